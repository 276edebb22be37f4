"""Triton and TileLang implementations, one folder per operator family.

kernels/<family>/__init__.py holds the family's operator records (entry points, input maker,
comparison, cost model, presets); triton_kernels.py and tilelang_kernels.py hold one source per
DSL with its tuning space. kernels/_triton and kernels/_tilelang hold what the DSLs share.
"""


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n, for n >= 1: tile sizes chosen on the host (triton.next_power_of_2 is a
    constexpr function costing microseconds a call, too slow for tuning-space rules tried 10^5 times)."""
    return 1 << (n - 1).bit_length()
