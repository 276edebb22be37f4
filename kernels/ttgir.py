"""Triton's GPU dialect (TTGIR) as printed text: ops, tensor layouts, source locations, element orders.

The sm_90a build decides what the interpreter never sees: each tensor's register layout, and which reshapes may
reorder elements (`tt.reshape ... allow_reorder`: Triton's combine pass sets it on a reshape whose users only
reduce, and lowers it by reusing each thread's registers in order). Read here without MLIR, from the text
`triton.compile(...).asm["ttgir"]` holds, by flashkern.kernels.gpu_lint (hazard rules) and
flashkern.kernels._triton.pairing (the GPU's element pairing emulated in the interpreter).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import numpy as np

_OP = re.compile(r'^\s*(?P<results>%[\w$.-]+(?::\d+)?(?:\s*,\s*%[\w$.-]+)*)\s*=\s*(?P<name>"[\w.]+"|[\w.]+)(?P<rest>.*)$')
_VALUE = re.compile(r"%[\w$.-]+(?:#\d+)?")
_LOC_REF = re.compile(r"loc\((#loc\d*)\)\s*$")
_LOC_DEF = re.compile(r"^(#loc\d*) = loc\((.*)\)\s*$")
_LAYOUT_DEF = re.compile(r"^(#[\w]+) = (#ttg\.\w+<.*>)\s*$")
_FILE_LOC = re.compile(r'^"(?P<file>[^"]+)":(?P<line>\d+):\d+$')
_NAMED_LOC = re.compile(r'^"[^"]*"\((#loc\d*)\)$')
_CALLSITE = re.compile(r"^callsite\((#loc\d*) at (#loc\d*)\)$")

# ops whose result element i is a function of their operands' elements i alone: element order passes through
_ELEMENTWISE_OPS = {"tt.bitcast", "tt.addptr", "tt.load", "ttg.convert_layout", "tt.fp_to_fp", "tt.int_to_ptr",
                    "tt.ptr_to_int", "tt.clampf", "tt.precise_sqrt", "tt.precise_divf", "tt.mulhiui",
                    "tt.extern_elementwise", "tt.elementwise_inline_asm"}
_ORDERLESS_OPS = {"tt.splat", "arith.constant"}  # every element the same value: no order of its own
LOGICAL = "logical order"  # elements as the source program indexes them


@dataclass(frozen=True)
class TensorType:
    shape: tuple[int, ...]
    element: str
    encoding: str  # as printed: an alias (#blocked2) or an inline attribute (#ttg.slice<...>)

    @property
    def text(self) -> str:
        return f"tensor<{'x'.join(map(str, (*self.shape, self.element) if self.element else self.shape))}, " \
               f"{self.encoding}>"

    @property
    def layout_only(self) -> TensorType:
        """Shape and encoding, which decide where elements live (not what they are)."""
        return TensorType(self.shape, "", self.encoding)


@dataclass(frozen=True)
class Reorder:
    """The element order a reorder-reshape leaves: its source layout's registers read into its result's. Two
    reshapes between the same shapes and encodings leave the same order, whatever the element types."""

    source: TensorType
    result: TensorType

    def __str__(self) -> str:
        return f"reorder {self.source.text} -> {self.result.text}"


@dataclass(frozen=True)
class Op:
    results: tuple[str, ...]
    name: str
    operands: tuple[str, ...]
    text: str  # the whole line
    loc: str  # its location alias (#loc12), or ""

    @property
    def types(self) -> list[TensorType]:
        """The tensor types the line prints, in order (operands' then results' where both are printed)."""
        return tensor_types(self.text)

    @property
    def allows_reorder(self) -> bool:
        return self.name == "tt.reshape" and re.search(r"\ballow_reorder\b", self.text) is not None


def tensor_types(text: str) -> list[TensorType]:
    found = []
    for start in (m.end() for m in re.finditer(r"tensor<", text)):
        depth, end = 1, start
        while depth and end < len(text):
            depth += {"<": 1, ">": -1}.get(text[end], 0)
            end += 1
        body = text[start:end - 1]
        dims, _, encoding = body.partition(", ")
        *shape, element = dims.split("x")
        if all(s.isdigit() for s in shape):
            found.append(TensorType(tuple(map(int, shape)), element, encoding.strip()))
    return found


@dataclass(frozen=True)
class Blocked:
    """#ttg.blocked<{sizePerThread, threadsPerWarp, warpsPerCTA, order}> (one CTA)."""

    size_per_thread: tuple[int, ...]
    threads_per_warp: tuple[int, ...]
    warps_per_cta: tuple[int, ...]
    order: tuple[int, ...]  # dims from the fastest

    def bases(self, shape: tuple[int, ...]) -> dict[str, list[tuple[int, ...]]]:
        """The linear layout over `shape` as Triton builds it (blockedToLinearLayout, combineCtaCgaWithShape): the
        coordinate each register, lane and warp bit adds (XOR); registers first along `order`, then lanes, then
        warps; repeats of the tile as more register bits (fastest dim first); a tile larger than the shape
        broadcasts its largest bases (zeroed)."""
        rank = len(shape)
        size = [1] * rank
        bases: dict[str, list[list[int]]] = {"register": [], "lane": [], "warp": []}
        for kind, per in (("register", self.size_per_thread), ("lane", self.threads_per_warp),
                          ("warp", self.warps_per_cta)):
            for dim in self.order:
                for _ in range(per[dim].bit_length() - 1):
                    basis = [0] * rank
                    basis[dim] = size[dim]
                    bases[kind].append(basis)
                    size[dim] *= 2
        for dim in self.order:  # not smaller than the shape: the tile repeats in registers
            while size[dim] < shape[dim]:
                basis = [0] * rank
                basis[dim] = size[dim]
                bases["register"].append(basis)
                size[dim] *= 2
        for dim in range(rank):  # not larger: broadcast, the largest bases first
            ranked = sorted(((b[dim], kind, i) for kind in ("register", "lane", "warp")
                             for i, b in enumerate(bases[kind]) if b[dim]), reverse=True)
            for value, kind, i in ranked:
                if size[dim] <= shape[dim]:
                    break
                bases[kind][i][dim] = 0
                size[dim] //= 2
        return {kind: [tuple(b) for b in found] for kind, found in bases.items()}

    def owners(self, shape: tuple[int, ...]) -> np.ndarray:
        """int64 [threads, registers]: the row-major flat index of the element each thread's register holds, in
        register order (thread = lane + 32 x warp)."""
        bases = self.bases(shape)

        def coordinates(kind):
            picked = np.array([[(i >> bit) & 1 for bit in range(len(bases[kind]))] for i in range(1 << len(bases[kind]))],
                              dtype=np.int64).reshape(1 << len(bases[kind]), len(bases[kind]))
            vectors = np.array(bases[kind], dtype=np.int64).reshape(len(bases[kind]), len(shape))
            out = np.zeros((1 << len(bases[kind]), len(shape)), dtype=np.int64)
            for bit in range(len(bases[kind])):
                out ^= picked[:, bit:bit + 1] * vectors[bit]
            return out

        registers, lanes, warps = (coordinates(kind) for kind in ("register", "lane", "warp"))
        threads = (lanes[None, :, :] ^ warps[:, None, :]).reshape(-1, len(shape))  # thread = lane + 32 x warp
        coords = threads[:, None, :] ^ registers[None, :, :]
        strides = np.cumprod((1,) + tuple(reversed(shape[1:])))[::-1]
        return (coords * strides).sum(-1)


