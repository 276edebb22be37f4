"""The sm_90a build check: every implementation compiles for Hopper here, without a GPU.

TileLang builds need nvcc and are skipped (reported, not passed) where it is absent; Triton
builds use Triton's own ptxas and always run.
"""

import importlib
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from flashkern import compile_check, registry
from flashkern.kernels.cases import narrow
from flashkern.kernels._tilelang import nvcc_path

OPS = sorted(registry.operators())


# Defaults that spill in their build (registers, spills and stack as the JIT's own assembler reports them), and
# why: the model charges their spills (its local memory term, tests/test_sass.py), and nothing else may spill.
MUST_SPILL = {
    ("sparse_decode_attention", "triton"): "64 heads a program (wgmma's M: a record decoded once per token): the "
    "[64, 512] fp32 accumulator holds 128 of 255 registers, and the allocator spills 1.0-1.3 KB beside it "
    "(Triton 3.9 with --regAllocOptLevel=2, and 3.6); modelled 53.5 us at T = 64 on 3.6 against 230 us for 16 "
    "heads that do not spill (docs/operators.md 8.3), so the spilling design stays the default on both until the "
    "role split (issue 54) frees the registers; 8 heads (16-head "
    "programs) spill 32 B where ptxas targets two CTAs an SM (128 registers), and bounding it by the register file "
    "(register_bound) took the other specializations to 253-255 registers and one to 172 B of spills",
}


@pytest.mark.parametrize("family", registry.FAMILIES)
def test_every_implementation_builds_for_sm90a_and_defaults_do_not_spill(family):
    """The default config of every implementation of a family for each smoke specialization, and one sampled config
    of each implementation, build; defaults fit the register file (a regression guard on the register models, since
    defaults run untuned shapes); reports hold real resource figures.

    One test per family, its builds in one worker process: the families spread over the test workers without more
    build processes than cores. A TileLang sm_90a build takes 2-25 s here (a Triton one under 3 s), so the narrow
    (`ci`) profile builds TileLang's default at the first smoke specialization (the model's formats) and no sampled
    TileLang config; the wide profiles build everything above.
    """
    ops = sorted(op.name for op in importlib.import_module(f"flashkern.kernels.{family}").OPERATORS)
    sampled_impls = {(op, impl.name) for op in ops for impl in registry.get(op).implementations
                     if not (narrow() and impl.name == "tilelang")}
    defaults, sampled = {}, {}
    for job in compile_check.plan(ops, "smoke", sample=1):
        first = job.problem.specialization() == registry.get(job.op).presets["smoke"][0].specialization()
        if job.default:
            if first or not (narrow() and job.impl == "tilelang"):
                defaults.setdefault((job.op, job.impl, job.problem.specialization()), job)  # one shape per program
        elif (job.op, job.impl) in sampled_impls:
            sampled.setdefault((job.op, job.impl), job)
    results = compile_check.run(list(defaults.values()) + list(sampled.values()), workers=1)
    assert {(r.job.op, r.job.impl) for r in results} == {(op, impl.name) for op in ops
                                                         for impl in registry.get(op).implementations}
    assert {(r.job.op, r.job.impl) for r in results if not r.job.default} == sampled_impls  # not only defaults
    failed = [f"{r.job.op}/{r.job.impl} {r.config}: {r.error}" for r in results if not (r.ok or r.skipped)]
    assert not failed, "\n".join(failed)
    spilled = [f"{r.job.op}/{r.job.impl} {r.job.problem.key} {r.config}: {r.report.spills} B"
               for r in results if r.ok and r.job.default and r.report.spills
               and (r.job.op, r.job.impl) not in MUST_SPILL]
    assert not spilled, "\n".join(spilled)
    hazards = [f"{r.job.op}/{r.job.impl} {r.job.problem.key} {r.config}: {h}" for r in results if r.ok
               for h in r.report.hazards]
    assert not hazards, "\n".join(hazards)  # the GPU lint (kernels/gpu_lint.py) on every build, sampled ones too
    for r in results:
        if r.ok:
            assert 0 < r.report.registers <= 255 and r.report.threads >= 32, r
    if nvcc_path() is None:
        pytest.skip("nvcc not found: the TileLang sm_90a builds were skipped (the Triton ones passed)")
    assert all(r.ok for r in results)


