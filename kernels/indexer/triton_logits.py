"""Indexer scoring in Triton: dense, paged and sparse MQA logits from one kernel source.

    logits[m, n] = sum_h w[m, h] * relu(q[m, h] . k[n]) * k_scale[n]       (fp8; k_scale per key)
                 = sum_h w[m, h] * relu(q[m, h] . k[n])                    (mxfp4, on dequantized q, k)
    and -inf outside the positions row m may see.

Tile plan: a program owns ROWS query rows that see the same keys (BLOCK_M rows of the dense
form, block_rows of the next_n tokens of one sequence in the paged form, one row in the sparse form) and a
span of TILES x BLOCK_N output columns. Its q tile [ROWS x H, D] (heads padded to H_PAD) stays
put while it walks the span one key tile at a time:
  1. column -> key position (dense and paged: the column itself; sparse: candidate block
     blocks[m, c // block] and slot c % block) and the rows that may see it ([ks, ke) per row;
     paged: [0, context_lens[b] - next_n + j + 1), or [0, context_lens[b, j]) for 2-D lengths);
  2. a tile no row may see is stored as -inf and nothing else is read;
  3. otherwise key storage rows (paged: through the block table, read only where seen; an entry outside
     [0, cache blocks) reads nothing and its positions are -inf), then
     S = K Q^T [BLOCK_N, ROWS x H] in fp32: one fp8 dot over D, or for MXFP4 one dot per 32
     values of D on e2m1 codes decoded to e4m3 in registers (exact), each scaled by its two
     ue8m0 block scales (a power of two: exact; 0xFF is NaN) and summed in chunk order;
  4. relu (NaN kept), times w, summed over heads -> [BLOCK_N, ROWS], times k_scale (fp8), -inf
     masked, stored as fp32 or rounded to nearest-even bf16;
  5. sparse form: no logits are stored. The span's scores stay in registers as order keys; a radix
     select there keeps its best top_k (the top-k rule) in candidate order, with their positions (a span
     of at most top_k slots keeps them all in place), and the row's kept end goes up by an atomic max;
     the top-k stage then merges the row's kept columns (the row's top_k are among them). Tiles past a
     span's last listed candidate are not scored, so the work follows the listed candidates.
Index values are never trusted: any int32 in ks, ke, context lengths, block tables or candidate lists addresses
nothing outside its tensor (keys are read only at columns in [0, width), through table entries and candidate ids
checked against the cache's blocks and the key count), and what it points at scores -inf (reference/indexer.py).
Every input is addressed through its strides (all but the last dimension, which is unit-stride):
q, q_scale and w per row and head, keys and their scales per position or per (cache block, slot),
block tables and candidate lists per row; context lengths, ks and ke are contiguous.
The keys of a tile are the MMA's M side, so one query row's heads (32 or 64) suffice for its
N side. Every sum has a fixed order: repeated runs are bitwise identical. (sm_90's fp8 MMAs
add inside one dot at less than fp32 precision, as DeepGEMM's do; the upstream similarity
tolerances allow it.) Addresses that can pass 2^31 (key rows x D, rows x columns) are int64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

import flashkern
from flashkern.autotune.space import Space
from flashkern.kernels._triton import Launch, round_to_bf16
from flashkern.kernels._triton.codecs import ue8m0_decode
from flashkern.kernels.indexer.problem import kept_per_span, kept_width, span_slots
from flashkern.kernels.indexer.triton_topk import NAN_KEY, NEG_INF_KEY, flip_negative, order_key, select_in_registers
from flashkern.kernels.tiles import SMS, cdiv, next_power_of_2

DENSE, PAGED, SPARSE = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)  # addressing modes
MX_BLOCK = tl.constexpr(32)  # MXFP4 values per ue8m0 scale
E2M1_AS_E4M3_CORRECTION = tl.constexpr(4096.0)  # 2^6 x 2^6: e2m1 codes read as e4m3 are 2^-6 of their values


@triton.jit
def _mxfp4_chunk(packed_ptr, data_row, scale_ptr, scale_row, rows_ok, chunk):
    """Block `chunk` (values chunk*32 .. chunk*32+31) of MXFP4 rows [R] (int64 offsets of each row's first byte in
    packed / scale): the e2m1 values times 2^-6 as e4m3 [R, 32] and the block scale 2^(e - 127) as fp32 [R], all
    exact (e = 0: 2^-127; e = 0xFF: NaN, as OCP MX).

    An e2m1 code s|ee|m (even element in the low nibble) placed at bits 7 and 4..2 of a byte reads as the e4m3
    value 2^-6 times its own: exponent ee with e4m3's bias 7 instead of e2m1's 1, subnormals included.
    """
    element = tl.arange(0, MX_BLOCK)[None, :]
    byte = tl.load(packed_ptr + data_row[:, None] + chunk * (MX_BLOCK // 2) + element // 2,
                   mask=rows_ok[:, None], other=0)
    code = byte >> ((element % 2) * 4).to(tl.uint8)  # bits 3..0: this element's code
    values = (((code << 2) & 0x1C) | ((code << 4) & 0x80)).to(tl.float8e4nv, bitcast=True)
    return values, ue8m0_decode(tl.load(scale_ptr + scale_row + chunk, mask=rows_ok, other=127))


@triton.jit
def _key_positions(col, group, keys, width, blocks_ptr, stride_table, MODE: tl.constexpr, BLOCK: tl.constexpr):
    """Absolute key position of each output column and whether that key exists (sparse: a candidate block id outside
    [0, ceil(keys / BLOCK)), -1 included, has none)."""
    if MODE == SPARSE:
        block_id = tl.load(blocks_ptr + group.to(tl.int64) * stride_table + col // BLOCK, mask=col < width, other=-1)
        listed = (block_id >= 0) & (block_id < tl.cdiv(keys, BLOCK))
        position = tl.where(listed, block_id, 0) * BLOCK + col % BLOCK  # no overflow from a garbage id
        exists = listed & (position < keys)
    else:
        position = col
        exists = col < width
    return position, exists


@triton.jit
def _key_rows(position, needed, group, keys, table_ptr, stride_table, stride_k_page, stride_k_slot, stride_ks_page,
              stride_ks_slot, MODE: tl.constexpr, BLOCK: tl.constexpr):
    """int64 offsets of each needed key's data and scales, and which needed keys are found: slot p % BLOCK of cache
    block table[b, p // BLOCK] when that entry is in [0, keys) (paged; `keys` = cache blocks; another entry finds
    nothing and addresses block 0), or row p of a flat key table (always found)."""
    if MODE == PAGED:
        page = tl.load(table_ptr + group.to(tl.int64) * stride_table + position // BLOCK, mask=needed, other=-1)
        found = needed & (page >= 0) & (page < keys)
        page = tl.where(found, page, 0).to(tl.int64)
        slot = position % BLOCK
        return page * stride_k_page + slot * stride_k_slot, page * stride_ks_page + slot * stride_ks_slot, found
    position = position.to(tl.int64)
    return position * stride_k_page, position * stride_ks_page, needed


@triton.jit
def _head_dots(q_tile, q_ptr, q_scale_ptr, q_row, qs_row, q_ok, k_ptr, k_scale_ptr, k_row, ks_row, needed,
               FP4: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """S = K Q^T: fp32 [BLOCK_N, ROWS x H_PAD] dot products of the tile's keys with every (row, head) of q.
    q_row, qs_row, k_row, ks_row: int64 offsets of each (row, head)'s / key's data and scales."""
    if FP4:
        S = tl.zeros((k_row.shape[0], q_row.shape[0]), tl.float32)
        for chunk in range(D // MX_BLOCK):
            k, k_scale = _mxfp4_chunk(k_ptr, k_row, k_scale_ptr, ks_row, needed, chunk)
            q, q_scale = _mxfp4_chunk(q_ptr, q_row, q_scale_ptr, qs_row, q_ok, chunk)
            S += tl.dot(k, tl.trans(q)) * (k_scale[:, None] * q_scale[None, :])  # scales first: exact, no underflow
        S = S * E2M1_AS_E4M3_CORRECTION
    else:
        d = tl.arange(0, BLOCK_D)[None, :]
        k = tl.load(k_ptr + k_row[:, None] + d, mask=needed[:, None] & (d < D), other=0.0)
        S = tl.dot(k, tl.trans(q_tile))
    return S


@triton.jit(do_not_specialize=["rows", "keys"])  # per-step sizes: one compile whatever the batch
def indexer_logits_kernel(
    q_ptr, q_scale_ptr, w_ptr, k_ptr, k_scale_ptr, out_ptr,
    ks_ptr, ke_ptr,  # dense and sparse: each row's visible positions [ks, ke)
    table_ptr, context_ptr,  # paged: block table [B, *], context lengths [B] or [B, next_n]
    blocks_ptr,  # sparse: candidate blocks [M, *]
    positions_ptr, kept_end_ptr,  # sparse: kept candidates' positions [M, spans x KEEP] (out_ptr: their scores);
    # the end of each row's kept columns [M] (zeroed by the caller): the kept slots of its last span with candidates
    rows, keys, width,  # keys: key rows of a flat table (dense, sparse), cache blocks (paged)
    # element strides: q and q_scale per program group, row within it and head; w per row and head; keys and
    # their scales per page (flat key tables: per position) and slot; block table / candidate blocks per row
    stride_q_group, stride_q_row, stride_q_head, stride_qs_group, stride_qs_row, stride_qs_head,
    stride_w_row, stride_w_head, stride_k_page, stride_k_slot, stride_ks_page, stride_ks_slot, stride_table,
    H: tl.constexpr, H_PAD: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, FP4: tl.constexpr,
    MODE: tl.constexpr, ROWS: tl.constexpr, ROWS_PAD: tl.constexpr, GROUP_ROWS: tl.constexpr, BLOCK: tl.constexpr,
    LENS_2D: tl.constexpr, BF16: tl.constexpr, BLOCK_N: tl.constexpr, TILES: tl.constexpr, KEEP: tl.constexpr,
    KEEP_PAD: tl.constexpr,
):
    # a program owns ROWS rows of a group of GROUP_ROWS (dense: block_m rows, ROWS = GROUP_ROWS; paged: the next_n
    # tokens of sequence `group`, ROWS of them per program; sparse: row `group`)
    CHUNKS: tl.constexpr = (GROUP_ROWS + ROWS - 1) // ROWS
    group = tl.program_id(0) // CHUNKS
    group_first = group * GROUP_ROWS
    first = group_first + (tl.program_id(0) % CHUNKS) * ROWS
    end = tl.minimum(tl.minimum(first + ROWS, group_first + GROUP_ROWS), rows)
    # the program's query rows and the positions each sees: lo <= position < hi
    row = first + tl.arange(0, ROWS_PAD)
    row_ok = row < end
    # (any int32 bound: positions are columns in [0, width), so only the order of lo and hi matters; paged ends are
    # computed in int64 and clamped to [0, width], so that a length near the int32 limits does not wrap)
    if MODE == PAGED:
        lo = tl.zeros((ROWS_PAD,), tl.int32)
        if LENS_2D:  # [B, next_n]: row b * next_n + j sees [0, context_lens[b, j])
            hi = tl.load(context_ptr + row, mask=row_ok, other=0)
        else:  # [B]: token j sees [0, context_lens[b] - next_n + j + 1)
            token_end = tl.load(context_ptr + group).to(tl.int64) - GROUP_ROWS + 1 + (row - group_first)
            hi = tl.where(row_ok, tl.minimum(tl.maximum(token_end, 0), width).to(tl.int32), 0)
    else:
        lo = tl.load(ks_ptr + row, mask=row_ok, other=0)
        hi = tl.load(ke_ptr + row, mask=row_ok, other=0)
    nonempty = lo < hi  # false for missing rows (lo = hi = 0)
    lo_min = tl.min(tl.where(nonempty, lo, 2**31 - 1), axis=0)
    hi_max = tl.max(tl.where(nonempty, hi, 0), axis=0)
    # q and w of every (row, head) slot, slot = r * H_PAD + h
    slot = tl.arange(0, ROWS_PAD * H_PAD)
    slot_row, slot_head = slot // H_PAD, slot % H_PAD
    q_ok = (first + slot_row < end) & (slot_head < H)
    group_row = (first - group_first) + slot_row  # the slot's row within its group
    group_64 = group.to(tl.int64)
    q_row = group_64 * stride_q_group + group_row * stride_q_row + slot_head * stride_q_head
    qs_row = group_64 * stride_qs_group + group_row * stride_qs_row + slot_head * stride_qs_head
    q_tile = None
    if not FP4:
        d = tl.arange(0, BLOCK_D)[None, :]
        q_tile = tl.load(q_ptr + q_row[:, None] + d, mask=q_ok[:, None] & (d < D), other=0.0)
    head = tl.arange(0, H_PAD)[None, :]
    w = tl.load(w_ptr + row.to(tl.int64)[:, None] * stride_w_row + head * stride_w_head,
                mask=row_ok[:, None] & (head < H), other=0.0)

    out_rows = out_ptr + row.to(tl.int64)[None, :] * width
    span = tl.program_id(1) * (TILES * BLOCK_N)
    span_end = tl.minimum(span + TILES * BLOCK_N, width)
    # The tiles no row may see ([span, seen_start) and [seen_end, span_end): columns outside [lo_min, hi_max) are
    # positions outside it, except in the sparse form) are -inf and read nothing; the loop over the others has no
    # data-dependent branch, so that its key loads pipeline (cp.async), masks doing the rest. The paged form keeps
    # a skip of the tiles no row sees: pipelined, its programs take more registers (127 -> 159 at 2 rows) and
    # shared memory (41 -> 73 KB) and fit one an SM instead of two (the model: 2.5 -> 4.9 us at decode).
    if MODE == SPARSE:  # the tiles between the span's first and last listed candidate (lists are -1 padded)
        seen_start, seen_end = _listed_tiles(span, span_end, group, keys, width, blocks_ptr, stride_table, BLOCK,
                                             BLOCK_N, TILES)
        span_keys = tl.full((TILES, BLOCK_N), NAN_KEY, tl.int32)  # order keys of the span's scores (NaN: none)
    else:
        lo_seen = tl.minimum(tl.maximum(lo_min, span), span_end)  # clamped first: ks, ke may be any int32
        hi_seen = tl.minimum(tl.maximum(hi_max, lo_seen), span_end)
        seen_start = span + (lo_seen - span) // BLOCK_N * BLOCK_N
        seen_end = tl.minimum(span + tl.cdiv(hi_seen - span, BLOCK_N) * BLOCK_N, span_end)
    if MODE != SPARSE:
        for tile_start in range(span, seen_start, BLOCK_N):
            _store_logits(out_rows, tile_start, row_ok, width,
                          tl.full((BLOCK_N, ROWS_PAD), float("-inf"), tl.float32), BF16)
    for tile_start in range(seen_start, seen_end, BLOCK_N):
        col = tile_start + tl.arange(0, BLOCK_N)
        position, exists = _key_positions(col, group, keys, width, blocks_ptr, stride_table, MODE, BLOCK)
        needed = exists & (position >= lo_min) & (position < hi_max)  # what some row sees (and gaps between rows)
        logits = tl.full((BLOCK_N, ROWS_PAD), float("-inf"), tl.float32)
        if MODE != PAGED or tl.max(needed.to(tl.int32), axis=0) > 0:  # (a branch in the paged form only)
            k_row, ks_row, needed = _key_rows(position, needed, group, keys, table_ptr, stride_table, stride_k_page,
                                              stride_k_slot, stride_ks_page, stride_ks_slot, MODE, BLOCK)
            S = _head_dots(q_tile, q_ptr, q_scale_ptr, q_row, qs_row, q_ok, k_ptr, k_scale_ptr, k_row, ks_row,
                           needed, FP4, D, BLOCK_D)
            relu = tl.maximum(S, 0.0, propagate_nan=tl.PropagateNan.ALL)  # NaN kept (a 0xFF scale): max.NaN.f32
            heads = tl.reshape(relu, (BLOCK_N, ROWS_PAD, H_PAD)) * w[None, :, :]
            scores = tl.sum(heads, axis=2)
            if not FP4:
                scores = scores * tl.load(k_scale_ptr + ks_row, mask=needed, other=0.0)[:, None]
            p = position[:, None]
            visible = needed[:, None] & (p >= lo[None, :]) & (p < hi[None, :])  # [BLOCK_N, ROWS_PAD]
            logits = tl.where(visible, scores, float("-inf"))
        if MODE == SPARSE:  # kept in registers: the span is selected from them
            tile = tl.arange(0, TILES)[:, None] == (tile_start - span) // BLOCK_N
            span_keys = tl.where(tile, order_key(tl.reshape(logits, (1, BLOCK_N)), NAN_KEY), span_keys)
        else:
            _store_logits(out_rows, tile_start, row_ok, width, logits, BF16)
    if MODE == SPARSE:
        _keep_best(span_keys, span, group, keys, width, blocks_ptr, stride_table, out_ptr, positions_ptr, BLOCK,
                   KEEP, KEEP_PAD)
        tl.atomic_max(kept_end_ptr + group, (tl.program_id(1) + 1) * KEEP, mask=seen_start < seen_end)
    else:
        for tile_start in range(seen_end, span_end, BLOCK_N):
            _store_logits(out_rows, tile_start, row_ok, width,
                          tl.full((BLOCK_N, ROWS_PAD), float("-inf"), tl.float32), BF16)


@triton.jit
def _listed_tiles(span, span_end, group, keys, width, blocks_ptr, stride_table, BLOCK: tl.constexpr,
                  BLOCK_N: tl.constexpr, TILES: tl.constexpr):
    """[seen_start, seen_end): the span's key tiles from the first to the last holding a listed candidate."""
    col = span + tl.arange(0, TILES * BLOCK_N)
    _, exists = _key_positions(col, group, keys, width, blocks_ptr, stride_table, SPARSE, BLOCK)
    first = tl.min(tl.where(exists, col, span_end), axis=0)
    last = tl.max(tl.where(exists, col + 1, span), axis=0)
    seen_start = span + (first - span) // BLOCK_N * BLOCK_N
    return seen_start, tl.minimum(span + tl.cdiv(last - span, BLOCK_N) * BLOCK_N, span_end)


