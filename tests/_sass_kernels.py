"""Small Triton kernels built for the SASS counter's tests (tests/test_sass.py): each thread owns one element
(BLOCK = 32 x num_warps), so per-thread instruction counts are the source's own."""

import torch
import triton
import triton.language as tl

from flashkern.kernels._triton import Launch

FMAS = 6  # FMAs per trip of fma_loop
BLOCK = 128
WARPS = 4


@triton.jit
def fma_loop(x_ptr, out_ptr, trips, a, b, FMAS: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.load(x_ptr + offsets)
    for _ in range(trips):
        for _ in tl.static_range(FMAS):
            acc = acc * a + b
    tl.store(out_ptr + offsets, acc)


@triton.jit
def decode_loop(x_ptr, out_ptr, trips, BLOCK: tl.constexpr):
    """An integer record decode: shifts, masks and xors of loaded words, no floating point."""
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.int32)
    for t in range(trips):
        word = tl.load(x_ptr + t * BLOCK * tl.num_programs(0) + offsets)
        acc ^= ((word >> 3) & 0x7) | ((word >> 11) & 0x70) | ((word << 5) & 0x3F00)
    tl.store(out_ptr + offsets, acc)


@triton.jit
def copy(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=mask), mask=mask)


SPILL_REGISTERS = 32  # spill_loop's register bound (.maxnreg): far below its live values


@triton.jit
def spill_loop(x_ptr, out_ptr, trips, BLOCK: tl.constexpr, WIDTH: tl.constexpr):
    """WIDTH values a thread stay live through the loop, each trip rotating them: under a tight register bound the
    loop reloads and stores spills (LDL / STL) every trip."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tile = tl.load(x_ptr + rows[:, None] * WIDTH + tl.arange(0, WIDTH)[None, :])
    for t in range(trips):
        tile = tile * 1.0001 + tl.sum(tile, axis=1)[:, None] * 0.5 + t
    tl.store(out_ptr + rows[:, None] * WIDTH + tl.arange(0, WIDTH)[None, :], tile)


def launches(ctas: int, trips: int) -> dict[str, Launch]:
    n = ctas * BLOCK
    x, out = torch.ones(n), torch.empty(n)
    words, decoded = torch.arange(n * trips, dtype=torch.int32), torch.empty(n, dtype=torch.int32)
    return {
        "fma_loop": Launch(fma_loop, (ctas,), dict(x_ptr=x, out_ptr=out, trips=trips, a=1.0001, b=0.5, FMAS=FMAS,
                                                    BLOCK=BLOCK), num_warps=WARPS),
        "decode_loop": Launch(decode_loop, (ctas,), dict(x_ptr=words, out_ptr=decoded, trips=trips, BLOCK=BLOCK),
                              num_warps=WARPS),
        "copy": Launch(copy, (ctas,), dict(x_ptr=x, out_ptr=out, n=n, BLOCK=BLOCK), num_warps=WARPS),
        "spill_loop": Launch(spill_loop, (ctas,), dict(x_ptr=torch.ones(n * 64), out_ptr=torch.empty(n * 64),
                                                        trips=trips, BLOCK=BLOCK, WIDTH=64), num_warps=WARPS,
                             options={"maxnreg": SPILL_REGISTERS}),
    }
