"""The Triton top-k's histogram as it was built until 2026-12-07, its values and mask reshaped to 1-D apart: the
form whose sm_90a build paired one column's mask with another's bin (the first H200 run's wrong rows). Kept to
show that the GPU lint and the pairing emulation fail on it (tests/test_gpu_pairing.py)."""

import triton
import triton.language as tl

from flashkern.kernels.indexer import triton_topk


@triton.jit
def histogram_reshaped_apart(bins, counted, NUM_BINS: tl.constexpr):
    return tl.histogram(tl.reshape(bins, (bins.numel,)), NUM_BINS, mask=tl.reshape(counted, (counted.numel,)))


def install() -> None:
    """The top-k kernels use the old histogram (in a builder process; tests patch their own with monkeypatch)."""
    triton_topk.masked_histogram = histogram_reshaped_apart
