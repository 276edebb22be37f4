"""Global-memory traffic a TileLang GPU kernel requests, counted from its lowered program without running it.

`measure(prim_func, args, pass_configs)` lowers a GPU-flavour program for sm_90a through TileLang's CUDA pipeline
up to the end of tile-operator lowering (`CUDAPassPipelineBodyPrologue`). By then T.copy, T.gemm, T.reduce,
T.Parallel and T.Pipelined are loops of BufferLoad / BufferStore (and cp.async intrinsics), and the grid and the
threads are `launch_thread` bindings. TMA lowering and warp specialization are switched off for the count so
that copies stay element loops: a TMA box moves the same in-bounds elements. Every size is bound from the
arguments: a parameter buffer's symbolic shape and strides from its tensor's, a scalar parameter from its value.
Lowering takes seconds and is cached by program text and pass configs: the sizes are dynamic, so one lowering
serves every problem size of a kernel; the walk itself takes a fraction of a second.

What counts, each time it executes:
- a load from / a store to a parameter buffer (global memory): its element size times its lanes;
- a pointer to a parameter buffer handed to an intrinsic (`tvm_access_ptr`: cp.async sources, atomics): its
  extent in elements, read and/or written as its access mask says (an atomic both);
- an explicit TMA copy (`T.tma_copy`: tma_load / tma_store of a create_tma_descriptor): its whole box.
An access executes once per point of the box of its enclosing thread bindings (blockIdx, threadIdx) and loops
(vectorized lanes included) that satisfies its guards: the enclosing if-conditions, the condition of an
if_then_else / Select it sits in (the branch not taken moves nothing), a cp.async's predicate, and the bounds of
a loop whose extent depends on outer variables. Guards are counted exactly: those TVM's analyzer proves or
disproves are settled, the rest are evaluated over the grid of the variables they involve (independent groups
of guards separately). Variables bound once (let bindings, `T.alloc_var` locals assigned once) are substituted.

Data. A loop whose extent reads a parameter buffer (`for t in T.serial(tiles)`, tiles = ceildiv(Counts[m], tile):
the split top-k's pass over the candidates an earlier stage compacted) asks `values` for what the arguments hold
when the launch starts (TileLangKernel.traffic runs the C flavour of the earlier stages to produce it) and the walk
starts again with them: each CTA then runs its own extent, and every guard reading those buffers is evaluated, a
load at its indices clamped to the tensor. Buffers the launch writes (stores, atomics) stay unknown: their values
change while it runs. A local alone naming such an extent is reported among the sizes at its largest over the
CTAs (the heaviest CTA's trips, for the issue count's CUDA C loop bounds: kernels.sass.for_extent).

Where the count is an upper bound (exact=False):
- a guard that depends on data it does not have (reads a buffer whose values it was not given or that the launch
  writes, or a local assigned more than once: an early exit, a gather's validity test) is taken as true, except a
  ticket (an atomic add's return on Counter[blockIdx.k], as a split-K CTA draws to learn whether it arrived last;
  `_Counter.ticket`), which is its CTA's rank; so is a group of guards whose variables span more than
  MAX_ENUMERATED points;
- without values, a loop whose extent depends on data runs the largest extent the analyzer can bound it by from
  the sizes (min(Ends[b], W) -> W); a loop it cannot bound (only the data type limits it) raises ValueError naming
  the loop, and so does a while loop.
Counts are per element a CTA requests, as in Triton's count (kernels/_triton/traffic): a thread binding that
neither the address nor a guard involves does not multiply it, so a value every thread of a CTA loads (a scalar
read outside T.Parallel, a broadcast element) counts once per CTA; no rounding to sectors, no coalescing, no L2
(the model's business). Beside the bytes, each read records which earlier CTAs (by launch gap) made the
same request (`_Counter.reread_gaps`): the model's L2 credit for CTAs that stream shared data together.
Copies of one load within a statement under the same guards count once, as the compiled code loads once (a
T.macro expanding its argument twice). A parameter's data pointer used any other way (a TMA descriptor the
count cannot read, address_of) raises NotImplementedError rather than go uncounted. Every CTA is counted:
sampled = ctas.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import numpy as np
import tilelang  # noqa: F401  (first: importing it puts its tvm on the path)
import torch
import tvm
from tvm import arith, tirx
from tvm.tirx import expr as E
from tvm.tirx import stmt as S

from flashkern.kernels._tilelang import _sm90_target
from flashkern.kernels.build import LaunchTraffic, TensorTraffic

# Copies stay element loops (TMA off: its boxes move the same elements; warp specialization would reintroduce TMA).
ANALYSIS_PASS_CONFIGS = {"tl.disable_tma_lower": True, "tl.disable_warp_specialized": True}
MAX_ENUMERATED = 1 << 24  # most grid points one group of guards is evaluated over; beyond, it is taken as true
MAX_GAPS = 64  # distinct launch gaps kept per access (beyond, rounded up to quarter powers of two)
_CHUNK = 1 << 20  # grid points evaluated at once
_UNBOUNDED = 1 << 30  # a bound this wide comes from a data type, not from the sizes: the value is unbounded
_LOWERED: dict = {}  # (program text, pass configs) -> lowered program; sizes are dynamic, so one serves every call


def lower_for_traffic(prim_func, pass_configs: dict | None = None) -> tirx.PrimFunc:
    """The program after tile-operator lowering for sm_90a, with TMA and warp specialization off."""
    from tilelang.cuda.pipeline import CUDAPassPipelineBodyPrologue

    config = {**(pass_configs or {}), **ANALYSIS_PASS_CONFIGS}
    key = (prim_func.script(), tuple(sorted(config.items())))
    if key not in _LOWERED:
        target = _sm90_target()
        with tvm.transform.PassContext(opt_level=3, config=config), target:
            _LOWERED[key] = CUDAPassPipelineBodyPrologue(tvm.IRModule({"main": prim_func}), target)["main"]
    return _LOWERED[key]


def measure(prim_func, args: list, pass_configs: dict | None = None, values=None) -> LaunchTraffic:
    """Global-memory traffic of launching the GPU-flavour `prim_func` on `args` (tensors and scalars, in parameter
    order, as the kernel would be called; nothing is launched, so CPU tensors do).

    values: None, or a callable returning what each argument holds when the launch starts (a tensor, or None where
    unknown; the earlier stages of the call having run), called only if a loop's extent reads data."""
    func = lower_for_traffic(prim_func, pass_configs)
    sizes = _size_bindings(func, args)
    body = tirx.stmt_functor.substitute(func.body, sizes)
    buffers = [func.buffer_map[p] for p in func.params if p in func.buffer_map]
    counter = _Counter(buffers, _assigned_once(body), needs_data=values is not None)
    try:
        counter.stmt(body)
    except _NeedsData:
        counter = _Counter(buffers, _assigned_once(body), arrays=_arrays(func, values(), _written(body, buffers)))
        counter.stmt(body)
    return LaunchTraffic(ctas=counter.ctas, bytes_read=counter.bytes_read, bytes_written=counter.bytes_written,
                         sampled=counter.ctas, exact=counter.exact,
                         tensors=_per_tensor(func, args, counter.per_buffer, counter.shared),
                         sizes=tuple(sorted([(var.name, int(value.value)) for var, value in sizes.items()]
                                            + list(counter.grid.items()) + list(counter.data_sizes.items()))))


