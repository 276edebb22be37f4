"""KV-cache records in Triton: quantize_kv and kv_cache_insert (one kernel body), dequantize_kv.

    fp4    288 B: codes = e2m1(x / sf) two per byte (even element low), then sf = e4m3(clamp(amax / 6, 2^-9, 448))
           per 16 values;
    mxfp8  528 B: codes = e4m3(x / 2^(e - 127)), then e = clamp(ceil_ue8m0(amax / 448), 1, 254) per 32 values;
    a block holding a NaN: the NaN scale byte (0x7F / 0xFF) and zero codes (reference/kv_cache.py).

Tile plan: a program owns BLOCK_ROWS records. Quantize loads the latent tile [BLOCK_ROWS, 512] (bf16 rows at
their stride), views it as [BLOCK_ROWS x scales, group] for the block amax (an integer max of |x|'s bits, which
also flags NaN: its bits exceed those of inf), encodes with the integer codecs of kernels/_triton/codecs.py (the
divisions IEEE-rounded, tl.math.div_rn: Triton's `/` is approximate on the GPU; mxfp8 multiplies by the exact
power-of-two reciprocal of its scale instead) and stores each record's codes and scales as two contiguous spans
at the record's address: row x bytes for quantize_kv, or with INSERT (a constexpr) the slot's page x page stride
+ row in page x bytes of the cache, nothing for a slot of -1 or outside the cache. Dequantize loads the same
spans and stores the values [BLOCK_ROWS, 512] fp32. Records are 288 = 16 x 18 and 528 = 16 x 33 bytes and each
span starts 16-byte aligned, so loads and stores can be 16 B wide. Addresses are int64 (caches can pass 2^31 B).

H200 bounds: memory. Per record quantize moves 1024 B of bf16 in and 288 / 528 B out (3.7 / 3.1 G records per
second at 4.8 TB/s), dequantize 288 / 528 B in and 2048 B out (2.1 / 1.9 G per second); the per-value integer
codecs (some 30 ops, with an IEEE division for fp4) keep under the memory time only with every SM busy, hence
small programs (2 or more per SM).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

import flashkern
from flashkern.autotune.space import Space
from flashkern.kernels._triton import Launch
from flashkern.kernels._triton.codecs import (F32_ABS, F32_INF, bf16_to_f32, e2m1_decode, e2m1_encode, e4m3_decode,
                                              e4m3_encode, ue8m0_ceil, ue8m0_decode, ue8m0_reciprocal)
from flashkern.kernels.tiles import SMS, cdiv, next_power_of_2
from flashkern.reference import formats
from flashkern.reference.kv_cache import FORMATS, FP4_MIN_SCALE, LATENT, MXFP8_MIN_EXPONENT

D = tl.constexpr(LATENT)
MIN_SCALE = tl.constexpr(FP4_MIN_SCALE)
MIN_EXPONENT = tl.constexpr(MXFP8_MIN_EXPONENT)
E4M3_MAX = tl.constexpr(formats.E4M3_MAX)
E2M1_MAX = tl.constexpr(formats.E2M1_MAX)


@triton.constexpr_function
def record_bytes(format):
    """Bytes of a record in `format` ("fp4" or "mxfp8")."""
    return FORMATS[format].bytes


@triton.constexpr_function
def code_bytes(format):
    """Bytes of a record's codes (its scale bytes follow them)."""
    return FORMATS[format].code_bytes


@triton.constexpr_function
def scale_group(format):
    """Values per scale byte."""
    return FORMATS[format].group


@triton.jit
def slot_offset(slot, block_size, page_stride, FORMAT: tl.constexpr):
    """int64 byte offset of cache slot `slot` (a valid int32 one): row slot % block_size of page slot // block_size
    (the division in int32, the address in int64)."""
    page = slot // block_size
    return page.to(tl.int64) * page_stride + (slot - page * block_size).to(tl.int64) * record_bytes(FORMAT)


