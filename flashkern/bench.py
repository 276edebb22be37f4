"""`flashkern bench`: time the reference and every implementation at a preset's shapes.

Every implementation's output is checked against the reference before it is timed (a call of
its entry point in checked mode, so the inputs' index values are checked too), and the
bytes the operator must move (its cost model) turn times into GB/s. Interpreted Triton (CPU) is
checked, not timed, unless asked: it is a correctness path, not a speed contender. Timing is the tuner's
(flashkern.autotune.timing.measure: torch's Timer on CPU; on CUDA, device time from CUDA graphs, or
call by call with host time included for a call that cannot be captured (a reference that reads the
host; marked "eager"); at a fixed torch thread count, 1 on CPU): each row's Timing has the median, its
IQR (the spread) and the thread count.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashkern import checks
from flashkern import device as devices
from flashkern import registry
from flashkern.autotune.timing import Timing, measure


@dataclass(frozen=True)
class BenchRow:
    op: str
    problem: object
    backend: str
    timing: Timing | None
    bytes: float
    status: str  # "ok", "reference", or why there is no figure

    @property
    def gbps(self) -> float | None:
        return self.bytes / self.timing.median / 1e9 if self.timing else None


def bench(op_names, problems_of, device: str | None = None, budget: float = 0.5, backends=None,
          threads: int | None = None, time_interpreted: bool = False, on_row=None):
    """Rows for every (problem, backend) of each operator; problems_of(op) gives its problems,
    backends (default: all) limits which are timed, threads is torch's thread count while timing
    (default flashkern.autotune.timing.default_threads: 1 on CPU). Interpreted Triton is checked, not timed
    (status "checked"), unless time_interpreted. on_row(row) follows progress."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    info = devices.info(device)
    rows = []

    def add(row: BenchRow) -> None:
        rows.append(row)
        if on_row:
            on_row(row)

    for name in op_names:
        op = registry.get(name)
        for problem in problems_of(op):
            moved = op.cost(problem).bytes
            inputs = op.make_inputs(problem, device, seed=0)
            expected = op.reference(**inputs)
            timing = measure(lambda: op.reference(**inputs), device, budget=budget, threads=threads)
            add(BenchRow(name, problem, "reference", timing, moved, "reference"))
            for impl in op.implementations:
                if backends is not None and impl.name not in backends:
                    add(BenchRow(name, problem, impl.name, None, moved, "not asked for"))
                    continue
                reason = impl.unavailable(info)
                if reason:
                    add(BenchRow(name, problem, impl.name, None, moved, f"unavailable: {reason}"))
                    continue
                config = impl.default_config(problem)
                try:  # through the entry point: argument and (checked mode) value checks on the inputs
                    with checks.checked():
                        op.compare(inputs, expected, op.result_of(inputs, backend=impl.name, config=config))
                except AssertionError as exc:
                    add(BenchRow(name, problem, impl.name, None, moved, f"MISMATCH: {str(exc).splitlines()[0]}"))
                    continue
                if impl.name == "triton" and device.type == "cpu" and not time_interpreted:
                    add(BenchRow(name, problem, impl.name, None, moved, "checked"))
                    continue
                out = op.empty_outputs(problem, inputs)
                timing = measure(lambda: impl.run(problem, inputs, config, out), device, budget=budget, threads=threads)
                add(BenchRow(name, problem, impl.name, timing, moved, "ok"))
    return rows
