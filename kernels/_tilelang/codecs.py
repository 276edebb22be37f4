"""Bit codecs between narrow floats and fp32, written as TileLang (TIR) expressions.

The C target has no bf16 / float8 / float4 tensors, so narrow floats travel as integer views
(uint16 / uint8) and are converted here with integer bit math plus plain fp32 adds. The same
expressions lower for CUDA. Each function returns one expression, for use inside @T.prim_func
bodies, e.g. ``Y[i] = codecs.bf16_to_f32(X[i])``. Encoders take a float32 expression.

Formats (sign | exponent | mantissa, bias):

    bf16    1 | 8 | 7   bias 127   the top half of an fp32; inf and NaN as in fp32
    e4m3fn  1 | 4 | 3   bias 7     subnormals m * 2^-9; no inf; S.1111.111 (0x7F / 0xFF) is NaN;
                                   max finite 448 (0x7E)
    e2m1    1 | 2 | 1   bias 1     4-bit code in the low nibble; magnitudes
                                   0, 0.5, 1, 1.5, 2, 3, 4, 6 (codes 0..7); bit 3 is the sign;
                                   no inf, no NaN
    ue8m0   0 | 8 | 0   bias 127   a power-of-two scale byte 2^(e - 127); 0xFF is NaN (OCP MX)

Encoding rounds to nearest, ties to even, and keeps the sign of zero:

    bf16    overflow rounds to inf (as IEEE); NaN stays NaN (sign kept, quiet bit set)
    e4m3fn  saturating: |x| > 448 and inf give +-448; NaN gives 0x7F | sign
            (the behaviour of torch's CPU ``x.to(torch.float8_e4m3fn)``)
    e2m1    saturating: |x| > 6 and inf give +-6; NaN also gives 6 with the NaN's sign bit
            (ml_dtypes' float4_e2m1fn on finite values and inf)

Normal results round in the integer domain (add half an ulp minus one plus the lowest kept
bit, then shift). Subnormal results use an fp32 add of a "magic" power of two whose ulp is
the target's subnormal spacing: the fp32 adder performs the round to nearest even (an fp32
denormal input flushed to zero under CUDA fast math still gets its correct code, 0).
"""

import functools  # no `from __future__ import annotations`: T.prim_func evaluates the annotations

from flashkern.kernels._tilelang import T  # tilelang.language, loaded on first use (set before codecs is imported)

_ABS = 0x7FFFFFFF
_F32_INF = 0x7F800000


def _u32(x):
    """fp32 expression -> its bits as uint32."""
    return T.reinterpret(x, "uint32")


def _f32(u):
    """uint32 bits -> fp32."""
    return T.reinterpret(u, "float32")


# ---------------------------------------------------------------------------- bf16

def bf16_to_f32(bits):
    """bf16 bits (uint16) -> fp32, exact for every code."""
    return _f32(T.shift_left(T.Cast("uint32", bits), T.uint32(16)))


def f32_to_bf16(x):
    """fp32 -> bf16 bits (uint16): round to nearest even, overflow to inf, NaN to a quiet NaN."""
    u = _u32(x)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    nan = (u >> 16) | 0x40
    is_nan = (u & _ABS) > T.uint32(_F32_INF)
    return T.Cast("uint16", T.if_then_else(is_nan, nan, rounded))


# ---------------------------------------------------------------------------- shared encoder

def _encode_magnitude(a, man: int, bias: int):
    """Code (exponent | mantissa) of the finite magnitude with fp32 bits `a`, RNE.

    The format has `man` mantissa bits and exponent bias `bias`; `a` must already be clamped
    to the largest finite value of the format.
    """
    shift = 23 - man
    normal = ((a + ((1 << (shift - 1)) - 1) + ((a >> shift) & 1)) >> shift) - ((127 - bias) << man)
    # 2^(1 - bias - man) is the subnormal spacing; the fp32 whose ulp equals it is 2^(24 - bias - man)
    magic = (151 - bias - man) << 23
    subnormal = _u32(_f32(a) + _f32(T.uint32(magic))) - magic
    return T.if_then_else(a < T.uint32((128 - bias) << 23), subnormal, normal)