class _NeedsData(Exception):
    """A loop's extent reads data: the count starts again with the values of the arguments."""


def _written(body, buffers: list) -> set:
    """Data pointers of the parameter buffers the program may write (stores, and pointers handed to intrinsics or
    taken with address_of, which may be atomics): their values change while it runs."""
    globals_ = {buffer.data for buffer in buffers}
    written: set = set()

    def visit(node):
        if isinstance(node, S.BufferStore) and node.buffer.data in globals_:
            written.add(node.buffer.data)
        elif isinstance(node, E.Call) and _op_name(node) == "tirx.tvm_access_ptr" and node.args[4].value & 2:
            written.add(node.args[1])
        elif isinstance(node, E.Call) and _op_name(node) == "tirx.address_of":
            written.add(node.args[0].buffer.data)

    tirx.stmt_functor.post_order_visit(body, visit)
    return written & globals_


def _arrays(func: tirx.PrimFunc, values: list, written: set) -> dict:
    """Parameter buffer data pointer -> the numpy array of what its argument holds, for the tensors `values` gives
    of the buffer's type and rank (a bf16 buffer's values stay unknown) that the program does not write."""
    arrays = {}
    for param, value in zip(func.params, values):
        buffer = func.buffer_map.get(param)
        if (buffer is not None and value is not None and buffer.data not in written and value.dim() == len(buffer.shape)
                and str(value.dtype).removeprefix("torch.") == str(buffer.dtype) and value.dtype != torch.bfloat16):
            arrays[buffer.data] = value.detach().cpu().numpy()
    return arrays


def _per_tensor(func, args: list, per_buffer: dict, shared: dict) -> tuple[TensorTraffic, ...]:
    """Bytes requested, bytes stored and the reads earlier CTAs made too, per distinct storage behind the tensor
    arguments."""
    found: dict = {}
    for param, arg in zip(func.params, args):
        buffer = func.buffer_map.get(param)
        if buffer is not None and hasattr(arg, "untyped_storage"):
            storage = arg.untyped_storage()
            requested, size, gaps = found.get(storage.data_ptr(), (0.0, storage.nbytes(), {}))
            for gap, nbytes in shared.get(buffer.data, {}).items():
                gaps[gap] = gaps.get(gap, 0.0) + nbytes
            found[storage.data_ptr()] = (requested + per_buffer.get(buffer.data, 0.0), size, gaps)
    return tuple(TensorTraffic(requested, float(size), tuple(sorted(gaps.items())))
                 for requested, size, gaps in found.values())