def _blocked(definition: str) -> Blocked | None:
    if not definition.startswith("#ttg.blocked<"):
        return None
    fields = {name: tuple(int(v) for v in values.split(",") if v.strip())
              for name, values in re.findall(r"(\w+) = \[([\d,\s]*)\]", definition)}
    return Blocked(fields["sizePerThread"], fields["threadsPerWarp"], fields["warpsPerCTA"], fields["order"])


class Module:
    """One kernel's TTGIR text, parsed line by line."""

    def __init__(self, text: str):
        self.text = text
        self.ops: list[Op] = []
        self.defining: dict[str, Op] = {}
        self.layouts: dict[str, str] = {}
        self.locs: dict[str, str] = {}
        for line in text.splitlines():
            if m := _LAYOUT_DEF.match(line):
                self.layouts[m.group(1)] = m.group(2)
                continue
            if m := _LOC_DEF.match(line):
                self.locs[m.group(1)] = m.group(2)
                continue
            m = _OP.match(line)
            if not m:
                continue
            name = m.group("name").strip('"')
            rest = _LOC_REF.sub("", m.group("rest"))
            loc = _LOC_REF.search(line)
            results = tuple(r.strip().split(":")[0] for r in m.group("results").split(","))
            op = Op(results, name, tuple(_VALUE.findall(rest.split(" : ")[0])), line.strip(),
                    loc.group(1) if loc else "")
            self.ops.append(op)
            for result in results:
                self.defining[result] = op

    def layout(self, encoding: str) -> Blocked | None:
        """The blocked layout an encoding names, or None for other kinds (slice, linear, mma, ...)."""
        return _blocked(self.layouts.get(encoding, encoding))

    def where(self, op: Op) -> tuple[tuple[str, int], ...]:
        """(file, line) of the op's source, innermost call first (inlined jit functions)."""
        return self._resolve(op.loc)

    @functools.cache
    def _resolve(self, loc: str) -> tuple[tuple[str, int], ...]:
        body = self.locs.get(loc, "")
        if m := _FILE_LOC.match(body):
            return ((m.group("file"), int(m.group("line"))),)
        if m := _NAMED_LOC.match(body):
            return self._resolve(m.group(1))
        if m := _CALLSITE.match(body):
            return self._resolve(m.group(1)) + self._resolve(m.group(2))
        return ()

    def describe(self, op: Op) -> str:
        chain = self.where(op)
        return " <- ".join(f"{file.rsplit('/', 1)[-1]}:{line}" for file, line in chain) or op.loc or op.name

    def orders(self, value: str) -> frozenset:
        """The element orders `value`'s elements come in: LOGICAL, or a Reorder for each reorder-reshape reached
        through element-wise ops (several: elements of different orders meet in it); empty when its elements carry
        no order (a splat, a constant, a scalar)."""
        return self._orders(value.split("#")[0])

    @functools.cache
    def _orders(self, value: str) -> frozenset:
        op = self.defining.get(value)
        if op is None:
            return frozenset({LOGICAL})  # a block or function argument
        types = op.types
        if op.name in _ORDERLESS_OPS or not types:
            return frozenset()
        if op.allows_reorder:
            return frozenset({Reorder(types[0].layout_only, types[-1].layout_only)})
        if op.name.startswith(("arith.", "math.")) or op.name in _ELEMENTWISE_OPS:
            return frozenset().union(*(self._orders(v.split("#")[0]) for v in op.operands))
        return frozenset({LOGICAL})

    def reorder_permutation(self, reorder: Reorder) -> np.ndarray:
        """perm[i] = the source element (row-major flat index) that the result's element i holds on the GPU."""
        source, result = self.layout(reorder.source.encoding), self.layout(reorder.result.encoding)
        if source is None or result is None:
            raise NotImplementedError(f"only blocked layouts are modelled: {reorder}")
        src, dst = source.owners(reorder.source.shape), result.owners(reorder.result.shape)
        if src.shape != dst.shape or len(np.unique(dst)) != dst.size:
            raise NotImplementedError(f"a reorder with broadcast registers: {reorder}")
        perm = np.empty(dst.size, dtype=np.int64)
        perm[dst.ravel()] = src.ravel()
        return perm