@triton.jit
def _keep_best(span_keys, span, group, keys, width, blocks_ptr, stride_table, scores_ptr, positions_ptr,
               BLOCK: tl.constexpr, KEEP: tl.constexpr, KEEP_PAD: tl.constexpr):
    """The span's KEEP best candidates by the top-k rule (-inf and NaN not eligible), in candidate order, into its
    KEEP slots of the row's kept columns: scores (then -inf) and absolute positions; the row's top-k is among them.
    A span that keeps all its slots stores every score in place (NaN keys as NaN: not eligible in the merge)."""
    key = tl.reshape(span_keys, (span_keys.shape[0] * span_keys.shape[1],))  # tile-major: candidate order
    base = group.to(tl.int64) * (tl.num_programs(1) * KEEP) + tl.program_id(1) * KEEP
    if KEEP < key.shape[0]:
        take = select_in_registers(key, key > NEG_INF_KEY, KEEP)  # -inf and NaN are not eligible
        slot = tl.cumsum(take.to(tl.int32), 0) - 1
        position, _ = _key_positions(span + tl.arange(0, key.shape[0]), group, keys, width, blocks_ptr,
                                     stride_table, SPARSE, BLOCK)
        tl.store(scores_ptr + base + slot, flip_negative(key).to(tl.float32, bitcast=True), mask=take)
        tl.store(positions_ptr + base + slot, position, mask=take)
        pad = tl.arange(0, KEEP_PAD)
        tl.store(scores_ptr + base + pad, float("-inf"), mask=(pad >= tl.sum(take.to(tl.int32), axis=0)) & (pad < KEEP))
    else:  # the span keeps every slot in place (column = slot; the merge maps it through the candidate blocks)
        tl.store(scores_ptr + base + tl.arange(0, key.shape[0]), flip_negative(key).to(tl.float32, bitcast=True))


