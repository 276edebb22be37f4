"""The performance model (flashkern.model): occupancy by the CUDA rules, the PTX census, fill and waves, the
traffic ratio of a kernel that reads its input twice, a config that loses wgmma, and every implementation of
one operator modelled end to end."""

import importlib
import json
import os
import subprocess
import sys
import textwrap

import flashkern  # noqa: F401  (before triton: kernels below run under the interpreter)
import pytest
import torch
import triton
import triton.language as tl

from flashkern import model, registry
from flashkern.autotune import identity
from flashkern_cli import main
from flashkern.kernels import sass
from flashkern.kernels._triton import Launch
from flashkern.kernels._triton import traffic as triton_traffic
from flashkern.kernels.build import BuildReport, Census, LaunchTraffic, TensorTraffic
from flashkern.registry import Cost

H200 = model.DEVICES["h200"]


@pytest.mark.parametrize("threads, registers, smem, ctas, limiter", [
    (256, 32, 0, 8, "threads"),  # 8 warps: 64 / 8
    (128, 255, 0, 2, "registers"),  # 255 -> 8192 per warp: 8 warps, 2 CTAs of 4
    (128, 200, 0, 2, "registers"),  # 6400 per warp: 10 warps, placed by 4: 8 -> 2 CTAs
    (1024, 64, 0, 1, "registers"),  # 2048 per warp: 32 warps, one CTA of 32 warps (threads would allow 2)
    (1024, 32, 0, 2, "threads"),  # 1024 per warp: 64 warps either way
    (128, 40, 100 * 1024, 2, "shared memory"),  # (102400 + 1024) -> 103424 B each: 233472 / 103424
    (32, 16, 0, 32, "CTA slots"),  # one warp each: 64 by threads, capped at 32 CTAs
])
def test_occupancy_follows_the_cuda_rules(threads, registers, smem, ctas, limiter):
    assert model.occupancy(threads, registers, smem, H200) == model.Occupancy(ctas, limiter)


def test_fill_counts_idle_sms_and_tails():
    assert model._fill(66, 4, H200) == (1, 0.5)  # half the SMs busy
    assert model._fill(132 * 4, 4, H200) == (1, 1.0)
    waves, fill = model._fill(132 * 4 + 1, 4, H200)  # one CTA in a second wave
    assert waves == 2 and fill == pytest.approx((132 * 4 + 1) / (2 * 132 * 4))


PTX = textwrap.dedent("""
    @%p1 ld.global.nc.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd1 + 0 ];
    ld.global.b16 %rs1, [%rd2];
    cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%r5], [%rd3, {%r6, %r7}], [%r8];
    mbarrier.try_wait.parity.shared::cta.b64 %p2, [%r8], %r9;
    wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {%f1}, %rd4, %rd5, 1, 1, 1;
    wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {%f2}, %rd6, %rd7, 1, 1, 1;
    st.global.v2.f32 [%rd8], {%f3, %f4};
    atom.global.add.f32 %f5, [%rd9], %f6;
    @%p3 atom.acq_rel.gpu.add.s32 %r11, [%rd10], 1;
    red.shared::cta.add.u32 [%r10], 1;
    bar.sync 0;
""")


def test_census_reads_ptx():
    assert Census.of(PTX) == Census(wgmma=2, mma_sync=0, mma_input="fp8", cp_async=0, tma=1, global_loads=2,
                                    widest_load=16, global_stores=1, global_atomics=2, shared_atomics=1, barriers=2)
    assert Census.of("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%f1}, {%r1}, {%r2}, {%f2};").mma_input == "bf16"
    assert Census.of("add.f32 %f1, %f2, %f3;") == Census()


@triton.jit
def _read_twice(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(y_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) + tl.load(x_ptr + offsets, mask=mask), mask=mask)


