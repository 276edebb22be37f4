"""Shared TileLang machinery: the CPU/GPU flavour switch, compilation, and the sm_90a build.

One kernel source serves two targets. A kernel factory takes a `Flavour` and asks it for
memory scopes, the loop form and the storage type of narrow floats; the tiling, index math,
masks and reductions are the same code for both:

    GPU (CUDA):  shared memory, register fragments, T.Parallel, native bf16 / fp8 tensors
    CPU (C):     local buffers, serial T.grid loops, bf16 / fp8 passed as integer views and
                 decoded by the bit codecs in `codecs`

The CPU build is real C compiled with -O2 and is what the equivalence tests run; the GPU
flavour is lowered for sm_90a and compiled with nvcc by `build_sm90` so that GPU build
breaks are caught on machines without a GPU.

TileLang (and TVM under it) is imported when a TileLang kernel is first built, compiled or lowered, not when
flashkern is: `T` here is `tilelang.language` loaded on its first attribute use, and the kernel modules take it
from here (`from flashkern.kernels._tilelang import T`), so a process that runs only Triton never loads TVM.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import os
import shutil
import subprocess
import tempfile
import types
from dataclasses import dataclass, field
from typing import Callable

import torch


class LazyModule(types.ModuleType):
    """A module imported on its first attribute use (the usual import, through sys.modules; nothing else changes)."""

    def __getattr__(self, attribute: str):
        module = importlib.import_module(self.__name__)
        self.__dict__.update(vars(module))  # later lookups are plain attribute reads
        return getattr(module, attribute)


tilelang = LazyModule("tilelang")
T = LazyModule("tilelang.language")

from flashkern.kernels._tilelang import codecs  # noqa: E402  (codecs takes T from here)
from flashkern.kernels import gpu_lint
from flashkern.kernels.build import (NO_TRAFFIC, BuildReport, LaunchTraffic, assemble, cached_report, command_assembler,
                                     source_digest)


CPU_PASS_CONFIGS = {"tirx.disable_vectorize": True}  # math inside auto-vectorized loops fails on the C target
CPU_COMPILE_FLAGS = ["-O2"]  # the C compiler otherwise runs at -O0 (about 13x slower)
SM90_ARCH = "sm_90a"  # "sm_90" compiles but emits no wgmma
_THIS_SOURCE = source_digest(__file__)  # how kernels are lowered and built


@dataclass(frozen=True)
class Flavour:
    """Memory scopes, loop form and narrow-float storage for one target."""

    on_gpu: bool

    @property
    def shared(self):
        return T.alloc_shared if self.on_gpu else T.alloc_local

    @property
    def fragment(self):
        return T.alloc_fragment if self.on_gpu else T.alloc_local

    @property
    def parallel(self):
        return T.Parallel if self.on_gpu else T.grid

    @property
    def bf16(self) -> str:
        """Storage dtype of bf16 tensors as the kernel declares them."""
        return "bfloat16" if self.on_gpu else "uint16"

    def bf16_arg(self, tensor):
        """A bf16 tensor as the kernel takes it: itself on GPU, its uint16 bit view on CPU."""
        return tensor if self.on_gpu else tensor.view(torch.uint16)

    def load_bf16(self, value):
        """fp32 value of one stored bf16 element."""
        return T.Cast("float32", value) if self.on_gpu else codecs.bf16_to_f32(value)

    def round_bf16(self, x):
        """x rounded to the nearest bf16 (ties to even), as fp32."""
        if self.on_gpu:
            return T.Cast("float32", T.Cast("bfloat16", x))
        return codecs.bf16_to_f32(codecs.f32_to_bf16(x))

    def mul_bf16x2(self, a, b):
        """The bits (uint32) of two bf16 products, a and b each the bits of a bf16x2: one HMUL2.BF16 on the GPU;
        on the CPU each half in fp32, rounded to the nearest bf16."""
        if self.on_gpu:
            return T.reinterpret(T.reinterpret(a, "bfloat16x2") * T.reinterpret(b, "bfloat16x2"), "uint32")
        low = codecs.f32_to_bf16(codecs.bf16_to_f32(a & 0xFFFF) * codecs.bf16_to_f32(b & 0xFFFF))
        high = codecs.f32_to_bf16(codecs.bf16_to_f32(a >> 16) * codecs.bf16_to_f32(b >> 16))
        return T.Cast("uint32", low) | T.shift_left(T.Cast("uint32", high), T.uint32(16))

    @property
    def put_bf16x2(self):
        """A macro put(values, c, bits): values[c], values[c + 1] = the two bf16 of `bits` (low half first), into a
        local buffer (`operand` dtype): one register on the GPU; two fp32 values on the CPU (whose gemm tiles are
        fp32). A vectorized copy then moves the buffer into a (swizzled) shared tile in 16-byte stores."""
        on_gpu = self.on_gpu

        @T.macro
        def put(values, c, bits):
            if on_gpu:
                values[T.Ramp(c, 1, 2)] = T.reinterpret(bits, "bfloat16x2")
            else:
                values[c] = codecs.bf16_to_f32(bits & 0xFFFF)
                values[c + 1] = codecs.bf16_to_f32(bits >> 16)

        return put

    def tma_arg(self, tensor):
        """A tensor a kernel T.copy's from, as it is where a TMA descriptor can address it (16-byte aligned base and
        leading strides), else a contiguous copy: on sm_90a TileLang lowers such copies to TMA, whose descriptor
        refuses other layouts at launch. Reads only the layout, never values."""
        item = tensor.element_size()
        aligned = tensor.data_ptr() % 16 == 0 and all(s * item % 16 == 0 for s in tensor.stride()[:-1])
        return tensor if aligned or not self.on_gpu else tensor.clone(memory_format=torch.contiguous_format)

    def store_bf16(self, x):
        """fp32 x as a stored bf16 element (rounded to nearest, ties to even): bf16 on GPU, its bits on CPU."""
        return T.Cast("bfloat16", x) if self.on_gpu else codecs.f32_to_bf16(x)


CPU = Flavour(on_gpu=False)
GPU = Flavour(on_gpu=True)


@contextlib.contextmanager
def _c_wrapper_with_strides():
    """While open, the C target takes tensors with dynamic strides (`T.StridedTensor(shape, (S, 1), ...)`, S =
    T.dynamic).

    TileLang 0.1.15's C host wrapper declares only the dynamic *shape* symbols as `call(...)` arguments, while
    the kernel it calls (and the Cython adapter, which reads the symbols from the torch tensors: shapes first,
    then strides) also carry the stride symbols, so such a kernel fails to compile. The CUDA wrapper lists
    shapes then strides; this gives the C wrapper the same list, in the same order, for our compiles only.
    """
    from tilelang.jit.adapter.wrapper import TLCPUSourceWrapper
    from tvm import tirx

    shape_symbols = TLCPUSourceWrapper.get_dynamic_symbolic_set

    def shape_and_stride_symbols(self, prim_func):
        symbols = dict(shape_symbols(self, prim_func))
        for param in prim_func.params:
            if param in prim_func.buffer_map:
                for stride in prim_func.buffer_map[param].strides:
                    if isinstance(stride, tirx.Var) and stride.name not in symbols:
                        symbols[stride.name] = str(stride.dtype)
        return list(symbols.items())

    TLCPUSourceWrapper.get_dynamic_symbolic_set = shape_and_stride_symbols
    try:
        yield
    finally:
        TLCPUSourceWrapper.get_dynamic_symbolic_set = shape_symbols


# What our C compiles skip once the program is legal (after C_LEGALIZED_BY: the passes up to it rely on simplified
# forms): arithmetic simplifiers and code motion that only tidy the program for the next pass or the printer. The C
# compiler (-O2) does the same folding and hoisting; CUDA builds run them all (their source is what GPU users get).
# What the program computes is untouched: every C-flavour test compares it to the reference.
C_LEGALIZED_BY = "tl.LegalizeSafeMemoryAccess"
C_SKIPPED_PASSES = frozenset({"tl.Simplify", "tirx.Simplify", "s_tir.HoistIfThenElse", "tirx.RemoveNoOp",
                              "tl.LoopUnswitching", "s_tir.RenormalizeSplitPattern"})


@contextlib.contextmanager
def _c_pipeline_without_simplifiers():
    """While open, TileLang compiles skip C_SKIPPED_PASSES after C_LEGALIZED_BY, through TileLang's per-compile
    instrumentation session (a tool whose pass instrument, one per compile, declines them); nothing outside the
    session changes. A TileLang that runs no C_LEGALIZED_BY skips nothing.

    Why: a C compile of 4-30 s here is nearly all TVM passes, about half of it these (sparse_decode_attention 31 ->
    17 s, paged_mqa_logits 26 -> 12 s, mhc_pre 11 -> 5 s at their first smoke shapes). It is also a fix: the
    simplifier TileLang 0.1.15 runs just before printing folds a float constant into a bit reinterpretation (a bf16
    store of -inf), which the C code generator prints as `*(uint32_t *)(&(-INFINITY))`, the address of a constant,
    which does not compile (tests/test_compile_check.py notices when a TileLang upgrade fixes it).
    """
    from tilelang.instrumentation.session import PassInstrumentationTool, compile_pass_instrumentation
    from tvm.ir.instrument import pass_instrument

    @pass_instrument
    class DeclineOnceLegal:
        def __init__(self):
            self.legal = False

        def should_run(self, mod, info) -> bool:
            if not self.legal:
                self.legal = info.name == C_LEGALIZED_BY
                return True
            return info.name not in C_SKIPPED_PASSES

    class SkipSimplifiers(PassInstrumentationTool):
        def create_pass_instrument(self):
            return DeclineOnceLegal()

    with compile_pass_instrumentation(name="flashkern-c", tools=[SkipSimplifiers()], reuse_existing=False):
        yield


@contextlib.contextmanager
def _quiet_tilelang():
    """TileLang's "begins/completes to compile" INFO lines off while we compile; its level restored after."""
    tilelang_log = logging.getLogger("tilelang")
    level = tilelang_log.level
    tilelang_log.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        tilelang_log.setLevel(level)


