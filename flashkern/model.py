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
  time     max(traffic / (HBM peak x MEMORY_EFFICIENCY), flops / (peak of the arithmetic the build uses x
           MATH_EFFICIENCY)) / fill + LAUNCH_SECONDS. The operator's flops go to its stage with tensor-core
           instructions (else to the stage that moves the most bytes); every requested byte is charged at HBM
           speed (re-reads L2 would serve make the figure pessimistic for small re-read data).
The operator's roof is one launch + max(Cost.bytes / HBM peak, Cost.flops / peak of Cost.math) (no kernel beats
its own launch, so a decode-size operator in one launch is near its roof); the predicted roofline fraction is
roof / predicted time.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

import flashkern
from flashkern import registry
from flashkern.autotune import identity
from flashkern.kernels.build import BuildReport, Census, LaunchTraffic
from flashkern.registry import Cost

MEMORY_EFFICIENCY = 0.8  # of HBM peak: what FlashMLA and DeepGEMM report for memory-bound kernels on H800 / H200
MATH_EFFICIENCY = 0.7  # of dense tensor-core peak: DeepGEMM's FP8 GEMMs at large shapes
LAUNCH_SECONDS = 3e-6  # per kernel launch, from the host's launch to the grid's first instruction (no CUDA graph)


@dataclass(frozen=True)
class Device:
    """One GPU's figures the model uses, with where each comes from."""

    name: str
    sms: int
    hbm_bytes_per_s: float
    peak_flops: dict  # arithmetic ("fp8", "bf16", "fp16", "tf32", "int8": dense tensor cores; "fp32": CUDA cores)
    l2_bytes: int | None
    registers_per_sm: int = 65536
    max_registers_per_thread: int = 255
    smem_per_sm: int = 228 * 1024
    smem_reserved_per_cta: int = 1024  # the system's share of each CTA's shared memory (sm_80 and later)
    max_threads_per_sm: int = 2048
    max_ctas_per_sm: int = 32
    sources: str = ""


def _hopper(name: str, hbm: float, sources: str) -> Device:
    return Device(name, sms=132, hbm_bytes_per_s=hbm, l2_bytes=50 * 2**20, sources=sources, peak_flops={
        "fp8": 1979e12, "int8": 1979e12, "bf16": 989e12, "fp16": 989e12, "tf32": 494e12, "fp32": 67e12})


