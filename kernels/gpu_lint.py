"""Hazards in what the GPU compiler builds, found without a GPU: one rule a function, over the sm_90a build's
Triton GPU IR (TTGIR) and TileLang's generated CUDA.

The interpreter and the C target run a kernel's meaning; these rules read what the compiler made of it, where the
two can differ. Every Triton and TileLang build report carries its findings (kernels.build.BuildReport.hazards),
so `flashkern compile-check` and the suite's build test fail on them. A rule names the op (source file:line,
innermost call first) and why.

TTGIR
  reorder_pairing: the operands of one reduction, scan or histogram (or the values an element-wise chain combines
      into one) whose elements come in different orders. Triton's combine pass lets a reshape that only feeds
      reductions reorder elements (`allow_reorder`: each thread's registers reused in order), and two tensors of
      different layouts reshaped apart then pair one column's mask with another's value. The first H200 run's
      wrong top-k rows (docs/gpu.md); kernels._triton.pairing replays that pairing in the interpreter.
CUDA (TileLang)
  divergent_shuffle: a full-warp __shfl_*_sync inside a branch (or loop) whose condition varies between the lanes
      of a warp: lanes that skip it leave the shuffle undefined.
  divergent_barrier: __syncthreads() inside a branch (or loop) whose condition varies between the threads of a
      CTA: a deadlock, or a barrier the threads meet at different points.
The CUDA rules read conditions syntactically: threadIdx, and locals assigned from it, count as varying unless
only whole warps (threadIdx.x >> 5 or more, / 32, comparisons with multiples of 32) decide.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from flashkern.kernels import ttgir


@dataclass(frozen=True)
class Hazard:
    rule: str
    where: str
    detail: str

    def __str__(self) -> str:
        return f"{self.rule} at {self.where}: {self.detail}"


# ---------------------------------------------------------------- TTGIR rules

_REDUCING_OPS = ("tt.reduce", "tt.scan", "tt.histogram")


def reorder_pairing(module: ttgir.Module) -> list[Hazard]:
    hazards = []
    for op in module.ops:
        if op.name not in _REDUCING_OPS:
            continue
        orders = frozenset().union(*(module.orders(value) for value in op.operands))
        reorders = sorted(str(o) for o in orders if isinstance(o, ttgir.Reorder))
        scan_reordered = op.name == "tt.scan" and reorders  # a scan depends on the order itself
        if reorders and (len(orders) > 1 or scan_reordered):
            kinds = reorders + ([ttgir.LOGICAL] if ttgir.LOGICAL in orders else [])
            hazards.append(Hazard("reorder_pairing", module.describe(op),
                                  f"{op.name} meets elements in {len(kinds)} orders: " + "; ".join(kinds)))
    return hazards


TTGIR_RULES = (reorder_pairing,)


def lint_ttgir(text: str) -> tuple[str, ...]:
    """Every TTGIR rule's findings in one kernel's TTGIR, as lines."""
    module = ttgir.Module(text)
    return tuple(str(h) for rule in TTGIR_RULES for h in rule(module))


# ---------------------------------------------------------------- CUDA rules

_TID = r"(?:\(\(int\)threadIdx\.x\)|threadIdx\.x)"
_THREAD = re.compile(r"\(\(int\)threadIdx\.x\)|threadIdx\.[xyz]")
_WARP_WIDE = (  # (pattern, the group that must be warp-sized, whether it is a shift)
    (re.compile(_TID + r"\s*>>\s*(\d+)"), True),  # >> 5 or more: a warp's index or coarser
    (re.compile(_TID + r"\s*/\s*(\d+)"), False),  # / a multiple of 32
    (re.compile(_TID + r"\s*(?:<|>=|>|<=)\s*(\d+)"), False),  # a cut at a warp boundary
    (re.compile(r"(\d+)\s*(?:<|>=|>|<=)\s*" + _TID), False),
)
_ASSIGN = re.compile(r"(?:^|[;{}])\s*(?:(?:const\s+)?[\w:<>]+\s+)?(\w+)(?:\[[^\]]*\])?\s*=(?!=)\s*([^;]*);", re.M)
_FULL_MASK = r"\(\s*(?:\(uint\)|\(unsigned\)|\(unsigned int\))?\s*(?:4294967295|0x[fF]{8}u?|-1)\b"
_SHUFFLE = re.compile(r"__shfl(?:_up|_down|_xor)?_sync" + _FULL_MASK)
_BARRIER = re.compile(r"__syncthreads\(\)")
_STRUCTURE = re.compile(r"\b(if|for|while)\s*\(|\belse\b|[{};]")


def _varies(expression: str, varying: dict[str, str]) -> str:
    """'lane' when the expression can differ between the lanes of a warp, 'warp' when only between warps, '' when
    it is the same in every thread (as far as its text tells)."""
    kinds, rest = set(), expression
    for pattern, shift in _WARP_WIDE:
        for m in pattern.finditer(expression):
            n = int(m.group(1))
            if (n >= 5) if shift else (n % 32 == 0):
                kinds.add("warp")
                rest = rest.replace(m.group(0), "0")
    if _THREAD.search(rest):
        kinds.add("lane")
    kinds.update(kind for name, kind in varying.items() if re.search(rf"(?<![\w.]){re.escape(name)}\b", rest))
    return "lane" if "lane" in kinds else ("warp" if kinds else "")


def _varying_locals(source: str) -> dict[str, str]:
    """Locals assigned from thread-varying expressions anywhere in the source (to a fixpoint: flow-insensitive, so
    a local once varying is taken as varying everywhere)."""
    assignments = _ASSIGN.findall(source)
    varying: dict[str, str] = {}
    changed = True
    while changed:
        changed = False
        for name, expression in assignments:
            kind = _varies(expression, varying)
            if kind and varying.get(name) != "lane" and varying.get(name) != kind:
                varying[name] = "lane" if "lane" in (kind, varying.get(name)) else kind
                changed = True
    return varying


def _enclosing_conditions(source: str, call: re.Pattern) -> list[tuple[int, list[str]]]:
    """Each match of `call`: its line and the conditions of the if / for / while blocks around it (an else block
    under its if's condition), innermost last."""
    events = sorted([(m.start(), "call", m) for m in call.finditer(source)], key=lambda e: e[0])
    found, stack = [], []  # stack: per open brace, its header's condition or ""
    pending, closed = None, None  # a header's condition waiting for its brace; the condition of the block just shut
    pos, calls = 0, iter(events)
    next_call = next(calls, None)
    while True:
        m = _STRUCTURE.search(source, pos)
        while next_call and (m is None or next_call[0] < m.start()):
            found.append((source.count("\n", 0, next_call[0]) + 1, [c for c in stack if c] + [pending or ""]))
            next_call = next(calls, None)
        if m is None:
            return found
        token, pos = m.group(0), m.end()
        if m.group(1):  # the condition, to its closing parenthesis
            depth, end = 1, pos
            while depth and end < len(source):
                depth += {"(": 1, ")": -1}.get(source[end], 0)
                end += 1
            condition = source[pos:end - 1]
            pending = f"{pending} && {condition}" if pending else condition  # else if: both
            pos = end
        elif token == "else":
            pending = closed
        elif token == "{":
            stack.append(pending or "")
            pending = None
        elif token == "}":
            closed = stack.pop() if stack else None
        else:  # ";": a braceless statement under its header ends
            pending = None


def _divergent_calls(source: str, call: re.Pattern, threshold: str) -> list[tuple[int, str]]:
    """Lines where `call` runs under a condition varying at `threshold` ('lane': within a warp; 'warp': within a
    CTA), with the first such condition."""
    varying = _varying_locals(source)
    found = []
    for line, conditions in _enclosing_conditions(source, call):
        for condition in conditions:
            # a for loop's own variable varies with the trip, not the thread: its header decides
            own = set(re.findall(r"^\s*(?:[\w:]+\s+)?(\w+)\s*=[^=]", condition.split(";")[0])) if ";" in condition else set()
            kind = _varies(condition, {k: v for k, v in varying.items() if k not in own}) if condition else ""
            if kind == "lane" or (threshold == "warp" and kind == "warp"):
                found.append((line, " ".join(condition.split())))
                break
    return found


def divergent_shuffle(source: str) -> list[Hazard]:
    return [Hazard("divergent_shuffle", f"line {n}", f"a full-warp shuffle under `{c}`")
            for n, c in _divergent_calls(source, _SHUFFLE, "lane")]


def divergent_barrier(source: str) -> list[Hazard]:
    return [Hazard("divergent_barrier", f"line {n}", f"__syncthreads() under `{c}`")
            for n, c in _divergent_calls(source, _BARRIER, "warp")]


CUDA_RULES = (divergent_shuffle, divergent_barrier)


def lint_cuda(source: str) -> tuple[str, ...]:
    """Every CUDA rule's findings in one generated CUDA source, as lines."""
    return tuple(str(h) for rule in CUDA_RULES for h in rule(source))
