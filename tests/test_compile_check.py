"""The sm_90a build check: every implementation compiles for Hopper here, without a GPU.

TileLang builds need nvcc and are skipped (reported, not passed) where it is absent; Triton
builds use Triton's own ptxas and always run.
"""

import pytest

from flashkern import compile_check, registry
from flashkern.kernels._tilelang import nvcc_path

OPS = sorted(registry.operators())


def test_every_implementation_builds_for_sm90a_and_defaults_do_not_spill():
    """The default config of every implementation for each smoke specialization, and one sampled config of each
    implementation (on its first specialization), build; defaults fit the register file (a regression guard on
    the register models, since defaults run untuned shapes); reports hold real resource figures.

    One test, one set of builds: CI's two cores build about 40 kernels here, and test workers share no fixtures.
    """
    defaults = compile_check.plan(OPS, "smoke", sample=0)
    sampled = {}
    for job in compile_check.plan(OPS, "smoke", sample=1):
        if not job.default:
            sampled.setdefault((job.op, job.impl), job)
    results = compile_check.run(defaults + list(sampled.values()))
    assert {(r.job.op, r.job.impl) for r in results} == {(op, impl.name) for op in OPS
                                                         for impl in registry.get(op).implementations}
    failed = [f"{r.job.op}/{r.job.impl} {r.config}: {r.error}" for r in results if not (r.ok or r.skipped)]
    assert not failed, "\n".join(failed)
    spilled = [f"{r.job.op}/{r.job.impl} {r.job.problem.key} {r.config}: {r.report.spills} B"
               for r in results if r.ok and r.job.default and r.report.spills]
    assert not spilled, "\n".join(spilled)
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