def test_a_broken_build_is_reported_as_failed():
    op = registry.get("moe_route")
    job = compile_check.BuildJob("moe_route", "triton", op.presets["smoke"][0], {"block_t": 3, "num_warps": 4})
    (result,) = compile_check.run([job], workers=1)
    assert not result.ok and not result.skipped and "arange" in result.error


def test_tilelang_builds_are_skipped_not_passed_without_nvcc(monkeypatch):
    monkeypatch.setattr("flashkern.kernels._tilelang.nvcc_path", lambda: None)
    op = registry.get("moe_route")
    result = compile_check.build(compile_check.BuildJob("moe_route", "tilelang", op.presets["smoke"][0], None))
    assert result.skipped and not result.ok and "nvcc" in result.error


def test_build_reports_are_kept_and_built_again_when_unreadable_or_turned_off(tmp_path, monkeypatch):
    """kernels.build.cached_report: a report is stored once and read back without building; an unreadable file is
    built again and replaced; other inputs are another entry; "off" always builds."""
    from flashkern.kernels.build import CACHE_ENV, BuildReport, Census, cached_report

    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    builds = []

    def build():
        builds.append(1)
        return BuildReport(registers=40, spill_stores=8, smem=1024, threads=128, census=Census(wgmma=2, mma_input="fp8"))

    first = cached_report(("tir", 1), build)
    assert cached_report(("tir", 1), build) == first and len(builds) == 1  # kept
    (stored,) = tmp_path.glob("*.json")
    stored.write_text("{ not a report")
    assert cached_report(("tir", 1), build) == first and len(builds) == 2  # unreadable: built again, replaced
    assert cached_report(("tir", 1), build) == first and len(builds) == 2
    cached_report(("tir", 2), build)
    assert len(builds) == 3 and len(list(tmp_path.glob("*.json"))) == 2  # other inputs: another build
    monkeypatch.setenv(CACHE_ENV, "off")
    cached_report(("tir", 1), build)
    assert len(builds) == 4


def test_tilelang_build_reports_are_keyed_on_the_program_and_its_pass_options(tmp_path, monkeypatch):
    """The second build of one TileLang program reads the stored report (nothing lowered); the same program with
    other pass options is built."""
    import tilelang.language as T

    from flashkern.kernels import _tilelang as tl
    from flashkern.kernels._tilelang import codecs
    from flashkern.kernels.build import CACHE_ENV

    if nvcc_path() is None:
        pytest.skip("nvcc not found: no TileLang sm_90a build to keep")
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    lowered, lower = [], tl.lower_sm90
    monkeypatch.setattr(tl, "lower_sm90", lambda *args: lowered.append(args) or lower(*args))
    func = codecs.codec_prim_func("e4m3", "decode", parallel=T.Parallel, block=128)
    first = tl.build_sm90(func)
    assert first.registers > 0 and first.threads == 128 and len(lowered) == 1
    assert tl.build_sm90(codecs.codec_prim_func("e4m3", "decode", parallel=T.Parallel, block=128)) == first
    assert len(lowered) == 1  # the same program, built anew by the factory: its stored report
    tl.build_sm90(func, {"tl.disable_tma_lower": True})
    assert len(lowered) == 2


SPECIALIZATION_CHECK = """
import json
from triton.backends.compiler import BaseBackend
from triton.runtime.jit import native_specialize_impl
from flashkern import registry
from flashkern.kernels._triton import _signature, _stages

mismatches, launches_seen = [], 0
for name, op in sorted(registry.operators().items()):
    impl = op.implementation("triton")
    for problem in op.presets["smoke"]:
        inputs = op.make_inputs(problem, "cpu", 0)
        op.check(inputs)
        config = impl.default_config(problem)
        for launch in _stages(impl.kernel.plan(problem, inputs, config, op.empty_outputs(problem, inputs))):
            launches_seen += 1
            signature, constexprs, attrs = _signature(launch)
            for index, param in enumerate(launch.kernel.params):
                value = launch.args[param.name]
                if param.is_constexpr or value is None:
                    continue
                kind, key = native_specialize_impl(BaseBackend, value, param.is_const, not param.do_not_specialize,
                                                   not param.do_not_specialize_on_alignment)[:2]
                ours = ("constexpr" if param.name in constexprs else signature[param.name], (index,) in attrs)
                if ours != (kind, isinstance(key, str) and "D" in key):
                    mismatches.append([name, launch.kernel.__name__, param.name, repr(value), ours, [kind, key]])
print(json.dumps([launches_seen, mismatches]))
"""


