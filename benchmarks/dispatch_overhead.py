"""Host cost of a flashkern call over the bare kernel launch, per operator and call path, in microseconds per call.

For every operator at its first smoke problem, with the Triton implementation in its default config and the
kernel launches themselves stubbed out (so only Python runs), per call:
  bare       a minimal wrapper of the implementation taking the same arguments: outputs allocated, the kernel
             launched in its problem's default config (what a hand-written caller of the kernel would do);
  direct     flashkern.ops.<name>(..., backend="triton");
  auto       flashkern.ops.<name>(...) with backend="auto" hitting a tuned-table entry for the shape;
  custom op  torch.ops.flashkern.<name>(..., backend="triton"), through the torch dispatcher;
  checked    the auto call in checked mode (value checks read the index tensors), for operators that have them;
  dispatcher the torch dispatcher alone: an op with the same schema whose kernel returns at once (the part of the
             custom op's cost that is torch's: boxing every argument to and from Python);
  ours       the custom op less the dispatcher alone and less bare: flashkern's own part of the custom op's
             overhead (to set beside direct's).

How it holds on a shared machine: every path runs `--number` calls a batch, the batches interleaved in `--rounds`
rounds (so a slow spell hits every path alike), and a path's overhead is taken round by round (its batch less the
bare batch of the same round); printed: the median over rounds and, in brackets, the spread (25th-75th
percentile). Where the kernel lets a process count its own retired instructions (perf_event_open; not in most
VMs), each path's instructions per call are printed too: a figure no neighbour changes.
Run: python benchmarks/dispatch_overhead.py [--rounds N] [--number N] [--json FILE] [operator ...]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import tempfile
import time

import torch

from flashkern import checks, dispatch, library, registry
from flashkern import device as devices
from flashkern.autotune import identity
from flashkern.autotune import store as stores
from flashkern.kernels._triton import Launch

BACKEND = "triton"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU tensors run Triton's interpreter (stubbed out here)
PATHS = ("direct", "auto", "custom op", "checked", "dispatcher")


class InstructionCounter:
    """This thread's retired user-space instructions (Linux perf_event_open), or unavailable (`why` says why)."""

    _PERF_TYPE_HARDWARE, _INSTRUCTIONS = 0, 1
    _DISABLED, _EXCLUDE_KERNEL, _EXCLUDE_HV = 1 << 0, 1 << 5, 1 << 6
    _ENABLE, _DISABLE, _RESET = 0x2400, 0x2401, 0x2403  # PERF_EVENT_IOC_*
    _SYSCALL = {"x86_64": 298, "aarch64": 241}

    def __init__(self):
        self.fd, self.why = -1, None
        attr = (ctypes.c_uint64 * 16)()  # struct perf_event_attr, version 5 (112 bytes), zeroed
        attr_bytes = ctypes.cast(attr, ctypes.POINTER(ctypes.c_uint32))
        attr_bytes[0], attr_bytes[1] = self._PERF_TYPE_HARDWARE, 112  # type, size
        attr[1] = self._INSTRUCTIONS  # config
        attr[5] = self._DISABLED | self._EXCLUDE_KERNEL | self._EXCLUDE_HV  # the flag bits
        number = self._SYSCALL.get(os.uname().machine)
        if number is None:
            self.why = f"no perf_event_open number for {os.uname().machine}"
            return
        libc = ctypes.CDLL(None, use_errno=True)
        self.fd = libc.syscall(number, attr, 0, -1, -1, 0)
        if self.fd < 0:
            self.why = f"perf_event_open: {os.strerror(ctypes.get_errno())}"
        self._ioctl = libc.ioctl

    def count(self, fn, number: int) -> float:
        """Instructions per call of fn over `number` calls."""
        self._ioctl(self.fd, self._RESET, 0)
        self._ioctl(self.fd, self._ENABLE, 0)
        for _ in range(number):
            fn()
        self._ioctl(self.fd, self._DISABLE, 0)
        value = ctypes.c_uint64()
        os.readv(self.fd, [value])
        return value.value / number


def batch_us(fn, number: int) -> float:
    start = time.perf_counter()
    for _ in range(number):
        fn()
    return (time.perf_counter() - start) / number * 1e6


