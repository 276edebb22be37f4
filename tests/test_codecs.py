"""Bit codecs (flashkern.kernels._tilelang.codecs) against independent oracles.

bf16 and float8_e4m3fn are checked against torch's CPU conversions, FP4 e2m1 against
ml_dtypes. Each codec runs inside a compiled TileLang C kernel (`codec_kernel`); decoding is
checked on every code, encoding on every grid value, every midpoint, +-1 fp32 ulp around
them, special values and random fp32 bit patterns.
"""

import math
from dataclasses import dataclass

import ml_dtypes
import numpy as np
import pytest
import tilelang.language as T
import torch
from hypothesis import given
from hypothesis import strategies as st

from flashkern.kernels._tilelang import codecs

N_RANDOM = 1 << 21  # random fp32 bit patterns per format


@dataclass(frozen=True)
class Format:
    name: str
    storage: torch.dtype
    n_codes: int
    sign_bit: int
    saturating: bool

    def decode_ref(self, codes: torch.Tensor) -> torch.Tensor:
        """The oracle's fp32 value of each code."""
        if self.name == "bf16":
            return codes.view(torch.bfloat16).float()
        if self.name == "e4m3":
            return codes.view(torch.float8_e4m3fn).float()
        return torch.from_numpy(codes.numpy().view(ml_dtypes.float4_e2m1fn).astype(np.float32))

    def encode_ref(self, x: torch.Tensor) -> torch.Tensor:
        """The oracle's code of each fp32 value."""
        if self.name == "bf16":
            return x.to(torch.bfloat16).view(torch.uint16)
        if self.name == "e4m3":
            return x.to(torch.float8_e4m3fn).view(torch.uint8)
        with np.errstate(invalid="ignore"):
            return torch.from_numpy(x.numpy().astype(ml_dtypes.float4_e2m1fn).view(np.uint8))

    def all_codes(self) -> torch.Tensor:
        codes = torch.arange(self.n_codes, dtype=torch.int32)
        return codes.to(torch.int16).view(torch.uint16) if self.storage == torch.uint16 else codes.to(torch.uint8)


BF16 = Format("bf16", torch.uint16, 1 << 16, 0x8000, saturating=False)
E4M3 = Format("e4m3", torch.uint8, 1 << 8, 0x80, saturating=True)
E2M1 = Format("e2m1", torch.uint8, 1 << 4, 0x8, saturating=True)
FORMATS = [BF16, E4M3, E2M1]
ids = [f.name for f in FORMATS]


def decode(fmt: Format, codes: torch.Tensor) -> torch.Tensor:
    out = torch.empty(codes.numel(), dtype=torch.float32)
    codecs.codec_kernel(fmt.name, "decode")(codes.contiguous(), out)
    return out


def encode(fmt: Format, x: torch.Tensor) -> torch.Tensor:
    out = torch.empty(x.numel(), dtype=fmt.storage)
    codecs.codec_kernel(fmt.name, "encode")(x.contiguous(), out)
    return out


def f32(bits) -> torch.Tensor:
    return torch.from_numpy(np.asarray(bits, dtype=np.uint32).view(np.float32).copy())


def as_int(codes: torch.Tensor) -> np.ndarray:
    return codes.numpy().astype(np.int64)


def finite_grid(fmt: Format) -> np.ndarray:
    """Every finite value of the format (oracle-decoded), sorted, as float64; -0 and +0 once."""
    values = fmt.decode_ref(fmt.all_codes()).double().numpy()
    return np.unique(values[np.isfinite(values)])