@triton.jit
def _store_logits(out_rows, tile_start, row_ok, width, logits, BF16: tl.constexpr):
    """logits [BLOCK_N, ROWS_PAD] into the tile's columns of the program's rows (out_rows [1, ROWS_PAD] pointers)."""
    col = tile_start + tl.arange(0, logits.shape[0])
    if BF16:
        logits = round_to_bf16(logits)  # the interpreter's cast truncates; rounded first, it is exact
    tl.store(out_rows + col[:, None], logits.to(out_rows.dtype.element_ty),
             mask=(col < width)[:, None] & row_ok[None, :])


# ---------------------------------------------------------------- plans


def _indexer_constexprs(indexer, rows: int, mode: int, block: int, config: dict, lens_2d: bool = False,
                        bf16: bool = False, group_rows: int | None = None, keep: int = 0) -> dict:
    """Shape constants of one specialization (programs of `rows` rows of groups of group_rows, default rows; sparse:
    `keep` candidates kept per span); heads padded so that a dot's N side is >= 16."""
    rows_pad = next_power_of_2(rows)
    return dict(H=indexer.heads, H_PAD=_heads_pad(indexer, rows),
                D=indexer.dim, BLOCK_D=max(32, next_power_of_2(indexer.dim)), FP4=indexer.fmt == "mxfp4",
                MODE=mode, ROWS=rows, ROWS_PAD=rows_pad, GROUP_ROWS=group_rows or rows, BLOCK=block,
                LENS_2D=lens_2d, BF16=bf16, BLOCK_N=config["block_n"], TILES=config["tiles"], KEEP=keep,
                KEEP_PAD=next_power_of_2(max(keep, 1)))