DEVICES = {
    "h200": _hopper("H200 SXM", 4.8e12, "SMs, tensor peaks: the H100 SXM chip (NVIDIA H100 datasheet, dense = half "
                    "the sparse figures; 4096 FLOP/clk/SM x 1.83 GHz x 132 for BF16); HBM3e 4.8 TB/s: NVIDIA H200 "
                    "datasheet; L2 50 MB: the H100 SXM figure (none published for H200); SM limits: CUDA C++ "
                    "Programming Guide, compute capability 9.0"),
    "h100": _hopper("H100 SXM", 3.35e12, "NVIDIA H100 datasheet (SXM5, dense); SM limits: CUDA C++ Programming Guide, "
                    "compute capability 9.0"),
    "b200": Device("B200", sms=148, hbm_bytes_per_s=8e12, l2_bytes=None, peak_flops={
        "fp8": 4.5e15, "int8": 4.5e15, "bf16": 2.25e15, "fp16": 2.25e15, "tf32": 1.1e15, "fp32": 75e12},
        sources="NVIDIA HGX B200 datasheet per GPU (dense = half the sparse figures), 148 SMs; FP32 CUDA-core peak "
                "estimated as 148 SMs x 128 lanes x 2 x ~2 GHz; L2 not published; SM limits as compute capability "
                "9.0 (CUDA C++ Programming Guide, 10.0)"),
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
class StagePrediction:
    report: BuildReport
    traffic: LaunchTraffic
    occupancy: Occupancy
    waves: int
    fill: float  # fraction of the SMs' time the grid keeps busy
    math: str  # the arithmetic its flops are charged at
    flops: float
    seconds: float


@dataclass(frozen=True)
class Prediction:
    stages: tuple[StagePrediction, ...]
    cost: Cost
    device: Device

    @property
    def seconds(self) -> float:
        return sum(s.seconds for s in self.stages)

    @property
    def traffic(self) -> float:
        return sum(s.traffic.bytes for s in self.stages)

    @property
    def traffic_ratio(self) -> float:
        """Bytes the design requests over bytes the operator must move."""
        return self.traffic / self.cost.bytes

    @property
    def roof_seconds(self) -> float:
        return LAUNCH_SECONDS + max(self.cost.bytes / self.device.hbm_bytes_per_s,
                                    self.cost.flops / self.device.peak_flops[self.cost.math])

    @property
    def roofline_fraction(self) -> float:
        return self.roof_seconds / self.seconds

    @property
    def census(self) -> Census:
        return Census.total(s.report.census for s in self.stages)


def _fill(ctas: int, resident: int, device: Device) -> tuple[int, float]:
    """(waves, busy fraction): one wave fills min(CTAs, SMs) of the SMs; later waves leave a tail."""
    if ctas == 0:
        return 0, 1.0
    slots = device.sms * resident
    waves = math.ceil(ctas / slots)
    return waves, min(ctas, device.sms) / device.sms if waves == 1 else ctas / (waves * slots)


def predict(cost: Cost, stages: list[tuple[BuildReport, LaunchTraffic]], device: Device) -> Prediction:
    """The model's time for one call: its stages (each launch's build report and traffic) on `device`."""
    tensor_core = [i for i, (report, _) in enumerate(stages) if report.census.wgmma or report.census.mma_sync]
    busiest = max(range(len(stages)), key=lambda i: stages[i][1].bytes)
    charged = tensor_core[0] if tensor_core else busiest
    predicted = []
    for i, (report, traffic) in enumerate(stages):
        fit = occupancy(report.threads, report.registers, report.smem, device)
        waves, fill = _fill(traffic.ctas, fit.ctas_per_sm, device)
        arithmetic = report.census.mma_input if report.census.mma_input in device.peak_flops else "fp32"
        flops = cost.flops if i == charged else 0.0
        busy = max(traffic.bytes / (device.hbm_bytes_per_s * MEMORY_EFFICIENCY),
                   flops / (device.peak_flops[arithmetic] * MATH_EFFICIENCY))
        seconds = 0.0 if traffic.ctas == 0 else busy / fill + LAUNCH_SECONDS
        predicted.append(StagePrediction(report, traffic, fit, waves, fill, arithmetic, flops, seconds))
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
                     source=identity.source_versions(registry.get(self.op))[self.impl], error=self.error)
        p = self.prediction
        if p is None:
            return found
        stages = [dict(ctas=s.traffic.ctas, sampled=s.traffic.sampled, exact=s.traffic.exact,
                       bytes_read=s.traffic.bytes_read, bytes_written=s.traffic.bytes_written,
                       ctas_per_sm=s.occupancy.ctas_per_sm, limiter=s.occupancy.limiter, waves=s.waves, fill=s.fill,
                       math=s.math, flops=s.flops, seconds=s.seconds, registers=s.report.registers,
                       spills=s.report.spills, smem=s.report.smem, threads=s.report.threads,
                       census=dataclasses.asdict(s.report.census)) for s in p.stages]
        return dict(found, device=p.device.name, model_seconds=p.seconds, roof_seconds=p.roof_seconds,
                    roofline_fraction=p.roofline_fraction, bytes=p.traffic, min_bytes=p.cost.bytes,
                    traffic_ratio=p.traffic_ratio, stages=stages)


SAVED = Path(__file__).resolve().parent.parent / "docs" / "model-h200.json"  # `flashkern model --json`, committed


def current_records(path=None) -> dict[tuple[str, str, str], dict]:
    """A saved model's default-config records (default: SAVED) by (operator, implementation, shape key), those whose
    kernel source is still the one modelled; {} when the file is absent."""
    try:
        with open(path or SAVED) as f:
            records = json.load(f)
    except FileNotFoundError:
        return {}
    ops = registry.operators()
    return {(r["op"], r["impl"], r["problem"]): r for r in records
            if r["default"] and "model_seconds" in r and r["op"] in ops
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
    the caller), in its GPU default config and `sample` more: traffic counted here, builds in worker processes
    (flashkern.compile_check), one per distinct build (impl.kernel.build_key of a shape and config). on_step(done, total) follows
    the builds and then the rows."""
    from flashkern import compile_check

    cases = []
    for name in op_names:
        op = registry.get(name)
        for problem in op.presets[preset]:
            for impl in op.implementations:
                cases += [(op, impl, problem, config, default)
                          for config, default in _gpu_configs(impl, problem, sample, seed)]
    builds = {}
    def build_of(op, impl, problem, config):
        return op.name, impl.name, impl.kernel.build_key(problem, config)

    for op, impl, problem, config, _ in cases:
        builds.setdefault(build_of(op, impl, problem, config), compile_check.BuildJob(op.name, impl.name, problem, config))
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
