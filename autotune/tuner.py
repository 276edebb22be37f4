"""Sweeps: measure every implementation and config per shape, keep the results, pick a winner.

For one operator and a list of problems, on one device:
  1. candidates: the reference, and per implementation that runs here (of `backends`, default
     all) its default config plus up to max_configs - 1 more from its tuning space (limits pruned
     for the target). On CPU, GPU-only parameters are pinned to the default's values, and
     interpreted Triton contributes only its default config: it is checked for correctness but
     never timed or chosen.
  2. resume: candidates already in the store for this device and these versions are skipped,
     unless timed at another thread count (rows of a schema-1 store have none: they are timed
     again, and their shapes decided again).
  3. build, in parallel worker processes (one worker: in this process): TileLang kernels are compiled
     (filling TileLang's disk cache for the timing process); on sm_90 devices every kernel is also built
     for its register, spill and shared-memory report, and spilling configs are pruned with the reason
     recorded.
  4. per shape: run each candidate once and compare with the reference on the tuning inputs
     (failures are stored with their reason), then time the correct ones together (a timing
     pass, below) and store each with its median, IQR and thread count.
  5. decide: the leaders (by stored median: the fastest, the runner-up, and any other within 25%
     of the fastest or not beaten by it beyond the spread; at most 4) are timed again together,
     in ROUNDS fresh interleaved rounds (their stored figures may come from other passes or
     runs). The fastest wins when it beats every other leader beyond the spread; otherwise the
     leaders are timed once more, and if still not separated the simplest of the fastest and
     those it does not beat wins (the reference, then a default config, then the faster), with a
     reason starting "within noise". The decision is stored with the winner's median and IQR
     from that re-time, the thread count, and the versions of every candidate.
Steps 4 and 5 run in a Measurer, which writes nothing: the Tuner stores each result as it comes, and
autotune.ray_sweep runs them as one Ray task per shape.

A timing pass (`Measurer._time`, step 4) runs ROUNDS interleaved rounds: each round times every
candidate once for budget / ROUNDS seconds (flashkern.autotune.timing.measure, at the tuner's
fixed torch thread count), starting one candidate further along each round, so a slow spell of
the machine falls on all candidates alike rather than on one. A candidate's figure pools the
samples of its rounds. An outlier (IQR over OUTLIER_SPREAD of the median, or round medians
spread over ROUND_DISAGREEMENT of it) is measured again, in rounds with the other outliers, up
to REMEASURES time(s); the steadiest pass is kept (a non-outlier first, then the smallest
relative IQR). "Beyond the spread" is flashkern.autotune.timing.beats: the runner-up's median
exceeds the winner's by more than half of each IQR plus 3% of the winner's median.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Any

import torch

from flashkern import device as devices
from flashkern import registry
from flashkern.autotune import identity
from flashkern.autotune import store as st
from flashkern.autotune.timing import Timing, beats, default_threads, measure, pooled

ROUNDS = 5  # interleaved rounds per timing pass
OUTLIER_SPREAD = 0.25  # an IQR over 25% of the median: timed through a noisy spell
ROUND_DISAGREEMENT = 0.5  # round medians spread over 50% of the median: a slow spell hit some rounds
REMEASURES = 1  # more passes for outliers
LEADER_WINDOW = 1.25  # leaders: within 25% of the best stored median (or not beaten by it beyond the spread)
MAX_LEADERS = 4
DECIDE_PASSES = 2  # timing passes of the leaders before a decision is taken within noise


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

    def __str__(self) -> str:
        return self.impl if self.impl == "reference" else f"{self.impl} {st.canonical(self.config)}"


@dataclass
class Summary:
    measured: int = 0  # new results stored (timed, checked or rejected)
    reused: int = 0  # candidates found in the store
    built: int = 0  # kernels built
    decided: int = 0  # new decisions


def candidates(op, problem, info, max_configs: int, seed: int = 0, backends=None) -> list[Candidate]:
    """The reference, then per implementation of `backends` (default: all) its default and sampled configs."""
    found = [Candidate("reference", {}, True, True)]
    for impl in op.implementations:
        if impl.unavailable(info) or (backends is not None and impl.name not in backends):
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


def verdict(leaders: list[Candidate], timings: list[Timing]) -> tuple[int, str, bool]:
    """(index of the winner, the reason, whether it beat every other leader beyond the spread).

    Separated: the fastest by median. Otherwise the simplest (Candidate.rank, then the faster) of the
    fastest and the leaders it does not beat beyond the spread, with a reason starting "within noise"."""
    order = sorted(range(len(leaders)), key=lambda i: timings[i].median)
    fastest, runner_up = order[0], order[1]
    rivals = [i for i in order[1:] if not beats(timings[fastest], timings[i])]
    if not rivals:
        fast, slow = timings[fastest], timings[runner_up]
        return fastest, (f"fastest: {slow.median / fast.median:.2f}x faster than {leaders[runner_up]}, beyond the "
                         f"spread (IQR {fast.spread:.0%} and {slow.spread:.0%} of the medians)"), True
    won = min([fastest] + rivals, key=lambda i: (leaders[i].rank, timings[i].median))
    tied = ", ".join(f"{leaders[i]} {timings[i].median * 1e6:.4g} us (IQR {timings[i].iqr * 1e6:.3g})"
                     for i in [fastest] + rivals)
    return won, f"within noise: {tied}; the simplest wins", False


def _key(op, problem, candidate: Candidate, dtypes: str, device_key: str) -> st.Key:
    return st.Key(op.name, candidate.impl, st.canonical(candidate.config), problem.key, dtypes, device_key,
                  identity.versions(op, candidate.impl))


def build(op_name: str, impl_name: str, problem, config: dict, info) -> tuple:
    """Worker: build one kernel for the measuring device `info` (a DeviceInfo, perhaps not this process's): on sm_90
    the sm_90a build, whose resources prune a spilling config; a TileLang kernel is also compiled where this process
    can run it (filling TileLang's disk cache for the measuring process). Returns (status, reason, report)."""
    from flashkern.kernels._tilelang import CPU, GPU

    op = registry.get(op_name)
    impl = op.implementation(impl_name)
    try:
        report = None
        sm90 = info.kind == "cuda" and info.capability == (9, 0)
        # (their layout is what a TileLang program may specialize on)
        inputs = op.make_inputs(problem, "cpu", 0) if sm90 or impl_name == "tilelang" else None
        if sm90:
            report = impl.build_sm90(problem, inputs, config, op.empty_outputs(problem, inputs))
            if report.spills:
                return st.PRUNED, f"spills {report.spills} B at {report.registers} registers (sm_90a)", report
        if impl_name == "tilelang" and (info.kind == "cpu" or torch.cuda.is_available()):
            impl.kernel.compiled(problem, config, GPU if info.kind == "cuda" else CPU, inputs)
        return st.OK, "", report
    except Exception as exc:  # a failed build is a stored result, not a crash of the sweep
        last_line = (str(exc).strip().splitlines() or [""])[-1]
        return st.BUILD_FAILED, f"{type(exc).__name__}: {last_line[:300]}", None


def _outlier(timing: Timing, rounds: list[Timing]) -> bool:
    """A large spread relative to the median, or rounds whose medians disagree."""
    medians = [r.median for r in rounds]
    return timing.spread > OUTLIER_SPREAD or (max(medians) - min(medians)) / timing.median > ROUND_DISAGREEMENT


@dataclass
class ShapeWork:
    """One shape's checking, timing and decision, as a process without the store does it: the candidates to
    check and time (their builds passed), the current results the decision weighs besides theirs, and whether a
    current decision exists already (then none is taken)."""

    op: str
    problem: Any
    todo: list[Candidate]
    stored: list[tuple[Candidate, st.Result]]  # OK results of the shape's other candidates, at the sweep's threads
    decided: bool


@dataclass
class ShapeOutcome:
    results: list[st.Result]  # one per candidate of the work's todo: timed, or why not
    decision: st.Decision | None


class Measurer:
    """Checks candidates against the reference, times them and decides shapes on this process's device; it writes
    nothing (a Tuner, or a Ray sweep's driver, stores what it returns). Results are keyed on this process's own
    device identity."""

    def __init__(self, device: str, budget: float, threads: int, seed: int = 0, progress=None):
        self.device = torch.device(device)
        self.info = devices.info(self.device)
        self.budget, self.threads, self.seed, self.progress = budget, threads, seed, progress

    def _report(self, **kw):
        if self.progress:
            self.progress(**kw)

    def measure(self, work: ShapeWork, inputs: dict | None = None, on_result=None) -> ShapeOutcome:
        """The work's results and decision; on_result(result), when given, is called as each result is ready (a
        sweep in this process stores it then: a killed sweep loses at most the candidate it was timing)."""
        op, problem = registry.get(work.op), work.problem
        results = []

        def done(result: st.Result) -> st.Result:
            results.append(result)
            if on_result is not None:
                on_result(result)
            self._report(advance=1)
            return result

        if inputs is None:
            inputs = op.make_inputs(problem, self.device, seed=self.seed)
        dtypes = identity.dtypes(inputs)
        expected = op.reference(**inputs) if work.todo else None
        to_time = []
        for cand in work.todo:
            key = _key(op, problem, cand, dtypes, self.info.key)
            rejected = self._check(op, problem, inputs, expected, cand, key)
            if rejected is None:
                to_time.append((cand, key))
            else:
                done(rejected)
        timings = self._time([self._run(op, problem, inputs, cand) for cand, _ in to_time])
        timed = [(cand, done(result_of(op, problem, cand, key, st.OK, timing=timing)))
                 for (cand, key), timing in zip(to_time, timings)]
        own = [(cand, r) for cand, r in work.stored if r.key.device == self.info.key]
        decision = None if work.decided else self._decide(op, problem, inputs, dtypes, own + timed)
        return ShapeOutcome(results, decision)

    def _run(self, op, problem, inputs, cand: Candidate):
        if cand.impl == "reference":
            return lambda: op.reference(**inputs)
        impl = op.implementation(cand.impl)
        out = op.empty_outputs(problem, inputs)  # written in full by every run
        return lambda: impl.run(problem, inputs, cand.config, out)

    def _check(self, op, problem, inputs, expected, cand: Candidate, key: st.Key) -> st.Result | None:
        """Run once against the reference: the Result to store when it fails or is not to be timed, else None."""
        try:
            op.compare(inputs, expected, self._run(op, problem, inputs, cand)())
        except AssertionError as exc:
            return result_of(op, problem, cand, key, st.INCORRECT, str(exc).strip().splitlines()[0][:500])
        except Exception as exc:
            return result_of(op, problem, cand, key, st.ERROR, f"{type(exc).__name__}: {str(exc)[:300]}")
        if not cand.timed:
            return result_of(op, problem, cand, key, st.CHECKED, "correct; the interpreter is not timed")
        return None

    def _rounds(self, runs) -> list[list[Timing]]:
        """ROUNDS rounds, each timing every run once for budget / ROUNDS seconds, starting one run further along
        each round; per run, its Timing of each round."""
        timings = [[] for _ in runs]
        for start in range(ROUNDS):
            for i in range(len(runs)):
                at = (start + i) % len(runs)
                timings[at].append(measure(runs[at], self.device, budget=self.budget / ROUNDS, threads=self.threads))
        return timings

    def _time(self, runs) -> list[Timing]:
        """A timing pass (see the module docstring): each run's pooled Timing, outliers re-measured."""
        kept: dict[int, tuple[bool, float, Timing]] = {}  # run -> (outlier, relative IQR, timing) of its best pass
        todo = list(range(len(runs)))
        for _ in range(1 + REMEASURES):
            for i, rounds in zip(todo, self._rounds([runs[i] for i in todo])):
                timing = pooled(rounds)
                steadiness = (_outlier(timing, rounds), timing.spread)
                if i not in kept or steadiness < kept[i][:2]:
                    kept[i] = (*steadiness, timing)
            todo = [i for i in todo if kept[i][0]]
            if not todo:
                break
        return [kept[i][2] for i in range(len(runs))]

    def _decide(self, op, problem, inputs, dtypes: str, current: list[tuple[Candidate, st.Result]]) \
            -> st.Decision | None:
        """The leaders of the current results re-timed together, and the verdict (step 5 of the module docstring)."""
        current = sorted(current, key=lambda c: c[1].median)
        if not current:
            return None
        best = current[0][1]
        close = sum(1 for _, r in current if r.median <= LEADER_WINDOW * best.median or not beats(best, r))
        leaders = [cand for cand, _ in current[:min(MAX_LEADERS, max(2, close))]]
        if len(leaders) == 1:
            won, timings, reason = 0, [best], "the only timed candidate"
        else:
            runs = [self._run(op, problem, inputs, cand) for cand in leaders]
            for _ in range(DECIDE_PASSES):
                timings = [pooled(rounds) for rounds in self._rounds(runs)]
                won, reason, separated = verdict(leaders, timings)
                if separated:
                    break
        winner, timing = leaders[won], timings[won]
        return st.Decision(op.name, problem.key, dtypes, self.info.key, identity.op_versions(op),
                           repr(problem.specialization()), tuple(problem.sizes), winner.impl,
                           st.canonical(winner.config), timing.median, reason, iqr=timing.iqr, threads=self.threads)


def result_of(op, problem, cand: Candidate, key: st.Key, status: str, reason: str = "", timing=None,
              report=None) -> st.Result:
    cost = op.cost(problem)
    figures = dict(median=timing.median, low=timing.low, high=timing.high, reps=timing.reps, iqr=timing.iqr,
                   threads=timing.threads) if timing else {}
    return st.Result(
        key=key, spec=repr(problem.specialization()), sizes=tuple(problem.sizes), is_default=cand.is_default,
        bytes=cost.bytes, flops=cost.flops, status=status, reason=reason, **figures,
        registers=report.registers if report else None, spills=report.spills if report else None,
        smem=report.smem if report else None)


@dataclass
class Build:
    """A kernel to build before its shape is measured."""

    problem: Any
    candidate: Candidate
    key: st.Key


class Tuner:
    """A sweep on this machine: plans from the store, builds in worker processes, measures shape by shape in this
    process (Measurer), stores every result and decision as it comes (autotune.ray_sweep runs the same plan over a
    Ray cluster)."""

    def __init__(self, store: st.Store, device: str | None = None, budget: float = 0.2, max_configs: int = 24,
                 workers: int | None = None, seed: int = 0, progress=None, threads: int | None = None,
                 backends=None, info=None):
        """budget: seconds of timing per candidate and pass; threads: torch threads while timing (default
        flashkern.autotune.timing.default_threads: 1 on CPU); backends: implementations to tune (default all;
        the reference always competes); info: the measuring device's identity when it is not this process's (a
        Ray sweep's driver plans for its workers' device)."""
        self.store = store
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.info = info or devices.info(self.device)
        self.budget = budget
        self.max_configs = max_configs
        self.workers = workers or max(1, (os.cpu_count() or 2) - (1 if self.info.kind == "cuda" else 0))
        self.seed = seed
        self.progress = progress  # callable(total=..., advance=..., description=...)
        self.threads = threads or default_threads(self.device)
        self.backends = backends

    def _report(self, **kw):
        if self.progress:
            self.progress(**kw)

    def _candidates(self, op, problem) -> list[Candidate]:
        return candidates(op, problem, self.info, self.max_configs, self.seed, self.backends)

    def _reusable(self, result: st.Result | None) -> bool:
        """A stored result stands unless it was timed at another thread count (or before counts were stored)."""
        return result is not None and (result.status != st.OK or result.threads == self.threads)

    def tune(self, op_name: str, problems) -> Summary:
        op = registry.get(op_name)
        summary = Summary()
        works, builds = self.plan(op, problems, summary, device=self.device)
        self._report(total=len(builds) + sum(len(w.todo) + 1 for w, _ in works), description=f"tuning {op.name}")
        failed = self._build_all(op, builds, summary)
        measurer = Measurer(str(self.device), self.budget, self.threads, self.seed, self.progress)
        def stored(result: st.Result) -> None:
            self.store.put(result)
            summary.measured += 1

        for work, inputs in works:
            outcome = measurer.measure(self.without_failed(op, work, inputs, failed), inputs, on_result=stored)
            self.store_decision(outcome.decision, summary)
            self._report(advance=1)
        return summary

    def plan(self, op, problems, summary: Summary, device="cpu") -> tuple[list[tuple[ShapeWork, dict]], list[Build]]:
        """Per problem, its work (with the inputs made on `device`, which give its dtypes) and the builds it waits
        for; candidates already in the store count as reused."""
        works, builds = [], []
        versions = identity.op_versions(op)
        decided = {(d.shape, d.dtypes, d.versions, d.threads) for d in self.store.decisions(op.name, self.info.key)}
        for problem in problems:
            inputs = op.make_inputs(problem, device, seed=self.seed)
            dtypes = identity.dtypes(inputs)
            todo, stored = [], []
            for cand in self._candidates(op, problem):
                key = _key(op, problem, cand, dtypes, self.info.key)
                found = self.store.get(key)
                if self._reusable(found):
                    summary.reused += 1
                    if found.status == st.OK:
                        stored.append((cand, found))
                else:
                    todo.append(cand)
                    if cand.impl != "reference" and (self.info.kind == "cuda" or cand.impl == "tilelang"):
                        builds.append(Build(problem, cand, key))
            works.append((ShapeWork(op.name, problem, todo, stored,
                                    (problem.key, dtypes, versions, self.threads) in decided), inputs))
        return works, builds

    def without_failed(self, op, work: ShapeWork, inputs: dict, failed: set) -> ShapeWork:
        """The work less the candidates whose build failed or was pruned (stored already)."""
        dtypes = identity.dtypes(inputs)
        todo = [c for c in work.todo if _key(op, work.problem, c, dtypes, self.info.key) not in failed]
        self._report(advance=len(work.todo) - len(todo))
        return dataclasses.replace(work, todo=todo)

    def store_outcome(self, outcome: ShapeOutcome, summary: Summary) -> None:
        """Store a shape's results, then its decision (a Ray sweep's driver, as each shape's task returns)."""
        for result in outcome.results:
            self.store.put(result)
            summary.measured += 1
        self.store_decision(outcome.decision, summary)

    def store_decision(self, decision: st.Decision | None, summary: Summary) -> None:
        if decision is not None:
            self.store.decide(decision)
            summary.decided += 1

    def store_build(self, op, build: Build, status: str, reason: str, report, summary: Summary) -> bool:
        """Record one finished build; a failed or pruned one is stored as its result. True when it passed."""
        summary.built += 1
        self._report(advance=1)
        if status == st.OK:
            return True
        self.store.put(result_of(op, build.problem, build.candidate, build.key, status, reason, report=report))
        summary.measured += 1
        return False

    def _build_all(self, op, builds: list[Build], summary: Summary) -> set:
        """Build in parallel (one worker: in this process, which then holds the kernels); store failures and pruned
        configs; return their keys."""
        failed = set()
        if not builds:
            return failed

        def record(build, status, reason, report):
            if not self.store_build(op, build, status, reason, report, summary):
                failed.add(build.key)

        if min(self.workers, len(builds)) == 1:
            for b in builds:
                record(b, *build(op.name, b.candidate.impl, b.problem, b.candidate.config, self.info))
            return failed
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=min(self.workers, len(builds)), mp_context=context) as pool:
            futures = {pool.submit(build, op.name, b.candidate.impl, b.problem, b.candidate.config, self.info): b
                       for b in builds}
            for future in as_completed(futures):
                record(futures[future], *future.result())
        return failed