def dense_inputs(fmt: Format, extra=()) -> torch.Tensor:
    """Grid values, midpoints, +-1 ulp around both, specials and random fp32 bit patterns."""
    grid = finite_grid(fmt)
    mids = ((grid[1:] + grid[:-1]) / 2).astype(np.float32)  # exact in fp32 for all three formats
    near = np.concatenate([grid.astype(np.float32), mids])
    near = np.concatenate([near, np.nextafter(near, np.float32(np.inf)), np.nextafter(near, np.float32(-np.inf))])
    specials = np.array(
        [0.0, -0.0, np.inf, -np.inf, 3.4028235e38, -3.4028235e38, 1.1754944e-38, 1e-45, -1e-45, 1e9, -1e9],
        dtype=np.float32,
    )
    rng = np.random.default_rng(1234)
    random = rng.integers(0, 1 << 32, N_RANDOM, dtype=np.uint32).view(np.float32)
    return torch.from_numpy(np.concatenate([near, specials, np.asarray(extra, np.float32), random]))


def assert_codes_equal(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor):
    bad = (got != want).nonzero().flatten()
    if len(bad):
        i = bad[:8]
        rows = [f"x={x[j].item()!r} (0x{x.view(torch.int32)[j].item() & 0xFFFFFFFF:08x}) "
                f"got 0x{int(got[j]):x} want 0x{int(want[j]):x}" for j in i.tolist()]
        pytest.fail(f"{len(bad)} mismatches:\n" + "\n".join(rows))


# ---------------------------------------------------------------------------- decode


@pytest.mark.parametrize("fmt", FORMATS, ids=ids)
def test_decode_all_codes(fmt):
    codes = fmt.all_codes()
    got, want = decode(fmt, codes), fmt.decode_ref(codes)
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got.view(torch.int32)[~nan], want.view(torch.int32)[~nan])  # -0 included


def test_e2m1_decode_ignores_high_bits():
    codes = torch.arange(256, dtype=torch.uint8)
    assert torch.equal(decode(E2M1, codes).view(torch.int32), E2M1.decode_ref(codes & 0xF).view(torch.int32))


# ---------------------------------------------------------------------------- encode


def test_bf16_encode_dense():
    x = dense_inputs(BF16)
    got, want = encode(BF16, x), BF16.encode_ref(x)
    nan = x.isnan()
    assert_codes_equal(got[~nan], want[~nan], x[~nan])
    assert BF16.decode_ref(got[nan]).isnan().all()  # NaN payloads are not specified


def test_e4m3_encode_dense():
    boundary = np.array([448, 464, 479.99, 480, 500, 1e4, 3e38], np.float32)
    boundary = np.concatenate([boundary, np.nextafter(np.float32(464), np.float32([0, np.inf]))])
    subnormal = np.linspace(0, 2.0**-6, 20001, dtype=np.float32)  # step ~ 2^-20, ulp-scale neighbours too
    nans = f32([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FFFFFFF, 0xFFFFFFFF]).numpy()
    extra = np.concatenate([boundary, -boundary, subnormal, -subnormal, nans])  # all fp32: keeps sNaN bits
    x = dense_inputs(E4M3, extra)
    assert_codes_equal(encode(E4M3, x), E4M3.encode_ref(x), x)  # NaN codes included


def test_e2m1_encode_dense():
    big = np.array([6.5, 7, 8, 100, 1e30], np.float32)
    x = dense_inputs(E2M1, np.concatenate([big, -big]))
    nan = x.isnan()
    assert_codes_equal(encode(E2M1, x[~nan]), E2M1.encode_ref(x[~nan]), x[~nan])


def test_e2m1_encode_nan_rule():
    """NaN has no e2m1 code: the documented rule is 6 with the NaN's sign bit (ml_dtypes gives +-0)."""
    bits = np.array([0x7FC00000, 0x7F800001, 0x7FFFFFFF, 0xFFC00000, 0xFF800001, 0xFFFFFFFF], np.uint32)
    x = f32(bits)
    assert x.isnan().all()
    six = E2M1.encode_ref(torch.tensor([6.0]))[0].item()
    want = torch.from_numpy(np.where(bits >> 31, six | E2M1.sign_bit, six).astype(np.uint8))
    assert_codes_equal(encode(E2M1, x), want, x)


