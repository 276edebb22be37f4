"""Overhead of backend="auto" (a tuned-table hit) over a direct call, per call, in microseconds.

The kernel itself is replaced by a stub returning preallocated outputs, so only the Python path
is timed: argument checks, backend resolution, table lookup. Batches of auto and direct calls
alternate, and the figure is the median of the paired differences (shared machines drift).
Run: python benchmarks/dispatch_overhead.py
"""

import os
import statistics
import tempfile
import timeit

from flashkern import device as devices
from flashkern import dispatch, registry
from flashkern.autotune import identity
from flashkern.autotune import store as st
from flashkern.kernels._tilelang import TileLangKernel
from flashkern.kernels.moe_route import V41_FLASH, RouteProblem


def per_call_us(fn, number=2000, repeat=15) -> float:
    return statistics.median(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6


def paired_difference_us(a, b, number=1000, pairs=41) -> tuple[float, float, float]:
    """Median, and the 25th/75th percentiles, of per-call time(a) - time(b) over alternating batches."""
    diffs = sorted((timeit.timeit(a, number=number) - timeit.timeit(b, number=number)) / number * 1e6
                   for _ in range(pairs))
    return diffs[pairs // 2], diffs[pairs // 4], diffs[3 * pairs // 4]


def main() -> None:
    op = registry.get("moe_route")
    problem = RouteProblem(tokens=16, routing=V41_FLASH)
    inputs = op.make_inputs(problem, "cpu")
    config = {"block_t": 2, "threads": 128}
    impl = op.implementation("tilelang")
    outputs = impl.run(problem, inputs, config)
    TileLangKernel.run = lambda self, p, i, c: outputs  # time the dispatch path, not the kernel

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "t.sqlite3")
        with st.Store(path) as store:
            store.decide(st.Decision("moe_route", problem.key, identity.dtypes(inputs), devices.info("cpu").key,
                                     identity.op_versions(op), repr(problem.specialization()), problem.sizes,
                                     "tilelang", st.canonical(config), 1e-4, "benchmark"))
        os.environ[st.ENV_VAR] = path
        dispatch.reload_tables()
        entry = op.entry
        auto = per_call_us(lambda: entry(**inputs))
        direct = per_call_us(lambda: entry(**inputs, backend="tilelang", config=config))
        bare = per_call_us(lambda: impl.run(problem, inputs, config))
        check = per_call_us(lambda: op.check(inputs))
        table = dispatch.table_for(devices.info("cpu"))
        lookup = per_call_us(lambda: table.lookup("moe_route", problem))
        paired, low, high = paired_difference_us(lambda: entry(**inputs),
                                                 lambda: entry(**inputs, backend="tilelang", config=config))
    print(f"per call (µs): auto (table hit) {auto:.2f} | direct backend+config {direct:.2f} | "
          f"bare kernel call {bare:.2f} | argument checks {check:.2f} | table lookup {lookup:.2f}")
    print(f"overhead of auto over a direct call (paired median): {paired:+.2f} µs (quartiles {low:+.2f} .. "
          f"{high:+.2f}); auto dispatch over the bare kernel call: {auto - bare:.2f} µs")


if __name__ == "__main__":
    main()
