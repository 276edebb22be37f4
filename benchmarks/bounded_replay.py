"""Bounded replay against full recompute: the kernel work of one attention layer that makes a request with a
prefix-cache hit of H tokens ready for its first new token (docs/operators.md section 8.4).

flashkern.replay.plan_replay(H, 1) recomputes H + 1 tokens without replay and 129 with it, in prefill chunks of
8192. Per chunk of r tokens whose last position is p (compressed positions one a token, as the presets have them):
  kv_cache_insert          r window records (MXFP8), and compressed records (FP4) for the tokens past the hit only
                           (replayed rows keep theirs);
  mqa_logits               r indexer rows over the p + 1 compressed positions (causal ends);
  topk_indices             the top-512 of each row;
  sparse_decode_attention  r tokens over their top-512 and their window by position (replayed rows bounded).
Measured here: each kernel on this machine (--backend, default tilelang: its C target) at reduced width (indexer
4 heads x 64, attention 4 heads, --rows query rows at the chunk's end), scaled to the chunk's rows (each kernel's
work is linear in its rows; the chunk's earlier rows see fewer keys, so full recompute is overestimated by at most
half a chunk's scoring). Predicted: `flashkern model` (H200) at the model's width (indexer 32 x 128, 64 heads) on
pieces of at most 1024 rows (enough CTAs to fill the GPU), scaled the same way. vLLM's reported reductions of time to
first token (30%; about 70% at 100K tokens) time the whole model and its scheduler, not one layer's kernels.

Run: python benchmarks/bounded_replay.py [--hits 4096,16384,65536,102400] [--rows 16] [--budget 0.5]
     [--backend B] [--full-width] [--no-model] [--impl tilelang] [--json out.json]
(on a GPU: --backend triton --full-width --rows 1024 --no-model, as scripts/gpu_check.sh runs it). On the 2-core dev
VM the measured part takes about 4 minutes and the H200 model about 30 (its sm_90a builds; --no-model skips it).
"""

import argparse
import json
from functools import cache

import torch
from rich.console import Console
from rich.progress import track

from flashkern import registry
from flashkern import model as perf
from flashkern.autotune.timing import measure
from flashkern.kernels.indexer import Indexer, LogitsProblem, TopkProblem, causal_ends
from flashkern.kernels.kv_cache import V41_HEADS, V41_TOPK, V41_WINDOW, AttentionProblem, CodecProblem
from flashkern.replay import plan_replay

CHUNK = 8192  # prefill chunk (tokens)
MODEL_PIECE = 1024  # rows the H200 prediction models at once
REDUCED = dict(indexer=Indexer(4, 64), heads=4)
FULL = dict(indexer=Indexer(), heads=V41_HEADS)


def chunks(hit: int, replay: bool) -> list[tuple[int, int, int]]:
    """(rows, last position, rows past the hit) of each prefill chunk the plan runs for one new token."""
    plan = plan_replay(hit, 1, V41_WINDOW, enabled=replay)
    r = plan.recompute
    return [(min(CHUNK, r.stop - s), min(s + CHUNK, r.stop) - 1, max(min(s + CHUNK, r.stop) - max(s, hit), 0))
            for s in range(r.start, r.stop, CHUNK)]


def kernels(rows: int, last: int, new: int, width: dict) -> list[tuple[str, object]]:
    """(operator, problem) of each kernel a chunk runs."""
    return [("kv_cache_insert", CodecProblem(rows, "mxfp8")),
            *([("kv_cache_insert", CodecProblem(new, "fp4"))] if new else []),
            ("mqa_logits", LogitsProblem(rows, last + 1, width["indexer"])),
            ("topk_indices", TopkProblem(rows, last + 1, k=V41_TOPK)),
            ("sparse_decode_attention", AttentionProblem(rows, V41_TOPK, V41_WINDOW, width["heads"], swa=True,
                                                         sink=True, window_by_position=True))]


def pieces(problem, limit: int) -> tuple[object, float]:
    """The problem at most `limit` rows (its first size) and the factor that scales its time back."""
    rows = problem.sizes[0]
    if rows <= limit:
        return problem, 1.0
    return problem.with_sizes((limit, *problem.sizes[1:])), rows / limit


DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _inputs(name: str, problem) -> dict:
    """The operator's preset inputs, with causal ends for the indexer rows at the end of the context."""
    inputs = registry.get(name).make_inputs(problem, DEVICE, 0)
    if name == "mqa_logits":
        inputs["ks"] = torch.zeros(problem.rows, dtype=torch.int32, device=DEVICE)
        inputs["ke"] = causal_ends(problem.rows, problem.keys).to(DEVICE)
    elif name == "topk_indices":
        inputs["ends"] = causal_ends(problem.rows, problem.positions).to(DEVICE)
    return inputs


@cache
def measured_seconds(name: str, problem, backend: str, budget: float) -> float:
    op = registry.get(name)
    inputs = _inputs(name, problem)
    fresh = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    op.compare(inputs, op.reference(**fresh), op.result_of(inputs, backend=backend))
    return measure(lambda: op.entry(**inputs, backend=backend), DEVICE, budget=budget).median


@cache
def predicted_seconds(name: str, problem, impl: str) -> float:
    (row,) = [r for r in perf.evaluate_problems([(name, problem)], perf.DEVICES["h200"], workers=1)
              if r.impl == impl and r.default]
    if row.prediction is None:
        raise RuntimeError(f"{name} {problem.key}: {row.error}")
    return row.prediction.kernel_seconds


def layer_seconds(hit: int, replay: bool, timed) -> dict[str, float]:
    """Seconds per operator for one layer's chunks; timed(name, problem) -> seconds of that problem."""
    total: dict[str, float] = {}
    for rows, last, new in chunks(hit, replay):
        for name, problem in kernels(rows, last, new, timed.width):
            total[name] = total.get(name, 0.0) + timed(name, problem)
    return total


class Timed:
    """timed(name, problem): measured here, or predicted, scaled from pieces of at most `limit` rows."""

    def __init__(self, width: dict, limit: int, seconds):
        self.width, self.limit, self.seconds = width, limit, seconds

    def __call__(self, name: str, problem) -> float:
        piece, factor = pieces(problem, self.limit)
        return self.seconds(name, piece) * factor


def _time(seconds: float) -> str:
    return f"{seconds:.2f} s" if seconds >= 1 else f"{seconds * 1e3:.3g} ms"


def table(title: str, hits, timed) -> list[dict]:
    rows = []
    for hit in track(hits, description=title, console=Console(stderr=True), transient=True):
        full, bounded = layer_seconds(hit, False, timed), layer_seconds(hit, True, timed)
        rows.append(dict(hit=hit, full=full, bounded=bounded, reduction=1 - sum(bounded.values()) / sum(full.values())))
    print(f"\n{title}\n")
    print("| hit H | full recompute | of it: scoring + top-k | bounded replay | of it: scoring + top-k "
          "| kernel work cut | vLLM TTFT cut (reported) |")
    print("|---:|---:|---:|---:|---:|---:|---|")
    select = lambda t: t.get("mqa_logits", 0) + t.get("topk_indices", 0)  # noqa: E731  (the indexer's share)
    for r in rows:
        print(f"| {r['hit']} | {_time(sum(r['full'].values()))} | {_time(select(r['full']))} "
              f"| {_time(sum(r['bounded'].values()))} | {_time(select(r['bounded']))} "
              f"| {r['reduction']:.1%} | {'about 70%' if r['hit'] >= 100_000 else '30%'} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hits", default="4096,16384,65536,102400")
    parser.add_argument("--rows", type=int, default=16, help="rows each kernel is measured at here")
    parser.add_argument("--backend", default="tilelang" if DEVICE.type == "cpu" else "triton")
    parser.add_argument("--full-width", action="store_true", help="measure at the model's width (on a GPU)")
    parser.add_argument("--budget", type=float, default=0.5, help="seconds of timing per measurement")
    parser.add_argument("--impl", default="tilelang", help="the implementation the H200 prediction models")
    parser.add_argument("--no-model", action="store_true", help="skip the H200 prediction")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    args = parser.parse_args()
    hits = [int(h) for h in args.hits.split(",")]
    width = FULL if args.full_width else REDUCED
    here = Timed(width, args.rows, lambda name, p: measured_seconds(name, p, args.backend, args.budget))
    results = {"measured": table(f"Measured on {DEVICE.type} ({args.backend}, {'full' if args.full_width else 'reduced'} "
                                 f"width, {args.rows}-row pieces)", hits, here)}
    if not args.no_model:
        h200 = Timed(FULL, MODEL_PIECE, lambda name, p: predicted_seconds(name, p, args.impl))
        results["h200"] = table(f"H200, flashkern model ({args.impl}, the model's width)", hits, h200)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