def rounds_us(calls: dict, number: int, rounds: int) -> dict[str, list[float]]:
    """Per path, its per-call time in each round; the paths interleaved within every round."""
    found = {name: [] for name in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            found[name].append(batch_us(fn, number))
    return found


def spread(values: list[float]) -> tuple[float, float, float]:
    """(median, 25th percentile, 75th percentile)."""
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return median, q1, q3


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


def call_paths(op, problem, inputs: dict) -> dict:
    """Every path's call for one operator's inputs (bare first)."""
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

    twin = dispatcher_twin(op, overload(*args, **kwargs, backend=BACKEND))
    calls = {
        "bare": lambda: bare(**inputs),
        "direct": lambda: op.entry(**inputs, backend=BACKEND),
        "auto": lambda: op.entry(**inputs),
        "custom op": lambda: overload(*args, **kwargs, backend=BACKEND),
        "dispatcher": lambda: twin(*args, **kwargs, backend=BACKEND),
    }
    if op.check_values is not None:
        calls["checked"] = checked
    for call in calls.values():
        call()
    return calls


def measure(calls: dict, number: int, rounds: int, counter: InstructionCounter) -> dict:
    """Per path: the median and spread of its overhead (over bare; checked over auto; dispatcher alone), us/call,
    and instructions per call when counted."""
    times = rounds_us(calls, number, rounds)
    base = {"checked": "auto", "dispatcher": None}
    row = {"bare": spread(times["bare"])}
    for name in calls:
        if name != "bare":
            against = base.get(name, "bare")
            row[name] = spread(times[name] if against is None else
                               [a - b for a, b in zip(times[name], times[against])])
    row["ours"] = spread([c - d - b for c, d, b in zip(times["custom op"], times["dispatcher"], times["bare"])])
    if counter.why is None:
        row["instructions"] = {name: counter.count(fn, number) for name, fn in calls.items()}
    return row


def _cell(value) -> str:
    if value is None:
        return f"{'-':>20}"
    median, q1, q3 = value
    return f"{median:7.2f} [{q1:5.2f}, {q3:5.2f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ops", nargs="*", help="operators (default: all)")
    parser.add_argument("--rounds", type=int, default=41, help="rounds of batches, the paths interleaved in each")
    parser.add_argument("--number", type=int, default=200, help="calls per batch")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    args = parser.parse_args()
    torch.set_num_threads(1)
    names = args.ops or sorted(registry.operators())
    cases = {}
    for name in names:
        op = registry.get(name)
        problem = op.presets["smoke"][0]
        cases[name] = (op, problem, op.make_inputs(problem, DEVICE, 0))
    counter = InstructionCounter()
    Launch.__call__ = lambda self: None  # time the Python path, not the (interpreted) kernel
    with tempfile.TemporaryDirectory() as tmp:
        os.environ[stores.ENV_VAR] = os.path.join(tmp, "table.sqlite3")
        tune_table(os.environ[stores.ENV_VAR], cases)
        dispatch.reload_tables()
        with checks.checked(False):
            rows = {name: measure(call_paths(*case), args.number, args.rounds, counter)
                    for name, case in cases.items()}
    print(f"host cost on {devices.info(DEVICE).describe()}, us per call: median [25th, 75th percentile] of "
          f"{args.rounds} interleaved rounds of {args.number} calls; launches stubbed")
    print(f"{'operator':24}{'bare':>20}  {'over bare: direct':>20}{'auto':>21}{'custom op':>21}  "
          f"{'checked over auto':>20}  {'dispatcher alone':>20}  {'ours (custom op less both)':>26}")
    for name, row in rows.items():
        print(f"{name:24}{_cell(row['bare'])}  {_cell(row['direct'])} {_cell(row['auto'])} {_cell(row['custom op'])}"
              f"  {_cell(row.get('checked'))}  {_cell(row['dispatcher'])}  {_cell(row['ours']):>26}")
    print("instructions per call: " + ("; ".join(
        f"{name} " + ", ".join(f"{path} {n:.0f}" for path, n in row["instructions"].items())
        for name, row in rows.items()) if counter.why is None else f"not counted here ({counter.why})"))
    worst = max(rows.items(), key=lambda item: item[1]["direct"][0])
    ratio = max(rows.items(), key=lambda item: item[1]["custom op"][0] / item[1]["direct"][0])
    print(f"largest median overhead of a direct call: {worst[1]['direct'][0]:.2f} us ({worst[0]}); custom op over "
          f"direct: at most {ratio[1]['custom op'][0] / ratio[1]['direct'][0]:.1f}x the overhead ({ratio[0]}), "
          f"{max((r['bare'][0] + r['custom op'][0]) / (r['bare'][0] + r['direct'][0]) for r in rows.values()):.2f}x "
          "the whole call")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