def placeholder(shape: tuple, dtype: torch.dtype, device, fill: int = 0) -> torch.Tensor:
    """A tensor filled with `fill` for an argument whose input is absent (no bias, no sink, no window cache): made
    once per (shape, dtype, device, fill) and shared by every call, so no kernel may write it."""
    return _placeholder(tuple(shape), dtype, torch.device(device), fill)


@functools.cache
def _placeholder(shape: tuple, dtype: torch.dtype, device: torch.device, fill: int) -> torch.Tensor:
    return torch.full(shape, fill, dtype=dtype, device=device)


def row_strided(shape: tuple, dtype: str, name: str):
    """A global tensor [shape] whose leading dimensions have run-time strides (named `<name>_stride<i>`) and whose
    last dimension is unit-stride: what an argument checked with `checks.tensor(..., strided=True)` may be."""
    strides = tuple(T.dynamic(f"{name}_stride{i}") for i in range(len(shape) - 1)) + (1,)
    return T.StridedTensor(shape, strides, dtype)


def compile_cpu(prim_func):
    """Compile a CPU-flavour kernel to C with optimization (TileLang caches it on disk too).

    TileLang 0.1.15 writes the C source and library of each compile to the temporary folder and never removes them
    (thousands of files after a test run); they are written to a folder of ours, removed once the library is loaded
    and copied to TileLang's cache. The folder is set through `tempfile.tempdir`, a process-wide setting: compiles
    must not run on several threads of one process at once (ours run one per process). TileLang's C target needs two
    fixes, both applied only while this compile runs: _c_wrapper_with_strides and _c_pipeline_without_simplifiers."""
    with tempfile.TemporaryDirectory(prefix="flashkern-c-") as folder, _quiet_tilelang(), \
            _c_wrapper_with_strides(), _c_pipeline_without_simplifiers():
        shared_default, tempfile.tempdir = tempfile.tempdir, folder
        try:
            return tilelang.compile(prim_func, target="c", pass_configs=CPU_PASS_CONFIGS,
                                    compile_flags=CPU_COMPILE_FLAGS)
        finally:
            tempfile.tempdir = shared_default


