"""mHC at the model's shapes: time per call, bytes moved per token, and the fraction of memory bandwidth.

mHC is memory bound (per token it reads n x D bf16 streams and writes a D-wide layer input or n x D
new streams; the GEMM has (2+n)n = 24 outputs), so the figure of merit is achieved bandwidth: the bytes
the operator must move (its cost model: inputs and outputs once) over the median time, against this
machine's copy bandwidth (a large torch copy, read + write, measured first).

Every kernel result is checked against the reference before it is timed (flashkern.bench). On a CPU
the kernels are correctness paths (TileLang's C, Triton's interpreter): they are timed only up to
--kernel-tokens tokens, the reference at every size.

Run: python benchmarks/mhc_bandwidth.py [--ops mhc_pre,mhc_post,mhc_post_pre] [--hidden 4096,5120,7168]
     [--tokens 1,128,1024,8192] [--kernel-tokens 16] [--backends triton,tilelang] [--budget 1]
"""

import argparse

import torch
from rich.console import Console
from rich.progress import track

from flashkern import device as devices
from flashkern.autotune.timing import measure
from flashkern.bench import bench
from flashkern.kernels.mhc import MhcProblem


def copy_bandwidth(device, megabytes: int = 512) -> float:
    """Bytes per second of a large device copy (each byte read once and written once)."""
    src = torch.empty(megabytes << 20, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    timing = measure(lambda: dst.copy_(src), device, budget=2.0)
    return 2 * src.numel() / timing.median


def problems(op_name: str, hidden: int, tokens: int) -> MhcProblem:
    """The model's form of each operator: the chain is V4.1's delayed pre with the fused RMSNorm."""
    chain = op_name == "mhc_post_pre"
    return MhcProblem(tokens, hidden, has_norm=chain, collapse="carried" if chain else "fresh")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", default="mhc_pre,mhc_post,mhc_post_pre")
    parser.add_argument("--hidden", default="4096,5120,7168")
    parser.add_argument("--tokens", default="1,128,1024,8192")
    parser.add_argument("--kernel-tokens", type=int, default=16, help="time the kernels up to this many tokens")
    parser.add_argument("--backends", default="triton,tilelang")
    parser.add_argument("--budget", type=float, default=1.0, help="seconds of timing per row")
    parser.add_argument("--device", default=None)
    args = parser.parse_args()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    peak = copy_bandwidth(device)
    print(f"{devices.info(device).describe()}: copy bandwidth {peak / 1e9:.1f} GB/s\n")
    print("| op | D | T | backend | time | bytes/token | GB/s | of copy bandwidth |")
    print("|---|---|---|---|---|---|---|---|")
    grid = [(op_name, int(d), int(t)) for op_name in args.ops.split(",") for d in args.hidden.split(",")
            for t in args.tokens.split(",")]
    for op_name, d, t in track(grid, description="mhc shapes", console=Console(stderr=True), transient=True):
        backends = args.backends.split(",") if t <= args.kernel_tokens else ()
        for row in bench([op_name], lambda op: (problems(op_name, d, t),), device, args.budget, backends):
            if row.timing is None:
                if row.status != "not asked for":
                    print(f"| {op_name} | {d} | {t} | {row.backend} | {row.status} | | | |", flush=True)
                continue
            print(f"| {op_name} | {d} | {t} | {row.backend} | {row.timing.median * 1e3:.3f} ms | "
                  f"{row.bytes / t / 1e3:.1f} KB | {row.gbps:.2f} | {row.gbps * 1e9 / peak:.1%} |", flush=True)


if __name__ == "__main__":
    main()