# ---------------------------------------------------------------------------- float8 e4m3fn

_E4M3_MAX = 0x43E00000  # 448.0
_E4M3_REBIAS = 2.0**120  # 2^(127 - 7): fp32's exponent bias over e4m3's


def e4m3_to_f32(bits):
    """float8_e4m3fn code (uint8) -> fp32, exact; 0x7F / 0xFF decode to NaN. Branch-free: the code's exponent and
    mantissa placed 20 bits up in an fp32 (2^(e - 127) x 1.m, or for e = 0 the fp32 subnormal 0.m x 2^-126), times
    2^120 (a subnormal e4m3 passes through the fp32 subnormals, which the multiply keeps: no flush to zero on
    either target)."""
    b = T.Cast("uint32", bits)
    placed = _f32(((b & 0x7F) << 20) | ((b & 0x80) << 24)) * T.float32(_E4M3_REBIAS)
    return T.if_then_else((b & 0x7F) == 0x7F, _f32(T.uint32(0x7FC00000) | ((b & 0x80) << 24)), placed)


def f32_to_e4m3(x):
    """fp32 -> float8_e4m3fn code (uint8): RNE, saturating to +-448, NaN -> 0x7F | sign."""
    u = _u32(x)
    a = u & _ABS
    code = T.if_then_else(
        a > T.uint32(_F32_INF), T.uint32(0x7F), _encode_magnitude(T.min(a, T.uint32(_E4M3_MAX)), 3, 7)
    )
    return T.Cast("uint8", code | ((u >> 24) & 0x80))


# ---------------------------------------------------------------------------- fp4 e2m1

_E2M1_MAX = 0x40C00000  # 6.0
_E2M1_REBIAS = 2.0**126  # 2^(127 - 1)


def e2m1_to_f32(code):
    """FP4 e2m1 code (any integer expression, code in the low 4 bits) -> fp32, exact. Branch-free: the code's
    exponent and mantissa placed 22 bits up in an fp32, times 2^126 (the magnitudes 0 and 0.5 pass through the fp32
    subnormals 0 and 2^-127, which the multiply keeps)."""
    c = T.Cast("uint32", code)
    return _f32(((c & 7) << 22) | ((c & 8) << 28)) * T.float32(_E2M1_REBIAS)


E2M1_REBIAS_BF16X2 = 0x7E807E80  # bf16 2^126 in both halves: what e2m1_pair_bf16x2 is multiplied by


def e2m1_pair_bf16x2(byte):
    """A byte of two FP4 e2m1 codes (low nibble first) -> the bits of a bf16x2 holding each code's value x 2^-126
    (times E2M1_REBIAS_BF16X2, exact: the same placement as e2m1_to_f32, in bf16, whose exponent bias is fp32's).
    byte x (2^6 + 2^18) puts the low code's magnitude at bits 6..8 and the high one's at 22..24; six bits further
    up sit the signs (bits 15 and 31): one multiply, one shift and two logic ops a pair."""
    spread = T.Cast("uint32", byte) * T.uint32(0x00040040)
    return (spread & T.uint32(0x01C001C0)) | (T.shift_left(spread, T.uint32(6)) & T.uint32(0x80008000))


E4M3_REBIAS_BF16X2 = 0x7B807B80  # bf16 2^120 in both halves: what e4m3_pair_bf16x2 is multiplied by


def e4m3_pair_bf16x2(low, high):
    """Two float8_e4m3fn codes -> the bits of a bf16x2 holding each code's value x 2^-120 (times
    E4M3_REBIAS_BF16X2, exact: the placement of e4m3_to_f32, in bf16). With the codes at bits 0 and 16, one shift
    by 4 places both magnitudes (bits 4..10, 20..26) and one by 8 both signs (bits 15, 31); a NaN code (magnitude
    0x7F, placed 0x7F0) is the one whose placed magnitude carries into bit 11 when one mantissa step is added, and
    that bit times 15 fills the rest of the exponent: a bf16 NaN. No branch or select."""
    spread = T.Cast("uint32", low) | T.shift_left(T.Cast("uint32", high), T.uint32(16))
    magnitude = T.shift_left(spread, T.uint32(4)) & T.uint32(0x07F007F0)
    nan = ((magnitude + T.uint32(0x00100010)) & T.uint32(0x08000800)) * T.uint32(15)
    return magnitude | (T.shift_left(spread, T.uint32(8)) & T.uint32(0x80008000)) | nan