def _query_strides(inputs: dict, rows_per_group: int) -> dict:
    """(group, row, head) strides of q and q_scale: [M, H, ...] in groups of rows_per_group rows, or
    [B, next_n, H, ...] with a group per sequence; and w's (row, head) strides."""
    def strides(x):
        if x is None:
            return 0, 0, 0
        if x.dim() == 4:
            return x.stride(0), x.stride(1), x.stride(2)
        return rows_per_group * x.stride(0), x.stride(0), x.stride(1)

    (q_group, q_row, q_head), (qs_group, qs_row, qs_head) = strides(inputs["q"]), strides(inputs["q_scale"])
    return dict(stride_q_group=q_group, stride_q_row=q_row, stride_q_head=q_head, stride_qs_group=qs_group,
                stride_qs_row=qs_row, stride_qs_head=qs_head, stride_w_row=inputs["w"].stride(0),
                stride_w_head=inputs["w"].stride(1))


def _key_strides(k: torch.Tensor, k_scale: torch.Tensor) -> dict:
    """(page, slot) strides of the keys and their scales: a flat key table [N, ...] (per position; no slot) or a
    paged cache [blocks, block_size, ...]."""
    paged = k.dim() == 3
    return dict(stride_k_page=k.stride(0), stride_k_slot=k.stride(1) if paged else 0,
                stride_ks_page=k_scale.stride(0), stride_ks_slot=k_scale.stride(1) if paged else 0)