def test_a_kernel_that_reads_its_input_twice_moves_twice_the_input():
    n = 1000
    x, y = torch.ones(n), torch.empty(n)
    traffic = triton_traffic.measure(Launch(_read_twice, (triton.cdiv(n, 128),), dict(x_ptr=x, y_ptr=y, n=n, BLOCK=128)))
    report = BuildReport(registers=16, threads=128)
    once = model.predict(Cost(flops=n, bytes=8 * n), [(report, traffic)], H200)  # x read once, y written once
    assert traffic.bytes_read == 2 * 4 * n and traffic.bytes_written == 4 * n
    assert once.traffic_ratio == pytest.approx(1.5)  # (2 reads + 1 write) / (1 + 1)
    assert sorted(traffic.tensors) == [TensorTraffic(4 * n, 4 * n), TensorTraffic(8 * n, 4 * n)]
    assert model.hbm_bytes(traffic, H200) == 8 * n  # x's second read hits L2
    reads_only = model.predict(Cost(flops=n, bytes=4 * n), [(report, LaunchTraffic(8, 8 * n, 0, 8))], H200)
    assert reads_only.traffic_ratio == pytest.approx(2.0)


def test_time_and_roof():
    """Memory-bound: bytes at 80% of HBM over the fill, plus a launch beside it; the roof is the bytes at peak, with
    no launch; without an issue profile only the memory and tensor terms count."""
    moved = 4.8e9  # 1 ms at peak
    report = BuildReport(registers=32, threads=256)
    full = model.predict(Cost(flops=0, bytes=moved), [(report, LaunchTraffic(132 * 8, moved, 0, 132 * 8))], H200)
    assert full.kernel_seconds == pytest.approx(1e-3 / 0.8) and full.bound == "HBM"
    assert full.seconds == pytest.approx(1e-3 / 0.8 + model.LAUNCH_SECONDS)
    assert full.graph_seconds == pytest.approx(1e-3 / 0.8 + model.GRAPH_LAUNCH_SECONDS)
    assert full.roof_seconds == pytest.approx(1e-3)
    assert full.roofline_fraction == pytest.approx(0.8)
    half = model.predict(Cost(flops=0, bytes=moved), [(report, LaunchTraffic(66, moved, 0, 66))], H200)
    assert half.seconds == pytest.approx(2e-3 / 0.8 + model.LAUNCH_SECONDS)
    tensor = BuildReport(registers=128, threads=128, census=Census(wgmma=1, mma_input="fp8"))
    gemm = model.predict(Cost(flops=1979e12 * 1e-3, bytes=1, math="fp8"),
                         [(report, LaunchTraffic(132, 1, 0, 132)), (tensor, LaunchTraffic(132, 1, 0, 132))], H200)
    assert [s.flops for s in gemm.stages] == [0, 1979e12 * 1e-3]  # charged to the stage with tensor cores
    assert gemm.stages[1].seconds == pytest.approx(1e-3 / model.MATH_EFFICIENCY + model.LAUNCH_SECONDS, rel=1e-6)
    assert gemm.bound == "tensor"


def test_memory_and_compute_overlap_partly_and_latency_bounds_them():
    """One side's terms overlap completely (the longest stands for the side); the two sides as a p-norm, so two
    equal sides cost 2^(1/p) of one and a side far behind adds almost nothing; the latency term is a floor."""
    p = model.OVERLAP_EXPONENT
    assert model.composed({"HBM": 3.0, "L2": 2.0, "local memory": 1.0}) == 3.0
    assert model.composed({"tensor": 3.0, "issue": 1.0}) == 3.0
    assert model.composed({"HBM": 1.0, "tensor": 1.0}) == pytest.approx(2 ** (1 / p))
    assert model.composed({"L2": 1.0, "issue": 0.01}) == pytest.approx(1.0, rel=1e-3)
    assert model.composed({"HBM": 3.0, "L2": 1.0, "issue": 4.0}) == pytest.approx((3.0 ** p + 4.0 ** p) ** (1 / p))
    assert model.composed({"HBM": 1.0, "tensor": 1.0, "latency": 5.0}) == 5.0
    assert model.composed({}) == 0.0


