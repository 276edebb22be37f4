"""Sparse decode attention in Triton (reference/kv_cache.py): MQA over the dequantized latent, keys = values.

    s_j = scale q[t, h] . kv_j over the selected rows j of token t (both caches; -1 and out-of-range are padding),
    d = sum_j exp(s_j) + exp(sink[h]), out = bf16(sum_j exp(s_j) kv_j / d), lse = log d (no key: out 0, lse sink).

grid: (tokens x head groups, splits); block: 8 warps; tile: BLOCK_H heads (up to 64, all of a token: wgmma's M
side, so each record is decoded once per token) x BLOCK_N keys x 512 columns in BLOCK_D-wide blocks. Per key block
(problem.key_splits: the top-k's blocks, then the window's; one cache and format per block):
  1. BLOCK_N slots (an index row, or the window's by position) -> record addresses; per column block the codes
     and scale words are gathered (cp.async), decoded exactly (triton_records.decode_records) into bf16, and
     S += q_c kv_c^T on tensor cores;
  2. online softmax in fp32 (p rounded to the nearest bf16), acc_c = acc_c alpha + p kv_c (K = V).
One split finishes in place (the sink joins, `_weight`); several store fp32 partials that `combine_kernel` merges.
H200 (v41-flash): per token 84 MFLOP (tensor 85 ns) and 211 KB of records (44 ns of HBM); the model has the
decode's integer work and the accumulator's rescale bind it (docs/operators.md section 8, "Design").
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

import flashkern
from flashkern.autotune.space import Space
from flashkern.kernels._triton import Launch, round_to_bf16
from flashkern.kernels._triton.codecs import bf16_to_f32
from flashkern.kernels.kv_cache.problem import key_splits
from flashkern.kernels.kv_cache.triton_records import D, decode_records, slot_offset, word_aligned
from flashkern.kernels.tiles import cdiv, next_power_of_2
from flashkern.reference.kv_cache import LATENT

NEG_INF = tl.constexpr(float("-inf"))


@triton.jit
def _listed_slots(index_ptr, width, first, BLOCK_N: tl.constexpr):
    """Entries first .. first + BLOCK_N - 1 of a token's index row at index_ptr (-1 past `width`)."""
    j = first + tl.arange(0, BLOCK_N)
    return tl.load(index_ptr + j, mask=j < width, other=-1)