def compile_cuda(prim_func, pass_configs: dict | None = None):
    """JIT-compile a GPU-flavour kernel for the current CUDA device."""
    with _quiet_tilelang():
        return tilelang.compile(prim_func, target="cuda", pass_configs=pass_configs or {})


def _sm90_target():
    from tvm.target import Target

    return Target({"kind": "cuda", "arch": SM90_ARCH})


def lower_sm90(prim_func, pass_configs: dict | None = None):
    """Lower a GPU-flavour kernel for sm_90a: returns (CUDA source, dynamic shared memory bytes, threads)."""
    from tvm import transform

    target = _sm90_target()
    with transform.PassContext(opt_level=3, config=pass_configs or {}), target:
        with _quiet_tilelang():
            artifact = tilelang.lower(prim_func, target=target)
    smem, threads = 0, 0
    for _, fn in artifact.device_mod.functions.items():
        attrs = fn.attrs or {}
        if "dyn_shared_memory_buf" in attrs:
            smem = max(smem, int(attrs["dyn_shared_memory_buf"]))
        if "thread_extent" in attrs:
            threads = max(threads, int(attrs["thread_extent"].get("threadIdx.x", 0)))
    return artifact.kernel_source, smem, threads


@functools.cache
def c_compiler() -> str | None:
    """The C compiler TileLang's C target needs, or None."""
    return shutil.which("cc") or shutil.which("gcc")