def test_a_sub_partition_with_few_warps_waits_on_their_dependencies():
    """A warp issues a dependent instruction every DEPENDENT_ISSUE_CYCLES: with fewer warps than that a
    sub-partition idles between dispatches, unless a slow pipe binds anyway (ALU issues every other cycle)."""
    cycles = model.DEPENDENT_ISSUE_CYCLES
    idle = dict.fromkeys([*sass.PIPES, *sass.ISSUE_RATE], 0.0)
    issue = model.Issue(per_warp=idle | {"fma": 1000.0}, trips=(), traced=True, phases=1.0)
    assert model.warp_cycles(issue, issue.per_warp, cycles) == (1000.0, "dispatch")
    assert model.warp_cycles(issue, issue.per_warp, 1) == (1000.0 * cycles, "dependencies")
    assert model.warp_cycles(issue, idle | {"alu": 1000.0}, cycles / 2) == (2000.0, "alu")  # 2 warps hide it
    seconds = {warps: model._issue_seconds(issue, ctas=132, warps=warps, resident=1, device=H200)
               for warps in (4, 8, 16, 32)}
    # one CTA an SM doing the same work per warp: 1 or 2 warps a sub-partition take the dependent chain's time,
    # from 4 the sub-partition's dispatch binds and time grows with the warps
    assert seconds[4][0] == pytest.approx(seconds[8][0]) == pytest.approx(seconds[16][0])
    assert seconds[4][1] == "dependencies" and seconds[16][1] == "dispatch"
    assert seconds[32][0] == pytest.approx(2 * seconds[16][0])


def test_re_reads_inside_l2_are_charged_at_l2_bandwidth():
    """A 4 MB tensor read 8 times: first touches from HBM, the re-reads from L2 (the L2 term then binds); a
    tensor twice L2's size misses on half of its re-reads."""
    report = BuildReport(registers=32, threads=256)
    small = 4 * 2**20
    hot = model.predict(Cost(flops=0, bytes=small),
                        [(report, LaunchTraffic(132, 8 * small, 0, 132, tensors=(TensorTraffic(8 * small, small),)))],
                        H200)
    assert model.hbm_bytes(hot.stages[0].traffic, H200) == small
    assert hot.bound == "L2" and hot.kernel_seconds == pytest.approx(8 * small / H200.l2_bytes_per_s)
    big = 2 * H200.l2_bytes
    cold = LaunchTraffic(132, 3 * big, 0, 132, tensors=(TensorTraffic(3 * big, big),))
    assert model.hbm_bytes(cold, H200) == pytest.approx(big + 2 * big / 2)
    assert model.hbm_bytes(LaunchTraffic(132, 3 * big, 0, 132), H200) == 3 * big  # no per-tensor count: no credit
    # per tensor: a small re-read table beside a large tensor streamed once hits L2 whatever the large one's size
    mixed = LaunchTraffic(132, 8 * small + big, 0, 132,
                          tensors=(TensorTraffic(8 * small, small), TensorTraffic(big, big)))
    assert model.hbm_bytes(mixed, H200) == small + big


