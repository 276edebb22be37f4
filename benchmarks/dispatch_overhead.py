"""Overhead of backend="auto" (a tuned-table hit) over a direct call, per call, in microseconds.

The kernel itself is replaced by a stub returning preallocated outputs, so only the Python path
is timed: argument checks, backend resolution, table lookup. Run: python benchmarks/dispatch_overhead.py
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
    print(f"per call (µs): auto (table hit) {auto:.2f} | direct backend+config {direct:.2f} | "
          f"bare kernel call {bare:.2f} | argument checks {check:.2f} | table lookup {lookup:.2f}")
    print(f"overhead of auto over a direct call: {auto - direct:+.2f} µs; auto dispatch over the bare kernel "
          f"call: {auto - bare:.2f} µs")


if __name__ == "__main__":
    main()