def _launch(groups: int, width: int, config: dict, args: dict) -> Launch:
    span = config["block_n"] * config["tiles"]
    return Launch(indexer_logits_kernel, grid=(groups, cdiv(width, span)), args=args,
                  num_warps=config["num_warps"])


def _unused_addressing() -> dict:
    return dict(ks_ptr=None, ke_ptr=None, table_ptr=None, context_ptr=None, blocks_ptr=None, positions_ptr=None,
                kept_end_ptr=None, stride_table=0)


def plan_mqa_logits(problem, inputs: dict, config: dict, out: torch.Tensor):
    """Dense logits into out [M, N]: programs of block_m rows x a span of key tiles."""
    m, n = problem.rows, problem.keys
    args = dict(_unused_addressing(), q_ptr=inputs["q"], q_scale_ptr=inputs["q_scale"], w_ptr=inputs["w"],
                k_ptr=inputs["k"], k_scale_ptr=inputs["k_scale"], out_ptr=out, ks_ptr=inputs["ks"],
                ke_ptr=inputs["ke"], rows=m, keys=n, width=n, **_query_strides(inputs, config["block_m"]),
                **_key_strides(inputs["k"], inputs["k_scale"]),
                **_indexer_constexprs(problem.indexer, config["block_m"], DENSE.value, 1, config,
                                      bf16=problem.bf16_logits))
    return _launch(cdiv(m, config["block_m"]), n, config, args)