@pytest.mark.parametrize("resident", [1, 4])
def test_tiles_that_running_ctas_share_come_from_hbm_once(resident):
    """A tensor twice L2's size read 8 times, each re-read made by the CTA launched `gap` places before: while that
    CTA still runs (gap < 132 SMs x resident CTAs) the re-read hits L2 (GEMM panels, the heads of one token);
    further apart it is the resident rule's (half the re-reads miss here)."""
    big = 2 * H200.l2_bytes
    for gap, hits in [(1, True), (132 * resident - 1, True), (132 * resident, False), (10_000, False)]:
        traffic = LaunchTraffic(132, 8 * big, 0, 132, tensors=(TensorTraffic(8 * big, big, ((gap, 7 * big),)),))
        expected = big if hits else big + 7 * big / 2
        assert model.hbm_bytes(traffic, H200, resident) == pytest.approx(expected), gap
    shared_once = LaunchTraffic(132, 8 * big, 0, 132, tensors=(TensorTraffic(8 * big, big, ((1, 3 * big),)),))
    # the fewer of the two: resident 1 + 7/2, lockstep 8 - 3
    assert model.hbm_bytes(shared_once, H200, resident) == pytest.approx(4.5 * big)
    report = BuildReport(registers=32, threads=1024 // resident)
    fit = model.occupancy(report.threads, report.registers, report.smem, H200).ctas_per_sm
    assert fit == 2 * resident  # the model passes the occupancy it computes, so a 2x wider grid window hits too
    wide = LaunchTraffic(132, 8 * big, 0, 132, tensors=(TensorTraffic(8 * big, big, ((132 * fit - 1, 7 * big),)),))
    assert model.predict(Cost(flops=0, bytes=big), [(report, wide)], H200).stages[0].terms["HBM"] == pytest.approx(
        big / (H200.hbm_bytes_per_s * model.MEMORY_EFFICIENCY))


DOT_BUILD = textwrap.dedent("""
    import json, triton, triton.language as tl, torch
    import flashkern
    from flashkern.kernels._triton import Launch, build_sm90

    @triton.jit
    def dot(a_ptr, b_ptr, c_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
        m, n, k = tl.arange(0, M), tl.arange(0, N), tl.arange(0, K)
        a = tl.load(a_ptr + m[:, None] * K + k[None, :])
        b = tl.load(b_ptr + k[:, None] * N + n[None, :])
        tl.store(c_ptr + m[:, None] * N + n[None, :], tl.dot(a, b))

    found = {}
    for rows in (64, 16):  # a warpgroup MMA needs 64 rows; 16 falls back to mma.sync
        a, b = torch.empty(rows, 64, dtype=torch.bfloat16), torch.empty(64, 64, dtype=torch.bfloat16)
        c = torch.empty(rows, 64)
        census = build_sm90(Launch(dot, (1,), dict(a_ptr=a, b_ptr=b, c_ptr=c, M=rows, N=64, K=64), num_warps=4)).census
        found[rows] = [census.wgmma, census.mma_sync, census.mma_input]
    print(json.dumps(found))
""")


def test_a_config_that_loses_wgmma_shows_in_the_census(tmp_path):
    """Built natively (TRITON_INTERPRET=0) in a child process, as compile-check builds."""
    script = tmp_path / "dot_build.py"  # Triton reads a kernel's source from its file
    script.write_text(DOT_BUILD)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env={**os.environ, "TRITON_INTERPRET": "0"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found["64"][0] > 0 and found["64"][2] == "bf16"
    assert found["16"][0] == 0 and found["16"][1] > 0 and found["16"][2] == "bf16"


def test_every_implementation_of_an_operator_is_modelled_from_the_command_line(tmp_path):
    """flashkern model at a preset: a row per implementation and config (default and sampled) with a prediction;
    the JSON keeps every stage and the kernel source's version, the Markdown table the default configs."""
    op = registry.get("sinkhorn")
    saved, table = tmp_path / "model.json", tmp_path / "model.md"
    assert main(["model", "sinkhorn", "--preset", "smoke", "--sample", "1", "--jobs", "1", "--json", str(saved),
                 "--markdown", str(table)]) == 0
    records = json.loads(saved.read_text())
    assert {(r["impl"], r["default"]) for r in records} >= {(impl.name, d) for impl in op.implementations
                                                            for d in (True, False)}
    for r in records:
        assert r["traffic_ratio"] >= 1.0 - 1e-9, r  # no design moves less than the operator must
        assert 0 < r["roofline_fraction"] <= 1.0
        assert all(s["ctas"] > 0 and s["registers"] > 0 for s in r["stages"])
    defaults = [r for r in records if r["default"]]
    lines = table.read_text().splitlines()
    assert len(lines) == 4 + len(op.implementations) + 5 + len(defaults)  # the summary, then a row per shape
    assert lines[0].startswith("Predicted by a model of the H200 SXM, not measured (`flashkern model sinkhorn")
    current = model.current_records(saved)
    assert set(current) == {(r["op"], r["impl"], r["problem"]) for r in defaults}


def test_saved_predictions_are_shown_only_while_kernel_and_model_are_the_ones_used(tmp_path, monkeypatch,
                                                                                  capsys):
    op = registry.get("sinkhorn")
    problem = op.presets["smoke"][0]
    sources = identity.source_versions(op)
    record = dict(op="sinkhorn", problem=problem.key, default=True, config={}, error="", model_seconds=4.25e-6,
                  roof_seconds=3.0e-6, roofline_fraction=0.706, model=model.MODEL_VERSION)
    saved = tmp_path / "model.json"
    saved.write_text(json.dumps([dict(record, impl="triton", source=sources["triton"]),
                                 dict(record, impl="tilelang", source="an older kernel")]))
    assert set(model.current_records(saved)) == {("sinkhorn", "triton", problem.key)}
    older_model = tmp_path / "older-model.json"  # the same kernels priced by another model: stale as well
    older_model.write_text(json.dumps([dict(record, impl="triton", source=sources["triton"], model="0" * 16)]))
    assert model.current_records(older_model) == {}
    assert model.current_records(tmp_path / "absent.json") == {}
    monkeypatch.setattr(model, "SAVED", saved)
    assert main(["bench", "sinkhorn", "--budget", "0.01"]) == 0
    out = capsys.readouterr().out
    assert "triton 4.2 (71%)" in out and "tilelang 4.2" not in out


VERSIONS = """
import json, sys
from flashkern import registry
from flashkern.autotune import identity
if sys.argv[1] == "busy":  # what a process that ran the model and the checks has imported besides
    import flashkern.check, flashkern.cli, flashkern.model
    op = registry.get("sinkhorn")
    problem = op.presets["smoke"][0]
    inputs = op.make_inputs(problem, "cpu", 0)
    impl = op.implementation("triton")
    impl.traffic(problem, inputs, impl.default_config(problem), op.empty_outputs(problem, inputs))
    import pkgutil, importlib, tilelang, flashkern.kernels  # and every module of the kernels' tree (instruments, test aids)
    for found in pkgutil.walk_packages(flashkern.kernels.__path__, "flashkern.kernels."):
        importlib.import_module(found.name)
print(json.dumps({name: identity.source_versions(op) for name, op in registry.operators().items()}))
"""


def test_kernel_source_versions_do_not_depend_on_what_a_process_imported():
    """A saved model (and a tuning result) stays current in a process that never ran the model."""
    found = [subprocess.run([sys.executable, "-c", VERSIONS, mode], capture_output=True, text=True, check=True)
             .stdout.strip().splitlines()[-1] for mode in ("bare", "busy")]
    assert found[0] == found[1]


@pytest.mark.parametrize("op_name", ["moe_route", "mhc_pre", "sparse_mqa_logits", "sparse_decode_attention"])
def test_kernel_source_versions_cover_kernel_code_only(op_name, monkeypatch):
    """An implementation's version changes with its kernel module and the shared DSL modules, not with the test-case
    strategies, the model's instruments (build reports, SASS, traffic counts) or another family's kernels: editing
    those must not make saved results and predictions stale."""
    op = registry.get(op_name)
    family = identity._entry_module(op, "triton").split(".")[2]
    for impl in ("triton", "tilelang"):
        closure = identity._module_closure(identity._entry_module(op, impl))
        assert f"flashkern.kernels._{impl}" in closure and not identity.INSTRUMENTS & set(closure), closure
        assert all(importlib.import_module(name) for name in identity.INSTRUMENTS)  # each names a real module
        assert not [m for m in closure if m.endswith(".cases")], closure
        others = [f for f in registry.FAMILIES if f != family]
        assert not [m for m in closure if any(m.startswith(f"flashkern.kernels.{f}") for f in others)], closure
    before = identity.source_versions(op)
    identity.source_hash.cache_clear()
    kernel_module = sys.modules[identity._entry_module(op, "triton")]
    monkeypatch.setattr(identity.inspect, "getsource",
                        lambda m, real=identity.inspect.getsource: real(m) + ("#" if m is kernel_module else ""))
    after = identity.source_versions(op)
    identity.source_hash.cache_clear()
    assert after["triton"] != before["triton"] and after["reference"] == before["reference"]