def test_e2m1_ties_table():
    """The spec's ties-to-even table, as values (also checked against ml_dtypes)."""
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    want = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0])
    for sign in (1, -1):
        codes = encode(E2M1, sign * x)
        assert torch.equal(E2M1.decode_ref(codes), sign * want)
        assert torch.equal(codes, E2M1.encode_ref(sign * x))


@pytest.mark.parametrize("fmt", FORMATS, ids=ids)
def test_round_trip(fmt):
    codes = fmt.all_codes()
    keep = ~fmt.decode_ref(codes).isnan()
    codes = codes[keep]
    assert torch.equal(encode(fmt, decode(fmt, codes)), codes)


# ---------------------------------------------------------------------------- nearest-value property


def _floats(fmt: Format):
    wide = st.floats(width=32, allow_nan=False)
    if fmt is BF16:
        return wide
    top = float(finite_grid(fmt)[-1])
    return st.one_of(wide, st.floats(-2 * top, 2 * top, width=32))


def _check_nearest(fmt: Format, xs):
    """encode(x) is a grid neighbour of x, at least as close as the other, even on a tie, signed like x."""
    x = torch.tensor(xs, dtype=torch.float32)
    codes = encode(fmt, x)
    ci = as_int(codes)
    mag_codes = torch.from_numpy(ci & ~fmt.sign_bit).to(torch.int32).to(fmt.storage)
    q = fmt.decode_ref(mag_codes).double().numpy()
    grid = finite_grid(fmt)
    grid = grid[grid >= 0]
    if not fmt.saturating:  # IEEE overflow: inf behaves as the grid point 2^128 (max finite is odd)
        q = np.where(np.isinf(q), 2.0**128, q)
        grid = np.append(grid, 2.0**128)
    a = np.minimum(np.abs(x.double().numpy()), grid[-1])
    lo = grid[np.searchsorted(grid, a, "right") - 1]
    hi = grid[np.searchsorted(grid, a, "left")]
    for j in range(len(a)):
        d_lo, d_hi, d = a[j] - lo[j], hi[j] - a[j], abs(q[j] - a[j])
        msg = f"x={xs[j]!r} code=0x{ci[j]:x} value={q[j]!r} neighbours {lo[j]!r}, {hi[j]!r}"
        assert q[j] in (lo[j], hi[j]) and d <= min(d_lo, d_hi), msg
        if d_lo == d_hi and lo[j] != hi[j]:
            assert ci[j] & 1 == 0, "tie not to even: " + msg
        assert bool(ci[j] & fmt.sign_bit) == bool(np.signbit(xs[j])), "sign: " + msg


@given(xs=st.lists(_floats(BF16), min_size=1, max_size=64))
def test_bf16_encode_nearest(xs):
    _check_nearest(BF16, xs)


@given(xs=st.lists(_floats(E4M3), min_size=1, max_size=64))
def test_e4m3_encode_nearest(xs):
    _check_nearest(E4M3, xs)


@given(xs=st.lists(_floats(E2M1), min_size=1, max_size=64))
def test_e2m1_encode_nearest(xs):
    _check_nearest(E2M1, xs)


# ---------------------------------------------------------------------------- CUDA lowering


@pytest.mark.parametrize("fmt", FORMATS, ids=ids)
def test_lowers_for_sm90(fmt):
    from flashkern.kernels._tilelang import lower_sm90

    for direction in ("decode", "encode"):
        source, _, threads = lower_sm90(codecs.codec_prim_func(fmt.name, direction, parallel=T.Parallel, block=128))
        assert "__global__" in source and "codec_kernel" in source
        assert threads == 128


def assert_halves_equal(out: torch.Tensor, want_low: torch.Tensor, want_high: torch.Tensor):
    """Each bf16 half of the int32 bf16x2 words `out` equals the fp32 (bf16-valued) `want_*` bit for bit (-0
    included), NaN where it is NaN."""
    for got, want in (((out << 16).view(torch.float32), want_low), ((out & -65536).view(torch.float32), want_high)):
        nan = want.isnan()
        assert torch.equal(got.isnan(), nan)
        assert torch.equal(got.view(torch.int32)[~nan], want.view(torch.int32)[~nan])


