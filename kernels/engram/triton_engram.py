"""Engram in Triton: the n-gram hash, the table lookup and the gate (reference/engram.py is the contract).

    hash    h = cid(t) mult[0]; h ^= id_k mult[k] for lookback k = 1 .. max_ngram - 1 (the k-th id before t in its
            run of equal seq ids, else its history's, else the pad id); row(t, k + 1, j) = h % prime + offset
    lookup  value[i] = e4m3(code[i]) 2^(scale[i / 32] - 127) as bf16 (exact); a row id outside the table: zeros
    gate    dot = sum(h q_w k k_w) rstd_h rstd_k / sqrt(D); g = sigmoid(sign(dot) sqrt(max(|dot|, 1e-6)));
            out = bf16(h + g v), fp32 inside

Tile plan. Hash: a program per BLOCK_T tokens; per lookback step k the run test (seq id of token t - k), the
id from the call or the history row (every gather masked, its address clamped), the int64 product and XOR; h of
each order is kept in its heads' columns of a [BLOCK_T, orders x heads padded to a power of two] tile, whose
remainders by the primes are stored once. Lookup: the T x L row reads flattened into tiles of BLOCK_ROWS rows
(int64 byte offsets at the table's row stride; its alignment is declared so that a row's 256 codes load in
pieces of up to 8 bytes); a program per tile, or a persistent grid of min(tiles, SMs) or min(tiles, SMs / 2)
programs (the side stream's half) striding over the tiles. Gate: a program per token holds its hc streams as
[HC, BLOCK_D] tiles, or (stream_programs, for few tokens) a program per (token, stream) one [BLOCK_D] row, a
token's programs adjacent (hc times the CTAs; each reads v and the weights, L2 serving the repeats): a pass over D
accumulates sum h^2, sum k^2 and sum h q_w k k_w per stream, a second pass re-reads h (L1 / L2) and v and stores
out.

H200 bounds: lookup and gate are memory-bound. Lookup: 264 B in and 512 B out a row, 24 rows a token; a host
table is read at PCIe Gen5's 64 GB/s each way by a persistent grid (vLLM's UVA gather: the table dwarfs TLB reach).
Gate: per stream D bf16 of h and k read, v's shared by the streams, out written (h's second read from L2). The
hash writes 8 B a row id; its cost is the int64 remainders (no 64-bit divider: a software division each).
"""

from __future__ import annotations

import triton
import triton.language as tl

import flashkern
from flashkern.autotune.space import Space
from flashkern.kernels._triton import INTERPRETED, Launch, round_to_bf16
from flashkern.kernels._triton.codecs import bf16_to_f32, e4m3_decode, ue8m0_decode
from flashkern.kernels.tiles import SMS, cdiv, next_power_of_2
from flashkern.reference.engram import DOT_FLOOR, ROW_VALUES, SCALE_BLOCK