@functools.cache
def nvcc_path() -> str | None:
    """The CUDA compiler, or None where it is absent (sm_90a builds are then skipped)."""
    return shutil.which("nvcc") or next(
        (p for p in ("/usr/local/cuda/bin/nvcc", "/usr/local/bin/nvcc") if os.path.exists(p)), None
    )


def _include_dirs() -> list[str]:
    root = os.path.dirname(tilelang.__file__)
    return [os.path.join(root, "src"), os.path.join(root, "3rdparty", "cutlass", "include")]


@functools.cache
def _nvcc_version() -> str:
    nvcc = nvcc_path()
    return "" if nvcc is None else subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout


def build_sm90(prim_func, pass_configs: dict | None = None) -> BuildReport:
    """Lower for sm_90a, compile to PTX and assemble with nvcc; report registers, spills, shared memory and the
    PTX census. Reports are kept on disk (kernels.build.cached_report), keyed on the kernel's TIR, the pass
    options, TileLang's and nvcc's versions and this module's source."""
    depends_on = (prim_func.script(), sorted((pass_configs or {}).items()), SM90_ARCH, tilelang.__version__,
                  _nvcc_version(), _THIS_SOURCE)
    return cached_report(depends_on, lambda: _build_sm90(prim_func, pass_configs))


