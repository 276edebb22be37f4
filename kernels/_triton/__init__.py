"""Shared Triton machinery: launch records, the ahead-of-time sm_90a build, numeric helpers.

Without a GPU, flashkern runs Triton kernels under the interpreter (TRITON_INTERPRET=1 is set
by `import flashkern` before any kernel is defined). Interpreted kernels cannot be compiled, so
the sm_90a build runs in a worker process started with TRITON_INTERPRET=0 (see
flashkern.compile_check); inside it, `build_sm90` compiles a `Launch` for
GPUTarget("cuda", 90, 32), reads its resources from the JIT's own PTX -> cubin step (the backend's
make_cubin: its ptxas and flags) and lints its TTGIR (kernels.gpu_lint).

Interpreter pitfalls handled here:
- fp32 -> bf16 casts truncate under the interpreter (the GPU rounds to nearest even):
  use `round_to_bf16`, exact on both.
- bf16 `tl.dot` multiplies raw bit patterns under the interpreter: kernels upcast bf16
  operands to fp32 before `tl.dot` (exact: bf16 values are exact in fp32 and in tf32).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import triton
import triton.language as tl

import flashkern
from flashkern.kernels import gpu_lint
from flashkern.kernels.build import NO_TRAFFIC, BuildReport, LaunchTraffic, assemble

_POINTER_TYPES = {
    torch.float32: "*fp32",
    torch.float16: "*fp16",
    torch.bfloat16: "*bf16",
    torch.float8_e4m3fn: "*fp8e4nv",
    torch.int64: "*i64",
    torch.int32: "*i32",
    torch.int16: "*i16",
    torch.int8: "*i8",
    torch.uint8: "*u8",
    torch.bool: "*i1",
}


@dataclass
class Launch:
    """One kernel launch: the kernel, its grid, its arguments by parameter name, and launch options."""

    kernel: Any
    grid: tuple[int, ...]
    args: dict[str, Any]
    num_warps: int = 4
    num_stages: int = 2
    options: dict[str, Any] = field(default_factory=dict)
    # CTAs that finish one piece of work together, consecutive in CUDA's x-fastest block order (the split-K CTAs of
    # a tile whose last arrival runs the epilogue): the traffic count samples and traces them as whole groups
    cooperating: int = 1

    def __call__(self) -> None:
        if flashkern._TRITON_INTERPRETED:  # numpy runs the kernel: its warnings on NaN / inf / padding lanes are not
            # the caller's (floating-point errors; "All-NaN slice" from its reductions)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                self.kernel[self.grid](**self.args, num_warps=self.num_warps, num_stages=self.num_stages,
                                       **self.options)
            return
        self.kernel[self.grid](**self.args, num_warps=self.num_warps, num_stages=self.num_stages, **self.options)


def _params(kernel):
    """The kernel's parameters as the JIT sees them (constexpr, do_not_specialize), interpreted or not."""
    if hasattr(kernel, "params"):
        return kernel.params
    from triton.runtime.jit import JITFunction

    options = {name: kernel.kwargs.get(name) for name in ("do_not_specialize", "do_not_specialize_on_alignment")}
    return JITFunction(kernel.fn, **options).params


