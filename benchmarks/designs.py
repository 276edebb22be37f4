"""Designs side by side: each backend's earlier or alternative design against its current default, at the v41-flash
shapes. Each config is checked against the reference before it is timed; on a CPU the interpreted Triton is checked
only (--time-interpreted to time it).

  sparse_decode_attention: 16-head groups (every record gathered and decoded by each group of a token) against the
      default (a token's 64 heads in one CTA where the backend's builds allow it), T = 1 to 4096; and, for the window
      by position at the token counts above the window, TileLang's shared window (each token's own window record
      decoded once for the call, the keys tokens of the call hold read as bf16 rows: docs/operators.md 8.4) against
      its default (each token decodes its window);
  sparse_mqa_logits: Triton's earlier form (every candidate's score kept, one top-k over the row's 16384) against
      spans that keep their best top_k; TileLang's 8-tile spans against its default (a tile per span);
  mhc_pre, mhc_post_pre: the epilogue run by each token tile's last split (one launch) against the default (its own
      launch, a program per token, at small batches; the same where the default keeps the last split);
  topk_indices, candidate_blocks: one CTA a row (chunks 1) against the default (long rows split over CTAs);
  moe_route_gate: Triton's earlier form (one launch, a program per 16-row token tile with every expert, mma.sync)
      against the default (at decode a split GEMV whose last program routes; at prefill a wgmma GEMM into partials,
      then the routing launch); TileLang's stages with 16-row tiles and no D split against its default.

Run: python benchmarks/designs.py [--ops sparse_decode_attention,sparse_mqa_logits,mhc_pre,mhc_post_pre,...]
     [--tokens 1,8,64,4096]
     [--budget 0.2] [--json out.json]
"""

import argparse
import json

import torch

from flashkern import device as devices
from flashkern import registry
from flashkern.autotune.timing import measure
from flashkern.kernels.kv_cache import V41_HEADS, V41_TOPK, V41_WINDOW, AttentionProblem

def _last_split_epilogue(default: dict) -> dict:
    return {**default, "epilogue": "last_split"}


def _one_cta_a_row(default: dict) -> dict:
    return {**default, "chunks": 1}


def _one_program_a_tile(default: dict) -> dict:
    return {**default, "block_t": 16, "block_d": 32, "num_warps": 8, "num_stages": 3, "splits": 1, "epi_t": 16,
            "separate_route": False}


def _sixteen_head_groups(default: dict) -> dict:
    return {**default, "block_h": 16, "threads": 128}


def _unsplit_16_row_tiles(default: dict) -> dict:
    return {**default, "block_t": 16, "splits": 1, "threads": 128, "num_stages": 2}


def _shared_window(default: dict) -> dict:
    return {**default, "shared_window": 1}


DESIGNS = {  # operator -> backend -> (design name, config or default -> config): timed beside the default
    "sparse_decode_attention": {
        "triton": ("16-head groups", {"block_h": 16, "block_n": 32, "block_d": 128, "max_splits": 16, "num_warps": 8,
                                      "num_stages": 2}),
        "tilelang": ("16-head groups", _sixteen_head_groups),
    },
    "sparse_decode_attention by position": {"tilelang": ("window decoded once per call", _shared_window)},
    "sparse_mqa_logits": {
        "triton": ("every candidate kept", {"block_n": 256, "tiles": 1, "num_warps": 8}),
        "tilelang": ("8-tile spans", {"block_n": 128, "tiles": 8, "threads": 128}),
    },
    **{op_name: dict.fromkeys(("triton", "tilelang"), ("epilogue by the last split", _last_split_epilogue))
       for op_name in ("mhc_pre", "mhc_post_pre")},
    **{op_name: dict.fromkeys(("triton", "tilelang"), ("one CTA a row", _one_cta_a_row))
       for op_name in ("topk_indices", "candidate_blocks")},
    "moe_route_gate": {"triton": ("a program per token tile", _one_program_a_tile),
                       "tilelang": ("16-row tiles, D not split", _unsplit_16_row_tiles)},
}


def problems(design_key: str, tokens: list[int]) -> list:
    if design_key == "sparse_decode_attention":
        return [AttentionProblem(t, V41_TOPK, V41_WINDOW, V41_HEADS, swa=True, sink=True) for t in tokens]
    if design_key == "sparse_decode_attention by position":  # prefill chunks: more tokens than the window
        return [AttentionProblem(t, V41_TOPK, V41_WINDOW, V41_HEADS, swa=True, sink=True, window_by_position=True)
                for t in tokens if t > V41_WINDOW]
    return list(registry.get(design_key).presets["v41-flash"])


def rows(design_keys, tokens, budget: float, device: torch.device, time_interpreted: bool):
    info = devices.info(device)
    for design_key in design_keys:
        op_name = design_key.split()[0]
        op = registry.get(op_name)
        for problem in problems(design_key, tokens):
            inputs = op.make_inputs(problem, device, seed=0)
            expected = op.reference(**inputs)
            for impl in op.implementations:
                if impl.name not in DESIGNS[design_key]:
                    continue
                reason = impl.unavailable(info)
                default = impl.default_config(problem)
                design, alternative = DESIGNS[design_key][impl.name]
                alternative = alternative(default) if callable(alternative) else alternative
                for design, config in ((design, alternative), ("default", default)):
                    row = dict(op=op_name, problem=problem.key, backend=impl.name, design=design, config=config)
                    if reason:
                        yield dict(row, status=f"unavailable: {reason}")
                        continue
                    try:
                        op.compare(inputs, expected, op.result_of(dict(inputs), backend=impl.name, config=config))
                    except AssertionError as exc:
                        yield dict(row, status=f"MISMATCH: {str(exc).splitlines()[0]}")
                        continue
                    if impl.name == "triton" and device.type == "cpu" and not time_interpreted:
                        yield dict(row, status="checked")
                        continue
                    out = op.empty_outputs(problem, inputs)
                    timing = measure(lambda: impl.run(problem, inputs, config, out), device, budget=budget)
                    yield dict(row, status="ok", median_s=timing.median, iqr_s=timing.iqr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", default=",".join(DESIGNS), help="comma-separated DESIGNS keys (operators)")
    parser.add_argument("--tokens", default="1,8,64,4096", help="sparse_decode_attention's token counts")
    parser.add_argument("--budget", type=float, default=0.2, help="seconds of timing per config")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--time-interpreted", action="store_true", help="time Triton's interpreter on a CPU too")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    device = torch.device(args.device)
    print(f"{devices.info(device).describe()}\n\n| operator | problem | backend | design | median | IQR | status |\n"
          "|---|---|---|---|---:|---:|---|")
    found = []
    for row in rows(args.ops.split(","), [int(t) for t in args.tokens.split(",")], args.budget, device,
                    args.time_interpreted):
        found.append(row)
        timed = (f"{row['median_s'] * 1e6:.1f} us | {row['iqr_s'] * 1e6:.1f} us" if "median_s" in row else " | ")
        print(f"| {row['op']} | {row['problem']} | {row['backend']} | {row['design']} | {timed} | {row['status']} |",
              flush=True)
        if args.json:  # after every row: a run cut short by a time limit keeps what it measured
            with open(args.json, "w") as f:
                json.dump(found, f, indent=1)


if __name__ == "__main__":
    main()