def plan_paged_mqa_logits(problem, inputs: dict, config: dict, out: torch.Tensor):
    """Decode logits into out [B * next_n, max_blocks * block_size]: a program per block_rows tokens of a sequence x
    a span of positions."""
    rows, width = problem.batch * problem.next_n, problem.width
    args = dict(_unused_addressing(), q_ptr=inputs["q"], q_scale_ptr=inputs["q_scale"], w_ptr=inputs["w"],
                k_ptr=inputs["k_cache"], k_scale_ptr=inputs["k_scale"], out_ptr=out,
                table_ptr=inputs["block_table"], context_ptr=inputs["context_lens"],
                stride_table=inputs["block_table"].stride(0), rows=rows, keys=inputs["k_cache"].shape[0], width=width,
                **_query_strides(inputs, problem.next_n), **_key_strides(inputs["k_cache"], inputs["k_scale"]),
                **_indexer_constexprs(problem.indexer, paged_rows(problem, config), PAGED.value, problem.block_size,
                                      config, lens_2d=problem.lens_2d, bf16=problem.bf16_logits,
                                      group_rows=problem.next_n))
    programs = problem.batch * cdiv(problem.next_n, paged_rows(problem, config))
    return _launch(programs, width, config, args)


def plan_sparse_select(problem, inputs: dict, config: dict):
    """Per row and span of candidate slots, the span's best kept_per_span candidates: (launch, scores, positions,
    kept_end): scores and positions [M, spans x kept] in candidate order, scores -inf past each span's kept ones
    (columns past kept_end [M] are not written: the merge reads a row up to its end)."""
    m, width = problem.rows, problem.candidates
    keep = kept_per_span(problem, config)
    scores = torch.empty(m, kept_width(problem, config), dtype=torch.float32, device=inputs["q"].device)
    positions = (torch.empty(scores.shape, dtype=torch.int32, device=inputs["q"].device) if keep < span_slots(config)
                 else None)  # spans that keep every slot keep them in place: the merge maps through the blocks
    kept_end = torch.zeros(m, dtype=torch.int32, device=inputs["q"].device)
    args = dict(_unused_addressing(), q_ptr=inputs["q"], q_scale_ptr=inputs["q_scale"], w_ptr=inputs["w"],
                k_ptr=inputs["k"], k_scale_ptr=inputs["k_scale"], out_ptr=scores, positions_ptr=positions,
                kept_end_ptr=kept_end, ks_ptr=inputs["ks"], ke_ptr=inputs["ke"], blocks_ptr=inputs["blocks"],
                stride_table=inputs["blocks"].stride(0), rows=m, keys=problem.keys, width=width,
                **_query_strides(inputs, 1), **_key_strides(inputs["k"], inputs["k_scale"]),
                **_indexer_constexprs(problem.indexer, 1, SPARSE.value, problem.block, config, keep=keep))
    return _launch(m, width, config, args), scores, positions, kept_end