def _signature(launch: Launch):
    """Triton signature, constexprs and attributes for an AOT build, specialized as the JIT specializes them at run
    time: an integer equal to 1 becomes the constant 1, integers divisible by 16 and 16-byte-aligned pointers get
    `tt.divisibility = 16` (unless the kernel opts out with do_not_specialize / do_not_specialize_on_alignment)."""
    signature, constexprs, attrs = {}, {}, {}
    for index, param in enumerate(_params(launch.kernel)):
        value = launch.args[param.name]
        specialize = not param.do_not_specialize
        aligned = specialize and not param.do_not_specialize_on_alignment
        if param.is_constexpr or value is None or (specialize and type(value) is int and value == 1):
            signature[param.name] = "constexpr"
            constexprs[param.name] = value
        elif isinstance(value, torch.Tensor):
            signature[param.name] = _POINTER_TYPES[value.dtype]
            if aligned and value.data_ptr() % 16 == 0:
                attrs[(index,)] = [["tt.divisibility", 16]]
        elif isinstance(value, bool):
            signature[param.name] = "i1"
        elif isinstance(value, int):
            signature[param.name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            if aligned and value % 16 == 0:
                attrs[(index,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[param.name] = "fp32"
        else:
            raise TypeError(f"argument {param.name!r}: cannot type {type(value).__name__} for an AOT build")
    return signature, constexprs, attrs


def compile_key(launch: Launch) -> tuple:
    """What the JIT compiles `launch` for: the kernel, its specialized signature and its launch options. Two launches
    with one key share one compiled kernel."""
    signature, constexprs, attrs = _signature(launch)
    return (launch.kernel.fn.__qualname__, tuple(signature.items()), tuple(sorted(map(repr, constexprs.items()))),
            tuple(sorted(attrs)), launch.num_warps, launch.num_stages, tuple(sorted(launch.options.items())))


def register_bound(num_warps: int) -> dict:
    """Launch options bounding a CTA of `num_warps` by the registers one CTA an SM may have (64K shared, at most
    255 a thread: PTX .maxnreg). Without a bound, ptxas 13 at the JIT's --regAllocOptLevel=2 picks an occupancy of
    its own and spills to reach it: the split top-k's candidate stage took 128 registers and 80 B of spills, 145 and
    none with the bound; mhc_pre's GEMM at 16 tokens 80 and 8 B, 94 and none."""
    return {"maxnreg": min(255, 65536 // (32 * num_warps))}


def _sm90_backend():
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend

    return make_backend(GPUTarget("cuda", 90, 32))


def jit_assembler(options: dict):
    """kernels.build.Assembler of the JIT: the NVIDIA backend's own make_cubin (the ptxas, flags and line info the
    installed Triton uses: 3.9 adds --regAllocOptLevel=2, 3.6 does not) with its ptxas log printed (Triton's
    dump_ptxas_log knob, inside its scope) and captured."""
    import contextlib
    import io

    from triton import knobs

    backend = _sm90_backend()
    parsed = backend.parse_options(options)

    def run(ptx: str) -> tuple[bytes, str]:
        with knobs.nvidia.scope(), contextlib.redirect_stdout(io.StringIO()) as log:
            knobs.nvidia.dump_ptxas_log = True
            cubin = backend.make_cubin(ptx, {}, parsed, 90)
        return cubin, log.getvalue()

    return run


def _launch_options(launch: Launch) -> dict:
    return {"num_warps": launch.num_warps, "num_stages": launch.num_stages, **launch.options}


def compile_sm90(launch: Launch):
    """triton.compile of `launch` for compute capability 9.0, specialized as the JIT would (in a process with
    TRITON_INTERPRET=0): the compiled kernel, its .asm holding ttgir, ptx and cubin."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if not hasattr(launch.kernel, "cache_key"):
        raise RuntimeError("AOT builds need TRITON_INTERPRET=0 in the building process")
    signature, constexprs, attrs = _signature(launch)
    return triton.compile(ASTSource(launch.kernel, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                          options=_launch_options(launch))


def build_sm90(launch: Launch) -> BuildReport:
    """Compile `launch` ahead of time for compute capability 9.0 and report its resources as the JIT's assembler
    reports them, with the lint of its TTGIR."""
    compiled = compile_sm90(launch)
    report = assemble(compiled.asm["ptx"], jit_assembler(_launch_options(launch)),
                      hazards=gpu_lint.lint_ttgir(compiled.asm["ttgir"]))
    return report.with_(smem=max(report.smem, compiled.metadata.shared), threads=32 * launch.num_warps)


def _stages(launches) -> tuple[Launch, ...]:
    return launches if isinstance(launches, tuple) else (launches,)


@dataclass(frozen=True)
class TritonKernel:
    """A Triton implementation: `plan(problem, inputs, config, out) -> launches` does the rest.

    `launches` is one Launch, or a tuple of them run in order (a multi-stage implementation); together they
    write every element of `out` (the operator's outputs, allocated by the caller).
    """

    plan: Any
    min_capability: tuple[int, int] = (8, 0)
    cpu_mode = "Triton interpreter (correct, not a speed contender)"

    def run(self, problem, inputs, config, out):
        for launch in _stages(self.plan(problem, inputs, config, out)):
            if all(n > 0 for n in launch.grid):
                launch()
        return out

    @staticmethod
    def build_key(problem, config) -> tuple:
        """What an sm_90a build depends on: the whole problem (the JIT specializes on integer values: 1, and
        divisibility by 16) and the config."""
        return problem, tuple(sorted(config.items()))

    def build_stages_sm90(self, problem, inputs, config, out) -> tuple[BuildReport, ...]:
        """Each launch's sm_90a build report."""
        return tuple(build_sm90(launch) for launch in _stages(self.plan(problem, inputs, config, out)))

    def build_sm90(self, problem, inputs, config, out) -> BuildReport:
        return BuildReport.merge(self.build_stages_sm90(problem, inputs, config, out))

    def traffic(self, problem, inputs, config, out) -> tuple[LaunchTraffic, ...]:
        """Each launch's global-memory traffic as its design requests it, planned as for a GPU and counted by the
        interpreter (kernels/_triton/traffic); `out` is scratch."""
        with flashkern.planning_for_gpu():
            launches = _stages(self.plan(problem, inputs, config, out))
        return tuple(traffic.measure(launch) if all(n > 0 for n in launch.grid) else NO_TRAFFIC for launch in launches)

    def unavailable(self, device) -> str | None:
        """Why this cannot run on `device` (a DeviceInfo), or None."""
        interpreted = flashkern.triton_interpreted()
        if device.kind == "cpu":
            return None if interpreted else "CPU tensors need Triton's interpreter (TRITON_INTERPRET=1)"
        if interpreted:
            return "Triton is in interpreter mode (TRITON_INTERPRET=1), which runs CPU tensors only"
        if device.capability < self.min_capability:
            return f"needs compute capability {self.min_capability[0]}.{self.min_capability[1]}+"
        return None


INTERPRETED = tl.constexpr(flashkern.triton_interpreted())  # per process: the AOT build's worker compiles for a GPU


@triton.jit
def round_to_bf16(x):
    """fp32 x rounded to the nearest bf16 (ties to even), returned as fp32; NaN stays NaN. On a GPU the hardware
    conversion (cvt.rn.bf16x2: half an instruction a value); under the interpreter, whose cast truncates, bit math."""
    if INTERPRETED:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        rounded = (bits & 0xFFFF0000).to(tl.float32, bitcast=True)
        return tl.where(x == x, rounded, x)
    return x.to(tl.bfloat16, fp_downcast_rounding="rtne").to(tl.float32)


# The traffic counters use this module's records; imported here, not on first use, so that what a kernel's source
# version covers (flashkern.autotune.identity) does not depend on whether the model ran in the process.
from flashkern.kernels._triton import traffic  # noqa: E402
