"""Global-memory traffic a Triton launch requests, counted by running it under Triton's interpreter.

`measure(launch)` interprets the launch with the interpreter's builder instrumented and adds up, over every
CTA, the bytes each memory operation asks for: the lanes whose mask is true times the size of the pointee type
(a scalar access is one lane). Every access the interpreter performs ends in one of four builder methods, and
those are the ones counted, so nothing is counted twice:
- create_masked_load / create_masked_store: plain, masked, tensor-descriptor (TMA-style) and atomic loads and
  stores all route through them (descriptor accesses count their in-bounds lanes, as a TMA box moves them);
- create_atomic_rmw: read + write of each active lane;
- create_atomic_cas: read + write of each lane (whether or not the compare succeeds).

Sampling: a grid of more than `max_ctas` CTAs is walked on a deterministic sample of program ids — the first
and the last CTA, the rest evenly spaced over the grid flattened x-fastest (CUDA's block order) — and the totals
are scaled by ctas / sampled. A launch whose CTAs cooperate (`Launch.cooperating`: the split-K CTAs of a tile,
whose last arrival runs the epilogue) is sampled in whole groups, so the protocol runs as on the GPU. The walk launches a 1-D grid of `sampled` CTAs and instruments the builder's
set_grid_idx to turn the i-th index into the i-th sampled program id, and its set_grid_dim to keep the real
grid (so tl.program_id / tl.num_programs read as in the real launch). This reuses the interpreter's own grid
loop, argument copies and language patches unchanged, once for the whole walk, with nothing copied out of
Triton (a 1x1x1 launch per sampled CTA would redo those per CTA and need program_id / num_programs patched
as well); a full walk is the same path with every program id as the sample.

Limits:
- Requested bytes at lane granularity: no rounding to sectors or cache lines, no coalescing, and a re-read
  counts again even where L2 would serve it (the model's business, see LaunchTraffic).
- The launch really runs, on the inputs it was given: data-dependent control flow is counted as these inputs
  drive it, and in-place kernels modify their arguments. A sampled walk leaves its outputs partly unwritten:
  they are scratch (the model allocates them), and a later launch reading them sees garbage.
- Scaling from a sample is exact for CTAs that request the same traffic; otherwise it is an estimate: a ragged
  last CTA is always sampled but weighs ctas / sampled like the others, a slight under-count of a masked tail.
- Cross-CTA protocols run in the interpreter's sequential order: a spin-wait (atomic poll) counts each poll,
  and one waiting on a CTA left out of the sample does not end.
- Interpreter only (TRITON_INTERPRET=1, as `import flashkern` sets on CPU); `exact` is always True.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import inspect
import math
import os
import sys
from typing import NamedTuple

import numpy as np
import torch
import triton

import flashkern
from flashkern.kernels._triton import Launch
from flashkern.kernels.build import LaunchTraffic, TensorTraffic


class _Access(NamedTuple):
    """How one builder method touches memory: its pointer and mask parameters, and reads/writes per lane."""

    pointers: str
    mask: str | None  # None: every lane is active
    reads: int
    writes: int


_ACCESSES = {
    "create_masked_load": _Access("ptrs", "mask", reads=1, writes=0),
    "create_masked_store": _Access("ptrs", "mask", reads=0, writes=1),
    "create_atomic_rmw": _Access("ptr", "mask", reads=1, writes=1),
    "create_atomic_cas": _Access("ptr", None, reads=1, writes=1),
}


@dataclasses.dataclass
class _Totals:
    read: int = 0
    written: int = 0
    starts: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, dtype=np.uint64))  # storages, sorted
    ends: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, dtype=np.uint64))
    per_storage: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))  # bytes requested of each

    def attribute(self, address: int, nbytes: int):
        i = int(np.searchsorted(self.starts, address, side="right")) - 1
        if i >= 0 and address < self.ends[i]:
            self.per_storage[i] += nbytes


TRACED_CTAS = 8  # sampled CTAs whose source lines are counted (trips of loops: flashkern.kernels.sass)


def measure(launch: Launch, max_ctas: int = 64) -> LaunchTraffic:
    """Bytes `launch` reads and writes in global memory, over all its CTAs (sampled beyond `max_ctas`)."""
    if max_ctas < 2:
        raise ValueError("max_ctas must be at least 2 (the first and the last CTA are always sampled)")
    if not flashkern.triton_interpreted():
        raise RuntimeError("measuring Triton traffic needs Triton's interpreter (TRITON_INTERPRET=1)")
    from triton.runtime.interpreter import interpreter_builder

    grid = tuple(launch.grid) + (1,) * (3 - len(launch.grid))
    ctas = math.prod(grid)
    if ctas == 0:
        return LaunchTraffic(ctas=0, bytes_read=0.0, bytes_written=0.0, sampled=0)
    group = launch.cooperating
    if ctas % group:
        raise ValueError(f"{ctas} CTAs do not split into groups of {group} cooperating ones")
    program_ids = [_program_id(index, grid) for index in _sampled_indices(ctas, max_ctas, group)]
    storages = _storages(launch.args.values())
    totals = _Totals(starts=np.array([start for start, _ in storages], dtype=np.uint64),
                     ends=np.array([start + size for start, size in storages], dtype=np.uint64),
                     per_storage=np.zeros(len(storages)))
    counting = {name: functools.partial(_counted, access=access, totals=totals) for name, access in _ACCESSES.items()}
    traced = set(_sampled_indices(len(program_ids), TRACED_CTAS, group))
    with _LineCounter() as lines:

        def next_cta(set_grid_idx):
            def select(x, y, z):
                lines.trace(x in traced)  # the CTA's kernel frame starts after this: traced or not
                set_grid_idx(*program_ids[x])  # CTA i: sample i
            return select

        sampling = {
            "set_grid_dim": lambda set_grid_dim: lambda *_: set_grid_dim(*grid),  # tl.num_programs: the real grid
            "set_grid_idx": next_cta,
        }
        with _instrumented(interpreter_builder, counting | sampling):
            dataclasses.replace(launch, grid=(len(program_ids),))()
    scale = ctas / len(program_ids)
    return LaunchTraffic(
        ctas=ctas, bytes_read=totals.read * scale, bytes_written=totals.written * scale, sampled=len(program_ids),
        tensors=tuple(TensorTraffic(requested * scale, float(size))
                      for requested, (_, size) in zip(totals.per_storage, storages)),
        lines=tuple(sorted((where, count / len(traced)) for where, count in lines.counts.items())),
        cta_lines=tuple(tuple(sorted(cta.items())) for cta in lines.per_cta),
    )


def _storages(values) -> list[tuple[int, int]]:
    """(address, bytes) of the distinct storages behind the tensor arguments, by address: all the launch can
    touch (the interpreter runs CPU tensors in place, so their addresses are the ones its pointers hold)."""
    storages = {}
    for value in values:
        if isinstance(value, torch.Tensor):
            storage = value.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sorted(storages.items())


class _LineCounter:
    """(file, line) -> times it ran, for the kernel code the interpreter runs in this thread while tracing is on:
    the kernels and their @triton.jit helpers (frames of Triton, numpy, torch and the standard library are not
    traced). Tracing costs about 3x the walk, so it is turned on for TRACED_CTAS of the sampled CTAs."""

    def __init__(self):
        self.per_cta: list[collections.Counter] = []  # one per traced CTA, in the order they ran
        self.previous = None

    @property
    def counts(self) -> collections.Counter:
        """Every traced CTA's runs together."""
        return sum(self.per_cta, collections.Counter())

    def local(self, frame, event, _):
        if event == "line":
            self.per_cta[-1][frame.f_code.co_filename, frame.f_lineno] += 1
        return self.local

    def calls(self, frame, event, _):
        return None if frame.f_code.co_filename.startswith(_UNTRACED) else self.local

    def trace(self, on: bool):
        """Start the next CTA: counted (a counter of its own) or not."""
        if on:
            self.per_cta.append(collections.Counter())
        sys.settrace(self.calls if on else self.previous)

    def __enter__(self):
        self.previous = sys.gettrace()
        return self

    def __exit__(self, *_):
        sys.settrace(self.previous)