def test_triton_builds_are_specialized_as_the_jit_specializes(tmp_path):
    """The AOT signature of every Triton launch at the smoke shapes matches Triton's own run-time specialization of
    the same arguments (integers equal to 1 as constants, divisibility by 16 of integers and pointers). Natively
    (TRITON_INTERPRET=0) in a child process: interpreted kernels carry no parameter records."""
    script = tmp_path / "specialization_check.py"
    script.write_text(SPECIALIZATION_CHECK)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env={**os.environ, "TRITON_INTERPRET": "0"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    launches, mismatches = json.loads(proc.stdout.strip().splitlines()[-1])
    assert launches >= len(OPS) and not mismatches


def test_c_target_compiles_leave_nothing_in_the_temporary_folder(tmp_path, monkeypatch):
    """TileLang writes each C compile's source and library to the temporary folder and keeps them; compile_cpu
    removes them once the library is loaded (the program still runs)."""
    import tempfile

    import tilelang
    import tilelang.language as T
    import torch

    from flashkern.kernels._tilelang import compile_cpu

    @T.prim_func
    def add_one(a: T.Tensor((8,), "float32"), b: T.Tensor((8,), "float32")):
        with T.Kernel(1) as _:
            for i in T.serial(8):
                b[i] = a[i] + 1.0

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    tilelang.disable_cache()  # a compile, not a cache hit
    try:
        kernel = compile_cpu(add_one)
    finally:
        tilelang.enable_cache()
    a, b = torch.arange(8, dtype=torch.float32), torch.zeros(8)
    kernel(a, b)
    assert torch.equal(b, a + 1)
    assert tempfile.tempdir == str(tmp_path) and not list(tmp_path.iterdir())


def test_the_c_target_still_needs_the_late_simplify_skipped(monkeypatch, tmp_path):
    """TileLang 0.1.15's last simplifier pass folds a bf16 store of -inf into a reinterpretation of the constant,
    which its C code generator prints as the address of a constant (`&(-INFINITY)`: no C compiler takes it). Our
    C compiles skip that pass (`_c_pipeline_without_simplifiers`). When a TileLang upgrade fixes the code generator,
    the first half fails (the skip is then a speed-up only); the second half checks the skip still works."""
    import random
    import tempfile

    import tilelang
    import torch

    from flashkern.kernels import _tilelang as tl
    from flashkern.kernels._tilelang import T, codecs

    salt = random.randrange(1, 1 << 15)  # a source no earlier run compiled (TileLang's disk cache)

    def program():
        N = T.dynamic("N")

        @T.prim_func
        def negative_infinity(A: T.Tensor((N,), "float32"), B: T.Tensor((N,), "uint16")):
            with T.Kernel(1) as _:
                for i in T.serial(N):
                    B[i] = codecs.f32_to_bf16(-T.infinity("float32")) + T.Cast("uint16", A[i] > salt)

        return negative_infinity

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # TileLang's own compile leaves its files there
    tilelang.disable_cache()
    try:
        with pytest.raises(RuntimeError, match=re.escape("(&(-INFINITY))")):
            tilelang.compile(program(), target="c", pass_configs=tl.CPU_PASS_CONFIGS)
        kernel = tl.compile_cpu(program())
    finally:
        tilelang.enable_cache()
    a, b = torch.tensor([0.0, salt + 1.0]), torch.empty(2, dtype=torch.uint16)
    kernel(a, b)
    assert b.tolist() == [0xFF80, 0xFF81]  # bf16 -inf, then -inf's bits + 1


def test_the_c_wrapper_still_needs_the_stride_symbols(monkeypatch, tmp_path):
    """TileLang 0.1.15's C host wrapper omits a strided tensor's stride symbols, so such a kernel does not compile
    for C without `_c_wrapper_with_strides`, and with it runs right on a row-padded view. When a TileLang upgrade
    declares the symbols itself, the first half fails: remove the workaround; when it changes the wrapper so the
    workaround breaks, the second half fails."""
    import random
    import tempfile

    import tilelang
    import tilelang.language as T
    import torch

    from flashkern.kernels import _tilelang as tl

    salt = float(random.randrange(1, 1 << 20))  # a source no earlier run compiled (TileLang's disk cache)

    def program():
        N = T.dynamic("N")

        @T.prim_func
        def scaled(a: tl.row_strided((N, 4), "float32", "a"), b: T.Tensor((N, 4), "float32")):
            with T.Kernel(1) as _:
                for i, j in T.grid(N, 4):
                    b[i, j] = a[i, j] * salt

        return scaled

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # TileLang's own compile leaves its files there
    tilelang.disable_cache()
    try:
        with pytest.raises(RuntimeError, match=r"return scaled_kernel\(a, b, N\);"):  # the call omits a_stride0
            tilelang.compile(program(), target="c", pass_configs=tl.CPU_PASS_CONFIGS)
        kernel = tl.compile_cpu(program())
    finally:
        tilelang.enable_cache()
    wide = torch.arange(5 * 7, dtype=torch.float32).reshape(5, 7)
    out = torch.empty(5, 4)
    kernel(wide[:, :4], out)
    assert torch.equal(out, wide[:, :4] * salt)


def test_c_compiles_skip_the_simplifiers_and_cuda_lowering_keeps_them():
    """Our C compiles run TileLang's pipeline with its simplifiers up to C_LEGALIZED_BY and without C_SKIPPED_PASSES
    (the simplifiers and code motion the C compiler repeats) after it, and still lower the tile ops; an sm_90a
    lowering runs the simplifiers throughout (its source is what GPU users get); the skip lasts only while our compile
    runs."""
    import random

    import tilelang
    import tilelang.language as T
    import torch
    from tilelang.instrumentation.session import PassInstrumentationTool, register_pass_instrumentation_tool, \
        unregister_pass_instrumentation_tool
    from tvm.ir.instrument import pass_instrument

    from flashkern.kernels import _tilelang as tl

    salt = random.randrange(1, 1 << 15)  # a source no earlier run compiled (TileLang's disk cache)
    ran = []

    @pass_instrument
    class Record:
        def run_before_pass(self, mod, info):
            ran.append(info.name)

    class Recorder(PassInstrumentationTool):
        def create_pass_instrument(self):
            return Record()

    @T.prim_func
    def halves(a: T.Tensor((64,), "int32"), b: T.Tensor((64,), "int32")):
        with T.Kernel(1, threads=64) as _:
            for i in T.serial(64):
                b[i] = a[i] // 2 + a[i] % 2 + salt

    register_pass_instrumentation_tool("flashkern-test-recorder", Recorder)
    try:
        kernel = tl.compile_cpu(halves)
        c_passes, ran[:] = list(ran), []
        tilelang.lower(halves, target=tl._sm90_target())
        cuda_passes = list(ran)
    finally:
        unregister_pass_instrumentation_tool("flashkern-test-recorder")
    legal = c_passes.index(tl.C_LEGALIZED_BY)
    assert "tl.LowerTileOp" in c_passes[:legal] and "tl.Simplify" in c_passes[:legal], c_passes
    assert not set(c_passes[legal:]) & tl.C_SKIPPED_PASSES, c_passes
    assert {"tl.Simplify", "tirx.Simplify"} <= set(cuda_passes), cuda_passes
    a, b = torch.arange(64, dtype=torch.int32), torch.empty(64, dtype=torch.int32)
    kernel(a, b)
    assert torch.equal(b, a // 2 + a % 2 + salt)


def test_importing_flashkern_changes_nothing_in_tilelang():
    """No global patch at import: TileLang's C wrapper, its device code generation and its log level are what they
    were before flashkern and every kernel module was imported (the changes our C compiles need last only while they
    run)."""
    script = textwrap.dedent("""\
        import importlib, logging
        from tilelang.jit.adapter.wrapper import TLCPUSourceWrapper
        lower = importlib.import_module("tilelang.engine.lower")
        before = (TLCPUSourceWrapper.get_dynamic_symbolic_set, lower._prepare_device_codegen_mod,
                  logging.getLogger("tilelang").level)
        import flashkern, flashkern.ops
        from flashkern import registry
        registry.operators()
        after = (TLCPUSourceWrapper.get_dynamic_symbolic_set, lower._prepare_device_codegen_mod,
                 logging.getLogger("tilelang").level)
        assert before == after, (before, after)
        """)
    subprocess.run([sys.executable, "-c", script], check=True)
