"""Host-side tile arithmetic shared by the kernels' layouts, tuning rules and default configs."""

SMS = 132  # H100 / H200 SXM: the GPU default configs size their grids for this many SMs


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n, 0 for 0 (as triton.next_power_of_2, a constexpr function costing
    microseconds a host call: too slow for tuning-space rules tried 10^5 times and for launch plans made per call)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for a >= 0, b > 0 (as triton.cdiv, also a constexpr function on the host)."""
    return (a + b - 1) // b


def split_plan(hidden: int, split_k: int, block_d: int) -> tuple[int, int]:
    """(splits, chunk): a GEMM's K splits over D, each `chunk` columns (a multiple of block_d); split s covers d in
    [s * chunk, min(D, (s + 1) * chunk)). At most split_k splits, none empty."""
    tiles = -(-hidden // block_d)
    chunk = -(-tiles // max(1, min(split_k, tiles))) * block_d
    return -(-hidden // chunk), chunk
