"""Bit codecs between narrow floats and fp32 as @triton.jit helpers (reference/formats.py is the contract).

Formats (sign | exponent | mantissa, bias):

    bf16    1 | 8 | 7   bias 127   the top half of an fp32
    e4m3fn  1 | 4 | 3   bias 7     subnormals m * 2^-9; no inf; S.1111.111 (0x7F / 0xFF) is NaN; max finite 448
    e2m1    1 | 2 | 1   bias 1     a 4-bit code (bit 3 the sign); magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6; no inf/NaN
    ue8m0   8-bit exponent e       2^(e - 127) (e = 0: the fp32 subnormal 2^-127); 0xFF is NaN

Everything is integer bit math on int32 views of fp32 (plus exact int -> fp32 conversions and exact power-of-two
multiplies, which keep subnormals in numpy and in the GPU's mul.f32: Triton emits no .ftz), so the interpreter
and sm_90a give the same bits: `.to(tl.float8e4nv)` would round and saturate differently on each, and fp32
adds of subnormals would depend on flush-to-zero. Codes are returned as int32 (callers narrow them to uint8);
decoders accept any integer type holding the code in its low bits.

Encoders round to nearest, ties to the even code, saturate (|x| beyond the largest finite value and +-inf give it
with x's sign) and keep the sign of zero; NaN gives e4m3 0x7F | sign and e2m1 code 7 | sign (6 with the NaN's
sign), as torch's and ml_dtypes' converters.
"""

from __future__ import annotations

import triton
import triton.language as tl

F32_ABS = tl.constexpr(0x7FFFFFFF)
F32_INF = tl.constexpr(0x7F800000)  # bits of +inf; a magnitude above it is NaN
F32_NAN = tl.constexpr(0x7FC00000)
E4M3_MAX_BITS = tl.constexpr(0x43E00000)  # bits of 448.0
E2M1_MAX_BITS = tl.constexpr(0x40C00000)  # bits of 6.0
UE8M0_NAN = tl.constexpr(0xFF)
UE8M0_MAX = tl.constexpr(254)  # the largest finite ue8m0 byte (2^127)
E4M3_REBIAS = tl.constexpr(2.0**120)  # 2^(127 - 7): fp32's exponent bias over e4m3's
E2M1_REBIAS = tl.constexpr(2.0**126)  # 2^(127 - 1)


@triton.jit
def bf16_to_f32(x):
    """bf16 -> fp32, exact for every value: the bits shifted into place (the interpreter's cast flushes bf16
    subnormals to zero)."""
    return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _round_magnitude(a, MANTISSA: tl.constexpr, BIAS: tl.constexpr):
    """The (exponent | mantissa) code of the fp32 magnitude with bits `a` (int32, finite, at most the format's
    largest value) in a format of MANTISSA mantissa bits and exponent bias BIAS, rounded to nearest even.

    Normal results (a >= 2^(1 - BIAS)) round in place: add half an ulp minus one plus the lowest kept bit, shift,
    rebias. Subnormal results count units of 2^(1 - BIAS - MANTISSA): the fp32 significand (implicit bit included)
    shifted right by `drop` bits, rounded on the dropped bits; drop >= 25 leaves 0 for any significand (< 2^24),
    so it is capped at 31 (and kept >= 1 where the normal result is taken: every shift stays defined). A
    subnormal that rounds up to 2^MANTISSA units is the smallest normal's code.
    """
    SHIFT: tl.constexpr = 23 - MANTISSA
    normal = ((a + ((1 << (SHIFT - 1)) - 1) + ((a >> SHIFT) & 1)) >> SHIFT) - ((127 - BIAS) << MANTISSA)
    exponent = a >> 23
    significand = (a & 0x7FFFFF) | tl.where(exponent > 0, 0x800000, 0)
    drop = tl.minimum(tl.maximum(151 - BIAS - MANTISSA - tl.maximum(exponent, 1), 1), 31)
    units = significand >> drop
    rest = significand & ((1 << drop) - 1)
    half = 1 << (drop - 1)
    subnormal = units + ((rest > half) | ((rest == half) & ((units & 1) == 1))).to(tl.int32)
    return tl.where(exponent < 128 - BIAS, subnormal, normal)


@triton.jit
def e4m3_encode(x):
    """fp32 -> e4m3fn code (int32, 0..255): RNE, saturating at +-448; NaN -> 0x7F | sign."""
    bits = x.to(tl.int32, bitcast=True)
    magnitude = bits & F32_ABS
    code = _round_magnitude(tl.minimum(magnitude, E4M3_MAX_BITS), 3, 7)
    code = tl.where(magnitude > F32_INF, 0x7F, code)
    return code | ((bits >> 24) & 0x80)


@triton.jit
def e2m1_encode(x):
    """fp32 -> e2m1 code (int32, 0..15): RNE, saturating at +-6 (NaN too: its bits exceed those of inf)."""
    bits = x.to(tl.int32, bitcast=True)
    code = _round_magnitude(tl.minimum(bits & F32_ABS, E2M1_MAX_BITS), 1, 1)
    return code | ((bits >> 28) & 8)


@triton.jit
def e4m3_decode(code):
    """e4m3fn code -> fp32 (exact); 0x7F / 0xFF decode to NaN. The code's exponent and mantissa placed 20 bits up in
    an fp32 (2^(e - 127) x 1.m, or for e = 0 the fp32 subnormal 0.m x 2^-126), times 2^120: the e4m3 value, normal
    or subnormal (no flush to zero: the GPU's mul.f32 keeps subnormals, as numpy does)."""
    c = code.to(tl.int32)
    sign = (c & 0x80) << 24
    value = (sign | ((c & 0x7F) << 20)).to(tl.float32, bitcast=True) * E4M3_REBIAS
    return tl.where((c & 0x7F) == 0x7F, (sign | F32_NAN).to(tl.float32, bitcast=True), value)


@triton.jit
def e2m1_decode(code):
    """e2m1 code (low 4 bits) -> fp32 (exact): the code's exponent and mantissa placed 22 bits up in an fp32, times
    2^126 (the magnitudes 0 and 0.5 pass through the fp32 subnormals 0 and 2^-127, which the multiply keeps)."""
    c = code.to(tl.int32)
    return (((c & 8) << 28) | ((c & 7) << 22)).to(tl.float32, bitcast=True) * E2M1_REBIAS


@triton.jit
def ue8m0_decode(e):
    """ue8m0 byte e -> fp32 2^(e - 127) (e = 0: the subnormal 2^-127); 0xFF -> NaN."""
    e = e.to(tl.int32)
    value = tl.where(e == 0, 0x00400000, e << 23)
    return tl.where(e == UE8M0_NAN, F32_NAN, value).to(tl.float32, bitcast=True)


@triton.jit
def ue8m0_ceil(x):
    """The ue8m0 byte (int32) of 2^ceil(log2(x)) for fp32 x >= 0: x's exponent field, plus one if its mantissa is
    nonzero, at most 254 (inf gives 254)."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.minimum(((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32), UE8M0_MAX)


@triton.jit
def ue8m0_reciprocal(e):
    """fp32 2^(127 - e): the exact reciprocal of the scale of a ue8m0 byte e in [1, 254] (the byte 254 - e; for
    e = 254 the subnormal 2^-127)."""
    return ue8m0_decode(254 - e.to(tl.int32))
