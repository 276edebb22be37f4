"""Narrow float formats shared by the storage formats of every family (docs/operators.md sections 2.1 and 8).

    e2m1    FP4: 1 | 2 | 1, bias 1; magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 (codes 0..7), bit 3 the sign; no inf/NaN
    e4m3fn  FP8: 1 | 4 | 3, bias 7; max finite 448; 0x7F / 0xFF are NaN; no inf (torch.float8_e4m3fn)
    ue8m0   a power-of-two scale byte e: 2^(e - 127); 0xFF is NaN (OCP MX)

Encoders round to nearest, ties to even, and saturate (|x| beyond the largest finite value, inf included,
gives the largest finite value with x's sign).
"""

from __future__ import annotations

import torch

E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitudes of e2m1 codes 0..7; bit 3 is the sign
E2M1_MAX = 6.0
E4M3_MAX = 448.0
E4M3_NAN = 0x7F  # the e4m3fn code torch gives NaN (sign clear)
UE8M0_BIAS = 127
UE8M0_NAN = 0xFF  # the ue8m0 byte that encodes NaN (OCP MX)
FP4_ROUNDING = ("even", "down")


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """fp32 value of each e2m1 code (0..15)."""
    grid = torch.tensor(E2M1_GRID, device=codes.device)
    value = grid[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -value, value)


def e2m1_encode(x: torch.Tensor, rounding: str = "even") -> torch.Tensor:
    """fp32 -> e2m1 codes (uint8, 0..15), saturating at 6 (inf too; NaN gives 6 with its sign bit).

    rounding="even": round to nearest, a midpoint to the even code (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2,
    2.5 -> 2, 3.5 -> 4, 5 -> 4), the sign kept (a negative value that rounds to 0 gives -0, code 8), as hardware
    converters; rounding="down": a midpoint goes to the lower magnitude and -0 never appears (DeepGEMM's torch
    encoder).
    """
    if rounding not in FP4_ROUNDING:
        raise ValueError(f"rounding must be one of {FP4_ROUNDING}, got {rounding!r}")
    grid = torch.tensor(E2M1_GRID, device=x.device)
    midpoints = (grid[1:] + grid[:-1]) / 2
    magnitude = x.abs().clamp(max=E2M1_MAX)  # NaN stays NaN and sorts past every midpoint: code 7
    code = torch.searchsorted(midpoints, magnitude.contiguous())  # a midpoint itself goes to the lower code
    if rounding == "even":
        tie = (code < len(midpoints)) & (magnitude == midpoints[code.clamp(max=len(midpoints) - 1)])
        code = code + (tie & (code % 2 == 1)).long()  # ... unless that code is odd
    negative = torch.signbit(x) if rounding == "even" else (x < 0) & (code > 0)
    return (code | torch.where(negative, 8, 0)).to(torch.uint8)


def e4m3_encode(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> e4m3fn codes as uint8: round to nearest even, saturating at +-448 (inf too); NaN -> 0x7F | sign."""
    codes = x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.where(torch.isnan(x), E4M3_NAN | torch.where(torch.signbit(x), 0x80, 0), codes).to(torch.uint8)


def e4m3_decode(codes: torch.Tensor) -> torch.Tensor:
    """fp32 value of each e4m3fn code (uint8)."""
    return codes.view(torch.float8_e4m3fn).float()


def ue8m0_decode(scale: torch.Tensor) -> torch.Tensor:
    """fp32 value 2^(e - 127) of each ue8m0 byte e (0 is 2^-127; 0xFF is NaN), built from its bits: exact on every
    device (CUDA's exp2 need not be exact for subnormal results)."""
    e = scale.to(torch.int32)
    value = torch.where(e == 0, 1 << 22, e << 23).view(torch.float32)
    return torch.where(e == UE8M0_NAN, torch.nan, value)


def mxfp8_decode(codes: torch.Tensor, scale_bytes: torch.Tensor, group: int = 32) -> torch.Tensor:
    """fp32 values of MXFP8 blocks: e4m3 codes [..., n] times 2^(e - 127) of their block's ue8m0 byte [..., n / group]
    (exact; a 0xFF scale makes its block NaN)."""
    values = e4m3_decode(codes.contiguous()).unflatten(-1, (-1, group))
    return (values * ue8m0_decode(scale_bytes)[..., None]).flatten(-2)


def ue8m0_ceil(x: torch.Tensor) -> torch.Tensor:
    """The ue8m0 byte of 2^ceil(log2(x)) for fp32 x >= 0, from x's bits: its exponent field, plus one if the mantissa
    is nonzero (DeepGEMM's ceil_to_ue8m0), at most 254 (inf gives 254); as int32."""
    bits = x.float().contiguous().view(torch.int32)
    return (((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).int()).clamp(max=254)