@triton.jit
def _window_slots(table_row_ptr, table_width, block_size, cache_slots, low, position, window, first,
                  BLOCK_N: tl.constexpr):
    """Window entries first .. first + BLOCK_N - 1 of a token at `position` whose sequence's pages start at
    table_row_ptr (reference.window_slots): entry i is key j = position - window + 1 + i, a slot where i < window,
    j >= low (>= 0) and the table has a page of the cache there, else -1 (no other table entry is read)."""
    i = first + tl.arange(0, BLOCK_N)
    key = position - window + 1 + i
    page_index = key // block_size
    kept = (i < window) & (key >= low) & (page_index < table_width)
    page = tl.load(table_row_ptr + page_index, mask=kept, other=-1)
    return tl.where((page >= 0) & (page < cache_slots // block_size), page * block_size + key % block_size, -1)


@triton.jit
def _attend_block(q, m, l, acc, cache_ptr, page_stride, block_size, cache_slots, slot, scale,
                  FORMAT: tl.constexpr, WORDS: tl.constexpr, INTERPRETED: tl.constexpr):
    """The online-softmax step (m, l, acc) -> (m, l, acc) over a key block of cache slots `slot` [BLOCK_N] (-1 and
    slots outside the cache are padding). q and acc are tuples of the column blocks of the q tile and the
    accumulator, [BLOCK_H, BLOCK_D] each; the key block is decoded a column block at a time, each used by both
    products."""
    BLOCK_D: tl.constexpr = q[0].shape[1]
    BLOCK_N: tl.constexpr = slot.shape[0]
    selected = (slot >= 0) & (slot < cache_slots)
    row = slot_offset(tl.where(selected, slot, 0), block_size, page_stride, FORMAT)
    s = tl.zeros((q[0].shape[0], BLOCK_N), tl.float32)
    kv = ()
    for c in tl.static_range(len(q)):
        kv_c = decode_records(cache_ptr, row, selected, FORMAT, c * BLOCK_D, BLOCK_D, WORDS).to(q[c].dtype)
        s = tl.dot(q[c], tl.trans(kv_c), s)
        kv = kv + (kv_c,)
    s = tl.where(selected[None, :], s * scale, NEG_INF)  # NaN in a selected record stays NaN, as the reference
    m_new = tl.maximum(m, tl.max(s, axis=1))
    base = tl.where(m_new == NEG_INF, 0.0, m_new)  # nothing selected yet: subtract 0, so padding makes no NaN
    alpha = tl.exp(m - base)
    p = tl.exp(s - base[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    if INTERPRETED:  # p rounded to bf16 as the GPU's conversion does (the interpreter's cast truncates)
        p = round_to_bf16(p)
    p = p.to(q[0].dtype)
    new_acc = ()
    for c in tl.static_range(len(acc)):
        new_acc = new_acc + (tl.dot(p, kv[c], acc[c] * alpha[:, None]),)
    return m_new, l, new_acc


@triton.jit
def _weight(m, m_all):
    """exp(m - m_all): 0 for m = -inf (also when m_all = -inf), 1 for m = m_all (also +inf: a +inf sink takes all
    the weight, so out is 0 and lse +inf, as the reference)."""
    return tl.where(m == NEG_INF, 0.0, tl.where(m == m_all, 1.0, tl.exp(m - m_all)))


@triton.jit
def _lse(m_all, d):
    """m_all + log d: -inf where d = 0 (nothing selected, no sink), +inf where a score is +inf (m_all = inf, d NaN:
    the reference's logsumexp)."""
    return tl.where(m_all == float("inf"), m_all, m_all + tl.log(d))


@triton.jit
def _sink(sink_ptr, head, head_ok, HAS_SINK: tl.constexpr):
    """sink[head] [R], -inf without a sink (or past H)."""
    if HAS_SINK:
        return tl.load(sink_ptr + head, mask=head_ok, other=NEG_INF)
    else:
        return tl.full(head.shape, NEG_INF, tl.float32)


@triton.jit
def _store_out(out_ptr, row, row_ok, column, acc, weight, d, INTERPRETED: tl.constexpr):
    """out[row, column] = bf16(acc x weight / d), 0 where d = 0 (nothing selected, no sink: acc is 0 there);
    row: int64 (token x H + head) [R], column [C], weight [R]."""
    out = acc * (weight / tl.where(d == 0.0, 1.0, d))[:, None]
    if INTERPRETED:  # its cast truncates; rounded first, the cast is exact
        out = round_to_bf16(out)
    tl.store(out_ptr + row[:, None] * D + column[None, :], out.to(tl.bfloat16), mask=row_ok[:, None])


@triton.jit(do_not_specialize=["tokens", "blocks_per_split", "splits", "stride_table", "table_rows", "table_width",
                               "has_lower"])  # per-step sizes: one compile whatever the batch
def sparse_attention_kernel(
    q_ptr, stride_q_token, stride_q_head,
    kv_ptr, kv_page_stride, kv_block_size, kv_slots, indices_ptr, stride_indices, topk,
    swa_ptr, swa_page_stride, swa_block_size, swa_slots, swa_indices_ptr, stride_swa_indices, window,
    table_ptr, stride_table, table_rows, table_width, positions_ptr, seq_ids_ptr, lower_ptr, has_lower,
    sink_ptr, scale, out_ptr, lse_ptr, acc_parts_ptr, max_parts_ptr, sum_parts_ptr,
    tokens, kv_blocks, blocks, blocks_per_split, splits,
    H: tl.constexpr, KV_FORMAT: tl.constexpr, SWA_FORMAT: tl.constexpr, KV_WORDS: tl.constexpr,
    SWA_WORDS: tl.constexpr, HAS_SWA: tl.constexpr, BY_POSITION: tl.constexpr,
    HAS_SINK: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, INTERPRETED: tl.constexpr,
):
    """Token program_id(0) // head groups, heads [BLOCK_H (program_id(0) % head groups), +BLOCK_H), key blocks
    [blocks_per_split program_id(1), +blocks_per_split) of its kv_blocks (kv_cache) then blocks - kv_blocks
    (swa_cache: swa_indices, or BY_POSITION the token's window through the block table): out and lse, or with
    splits > 1 the split's partials acc, max and sum [splits, tokens, H(, 512)] (a run-time branch: one compile
    serves every split count)."""
    GROUPS: tl.constexpr = (H + BLOCK_H - 1) // BLOCK_H
    token = (tl.program_id(0) // GROUPS).to(tl.int64)
    head = (tl.program_id(0) % GROUPS) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(1)
    head_ok = head < H
    column = tl.arange(0, BLOCK_D)
    q_rows = q_ptr + token * stride_q_token + head.to(tl.int64)[:, None] * stride_q_head
    q = ()
    acc = ()
    for c in tl.static_range(D // BLOCK_D):
        q_c = tl.load(q_rows + c * BLOCK_D + column[None, :], mask=head_ok[:, None], other=0.0)
        if INTERPRETED:  # its tl.dot cannot multiply bf16: fp32 operands (exact: bf16 values)
            q_c = bf16_to_f32(q_c)
        q = q + (q_c,)
        acc = acc + (tl.zeros((BLOCK_H, BLOCK_D), tl.float32),)
    m = tl.full((BLOCK_H,), NEG_INF, tl.float32)
    l = tl.zeros((BLOCK_H,), tl.float32)
    first = split * blocks_per_split
    last = tl.minimum(first + blocks_per_split, blocks)
    for block in range(first, tl.minimum(last, kv_blocks)):
        slot = _listed_slots(indices_ptr + token * stride_indices, topk, block * BLOCK_N, BLOCK_N)
        m, l, acc = _attend_block(q, m, l, acc, kv_ptr, kv_page_stride, kv_block_size, kv_slots, slot, scale,
                                  KV_FORMAT, KV_WORDS, INTERPRETED)
    if HAS_SWA:
        for block in range(tl.maximum(first, kv_blocks), last):
            if BY_POSITION:  # the token's scalars loaded per block (cached): none stays live across the loop
                seq = tl.load(seq_ids_ptr + token)
                known = (seq >= 0) & (seq < table_rows)  # a sequence outside the table sees no key
                seq = tl.where(known, seq, 0)
                low = tl.maximum(tl.load(lower_ptr + seq, mask=has_lower != 0, other=0), 0)
                slot = _window_slots(table_ptr + seq.to(tl.int64) * stride_table, table_width, swa_block_size,
                                     swa_slots, tl.where(known, low, 2147483647), tl.load(positions_ptr + token),
                                     window, (block - kv_blocks) * BLOCK_N, BLOCK_N)
            else:
                slot = _listed_slots(swa_indices_ptr + token * stride_swa_indices, window,
                                     (block - kv_blocks) * BLOCK_N, BLOCK_N)
            m, l, acc = _attend_block(q, m, l, acc, swa_ptr, swa_page_stride, swa_block_size, swa_slots, slot,
                                      scale, SWA_FORMAT, SWA_WORDS, INTERPRETED)
    if splits > 1:
        part = (split * tokens + token) * H + head
        for c in tl.static_range(D // BLOCK_D):
            tl.store(acc_parts_ptr + part[:, None] * D + c * BLOCK_D + column[None, :], acc[c],
                     mask=head_ok[:, None])
        tl.store(max_parts_ptr + part, m, mask=head_ok)
        tl.store(sum_parts_ptr + part, l, mask=head_ok)
    else:
        sink = _sink(sink_ptr, head, head_ok, HAS_SINK)
        m_all = tl.maximum(m, sink)
        w = _weight(m, m_all)
        total = l * w + _weight(sink, m_all)
        row = token * H + head
        for c in tl.static_range(D // BLOCK_D):
            _store_out(out_ptr, row, head_ok, c * BLOCK_D + column, acc[c], w, total, INTERPRETED)
        tl.store(lse_ptr + row, _lse(m_all, total), mask=head_ok)


@triton.jit(do_not_specialize=["tokens"])  # per-step sizes: one compile whatever the batch
def combine_kernel(acc_parts_ptr, max_parts_ptr, sum_parts_ptr, sink_ptr, out_ptr, lse_ptr, tokens, splits,
                   H: tl.constexpr, HAS_SINK: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                   INTERPRETED: tl.constexpr):
    """Token program_id(0), heads [BLOCK_H program_id(1), +BLOCK_H), columns [BLOCK_D program_id(2), +BLOCK_D):
    m_all = max(max_s m_s, sink), d = sum_s l_s exp(m_s - m_all) + exp(sink - m_all),
    out = bf16(sum_s acc_s exp(m_s - m_all) / d), lse = m_all + log d (stored by the first column block)."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    column = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    head_ok = head < H
    sink = _sink(sink_ptr, head, head_ok, HAS_SINK)
    m_all = sink
    for split in range(splits):
        m_all = tl.maximum(m_all, tl.load(max_parts_ptr + (split * tokens + token) * H + head, mask=head_ok,
                                          other=NEG_INF))
    d = _weight(sink, m_all)
    acc = tl.zeros((BLOCK_H, BLOCK_D), tl.float32)
    for split in range(splits):
        part = (split * tokens + token) * H + head
        w = _weight(tl.load(max_parts_ptr + part, mask=head_ok, other=NEG_INF), m_all)
        d += tl.load(sum_parts_ptr + part, mask=head_ok, other=0.0) * w
        acc += tl.load(acc_parts_ptr + part[:, None] * D + column[None, :], mask=head_ok[:, None],
                       other=0.0) * w[:, None]
    _store_out(out_ptr, token * H + head, head_ok, column, acc, tl.full(d.shape, 1.0, tl.float32), d, INTERPRETED)
    if tl.program_id(2) == 0:
        tl.store(lse_ptr + token * H + head, _lse(m_all, d), mask=head_ok)


# ---------------------------------------------------------------- plan


def _cache_args(prefix: str, cache: torch.Tensor | None) -> dict:
    """A paged cache's pointer, page stride, page size and slots (a placeholder where absent)."""
    if cache is None:
        return {f"{prefix}_ptr": None, f"{prefix}_page_stride": 0, f"{prefix}_block_size": 1, f"{prefix}_slots": 0}
    return {f"{prefix}_ptr": cache, f"{prefix}_page_stride": cache.stride(0), f"{prefix}_block_size": cache.shape[1],
            f"{prefix}_slots": cache.shape[0] * cache.shape[1]}


def _window_args(inputs: dict, problem) -> dict:
    """The window by position's block table (pointer, row stride, rows, width), positions, sequence ids and lower
    bounds (has_lower 0: none given); placeholders the kernel never reads otherwise."""
    if not problem.window_by_position:
        return dict(table_ptr=None, stride_table=0, table_rows=0, table_width=0, positions_ptr=None,
                    seq_ids_ptr=None, lower_ptr=None, has_lower=0)
    table, lower = inputs["swa_block_table"], inputs.get("swa_lower")
    return dict(table_ptr=table, stride_table=table.stride(0), table_rows=table.shape[0], table_width=table.shape[1],
                positions_ptr=inputs["positions"], seq_ids_ptr=inputs["seq_ids"],
                lower_ptr=inputs["positions"] if lower is None else lower, has_lower=int(lower is not None))


def _words(cache: torch.Tensor | None) -> bool:
    """Whether the cache's records all start 4-byte aligned (records are 288 and 528 B, so: its data pointer and
    page stride)."""
    return cache is not None and word_aligned(cache, cache.stride(0))


def _combine_tile(problem) -> tuple[int, int]:
    """(heads, columns) of a combine program: GPU 4 x 128 (many small programs: T = 1 and H = 64 gives 64);
    interpreter every head and column of a token at once."""
    if flashkern.triton_interpreted():
        return next_power_of_2(problem.heads), LATENT
    return min(4, next_power_of_2(problem.heads)), 128


def plan_attention(problem, inputs: dict, config: dict, out):
    """AttentionOutputs(out, lse): the attention launch (grid tokens x head groups, splits), then with several
    splits the combine launch over fp32 partials allocated here."""
    q, indices, swa_indices = inputs["q"], inputs["indices"], inputs["swa_indices"]
    t, h = problem.tokens, problem.heads
    block_h, block_n = config["block_h"], config["block_n"]
    plan = key_splits(problem, block_h, block_n, config["max_splits"])
    split = plan.splits > 1
    parts = dict(acc_parts_ptr=out.lse, max_parts_ptr=out.lse, sum_parts_ptr=out.lse)  # unsplit: never written
    if split:
        parts = dict(acc_parts_ptr=torch.empty(plan.splits, t, h, LATENT, dtype=torch.float32, device=q.device),
                     max_parts_ptr=torch.empty(plan.splits, t, h, dtype=torch.float32, device=q.device),
                     sum_parts_ptr=torch.empty(plan.splits, t, h, dtype=torch.float32, device=q.device))
    scale = LATENT**-0.5 if inputs["scale"] is None else float(inputs["scale"])
    interpreted = flashkern.triton_interpreted()
    attention = Launch(
        sparse_attention_kernel, grid=(t * cdiv(h, block_h), plan.splits),
        args=dict(q_ptr=q, stride_q_token=q.stride(0), stride_q_head=q.stride(1),
                  **_cache_args("kv", inputs["kv_cache"]), indices_ptr=indices, stride_indices=indices.stride(0),
                  topk=problem.topk,
                  **_cache_args("swa", inputs["swa_cache"]), swa_indices_ptr=swa_indices,
                  stride_swa_indices=0 if swa_indices is None else swa_indices.stride(0), window=problem.window,
                  **_window_args(inputs, problem),
                  sink_ptr=inputs["sink"], scale=scale, out_ptr=out.out, lse_ptr=out.lse, **parts, tokens=t,
                  kv_blocks=plan.kv_blocks, blocks=plan.blocks, blocks_per_split=plan.blocks_per_split,
                  splits=plan.splits, H=h,
                  KV_FORMAT=problem.kv_format, SWA_FORMAT=problem.swa_format,
                  KV_WORDS=_words(inputs["kv_cache"]), SWA_WORDS=_words(inputs["swa_cache"]), HAS_SWA=problem.swa,
                  BY_POSITION=problem.window_by_position,
                  HAS_SINK=problem.sink, BLOCK_H=block_h, BLOCK_N=block_n,
                  BLOCK_D=config["block_d"], INTERPRETED=interpreted),
        num_warps=config["num_warps"], num_stages=config["num_stages"])
    if not split:
        return attention
    heads, columns = _combine_tile(problem)
    combine = Launch(
        combine_kernel, grid=(t, cdiv(h, heads), LATENT // columns),
        args=dict(**parts, sink_ptr=inputs["sink"], out_ptr=out.out, lse_ptr=out.lse, tokens=t, splits=plan.splits,
                  H=h, HAS_SINK=problem.sink, BLOCK_H=heads, BLOCK_D=columns, INTERPRETED=interpreted),
        num_warps=4)
    return attention, combine


# ---------------------------------------------------------------- space and defaults
# Register model, measured with ptxas (sm_90a; v41-flash at T = 1 and 4096): 8 warps (4 spill).
# Triton 3.9:
# - block_h 16 (mma.sync) and 32 take 193-254 registers without spilling while block_n <= 32 and block_n x
#   block_d <= 4096 at v41-flash; 32 x 256 spilled 32-96 B, and 32 x 128 12 B at 8 heads (the smoke shapes).
# - block_h 64 (wgmma on the token's 64 heads; its [64, 512] fp32 accumulator alone 128 registers per thread):
#   255 registers without spilling at 16 x 64 and 32 x 64 (keys x columns per decoded tile); 16 x 128 spilled
#   8 B at T = 1, 32 x 128 12-56 B, block_n 64 128-260 B.
# Under the JIT's own flags (3.9's --regAllocOptLevel=2) the 64-head default spills 1.1-1.3 KB on 3.9 and 1.0-1.3
#   KB on Triton 3.6 (the oldest supported; block_h 32 12-220 B, block_h 16 nothing at 32 x 64), and still wins:
#   the model, spills charged as local memory, puts it at 53.5 us at T = 64 on 3.6 against 230 us for 16 heads
#   (2677 against 14738 us at T = 4096), and within 5% of 16 heads at T = 1 (docs/operators.md 8.3).
# Shared memory stays under 120 KB (q, the kv column blocks, the pipelined record bytes).
ATTENTION_SPACE = Space(
    params={"block_h": (16, 32, 64), "block_n": (16, 32, 64), "block_d": (64, 128, 256, 512),
            "max_splits": (1, 2, 4, 8, 16, 32), "num_warps": (4, 8), "num_stages": (1, 2, 3)},
    gpu_only=("num_warps", "num_stages"),
    constraints={"block_h <= max(16, H) (more would be padding only)":
                 lambda p, c: c["block_h"] <= max(16, next_power_of_2(p.heads))},
    limits={"8 warps (registers: 4 spill)": lambda p, c: c["num_warps"] == 8,
            "block_n <= 32, block_n x block_d <= 4096, block_d <= 64 at block_h 64 (registers)":
            lambda p, c: c["block_n"] <= 32 and c["block_n"] * c["block_d"] <= 4096
            and (c["block_h"] < 64 or c["block_d"] <= 64)},
)


def attention_default(problem) -> dict:
    """GPU: a token's heads in one program up to 64 (wgmma's M side: every record is decoded once per token; 128
    heads take two programs; on Triton 3.6 and 3.9 alike, spills and all), 32 keys per step in 64-column blocks on 8
    warps, 2 stages, up to 32 splits within one wave (T = 1, H = 64: 20 splits, a key block each, model 7.5 -> 6.3
    us against at most 16; T = 8: 10; T = 64: 2); the window by position on 3 stages (its slot arithmetic spills
    16 B on 2, none on 3). Interpreter (each tl op costs about the same whatever its size): up to 64 heads and 64
    keys per step over whole rows, one split."""
    block_h = min(64, max(16, next_power_of_2(problem.heads)))
    if flashkern.triton_interpreted():
        return {"block_h": block_h, "block_n": 64, "block_d": 512, "max_splits": 1, "num_warps": 8, "num_stages": 2}
    return {"block_h": block_h, "block_n": 32, "block_d": 64, "max_splits": 32, "num_warps": 8,
            "num_stages": 3 if problem.window_by_position else 2}
