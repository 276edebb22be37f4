"""Timing one call: CUDA events with a cold L2 on GPUs, wall-clock medians on CPUs.

The first call is a warm-up (it may compile); the second, timed, sizes the repetitions to fit a
time budget, between min_reps and max_reps. The median is the figure to quote; min and max
show the spread.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Timing:
    median: float  # seconds
    low: float
    high: float
    reps: int


_L2_FLUSH: dict[torch.device, torch.Tensor] = {}


def _flush_l2(device: torch.device) -> None:
    """Overwrite a buffer larger than any L2 (H200: 60 MiB), so every timed call starts cold."""
    if device not in _L2_FLUSH:
        _L2_FLUSH[device] = torch.empty(256 * 2**20, dtype=torch.uint8, device=device)
    _L2_FLUSH[device].zero_()


def measure(fn, device, *, budget: float = 1.0, min_reps: int = 1, max_reps: int = 100) -> Timing:
    """Time fn() on `device` (a torch.device or str)."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    fn()  # warm-up: compilation, caches
    if cuda:
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize(device)
    probe = max(time.perf_counter() - start, 1e-7)
    times = [] if cuda else [probe]  # on CUDA the probe ran with a warm L2: not a sample
    reps = int(min(max_reps, max(min_reps, budget / probe)))
    for _ in range(reps - len(times)):
        if cuda:
            _flush_l2(device)
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            fn()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return Timing(statistics.median(times), min(times), max(times), reps)
