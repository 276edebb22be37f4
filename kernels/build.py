"""The sm_90a build report shared by both DSLs: registers, spills and shared memory per kernel.

Both paths end in ptxas (nvcc for TileLang's CUDA source, Triton's bundled ptxas for its PTX),
so one parser reads both `-v` outputs.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class BuildReport:
    registers: int = 0  # per thread
    spill_stores: int = 0  # bytes
    spill_loads: int = 0  # bytes
    stack: int = 0  # bytes of stack frame per thread
    smem: int = 0  # bytes of shared memory per block (static + dynamic)
    threads: int = 0  # per block
    wgmma: bool = False  # Hopper warpgroup MMA present in the generated code

    def with_(self, **changes) -> BuildReport:
        return dataclasses.replace(self, **changes)

    @property
    def spills(self) -> int:
        return self.spill_stores + self.spill_loads

    @staticmethod
    def merge(reports) -> BuildReport:
        """One report for the kernels of a multi-stage implementation: the largest figure of each kind."""
        reports = list(reports)
        fields = ("registers", "spill_stores", "spill_loads", "stack", "smem", "threads")
        merged = {name: max(getattr(r, name) for r in reports) for name in fields}
        return BuildReport(**merged, wgmma=any(r.wgmma for r in reports))


_USED = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def parse_ptxas(text: str) -> BuildReport:
    """Read `ptxas -v` output; with several kernels, the largest figure of each kind."""
    regs = smem = stack = stores = loads = 0
    found = False
    for m in _USED.finditer(text):
        found = True
        regs = max(regs, int(m.group(1)))
        smem = max(smem, int(m.group(2) or 0))
    for m in _FRAME.finditer(text):
        stack = max(stack, int(m.group(1)))
        stores = max(stores, int(m.group(2)))
        loads = max(loads, int(m.group(3)))
    if not found:
        raise RuntimeError("no register usage in the ptxas output:\n" + text[-2000:])
    return BuildReport(registers=regs, spill_stores=stores, spill_loads=loads, stack=stack, smem=smem)
