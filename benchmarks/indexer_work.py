"""Dense against two-level sparse indexer scoring, per context length: work and time.

Per layer that selects sparse-attention positions, for query rows at the end of a context of N:
  dense:  mqa_logits over every visible position, then topk_indices (k = 512);
  sparse: sparse_mqa_logits: scoring only inside the 2048 candidate blocks of 8 positions
          (16K positions) and top-512 over them.
The candidate blocks come once per step from the candidate layer (dense logits, then
candidate_blocks); that cost is shown on its own line. Work = scored (row, position) pairs;
FLOPs = 2 * pairs * H * D. Every kernel result is checked against the reference first.

Run: python benchmarks/indexer_work.py [--contexts 8192,65536,524288] [--rows 1]
     [--backends reference,tilelang] [--budget 2] [--json out.json]
"""

import argparse
import json

import torch
from rich.console import Console
from rich.progress import track

from flashkern import registry
from flashkern.autotune.timing import measure
from flashkern.kernels.indexer import LogitsProblem, causal_ends

TOP_K, N_BLOCKS, BLOCK = 512, 2048, 8


def run(backend: str, op_name: str, inputs: dict):
    op = registry.get(op_name)
    return op.entry(**inputs, backend=backend)


def checked(backend: str, op_name: str, inputs: dict):
    """The backend's result, after comparing it with the reference's."""
    op = registry.get(op_name)
    expected = op.reference(**inputs)
    if backend == "reference":
        return expected
    actual = run(backend, op_name, inputs)
    op.compare(inputs, expected, actual)
    return actual


def context_row(keys: int, rows: int, backends, budget: float, device) -> list[dict]:
    logits_op = registry.get("mqa_logits")
    inputs = logits_op.make_inputs(LogitsProblem(rows, keys), device, seed=0)
    ke = causal_ends(rows, keys).to(device)
    heads, dim = inputs["q"].shape[1:]
    dense_logits = logits_op.reference(**inputs)
    blocks = registry.get("candidate_blocks").reference(dense_logits, ke, N_BLOCKS, BLOCK)
    scoring = {name: value for name, value in inputs.items() if name != "logits_dtype"}
    sparse_inputs = {**scoring, "blocks": blocks, "top_k": TOP_K, "block": BLOCK}
    topk_inputs = dict(logits=dense_logits, ends=ke, k=TOP_K, starts=None, sorted=False)
    candidate_inputs = dict(logits=dense_logits, row_end=ke, n_blocks=N_BLOCKS, block=BLOCK)

    dense_pairs = int((inputs["ke"] - inputs["ks"]).sum())
    positions = (blocks[:, :, None] * BLOCK + torch.arange(BLOCK, device=device)).flatten(1)
    sparse_pairs = int(((blocks.repeat_interleave(BLOCK, dim=1) >= 0) & (positions < ke[:, None])).sum())
    out = []
    for backend in backends:
        checked(backend, "mqa_logits", inputs)
        checked(backend, "topk_indices", topk_inputs)
        checked(backend, "candidate_blocks", candidate_inputs)
        checked(backend, "sparse_mqa_logits", sparse_inputs)
        t_logits = measure(lambda: run(backend, "mqa_logits", inputs), device, budget=budget).median
        t_topk = measure(lambda: run(backend, "topk_indices", topk_inputs), device, budget=budget).median
        t_blocks = measure(lambda: run(backend, "candidate_blocks", candidate_inputs), device, budget=budget).median
        t_sparse = measure(lambda: run(backend, "sparse_mqa_logits", sparse_inputs), device, budget=budget).median
        out.append(dict(context=keys, rows=rows, backend=backend, dense_pairs=dense_pairs, sparse_pairs=sparse_pairs,
                        work_ratio=dense_pairs / max(sparse_pairs, 1),
                        dense_s=t_logits + t_topk, sparse_s=t_sparse, time_ratio=(t_logits + t_topk) / t_sparse,
                        candidate_layer_s=t_logits + t_blocks,
                        dense_gflops=2 * dense_pairs * heads * dim / t_logits / 1e9))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="8192,65536,524288")
    parser.add_argument("--rows", type=int, default=1, help="query rows at the end of the context (1 = decode)")
    parser.add_argument("--backends", default="reference,tilelang")
    parser.add_argument("--budget", type=float, default=2.0, help="seconds of timing per measurement")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    contexts = track(args.contexts.split(","), description="contexts", console=Console(stderr=True), transient=True)
    rows = [r for n in contexts for r in context_row(int(n), args.rows, args.backends.split(","), args.budget, device)]
    print("| context | backend | dense pairs | sparse pairs | work ratio | dense (logits + top-k) | sparse | time ratio "
          "| candidate layer | dense GFLOP/s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['context']} | {r['backend']} | {r['dense_pairs']} | {r['sparse_pairs']} | {r['work_ratio']:.2f}x "
              f"| {r['dense_s'] * 1e3:.1f} ms | {r['sparse_s'] * 1e3:.1f} ms | {r['time_ratio']:.2f}x "
              f"| {r['candidate_layer_s'] * 1e3:.1f} ms | {r['dense_gflops']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