# ---------------------------------------------------------------- spaces and defaults
# Register model, measured with ptxas (sm_90a, Triton 3.9; H 4/32/64, D 64/128, all three modes): what matters
# is the fp32 tile S [block_n, rows x heads] per thread. fp8 holds one such tile: 64 values per thread take
# 110-176 registers, 128 take 200-255 (11 configs, none spills), 256 spill (block_m 4 x block_n 256 x H 64 on
# 8 warps: 216 B). MXFP4 holds two (the running sum and the chunk's dot) plus the decoded codes: 32 values per
# thread take 116-255 registers without spilling (17 configs); at 64, 9 of 10 configs built clean at 194-255
# registers but block_m 2 x block_n 128 x H 64 on 8 warps spilled 56 B, so the limit stays at 32; 128 spill
# (652-1172 B). Shared memory is the dot operands, (block_n + slots) x D bytes for fp8 and (block_n + slots) x 32
# for MXFP4's chunks, as every build measured (1024 keys x 32 heads x D 128 in fp8: 135168 B). Pipelining stages
# change nothing (the tile loop holds a branch): Triton's default is kept.
SHARED_MEMORY = 227 * 1024  # sm_90's most per block
VALUES_PER_THREAD = {"fp8": 128, "mxfp4": 32}  # limit
DEFAULT_VALUES_PER_THREAD = {"fp8": 64, "mxfp4": 32}
MAX_NUMEL = 2**20  # Triton's largest tensor
TILES = (1, 4, 16, 64)
NUM_WARPS = (4, 8)