@triton.jit
def _scale_bytes(base, row_ok, FIRST_SCALE: tl.constexpr, SCALES: tl.constexpr, WORDS: tl.constexpr):
    """Scale bytes FIRST_SCALE .. FIRST_SCALE + SCALES - 1 of the records at byte pointers `base` [R, 1], int32
    [R, SCALES]: with WORDS (4-byte aligned records) read as int32 words and split into bytes (low byte first), so
    a thread reads 4 bytes at once (asynchronous copies on the GPU; single bytes stay synchronous loads), else byte by
    byte."""
    R: tl.constexpr = base.shape[0]
    if WORDS and SCALES % 4 == 0:
        words = tl.load((base + FIRST_SCALE).to(tl.pointer_type(tl.int32)) + tl.arange(0, SCALES // 4)[None, :],
                        mask=row_ok[:, None], other=0)
        even = tl.join(words & 0xFF, (words >> 16) & 0xFF)  # bytes 0, 2 of each word
        odd = tl.join((words >> 8) & 0xFF, (words >> 24) & 0xFF)  # bytes 1, 3
        return tl.reshape(tl.join(even, odd), (R, SCALES))  # [word, pair, parity] = byte 2 pair + parity
    else:
        return tl.load(base + FIRST_SCALE + tl.arange(0, SCALES)[None, :], mask=row_ok[:, None], other=0).to(tl.int32)


@triton.jit
def decode_records(records_ptr, row, row_ok, FORMAT: tl.constexpr, FIRST: tl.constexpr, VALUES: tl.constexpr,
                   WORDS: tl.constexpr = False):
    """Values FIRST .. FIRST + VALUES - 1 (a span of whole scale blocks) of the records at int64 byte offsets `row`
    [R], as fp32 [R, VALUES] (exact); rows not ok read nothing and decode to 0. value = code value x the scale of
    its block (fp4: e2m1 x e4m3; mxfp8: e4m3 x 2^(e - 127)). WORDS: records_ptr and every row are 4-byte aligned
    (the scale bytes are then read in words)."""
    CODE_BYTES: tl.constexpr = code_bytes(FORMAT)
    GROUP: tl.constexpr = scale_group(FORMAT)
    R: tl.constexpr = row.shape[0]
    SCALES: tl.constexpr = VALUES // GROUP
    base = records_ptr + row[:, None]
    scale_bytes = _scale_bytes(base, row_ok, CODE_BYTES + FIRST // GROUP, SCALES, WORDS)
    codes = tl.load(base + FIRST * CODE_BYTES // D + tl.arange(0, VALUES * CODE_BYTES // D)[None, :],
                    mask=row_ok[:, None], other=0)
    if FORMAT == "fp4":
        values = e2m1_decode(tl.reshape(tl.join(codes & 0xF, codes >> 4), (R, VALUES)))  # even element: low nibble
        scales = e4m3_decode(scale_bytes)
    else:
        values = e4m3_decode(codes)
        scales = ue8m0_decode(scale_bytes)
    return tl.reshape(tl.reshape(values, (R, SCALES, GROUP)) * scales[:, :, None], (R, VALUES))


def word_aligned(records: torch.Tensor, row_stride: int) -> bool:
    """Whether every record of `records` (rows `row_stride` bytes apart) starts 4-byte aligned: decode_records may
    then read words (metadata only: no tensor values are read)."""
    return records.data_ptr() % 4 == 0 and row_stride % 4 == 0


@triton.jit
def encode_records(x, FORMAT: tl.constexpr):
    """Records of fp32 rows x [R, 512] (bf16 values): (code bytes [R, code bytes], scale bytes [R, scales]), int32.

    Per block: amax = max |x| as an integer max of the magnitude bits (a NaN's exceed inf's: the NaN flag);
    fp4: sf = e4m3(clamp(amax / 6, 2^-9, 448)), codes e2m1(x / decoded sf) packed two per byte;
    mxfp8: e = clamp(ceil_ue8m0(amax / 448), 1, 254), codes e4m3(x * 2^(127 - e)) (the exact reciprocal of the
    power-of-two scale, 2^-127 a subnormal: the product is x / 2^(e - 127) correctly rounded).
    """
    CODE_BYTES: tl.constexpr = code_bytes(FORMAT)
    GROUP: tl.constexpr = scale_group(FORMAT)
    R: tl.constexpr = x.shape[0]
    SCALES: tl.constexpr = D // GROUP
    blocks = tl.reshape(x, (R * SCALES, GROUP))
    amax_bits = tl.max(blocks.to(tl.int32, bitcast=True) & F32_ABS, axis=1)
    has_nan = amax_bits > F32_INF
    amax = amax_bits.to(tl.float32, bitcast=True)
    if FORMAT == "fp4":
        sf = e4m3_encode(tl.minimum(tl.maximum(tl.math.div_rn(amax, E2M1_MAX), MIN_SCALE), E4M3_MAX))
        codes = e2m1_encode(tl.math.div_rn(blocks, e4m3_decode(sf)[:, None]))
        scale_bytes = tl.where(has_nan, 0x7F, sf)
    else:
        exponent = tl.maximum(ue8m0_ceil(tl.math.div_rn(amax, E4M3_MAX)), MIN_EXPONENT)
        codes = e4m3_encode(blocks * ue8m0_reciprocal(exponent)[:, None])
        scale_bytes = tl.where(has_nan, 0xFF, exponent)
    codes = tl.reshape(tl.where(has_nan[:, None], 0, codes), (R, D))
    if FORMAT == "fp4":
        even, odd = tl.split(tl.reshape(codes, (R, CODE_BYTES, 2)))
        codes = even | (odd << 4)
    return codes, tl.reshape(scale_bytes, (R, SCALES))


@triton.jit(do_not_specialize=["rows"])  # per-step sizes: one compile whatever the batch
def quantize_kernel(latent_ptr, stride_latent, out_ptr, slots_ptr, rows, cache_slots, block_size, page_stride,
                    FORMAT: tl.constexpr, INSERT: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    """Records of latent rows [BLOCK_ROWS program_id(0), +BLOCK_ROWS): to out [rows, bytes], or with INSERT to cache
    slots slots[row] of out (a paged cache; a slot outside [0, cache_slots), -1 included, writes nothing)."""
    CODE_BYTES: tl.constexpr = code_bytes(FORMAT)
    row = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_ok = row < rows
    d = tl.arange(0, D)[None, :]
    x = tl.load(latent_ptr + row.to(tl.int64)[:, None] * stride_latent + d, mask=row_ok[:, None], other=0.0)
    codes, scale_bytes = encode_records(bf16_to_f32(x), FORMAT)
    if INSERT:
        slot = tl.load(slots_ptr + row, mask=row_ok, other=-1)
        row_ok = (slot >= 0) & (slot < cache_slots)
        at = slot_offset(tl.where(row_ok, slot, 0), block_size, page_stride, FORMAT)
    else:
        at = row.to(tl.int64) * record_bytes(FORMAT)
    base = out_ptr + at[:, None]
    scale = CODE_BYTES + tl.arange(0, D // scale_group(FORMAT))
    tl.store(base + tl.arange(0, CODE_BYTES)[None, :], codes.to(tl.uint8), mask=row_ok[:, None])
    tl.store(base + scale[None, :], scale_bytes.to(tl.uint8), mask=row_ok[:, None])


@triton.jit(do_not_specialize=["rows"])  # per-step sizes: one compile whatever the batch
def dequantize_kernel(records_ptr, stride_records, out_ptr, rows, FORMAT: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                      WORDS: tl.constexpr):
    """fp32 values of records [BLOCK_ROWS program_id(0), +BLOCK_ROWS) into out [rows, 512]."""
    row = (tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
    row_ok = row < rows
    values = decode_records(records_ptr, row * stride_records, row_ok, FORMAT, 0, D, WORDS)
    tl.store(out_ptr + row[:, None] * D + tl.arange(0, D)[None, :], values, mask=row_ok[:, None])


# ---------------------------------------------------------------- plans


def _launch(kernel, problem, config: dict, args: dict) -> Launch:
    return Launch(kernel, grid=(cdiv(problem.rows, config["block_rows"]),),
                  args=dict(args, rows=problem.rows, FORMAT=problem.format, BLOCK_ROWS=config["block_rows"]),
                  num_warps=config["num_warps"])


def plan_quantize(problem, inputs: dict, config: dict, out: torch.Tensor) -> Launch:
    """Records [N, bytes]: a program per block_rows latent rows."""
    latent = inputs["latent"]
    return _launch(quantize_kernel, problem, config,
                   dict(latent_ptr=latent, stride_latent=latent.stride(0), out_ptr=out, slots_ptr=None,
                        cache_slots=0, block_size=1, page_stride=0, INSERT=False))


def plan_insert(problem, inputs: dict, config: dict, out: torch.Tensor) -> Launch:
    """Records written into the cache (out is inputs["cache"]) at their slots: the quantize kernel with INSERT."""
    latent, cache = inputs["latent"], inputs["cache"]
    return _launch(quantize_kernel, problem, config,
                   dict(latent_ptr=latent, stride_latent=latent.stride(0), out_ptr=cache, slots_ptr=inputs["slots"],
                        cache_slots=cache.shape[0] * cache.shape[1], block_size=cache.shape[1],
                        page_stride=cache.stride(0), INSERT=True))


def plan_dequantize(problem, inputs: dict, config: dict, out: torch.Tensor) -> Launch:
    """Values [N, 512] fp32: a program per block_rows records."""
    records = inputs["records"]
    return _launch(dequantize_kernel, problem, config,
                   dict(records_ptr=records, stride_records=records.stride(0), out_ptr=out,
                        WORDS=word_aligned(records, records.stride(0))))


# ---------------------------------------------------------------- spaces and defaults
# Register model, measured with ptxas (sm_90a, Triton 3.9, both formats): what matters is the [block_rows, 512]
# row tile per thread. Quantize (and insert, the same kernel): 16-32 values per thread take 40-63 registers, 64
# take 96-136, 128 take 188-255 and mxfp8 spilled 356 B (32 rows on 4 warps, 64 on 8). Dequantize: 128 values per
# thread take 157-229 registers without spilling. Shared memory: a few KB of layout conversions.
INTERPRETED_TILE = 2**16  # values per interpreted program: large enough that the per-op cost amortizes


def _values_per_thread(problem, config) -> int:
    return config["block_rows"] * LATENT // (32 * config["num_warps"])


def _records_space(values_per_thread: int) -> Space:
    return Space(
        params={"block_rows": tuple(2**e for e in range(8)), "num_warps": (1, 2, 4, 8)},
        gpu_only=("num_warps",),
        constraints={"block_rows < 2 x rows (more would repeat a smaller config)":
                     lambda p, c: c["block_rows"] == 1 or c["block_rows"] < 2 * p.rows},
        limits={f"block_rows x 512 / threads <= {values_per_thread} (registers)":
                lambda p, c: _values_per_thread(p, c) <= values_per_thread},
    )


QUANTIZE_SPACE = INSERT_SPACE = _records_space(64)
DEQUANTIZE_SPACE = _records_space(128)


def records_default(problem) -> dict:
    """GPU: 4 warps at 16 values per thread (4 rows), fewer rows while that leaves under 2 programs per SM.
    Interpreter (each tl op costs about the same whatever its size): up to 2^16 values (128 rows) per program."""
    rows = next_power_of_2(max(1, problem.rows))
    if flashkern.triton_interpreted():
        return {"block_rows": min(rows, INTERPRETED_TILE // LATENT), "num_warps": 4}
    block_rows = min(4, rows)
    while block_rows > 1 and cdiv(problem.rows, block_rows) < 2 * SMS:
        block_rows //= 2
    return {"block_rows": block_rows, "num_warps": 4}


quantize_default = dequantize_default = insert_default = records_default
