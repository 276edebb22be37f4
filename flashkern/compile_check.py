"""GPU build check without a GPU: every implementation lowers and compiles for sm_90a.

For each operator and each shape of a preset, the default config and a reproducible sample of the tuning space
are built, once per distinct build (Triton: every shape, specialized as its JIT specializes the launch arguments;
TileLang: every distinct program, sizes dynamic):
  Triton:   ahead-of-time compile for GPUTarget("cuda", 90, 32), then Triton's ptxas -v;
  TileLang: the GPU flavour lowered for sm_90a, then nvcc -ptx and -cubin --resource-usage.
Builds run in parallel worker processes started with TRITON_INTERPRET=0 (interpreted
kernels cannot be compiled). TileLang builds need nvcc; where it is absent they are
reported as skipped, never as passed.
"""

from __future__ import annotations

import multiprocessing
import os
import time
import traceback
from concurrent.futures import ProcessPoolExecutor, as_completed
from contextlib import contextmanager
from dataclasses import dataclass

import flashkern
from flashkern import registry
from flashkern.kernels import build as kernel_build
from flashkern.kernels.build import BuildReport


@dataclass(frozen=True)
class BuildJob:
    op: str
    impl: str
    problem: object
    config: dict | None  # None: the implementation's default, resolved where the build runs
    issue: bool = False  # also profile the SASS issue (kernels.sass), as the performance model needs

    @property
    def default(self) -> bool:
        return self.config is None


@dataclass(frozen=True)
class BuildResult:
    job: BuildJob
    config: dict  # the config that was built
    stages: tuple[BuildReport, ...] | None  # one report per kernel launch, in order
    seconds: float
    error: str = ""
    skipped: bool = False  # the toolchain for this build is missing here

    @property
    def ok(self) -> bool:
        return self.stages is not None

    @property
    def report(self) -> BuildReport | None:
        """The stages' largest figures."""
        return None if self.stages is None else BuildReport.merge(self.stages)


def plan(op_names, preset: str = "smoke", sample: int = 2, seed: int = 0) -> list[BuildJob]:
    """Default config plus `sample` more configs per implementation and shape of the preset, one job per distinct
    build (impl.kernel.build_key): per shape for Triton (its JIT specializes on integer values), per distinct
    program for TileLang (sizes are dynamic). Sampled configs are drawn per shape, reproducibly, other than the
    default.

    A default job carries config None: the build worker (not interpreted) resolves it, as the parent did here for
    the key, to the GPU default.
    """
    jobs = []
    for name in op_names:
        op = registry.get(name)
        for impl in op.implementations:
            seen = set()
            for problem in op.presets[preset]:
                with flashkern.planning_for_gpu():
                    default = impl.default_config(problem)
                sampled = impl.space.sample_from([c for c in impl.space.configs(problem) if c != default], sample,
                                                 seed) if sample else []
                for config in (None, *sampled):
                    key = impl.kernel.build_key(problem, default if config is None else config)
                    if key not in seen:
                        seen.add(key)
                        jobs.append(BuildJob(name, impl.name, problem, config))
    return jobs


def build(job: BuildJob) -> BuildResult:
    """Build one job (in a worker process with TRITON_INTERPRET=0)."""
    from flashkern.kernels._tilelang import nvcc_path

    op = registry.get(job.op)
    impl = op.implementation(job.impl)
    config = impl.default_config(job.problem) if job.default else job.config
    start = time.perf_counter()
    if job.impl == "tilelang" and nvcc_path() is None:
        return BuildResult(job, config, None, 0.0, "nvcc not found", skipped=True)
    try:
        inputs = op.make_inputs(job.problem, "cpu", 0)
        op.check(inputs)  # the kernel views of accepted forms
        with kernel_build.profiling_issue(job.issue):
            stages = impl.build_stages_sm90(job.problem, inputs, config, op.empty_outputs(job.problem, inputs))
        return BuildResult(job, config, stages, time.perf_counter() - start)
    except Exception as exc:  # a failed build is a result to report, not a crash of the check
        detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        return BuildResult(job, config, None, time.perf_counter() - start, detail[-2000:])


@contextmanager
def environment(**values):
    """os.environ with `values` set inside the block (read by processes spawned there)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run(jobs: list[BuildJob], workers: int | None = None, on_result=None) -> list[BuildResult]:
    """Build every job in spawned workers that compile Triton natively; results in job order."""
    workers = workers or max(1, min(len(jobs), os.cpu_count() or 1))
    results: list[BuildResult | None] = [None] * len(jobs)
    # Workers inherit the environment at spawn time; the parent's own kernels are already defined.
    with environment(TRITON_INTERPRET="0"), ProcessPoolExecutor(
        max_workers=workers, mp_context=multiprocessing.get_context("spawn")
    ) as pool:
        futures = {pool.submit(build, job): i for i, job in enumerate(jobs)}
        for future in as_completed(futures):
            results[futures[future]] = future.result()
            if on_result:
                on_result(results[futures[future]])
    return results
