"""A performance model of every kernel on a Hopper or Blackwell GPU, from its sm_90a build and its design's
traffic. A model, never a measurement: it says where a design stands against the roofline and moves when the
design gets better; `scripts/gpu_check.sh` measures the same shapes when a GPU is lent.

Per implementation, config and shape, for each kernel launch (stage):
  traffic  global-memory bytes the design requests, every re-read counted (Triton: the interpreter counts each
           load and store of a sample of CTAs, kernels/_triton/traffic; TileLang: counted from the lowered GPU
           program, kernels/_tilelang/traffic), and its ratio to the bytes the operator must move (Cost.bytes);
  fill     CTAs, CTAs resident per SM from registers, shared memory and threads (`occupancy`, the CUDA occupancy
           rules), waves, and the fraction of the SMs' time the grid keeps busy;
  census   the PTX's tensor-core instructions and their input type, TMA and cp.async copies, widest global load,
           atomics and barriers (static counts: kernels/build.Census);
  issue    the SASS each warp issues per pipe (kernels/sass: loops from back edges, counted per trip in a build
           with unrolling off), trips per CTA from the loop headers the traffic count ran (Triton: traced in the
           interpreter, per CTA, so the heaviest traced CTA bounds it too; loops without a traced header count
           one trip per entry), straight code as often as its kernel line ran per CTA (a branch few CTAs take,
           a last arrival's epilogue, is not charged to all), at each pipe's issue rate;
  terms    HBM (bytes L2 does not serve, `hbm_bytes`: tensors it holds, tiles co-resident CTAs share; / (HBM
           peak x MEMORY_EFFICIENCY)), L2 (every requested byte at L2 bandwidth), tensor (flops / (peak of the
           arithmetic built x MATH_EFFICIENCY)), all over the SM fill; issue (warp instructions over the busy
           sub-partitions at the issue efficiency of their warps, and no less than the heaviest CTA's on one SM);
           latency (dependent global phases per CTA x a round trip, per wave); local memory (spills: the SASS's
           local loads and stores, from L1 while the stack frames fit beside shared memory, else L2); host link
           (Cost.host_bytes, a table in pinned host memory, at HOST_LINK_EFFICIENCY of the link's rate, plus one
           round trip over it). The operator's flops go to its stage with tensor-core instructions (else to the
           stage that moves the most bytes);
  time     the memory side's longest term and the compute side's overlapping partly (`composed`), no less than
           the latency term; then a launch: LAUNCH_SECONDS from the host, GRAPH_LAUNCH_SECONDS in a CUDA graph.
The operator's roof is max(Cost.bytes / HBM peak, Cost.flops / peak of Cost.math, Cost.host_bytes / host link rate),
with no launch; the roofline fraction is roof / predicted kernel time (launch excluded, reported beside it), so a
decode-size kernel is judged by its own work.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import flashkern
from flashkern import registry
from flashkern.autotune import identity
from flashkern.kernels import sass
from flashkern.kernels.build import BuildReport, Census, LaunchTraffic
from flashkern.registry import Cost

MEMORY_EFFICIENCY = 0.8  # of HBM peak: what FlashMLA and DeepGEMM report for memory-bound kernels on H800 / H200
MATH_EFFICIENCY = 0.77  # of dense tensor-core peak: TileLang's FP16 GEMM at 8192^3 publishes 758 of 989 TFLOPS
# The memory side (HBM, L2, local memory, host link: one path, so its longest term stands for it) and the compute
# side (tensor, issue) overlap partly: a stage takes (memory^p + compute^p)^(1/p), p = OVERLAP_EXPONENT (infinity
# would be perfect overlap, 1 none), and no less than its latency term. Fitted with the L2 bandwidth on the
# published anchors (docs/model-calibration.md): near-equal terms cost about 1.4x the longer one.
OVERLAP_EXPONENT = 2.0
# A warp waits this long between dependent instructions (the FP32 and integer pipes' latency), so a sub-partition
# issues every cycle only with as many warps to choose from: w < 4 warps a sub-partition dispatch w / 4 of its
# cycles at most (`warp_cycles`).
DEPENDENT_ISSUE_CYCLES = 4
LAUNCH_SECONDS = 3e-6  # per kernel launch, from the host's launch to the grid's first instruction (no CUDA graph)
GRAPH_LAUNCH_SECONDS = 1.3e-6  # per kernel inside a CUDA graph on H100 (Hazy Research, "Look Ma, No Bubbles!", 2025)
# Of a host link's rate that small random reads through UVA get: PCIe's packet headers (about 24 bytes a read
# completion of at most 256) and rows that straddle 128-byte read segments; an estimate until a GPU measures it.
HOST_LINK_EFFICIENCY = 0.7
PCIE5_X16 = 64e9  # bytes per second each way (PCI-SIG: 32 GT/s x 16 lanes, 128b/130b)
NVLINK_C2C = 450e9  # bytes per second each way, Grace to Hopper (NVIDIA GH200 datasheet: 900 GB/s both ways)
HOST_ROUND_TRIP_S = 1.5e-6  # a GPU read of host memory over PCIe and back: about three HBM round trips


# L2 hits per SM and clock, fitted with OVERLAP_EXPONENT on the published anchors: 12.1 TB/s on 132 SMs at 1.83
# GHz. TileLang's FP16 GEMM at 8192^3 moves 12.6 GB through L2 in its published 1451 us (at least 8.7 TB/s), above
# Chips and Cheese's read test ("Nvidia's H100: Funny L2, and Tons of Bandwidth", 2023: 5.5 TB/s on an H100 PCIe,
# 114 SMs at 1755 MHz, 27.5 B/clk/SM).
L2_BYTES_PER_CLOCK_PER_SM = 50.0


@dataclass(frozen=True)
class Device:
    """One GPU's figures the model uses, with where each comes from."""

    name: str
    sms: int
    hbm_bytes_per_s: float
    peak_flops: dict  # arithmetic ("fp8", "bf16", "fp16", "tf32", "int8": dense tensor cores; "fp32": CUDA cores)
    l2_bytes: int | None
    l2_bytes_per_clock_per_sm: float = L2_BYTES_PER_CLOCK_PER_SM  # L2 hits delivered to each SM per clock
    clock_hz: float = 1.83e9  # SM clock under tensor-core load (4096 FLOP/clk/SM x 132 x 1.83 GHz = 989 TFLOPS)
    global_round_trip_s: float = 0.5e-6  # a dependent global load + barrier + the phase's smem work (see below)
    sub_partitions: int = 4  # warp schedulers per SM, each issuing one warp instruction a cycle
    registers_per_sm: int = 65536
    max_registers_per_thread: int = 255
    smem_per_sm: int = 228 * 1024
    l1_bytes_per_sm: int = 256 * 1024  # L1 and shared memory together; local memory (spills) lives in what shared
    # memory leaves, and moves at the shared memory's bandwidth
    l1_bytes_per_clock_per_sm: float = 128.0  # 32 banks x 4 B a clock
    smem_reserved_per_cta: int = 1024  # the system's share of each CTA's shared memory (sm_80 and later)
    max_threads_per_sm: int = 2048
    max_ctas_per_sm: int = 32
    host_link_bytes_per_s: float = PCIE5_X16  # the GPU's reads of pinned host memory, each way
    sources: str = ""

    @property
    def l2_bytes_per_s(self) -> float:
        """L2 hit bandwidth, all SMs: each SM's port to L2 at the SM clock."""
        return self.l2_bytes_per_clock_per_sm * self.sms * self.clock_hz


