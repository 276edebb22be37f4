"""KV-cache records in TileLang: one source for CUDA and the CPU (C) target (docs/operators.md section 8.1).

    fp4    (288 B)  codes e2m1(x / sf), sf = e4m3(clamp(amax / 6, 2^-9, 448)) per 16 values; bytes [256, 288) the
                    scales, two codes a byte (even element in the low nibble)
    mxfp8  (528 B)  codes e4m3(x / 2^(e - 127)), e = max(ceil_ue8m0(amax / 448), 1) per 32 values; bytes
                    [512, 528) the exponents
    A block holding a NaN stores the NaN scale byte (fp4 0x7F, mxfp8 0xFF) and zero codes.

Tile plan: a program per block_rows rows.
  quantize / insert (one source, `scatter` selects the destination):
    1. the rows' bf16 values -> x [block_rows, 512] (shared; rows past N are zeros, never stored);
    2. a thread per (row, scale block): the largest |x| as fp32 bits (integer max of the magnitude bits, so a NaN,
       whose bits exceed inf's, shows as amax > inf), the scale, then the block's codes -> the record tile
       rec [block_rows, bytes] (shared);
    3. rec -> the destination: row i of out [N, bytes] (quantize_kv), or slot slots[i] of the paged cache
       (kv_cache_insert: page s // block_size, row s % block_size, any page stride, int64 addresses; a slot
       outside [0, blocks x block_size), -1 and INT32_MIN / MAX included, writes nothing).
  dequantize: the records -> rec [block_rows, bytes], then value = code value x scale -> out [N, 512] fp32.
Divisions are IEEE fp32 on both targets: the C target's `/` is, and TileLang's CUDA build compiles `/` to
div.rn.f32 (fast math is off unless tl.enable_fast_math is set; no flush to zero), as the reference's.
H200: memory bound; per row 1 KiB of bf16 in and 288 / 528 B out (dequantize: 288 / 528 B in, 2 KiB out), so
4096 rows move 5-10 MB: a few microseconds at 4.8 TB/s, launch latency at decode sizes. The record tile leaves in
16-byte stores to a contiguous `out` (record sizes are multiples of 16 bytes); strided rows and pages are read and
written element by element.
"""

# No `from __future__ import annotations`: TileLang evaluates T.Tensor annotations against the closure.
import functools

import torch

from flashkern.autotune.space import Space
from flashkern.kernels._tilelang import T, Flavour, codecs, row_strided
from flashkern.kernels.kv_cache.problem import CodecProblem
from flashkern.reference.formats import E2M1_MAX, E4M3_MAX, E4M3_NAN, UE8M0_NAN
from flashkern.reference.kv_cache import FORMATS, FP4_MIN_SCALE, LATENT, MXFP8_MIN_EXPONENT

MAGNITUDE = 0x7FFFFFFF  # fp32 bits without the sign
F32_INF = 0x7F800000
STORE_BYTES = 16  # record sizes (288, 528) are multiples of 16 bytes