VALUES = tl.constexpr(ROW_VALUES)
GROUP = tl.constexpr(SCALE_BLOCK)
SCALES = tl.constexpr(ROW_VALUES // SCALE_BLOCK)
FLOOR = tl.constexpr(DOT_FLOOR)


@triton.jit
def to_bf16(x):
    """fp32 x rounded to the nearest bf16 (ties to even), as bf16: the GPU's conversion; under the interpreter,
    whose cast truncates and mangles subnormals, round_to_bf16's top half (a NaN as 0x7FC0)."""
    if INTERPRETED:
        bits = (round_to_bf16(x).to(tl.uint32, bitcast=True) >> 16).to(tl.uint16)
        return tl.where(x == x, bits, 0x7FC0).to(tl.bfloat16, bitcast=True)
    return x.to(tl.bfloat16, fp_downcast_rounding="rtne")


# ---------------------------------------------------------------- hash


@triton.jit
def compressed_ids(ids, ok, map_ptr, vocab, pad_id):
    """token_map[ids] (int64) where ok and 0 <= ids < vocab, else pad_id; reads nothing elsewhere."""
    inside = ok & (ids >= 0) & (ids < vocab)
    return tl.where(inside, tl.load(map_ptr + tl.where(inside, ids, 0), mask=inside, other=0), pad_id)


@triton.jit(do_not_specialize=["tokens", "sequences"])  # per-call sizes: one compile whatever the batch
def engram_hash_kernel(token_ptr, seq_ptr, map_ptr, mult_ptr, prime_ptr, offset_ptr, history_ptr, out_ptr, tokens,
                       vocab, sequences, pad_id, NGRAM: tl.constexpr, HEADS: tl.constexpr,
                       COLUMNS_PAD: tl.constexpr, HAS_HISTORY: tl.constexpr, BLOCK_T: tl.constexpr):
    """Row ids [BLOCK_T, (NGRAM - 1) HEADS] of tokens [BLOCK_T program_id(0), +BLOCK_T)."""
    LOOKBACK: tl.constexpr = NGRAM - 1
    COLUMNS: tl.constexpr = LOOKBACK * HEADS
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < tokens
    seq = tl.load(seq_ptr + t, mask=t_ok, other=0).to(tl.int64)
    own = tl.load(token_ptr + t, mask=t_ok, other=0).to(tl.int64)
    h = compressed_ids(own, t_ok, map_ptr, vocab, pad_id) * tl.load(mult_ptr)
    if HAS_HISTORY:
        known = t_ok & (seq >= 0) & (seq < sequences)
        history_row = history_ptr + tl.where(known, seq, 0) * LOOKBACK
    c = tl.arange(0, COLUMNS_PAD)
    c_ok = c < COLUMNS
    by_column = tl.zeros((BLOCK_T, COLUMNS_PAD), tl.int64)  # h of each column's order
    same = t_ok  # the k-th token before t is in t's run
    depth = tl.zeros((BLOCK_T,), tl.int64)  # tokens before t in its run, counted up to k - 1
    for k in tl.static_range(1, NGRAM):
        same = same & (t >= k)
        earlier = tl.where(same, t - k, 0)
        same = same & (tl.load(seq_ptr + earlier, mask=same, other=0).to(tl.int64) == seq)
        ids = tl.load(token_ptr + earlier, mask=same, other=0).to(tl.int64)
        ok = same
        if HAS_HISTORY:  # before the run: history column LOOKBACK - k + depth (the (k - depth)-th id before it)
            before = known & ~same
            kept = tl.load(history_row + (LOOKBACK - k) + depth, mask=before, other=0)
            ids = tl.where(same, ids, kept)
            ok = same | before
        depth += same.to(tl.int64)
        h = h ^ (compressed_ids(ids, ok, map_ptr, vocab, pad_id) * tl.load(mult_ptr + k))
        by_column = tl.where((c // HEADS == k - 1)[None, :], h[:, None], by_column)
    primes = tl.load(prime_ptr + c, mask=c_ok, other=1)
    offsets = tl.load(offset_ptr + c, mask=c_ok, other=0)
    remainder = by_column % primes[None, :]  # h >= 0 unless a map entry breaks the multipliers' bound (checked mode)
    remainder = tl.where(remainder < 0, remainder + primes[None, :], remainder)  # then torch.remainder's, as numpy's
    rows = remainder + offsets[None, :]
    tl.store(out_ptr + t[:, None] * COLUMNS + c[None, :], rows, mask=t_ok[:, None] & c_ok[None, :])


# ---------------------------------------------------------------- lookup


@triton.jit(do_not_specialize=["count", "table_rows"])  # per-call sizes: one compile whatever the batch
def engram_lookup_kernel(table_ptr, stride_table, rows_ptr, out_ptr, count, table_rows, ALIGN: tl.constexpr,
                         BLOCK_ROWS: tl.constexpr):
    """bf16 rows [count, 256] of the table rows rows_ptr[0 .. count): tiles program_id(0), + num_programs(0), ...
    ALIGN divides the table's address and row stride (its rows' byte offsets are multiples of it)."""
    tiles = tl.cdiv(count, BLOCK_ROWS)
    value = tl.arange(0, VALUES)
    scale = tl.arange(0, SCALES)
    for tile in range(tl.program_id(0), tiles, tl.num_programs(0)):
        i = tl.cast(tile, tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        i_ok = i < count
        row = tl.load(rows_ptr + i, mask=i_ok, other=-1).to(tl.int64)
        row_ok = (row >= 0) & (row < table_rows)
        base = table_ptr + tl.multiple_of(tl.where(row_ok, row, 0) * stride_table, ALIGN)[:, None]
        codes = tl.load(base + value[None, :], mask=row_ok[:, None], other=0)
        scales = ue8m0_decode(tl.load(base + VALUES + scale[None, :], mask=row_ok[:, None], other=0))
        values = tl.reshape(e4m3_decode(codes), (BLOCK_ROWS, SCALES, GROUP)) * scales[:, :, None]  # exact
        values = to_bf16(tl.reshape(values, (BLOCK_ROWS, VALUES)))  # (a row read as zeros decodes to 0)
        tl.store(out_ptr + i[:, None] * VALUES + value[None, :], values, mask=i_ok[:, None])


# ---------------------------------------------------------------- gate


@triton.jit
def engram_gate_kernel(h_ptr, k_ptr, v_ptr, q_w_ptr, k_w_ptr, out_ptr, D, eps, dot_scale, HC: tl.constexpr,
                       HC_PER_PROGRAM: tl.constexpr, HC_PAD: tl.constexpr, BLOCK_D: tl.constexpr):
    """out [HC_PER_PROGRAM, D] of program_id(0)'s token and streams (HC_PER_PROGRAM = HC: the token's streams; 1:
    one stream, the token's HC programs adjacent): the three sums over D, then the gated add (dot_scale = 1 /
    sqrt(D)). HC_PAD = next_power_of_2(HC_PER_PROGRAM)."""
    PROGRAMS: tl.constexpr = HC // HC_PER_PROGRAM  # a token's programs
    program = tl.program_id(0)
    t = (program // PROGRAMS).to(tl.int64)
    i = tl.arange(0, HC_PAD)[:, None]
    s_ok = i < HC_PER_PROGRAM
    stream = t * (HC * D) + ((program % PROGRAMS) * HC_PER_PROGRAM + i) * D
    hh = tl.zeros((HC_PAD,), tl.float32)
    kk = tl.zeros((HC_PAD,), tl.float32)
    hk = tl.zeros((HC_PAD,), tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)[None, :]
        ok = s_ok & (d < D)
        x = bf16_to_f32(tl.load(h_ptr + stream + d, mask=ok, other=0.0))
        y = bf16_to_f32(tl.load(k_ptr + stream + d, mask=ok, other=0.0))
        w = (bf16_to_f32(tl.load(q_w_ptr + d, mask=d < D, other=0.0))
             * bf16_to_f32(tl.load(k_w_ptr + d, mask=d < D, other=0.0)))
        hh += tl.sum(x * x, axis=1)
        kk += tl.sum(y * y, axis=1)
        hk += tl.sum(x * y * w, axis=1)
    dot = hk * tl.rsqrt(hh / D + eps) * tl.rsqrt(kk / D + eps) * dot_scale
    root = tl.sqrt(tl.maximum(tl.abs(dot), FLOOR))
    g = tl.sigmoid(tl.where(dot > 0, root, tl.where(dot < 0, -root, dot)))[:, None]  # sign(0) = 0; NaN stays
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)[None, :]
        ok = s_ok & (d < D)
        x = bf16_to_f32(tl.load(h_ptr + stream + d, mask=ok, other=0.0))
        v = bf16_to_f32(tl.load(v_ptr + t * D + d, mask=d < D, other=0.0))
        tl.store(out_ptr + stream + d, to_bf16(x + g * v), mask=ok)


# ---------------------------------------------------------------- plans


def plan_hash(problem, inputs: dict, config: dict, out) -> Launch:
    """Row ids int64 [T, orders x heads]: a program per block_tokens tokens."""
    history = inputs["history"]
    return Launch(engram_hash_kernel, grid=(cdiv(problem.tokens, config["block_tokens"]),),
                  args=dict(token_ptr=inputs["token_ids"], seq_ptr=inputs["seq_ids"], map_ptr=inputs["token_map"],
                            mult_ptr=inputs["multipliers"], prime_ptr=inputs["primes"],
                            offset_ptr=inputs["offsets"], history_ptr=history if problem.history else None,
                            out_ptr=out, tokens=problem.tokens, vocab=inputs["token_map"].shape[0],
                            sequences=history.shape[0] if problem.history else 0, pad_id=int(inputs["pad_id"]),
                            NGRAM=problem.max_ngram, HEADS=problem.heads,
                            COLUMNS_PAD=next_power_of_2(problem.columns), HAS_HISTORY=problem.history,
                            BLOCK_T=config["block_tokens"]),
                  num_warps=config["num_warps"])


def _alignment(table) -> int:
    """The largest power of two up to 16 dividing the table's address and row stride (metadata only)."""
    both = table.data_ptr() | table.stride(0) | 16
    return both & -both


def lookup_grid(problem, config: dict) -> int:
    """Programs of the lookup: a tile each (persistent 0), or at most SMs (1) or SMs / 2 (2) striding over them."""
    tiles = cdiv(problem.rows, config["block_rows"])
    return min(tiles, (tiles, SMS, SMS // 2)[config["persistent"]])


def plan_lookup(problem, inputs: dict, config: dict, out) -> Launch:
    """bf16 [T, L, 256]: block_rows rows a tile. The table may be pinned host memory (read through UVA by its
    pointer) while rows and out are on the GPU."""
    table = inputs["table"]
    return Launch(engram_lookup_kernel, grid=(lookup_grid(problem, config),),
                  args=dict(table_ptr=table, stride_table=table.stride(0), rows_ptr=inputs["rows"], out_ptr=out,
                            count=problem.rows, table_rows=table.shape[0], ALIGN=_alignment(table),
                            BLOCK_ROWS=config["block_rows"]),
                  num_warps=config["num_warps"])


def streams_per_program(problem, config: dict) -> int:
    """A gate program's streams: one (stream_programs 1) or the token's hc (0)."""
    return 1 if config["stream_programs"] else problem.streams


def plan_gate(problem, inputs: dict, config: dict, out) -> Launch:
    """bf16 [T, hc, D]: a program per token (stream_programs 0) or per (token, stream), a token's adjacent (1)."""
    per_program = streams_per_program(problem, config)
    return Launch(engram_gate_kernel, grid=(problem.tokens * (problem.streams // per_program),),
                  args=dict(h_ptr=inputs["h"], k_ptr=inputs["k"], v_ptr=inputs["v"], q_w_ptr=inputs["q_w"],
                            k_w_ptr=inputs["k_w"], out_ptr=out, D=problem.hidden, eps=float(inputs["eps"]),
                            dot_scale=problem.hidden ** -0.5, HC=problem.streams, HC_PER_PROGRAM=per_program,
                            HC_PAD=next_power_of_2(per_program), BLOCK_D=config["block_d"]),
                  num_warps=config["num_warps"])


# ---------------------------------------------------------------- spaces and defaults
# Register model, measured with ptxas (sm_90a, Triton 3.9). Hash: the [block_tokens, columns] int64 tile; 32 values
# per thread take 124-134 registers at 24 columns and 246 at 448 (8 orders x 64 heads), no spill. Lookup: the
# [block_rows, 256] tile; 64 values per thread take 72 registers, 32 take 45. Gate: the [streams a program,
# block_d] tiles of h and k; 64 values per thread take 122-165 registers up to 8 streams and 255 at 16, 32 take
# 54-128 (one stream: 96, and 56 at 16 values); 16 streams on 8 warps spilled 16 B (at 32 and 64 values per
# thread), no other build spilled.
WARPS = (1, 2, 4, 8)


def _hash_values_per_thread(problem, config) -> int:
    return config["block_tokens"] * next_power_of_2(problem.columns) // (32 * config["num_warps"])


HASH_SPACE = Space(
    params={"block_tokens": tuple(2**e for e in range(11)), "num_warps": WARPS},
    gpu_only=("num_warps",),
    constraints={"block_tokens < 2 x tokens (more would repeat a smaller config)":
                 lambda p, c: c["block_tokens"] == 1 or c["block_tokens"] < 2 * p.tokens},
    limits={"block_tokens x columns / threads <= 32 (registers: int64 values)":
            lambda p, c: _hash_values_per_thread(p, c) <= 32},
)


def hash_default(problem) -> dict:
    """GPU: 4 warps, 128 tokens a program, fewer while that leaves under 2 programs per SM (down to 16) or breaks
    the register limit (many heads). Interpreter (each tl op costs about the same whatever its size): up to 1024
    tokens a program."""
    tokens = next_power_of_2(max(1, problem.tokens))
    if flashkern.triton_interpreted():
        return {"block_tokens": min(1024, tokens), "num_warps": 4}
    config = {"block_tokens": min(128, tokens), "num_warps": 4}
    while config["block_tokens"] > 1 and (HASH_SPACE.violations(problem, config) or (
            config["block_tokens"] > 16 and cdiv(problem.tokens, config["block_tokens"]) < 2 * SMS)):
        config["block_tokens"] //= 2
    return config


LOOKUP_SPACE = Space(
    params={"block_rows": tuple(2**e for e in range(7)), "num_warps": WARPS, "persistent": (0, 1, 2)},
    gpu_only=("num_warps",),
    constraints={"block_rows < 2 x rows (more would repeat a smaller config)":
                 lambda p, c: c["block_rows"] == 1 or c["block_rows"] < 2 * p.rows},
    limits={"block_rows x 256 / threads <= 64 (registers)":
            lambda p, c: c["block_rows"] * ROW_VALUES // (32 * c["num_warps"]) <= 64},
)


def lookup_default(problem) -> dict:
    """GPU, a table in HBM: 8 rows a tile on 4 warps, a program each (resident programs hide the loads' latency: the
    model gives 20.7 us at 4096 tokens, HBM-bound, against 23.7 us for one persistent program per SM, whose tiles
    run one after another). A host table: 16 rows a tile, a persistent grid of one program per SM (vLLM's UVA
    gather). Interpreter: up to 64 rows a tile, a program each."""
    rows = next_power_of_2(max(1, problem.rows))
    if flashkern.triton_interpreted():
        return {"block_rows": min(64, rows), "num_warps": 4, "persistent": 0}
    if problem.host:
        return {"block_rows": min(16, rows), "num_warps": 4, "persistent": 1}
    return {"block_rows": min(8, rows), "num_warps": 4, "persistent": 0}


def _gate_values_per_thread(problem, config) -> int:
    return next_power_of_2(streams_per_program(problem, config)) * config["block_d"] // (32 * config["num_warps"])


GATE_SPACE = Space(
    params={"block_d": tuple(2**e for e in range(8, 14)), "num_warps": WARPS, "stream_programs": (0, 1)},
    gpu_only=("num_warps",),
    constraints={"block_d < 2 x D unless 256 (more would repeat a smaller config)":
                 lambda p, c: c["block_d"] == 256 or c["block_d"] < 2 * p.hidden,
                 "stream_programs 0 at one stream (1 would repeat it)":
                 lambda p, c: c["stream_programs"] == 0 or p.streams > 1},
    limits={"streams a program x block_d / threads <= 64 (registers)":
                lambda p, c: _gate_values_per_thread(p, c) <= 64,
            "streams a program <= 8 on 8 warps (16 streams spilled 16 B at 32 and 64 values per thread)":
                lambda p, c: c["num_warps"] < 8 or streams_per_program(p, c) <= 8},
)


def gate_default(problem) -> dict:
    """GPU, few tokens (under 3/4 of the SMs, or under the SMs from 8 streams on): a program per (token, stream),
    chunks of up to 4096 columns on 4 warps (32 values per thread), 2048 once the programs outnumber 4 per SM (5
    fit an SM at 96 registers, 9 at 56: fewer waves). The model (H200, D = 5120, 4 streams): 1.5 us at T = 1
    against 5.3 us for a program per token, 2.8 us against 4.6 at T = 64; token programs win from about 110
    tokens on (at 4 streams: they fill the SMs by then and request 1.5x fewer L2 bytes, the weights and v read once
    a token). Otherwise a program per token: chunks of 2048 columns, narrower from 4 streams on (hc x block_d =
    4096: 32 values per thread, 256 columns at 16 streams), no wider than D needs. Interpreter: a program per
    token, D in one chunk (up to 8192)."""
    width = max(256, min(8192, next_power_of_2(problem.hidden)))
    if flashkern.triton_interpreted():
        return {"block_d": width, "num_warps": 4, "stream_programs": 0}
    if problem.tokens < (SMS if problem.streams >= 8 else 3 * SMS // 4):  # a stream a program (one stream: 0)
        block_d = 4096 if problem.tokens * problem.streams <= 4 * SMS else 2048
        return {"block_d": min(width, block_d), "num_warps": 4, "stream_programs": int(problem.streams > 1)}
    return {"block_d": min(width, max(256, min(2048, 4096 // next_power_of_2(problem.streams)))), "num_warps": 4,
            "stream_programs": 0}
