"""Engram's host-table lookup on this machine: GB/s against the copy bandwidth, with and without transparent huge
pages, with and without prefetch overlapped with a stand-in compute step; and the model's H200 figures.

A table of --table-gb GB lives in host memory (kernels/engram/host.HostTable), written once; a batch of T tokens
reads T x 24 random rows of 264 bytes and writes bf16 [T, 24, 256]. Per backend (the reference's torch ops on
torch's threads; the TileLang C kernel on host.gather's threads), the median time of a lookup (checked against
the reference first), its rate in table bytes read (rows x 264) and in bytes moved (rows x (8 + 264 + 512)) over
the machine's copy bandwidth (a 512 MB copy, read + write); "records" gathers the rows' bytes alone (no decode). Then one decode-like step repeated: engram's hash and
lookup, and a compute step of about the lookup's length (a matmul standing in for the layers before Engram's),
run one after the other, or overlapped (host.engram_prefetch before the compute, wait after it).
The H200 rows come from the performance model (flashkern.model, device "h200": PCIe Gen5; "gh200": NVLink-C2C).

Both tables stay allocated and the rounds alternate them (on a shared machine, run-to-run drift is as large as the
effect): each row is the median of the rounds, with the lowest and highest round beside it.

Run: python benchmarks/engram_lookup.py [--table-gb 4] [--tokens 64,4096] [--backends reference,tilelang]
     [--budget 2] [--rounds 5] [--steps 15] [--json out.json]
"""

import argparse
import itertools
import json
import statistics
import time

import torch

from flashkern.autotune.timing import measure
from flashkern.kernels.engram import LookupProblem, host, make_table, model_params
from flashkern.kernels.engram.problem import V41_HEADS, V41_NGRAM
from flashkern.reference import engram as ref
from mhc_bandwidth import copy_bandwidth

LOOKUPS = (V41_NGRAM - 1) * V41_HEADS
MOVED = 8 + ref.ROW_BYTES + 2 * ref.ROW_VALUES  # a row id, a record read, bf16 values written
FILL_BLOCK = 64 << 20
BATCHES = 16  # row batches a timing cycles through
THREADS = torch.get_num_threads()  # the machine's: torch's intra-op threads and host.gather's workers