def _size_bindings(func: tirx.PrimFunc, args: list) -> dict:
    """Each symbolic size, stride and scalar parameter of `func` -> its value in this call."""
    if len(args) != len(func.params):
        raise ValueError(f"{len(args)} arguments for a kernel of {len(func.params)} parameters")
    values: dict = {}

    def bind(symbol, value: int, what: str):
        if isinstance(symbol, tirx.Var):
            if symbol in values and values[symbol].value != value:
                raise ValueError(f"{what}: {symbol.name} is {values[symbol].value} elsewhere, {value} here")
            values[symbol] = tirx.const(value, symbol.dtype)
        elif isinstance(symbol, tirx.IntImm) and symbol.value != value:
            raise ValueError(f"{what} is {value}, the kernel expects {symbol.value}")

    for param, arg in zip(func.params, args):
        buffer = func.buffer_map.get(param)
        if buffer is None:
            values[param] = tirx.const(arg, param.dtype)
            continue
        if len(arg.shape) != len(buffer.shape):
            raise ValueError(f"{buffer.name} has {len(buffer.shape)} dimensions, its argument {len(arg.shape)}")
        for d, (symbol, size) in enumerate(zip(buffer.shape, arg.shape)):
            bind(symbol, int(size), f"dimension {d} of {buffer.name}")
        for d, (symbol, stride) in enumerate(zip(buffer.strides, arg.stride())):
            if isinstance(symbol, tirx.Var):  # a constant stride is not checked: size-1 dimensions take any
                bind(symbol, int(stride), f"stride {d} of {buffer.name}")
    return values


def _assigned_once(body) -> set:
    """Data pointers of the `T.alloc_var` locals, and of the buffers holding a ticket, the program stores to exactly
    once."""
    stores: dict = {}

    def visit(node):
        if isinstance(node, S.BufferStore) and (node.buffer.scope() == "local.var" or _is_ticket(node.value)):
            stores[node.buffer.data] = stores.get(node.buffer.data, 0) + 1

    tirx.stmt_functor.post_order_visit(body, visit)
    return {data for data, count in stores.items() if count == 1}


def _is_ticket(value) -> bool:
    """An atomic add's returned previous value (the arrival count of a split-K protocol)."""
    return isinstance(value, E.Call) and _op_name(value) == "tl.atomic_add_ret_elem_op"


def _bytes(dtype) -> float:
    return dtype.bits * dtype.lanes / 8


def _op_name(call: E.Call) -> str:
    return call.op.name if isinstance(call.op, tvm.ir.Op) else str(call.op)


@dataclass(frozen=True)
class _Dim:
    """A thread binding or loop variable ranging over [lo, lo + size)."""

    var: tirx.Var
    lo: int
    size: int


@dataclass(frozen=True, eq=False)
class _Guard:
    """One conjunct an access needs, over `variables` (Dims); variables is None when the conjunct cannot be
    evaluated (it reads data, or a variable out of scope) and is taken as true."""

    condition: tirx.PrimExpr
    variables: tuple | None = ()

    @property
    def unknown(self) -> bool:
        return self.variables is None


_NEVER = _Guard(tirx.const(False, "bool"))  # a guard the analyzer disproves: the access never executes


