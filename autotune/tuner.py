"""Sweeps: measure every implementation and config per shape, keep the results, pick a winner.

For one operator and a list of problems, on one device:
  1. candidates: the reference, and per implementation that runs here its default config plus up to
     max_configs - 1 more from its tuning space (limits pruned for the target). On CPU, GPU-only
     parameters are pinned to the default's values, and interpreted Triton contributes only its
     default config: it is checked for correctness but never timed or chosen.
  2. resume: candidates already in the store for this device and these versions are skipped.
  3. build, in parallel worker processes: TileLang kernels are compiled (filling TileLang's disk
     cache for the timing process); on sm_90 devices every kernel is also built for its register,
     spill and shared-memory report, and spilling configs are pruned with the reason recorded.
  4. one at a time: run, compare with the reference on the tuning inputs (failures are stored
     with their reason), time, store.
  5. decide: the leaders (within 25% of the best median) are re-timed in alternation; among
     those within the noise of the fastest, the simplest wins (the reference, then a default
     config, then others). The decision is stored with the versions of every candidate.
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass

import torch

from flashkern import device as devices
from flashkern import registry
from flashkern.autotune import identity
from flashkern.autotune import store as st
from flashkern.autotune.timing import measure

LEADER_WINDOW = 1.25  # leaders: within 25% of the best first-pass median
MAX_LEADERS = 4
RETIME_ROUNDS = 5
MIN_NOISE = 0.03  # differences under 3% are never trusted


@dataclass(frozen=True)
class Candidate:
    impl: str  # "reference" or an implementation name
    config: dict
    is_default: bool
    timed: bool  # False: correctness only (interpreted Triton)

    @property
    def rank(self) -> int:
        """Simplicity, for ties within the noise: the reference, then defaults, then other configs."""
        return 0 if self.impl == "reference" else 1 if self.is_default else 2


@dataclass
class Summary:
    measured: int = 0  # new results stored (timed, checked or rejected)
    reused: int = 0  # candidates found in the store
    built: int = 0  # kernels built in workers
    decided: int = 0  # new decisions


def candidates(op, problem, info, max_configs: int, seed: int = 0) -> list[Candidate]:
    found = [Candidate("reference", {}, True, True)]
    for impl in op.implementations:
        if impl.unavailable(info):
            continue
        default = impl.default_config(problem)
        if info.kind == "cpu" and impl.name == "triton":  # interpreter: a correctness path only
            found.append(Candidate(impl.name, default, True, False))
            continue
        pin = None if info.kind == "cuda" else default
        others = [c for c in impl.space.configs(problem, info.kind, pin=pin) if c != default]
        if max_configs:
            others = impl.space.sample_from(others, max_configs - 1, seed)
        found += [Candidate(impl.name, default, True, True)] + [Candidate(impl.name, c, False, True) for c in others]
    return found


def _key(op, problem, candidate: Candidate, dtypes: str, device_key: str) -> st.Key:
    return st.Key(op.name, candidate.impl, st.canonical(candidate.config), problem.key, dtypes, device_key,
                  identity.versions(op, candidate.impl))


def _build(op_name: str, impl_name: str, problem, config: dict, device: str):
    """Worker: compile one kernel; on sm_90 devices also report its resources. Returns (status, reason, report)."""
    from flashkern.kernels._tilelang import CPU, GPU

    op = registry.get(op_name)
    impl = op.implementation(impl_name)
    info = devices.info(device)
    try:
        report = None
        if info.kind == "cuda" and info.capability == (9, 0):
            inputs = op.make_inputs(problem, "cpu", 0)
            report = impl.build_sm90(problem, inputs, config, op.empty_outputs(problem, inputs))
            if report.spills:
                return st.PRUNED, f"spills {report.spills} B at {report.registers} registers (sm_90a)", report
        if impl_name == "tilelang":
            impl.kernel.compiled(problem, config, GPU if info.kind == "cuda" else CPU)
        return st.OK, "", report
    except Exception as exc:  # a failed build is a stored result, not a crash of the sweep
        last_line = (str(exc).strip().splitlines() or [""])[-1]
        return st.BUILD_FAILED, f"{type(exc).__name__}: {last_line[:300]}", None


class Tuner:
    def __init__(self, store: st.Store, device: str | None = None, budget: float = 0.2, max_configs: int = 24,
                 workers: int | None = None, seed: int = 0, progress=None):
        self.store = store
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.info = devices.info(self.device)
        self.budget = budget
        self.max_configs = max_configs
        self.workers = workers or max(1, (os.cpu_count() or 2) - (1 if self.info.kind == "cuda" else 0))
        self.seed = seed
        self.progress = progress  # callable(total=..., advance=..., description=...)

    def _report(self, **kw):
        if self.progress:
            self.progress(**kw)

    def tune(self, op_name: str, problems) -> Summary:
        op = registry.get(op_name)
        summary = Summary()
        plans = []
        for problem in problems:
            inputs = op.make_inputs(problem, self.device, seed=self.seed)
            dtypes = identity.dtypes(inputs)
            todo = []
            for cand in candidates(op, problem, self.info, self.max_configs, self.seed):
                key = _key(op, problem, cand, dtypes, self.info.key)
                if self.store.get(key) is None:
                    todo.append((cand, key))
                else:
                    summary.reused += 1
            plans.append((problem, inputs, dtypes, todo))

        builds = [(problem, cand, key) for problem, _, _, todo in plans for cand, key in todo
                  if cand.impl != "reference" and (self.info.kind == "cuda" or cand.impl == "tilelang")]
        timed = sum(len(todo) for *_, todo in plans)
        self._report(total=len(builds) + timed + len(plans), description=f"tuning {op.name}")
        failed = self._build_all(op, builds, summary)

        for problem, inputs, dtypes, todo in plans:
            expected = op.reference(**inputs)
            for cand, key in todo:
                if key not in failed:
                    self.store.put(self._measure(op, problem, inputs, expected, cand, key))
                    summary.measured += 1
                self._report(advance=1)
            self._decide(op, problem, inputs, dtypes, summary)
            self._report(advance=1)
        return summary

    # ------------------------------------------------------------ steps

    def _result(self, op, problem, cand: Candidate, key: st.Key, status: str, reason: str = "", timing=None,
                report=None) -> st.Result:
        cost = op.cost(problem)
        return st.Result(
            key=key, spec=repr(problem.specialization()), sizes=tuple(problem.sizes), is_default=cand.is_default,
            bytes=cost.bytes, flops=cost.flops, status=status, reason=reason,
            median=timing.median if timing else None, low=timing.low if timing else None,
            high=timing.high if timing else None, reps=timing.reps if timing else None,
            registers=report.registers if report else None, spills=report.spills if report else None,
            smem=report.smem if report else None)

    def _build_all(self, op, builds, summary: Summary) -> set:
        """Build in parallel; store failures and pruned configs; return their keys."""
        failed = set()
        if not builds:
            return failed
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=min(self.workers, len(builds)), mp_context=context) as pool:
            futures = {pool.submit(_build, op.name, cand.impl, problem, cand.config, str(self.device)):
                       (problem, cand, key) for problem, cand, key in builds}
            for future in as_completed(futures):
                problem, cand, key = futures[future]
                status, reason, report = future.result()
                summary.built += 1
                if status != st.OK:
                    self.store.put(self._result(op, problem, cand, key, status, reason, report=report))
                    summary.measured += 1
                    failed.add(key)
                self._report(advance=1)
        return failed

    def _run(self, op, problem, inputs, cand: Candidate):
        if cand.impl == "reference":
            return lambda: op.reference(**inputs)
        impl = op.implementation(cand.impl)
        out = op.empty_outputs(problem, inputs)  # written in full by every run
        return lambda: impl.run(problem, inputs, cand.config, out)

    def _measure(self, op, problem, inputs, expected, cand: Candidate, key: st.Key) -> st.Result:
        run = self._run(op, problem, inputs, cand)
        try:
            op.compare(inputs, expected, run())
        except AssertionError as exc:
            return self._result(op, problem, cand, key, st.INCORRECT, str(exc).strip().splitlines()[0][:500])
        except Exception as exc:
            return self._result(op, problem, cand, key, st.ERROR, f"{type(exc).__name__}: {str(exc)[:300]}")
        if not cand.timed:
            return self._result(op, problem, cand, key, st.CHECKED, "correct; the interpreter is not timed")
        return self._result(op, problem, cand, key, st.OK, timing=measure(run, self.device, budget=self.budget))

    def _decide(self, op, problem, inputs, dtypes: str, summary: Summary) -> st.Decision | None:
        versions = identity.op_versions(op)
        for existing in self.store.decisions(op.name, self.info.key):
            if existing.shape == problem.key and existing.dtypes == dtypes and existing.versions == versions:
                return None  # already decided for these versions
        current = []
        for cand in candidates(op, problem, self.info, self.max_configs, self.seed):
            result = self.store.get(_key(op, problem, cand, dtypes, self.info.key))
            if result is not None and result.status == st.OK:
                current.append((cand, result))
        if not current:
            return None
        best = min(r.median for _, r in current)
        leaders = sorted((c for c in current if c[1].median <= LEADER_WINDOW * best), key=lambda c: c[1].median)
        leaders = [cand for cand, _ in leaders[:MAX_LEADERS]]
        medians = [r.median for _, r in sorted(current, key=lambda c: c[1].median)[:len(leaders)]]
        noise = MIN_NOISE
        if len(leaders) > 1:  # re-time the leaders in alternation: slow drifts hit all of them alike
            rounds = [[] for _ in leaders]
            for _ in range(RETIME_ROUNDS):
                for i, cand in enumerate(leaders):
                    timing = measure(self._run(op, problem, inputs, cand), self.device,
                                     budget=self.budget / RETIME_ROUNDS)
                    rounds[i].append(timing.median)
            medians = [statistics.median(times) for times in rounds]
            noise = max(MIN_NOISE, max((max(t) - min(t)) / statistics.median(t) for t in rounds) / 2)
        fastest = min(range(len(leaders)), key=lambda i: medians[i])
        tied = [i for i in range(len(leaders)) if medians[i] <= medians[fastest] * (1 + noise)]
        won = min(tied, key=lambda i: (leaders[i].rank, medians[i]))
        winner = leaders[won]
        reason = "fastest" if won == fastest else (
            f"within {noise:.0%} noise of {leaders[fastest].impl} {leaders[fastest].config}: the simpler one wins")
        decision = st.Decision(op.name, problem.key, dtypes, self.info.key, versions, repr(problem.specialization()),
                               tuple(problem.sizes), winner.impl, st.canonical(winner.config), medians[won], reason)
        self.store.decide(decision)
        summary.decided += 1
        return decision