_UNTRACED = tuple(os.path.dirname(module.__file__) for module in (triton, np, torch, os)) + (__file__,)


def _sampled_indices(ctas: int, max_ctas: int, group: int = 1) -> range | list[int]:
    """Flat CTA indices to interpret: all of them, or about max_ctas in evenly spaced whole groups of `group`
    consecutive CTAs (at least two groups: the first and the last)."""
    if ctas <= max_ctas:
        return range(ctas)
    groups, wanted = ctas // group, max(2, max_ctas // group)
    if groups <= wanted:
        return range(ctas)
    # a spacing above 1 keeps the floored positions distinct
    return [g * (groups - 1) // (wanted - 1) * group + i for g in range(wanted) for i in range(group)]


def _program_id(index: int, grid: tuple[int, int, int]) -> tuple[int, int, int]:
    """The (x, y, z) program id of flat CTA `index`, x fastest."""
    nx, ny, _ = grid
    return index % nx, index // nx % ny, index // (nx * ny)


def _counted(method, access: _Access, totals: _Totals):
    """`method` (a bound builder method) adding the bytes of each call to `totals` before doing its work."""
    signature = inspect.signature(method)

    @functools.wraps(method)
    def counting(*args, **kwargs):
        arguments = signature.bind(*args, **kwargs).arguments
        pointers = arguments[access.pointers]
        if access.mask is None:
            active = pointers.data.reshape(-1)
        else:
            active = pointers.data[np.broadcast_to(arguments[access.mask].data, pointers.data.shape)]
        # pointer arithmetic treats int1 as a byte; the interpreter does the same
        nbytes = active.size * max(1, pointers.dtype.element_ty.primitive_bitwidth // 8)
        totals.read += access.reads * nbytes
        totals.written += access.writes * nbytes
        if active.size:
            totals.attribute(int(active.min()), (access.reads + access.writes) * nbytes)
        return method(*args, **kwargs)

    return counting


@contextlib.contextmanager
def _instrumented(builder, instruments: dict):
    """Replace builder methods by `instruments[name](original method)` for the duration; always restore."""
    shadowed = {name: builder.__dict__[name] for name in instruments if name in builder.__dict__}
    try:
        for name, instrument in instruments.items():
            setattr(builder, name, instrument(getattr(builder, name)))
        yield
    finally:
        for name in instruments:
            if name in shadowed:
                setattr(builder, name, shadowed[name])
            else:
                builder.__dict__.pop(name, None)
