"""Python cost of a flashkern call over the bare kernel launch, per operator, in microseconds per call.

For every operator at its first smoke problem, with the Triton implementation in its default config and the
kernel launches themselves stubbed out (so only Python runs), per call:
  bare       the implementation's own launch path: outputs allocated, launch arguments built (what a
             hand-written caller of the kernel would do);
  auto       flashkern.ops.<name>(...) with backend="auto" hitting a tuned-table entry for the shape;
  direct     flashkern.ops.<name>(..., backend="triton");
  custom op  torch.ops.flashkern.<name>(..., backend="triton"), through the torch dispatcher;
  checked    the auto call in checked mode (value checks read the index tensors);
and the overheads over bare: medians of paired differences between alternating batches (shared machines drift).
Run: python benchmarks/dispatch_overhead.py [--pairs N] [operator ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import timeit

import torch

from flashkern import checks, dispatch, library, registry
from flashkern import device as devices
from flashkern.autotune import identity
from flashkern.autotune import store as stores
from flashkern.kernels._triton import Launch

BACKEND = "triton"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU tensors run Triton's interpreter (stubbed out here)


def paired_us(a, b, number: int, pairs: int) -> float:
    """Median over alternating batches of per-call time(a) - time(b), in microseconds."""
    diffs = [(timeit.timeit(a, number=number) - timeit.timeit(b, number=number)) / number * 1e6 for _ in range(pairs)]
    return statistics.median(diffs)


def per_call_us(fn, number: int, repeat: int = 9) -> float:
    return statistics.median(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6


def tune_table(path: str, cases: dict) -> None:
    """A store whose decisions send every case's shape to the Triton default config, as a tuned table would."""
    with stores.Store(path) as store:
        for op, problem, inputs in cases.values():
            impl = op.implementation(BACKEND)
            store.decide(stores.Decision(op.name, problem.key, identity.dtypes(inputs), devices.info(DEVICE).key,
                                         identity.op_versions(op), repr(problem.specialization()), problem.sizes,
                                         BACKEND, stores.canonical(impl.default_config(problem)), 1e-5, "benchmark"))


def measure(op, problem, inputs: dict, number: int, pairs: int) -> dict:
    impl = op.implementation(BACKEND)
    config = impl.default_config(problem)
    prepared = dict(inputs)
    op.check(prepared)  # the kernel views (packed scales, fused caches) a bare caller would pass
    overload, args, kwargs = library.call_arguments(op.name, inputs)

    device = torch.device(DEVICE)

    def bare():
        impl.run(problem, prepared, config, op.outputs(problem, prepared, device))

    calls = {
        "auto": lambda: op.entry(**inputs),
        "direct": lambda: op.entry(**inputs, backend=BACKEND),
        "custom op": lambda: overload(*args, **kwargs, backend=BACKEND),
    }
    row = {"bare": per_call_us(bare, number)}
    for name, call in calls.items():
        call()
        row[name] = paired_us(call, bare, number, pairs)
    if op.check_values is not None:
        def checked():
            with checks.checked():
                op.entry(**inputs)

        row["checked"] = paired_us(checked, calls["auto"], number, pairs)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ops", nargs="*", help="operators (default: all)")
    parser.add_argument("--pairs", type=int, default=21, help="alternating batch pairs per figure")
    parser.add_argument("--number", type=int, default=500, help="calls per batch")
    args = parser.parse_args()
    torch.set_num_threads(1)
    names = args.ops or sorted(registry.operators())
    cases = {}
    for name in names:
        op = registry.get(name)
        problem = op.presets["smoke"][0]
        cases[name] = (op, problem, op.make_inputs(problem, DEVICE, 0))
    Launch.__call__ = lambda self: None  # time the Python path, not the (interpreted) kernel
    with tempfile.TemporaryDirectory() as tmp:
        os.environ[stores.ENV_VAR] = os.path.join(tmp, "table.sqlite3")
        tune_table(os.environ[stores.ENV_VAR], cases)
        dispatch.reload_tables()
        with checks.checked(False):
            rows = {name: measure(*case, args.number, args.pairs) for name, case in cases.items()}
    print(f"{'operator':18} {'bare':>7} | overhead over bare (us/call): {'auto':>6} {'direct':>7} {'custom op':>9} "
          f"| checked mode, extra: {'':>6}")
    for name, row in rows.items():
        checked = f"{row['checked']:+6.2f}" if "checked" in row else "     -"
        print(f"{name:18} {row['bare']:7.2f} | {'':29} {row['auto']:6.2f} {row['direct']:7.2f} {row['custom op']:9.2f} "
              f"| {'':20} {checked}")
    worst = max(max(row["auto"], row["direct"]) for row in rows.values())
    print(f"largest overhead of flashkern.ops over the bare launch: {worst:.2f} us "
          f"(custom op: {max(row['custom op'] for row in rows.values()):.2f} us)")


if __name__ == "__main__":
    main()