def _heads_pad(indexer, rows: int) -> int:
    return max(next_power_of_2(indexer.heads), 16 // next_power_of_2(rows))


def _slots(indexer, rows: int) -> int:
    """(row, head) slots of a program's q tile: the N side of S."""
    return next_power_of_2(rows) * _heads_pad(indexer, rows)


def _values_per_thread(indexer, rows: int, config: dict) -> int:
    return config["block_n"] * _slots(indexer, rows) // (32 * config["num_warps"])


def _operand_bytes(indexer, rows: int, config: dict) -> int:
    width = max(32, next_power_of_2(indexer.dim)) if indexer.fmt == "fp8" else 32
    return (config["block_n"] + _slots(indexer, rows)) * width


def _space(params: dict, rows_of, constraints: dict | None = None, limits: dict | None = None) -> Space:
    """A space whose programs own rows_of(problem, config) query rows."""
    return Space(
        params={**params, "tiles": TILES, "num_warps": NUM_WARPS},
        gpu_only=("num_warps",),
        constraints={"block_n x rows x heads <= 2^20 (Triton's largest tensor)":
                     lambda p, c: c["block_n"] * _slots(p.indexer, rows_of(p, c)) <= MAX_NUMEL, **(constraints or {})},
        limits={"block_n x rows x heads / threads <= 128 (fp8) or 32 (mxfp4) (registers)":
                lambda p, c: _values_per_thread(p.indexer, rows_of(p, c), c) <= VALUES_PER_THREAD[p.indexer.fmt],
                "(block_n + rows x heads) x D (fp8) or x 32 (mxfp4) bytes <= 227 KiB (shared memory)":
                lambda p, c: _operand_bytes(p.indexer, rows_of(p, c), c) <= SHARED_MEMORY, **(limits or {})},
    )


def _gpu_block_n(indexer, rows: int, target: int | None = None) -> int:
    """The widest key tile whose S stays at `target` values per thread (default: the format's default) on 8 warps
    (the narrowest if none does)."""
    target = target or DEFAULT_VALUES_PER_THREAD[indexer.fmt]
    for block_n in (256, 128, 64):
        if _values_per_thread(indexer, rows, {"block_n": block_n, "num_warps": 8}) <= target:
            return block_n
    return 64


def _tiles(programs_per_span: int, width: int, block_n: int, per_sm: int = 2) -> int:
    """Key tiles per program: the most that still leave `per_sm` programs per SM of an H200 (132 SMs; one where a
    program's registers leave room for no second)."""
    tiles = TILES[-1]
    while tiles > 1 and programs_per_span * cdiv(width, block_n * tiles) < per_sm * SMS:
        tiles //= 4
    return tiles


def _interpreted_block_n(width: int, widest: int, slots: int) -> int:
    """Under the interpreter: the whole width in one key tile when it fits (and S within Triton's largest tensor)."""
    return max(64, min(widest, MAX_NUMEL // slots, next_power_of_2(max(width, 1))))


LOGITS_SPACE = _space({"block_m": (1, 2, 4, 8, 16, 32, 64), "block_n": (64, 128, 256)},
                      lambda p, c: c["block_m"])


def logits_default(problem) -> dict:
    """GPU: q tiles of 64 (mxfp4) or, fp8, 128 (row, head) slots (256 from 8 rows) on 8 warps, key tiles as wide as
    S's default values per thread allow (fp8: twice them; 3.6 and 3.9 build 254 registers, no spills). Model,
    16 rows x 8K / 64K / 512K keys: 3.0 / 12.0 / 72.0 -> 2.0 / 7.0 / 51.2 us (tensor-bound at 512K), one row x 64K /
    512K: 6.0 / 24.0 -> 3.0 / 19.1 us. Interpreter (each tl op costs about the same whatever its size): up to 1024
    slots x 256 keys."""
    heads = next_power_of_2(problem.indexer.heads)
    if flashkern.triton_interpreted():
        block_m = max(1, min(64, 1024 // heads, next_power_of_2(max(problem.rows, 1))))
        block_n = _interpreted_block_n(problem.keys, 256, _slots(problem.indexer, block_m))
        return {"block_m": block_m, "block_n": block_n, "tiles": 64, "num_warps": 8}
    fp8 = problem.indexer.fmt == "fp8"
    slots = (256 if problem.rows >= 8 else 128) if fp8 else 64
    block_m = max(1, slots // heads)
    block_n = _gpu_block_n(problem.indexer, block_m, 2 * DEFAULT_VALUES_PER_THREAD["fp8"] if fp8 else None)
    return {"block_m": block_m, "block_n": block_n, "num_warps": 8,
            "tiles": _tiles(cdiv(problem.rows, block_m), problem.keys, block_n, 1 if slots == 256 else 2)}


WIDE_KEY_TILES = {"block_n": (64, 128, 256, 512, 1024)}


def paged_rows(problem, config) -> int:
    """Query tokens of a sequence per program: config["block_rows"], at most next_n."""
    return min(config["block_rows"], problem.next_n)


PAGED_SPACE = _space({**WIDE_KEY_TILES, "block_rows": (1, 2, 4, 8)}, paged_rows, constraints={
    "block_rows < 2 x next_n (more would repeat a smaller config)": lambda p, c: c["block_rows"] < 2 * p.next_n})


def paged_default(problem) -> dict:
    """Programs of a sequence's next_n tokens, or of a power of two fewer where all would not fit S's default values
    per thread at 64-key tiles (MTP with 64 heads); GPU: 8 warps, key tiles as wide as then allowed."""
    if flashkern.triton_interpreted():
        block_n = _interpreted_block_n(problem.width, 1024, _slots(problem.indexer, problem.next_n))
        return {"block_n": block_n, "block_rows": next_power_of_2(problem.next_n), "tiles": 64, "num_warps": 8}
    block_rows = next_power_of_2(problem.next_n)
    while block_rows > 1 and (_values_per_thread(problem.indexer, min(block_rows, problem.next_n),
                                                 {"block_n": 64, "num_warps": 8})
                              > DEFAULT_VALUES_PER_THREAD[problem.indexer.fmt]):
        block_rows //= 2
    rows = min(block_rows, problem.next_n)
    block_n = _gpu_block_n(problem.indexer, rows)
    programs = problem.batch * cdiv(problem.next_n, rows)
    return {"block_n": block_n, "block_rows": block_rows, "num_warps": 8,
            "tiles": _tiles(programs, problem.width, block_n)}


SPAN_KEYS_PER_THREAD = 32  # limit: a sparse program holds its span's order keys in registers


SPARSE_SPACE = _space(WIDE_KEY_TILES, lambda p, c: 1, limits={
    "tiles x block_n / threads <= 32 (registers: the span's keys)":
    lambda p, c: span_slots(c) // (32 * c["num_warps"]) <= SPAN_KEYS_PER_THREAD})


def sparse_default(problem) -> dict:
    """A program per row and span of tiles key tiles; GPU: 8 warps, key tiles as wide as S's default values per
    thread allow, spans of 4 tiles for fp8 (top_k 512 keeps half of 1024) and of one for MXFP4 (its decode makes
    the scoring the larger part: fewer programs serve one row slower, 22.8 against 30.5 us modelled at 16384
    candidates, and its 4-tile programs spill 312 B under Triton 3.6). Interpreter: a row in one span when it fits."""
    if flashkern.triton_interpreted():
        block_n = _interpreted_block_n(problem.candidates, 1024, _slots(problem.indexer, 1))
        tiles = next((t for t in TILES if t * block_n >= problem.candidates), TILES[-1])
        return {"block_n": block_n, "tiles": tiles, "num_warps": 8}
    return {"block_n": _gpu_block_n(problem.indexer, 1), "num_warps": 8,
            "tiles": 4 if problem.indexer.fmt == "fp8" else 1}
