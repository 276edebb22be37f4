"""Python cost of a flashkern call over the bare kernel launch, per operator, in microseconds per call.

For every operator at its first smoke problem, with the Triton implementation in its default config and the
kernel launches themselves stubbed out (so only Python runs), per call:
  bare       a minimal wrapper of the implementation taking the same arguments: outputs allocated, the kernel
             launched in its problem's default config (what a hand-written caller of the kernel would do);
  auto       flashkern.ops.<name>(...) with backend="auto" hitting a tuned-table entry for the shape;
  direct     flashkern.ops.<name>(..., backend="triton");
  custom op  torch.ops.flashkern.<name>(..., backend="triton"), through the torch dispatcher;
  dispatcher the torch dispatcher alone: an op with the same schema whose kernel returns at once (the part of the
             custom op's overhead that is torch's: boxing every argument to and from Python);
  ours       custom op less dispatcher: flashkern's part of the custom op's overhead;
  checked    the auto call in checked mode (value checks read the index tensors);
and the overheads over bare: differences of the fastest batch of each, the batches interleaved in rounds (on a
shared machine interference only adds time, so the minimum is the cost of the path itself). The machine's speed
at the time is printed too: the cost of reading one tensor's metadata (dtype, shape, strides, device) in Python.
Run: python benchmarks/dispatch_overhead.py [--rounds N] [operator ...]
"""

from __future__ import annotations

import argparse
import os
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


def fastest_us(calls: dict, number: int, rounds: int) -> dict:
    """Per call, in microseconds: the fastest of `rounds` batches of `number` calls, the calls interleaved."""
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(rounds):
        for name, fn in calls.items():
            best[name] = min(best[name], timeit.timeit(fn, number=number) / number * 1e6)
    return best


def metadata_read_us() -> float:
    """The machine's speed now: one tensor's (dtype, shape, strides, device) read in Python, in microseconds."""
    t = torch.zeros(4, 5)
    return min(timeit.repeat(lambda: (t.dtype, t.shape, t.stride(), t.device), number=100_000, repeat=5)) / 100_000 * 1e6


def tune_table(path: str, cases: dict) -> None:
    """A store whose decisions send every case's shape to the Triton default config, as a tuned table would."""
    with stores.Store(path) as store:
        for op, problem, inputs in cases.values():
            impl = op.implementation(BACKEND)
            store.decide(stores.Decision(op.name, problem.key, identity.dtypes(inputs), devices.info(DEVICE).key,
                                         identity.op_versions(op), repr(problem.specialization()), problem.sizes,
                                         BACKEND, stores.canonical(impl.default_config(problem)), 1e-5, "benchmark"))


_TWINS = torch.library.Library("flashkern_overhead", "DEF")


def dispatcher_twin(op, result):
    """torch.ops.flashkern_overhead.<name>: op's custom-op schema with a kernel that returns `result` at once."""
    _TWINS.define(op.name + library.schema(op.entry)[0])
    _TWINS.impl(op.name, lambda *args, **kwargs: result, "CUDA" if DEVICE == "cuda" else "CPU")
    return getattr(torch.ops.flashkern_overhead, op.name).default


def measure(op, problem, inputs: dict, number: int, rounds: int) -> dict:
    impl = op.implementation(BACKEND)
    config = impl.default_config(problem)
    prepared = dict(inputs)
    op.check(prepared)  # the kernel views (packed scales, fused caches) a bare caller would pass
    overload, args, kwargs = library.call_arguments(op.name, inputs)
    device = torch.device(DEVICE)
    views = {name: value for name, value in prepared.items() if value is not inputs.get(name)}

    def bare(**arguments):
        arguments.update(views)
        return impl.run(problem, arguments, config, op.outputs(problem, arguments, device))

    def checked():
        with checks.checked():
            op.entry(**inputs)

    calls = {
        "bare": lambda: bare(**inputs),
        "auto": lambda: op.entry(**inputs),
        "direct": lambda: op.entry(**inputs, backend=BACKEND),
        "custom op": lambda: overload(*args, **kwargs, backend=BACKEND),
    }
    twin = dispatcher_twin(op, overload(*args, **kwargs, backend=BACKEND))
    calls["dispatcher"] = lambda: twin(*args, **kwargs, backend=BACKEND)
    if op.check_values is not None:
        calls["checked"] = checked
    for call in calls.values():
        call()
    best = fastest_us(calls, number, rounds)
    row = {name: us - best["bare"] for name, us in best.items() if name not in ("bare", "dispatcher", "checked")}
    row["dispatcher"] = best["dispatcher"]
    row["bare"] = best["bare"]
    if "checked" in best:
        row["checked"] = best["checked"] - best["auto"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ops", nargs="*", help="operators (default: all)")
    parser.add_argument("--rounds", type=int, default=15, help="batches per call path, interleaved")
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
            rows = {name: measure(*case, args.number, args.rounds) for name, case in cases.items()}
    print(f"{'':18} {'':>7}   overhead over bare, us/call {'':28} checked mode")
    print(f"{'operator':18} {'bare':>7}   {'auto':>6} {'direct':>7} {'custom op':>10} {'dispatcher':>11} {'ours':>6}   "
          f"{'extra':>6}")
    for name, row in rows.items():
        checked = f"{row['checked']:+6.2f}" if "checked" in row else "     -"
        print(f"{name:18} {row['bare']:7.2f}   {row['auto']:6.2f} {row['direct']:7.2f} {row['custom op']:10.2f} "
              f"{row['dispatcher']:11.2f} {row['custom op'] - row['dispatcher']:6.2f}   {checked}")
    worst = max(max(row["auto"], row["direct"]) for row in rows.values())
    print(f"machine speed: {metadata_read_us():.2f} us per tensor metadata read (0.4 on a quiet hour)")
    ours = max(row["custom op"] - row["dispatcher"] for row in rows.values())
    print(f"largest overhead of flashkern.ops over the bare launch: {worst:.2f} us; custom op: "
          f"{max(row['custom op'] for row in rows.values()):.2f} us, of which not the dispatcher's: {ours:.2f} us")


if __name__ == "__main__":
    main()