_HOPPER_SOURCES = ("L2 hits 50 B/clk/SM (12.1 TB/s on 132 SMs at 1.83 GHz): fitted on published anchors "
                   "(docs/model-calibration.md; Chips and Cheese's H100 PCIe read test: 27.5); global "
                   "round trip 0.5 us: HBM latency about the 354 ns Chips and Cheese reads off H100 PCIe, plus the "
                   "barrier; clock 1.83 GHz: the dense BF16 peak's; issue rates: kernels/sass.py")


def _hopper(name: str, hbm: float, sources: str, host_link: float = PCIE5_X16) -> Device:
    return Device(name, sms=132, hbm_bytes_per_s=hbm, l2_bytes=50 * 2**20, sources=f"{sources}; {_HOPPER_SOURCES}",
                  peak_flops={"fp8": 1979e12, "int8": 1979e12, "bf16": 989e12, "fp16": 989e12, "tf32": 494e12,
                              "fp32": 67e12}, host_link_bytes_per_s=host_link)


DEVICES = {
    "h200": _hopper("H200 SXM", 4.8e12, "SMs, tensor peaks: the H100 SXM chip (NVIDIA H100 datasheet, dense = half "
                    "the sparse figures; 4096 FLOP/clk/SM x 1.83 GHz x 132 for BF16); HBM3e 4.8 TB/s: NVIDIA H200 "
                    "datasheet; L2 50 MB: the H100 SXM figure (none published for H200); SM limits: CUDA C++ "
                    "Programming Guide, compute capability 9.0"),
    "gh200": _hopper("GH200 (H200 on Grace)", 4.9e12, "the H200's chip with 144 GB HBM3e at 4.9 TB/s and NVLink-C2C "
                     "450 GB/s each way to the Grace CPU's memory (NVIDIA GH200 datasheet)", host_link=NVLINK_C2C),
    "h100": _hopper("H100 SXM", 3.35e12, "NVIDIA H100 datasheet (SXM5, dense); SM limits: CUDA C++ Programming Guide, "
                    "compute capability 9.0"),
    "b200": Device("B200", sms=148, hbm_bytes_per_s=8e12, l2_bytes=None, peak_flops={
        "fp8": 4.5e15, "int8": 4.5e15, "bf16": 2.25e15, "fp16": 2.25e15, "tf32": 1.1e15, "fp32": 75e12},
        sources="NVIDIA HGX B200 datasheet per GPU (dense = half the sparse figures), 148 SMs; FP32 CUDA-core peak "
                "estimated as 148 SMs x 128 lanes x 2 x ~2 GHz; L2 not published (no L2 credit); L2 bandwidth "
                "per SM and clock, clock, round trip and issue rates as Hopper's (not published); SM limits as "
                "compute capability 9.0 (CUDA C++ Programming Guide, 10.0)"),
}