class _Counter:
    """Walks a lowered program in execution order, adding up the bytes of its global accesses."""

    def __init__(self, buffers: list, assigned_once: set, *, needs_data: bool = False, arrays: dict | None = None):
        self.globals = {buffer.data: buffer for buffer in buffers}
        self.assigned_once = assigned_once
        self.needs_data = needs_data  # raise _NeedsData at a loop whose extent reads data
        self.arrays = arrays or {}  # parameter buffer data pointer -> what it holds (numpy), where known
        self.data_sizes: dict = {}  # a local in a data-dependent loop extent (by name) -> its largest value
        self.analyzer = arith.Analyzer()
        self.dims: dict = {}  # Var -> _Dim, the variables in scope
        self.threads: set = set()  # the threadIdx variables
        self.guards: list[_Guard] = []
        self.loaded: set = set()  # the global loads the current statement has counted, with their guards
        self.bound: dict = {}  # let-bound Var -> its value
        self.held: dict = {}  # an assign-once local's data pointer -> the value stored to it
        self.counts: dict = {}  # a group of guards -> (the group, points satisfying it): kept alive, keyed by id
        self.ctas = 1
        self.grid: dict = {}  # "blockIdx.x" ... -> extent
        self.blocks: dict = {}  # "blockIdx.x" ... -> its variable
        self.shared: dict = {}  # a parameter buffer's data pointer -> {launch gap: bytes an earlier CTA read too}
        self.gaps: dict = {}  # an access's origin (structural hashes) -> reread_gaps of it
        self.bytes_read = 0.0
        self.bytes_written = 0.0
        self.per_buffer: dict = {}  # a parameter buffer's data pointer -> bytes requested of it
        self.exact = True

    # ------------------------------------------------------------------ statements

    def stmt(self, node):
        self.loaded = set()
        if isinstance(node, S.SeqStmt):
            for child in node.seq:
                self.stmt(child)
        elif isinstance(node, S.AttrStmt):
            if node.attr_key == "thread_extent":
                self.thread(node)
            else:
                self.stmt(node.body)
        elif isinstance(node, S.For):
            self.loop(node)
        elif isinstance(node, S.While):
            raise ValueError(f"a while loop (condition {node.condition}) has no bound: its traffic cannot be counted")
        elif isinstance(node, S.IfThenElse):
            self.expr(node.condition)
            with self.guarded(node.condition):
                self.stmt(node.then_case)
            if node.else_case is not None:
                with self.guarded(tirx.Not(node.condition)):
                    self.stmt(node.else_case)
        elif isinstance(node, S.Bind):
            self.expr(node.value)
            self.bound[node.var] = self.resolve(node.value)
        elif isinstance(node, S.BufferStore):
            self.store(node)
        elif isinstance(node, S.Evaluate):
            self.expr(node.value)
        elif isinstance(node, S.SBlockRealize):
            with self.guarded(node.predicate):
                self.stmt(node.block)
        elif isinstance(node, S.SBlock):
            if node.init is not None:
                self.stmt(node.init)
            self.stmt(node.body)
        elif isinstance(node, S.AssertStmt):
            self.expr(node.condition)
        elif not isinstance(node, (S.AllocBuffer, S.DeclBuffer)):
            raise NotImplementedError(f"{type(node).__name__} statement in a lowered TileLang program")

    def thread(self, node: S.AttrStmt):
        tag = node.node.thread_tag
        extent = self.constant(node.value, f"the extent of {tag}")
        if tag.startswith("blockIdx."):
            self.ctas *= extent
            self.grid[tag] = extent
            self.blocks[tag] = node.node.var
        elif tag.startswith("threadIdx."):
            self.threads.add(node.node.var)
        with self.dimension(node.node.var, 0, extent):
            self.stmt(node.body)

    def loop(self, node: S.For):
        self.expr(node.min)
        self.expr(node.extent)
        var, start, extent = node.loop_var, self.resolve(node.min), self.resolve(node.extent)
        if self.needs_data and _reads(start + extent, self.globals):
            raise _NeedsData
        lo = self.span(start, var, least=True)
        hi = self.span(start + extent - 1, var, least=False)
        if _reads(start + extent, self.globals):
            self.record_locals(node.extent)
        if hi < lo:
            return
        conditions = [start <= var, var < start + extent]
        if node.step is not None and not (isinstance(node.step, tirx.IntImm) and node.step.value == 1):
            conditions.append(tirx.floormod(var - start, self.resolve(node.step)) == 0)
        with self.dimension(var, lo, hi - lo + 1), self.guarded(*conditions):
            self.stmt(node.body)

    def store(self, node: S.BufferStore):
        if node.buffer.data in self.globals:
            self.moved(node.buffer.data, 0, self.executions(node.indices) * _bytes(node.value.dtype))
        elif node.buffer.data in self.assigned_once:
            value = self.ticket(node.value) if _is_ticket(node.value) else self.resolve(node.value)
            if value is not None:
                self.held[node.buffer.data] = value
        self.expr(node.value)
        for index in node.indices:
            self.expr(index)

    # ------------------------------------------------------------------ expressions

    def expr(self, node):
        """Count the global accesses evaluating `node` makes."""
        if isinstance(node, E.BufferLoad):
            if node.buffer.data in self.globals and self.first_load(node):
                self.moved(node.buffer.data, self.executions(node.indices) * _bytes(node.dtype), 0, node.indices)
            for index in node.indices:
                self.expr(index)
        elif isinstance(node, E.Call):
            self.call(node)
        elif isinstance(node, E.Select):
            self.branches(node.condition, node.true_value, node.false_value)
        elif isinstance(node, E.Let):
            self.expr(node.value)
            self.bound[node.var] = self.resolve(node.value)
            self.expr(node.body)
        elif isinstance(node, E.Var):
            if node in self.globals:
                raise NotImplementedError(f"{self.globals[node].name}'s data pointer is used raw (e.g. a TMA "
                                          "descriptor): not counted")
        else:
            for operand in _operands(node):
                self.expr(operand)

    def first_load(self, load: E.BufferLoad) -> bool:
        """Whether this statement has not loaded the same element under the same (evaluable) guards yet: copies
        of one load in an expression (a T.macro expanding its argument several times) are one request. The buffer
        is part of the key: the structural hash of A[i] and of C[i] is the same for two buffers of one shape."""
        key = (load.buffer.data, tvm.ir.structural_hash(load),
               tuple(tvm.ir.structural_hash(g.condition) for g in self.guards if not g.unknown))
        if key in self.loaded:
            return False
        self.loaded.add(key)
        return True

    def call(self, node: E.Call):
        op = _op_name(node)
        if op == "tirx.if_then_else":
            self.branches(*node.args)
        elif op == "tirx.tvm_access_ptr":
            self.pointer(node)
        elif op == "tl.ptx_cp_async" and len(node.args) == 4:  # (dst, src, elements, predicate): zero-fill if false
            self.expr(node.args[3])
            with self.guarded(node.args[3]):
                for arg in node.args[:3]:
                    self.expr(arg)
        elif op in ("tl.tma_load", "tl.tma_store") and isinstance(node.args[0], E.Call) \
                and _op_name(node.args[0]) == "tl.create_tma_descriptor":
            self.tma(node, load=op == "tl.tma_load")
        elif op == "tirx.address_of":
            load = node.args[0]
            if load.buffer.data in self.globals:
                raise NotImplementedError(f"the address of an element of {load.buffer.name} is taken: not counted")
            for index in load.indices:
                self.expr(index)
        else:
            for arg in node.args:
                self.expr(arg)

    def branches(self, condition, taken, otherwise):
        self.expr(condition)
        with self.guarded(condition):
            self.expr(taken)
        with self.guarded(tirx.Not(condition)):
            self.expr(otherwise)

    def pointer(self, node: E.Call):
        """tvm_access_ptr(type, data, offset, extent, access mask: 1 read, 2 write)."""
        annotation, data, offset, extent, mask = node.args
        for arg in (offset, extent):
            self.expr(arg)
        if data not in self.globals:
            return
        moved = self.executions([offset]) * self.constant(extent, f"a pointer extent into {self.globals[data].name}") \
            * _bytes(annotation.dtype)
        self.moved(data, moved if mask.value & 1 else 0, moved if mask.value & 2 else 0, [offset])

    def tma(self, node: E.Call, load: bool):
        """tma_load(descriptor, barrier, shared pointer, coordinates...) / tma_store(descriptor, shared pointer,
        coordinates...): the descriptor's box (create_tma_descriptor(type, rank, pointer, sizes[rank],
        strides[rank], box[rank], ...)) in elements of its buffer, once per execution. The whole box counts: TMA's
        out-of-bounds clipping is not modelled (an upper bound at tails)."""
        descriptor = node.args[0]
        rank = self.constant(descriptor.args[1], "a TMA descriptor's rank")
        data = descriptor.args[2]
        box = [self.constant(extent, "a TMA box extent") for extent in descriptor.args[3 + 2 * rank: 3 + 3 * rank]]
        coordinates = node.args[3:] if load else node.args[2:]
        for arg in (*descriptor.args[3:], *node.args[1:]):
            self.expr(arg)
        if data not in self.globals:
            return
        moved = self.executions(coordinates) * math.prod(box) * _bytes(self.globals[data].dtype)
        self.moved(data, moved if load else 0, 0 if load else moved, coordinates)

    def moved(self, data, read: float, written: float, address=None):
        """Count `read` and `written` bytes of the buffer behind `data`; a read at `address` (its index
        expressions) also counts what earlier CTAs read of it (`reread_gaps`)."""
        self.bytes_read += read
        self.bytes_written += written
        self.per_buffer[data] = self.per_buffer.get(data, 0.0) + read + written
        if read and address is not None:
            shared = self.shared.setdefault(data, {})
            for gap, fraction in self.reread_gaps(address).items():
                shared[gap] = shared.get(gap, 0.0) + read * fraction

    def reread_gaps(self, address) -> dict:
        """gap -> the fraction of the CTAs whose request at `address` the CTA launched `gap` places before them
        made too (launch order: blockIdx.x fastest, then y, then z). Two CTAs request the same elements where their
        block indices give the same origin: the address with every loop and thread variable at the start of its
        range; guards are not consulted (the CTAs that skip an access are few where the grid's tail skips it).
        Addresses that read data (gathers), and grids over MAX_ENUMERATED CTAs, share nothing."""
        origin = [_first_lane(self.analyzer.simplify(self.resolve(index))) for index in address]
        key = tuple(tvm.ir.structural_hash(e) for e in origin)
        if key not in self.gaps:
            self.gaps[key] = self._gaps_of(origin)
        return self.gaps[key]

    def _gaps_of(self, origin: list) -> dict:
        axes = [tag for tag in ("blockIdx.x", "blockIdx.y", "blockIdx.z") if tag in self.blocks]
        ctas = math.prod(self.grid[tag] for tag in axes)
        if ctas < 2 or ctas > MAX_ENUMERATED:
            return {}
        launch, stride, grid = np.arange(ctas, dtype=np.int64), 1, {}
        for tag in axes:
            grid[self.blocks[tag]] = launch // stride % self.grid[tag]
            stride *= self.grid[tag]
        columns = []
        for expr in origin:
            variables = _evaluable_variables(expr)
            if variables is None or any(v not in grid and v not in self.dims for v in variables):
                return {}
            starts = {v: self.dims[v].lo for v in variables if v not in grid}
            columns.append(np.broadcast_to(np.asarray(_evaluate(expr, grid | starts), dtype=np.int64), (ctas,)))
        groups = (np.unique(np.stack(columns, axis=1), axis=0, return_inverse=True)[1].reshape(-1) if columns
                  else np.zeros(ctas, dtype=np.int64))
        order = np.argsort(groups, kind="stable")  # each group's CTAs in launch order
        gaps = np.diff(order)[groups[order][1:] == groups[order][:-1]]
        if len(np.unique(gaps)) > MAX_GAPS:  # keep the record small: round gaps up to quarter powers of two
            gaps = np.ceil(2.0 ** (np.ceil(np.log2(gaps) * 4) / 4)).astype(np.int64)
        values, counts = np.unique(gaps, return_counts=True)
        return {int(gap): count / ctas for gap, count in zip(values, counts)}

    # ------------------------------------------------------------------ scopes and evaluation

    @contextlib.contextmanager
    def dimension(self, var, lo: int, size: int):
        self.dims[var] = _Dim(var, lo, size)
        self.analyzer.bind(var, tvm.ir.Range.from_min_extent(lo, max(size, 1)), allow_override=True)
        try:
            yield
        finally:
            del self.dims[var]

    @contextlib.contextmanager
    def guarded(self, *conditions):
        """Accesses inside need every condition: each conjunct is settled by the analyzer when it can be."""
        depth = len(self.guards)
        for condition in conditions:
            for conjunct in _conjuncts(self.resolve(condition)):
                self.guards += [] if self.analyzer.can_prove(conjunct) else [self.guard(conjunct)]
        try:
            yield
        finally:
            del self.guards[depth:]

    def guard(self, conjunct) -> _Guard:
        variables = _evaluable_variables(conjunct, self.arrays)
        if variables is None or any(v not in self.dims for v in variables):
            return _Guard(conjunct, None)
        if self.analyzer.can_prove(tirx.Not(conjunct)):
            return _NEVER
        return _Guard(conjunct, tuple(self.dims[v] for v in variables))

    def ticket(self, call: E.Call):
        """The value a ticket takes, atomic_add_ret(&Counter[blockIdx.k], 1): the CTAs of one counter element
        count in one at a time, each drawing a distinct value 0, 1, ..; the count hands them out in launch order,
        so a CTA's ticket is its linear index (x fastest) over the other block indices. None (the ticket stays
        data) for any other counter address or increment."""
        pointer, increment = call.args[0], self.resolve(call.args[1])
        if not (isinstance(pointer, E.Call) and _op_name(pointer) == "tirx.tvm_access_ptr"
                and isinstance(increment, tirx.IntImm) and increment.value == 1):
            return None
        counter = self.resolve(pointer.args[2])
        if not any(counter.same_as(var) for var in self.blocks.values()):
            return None
        rank, stride = tirx.const(0, "int32"), 1
        for tag in sorted(self.grid):
            if not self.blocks[tag].same_as(counter):
                rank, stride = rank + self.blocks[tag] * stride, stride * self.grid[tag]
        return rank

    def resolve(self, expr):
        """`expr` with let-bound variables and assign-once locals replaced by what they hold."""

        def replace(node):
            return self.held.get(node.buffer.data) if isinstance(node, E.BufferLoad) else self.bound.get(node)

        return tirx.stmt_functor.ir_transform(tirx.Evaluate(expr), None, replace,
                                              ["tirx.BufferLoad", "tirx.Var"]).value

    def constant(self, expr, what: str) -> int:
        value = self.analyzer.simplify(self.resolve(expr))
        if not isinstance(value, tirx.IntImm):
            raise ValueError(f"{what} is not a constant once the sizes are bound: {value}")
        return value.value

    def span(self, expr, loop, least: bool) -> int:
        """The least (or greatest) value `expr` takes in scope: over the values of the data it reads where they are
        known, else limit()'s bound."""
        values = self.enumerated(expr)
        if values is None:
            return self.limit(expr, loop, least)
        return int(values.min() if least else values.max())

    def enumerated(self, expr):
        """`expr`'s values over every point of the variables in scope it reads (numpy), where it reads known data and
        no more than MAX_ENUMERATED points; else None."""
        variables = _evaluable_variables(expr, self.arrays)
        if not _reads(expr, self.arrays) or variables is None or any(v not in self.dims for v in variables):
            return None
        dims = [self.dims[v] for v in variables]
        if math.prod(dim.size for dim in dims) > MAX_ENUMERATED:
            return None
        coords = np.meshgrid(*(np.arange(dim.lo, dim.lo + dim.size) for dim in dims), indexing="ij")
        return np.asarray(_evaluate(expr, dict(zip(variables, coords)), self.arrays))

    def record_locals(self, extent):
        """data_sizes[name] of the assign-once local a data-dependent loop extent reads, where it reads one (`for t in
        T.serial(tiles)`): its largest value over the CTAs, the heaviest CTA's trips, for the issue count (which
        evaluates the CUDA C loop bound with the sizes, kernels.sass.for_extent). An extent combining several
        locals records none: the largest of each would not bound their combination."""
        locals_ = []
        tirx.stmt_functor.post_order_visit(extent, lambda node: locals_.append(node) if isinstance(
            node, E.BufferLoad) and node.buffer.data in self.held else None)
        if len({load.buffer.data for load in locals_}) != 1:
            return
        values = self.enumerated(self.held[locals_[0].buffer.data])
        if values is not None:
            name = locals_[0].buffer.name
            self.data_sizes[name] = max(self.data_sizes.get(name, 0), int(values.max()))

    def limit(self, expr, loop, least: bool) -> int:
        """The least (or greatest) value `expr` takes in scope; from the sizes alone where it depends on data."""
        bound = self.analyzer.const_int_bound(self.analyzer.simplify(expr))
        value = bound.min_value if least else bound.max_value
        if abs(value) >= _UNBOUNDED:
            raise ValueError(f"loop {loop.name}: its range ({expr}) depends on data and the sizes do not bound it")
        return value

    def executions(self, address) -> int:
        """Points of the current box that satisfy the current guards, for an access at `address` (its index
        expressions): groups of guards sharing variables are counted together, the variables no guard mentions
        contribute their sizes, except thread bindings the address does not involve (the CTA's threads request
        one element)."""
        if any(guard is _NEVER for guard in self.guards):
            return 0
        groups: list[tuple[set, list]] = []  # (variables, guards)
        for guard in self.guards:
            if guard.unknown:
                self.exact = False
                continue
            variables = {dim.var for dim in guard.variables}
            touching = [g for g in groups if g[0] & variables]
            groups = [g for g in groups if all(g is not t for t in touching)]
            groups.append((variables.union(*(g[0] for g in touching)), [h for g in touching for h in g[1]] + [guard]))
        constrained = set().union(*(g[0] for g in groups))
        addressed = set()
        for index in address:
            tirx.stmt_functor.post_order_visit(self.resolve(index),
                                               lambda node: addressed.add(node) if isinstance(node, E.Var) else None)
        free = math.prod(dim.size for var, dim in self.dims.items()
                         if var not in constrained and (var not in self.threads or var in addressed))
        return free * math.prod(self.satisfying(guards) for _, guards in groups)

    def satisfying(self, group: list[_Guard]) -> int:
        key = tuple(id(guard) for guard in group)
        if key not in self.counts:
            self.counts[key] = (group, self.count_points(group))
        return self.counts[key][1]

    def count_points(self, group: list[_Guard]) -> int:
        dims = list({dim.var: dim for guard in group for dim in guard.variables}.values())
        points = math.prod(dim.size for dim in dims)
        if points > MAX_ENUMERATED:
            self.exact = False
            return points
        satisfied = 0
        for start in range(0, points, _CHUNK):
            flat = np.arange(start, min(start + _CHUNK, points), dtype=np.int64)
            coords = np.unravel_index(flat, [dim.size for dim in dims])
            grid = {dim.var: coord + dim.lo for dim, coord in zip(dims, coords)}
            held = np.ones(len(flat), dtype=bool)
            for guard in group:
                held &= np.broadcast_to(_evaluate(guard.condition, grid, self.arrays), held.shape).astype(bool)
            satisfied += int(np.count_nonzero(held))
        return satisfied


