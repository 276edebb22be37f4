"""Timing one call with well-kept timers at a fixed thread count: the median and its spread.

CPU: `torch.utils.benchmark.Timer(...).blocked_autorange(min_run_time=budget / MIN_BLOCKS)`, then
more blocks up to MIN_BLOCKS. Its block-size estimate calls fn untimed first (the warm-up), then
grows the block tenfold until the timer's own cost is under 0.01% of it or one block outlasts
min_run_time, so a block lasts up to 10x min_run_time; a sample is one block's time per call.
(With min_run_time=budget, blocks of 100 ms answered a 20 ms budget for a 0.1 ms call: five
blocks took 25 times the budget.)
CUDA: `triton.testing.do_bench(fn, rep=budget, return_mode="all")`: untimed warm-up calls, then
every call timed alone with CUDA events, each after a 256 MB write that evicts L2 (a cold cache,
as when a layer's weights stream from HBM); a sample is one call. Not `do_bench_cudagraph`: it
cannot capture a candidate that synchronizes with the host (a reference may) and does not flush
L2 between calls, so candidates would not all be timed alike.

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

from dataclasses import dataclass, field

import torch
from torch.utils.benchmark import Measurement, TaskSpec, Timer, set_torch_threads

MIN_MARGIN = 0.03  # a gap under 3% of the faster median is never trusted, whatever the spread


@dataclass(frozen=True)
class Timing:
    median: float  # seconds per call: the median of the samples
    low: float  # the fastest sample
    high: float  # the slowest sample
    reps: int  # calls timed, all samples together
    iqr: float  # seconds: 75th minus 25th percentile of the samples
    threads: int  # torch intra-op threads while timing
    samples: tuple[float, ...] = field(default=(), repr=False, compare=False)  # seconds per call, one per sample

    @property
    def spread(self) -> float:
        """The IQR relative to the median."""
        return self.iqr / self.median


def default_threads(device) -> int:
    """The thread count to time with on `device` when none is asked for (the module docstring says why)."""
    return 1 if torch.device(device).type == "cpu" else torch.get_num_threads()


def summarize(samples, reps: int, threads: int) -> Timing:
    """The Timing of per-call samples (seconds)."""
    samples = tuple(samples)
    stats = Measurement(number_per_run=1, raw_times=list(samples),
                        task_spec=TaskSpec("fn()", "pass", num_threads=threads))
    return Timing(stats.median, min(samples), max(samples), reps, stats.iqr, threads, samples)


def pooled(timings) -> Timing:
    """One Timing of the samples of several measurements of one call at one thread count."""
    return summarize([s for t in timings for s in t.samples], sum(t.reps for t in timings), timings[0].threads)


MIN_BLOCKS = 5  # CPU samples (blocks of calls) per measurement, however long the first ones took


def measure(fn, device, *, budget: float = 1.0, threads: int | None = None) -> Timing:
    """Time fn() on `device` (a torch.device or str) for about `budget` seconds at `threads` torch threads."""
    device = torch.device(device)
    threads = threads or default_threads(device)
    if device.type == "cuda":
        from triton.testing import do_bench

        with set_torch_threads(threads):
            samples = [ms / 1e3 for ms in do_bench(fn, rep=budget * 1e3, return_mode="all")]
        return summarize(samples, len(samples), threads)
    timer = Timer("fn()", globals={"fn": fn}, num_threads=threads)
    blocks = timer.blocked_autorange(min_run_time=budget / MIN_BLOCKS)
    times = list(blocks.times)
    while len(times) < MIN_BLOCKS:  # a slow spell can fill the budget with one block: no spread to see
        times += timer.timeit(blocks.number_per_run).times
    return summarize(times, blocks.number_per_run * len(times), threads)


def beats(fast, slow) -> bool:
    """Whether `fast` is faster than `slow` beyond their measured spread (Timings or stored results): the
    gap between the medians exceeds half of each IQR (the boxes median ± IQR/2 do not overlap) plus
    MIN_MARGIN of the faster median."""
    return slow.median - fast.median > (fast.iqr + slow.iqr) / 2 + MIN_MARGIN * fast.median
