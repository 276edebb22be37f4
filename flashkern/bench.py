"""`flashkern bench`: time the reference and every implementation at a preset's shapes.

Every implementation's output is checked against the reference before it is timed (a call of
its entry point in checked mode, so the inputs' index values are checked too), and the
bytes the operator must move (its cost model) turn times into GB/s. Interpreted Triton is
timed too, but it is a correctness path, not a speed contender.
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


def bench(op_names, problems_of, device: str | None = None, budget: float = 0.5, backends=None):
    """Rows for every (problem, backend) of each operator; problems_of(op) gives its problems,
    backends (default: all) limits which are timed."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    info = devices.info(device)
    rows = []
    for name in op_names:
        op = registry.get(name)
        for problem in problems_of(op):
            moved = op.cost(problem).bytes
            inputs = op.make_inputs(problem, device, seed=0)
            expected = op.reference(**inputs)
            rows.append(BenchRow(name, problem, "reference", measure(lambda: op.reference(**inputs), device, budget=budget),
                          moved, "reference"))
            for impl in op.implementations:
                if backends is not None and impl.name not in backends:
                    rows.append(BenchRow(name, problem, impl.name, None, moved, "not asked for"))
                    continue
                reason = impl.unavailable(info)
                if reason:
                    rows.append(BenchRow(name, problem, impl.name, None, moved, f"unavailable: {reason}"))
                    continue
                config = impl.default_config(problem)
                try:  # through the entry point: argument and (checked mode) value checks on the inputs
                    with checks.checked():
                        op.compare(inputs, expected, op.entry(**inputs, backend=impl.name, config=config))
                except AssertionError as exc:
                    rows.append(BenchRow(name, problem, impl.name, None, moved, f"MISMATCH: {str(exc).splitlines()[0]}"))
                    continue
                out = op.empty_outputs(problem, inputs)
                timing = measure(lambda: impl.run(problem, inputs, config, out), device, budget=budget)
                rows.append(BenchRow(name, problem, impl.name, timing, moved, "ok"))
    return rows
