"""Sparse decode attention in Triton (reference/kv_cache.py): MQA over the dequantized latent, keys = values.

    s_j = scale q[t, h] . kv_j over the selected rows j of token t (indices[t] in kv_cache, swa_indices[t] in
    swa_cache; -1 and out-of-range entries are padding), d = sum_j exp(s_j) + exp(sink[h]),
    out = bf16(sum_j exp(s_j) kv_j / d), lse = log d; no selected key: out 0, lse = sink[h] (-inf without one).

Tile plan (FlashMLA's sparse decode, in Triton): a program owns one token, BLOCK_H heads (tl.dot's M side; heads
past H are masked rows of zeros) and one split of the token's key blocks (problem.key_splits: ceil(topk /
BLOCK_N) blocks of `indices` into kv_cache, then ceil(W / BLOCK_N) blocks of `swa_indices` into swa_cache, so
a block reads one cache in one format); the head groups of a token are neighbouring programs, so they read its
records from L2 together. The 512 columns are held as 512 / BLOCK_D column blocks (tuples of tiles): q's
[BLOCK_H, BLOCK_D] blocks, loaded once, and the fp32 accumulator's. Per key block:
  1. BLOCK_N index entries -> selected (in [0, cache slots)) and each record's int64 address in its page;
  2. per column block c: the records' codes and scales of those columns are gathered (16-byte aligned spans)
     and decoded (triton_records.decode_records) into kv_c [BLOCK_N, BLOCK_D] bf16, exact (fp4 values and mxfp8
     values above 2^-133 are bf16 numbers; unselected rows read nothing and are 0), and S += q_c kv_c^T in fp32
     on tensor cores;
  3. S times scale, -inf where not selected; online softmax in fp32: running max m (a row with nothing selected
     yet subtracts 0, so padding never makes NaN), running sum l of p = exp(S - m), each accumulator block
     rescaled by exp(m_old - m_new);
  4. acc_c += bf16(p) kv_c: the decoded block is the PV product's B operand too (K = V), so no key is read or
     decoded twice by a program. Decoding a column block at a time keeps the decoded tile small: whole rows
     took every build to 255 registers.
One split (splits == 1) finishes in place: m_all = max(m, sink), w = exp(m - m_all) (0 when m = -inf),
d = l w + exp(sink - m_all), out = bf16(acc w / d), lse = m_all + log d. Several splits store fp32 partials
(acc, m, l per split, token and head) and a combine launch merges them the same way, the sink joining there
(programs of a token x a few heads x a column block, many small ones at T = 1). NaN in a selected key's record
makes its score NaN, which p and then l, acc, out and lse carry (as the reference; a +inf score gives lse +inf);
unselected slots are never read. Under the interpreter (INTERPRETED) tl.dot cannot multiply bf16, so the
operands are fp32 there (exact) and p and out are rounded to bf16 explicitly, as the GPU's conversions do.

H200 bounds (v41-flash: H = 64, topk 512 fp4 + W 128 mxfp8 per token): per token topk x 288 + W x 528 = 211 KB
of records plus 4 B per index entry (44 ns at 4.8 TB/s), and 4 x 512 x H x 640 = 84 MFLOP on bf16 tensor cores
(85 ns at 990 TFLOP/s), plus the decode of every record by each head group (~8 integer / fp32 ops per value on
the CUDA cores, 4 groups of 16 heads at H = 64: the registers allow no more heads per program, see the space):
the arithmetic bounds it, not memory. T = 1 fills the SMs only through the split; its partials (H x 512 x 4 B
per split and token, written and read back) then move more bytes than the records, from L2.
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
from flashkern.kernels.kv_cache.triton_records import D, decode_records, slot_offset
from flashkern.reference.kv_cache import LATENT

NEG_INF = tl.constexpr(float("-inf"))


@triton.jit
def _attend_block(q, m, l, acc, cache_ptr, page_stride, block_size, cache_slots, index_ptr, width, first, scale,
                  FORMAT: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRETED: tl.constexpr):
    """The online-softmax step (m, l, acc) -> (m, l, acc) over key entries first .. first + BLOCK_N - 1 of one
    token's index row at index_ptr (entries past `width` are padding, as -1 and slots outside the cache).
    q and acc are tuples of the column blocks of the q tile and the accumulator, [BLOCK_H, BLOCK_D] each; the key
    block is decoded a column block at a time, each used by both products."""
    BLOCK_D: tl.constexpr = q[0].shape[1]
    j = first + tl.arange(0, BLOCK_N)
    slot = tl.load(index_ptr + j, mask=j < width, other=-1)
    selected = (slot >= 0) & (slot < cache_slots)
    row = slot_offset(tl.where(selected, slot, 0), block_size, page_stride, FORMAT)
    s = tl.zeros((q[0].shape[0], BLOCK_N), tl.float32)
    kv = ()
    for c in tl.static_range(len(q)):
        kv_c = decode_records(cache_ptr, row, selected, FORMAT, c * BLOCK_D, BLOCK_D).to(q[c].dtype)
        s = tl.dot(q[c], tl.trans(kv_c), s)
        kv = kv + (kv_c,)
    s = tl.where(selected[None, :], s * scale, NEG_INF)
    m_new = tl.maximum(m, tl.max(s, axis=1))
    base = tl.where(m_new == NEG_INF, 0.0, m_new)
    alpha = tl.exp(m - base)
    p = tl.exp(s - base[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    if INTERPRETED:  # p rounded to bf16 as the GPU's conversion does
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


@triton.jit
def sparse_attention_kernel(
    q_ptr, stride_q_token, stride_q_head,
    kv_ptr, kv_page_stride, kv_block_size, kv_slots, indices_ptr, stride_indices, topk,
    swa_ptr, swa_page_stride, swa_block_size, swa_slots, swa_indices_ptr, stride_swa_indices, window,
    sink_ptr, scale, out_ptr, lse_ptr, acc_parts_ptr, max_parts_ptr, sum_parts_ptr,
    tokens, kv_blocks, blocks, blocks_per_split,
    H: tl.constexpr, KV_FORMAT: tl.constexpr, SWA_FORMAT: tl.constexpr, HAS_SWA: tl.constexpr,
    HAS_SINK: tl.constexpr, SPLIT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, INTERPRETED: tl.constexpr,
):
    """Token program_id(0) // head groups, heads [BLOCK_H (program_id(0) % head groups), +BLOCK_H), key blocks
    [blocks_per_split program_id(1), +blocks_per_split) of its kv_blocks (kv_cache) then blocks - kv_blocks
    (swa_cache): out and lse, or (SPLIT) the split's partials acc, max and sum [splits, tokens, H(, 512)]."""
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
        if INTERPRETED:  # its tl.dot cannot multiply bf16: fp32 operands (exact), p rounded to bf16 first
            q_c = bf16_to_f32(q_c)
        q = q + (q_c,)
        acc = acc + (tl.zeros((BLOCK_H, BLOCK_D), tl.float32),)
    m = tl.full((BLOCK_H,), NEG_INF, tl.float32)
    l = tl.zeros((BLOCK_H,), tl.float32)
    first = split * blocks_per_split
    last = tl.minimum(first + blocks_per_split, blocks)
    for block in range(first, tl.minimum(last, kv_blocks)):
        m, l, acc = _attend_block(q, m, l, acc, kv_ptr, kv_page_stride, kv_block_size, kv_slots,
                                  indices_ptr + token * stride_indices, topk, block * BLOCK_N, scale,
                                  KV_FORMAT, BLOCK_N, INTERPRETED)
    if HAS_SWA:
        for block in range(tl.maximum(first, kv_blocks), last):
            m, l, acc = _attend_block(q, m, l, acc, swa_ptr, swa_page_stride, swa_block_size, swa_slots,
                                      swa_indices_ptr + token * stride_swa_indices, window,
                                      (block - kv_blocks) * BLOCK_N, scale, SWA_FORMAT, BLOCK_N, INTERPRETED)
    if SPLIT:
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