@dataclass(frozen=True)
class Occupancy:
    ctas_per_sm: int
    limiter: str  # "threads", "registers", "shared memory" or "CTA slots"


def occupancy(threads: int, registers: int, smem: int, device: Device) -> Occupancy:
    """CTAs resident per SM under the CUDA occupancy rules: registers are allocated per warp in units of 256 and
    warps are placed in groups of 4 (one per SM sub-partition); shared memory per CTA (plus the system's 1 KB)
    in units of 128 bytes."""
    warps = math.ceil(threads / 32)
    regs_per_warp = math.ceil(max(registers, 1) * 32 / 256) * 256
    warps_by_registers = (device.registers_per_sm // regs_per_warp) // 4 * 4
    smem_per_cta = math.ceil((smem + device.smem_reserved_per_cta) / 128) * 128
    limits = {
        "threads": device.max_threads_per_sm // 32 // warps,
        "registers": warps_by_registers // warps,
        "shared memory": device.smem_per_sm // smem_per_cta,
        "CTA slots": device.max_ctas_per_sm,
    }
    limiter = min(limits, key=limits.get)
    return Occupancy(limits[limiter], limiter)


@dataclass(frozen=True)
class Issue:
    """What one launch's warps issue, from its SASS profile and trip counts (kernels.sass)."""

    per_warp: dict  # pipe (and event) -> warp instructions one warp issues, on average over the CTAs
    trips: tuple  # trips per CTA of each SASS loop, on average
    traced: bool  # every loop's trips came from a traced header (else some counted once per entry)
    phases: float  # dependent global phases per CTA (barrier-separated passes over global memory)
    heaviest: dict | None = None  # per_warp of the traced CTA that issues the most (None: the CTAs alike)

    def cycles_per_warp(self, per_warp: dict | None = None) -> tuple[float, str]:
        """(cycles one warp occupies its sub-partition, the binding pipe): the dispatch of every instruction, or a
        pipe's instructions at its issue rate, whichever is longer (of the average warp, or of `per_warp`)."""
        per_warp = self.per_warp if per_warp is None else per_warp
        per_pipe = {name: per_warp[name] / rate for name, rate in sass.ISSUE_RATE.items()}
        dispatch = sum(per_warp[name] for name in sass.PIPES)
        pipe_name = max(per_pipe, key=per_pipe.get)
        return (dispatch, "dispatch") if dispatch >= per_pipe[pipe_name] else (per_pipe[pipe_name], pipe_name)


def issue_of(profile: sass.Profile, traffic: LaunchTraffic) -> Issue:
    """Trips from the source lines the traffic count ran, or from loop bounds and sizes (kernels.sass.trips);
    dependent phases: one per CTA, plus each global phase (a barrier reached with a blocking global load issued
    since the last one; cp.async / TMA copies, which pipelined loops wait on stages later, do not count) as
    often as it runs."""
    headers, sizes = dict(traffic.lines), dict(traffic.sizes)
    trips, known = sass.trips(profile, headers, sizes)
    executed = profile.executed(trips, headers)
    heaviest = None
    if len(traffic.cta_lines) > 1:  # CTAs that differ (a last arrival's epilogue, ragged work): the heaviest one
        each = [profile.executed(sass.trips(profile, dict(lines), sizes)[0], dict(lines), headers)
                for lines in traffic.cta_lines]
        heaviest = max(each, key=lambda per_warp: sum(per_warp[name] for name in sass.PIPES))
    return Issue(executed, tuple(trips), all(known), 1.0 + executed["global_phase"], heaviest)


@dataclass(frozen=True)
class StagePrediction:
    report: BuildReport
    traffic: LaunchTraffic
    occupancy: Occupancy
    waves: int
    fill: float  # fraction of the SMs' time the grid keeps busy
    math: str  # the arithmetic its flops are charged at
    flops: float
    terms: dict  # seconds of each bound: "HBM", "L2", "tensor", "issue", "latency", "local memory", "host link"
    issue: Issue | None
    issue_pipe: str = ""  # the pipe (or "dispatch") that binds the issue term

    @property
    def kernel_seconds(self) -> float:
        return composed(self.terms)

    @property
    def bound(self) -> str:
        """The longest term, which the others only add to ("issue (alu)" names the pipe)."""
        if not self.terms:
            return ""
        term = max(self.terms, key=self.terms.get)
        return f"issue ({self.issue_pipe})" if term == "issue" else term

    @property
    def seconds(self) -> float:
        """Kernel time plus a launch from the host (no CUDA graph)."""
        return 0.0 if self.traffic.ctas == 0 else self.kernel_seconds + LAUNCH_SECONDS

    @property
    def graph_seconds(self) -> float:
        """Kernel time plus a launch inside a CUDA graph."""
        return 0.0 if self.traffic.ctas == 0 else self.kernel_seconds + GRAPH_LAUNCH_SECONDS


@dataclass(frozen=True)
class Prediction:
    stages: tuple[StagePrediction, ...]
    cost: Cost
    device: Device

    @property
    def seconds(self) -> float:
        """Predicted time of one call, each launch from the host."""
        return sum(s.seconds for s in self.stages)

    @property
    def kernel_seconds(self) -> float:
        return sum(s.kernel_seconds for s in self.stages)

    @property
    def graph_seconds(self) -> float:
        return sum(s.graph_seconds for s in self.stages)

    @property
    def launch_seconds(self) -> float:
        return self.seconds - self.kernel_seconds

    @property
    def bound(self) -> str:
        """What bounds the stage that takes longest."""
        return max(self.stages, key=lambda s: s.kernel_seconds).bound if self.stages else ""

    @property
    def traffic(self) -> float:
        return sum(s.traffic.bytes for s in self.stages)

    @property
    def traffic_ratio(self) -> float:
        """Bytes the design requests over bytes the operator must move."""
        return self.traffic / self.cost.bytes

    @property
    def roof_seconds(self) -> float:
        """The operator's own floor: its minimum bytes at HBM peak or its flops at the peak its inputs allow; no
        launch (reported beside it), so a small kernel is judged by what it does, not by the launch it waits on."""
        return max(self.cost.bytes / self.device.hbm_bytes_per_s,
                   self.cost.flops / self.device.peak_flops[self.cost.math],
                   self.cost.host_bytes / self.device.host_link_bytes_per_s)

    @property
    def roofline_fraction(self) -> float:
        return self.roof_seconds / self.kernel_seconds if self.kernel_seconds else 1.0

    @property
    def census(self) -> Census:
        return Census.total(s.report.census for s in self.stages)


MEMORY_TERMS = ("HBM", "L2", "local memory", "host link")
COMPUTE_TERMS = ("tensor", "issue")


def composed(terms: dict, exponent: float = OVERLAP_EXPONENT) -> float:
    """A stage's time from its terms' seconds: the memory side's longest and the compute side's longest overlapping
    partly, (memory^p + compute^p)^(1/p) with p = `exponent` (infinity: the longer side); no less than the latency
    term."""
    memory = max(terms.get(name, 0.0) for name in MEMORY_TERMS)
    compute = max(terms.get(name, 0.0) for name in COMPUTE_TERMS)
    both = max(memory, compute) if math.isinf(exponent) else (memory ** exponent + compute ** exponent) ** (
        1 / exponent)
    return max(both, terms.get("latency", 0.0))


def _fill(ctas: int, resident: int, device: Device) -> tuple[int, float]:
    """(waves, busy fraction): one wave fills min(CTAs, SMs) of the SMs; later waves leave a tail."""
    if ctas == 0:
        return 0, 1.0
    slots = device.sms * resident
    waves = math.ceil(ctas / slots)
    return waves, min(ctas, device.sms) / device.sms if waves == 1 else ctas / (waves * slots)


def hbm_bytes(traffic: LaunchTraffic, device: Device, resident_ctas: int = 1) -> float:
    """Bytes that come from HBM, per tensor of the count (without one, or without an L2 figure, every byte): its
    first touches, up to its size, and of its re-reads the fewer that either of two ways of hitting L2 leaves:
      resident: re-reads miss in the fraction of the re-read tensors' total size that L2 cannot hold;
      lockstep: a read that the CTA launched `gap` places before made too (TensorTraffic.shared) hits when that
                CTA is still running: gap < SMs x `resident_ctas` per SM (CTAs start in launch order, so the
                grid's CTAs that stream the same tiles (GEMM panels, the heads of one token) run together)."""
    if not device.l2_bytes or not traffic.tensors:
        return traffic.bytes
    unattributed = traffic.bytes - sum(t.requested for t in traffic.tensors)
    re_read = [t for t in traffic.tensors if t.requested > t.stored]
    missed = max(0.0, 1.0 - device.l2_bytes / sum(t.stored for t in re_read)) if re_read else 0.0
    running = device.sms * resident_ctas
    total = max(unattributed, 0.0)
    for t in traffic.tensors:
        first = min(t.requested, t.stored)
        resident = first + max(t.requested - t.stored, 0.0) * missed
        lockstep = t.requested - sum(nbytes for gap, nbytes in t.shared if gap < running)
        total += max(first, min(resident, lockstep))
    return total


def _issue_seconds(issue: Issue, ctas: int, warps: int, resident: int, device: Device) -> tuple[float, str]:
    """Every warp's cycles spread over the sub-partitions the grid keeps busy: min(CTAs, SMs) SMs, each with at
    most `sub_partitions` of its resident warps issuing at once; and no less than the heaviest CTA's warps take on
    one SM's sub-partitions (a CTA that works alone, such as the last arrival that runs an epilogue, is not
    spread over the grid). A sub-partition with w warps also waits on dependencies: each warp issues at most
    every DEPENDENT_ISSUE_CYCLES (`warp_cycles`)."""
    per_sm = min(resident, math.ceil(ctas / device.sms)) * warps
    lanes = min(ctas, device.sms) * min(device.sub_partitions, per_sm)
    cycles, pipe_name = warp_cycles(issue, issue.per_warp, per_sm / min(device.sub_partitions, per_sm))
    balanced = ctas * warps * cycles / lanes / device.clock_hz
    if issue.heaviest is None:
        return balanced, pipe_name
    heaviest, heaviest_pipe = warp_cycles(issue, issue.heaviest, warps / min(device.sub_partitions, warps))
    alone = warps * heaviest / min(device.sub_partitions, warps) / device.clock_hz
    return (balanced, pipe_name) if balanced >= alone else (alone, heaviest_pipe)


def warp_cycles(issue: Issue, per_warp: dict, warps_per_sub_partition: float) -> tuple[float, str]:
    """(cycles of its sub-partition one warp takes, what binds it): its instructions at their pipes' rates
    (Issue.cycles_per_warp), or, with fewer than DEPENDENT_ISSUE_CYCLES warps to choose from, its share of the
    wait between its own dependent instructions ("dependencies"; independent ones within a warp not credited)."""
    cycles, pipe_name = issue.cycles_per_warp(per_warp)
    waits = sum(per_warp[name] for name in sass.PIPES) * DEPENDENT_ISSUE_CYCLES / warps_per_sub_partition
    return (waits, "dependencies") if waits > cycles else (cycles, pipe_name)


def _local_seconds(issue: Issue, report: BuildReport, ctas: int, resident: int, device: Device) -> float:
    """Spill traffic (the SASS's local loads and stores, every warp's): from L1 at its bandwidth while the resident
    CTAs' stack frames fit in what their shared memory leaves of it, the rest from L2."""
    warps = math.ceil(report.threads / 32)
    moved = issue.per_warp["local_bytes"] * warps * ctas
    frames = report.stack * report.threads * resident
    free = max(0, device.l1_bytes_per_sm - report.smem * resident)
    in_l1 = 1.0 if frames <= free else free / frames
    busy = min(ctas, device.sms)
    return moved * (in_l1 / (device.l1_bytes_per_clock_per_sm * busy * device.clock_hz)
                    + (1 - in_l1) / device.l2_bytes_per_s)


def predict(cost: Cost, stages: list[tuple[BuildReport, LaunchTraffic]], device: Device) -> Prediction:
    """The model's time for one call: its stages (each launch's build report and traffic) on `device`.

    A stage's time composes its terms (`composed`): HBM (bytes L2 misses, `hbm_bytes`, at MEMORY_EFFICIENCY of the
    peak) and L2 (every requested byte at L2 bandwidth), both over the SM fill; tensor (the operator's flops, charged
    to the stage with tensor-core instructions, at MATH_EFFICIENCY of the peak of the arithmetic built) over the
    fill; issue (the SASS's warp instructions over the sub-partitions busy, `_issue_seconds`); latency (waves x
    dependent phases per CTA x a global round trip). Then a launch: from the host, or inside a CUDA graph."""
    tensor_core = [i for i, (report, _) in enumerate(stages) if report.census.wgmma or report.census.mma_sync]
    busiest = max(range(len(stages)), key=lambda i: stages[i][1].bytes)
    charged = tensor_core[0] if tensor_core else busiest
    predicted = []
    for i, (report, traffic) in enumerate(stages):
        fit = occupancy(report.threads, report.registers, report.smem, device)
        waves, fill = _fill(traffic.ctas, fit.ctas_per_sm, device)
        arithmetic = report.census.mma_input if report.census.mma_input in device.peak_flops else "fp32"
        flops = cost.flops if i == charged else 0.0
        terms, issue, pipe_name = {}, None, ""
        if traffic.ctas:
            terms = {"HBM": hbm_bytes(traffic, device, fit.ctas_per_sm) / (device.hbm_bytes_per_s * MEMORY_EFFICIENCY)
                     / fill,
                     "L2": traffic.bytes / device.l2_bytes_per_s / fill,
                     "tensor": flops / (device.peak_flops[arithmetic] * MATH_EFFICIENCY) / fill}
            if report.issue is not None:
                issue = issue_of(report.issue, traffic)
                terms["issue"], pipe_name = _issue_seconds(issue, traffic.ctas, math.ceil(report.threads / 32),
                                                           fit.ctas_per_sm, device)
                terms["latency"] = waves * issue.phases * device.global_round_trip_s
                if issue.per_warp.get("local_bytes"):
                    terms["local memory"] = _local_seconds(issue, report, traffic.ctas, fit.ctas_per_sm, device) / fill
            if cost.host_bytes and i == busiest:
                terms["host link"] = (cost.host_bytes / (device.host_link_bytes_per_s * HOST_LINK_EFFICIENCY)
                                      + HOST_ROUND_TRIP_S)
        predicted.append(StagePrediction(report, traffic, fit, waves, fill, arithmetic, flops, terms, issue,
                                         pipe_name))
    return Prediction(tuple(predicted), cost, device)


# ---------------------------------------------------------------- every implementation at a preset's shapes


@dataclass(frozen=True)
class Row:
    op: str
    impl: str
    problem: object
    config: dict
    default: bool
    prediction: Prediction | None
    error: str = ""

    def record(self) -> dict:
        """The row as JSON-ready data, with the kernel source's version (a record is stale once it changes)."""
        found = dict(op=self.op, impl=self.impl, problem=self.problem.key, config=self.config, default=self.default,
                     source=identity.source_versions(registry.get(self.op))[self.impl], model=MODEL_VERSION,
                     error=self.error)
        p = self.prediction
        if p is None:
            return found
        stages = [dict(ctas=s.traffic.ctas, sampled=s.traffic.sampled, exact=s.traffic.exact,
                       bytes_read=s.traffic.bytes_read, bytes_written=s.traffic.bytes_written,
                       footprint=s.traffic.footprint, ctas_per_sm=s.occupancy.ctas_per_sm, limiter=s.occupancy.limiter,
                       waves=s.waves, fill=s.fill, math=s.math, flops=s.flops, seconds=s.seconds,
                       kernel_seconds=s.kernel_seconds, terms=s.terms, bound=s.bound,
                       issue=None if s.issue is None else dict(per_warp=s.issue.per_warp, trips=s.issue.trips,
                                                               traced=s.issue.traced, phases=s.issue.phases,
                                                               heaviest=s.issue.heaviest),
                       registers=s.report.registers,
                       spills=s.report.spills, smem=s.report.smem, threads=s.report.threads,
                       census=dataclasses.asdict(s.report.census)) for s in p.stages]
        return dict(found, device=p.device.name, model_seconds=p.seconds, kernel_seconds=p.kernel_seconds,
                    launch_seconds=p.launch_seconds, graph_seconds=p.graph_seconds, bound=p.bound,
                    roof_seconds=p.roof_seconds, roofline_fraction=p.roofline_fraction, bytes=p.traffic, min_bytes=p.cost.bytes,
                    traffic_ratio=p.traffic_ratio, stages=stages)


SAVED = Path(__file__).resolve().parent.parent / "docs" / "model-h200.json"  # `flashkern model --json`, committed
# The model's own version, kept in each record: a record priced by another model (its terms, constants or SASS
# reading changed since) is stale like one of another kernel source.
MODEL_VERSION = hashlib.sha256(b"".join(Path(module.__file__).read_bytes() for module in (sys.modules[__name__], sass))
                               ).hexdigest()[:16]


def current_records(path=None) -> dict[tuple[str, str, str], dict]:
    """A saved model's default-config records (default: SAVED) by (operator, implementation, shape key), those whose
    kernel source is still the one modelled, priced by this model (MODEL_VERSION); {} when the file is absent."""
    try:
        with open(path or SAVED) as f:
            records = json.load(f)
    except FileNotFoundError:
        return {}
    ops = registry.operators()
    return {(r["op"], r["impl"], r["problem"]): r for r in records
            if r["default"] and "model_seconds" in r and r["op"] in ops and r.get("model") == MODEL_VERSION
            and identity.source_versions(ops[r["op"]]).get(r["impl"]) == r["source"]}


def _gpu_configs(impl, problem, sample: int, seed: int) -> list[tuple[dict, bool]]:
    """(config, is default) pairs: the GPU default config and `sample` configs of the tuning space."""
    with flashkern.planning_for_gpu():
        default = impl.default_config(problem)
    sampled = [c for c in impl.space.sample(problem, sample, seed) if c != default]
    return [(default, True), *[(c, False) for c in sampled]]


def _traffic(op, impl, problem, config) -> tuple[LaunchTraffic, ...]:
    inputs = op.make_inputs(problem, "cpu", 0)
    op.check(inputs)  # the kernel views of accepted forms
    return impl.traffic(problem, inputs, config, op.empty_outputs(problem, inputs))


def evaluate(op_names, preset: str, device: Device, sample: int = 0, seed: int = 0, workers: int | None = None,
             on_step=None) -> list[Row]:
    """The model of every implementation of `op_names` at each shape of `preset` (operators without it skipped by
    the caller), in its GPU default config and `sample` more (`evaluate_problems`)."""
    problems = [(name, problem) for name in op_names for problem in registry.get(name).presets[preset]]
    return evaluate_problems(problems, device, sample, seed, workers, on_step)


def evaluate_problems(problems, device: Device, sample: int = 0, seed: int = 0, workers: int | None = None,
                      on_step=None) -> list[Row]:
    """The model of every implementation of each (operator name, problem) in `problems`, in its GPU default config
    and `sample` more: traffic counted here, builds in worker processes (flashkern.compile_check), one per distinct
    build (impl.kernel.build_key of a shape and config). on_step(done, total) follows the builds and then the
    rows."""
    from flashkern import compile_check

    cases = []
    for name, problem in problems:
        op = registry.get(name)
        for impl in op.implementations:
            cases += [(op, impl, problem, config, default)
                      for config, default in _gpu_configs(impl, problem, sample, seed)]
    builds = {}
    def build_of(op, impl, problem, config):
        return op.name, impl.name, impl.kernel.build_key(problem, config)

    for op, impl, problem, config, _ in cases:
        builds.setdefault(build_of(op, impl, problem, config),
                          compile_check.BuildJob(op.name, impl.name, problem, config, issue=True))
    jobs = list(builds.values())
    total, done = len(jobs) + len(cases), iter(range(1, len(jobs) + len(cases) + 1))

    def step(*_):
        if on_step:
            on_step(next(done), total)

    built = dict(zip(builds, compile_check.run(jobs, workers, on_result=step)))
    rows = []
    for op, impl, problem, config, default in cases:
        result = built[build_of(op, impl, problem, config)]
        try:
            if not result.ok:
                raise RuntimeError(("skipped: " if result.skipped else "build failed: ") + result.error)
            traffic = _traffic(op, impl, problem, config)
            rows.append(Row(op.name, impl.name, problem, config, default,
                            predict(op.cost(problem), list(zip(result.stages, traffic, strict=True)), device)))
        except Exception as exc:  # a row that cannot be modelled is reported, the others still are
            rows.append(Row(op.name, impl.name, problem, config, default, None, f"{type(exc).__name__}: {exc}"))
        step()
    return rows
