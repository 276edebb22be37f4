"""Timing one call with well-kept timers at a fixed thread count: the median and its spread.

CPU: `torch.utils.benchmark.Timer(...).blocked_autorange(min_run_time=budget / MIN_BLOCKS)`, then
more blocks up to MIN_BLOCKS. Its block-size estimate calls fn untimed first (the warm-up), then
grows the block tenfold until the timer's own cost is under 0.01% of it or one block outlasts
min_run_time, so a block lasts up to 10x min_run_time; a sample is one block's time per call.
(With min_run_time=budget, blocks of 100 ms answered a 20 ms budget for a 0.1 ms call: five
blocks took 25 times the budget.)
CUDA (kernels, graph=True): device time, as a serving engine's CUDA graphs run it. Host work per call
(argument checks, the plan lookup, Triton's or TileLang's launcher: 30 to 80 us on the first H200 run) would
otherwise be the figure: timed call by call with events (`triton.testing.do_bench`), every kernel of 10 to
35 us measured 40 to 300 us. fn is captured CALLS times into a graph, each call behind a write of twice the
L2 size (a cold cache, as when a layer's inputs stream from HBM), and the write alone into a second graph;
a sample is (replay of the first - replay of the second) / CALLS, the two replayed alternately. A call that
cannot be captured (it synchronizes with the host: some references) cannot run inside a graph either, so it
is timed as it runs, eagerly: `do_bench(fn, return_mode="all")`, every call timed alone with events after
the same L2-evicting write, host time included (as with graph=False); its Timing says graphed=False.
METHOD names the method in the versions of every stored result (flashkern.autotune.identity): results
timed another way are stale, not compared with these.

Threads: torch's intra-op thread count is set to `threads` while timing and restored after.
The CPU default is 1: TileLang's C target runs on one thread, so one thread compares like with
like, and it is the count that holds on a shared machine. Measured on the 2-core dev VM (median
per call of the reference; other jobs running, then also one busy process per core):
    moe_route T=1 E=384         1 thread 0.10 / 0.24 ms    2 threads   7.6 /  16 ms
    moe_route T=256 E=384       1 thread  7.1 /   14 ms    2 threads   108 / 217 ms
    mqa_logits rows=5 keys=300  1 thread 0.54 / 0.71 ms    2 threads    48 /  92 ms
(at 2 threads a call seems to wait for its descheduled second worker, a scheduler time slice at a
time). On CUDA the default is torch's count (the host only launches).

The figures (all from torch's Measurement of the samples): the median, the one to quote; the IQR
(75th minus 25th percentile), the spread; the fastest and slowest samples; the calls timed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch.utils.benchmark import Measurement, TaskSpec, Timer, set_torch_threads

MIN_MARGIN = 0.03  # a gap under 3% of the faster median is never trusted, whatever the spread
METHOD = "cpu-timer+cuda-graph-l2-cold"  # how measure() times (module docstring); part of every result's versions
GRAPH_SECONDS = 1e-3  # device time a captured graph of calls aims at (enough calls to amortize a replay's launch)
MAX_GRAPH_CALLS = 100
MIN_SAMPLES = 5


@dataclass(frozen=True)
class Timing:
    median: float  # seconds per call: the median of the samples
    low: float  # the fastest sample
    high: float  # the slowest sample
    reps: int  # calls timed, all samples together
    iqr: float  # seconds: 75th minus 25th percentile of the samples
    threads: int  # torch intra-op threads while timing
    samples: tuple[float, ...] = field(default=(), repr=False, compare=False)  # seconds per call, one per sample
    graphed: bool = field(default=False, compare=False)  # CUDA: device time from graphs (else eager, host included)

    @property
    def spread(self) -> float:
        """The IQR relative to the median."""
        return self.iqr / self.median


def default_threads(device) -> int:
    """The thread count to time with on `device` when none is asked for (the module docstring says why)."""
    return 1 if torch.device(device).type == "cpu" else torch.get_num_threads()


def summarize(samples, reps: int, threads: int, graphed: bool = False) -> Timing:
    """The Timing of per-call samples (seconds)."""
    samples = tuple(samples)
    stats = Measurement(number_per_run=1, raw_times=list(samples),
                        task_spec=TaskSpec("fn()", "pass", num_threads=threads))
    return Timing(stats.median, min(samples), max(samples), reps, stats.iqr, threads, samples, graphed)


def pooled(timings) -> Timing:
    """One Timing of the samples of several measurements of one call at one thread count."""
    return summarize([s for t in timings for s in t.samples], sum(t.reps for t in timings), timings[0].threads,
                     all(t.graphed for t in timings))


MIN_BLOCKS = 5  # CPU samples (blocks of calls) per measurement, however long the first ones took


def measure(fn, device, *, budget: float = 1.0, threads: int | None = None, graph: bool = True) -> Timing:
    """Time fn() on `device` (a torch.device or str) for about `budget` seconds at `threads` torch threads; on
    CUDA from CUDA graphs (device time) where fn can be captured and graph=True, else eagerly (host time
    included)."""
    device = torch.device(device)
    threads = threads or default_threads(device)
    if device.type == "cuda":
        with set_torch_threads(threads):
            if graph:
                try:
                    return summarize(*_graph_samples(fn, budget), threads, graphed=True)
                except RuntimeError:  # not capturable (a host read): time it as it runs
                    torch.cuda.synchronize()
            from triton.testing import do_bench

            samples = [ms / 1e3 for ms in do_bench(fn, rep=budget * 1e3, return_mode="all")]
        return summarize(samples, len(samples), threads)
    timer = Timer("fn()", globals={"fn": fn}, num_threads=threads)
    blocks = timer.blocked_autorange(min_run_time=budget / MIN_BLOCKS)
    times = list(blocks.times)
    while len(times) < MIN_BLOCKS:  # a slow spell can fill the budget with one block: no spread to see
        times += timer.timeit(blocks.number_per_run).times
    return summarize(times, blocks.number_per_run * len(times), threads)


def _graph_samples(fn, budget: float) -> tuple[list[float], int]:
    """Per-call device seconds of fn from CUDA graphs (module docstring), and the calls timed."""
    flush = torch.empty(2 * torch.cuda.get_device_properties().L2_cache_size // 4, dtype=torch.int32, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside capture: compiles, caches the plan (torch's advice)
        fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(3):
            flush.zero_()
            fn()
        end.record()
        end.synchronize()
    torch.cuda.current_stream().wait_stream(side)
    calls = max(1, min(MAX_GRAPH_CALLS, int(GRAPH_SECONDS / (start.elapsed_time(end) / 3e3))))

    def captured(body) -> torch.cuda.CUDAGraph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(calls):
                body()
        return g

    def flushed_call():
        flush.zero_()
        fn()

    with_calls, flushes = captured(flushed_call), captured(flush.zero_)
    events = []
    deadline = time.perf_counter() + budget
    while len(events) < MIN_SAMPLES or time.perf_counter() < deadline:
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        for g, (a, b) in ((with_calls, marks[:2]), (flushes, marks[2:])):
            a.record()
            g.replay()
            b.record()
        marks[-1].synchronize()
        events.append(marks)
    samples = [(m[0].elapsed_time(m[1]) - m[2].elapsed_time(m[3])) / 1e3 / calls for m in events]
    return samples, calls * len(samples)


def beats(fast, slow) -> bool:
    """Whether `fast` is faster than `slow` beyond their measured spread (Timings or stored results): the
    gap between the medians exceeds half of each IQR (the boxes median ± IQR/2 do not overlap) plus
    MIN_MARGIN of the faster median."""
    return slow.median - fast.median > (fast.iqr + slow.iqr) / 2 + MIN_MARGIN * fast.median