def _encode_block_macro(fl: Flavour, fmt):
    """encode_block(x, rec, r, g): the scale byte and codes of scale block g of row r of x (fl.bf16 [rows, 512])
    into rec [rows, bytes]."""
    G = fmt.group

    @T.macro
    def encode_block(x, rec, r, g):
        amax_bits = T.alloc_var("uint32", init=0)
        for j in T.unroll(G):
            amax_bits = T.max(amax_bits, T.reinterpret(fl.load_bf16(x[r, g * G + j]), "uint32") & MAGNITUDE)
        has_nan = amax_bits > T.uint32(F32_INF)
        amax = T.reinterpret(amax_bits, "float32")
        if fmt.name == "fp4":
            sf_code = T.alloc_var("uint8", init=codecs.f32_to_e4m3(T.min(T.max(amax / E2M1_MAX, FP4_MIN_SCALE),
                                                                           E4M3_MAX)))
            sf = T.alloc_var("float32", init=codecs.e4m3_to_f32(sf_code))
            rec[r, fmt.code_bytes + g] = T.if_then_else(has_nan, T.uint8(E4M3_NAN), sf_code)
            for j in T.unroll(G // 2):
                low = codecs.f32_to_e2m1(fl.load_bf16(x[r, g * G + 2 * j]) / sf)
                high = codecs.f32_to_e2m1(fl.load_bf16(x[r, g * G + 2 * j + 1]) / sf)
                rec[r, g * (G // 2) + j] = T.if_then_else(has_nan, T.uint8(0), low | T.shift_left(high, T.uint8(4)))
        else:
            exponent = T.max(codecs.f32_to_ue8m0_ceil(amax / E4M3_MAX), T.uint32(MXFP8_MIN_EXPONENT))
            scale = T.reinterpret(T.shift_left(exponent, T.uint32(23)), "float32")  # 2^(e - 127), e in [1, 254]
            rec[r, fmt.code_bytes + g] = T.if_then_else(has_nan, T.uint8(UE8M0_NAN), T.Cast("uint8", exponent))
            for j in T.unroll(G):
                rec[r, g * G + j] = T.if_then_else(has_nan, T.uint8(0),
                                                   codecs.f32_to_e4m3(fl.load_bf16(x[r, g * G + j]) / scale))

    return encode_block


@functools.cache
def slot_locator():
    """locate_slot(Cache, slot, page, row, i), a macro: page[i], row[i] = where slot `slot` of the paged Cache
    [blocks, block_size, bytes] is: page -1 (and row 0) for -1 and any slot outside [0, blocks x block_size)
    (compared in int64: no int32 value wraps); row[i] holds the slot meanwhile."""

    @T.macro
    def locate_slot(Cache, slot, page, row, i):
        row[i] = slot
        row[i] = T.if_then_else(
            (row[i] >= 0) & (T.Cast("int64", row[i]) < T.Cast("int64", Cache.shape[0]) * T.Cast("int64", Cache.shape[1])),
            row[i], -1)
        page[i] = T.if_then_else(row[i] >= 0, row[i] // Cache.shape[1], -1)
        row[i] = T.if_then_else(row[i] >= 0, row[i] % Cache.shape[1], 0)

    return locate_slot


def code_value(fmt, rec, r, d):
    """fp32 value of the code of element d of the record in row r of rec [rows, bytes] (before its scale)."""
    if fmt.name == "fp4":
        return codecs.e2m1_to_f32(T.shift_right(rec[r, d // 2], T.Cast("uint8", (d % 2) * 4)))
    return codecs.e4m3_to_f32(rec[r, d])


def scale_value(fmt, rec, r, g):
    """fp32 scale of scale block g of the record in row r of rec (NaN for the NaN scale byte)."""
    if fmt.name == "fp4":
        return codecs.e4m3_to_f32(rec[r, fmt.code_bytes + g])
    return codecs.ue8m0_to_f32(rec[r, fmt.code_bytes + g])


# ---------------------------------------------------------------- quantize_kv / kv_cache_insert


def _encode_program(problem: CodecProblem, config: dict, fl: Flavour, scatter: bool):
    """quantize_kv (scatter False: out [N, bytes]) or kv_cache_insert (scatter True: the records at their slots of
    cache [blocks, block_size, bytes]); module docstring."""
    fmt = FORMATS[problem.format]
    BR, RB = config["block_rows"], fmt.bytes
    N = T.dynamic("N")
    encode_block = _encode_block_macro(fl, fmt)
    NB, BS, PS = T.dynamic("blocks"), T.dynamic("block_size"), T.dynamic("page_stride")

    @T.macro
    def encode_rows(Latent, r0, rec):
        """rec [BR, bytes] = the records of rows r0 .. r0 + BR - 1 (rows past N: zeros, never stored)."""
        x = fl.shared((BR, LATENT), fl.bf16)
        for r, d in fl.parallel(BR, LATENT):
            x[r, d] = T.if_then_else(r0 + r < N, Latent[T.min(r0 + r, N - 1), d], T.Cast(fl.bf16, 0))
        for r, g in fl.parallel(BR, fmt.scales):
            encode_block(x, rec, r, g)

    if scatter:
        locate_slot = slot_locator()

        @T.prim_func
        def kv_cache_insert(
            Cache: T.StridedTensor((NB, BS, RB), (PS, RB, 1), "uint8"),
            Slots: T.Tensor((N,), "int32"),
            Latent: row_strided((N, LATENT), fl.bf16, "latent"),
        ):
            with T.Kernel(T.ceildiv(N, BR), threads=config["threads"]) as bx:
                rec = fl.shared((BR, RB), "uint8")
                page = fl.shared((BR,), "int32")  # -1: write nothing
                row = fl.shared((BR,), "int32")
                encode_rows(Latent, bx * BR, rec)
                for r in fl.parallel(BR):
                    locate_slot(Cache, T.if_then_else(bx * BR + r < N, Slots[T.min(bx * BR + r, N - 1)], -1), page,
                                row, r)
                for r, b in fl.parallel(BR, RB):
                    if bx * BR + r < N:
                        if page[r] >= 0:
                            Cache[T.Cast("int64", page[r]), row[r], b] = rec[r, b]

        return kv_cache_insert

    @T.prim_func
    def quantize_kv(
        Latent: row_strided((N, LATENT), fl.bf16, "latent"),
        Out: T.Tensor((N, RB), "uint8"),
    ):
        with T.Kernel(T.ceildiv(N, BR), threads=config["threads"]) as bx:
            rec = fl.shared((BR, RB), "uint8")
            encode_rows(Latent, bx * BR, rec)
            for r, v in fl.parallel(BR, RB // STORE_BYTES):  # 16-byte stores on the GPU
                for b in T.vectorized(STORE_BYTES):
                    if bx * BR + r < N:
                        Out[bx * BR + r, v * STORE_BYTES + b] = rec[r, v * STORE_BYTES + b]

    return quantize_kv


def quantize_program(problem: CodecProblem, config: dict, fl: Flavour):
    return _encode_program(problem, config, fl, scatter=False)


def quantize_args(problem: CodecProblem, inputs: dict, config: dict, fl: Flavour, out):
    if problem.rows == 0:
        return None
    return [fl.bf16_arg(inputs["latent"]), out]


def insert_program(problem: CodecProblem, config: dict, fl: Flavour):
    return _encode_program(problem, config, fl, scatter=True)


def cache_arg(cache: torch.Tensor) -> torch.Tensor:
    """A paged cache as the kernels declare it, strides (page stride, bytes, 1): with one slot a page, the row
    stride (never used, and free in the argument checks) is set to the record size."""
    if cache.shape[1] == 1 and cache.stride(1) != cache.shape[2]:
        return cache.as_strided(cache.shape, (cache.stride(0), cache.shape[2], 1))
    return cache


def insert_args(problem: CodecProblem, inputs: dict, config: dict, fl: Flavour, out):
    if problem.rows == 0:
        return None
    return [cache_arg(inputs["cache"]), inputs["slots"], fl.bf16_arg(inputs["latent"])]


# ---------------------------------------------------------------- dequantize_kv


def dequantize_program(problem: CodecProblem, config: dict, fl: Flavour):
    """out [N, 512] fp32 = the values of records [N, bytes]."""
    fmt = FORMATS[problem.format]
    BR, RB = config["block_rows"], fmt.bytes
    N = T.dynamic("N")

    @T.prim_func
    def dequantize_kv(
        Records: row_strided((N, RB), "uint8", "records"),
        Out: T.Tensor((N, LATENT), "float32"),
    ):
        with T.Kernel(T.ceildiv(N, BR), threads=config["threads"]) as bx:
            rec = fl.shared((BR, RB), "uint8")
            for r, b in fl.parallel(BR, RB):
                rec[r, b] = T.if_then_else(bx * BR + r < N, Records[T.min(bx * BR + r, N - 1), b], T.uint8(0))
            for r, g in fl.parallel(BR, fmt.scales):
                if bx * BR + r < N:
                    scale = scale_value(fmt, rec, r, g)
                    for j in T.unroll(fmt.group):
                        Out[bx * BR + r, g * fmt.group + j] = code_value(fmt, rec, r, g * fmt.group + j) * scale

    return dequantize_kv


def dequantize_args(problem: CodecProblem, inputs: dict, config: dict, fl: Flavour, out):
    if problem.rows == 0:
        return None
    return [inputs["records"], out]


# ---------------------------------------------------------------- tuning spaces

# sm_90a builds take 23..80 registers across the space, no spills (a thread encodes or decodes one scale block at a
# time), and at most 24 KiB of shared memory: no limit binds.
RECORD_SPACE = Space(params={"block_rows": (1, 2, 4, 8, 16), "threads": (64, 128, 256)}, gpu_only=("threads",))
QUANTIZE_SPACE = DEQUANTIZE_SPACE = INSERT_SPACE = RECORD_SPACE


def record_default(problem: CodecProblem) -> dict:
    """8 rows a program (8 KiB of bf16 in, or 16 KiB of fp32 out), 128 threads: 1-2 scale blocks a thread."""
    return {"block_rows": 8, "threads": 128}


quantize_default = dequantize_default = insert_default = record_default