@triton.jit
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


def _combine_tile(problem) -> tuple[int, int]:
    """(heads, columns) of a combine program: GPU 4 x 128 (many small programs: T = 1 and H = 64 gives 64);
    interpreter every head and column of a token at once."""
    if flashkern.triton_interpreted():
        return triton.next_power_of_2(problem.heads), LATENT
    return min(4, triton.next_power_of_2(problem.heads)), 128


def plan_attention(problem, inputs: dict, config: dict, out):
    """AttentionOutputs(out, lse): the attention launch (grid tokens x head groups, splits), then with several
    splits the combine launch over fp32 partials allocated here."""
    q, indices, swa_indices = inputs["q"], inputs["indices"], inputs["swa_indices"]
    t, h = problem.tokens, problem.heads
    block_h, block_n = config["block_h"], config["block_n"]
    plan = key_splits(problem, block_h, block_n, config["max_splits"])
    split = plan.splits > 1
    parts = dict(acc_parts_ptr=None, max_parts_ptr=None, sum_parts_ptr=None)
    if split:
        parts = dict(acc_parts_ptr=torch.empty(plan.splits, t, h, LATENT, dtype=torch.float32, device=q.device),
                     max_parts_ptr=torch.empty(plan.splits, t, h, dtype=torch.float32, device=q.device),
                     sum_parts_ptr=torch.empty(plan.splits, t, h, dtype=torch.float32, device=q.device))
    scale = LATENT**-0.5 if inputs["scale"] is None else float(inputs["scale"])
    interpreted = flashkern.triton_interpreted()
    attention = Launch(
        sparse_attention_kernel, grid=(t * triton.cdiv(h, block_h), plan.splits),
        args=dict(q_ptr=q, stride_q_token=q.stride(0), stride_q_head=q.stride(1),
                  **_cache_args("kv", inputs["kv_cache"]), indices_ptr=indices, stride_indices=indices.stride(0),
                  topk=problem.topk,
                  **_cache_args("swa", inputs["swa_cache"]), swa_indices_ptr=swa_indices,
                  stride_swa_indices=0 if swa_indices is None else swa_indices.stride(0), window=problem.window,
                  sink_ptr=inputs["sink"], scale=scale, out_ptr=out.out, lse_ptr=out.lse, **parts, tokens=t,
                  kv_blocks=plan.kv_blocks, blocks=plan.blocks, blocks_per_split=plan.blocks_per_split, H=h,
                  KV_FORMAT=problem.kv_format, SWA_FORMAT=problem.swa_format, HAS_SWA=problem.swa,
                  HAS_SINK=problem.sink, SPLIT=split, BLOCK_H=block_h, BLOCK_N=block_n,
                  BLOCK_D=config["block_d"], INTERPRETED=interpreted),
        num_warps=config["num_warps"], num_stages=config["num_stages"])
    if not split:
        return attention
    heads, columns = _combine_tile(problem)
    combine = Launch(
        combine_kernel, grid=(t, triton.cdiv(h, heads), LATENT // columns),
        args=dict(**parts, sink_ptr=inputs["sink"], out_ptr=out.out, lse_ptr=out.lse, tokens=t, splits=plan.splits,
                  H=h, HAS_SINK=problem.sink, BLOCK_H=heads, BLOCK_D=columns, INTERPRETED=interpreted),
        num_warps=4)
    return attention, combine


# ---------------------------------------------------------------- space and defaults
# Register model, measured with ptxas (sm_90a, Triton 3.9 and 3.6; v41-flash at T = 1 and 4096, smoke shapes):
# - block_h 16 (tl.dot on mma.sync, q and the kv column blocks staged in shared memory) on 8 warps takes 166-206
#   registers while block_n <= 32 and block_n x block_d <= 4096 (16 x 64 to 32 x 128, 16 x 256: the decoded
#   column block is at most 16 values per thread), without spilling; 64 x 64 took 255 and spilled 8-16 B at
#   T = 1, 8192 (32 x 256, 64 x 128) 150-210 B, 4 warps 60-210 B.
# - block_h 32 spilled 8-170 B at every block_n and block_d tried (16 warps too); block_h 64 (wgmma, its [64, 512]
#   fp32 accumulator alone 128 registers per thread on 8 warps) 8-12 B with Triton 3.9, 540-610 B with 3.6.
#   Decoding whole 512-wide rows instead of column blocks took every config to 255 registers.
# Shared memory stays under 120 KB (q, the kv column blocks, the pipelined record bytes).
ATTENTION_SPACE = Space(
    params={"block_h": (16, 32, 64), "block_n": (16, 32, 64), "block_d": (64, 128, 256, 512),
            "max_splits": (1, 2, 4, 8, 16, 32), "num_warps": (4, 8), "num_stages": (1, 2, 3)},
    gpu_only=("num_warps", "num_stages"),
    constraints={"block_h <= max(16, H) (more would be padding only)":
                 lambda p, c: c["block_h"] <= max(16, triton.next_power_of_2(p.heads))},
    limits={"block_h 16 on 8 warps (registers)": lambda p, c: c["block_h"] == 16 and c["num_warps"] == 8,
            "block_n <= 32, block_n x block_d <= 4096 (registers)":
            lambda p, c: c["block_n"] <= 32 and c["block_n"] * c["block_d"] <= 4096},
)


def attention_default(problem) -> dict:
    """GPU: 16 heads x 32 keys per step in 128-column blocks on 8 warps, 2 stages, up to 16 splits (T = 1, H = 64:
    4 head groups x 10 splits). Interpreter (each tl op costs about the same whatever its size): up to 64 heads and
    64 keys per step over whole rows, one split (fewest programs)."""
    if flashkern.triton_interpreted():
        return {"block_h": min(64, max(16, triton.next_power_of_2(problem.heads))), "block_n": 64, "block_d": 512,
                "max_splits": 1, "num_warps": 8, "num_stages": 2}
    return {"block_h": 16, "block_n": 32, "block_d": 128, "max_splits": 16, "num_warps": 8, "num_stages": 2}
