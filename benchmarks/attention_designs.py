"""sparse_decode_attention's designs side by side: each backend's earlier design (16-head groups: every record
gathered and decoded by each group of a token) against its current default (a token's 64 heads in one CTA where the
backend's builds allow it), at the v41-flash shapes. Each config is checked against the reference before it is
timed; on a CPU the interpreted Triton is checked only (--time-interpreted to time it).

Run: python benchmarks/attention_designs.py [--tokens 1,8,64,4096] [--budget 0.2] [--json out.json]
"""

import argparse
import json

import torch

from flashkern import device as devices
from flashkern import registry
from flashkern.autotune.timing import measure
from flashkern.kernels.kv_cache import V41_HEADS, V41_TOPK, V41_WINDOW, AttentionProblem

EARLIER = {  # the GPU defaults before 64-head programs
    "triton": {"block_h": 16, "block_n": 32, "block_d": 128, "max_splits": 16, "num_warps": 8, "num_stages": 2},
    "tilelang": {"block_h": 16, "block_n": 64, "max_splits": 16, "threads": 128},
}


def rows(tokens, budget: float, device: torch.device, time_interpreted: bool):
    op = registry.get("sparse_decode_attention")
    info = devices.info(device)
    for t in tokens:
        problem = AttentionProblem(t, V41_TOPK, V41_WINDOW, V41_HEADS, swa=True, sink=True)
        inputs = op.make_inputs(problem, device, seed=0)
        expected = op.reference(**inputs)
        for impl in op.implementations:
            reason = impl.unavailable(info)
            for design, config in (("16-head groups", EARLIER[impl.name]), ("default", impl.default_config(problem))):
                row = dict(tokens=t, backend=impl.name, design=design, config=config)
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
    parser.add_argument("--tokens", default="1,8,64,4096", help="comma-separated token counts")
    parser.add_argument("--budget", type=float, default=0.2, help="seconds of timing per config")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--time-interpreted", action="store_true", help="time Triton's interpreter on a CPU too")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    device = torch.device(args.device)
    print(f"{devices.info(device).describe()}\n\n| T | backend | design | median | IQR | status |\n|---|---|---|---:|---:|---|")
    found = []
    for row in rows([int(t) for t in args.tokens.split(",")], args.budget, device, args.time_interpreted):
        found.append(row)
        timed = "median_s" in row
        print(f"| {row['tokens']} | {row['backend']} | {row['design']} | "
              f"{row['median_s'] * 1e6:.1f} us | {row['iqr_s'] * 1e6:.1f} us | {row['status']} |" if timed else
              f"| {row['tokens']} | {row['backend']} | {row['design']} | | | {row['status']} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(found, f, indent=1)


if __name__ == "__main__":
    main()