def bf16x2_of_f32(x):
    """An fp32 that bf16 holds exactly (a scale) -> the bits of a bf16x2 holding it in both halves."""
    return (_u32(x) >> 16) * T.uint32(0x00010001)


def f32_to_e2m1(x):
    """fp32 -> FP4 e2m1 code 0..15 (uint8): RNE, saturating to +-6.

    NaN has no e2m1 code: it encodes as 6 with the NaN's sign bit (0x7 or 0xF), which falls
    out of clamping the magnitude bits, as NaN bits exceed those of inf.
    """
    u = _u32(x)
    code = _encode_magnitude(T.min(u & _ABS, T.uint32(_E2M1_MAX)), 1, 1)
    return T.Cast("uint8", code | ((u >> 28) & 8))


# ---------------------------------------------------------------------------- ue8m0 (OCP MX scale byte)

_UE8M0_NAN = 0xFF
_UE8M0_MAX_FINITE = 0xFE  # 2^127


def ue8m0_to_f32(exponent):
    """ue8m0 scale byte e (any integer expression) -> fp32 2^(e - 127), exact (e = 0: the subnormal 2^-127;
    e = 0xFF: NaN)."""
    e = T.Cast("uint32", exponent)
    bits = T.if_then_else(e == 0, T.uint32(0x00400000), T.shift_left(e, T.uint32(23)))
    return _f32(T.if_then_else(e == _UE8M0_NAN, T.uint32(0x7FC00000), bits))


def f32_to_ue8m0_ceil(x):
    """fp32 x >= 0 -> the ue8m0 byte of 2^ceil(log2(x)) as uint32: x's exponent field, plus one if its mantissa is
    nonzero (DeepGEMM's ceil_to_ue8m0), at most 0xFE (inf gives 0xFE; x = 0 gives 0)."""
    u = _u32(x)
    ceil = ((u >> 23) & 0xFF) + T.Cast("uint32", (u & 0x7FFFFF) != 0)
    return T.min(ceil, T.uint32(_UE8M0_MAX_FINITE))


# ---------------------------------------------------------------------------- test / debug kernels

_STORAGE = {"bf16": "uint16", "e4m3": "uint8", "e2m1": "uint8"}
_DECODE = {"bf16": bf16_to_f32, "e4m3": e4m3_to_f32, "e2m1": e2m1_to_f32}
_ENCODE = {"bf16": f32_to_bf16, "e4m3": f32_to_e4m3, "e2m1": f32_to_e2m1}


def codec_prim_func(fmt: str, direction: str, parallel=None, block: int = 256):
    """Elementwise 1-D codec kernel over N (dynamic) elements, before compilation.

    decode: codes (uint16 for bf16, uint8 for e4m3 / e2m1, one code per byte) -> float32;
    encode: float32 -> codes. `parallel` is the loop form (T.serial, the default, for C; T.Parallel for CUDA).
    """
    parallel = parallel or T.serial
    if direction == "decode":
        fn, src, dst = _DECODE[fmt], _STORAGE[fmt], "float32"
    elif direction == "encode":
        fn, src, dst = _ENCODE[fmt], "float32", _STORAGE[fmt]
    else:
        raise ValueError(f"direction must be 'decode' or 'encode', not {direction!r}")
    N = T.dynamic("N")

    @T.prim_func
    def codec(X: T.Tensor((N,), src), Y: T.Tensor((N,), dst)):
        with T.Kernel(T.ceildiv(N, block), threads=128) as bx:
            for i in parallel(block):
                if bx * block + i < N:
                    Y[bx * block + i] = fn(X[bx * block + i])

    return codec


@functools.cache
def codec_kernel(fmt: str, direction: str):
    """Compiled CPU codec kernel: call as kernel(x, y) with 1-D torch CPU tensors (see codec_prim_func)."""
    from flashkern.kernels._tilelang import compile_cpu  # that package imports this module

    return compile_cpu(codec_prim_func(fmt, direction))