def _build_sm90(prim_func, pass_configs: dict | None) -> BuildReport:
    source, dyn_smem, threads = lower_sm90(prim_func, pass_configs)
    nvcc = nvcc_path()
    if nvcc is None:
        raise FileNotFoundError("nvcc not found: the TileLang sm_90a build needs the CUDA compiler")
    with tempfile.TemporaryDirectory(prefix="flashkern-sm90-") as tmp:
        src = os.path.join(tmp, "kernel.cu")
        with open(src, "w") as f:
            f.write(source)
        # C++20 and fast math (when the kernel asks for it) as TileLang's own CUDA build uses them
        fast_math = ["--use_fast_math"] if (pass_configs or {}).get("tl.enable_fast_math") else []
        cmd = [nvcc, "-std=c++20", f"-arch={SM90_ARCH}", "-ptx", "-lineinfo", "-w", *fast_math,
               "-o", os.path.join(tmp, "kernel.ptx"), src]
        for inc in _include_dirs():
            cmd += ["-I", inc]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError("nvcc failed:\n" + (proc.stderr or proc.stdout)[-4000:])
        with open(os.path.join(tmp, "kernel.ptx")) as f:
            ptx = f.read()
    # ptxas as TileLang's own build runs it (tilelang/jit/adapter/libgen.py): nvcc's defaults and its register
    # usage level when the kernel sets one
    usage = (pass_configs or {}).get("tl.ptxas_register_usage_level")
    ptxas_options = [f"--ptxas-options=--register-usage-level={int(usage)}"] if usage is not None else []
    report = assemble(ptx, command_assembler([nvcc, "-cubin", f"-arch={SM90_ARCH}", "--resource-usage", "-w",
                                              "-lineinfo", *ptxas_options]),
                      {src: source}, hazards=gpu_lint.lint_cuda(source))
    return report.with_(smem=report.smem + dyn_smem, threads=threads)


_BY_SOURCE: dict = {}  # (kernel source, on GPU, GPU pass configs) -> compiled kernel, for every TileLangKernel


def _stages(value) -> tuple:
    return value if isinstance(value, tuple) else (value,)


def _first_tensor(out) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out[0]