def _e2m1_pairs_kernel(fl):
    """out[b, s] = the bf16x2 bits of byte b's two e2m1 codes times e4m3 scale code s, as the attention decodes."""
    from flashkern.kernels._tilelang import CPU, compile_cpu

    @T.prim_func
    def pairs(Scales: T.Tensor((256,), "uint8"), Out: T.Tensor((256, 256), "int32")):
        with T.Kernel(1, threads=128):
            for b, s in T.grid(256, 256):
                Out[b, s] = T.reinterpret(fl.mul_bf16x2(fl.mul_bf16x2(
                    codecs.e2m1_pair_bf16x2(T.Cast("uint8", b)), T.uint32(codecs.E2M1_REBIAS_BF16X2)),
                    codecs.bf16x2_of_f32(codecs.e4m3_to_f32(Scales[s]))), "int32")

    return compile_cpu(pairs) if fl is CPU else pairs


def test_e2m1_pairs_times_every_scale_are_exact():
    """The attention's FP4 decode (a byte -> bf16x2 bits, times 2^126, times the scale, two bf16 multiplies) gives
    each code's value times the scale for every byte and every e4m3 scale (NaN scales: NaN)."""
    from flashkern.kernels._tilelang import CPU

    scales = torch.arange(256, dtype=torch.uint8)
    out = torch.zeros(256, 256, dtype=torch.int32)
    _e2m1_pairs_kernel(CPU)(scales, out)
    codes = torch.arange(256, dtype=torch.uint8)
    scale = scales.view(torch.float8_e4m3fn).float()
    want_low = (E2M1.decode_ref(codes & 0xF)[:, None] * scale[None, :]).bfloat16().float()
    want_high = (E2M1.decode_ref(codes >> 4)[:, None] * scale[None, :]).bfloat16().float()
    assert_halves_equal(out, want_low, want_high)


def test_e2m1_pairs_lower_to_bf16x2_multiplies():
    from flashkern.kernels._tilelang import GPU, lower_sm90

    source, _, _ = lower_sm90(_e2m1_pairs_kernel(GPU))
    assert source.count("tl::mul2(") == 2 and "__nv_bfloat162" in source


def test_e4m3_pairs_times_every_scale_are_exact():
    """The attention's MXFP8 decode (two codes -> bf16x2 bits, times 2^120, times the ue8m0 scale) gives each code's
    value times the scale, rounded once to bf16, for every code in either place and every scale byte (NaN codes and
    the NaN scale: NaN)."""
    from flashkern.kernels._tilelang import CPU, compile_cpu

    @T.prim_func
    def pairs(Low: T.Tensor((256,), "uint8"), High: T.Tensor((256,), "uint8"), Out: T.Tensor((256, 256), "int32")):
        with T.Kernel(1, threads=128):
            for i, e in T.grid(256, 256):
                Out[i, e] = T.reinterpret(CPU.mul_bf16x2(CPU.mul_bf16x2(
                    codecs.e4m3_pair_bf16x2(Low[i], High[i]), T.uint32(codecs.E4M3_REBIAS_BF16X2)),
                    codecs.bf16x2_of_f32(codecs.ue8m0_to_f32(T.Cast("uint8", e)))), "int32")

    low = torch.arange(256, dtype=torch.uint8)
    high = ((torch.arange(256) * 37 + 11) % 256).to(torch.uint8)  # every code in the high place too
    out = torch.zeros(256, 256, dtype=torch.int32)
    compile_cpu(pairs)(low, high, out)
    scale = torch.where(torch.arange(256) == 255, torch.tensor(math.nan),
                        torch.pow(2.0, torch.arange(256, dtype=torch.float64) - 127).float())
    want_low, want_high = ((codes.view(torch.float8_e4m3fn).float()[:, None] * scale[None, :]).bfloat16().float()
                           for codes in (low, high))
    assert_halves_equal(out, want_low, want_high)
