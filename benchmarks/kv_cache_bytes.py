"""The FP4 attention path in bytes and time: what the cache stores per token, what a decoded token reads, time
per token here, and the performance model's H200 time.

1. Bytes stored per token: the model keeps about 2.5 compressed records per token (one per 4 tokens on the
   compressed layers, one per token on the others: --records-per-token), each a 512-value latent plus the
   indexer's 68-byte key (128 e2m1 values + 4 ue8m0 scales): FP4 records (288 B) against MXFP8 ones (528 B).
2. Bytes read per decoded token by sparse_decode_attention: topk records of the global cache + W records of
   the window cache (its cost model's record bytes), FP4 + MXFP8 (the model) against MXFP8 in both caches.
3. Time per token on this machine at the v41-flash decode shapes (flashkern.bench: each kernel checked
   against the reference first; on a CPU the kernels are correctness paths, timed up to --kernel-tokens).
4. The H200 prediction of the saved model (docs/model-h200.json, `flashkern model`): time per call and per
   token, and its roofline fraction, for each implementation's default config.

Run: python benchmarks/kv_cache_bytes.py [--tokens 1,8,64] [--kernel-tokens 1] [--budget 0.5]
"""

import argparse

import torch
from rich.console import Console
from rich.progress import track

from flashkern import device as devices
from flashkern import model, registry
from flashkern.bench import bench
from flashkern.kernels.kv_cache import V41_HEADS, V41_TOPK, V41_WINDOW, AttentionProblem
from flashkern.reference.kv_cache import FORMATS

INDEXER_KEY_BYTES = 128 // 2 + 128 // 32  # the indexer's MXFP4 key of 128 values: 64 B of codes + 4 scale bytes


def stored_per_token(records_per_token: float) -> None:
    print("| cache record | record | + indexer key | per token |")
    print("|---|---|---|---|")
    for name in ("fp4", "mxfp8"):
        record = FORMATS[name].bytes
        print(f"| {name} | {record} B | {record + INDEXER_KEY_BYTES} B | "
              f"{records_per_token * (record + INDEXER_KEY_BYTES):.0f} B |")
    print()


def read_per_token() -> None:
    op = registry.get("sparse_decode_attention")
    print("| caches (top-k / window) | top-k records | window records | read per token |")
    print("|---|---|---|---|")
    reads = {}
    for kv_format, swa_format in (("fp4", "mxfp8"), ("mxfp8", "mxfp8")):
        problem = AttentionProblem(1, V41_TOPK, V41_WINDOW, V41_HEADS, kv_format, swa_format, swa=True, sink=True)
        records = V41_TOPK * FORMATS[kv_format].bytes + V41_WINDOW * FORMATS[swa_format].bytes
        reads[kv_format] = records
        print(f"| {kv_format} / {swa_format} | {V41_TOPK} x {FORMATS[kv_format].bytes} B | "
              f"{V41_WINDOW} x {FORMATS[swa_format].bytes} B | {records / 1e3:.0f} KB "
              f"(all inputs and outputs: {op.cost(problem).bytes / 1e3:.0f} KB) |")
    print(f"\nFP4 top-k records: {1 - reads['fp4'] / reads['mxfp8']:.0%} fewer bytes read per decoded token.\n")


def time_per_token(tokens: list[int], kernel_tokens: int, budget: float, device) -> None:
    print(f"{devices.info(device).describe()}\n")
    print("| T | backend | time per call | per token | status |")
    print("|---|---|---|---|---|")
    for t in track(tokens, description="attention shapes", console=Console(stderr=True), transient=True):
        problem = AttentionProblem(t, V41_TOPK, V41_WINDOW, V41_HEADS, swa=True, sink=True)
        backends = None if t <= kernel_tokens else ()
        for row in bench(["sparse_decode_attention"], lambda op: (problem,), device, budget, backends):
            if row.timing is None:
                print(f"| {t} | {row.backend} | | | {row.status} |", flush=True)
                continue
            print(f"| {t} | {row.backend} | {row.timing.median * 1e3:.2f} ms | {row.timing.median / t * 1e3:.2f} ms | "
                  f"{row.status} |", flush=True)
    print()


def predicted() -> None:
    records = {key: r for key, r in model.current_records().items() if key[0] == "sparse_decode_attention"}
    if not records:
        print("No current saved model of sparse_decode_attention: run `flashkern model sparse_decode_attention "
              "--preset v41-flash --device h200`.")
        return
    print("| implementation | shape | H200 model | per token | roofline fraction | bound |")
    print("|---|---|---|---|---|---|")
    for (_, impl, shape), r in sorted(records.items()):
        tokens = int(shape.split()[0].split("=")[1])
        limiter = max(r["stages"], key=lambda s: s["seconds"])["limiter"]
        print(f"| {impl} | {shape} | {r['model_seconds'] * 1e6:.1f} us | {r['model_seconds'] / tokens * 1e6:.2f} us | "
              f"{r['roofline_fraction']:.0%} | {limiter} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="1,8,64")
    parser.add_argument("--kernel-tokens", type=int, default=1, help="time the kernels up to this many tokens")
    parser.add_argument("--records-per-token", type=float, default=2.5)
    parser.add_argument("--budget", type=float, default=0.5, help="seconds of timing per row")
    parser.add_argument("--device", default=None)
    args = parser.parse_args()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    stored_per_token(args.records_per_token)
    read_per_token()
    time_per_token([int(t) for t in args.tokens.split(",")], args.kernel_tokens, args.budget, device)
    predicted()


if __name__ == "__main__":
    main()