@dataclass(frozen=True, eq=False)
class TileLangKernel:
    """A TileLang implementation from one source for both targets.

    program(problem, config, flavour) -> prim_func, with dynamic sizes for what varies per call;
    arguments(problem, inputs, config, flavour, out) -> kernel arguments, or None when there is nothing to launch
    (having written `out` itself); the kernels write every element of `out`, the outputs the caller allocated.
    A multi-stage implementation returns a tuple of prim_funcs and a tuple of argument lists (None
    skips a stage); the stages run in order.
    gpu_pass_configs: TileLang pass options for the CUDA build (the same for JIT and the sm_90a check).
    layout(inputs) -> a hashable the programs specialize on besides the problem and config, from the inputs'
    metadata only (pointer and stride alignment, never values); with it, program(problem, config, flavour, layout).
    Compiled kernels are cached per (problem.specialization(), config, target, layout).
    """

    program: Callable
    arguments: Callable
    gpu_pass_configs: dict = field(default_factory=dict)
    min_capability: tuple[int, int] = (8, 0)
    layout: Callable | None = None
    cpu_mode = "TileLang C target (compiled with -O2)"
    _compiled: dict = field(default_factory=dict, repr=False)

    def layout_of(self, inputs: dict):
        """What the programs specialize on in `inputs` (None where they specialize on nothing)."""
        return None if self.layout is None else self.layout(inputs)

    def programs(self, problem, config, fl: Flavour, layout) -> tuple:
        """The stages' prim_funcs for inputs of `layout` (layout_of)."""
        if self.layout is None:
            return _stages(self.program(problem, config, fl))
        return _stages(self.program(problem, config, fl, layout))

    def compiled(self, problem, config, fl: Flavour, inputs: dict) -> tuple:
        layout = self.layout_of(inputs)
        key = (problem.specialization(), tuple(sorted(config.items())), fl.on_gpu, layout)
        if key not in self._compiled:
            self._compiled[key] = tuple(self._compile(func, fl) for func in self.programs(problem, config, fl, layout))
        return self._compiled[key]

    def _compile(self, func, fl: Flavour):
        """One compiled kernel per distinct source in the process: specializations that differ only in dynamic sizes,
        and implementations that share a stage (mhc_pre and mhc_post_pre's epilogue), share it."""
        source = (func.script(), fl.on_gpu, tuple(sorted(self.gpu_pass_configs.items())) if fl.on_gpu else ())
        if source not in _BY_SOURCE:
            _BY_SOURCE[source] = (compile_cuda(func, self.gpu_pass_configs) if fl.on_gpu else compile_cpu(func))
        return _BY_SOURCE[source]

    def _stage_arguments(self, problem, inputs, config, fl: Flavour, out, stages: int) -> tuple:
        """Each stage's argument list (None: the stage does not run)."""
        args = self.arguments(problem, inputs, config, fl, out)
        return (None,) * stages if args is None else (args,) if stages == 1 else args

    def run(self, problem, inputs, config, out):
        fl = GPU if _first_tensor(out).is_cuda else CPU
        kernels = self.compiled(problem, config, fl, inputs)
        for kernel, stage_args in zip(kernels, self._stage_arguments(problem, inputs, config, fl, out, len(kernels))):
            if stage_args is not None:
                kernel(*stage_args)
        return out

    @staticmethod
    def build_key(problem, config) -> tuple:
        """What an sm_90a build depends on: the problem without its sizes (dynamic in the kernels) and the config
        (a build's inputs come from the operator's make_inputs, in its usual layout)."""
        return problem.specialization(), tuple(sorted(config.items()))

    def build_stages_sm90(self, problem, inputs, config, out) -> tuple[BuildReport, ...]:
        """Each stage's sm_90a build report."""
        return tuple(build_sm90(func, self.gpu_pass_configs)
                     for func in self.programs(problem, config, GPU, self.layout_of(inputs)))

    def build_sm90(self, problem, inputs, config, out) -> BuildReport:
        return BuildReport.merge(self.build_stages_sm90(problem, inputs, config, out))

    def traffic(self, problem, inputs, config, out) -> tuple[LaunchTraffic, ...]:
        """Each stage's global-memory traffic as the GPU flavour's design requests it (kernels/_tilelang/traffic).
        A stage whose loop extents read data (a candidate count an earlier stage wrote) is counted with the values
        its arguments hold when it starts: the C flavour of the earlier stages is run to produce them."""
        funcs = self.programs(problem, config, GPU, self.layout_of(inputs))
        stage_args = self._stage_arguments(problem, inputs, config, GPU, out, len(funcs))
        earlier = _EarlierStages(self, problem, inputs, config, out, len(funcs))
        from flashkern.kernels._tilelang import traffic as counter  # an instrument (TVM passes): loaded when used

        return tuple(NO_TRAFFIC if args is None else
                     counter.measure(func, list(args), self.gpu_pass_configs, functools.partial(earlier.values, i))
                     for i, (func, args) in enumerate(zip(funcs, stage_args)))

    def unavailable(self, device) -> str | None:
        """Why this cannot run on `device` (a DeviceInfo), or None."""
        if device.kind == "cpu":
            return None if c_compiler() else "no C compiler for TileLang's C target"
        if device.capability < self.min_capability:
            return f"needs compute capability {self.min_capability[0]}.{self.min_capability[1]}+"
        return None


class _EarlierStages:
    """What a call's arguments hold when stage i starts: the C flavour's stages before it run (once, in order, each
    compiled when it first runs) on its own arguments, which correspond to the GPU flavour's position by position."""

    def __init__(self, kernel: TileLangKernel, problem, inputs, config, out, stages: int):
        self.kernel, self.problem, self.inputs, self.config, self.out, self.stages = (kernel, problem, inputs, config,
                                                                                      out, stages)
        self.args = None
        self.ran = 0

    def values(self, stage: int) -> list:
        if self.args is None:
            self.args = self.kernel._stage_arguments(self.problem, self.inputs, self.config, CPU, self.out, self.stages)
            self.funcs = self.kernel.programs(self.problem, self.config, CPU, self.kernel.layout_of(self.inputs))
        if stage < self.ran:
            raise ValueError(f"stage {stage}'s values asked after stage {self.ran - 1} ran")
        for func, args in zip(self.funcs[self.ran:stage], self.args[self.ran:stage]):
            if args is not None:
                self.kernel._compile(func, CPU)(*args)
        self.ran = stage
        return [arg if isinstance(arg, torch.Tensor) else None for arg in self.args[stage] or ()]
