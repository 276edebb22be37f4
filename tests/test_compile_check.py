"""The sm_90a build check: every implementation compiles for Hopper here, without a GPU.

TileLang builds need nvcc and are skipped (reported, not passed) where it is absent; Triton
builds use Triton's own ptxas and always run.
"""

import pytest

from flashkern import compile_check, registry
from flashkern.kernels._tilelang import nvcc_path

OPS = sorted(registry.operators())
pytestmark = pytest.mark.xdist_group("sm90_builds")  # one worker builds them all, once


@pytest.fixture(scope="module")
def results():
    """Default config and one sampled config of every implementation, for each smoke specialization."""
    return compile_check.run(compile_check.plan(OPS, "smoke", sample=1))


def test_every_implementation_builds_for_sm90a(results):
    assert {(r.job.op, r.job.impl) for r in results} == {(op, impl.name) for op in OPS
                                                         for impl in registry.get(op).implementations}
    failed = [f"{r.job.op}/{r.job.impl} {r.config}: {r.error}" for r in results if not (r.ok or r.skipped)]
    assert not failed, "\n".join(failed)
    if nvcc_path() is None:
        pytest.skip("nvcc not found: the TileLang sm_90a builds were skipped (the Triton ones passed)")
    assert all(r.ok for r in results)


def test_default_configs_do_not_spill(results):
    """Defaults run untuned shapes: they must fit the register file (a regression guard on the register models)."""
    spilled = [f"{r.job.op}/{r.job.impl} {r.job.problem.key} {r.config}: {r.report.spills} B"
               for r in results if r.ok and r.job.default and r.report.spills]
    assert not spilled, "\n".join(spilled)


def test_reports_hold_real_resource_figures(results):
    for r in results:
        if r.ok:
            assert 0 < r.report.registers <= 255 and r.report.threads >= 32, r


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