def _reads(expr, buffers) -> bool:
    """Whether `expr` loads from a buffer whose data pointer is in `buffers`."""
    found = []
    tirx.stmt_functor.post_order_visit(
        expr, lambda node: found.append(node) if isinstance(node, E.BufferLoad) and node.buffer.data in buffers else None)
    return bool(found)


def _first_lane(expr):
    """`expr` (an index, perhaps a vector: Ramp, Broadcast) at its first lane."""

    def first(node):
        return node.base if isinstance(node, E.Ramp) else node.value if isinstance(node, E.Broadcast) else None

    return tirx.stmt_functor.ir_transform(tirx.Evaluate(expr), None, first, ["tirx.Ramp", "tirx.Broadcast"]).value


def _conjuncts(condition) -> list:
    if isinstance(condition, E.And) or (isinstance(condition, E.Call) and _op_name(condition) == "tirx.bitwise_and"
                                        and condition.dtype == "bool"):
        a, b = (condition.a, condition.b) if isinstance(condition, E.And) else condition.args
        return _conjuncts(a) + _conjuncts(b)
    return [condition]


def _evaluable_variables(expr, arrays: dict | None = None) -> list | None:
    """The variables `expr` reads, in first-use order; None when `_evaluate` cannot evaluate it (it reads a
    buffer other than those `arrays` holds the values of, or calls something other than integer arithmetic)."""
    found: dict = {}
    evaluable = True
    arrays = arrays or {}

    def visit(node):
        nonlocal evaluable
        if isinstance(node, E.BufferLoad):
            evaluable &= node.buffer.data in arrays
        elif isinstance(node, E.Var):
            if node not in arrays:
                found[node] = None
        elif isinstance(node, E.Call):
            evaluable &= _op_name(node) in _NUMPY_CALLS
        elif not isinstance(node, (E.IntImm, E.FloatImm, E.Not, E.Select, E.Cast, E.BufferLoad, *_NUMPY_BINARY)):
            evaluable = False

    tirx.stmt_functor.post_order_visit(expr, visit)
    return list(found) if evaluable else None


