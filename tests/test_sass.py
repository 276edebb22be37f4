"""The SASS issue counter (flashkern.kernels.sass) on kernels built for the purpose (tests/_sass_kernels.py), and
the model's issue and memory terms on them: loops found from back edges and counted per trip, integer work on
the integer pipe, straight code counted once, trips from the interpreter's trace of the loop headers."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import flashkern  # noqa: F401  (before triton: the kernels run under the interpreter here)
import pytest

from flashkern import model
from flashkern.kernels import sass
from flashkern.kernels._triton import traffic
from flashkern.kernels.build import BuildReport, LaunchTraffic
from flashkern.registry import Cost

sys.path.insert(0, str(Path(__file__).parent))
import _sass_kernels as kernels  # noqa: E402

H200 = model.DEVICES["h200"]


@pytest.fixture(scope="module")
def built() -> dict[str, BuildReport]:
    """Each kernel's sm_90a build report with its issue profile, built natively in a child process."""
    script = textwrap.dedent(f"""
        import dataclasses, json, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import _sass_kernels as kernels
        from flashkern.kernels._triton import build_sm90
        from flashkern.kernels.build import profiling_issue
        with profiling_issue():
            reports = {{name: dataclasses.asdict(build_sm90(launch))
                        for name, launch in kernels.launches(ctas=4, trips=3).items()}}
        print(json.dumps(reports))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env={**os.environ, "TRITON_INTERPRET": "0", "FLASHKERN_BUILD_CACHE": "off"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {name: BuildReport.from_dict(report) for name, report in json.loads(proc.stdout.splitlines()[-1]).items()}


def test_a_loop_of_n_fmas_per_trip_counts_n_fmas(built):
    profile = built["fma_loop"].issue
    (loop,) = profile.loops
    assert loop.counts["fma"] == kernels.FMAS
    assert Path(loop.header[0]).name == Path(kernels.__file__).name and loop.parent == -1  # (a cached build may
    # name the file where it was first compiled: test_a_moved_source_file_is_still_the_same_file)
    assert profile.straight["fma"] == 0 and profile.straight["lsu"] >= 2  # the load and the store, once


def test_an_integer_decode_loop_lands_on_the_integer_pipes(built):
    (loop,) = built["decode_loop"].issue.loops
    assert loop.counts["fma"] == 0 and loop.counts["xu"] == 0
    assert loop.counts["alu"] >= 5  # shifts, masks, ors and the xor (LOP3 may fuse some)
    assert loop.counts["global_load"] == 1


def test_a_kernel_without_a_loop_is_counted_once(built):
    profile = built["copy"].issue
    assert profile.loops == ()
    assert profile.executed([]) == {**dict.fromkeys((*sass.PIPES, *sass.EVENTS), 0.0), **profile.straight}


@pytest.mark.parametrize("trips", [1, 7])
def test_trips_come_from_the_traced_loop_header(built, trips):
    launch = kernels.launches(ctas=4, trips=trips)["fma_loop"]
    counted = traffic.measure(launch)
    assert sass.trips(built["fma_loop"].issue, dict(counted.lines)) == ([trips], [True])
    issue = model.issue_of(built["fma_loop"].issue, counted)
    assert issue.traced and issue.per_warp["fma"] == kernels.FMAS * trips


def test_nested_loops_take_their_trips_per_cta_and_unknown_headers_one_per_entry():
    counts = dict.fromkeys((*sass.PIPES, *sass.EVENTS), 0)
    profile = sass.Profile(counts, (sass.Loop(0, 100, -1, counts, ("k.py", 10)),
                                    sass.Loop(20, 80, 0, counts, ("k.py", 12)),
                                    sass.Loop(200, 300, -1, counts, None)))
    # outer: 4 trips (5 header runs); inner: 3 trips per outer trip (4 header runs each, 16 in all)
    assert sass.trips(profile, {("k.py", 10): 5, ("k.py", 12): 16}) == ([4, 12, 1], [True, True, False])


def test_copies_of_one_source_loop_share_its_trips_from_the_sizes_too():
    """nvcc unswitches a condition a loop does not change into two copies of it, alternatives: the trips the
    header's bounds give are split between them (as the traced header executions are), not run by each."""
    counts = dict.fromkeys((*sass.PIPES, *sass.EVENTS), 0)
    header, text = ("k.cu", 75), "for (int t = 0; t < tiles; ++t) {"
    profile = sass.Profile(counts, (sass.Loop(0, 100, -1, counts, ("k.cu", 70), "for (int p = 0; p < 4; ++p) {"),
                                    sass.Loop(10, 40, 0, counts, header, text),
                                    sass.Loop(50, 90, 0, counts, header, text)))
    assert sass.trips(profile, {}, {"tiles": 2}) == ([4, 4, 4], [True, True, True])


GI_LISTING = """\
//--------------------- .text.k --------------------------
\t//## File "/x/k.py", line 10
        /*0000*/                   IMAD R1, R2, R3, RZ ;
\t//## File "/x/lib.py", line 5 inlined at "/x/k.py", line 20
\t//## File "/x/k.py", line 20
        /*0010*/                   FADD R1, R1, R1 ;
\t//## File "/x/lib.py", line 6 inlined at "/x/lib.py", line 9
\t//## File "/x/lib.py", line 9 inlined at "/x/k.py", line 21
\t//## File "/x/k.py", line 21
        /*0020*/                   FMUL R1, R1, R1 ;
        /*0030*/                   EXIT ;
"""


def test_an_inlining_chain_gives_the_innermost_line_and_the_kernels_own():
    """`nvdisasm -gi` lists an instruction's lines from the inlined code out to the kernel body's own line: the
    innermost names loop headers (as `-g` would), the outermost says which kernel statement runs it."""
    ins = sass.parse(GI_LISTING)
    assert [i.line for i in ins[:3]] == [("/x/k.py", 10), ("/x/lib.py", 5), ("/x/lib.py", 6)]
    assert [i.site for i in ins[:3]] == [("/x/k.py", 10), ("/x/k.py", 20), ("/x/k.py", 21)]


def test_straight_code_in_a_branch_counts_as_often_as_its_line_ran():
    """A last arrival's epilogue: straight-line code whose kernel line ran for 1 CTA in 8 counts an eighth on
    average, and not at all for a CTA that skipped it (a line the trace saw elsewhere); lines no trace saw, or that
    ran every time, count once."""
    profile = sass.count(sass.parse(GI_LISTING))
    assert profile.straight["fma"] == 2  # FADD, FMUL
    runs = {("/x/k.py", 10): 1.0, ("/x/k.py", 20): 1.0, ("/x/k.py", 21): 0.125}
    assert profile.executed([])["fma"] == 2
    assert profile.executed([], runs)["fma"] == pytest.approx(1.125)
    skipped = {("/x/k.py", 10): 1, ("/x/k.py", 20): 1}
    assert profile.executed([], skipped, traced=runs)["fma"] == pytest.approx(1.0)
    assert profile.executed([], skipped)["fma"] == pytest.approx(2.0)  # never seen to run: counted


def test_a_moved_source_file_is_still_the_same_file():
    """Triton's cache keys a build on its source, so its line info can name a checkout that has since moved: a
    header matches the traced file whose path ends the same way, the longest such tail winning."""
    counts = {("/check/work/main/kernels/indexer/triton_topk.py", 40): 9,
              ("/check/work/main/kernels/mhc/triton_topk.py", 40): 5,
              ("/check/work/main/kernels/indexer/other.py", 41): 3}
    assert sass.header_executions(("/work/main/kernels/indexer/triton_topk.py", 40), counts) == 9
    assert sass.header_executions(("/check/work/main/kernels/mhc/triton_topk.py", 40), counts) == 5
    assert sass.header_executions(("/old/triton_topk.py", 40), counts) in (9, 5)  # the name alone still matches
    assert sass.header_executions(("/work/main/kernels/indexer/other.py", 40), counts) is None  # not that line
    assert sass.header_executions(("/work/main/kernels/indexer/elsewhere.py", 41), counts) is None  # not that file
    assert sass.header_executions(None, counts) is None
    profile = sass.Profile(dict.fromkeys((*sass.PIPES, *sass.EVENTS), 0),
                           (sass.Loop(0, 10, -1, {}, ("/moved/kernels/indexer/triton_topk.py", 40)),))
    assert sass.trips(profile, counts) == ([8], [True])  # 9 header runs, entered once


def test_the_issue_term_binds_an_issue_bound_kernel_and_hbm_a_streaming_copy(built):
    ctas = 132 * 16
    heavy = kernels.launches(ctas=ctas, trips=200)["fma_loop"]
    stream = kernels.launches(ctas=ctas, trips=1)["copy"]
    n = ctas * kernels.BLOCK
    fma = model.predict(Cost(flops=0, bytes=8 * n), [(built["fma_loop"], traffic.measure(heavy, max_ctas=2))], H200)
    copy = model.predict(Cost(flops=0, bytes=8 * n), [(built["copy"], traffic.measure(stream, max_ctas=2))], H200)
    assert fma.bound == "issue (dispatch)"  # FFMA issues at one a cycle: the dispatch of all its neighbours binds
    stage = fma.stages[0]
    cycles = stage.issue.cycles_per_warp()[0]
    expected = ctas * kernels.WARPS * cycles / (132 * 4) / H200.clock_hz
    assert stage.terms["issue"] == pytest.approx(expected)
    assert stage.terms["issue"] > 10 * max(stage.terms["HBM"], stage.terms["L2"])
    assert copy.bound in ("HBM", "latency") and copy.stages[0].terms["issue"] < copy.stages[0].terms["HBM"]
    big = kernels.launches(ctas=132 * 512, trips=1)["copy"]
    large = model.predict(Cost(flops=0, bytes=8 * 132 * 512 * kernels.BLOCK),
                          [(built["copy"], traffic.measure(big, max_ctas=2))], H200)
    assert large.bound == "HBM"


@pytest.mark.parametrize("opcode, moved", [("LDL", 128), ("STL.64", 256), ("LDL.LU.128", 512), ("STL.U8", 32),
                                           ("LDG.E", 0), ("STS", 0)])
def test_local_bytes_are_a_warps_lanes_times_the_access_width(opcode, moved):
    assert sass.local_bytes(opcode) == moved


def test_spills_in_a_loop_are_counted_per_trip_and_charged_by_the_model(built):
    """A loop whose live values outgrow its register bound reloads and stores spills every trip: the SASS count
    holds their bytes in the loop's trip, and the model charges them (its local memory term) beside the LDL / STL
    the issue term already counts; the kernels that fit their registers are charged nothing."""
    report = built["spill_loop"]
    assert report.spills and report.registers <= kernels.SPILL_REGISTERS
    (loop,) = report.issue.loops
    assert loop.counts["local_bytes"] >= 32 * 4 and loop.counts["lsu"] >= loop.counts["local_bytes"] / 512
    trips = 100
    launch = kernels.launches(ctas=132, trips=trips)["spill_loop"]
    stage = model.predict(Cost(flops=0, bytes=1), [(report, traffic.measure(launch, max_ctas=2))], H200).stages[0]
    moved = stage.issue.per_warp["local_bytes"] * kernels.WARPS * 132
    assert moved >= trips * loop.counts["local_bytes"] * kernels.WARPS * 132
    from_l1, from_l2 = moved / (H200.l1_bytes_per_clock_per_sm * 132 * H200.clock_hz), moved / H200.l2_bytes_per_s
    frames = report.stack * report.threads * stage.occupancy.ctas_per_sm
    assert frames > H200.l1_bytes_per_sm  # the resident CTAs' stack frames outgrow L1: part of it comes from L2
    assert from_l1 < stage.terms["local memory"] < from_l2
    fitting = model.predict(Cost(flops=0, bytes=1), [(built["fma_loop"], traffic.measure(
        kernels.launches(ctas=132, trips=trips)["fma_loop"], max_ctas=2))], H200).stages[0]
    assert "local memory" not in fitting.terms


def test_a_cta_that_works_alone_bounds_the_issue_term(built):
    """32 CTAs of the FMA loop, one of which (a last arrival's epilogue) runs 1000 trips where the others run one:
    averaged over the grid its work would look spread over 32 SMs; the model keeps it on its own SM's four
    sub-partitions. CTAs alike (the same lines each) stay on the balanced count."""
    report = built["fma_loop"]
    header = report.issue.loops[0].header
    light, heavy = ((header, 2),), ((header, 1001),)  # a header runs once per trip and once more on exit
    ctas = 32

    def issue_seconds(cta_lines):
        lines = ((header, sum(dict(cta)[header] for cta in cta_lines) / len(cta_lines)),)  # the average CTA
        traffic = LaunchTraffic(ctas, 1.0, 0.0, ctas, lines=lines, cta_lines=cta_lines)
        return model.predict(Cost(flops=0, bytes=1), [(report, traffic)], H200).stages[0]

    lanes = min(4, kernels.WARPS)  # one CTA an SM: its warps' sub-partitions
    skewed = issue_seconds((light,) * 7 + (heavy,))
    heaviest = model.warp_cycles(skewed.issue, skewed.issue.heaviest, kernels.WARPS / lanes)[0]
    average = model.warp_cycles(skewed.issue, skewed.issue.per_warp, kernels.WARPS / lanes)[0]
    assert heaviest > 5 * average  # 1000 trips against 126 on average
    assert skewed.terms["issue"] == pytest.approx(kernels.WARPS * heaviest / lanes / H200.clock_hz)
    assert skewed.terms["issue"] > 5 * ctas * kernels.WARPS * average / (ctas * lanes) / H200.clock_hz
    alike = issue_seconds((heavy,) * 8)
    alike_cycles = model.warp_cycles(alike.issue, alike.issue.per_warp, kernels.WARPS / lanes)[0]
    assert alike.terms["issue"] == pytest.approx(ctas * kernels.WARPS * alike_cycles / (ctas * lanes) / H200.clock_hz)


def test_the_roofline_fraction_leaves_the_launch_out(built):
    stream = kernels.launches(ctas=4, trips=1)["copy"]
    n = 4 * kernels.BLOCK
    p = model.predict(Cost(flops=0, bytes=8 * n), [(built["copy"], traffic.measure(stream))], H200)
    assert p.roof_seconds == pytest.approx(8 * n / H200.hbm_bytes_per_s)
    assert p.roofline_fraction == pytest.approx(p.roof_seconds / p.kernel_seconds)
    assert p.seconds == pytest.approx(p.kernel_seconds + model.LAUNCH_SECONDS)
    assert p.graph_seconds == pytest.approx(p.kernel_seconds + model.GRAPH_LAUNCH_SECONDS)
    assert p.roofline_fraction < 0.1  # a tiny copy waits on a round trip, not on its bytes


OUT_OF_LINE = textwrap.dedent("""\
    //--------------------- .text.k            --------------------------
    k:
    \t//## File "k.cu", line 10
            /*0000*/                   S2R R0, SR_TID.X ;
    .L_x_0:
    \t//## File "k.cu", line 12
            /*0010*/                   FFMA R1, R1, R2, R3 ;
            /*0020*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R5 ;
            /*0030*/              @!P0 BRA `(.L_x_2) ;
    .L_x_1:
            /*0040*/                   FFMA R1, R1, R2, R3 ;
            /*0050*/                   IADD3 R6, R6, 0x1, RZ ;
            /*0060*/                   ISETP.NE.AND P1, PT, R6, R7, PT ;
    \t//## File "k.cu", line 11
            /*0070*/               @P1 BRA `(.L_x_0) ;
            /*0080*/                   EXIT ;
    .L_x_2:
    \t//## File "barrier.h", line 47
            /*0090*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R5 ;
            /*00a0*/              @!P0 BRA `(.L_x_2) ;
            /*00b0*/                   BRA `(.L_x_1) ;
    .L_x_3:
            /*00c0*/                   BRA `(.L_x_3);
""")


def test_out_of_line_retry_paths_are_their_own_loops_inside_the_loop_that_waits():
    """ptxas lays a barrier's retry path out after EXIT: address ranges would make it span the main loop; the
    control-flow graph keeps it a loop of its own, nested in the loop whose trip waits on it."""
    profile = sass.count(sass.parse(OUT_OF_LINE))
    main, retry = profile.loops
    assert main.header == ("k.cu", 11) and main.parent == -1
    assert retry.header == ("barrier.h", 47) and retry.parent == 0
    assert main.counts["fma"] == 2 and main.counts["alu"] == 2  # its own body, the retry path excluded
    assert retry.counts["lsu"] == 1
    assert profile.straight["lsu"] == 1 and sum(profile.straight.values()) == 2  # S2R and EXIT; the self-branch: never
    # the wait: one trip per entry (not traced)
    assert sass.trips(profile, {("k.cu", 11): 9}) == ([8, 8], [True, False])


@pytest.mark.parametrize("header, sizes, trips", [
    ("for (int k = 0; k < ((N + 63) >> 6); ++k) {", {"N": 1000}, 16),
    ("for (int k_1 = 0; k_1 < 16; ++k_1) {", {}, 16),
    ("for (int i = 1; i < min(T, 8); i += 2) {", {"T": 7}, 3),
    ("for (int i = 0; i < max(min(B, ((K + 31) >> 5) - (((int)blockIdx.z) * B)), 0); ++i) {",
     {"B": 5, "K": 512, "blockIdx.z": 4, "blockIdx.x": 3}, 4),  # 5, 5, 5, 1 over the grid's z
    ("for (int k = 0; k < (T / 4); ++k) {", {"T": 17}, 4),
    ("for (int k = 0; k < (((int)threadIdx.x) + 1); ++k) {", {}, None),  # reads a variable sizes do not give
    ("while (true) {", {}, None),
])
def test_cuda_c_loop_bounds_are_evaluated_with_the_sizes(header, sizes, trips):
    assert sass.for_extent(header, sizes) == trips



@pytest.mark.parametrize("header, sizes, bound", [
    ("for (int i = 0; i < (min(max((min((((int)blockIdx.x) * 2) + 2, ((hi + 127) >> 7)) - first), 0), 2)); ++i) {",
     {"blockIdx.x": 4}, 2),  # the data-dependent side is bounded by the block's tiles
    ("for (int i = 0; i < min(count, ((N + 127) >> 7)); ++i) {", {"N": 1000}, 8),
    ("for (int i = 0; i < min(count, limit); ++i) {", {}, None),  # neither side known
    ("for (int i = 0; i < max(count, 4); ++i) {", {}, None),  # max bounds nothing
    ("for (int i = 1; i < min(count, 4); ++i) {", {}, None),  # only loops from 0
])
def test_data_dependent_loop_bounds_take_their_clamp_as_an_upper_bound(header, sizes, bound):
    assert sass.for_extent(header, sizes) is None
    assert sass.for_bound(header, sizes) == bound


def test_a_loop_bound_named_by_a_local_takes_the_locals_value():
    before = ["  int first = max(((int)blockIdx.x) * 2, lo >> 7);", "  int count = min(max(hi - first, 0), 2);",
              "  int other = 7;"]
    header = sass.with_locals("for (int i_2 = 0; i_2 < count; ++i_2) {", before)
    assert header == "for (int i_2 = 0; i_2 < (min(max(hi - first, 0), 2)); ++i_2) {"
    assert sass.for_bound(header, {}) == 2
    assert sass.with_locals("for (int k = 0; k < 16; ++k) {", before) == "for (int k = 0; k < 16; ++k) {"
    assert sass.with_locals("for (int k = 0; k < unknown; ++k) {", before) == "for (int k = 0; k < unknown; ++k) {"


def test_a_loop_bound_named_by_a_local_assigned_later_keeps_its_name_for_the_sizes():
    before = ["  int tiles = 0;", "  int end_1 = end;", "  tiles = (((end_1 + 8191) - start_1) >> 13);"]
    header = sass.with_locals("for (int t = 0; t < tiles; ++t) {", before)
    assert header == "for (int t = 0; t < tiles; ++t) {"
    assert sass.for_extent(header, {"tiles": 3}) == 3
    assert sass.for_extent(header, {}) is None


PHASES = textwrap.dedent("""\
    //--------------------- .text.k            --------------------------
    k:
            /*0000*/                   LDG.E R1, desc[UR4][R2.64] ;
            /*0010*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
            /*0020*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
    .L_x_0:
    \t//## File "k.py", line 5
            /*0030*/                   LDG.E R1, desc[UR4][R2.64] ;
            /*0040*/                   STS [R3], R1 ;
            /*0050*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
            /*0060*/                   LDS R4, [R3] ;
            /*0070*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
            /*0080*/                   ISETP.NE.AND P1, PT, R6, R7, PT ;
            /*0090*/               @P1 BRA `(.L_x_0) ;
            /*00a0*/                   EXIT ;
""")


def test_a_global_phase_is_a_barrier_after_a_blocking_global_load():
    """The first barrier after a load waits on global memory; the next one (shared-memory work only) does not;
    in the loop, one phase per trip."""
    profile = sass.count(sass.parse(PHASES))
    assert profile.straight["barrier"] == 2 and profile.straight["global_phase"] == 1
    (loop,) = profile.loops
    assert loop.counts["barrier"] == 2 and loop.counts["global_phase"] == 1
    counted = model.issue_of(profile, LaunchTraffic(1, 0, 0, 1, lines=((("k.py", 5), 11),)))
    assert counted.trips == (10,) and counted.phases == 1 + 1 + 10


def _roles(joined: bool) -> str:
    """Warps split by threadIdx into two loops on exclusive paths; with `joined`, both go on to a third loop."""
    after = "            /*0080*/                   BRA `(.L_x_4) ;" if joined else "            /*0080*/                   EXIT ;"
    return textwrap.dedent("""\
        //--------------------- .text.k            --------------------------
        k:
                /*0000*/                   S2R R0, SR_TID.X ;
                /*0010*/                   ISETP.GE.AND P0, PT, R0, 0x80, PT ;
                /*0020*/               @P0 BRA `(.L_x_2) ;
        .L_x_0:
                /*0030*/                   FFMA R1, R1, R2, R3 ;
        \t//## File "k.py", line 10
                /*0040*/               @P1 BRA `(.L_x_0) ;
                /*0050*/                   BRA `(.L_x_4) ;
        .L_x_2:
                /*0060*/                   IADD3 R6, R6, 0x1, RZ ;
        \t//## File "k.py", line 20
                /*0070*/               @P1 BRA `(.L_x_2) ;
        """) + after + textwrap.dedent("""
        .L_x_4:
                /*0090*/                   FFMA R1, R1, R2, R3 ;
        \t//## File "k.py", line 30
                /*00a0*/               @P1 BRA `(.L_x_4) ;
                /*00b0*/                   EXIT ;
        .L_x_5:
                /*00c0*/                   BRA `(.L_x_5);
        """)


@pytest.mark.parametrize("joined, shares", [(False, [0.5, 0.5, 0.5]), (True, [0.5, 0.5, 1.0])])
def test_loops_on_exclusive_paths_share_the_warps(joined, shares):
    """Two sibling loops neither of which reaches the other are warp-specialized roles: each runs on half the warps
    (the third loop, reached from the first only, is exclusive with the second: half too); a third loop both reach
    runs on every warp, and the roles before it keep their halves."""
    profile = sass.count(sass.parse(_roles(joined)))
    assert [loop.header[1] for loop in profile.loops] == [10, 20, 30]
    assert [loop.share for loop in profile.loops] == shares


ROLE_SOURCE = textwrap.dedent("""\
    extern "C" __global__ void __launch_bounds__(384, 1) k(float* x) {
      x[0] = 1.0f;
      if (((int)threadIdx.x) < 8) {
        x[1] = 2.0f;
      }
      if (((int)threadIdx.x) < 128) {
        for (int i = 0; i < 4; ++i) {
          x[2] = 3.0f;
        }
      } else {
        if ((((int)threadIdx.x) % 4) == 0) {
          x[3] = 4.0f;
        }
        if (((int)threadIdx.x) >= 256) {
          x[4] = 5.0f;
        } else {
          x[5] = 6.0f;
        }
      }
      x[6] = 7.0f;
    }
    """)


def test_warp_shares_follow_the_role_branches_of_generated_cuda():
    """Lines inside `if (threadIdx.x < N)` / `>= N` branches (and their else) run on the warps holding the
    branch's threads, out of the launch bounds' 12; other braces (a loop, a condition on something else) keep the
    range around them; lines outside every role branch are not listed."""
    shares = sass.warp_shares(ROLE_SOURCE)
    lines = ROLE_SOURCE.splitlines()
    by_text = {lines[n - 1].strip(): share for n, share in shares.items()}
    assert by_text["x[1] = 2.0f;"] == pytest.approx(1 / 12)  # threads 0-7: one warp
    assert by_text["x[2] = 3.0f;"] == pytest.approx(4 / 12)  # the producer warpgroup
    assert by_text["x[3] = 4.0f;"] == pytest.approx(8 / 12)  # the consumers; % 4 is no role
    assert by_text["x[4] = 5.0f;"] == pytest.approx(4 / 12)  # threads 256-383
    assert by_text["x[5] = 6.0f;"] == pytest.approx(4 / 12)  # threads 128-255
    assert not any(lines[n - 1].strip() in ("x[0] = 1.0f;", "x[6] = 7.0f;") for n in shares)
    assert sass.warp_shares(ROLE_SOURCE.replace("__launch_bounds__(384, 1) ", "")) == {}


SPLIT_BY_SOURCE = textwrap.dedent("""\
    //--------------------- .text.k            --------------------------
    k:
            /*0000*/                   S2R R0, SR_TID.X ;
            /*0010*/                   ISETP.GE.AND P0, PT, R0, 0x80, PT ;
            /*0020*/               @P0 BRA `(.L_x_2) ;
    .L_x_0:
    \t//## File "k.cu", line 10
            /*0030*/                   FFMA R1, R1, R2, R3 ;
            /*0040*/               @P1 BRA `(.L_x_0) ;
            /*0050*/                   EXIT ;
    .L_x_2:
    \t//## File "k.cu", line 20
            /*0060*/                   IADD3 R6, R6, 0x1, RZ ;
            /*0070*/               @P1 BRA `(.L_x_2) ;
            /*0080*/                   EXIT ;
    .L_x_5:
            /*0090*/                   BRA `(.L_x_5);
    """)


def test_instructions_count_for_the_warps_that_run_them():
    """With per-instruction warp shares (from the source's role branches: a producer's line 10 on a third of the
    warps, a consumer's line 20 on two thirds) each instruction counts for its share, and the control flow's equal
    split (a half each without the shares) is not applied on top."""
    instructions = sass.parse(SPLIT_BY_SOURCE)
    assert [loop.share for loop in sass.count(instructions).loops] == [0.5, 0.5]
    share = {10: 1 / 3, 20: 2 / 3}
    profile = sass.count(instructions, lambda ins: share.get(ins.site[1], 1.0) if ins.site else 1.0)
    assert [loop.share for loop in profile.loops] == [1.0, 1.0]
    assert [profile.loops[0].counts["fma"], profile.loops[0].counts["other"]] == pytest.approx([1 / 3, 1 / 3])
    assert [profile.loops[1].counts["alu"], profile.loops[1].counts["other"]] == pytest.approx([2 / 3, 2 / 3])
    assert profile.straight["lsu"] == 1.0  # S2R before the split, no line: every warp