def filled_table(rows: int, huge_pages: bool) -> host.HostTable:
    """A HostTable of random records: a 64 MB block of them copied over the whole table (the rows a batch reads
    are random either way)."""
    table = host.HostTable(rows, huge_pages=huge_pages)
    block = make_table(min(rows, FILL_BLOCK // ref.ROW_BYTES), torch.Generator().manual_seed(0))
    for start in range(0, rows, block.shape[0]):
        piece = table.tensor[start: start + block.shape[0]]
        piece.copy_(block[: piece.shape[0]])
    return table


def lookup_rows(table: host.HostTable, tokens: int, backends: list[str], budget: float, peak: float) -> list[dict]:
    """Each backend's lookup, and "records": the rows' bytes gathered alone (torch.index_select into a buffer, no
    decode), the memory side on its own, where page size matters most."""
    batches = [torch.randint(0, table.tensor.shape[0], (tokens, LOOKUPS)) for _ in range(BATCHES)]
    turn = itertools.cycle(batches)  # a new batch each call: rows a call reads are not in the caches from the last
    rows = batches[0]
    expected = ref.engram_lookup(table.tensor, rows)
    records = torch.empty(rows.numel(), ref.ROW_BYTES, dtype=torch.uint8)
    calls = {"records": (lambda: torch.index_select(table.tensor, 0, next(turn).view(-1), out=records),
                         ref.ROW_BYTES + 8)}
    for backend in backends:
        out = host.gather(table.tensor, rows, backend=backend)
        assert torch.equal(out.view(torch.int16), expected.view(torch.int16)), f"{backend} differs from the reference"
        calls[backend] = (lambda backend=backend, out=out: host.gather(table.tensor, next(turn), out, backend=backend),
                          MOVED)
    found = []
    for name, (call, moved) in calls.items():
        seconds = measure(call, torch.device("cpu"), budget=budget, threads=THREADS).median
        found.append(dict(tokens=tokens, backend=name, huge_pages=table.huge_pages_state,
                          huge_page_gb=table.huge_page_bytes() / 1e9, us=seconds * 1e6,
                          table_gb_per_s=rows.numel() * ref.ROW_BYTES / seconds / 1e9,
                          moved_gb_per_s=rows.numel() * moved / seconds / 1e9,
                          of_copy=rows.numel() * moved / seconds / peak))
    return found


def compute_step(seconds: float):
    """A matmul loop of about `seconds` on this machine (the layers before Engram's)."""
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    start, runs = time.perf_counter(), 0
    while time.perf_counter() - start < 0.2:
        a @ b
        runs += 1
    repeat = max(1, round(seconds / ((time.perf_counter() - start) / runs)))
    return lambda: [a @ b for _ in range(repeat)]


def prefetch_rows(table: host.HostTable, tokens: int, backend: str, steps: int) -> dict:
    """Median step time, serial against overlapped: hash + lookup, and a compute step as long as they are."""
    params = model_params()
    hash_inputs = params.hash_inputs()
    gen = torch.Generator().manual_seed(1)
    token_ids = torch.randint(0, params.token_map.shape[0], (tokens,), generator=gen)
    seq_ids = torch.arange(tokens)
    out = torch.empty(tokens, LOOKUPS, ref.ROW_VALUES, dtype=torch.bfloat16)
    host.engram_prefetch(table.tensor, token_ids, seq_ids, hash_inputs, out, backend=backend).wait()  # compiled
    start = time.perf_counter()
    host.engram_prefetch(table.tensor, token_ids, seq_ids, hash_inputs, out, backend=backend).wait()
    compute = compute_step(time.perf_counter() - start)

    def serial():
        host.engram_prefetch(table.tensor, token_ids, seq_ids, hash_inputs, out, backend=backend).wait()
        compute()

    def overlapped():
        started = host.engram_prefetch(table.tensor, token_ids, seq_ids, hash_inputs, out, backend=backend)
        compute()
        started.wait()

    times = {}
    for name, step in (("serial", serial), ("overlapped", overlapped)):
        samples = []
        for _ in range(steps):
            begin = time.perf_counter()
            step()
            samples.append(time.perf_counter() - begin)
        times[name] = sorted(samples)[len(samples) // 2]
    return dict(tokens=tokens, backend=backend, huge_pages=table.huge_pages_state, serial_us=times["serial"] * 1e6,
                overlapped_us=times["overlapped"] * 1e6, speedup=times["serial"] / times["overlapped"])


def model_rows(tokens: list[int]) -> list[dict]:
    """The performance model's lookup on an H200 (PCIe Gen5 host link), a GH200 (NVLink-C2C) and in HBM."""
    from flashkern import model

    found = []
    for device in ("h200", "gh200"):
        for host_table in (False, True):
            problems = [("engram_lookup", LookupProblem(t, host=host_table)) for t in tokens]
            for row in model.evaluate_problems(problems, model.DEVICES[device], workers=1):
                if row.prediction is not None and row.default:
                    found.append(dict(device=device, host=host_table, tokens=row.problem.tokens, impl=row.impl,
                                      us=row.prediction.seconds * 1e6, bound=row.prediction.bound))
    return found


def grouped(found: list[dict]):
    """(tokens, backend, huge pages) -> the rows of every round, in first-seen order."""
    groups = {}
    for r in found:
        groups.setdefault((r["tokens"], r["backend"], r["huge_pages"]), []).append(r)
    return groups.items()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--table-gb", type=float, default=4.0)
    parser.add_argument("--tokens", default="64,4096")
    parser.add_argument("--backends", default="reference,tilelang")
    parser.add_argument("--budget", type=float, default=2.0, help="seconds of timing per row, over all rounds")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (the spread between them is shown)")
    parser.add_argument("--steps", type=int, default=15, help="decode-like steps per prefetch row")
    parser.add_argument("--no-model", action="store_true", help="skip the model's H200 rows")
    parser.add_argument("--json", default=None, help="write every row here too")
    args = parser.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    backends = args.backends.split(",")
    peak = copy_bandwidth(torch.device("cpu"))
    rows = int(args.table_gb * 1e9 // ref.ROW_BYTES)
    print(f"copy bandwidth {peak / 1e9:.1f} GB/s; table {rows:,} rows ({rows * ref.ROW_BYTES / 1e9:.1f} GB); "
          f"transparent huge pages: {host.transparent_huge_pages()}; {torch.get_num_threads()} threads\n")
    tables = {huge_pages: filled_table(rows, huge_pages) for huge_pages in (False, True)}
    lookups, prefetches = [], []
    try:  # rounds alternate the two tables: a shared machine's drift falls on both alike
        for _ in range(args.rounds):
            for t in tokens:
                for table in tables.values():
                    lookups += lookup_rows(table, t, backends, args.budget / args.rounds, peak)
                    prefetches += [prefetch_rows(table, t, backend, args.steps) for backend in backends]
    finally:
        for table in tables.values():
            table.close()
    print(f"Medians of {args.rounds} interleaved rounds [lowest, highest round]\n")
    print("| T | backend | huge pages | time | table GB/s | moved GB/s | of copy bandwidth |")
    print("|---|---|---|---|---|---|---|")
    for key, group in grouped(lookups):
        us = [r["us"] for r in group]
        r = group[0]
        scale = statistics.median(us) / r["us"]  # the rates at the median time
        print(f"| {key[0]} | {key[1]} | {key[2]} | {statistics.median(us):.0f} us [{min(us):.0f}, {max(us):.0f}] | "
              f"{r['table_gb_per_s'] / scale:.2f} | {r['moved_gb_per_s'] / scale:.2f} | {r['of_copy'] / scale:.1%} |")
    print("\n| T | backend | huge pages | serial step | with prefetch | speedup |\n|---|---|---|---|---|---|")
    for key, group in grouped(prefetches):
        speedups = [r["speedup"] for r in group]
        print(f"| {key[0]} | {key[1]} | {key[2]} | {statistics.median(r['serial_us'] for r in group):.0f} us | "
              f"{statistics.median(r['overlapped_us'] for r in group):.0f} us | {statistics.median(speedups):.2f}x "
              f"[{min(speedups):.2f}, {max(speedups):.2f}] |")
    predicted = [] if args.no_model else model_rows(tokens)
    if predicted:
        print("\n| device | table | T | impl | predicted (kernel + a launch) | bound |\n|---|---|---|---|---|---|")
        for r in predicted:
            print(f"| {r['device']} | {'host (pinned)' if r['host'] else 'HBM'} | {r['tokens']} | {r['impl']} | "
                  f"{r['us']:.1f} us | {r['bound']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(copy_gb_per_s=peak / 1e9, lookups=lookups, prefetch=prefetches, model=predicted), f,
                      indent=1)


if __name__ == "__main__":
    main()