def _operands(node) -> tuple:
    if isinstance(node, (E.IntImm, E.FloatImm, E.StringImm)):
        return ()
    if isinstance(node, E.Not):
        return (node.a,)
    if isinstance(node, (E.BinaryOpExpr, E.CmpExpr, E.LogicalExpr)):
        return (node.a, node.b)
    if isinstance(node, (E.Cast, E.Broadcast)):
        return (node.value,)
    if isinstance(node, E.Ramp):
        return (node.base, node.stride)
    if isinstance(node, E.Shuffle):
        return (*node.vectors, *node.indices)
    raise NotImplementedError(f"{type(node).__name__} expression in a lowered TileLang program")


def _truncdiv(a, b):
    return np.sign(a) * np.sign(b) * (np.abs(a) // np.abs(b))


_NUMPY_BINARY = {
    E.Add: np.add, E.Sub: np.subtract, E.Mul: np.multiply, E.FloorDiv: np.floor_divide, E.FloorMod: np.mod,
    E.Div: _truncdiv, E.Mod: lambda a, b: a - b * _truncdiv(a, b), E.Min: np.minimum, E.Max: np.maximum,
    E.LT: np.less, E.LE: np.less_equal, E.GT: np.greater, E.GE: np.greater_equal, E.EQ: np.equal,
    E.NE: np.not_equal, E.And: np.logical_and, E.Or: np.logical_or,
}
_NUMPY_CALLS = {
    "tirx.bitwise_and": np.bitwise_and, "tirx.bitwise_or": np.bitwise_or, "tirx.bitwise_xor": np.bitwise_xor,
    "tirx.bitwise_not": np.invert, "tirx.shift_left": np.left_shift, "tirx.shift_right": np.right_shift,
    "tirx.if_then_else": np.where,
}


def _evaluate(node, grid: dict, arrays: dict | None = None):
    """An integer / boolean expression over grid variables (numpy arrays), evaluated elementwise; a load from a
    buffer `arrays` holds (data pointer -> numpy array) reads it, its indices clamped to the array's bounds (every
    lane is evaluated, including those a condition around the load would skip)."""
    if isinstance(node, (E.IntImm, E.FloatImm)):
        return node.value
    if isinstance(node, E.Var):
        return grid[node]
    if isinstance(node, E.BufferLoad):
        array = arrays[node.buffer.data]
        indices = [np.clip(np.asarray(_evaluate(index, grid, arrays), dtype=np.int64), 0, size - 1)
                   for index, size in zip(node.indices, array.shape)]
        return array[tuple(np.broadcast_arrays(*indices))]
    if type(node) in _NUMPY_BINARY:
        if isinstance(node, E.Div) and not str(node.dtype).startswith(("int", "uint")):
            return np.true_divide(_evaluate(node.a, grid, arrays), _evaluate(node.b, grid, arrays))
        return _NUMPY_BINARY[type(node)](_evaluate(node.a, grid, arrays), _evaluate(node.b, grid, arrays))
    if isinstance(node, E.Not):
        return np.logical_not(_evaluate(node.a, grid, arrays))
    if isinstance(node, E.Select):
        return np.where(*(_evaluate(x, grid, arrays) for x in (node.condition, node.true_value, node.false_value)))
    if isinstance(node, E.Cast):
        value = _evaluate(node.value, grid, arrays)
        return np.asarray(value).astype(bool if node.dtype == "bool" else np.float64 if "float" in node.dtype
                                        else np.int64)
    if isinstance(node, E.Call) and _op_name(node) in _NUMPY_CALLS:
        return _NUMPY_CALLS[_op_name(node)](*(_evaluate(arg, grid, arrays) for arg in node.args))
    raise AssertionError(f"not evaluable: {node}")  # _evaluable_variables admits only the forms above
