"""Wall time of one smoke sweep in one process and over local Ray clusters of 1, 2 and 4 workers.

Each run tunes the same operators into a new store (`flashkern tune OP... [--ray local:N]`), after one untimed run
that fills TileLang's disk cache, so that every run builds from it alike; runs of the paths alternate, `--repeats`
times. A sweep's wall time on Ray is Ray's start (a few seconds), each worker's imports (torch, flashkern) and the
builds and timings, which Ray spreads over the workers; workers time on one thread each, so where a machine has
fewer cores than workers they time side by side, and their figures are noisier.
Run: python benchmarks/ray_sweep.py [--workers 1,2,4] [--repeats 2] [OP ...]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SWEEP_OPTIONS = ("--preset", "smoke", "--max-configs", "3", "--budget", "0.1")


def sweep_seconds(ops: list[str], db: Path, extra: tuple[str, ...]) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "flashkern", "tune", *ops, *SWEEP_OPTIONS, "--db", str(db), *extra],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ops", nargs="*", default=["moe_route", "sinkhorn"], help="operators (default: moe_route "
                        "sinkhorn)")
    parser.add_argument("--workers", default="1,2,4", help="local Ray cluster sizes, comma-separated")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs of each path")
    args = parser.parse_args()
    paths = {"one process": ("--jobs", "1")}
    for n in args.workers.split(","):
        paths[f"Ray, {n} worker{'' if n == '1' else 's'}"] = ("--ray", f"local:{n}")
    times = {name: [] for name in paths}
    with tempfile.TemporaryDirectory() as tmp:
        sweep_seconds(args.ops, Path(tmp) / "warm.sqlite3", paths["one process"])
        for repeat in range(args.repeats):
            for i, (name, extra) in enumerate(paths.items()):
                times[name].append(sweep_seconds(args.ops, Path(tmp) / f"{repeat}-{i}.sqlite3", extra))
    print(f"smoke sweep of {' '.join(args.ops)} ({' '.join(SWEEP_OPTIONS)}), wall seconds over {args.repeats} runs")
    for name, seconds in times.items():
        print(f"  {name:18} median {statistics.median(seconds):6.1f}  [{min(seconds):.1f}, {max(seconds):.1f}]")


if __name__ == "__main__":
    main()
