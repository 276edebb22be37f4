"""MoE routing in Triton: the whole routing in one launch, from logits or from hidden states.

Tile plan: a program owns BLOCK_T token rows, a warp per row (BLOCK_T a multiple of the warps), and the expert axis
in NC chunks of CW slots (CHUNK = 32: a lane an expert; grouped routing: a chunk is a group, CW its padded
width), held as a tuple of [BLOCK_T, CW] tiles: 384 experts are 12 chunks, no padding to 512.
Slots run in expert order: slot = expert (one group), else g * EG_PAD + j for expert g * EG + j.
  1. s = score(logits), non-finite s -> 0; b = s + bias (NaN keys -> lowest finite), -inf on padding slots
  2. groups: score = max or top-2 sum of b per group; keep the topk_group best (ties: lowest group)
  3. top_k rounds: the chunks folded lane by lane (key, slot, score), then one warp reduction picks the largest
     key, then the lowest slot holding it and its score; the slot is knocked out. Reductions stay within a
     warp (shuffles).
  4. renormalize by the sum (1 when it is 0), scale; invalid rows -> (id -1, weight 0)
The fused-gate kernels first form the logits chunks with tl.dot over D in BLOCK_D steps
(RMS-normalized and rounded to bf16 when a norm weight is given, as the reference does). At prefill the gate is
three launches instead (inv_rms_kernel, gate_gemm_kernel into fp32 partials, moe_route_kernel summing them): a GEMM
tile of 64 or 128 token rows is the M side of wgmma, and the routing is spread over every SM rather than run by
one program per tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

import flashkern
from flashkern.autotune.space import Space
from flashkern.kernels._triton import Launch, round_to_bf16
from flashkern.kernels.moe_route.problem import LOG1P_UNIT, slot_layout
from flashkern.kernels.tiles import SMS, cdiv, split_plan

SCORE_CODES = {"sqrtsoftplus": 0, "sigmoid": 1, "softmax": 2}
LOWEST = tl.constexpr(-3.4028234663852886e38)  # lowest finite fp32: NaN keys rank here, below every number
CHUNK = 32  # expert slots per chunk, a lane each (wider chunks take Triton's default layout: warps across the row)
NO_SLOT = tl.constexpr(2**31 - 1)


_P0, _P1, _P2, _P3, _P4, _P5, _P6, _P7 = (tl.constexpr(c) for c in LOG1P_UNIT)


@triton.jit
def _log1p_unit(u):
    """log(1 + u) for u in [0, 1] (problem.LOG1P_UNIT: u + u^2 P(u), Horner's rule)."""
    p = _P7 * u + _P6
    p = p * u + _P5
    p = p * u + _P4
    p = p * u + _P3
    p = p * u + _P2
    p = p * u + _P1
    p = p * u + _P0
    return u + u * u * p


@triton.jit
def _slot_experts(slot, G: tl.constexpr, EG: tl.constexpr, EG_PAD: tl.constexpr):
    """The expert of each slot and whether the slot holds one (one group: slot = expert)."""
    if G == 1:
        return slot, slot < EG
    if EG == EG_PAD:
        return slot, slot < G * EG
    return (slot // EG_PAD) * EG + slot % EG_PAD, ((slot // EG_PAD) < G) & ((slot % EG_PAD) < EG)


@triton.jit
def _chunk_slots(c: tl.constexpr, CW: tl.constexpr):
    """The slots of chunk c, [1, CW]."""
    return tl.arange(0, CW)[None, :] + c * CW  # the range first: the interpreter's constexpr + tensor is a constexpr


@triton.jit
def _route_chunks(x, row, row_ok, bias_ptr, valid_ptr, w_ptr, id_ptr, scale,
                  G: tl.constexpr, EG: tl.constexpr, EG_PAD: tl.constexpr, NC: tl.constexpr, CW: tl.constexpr,
                  K: tl.constexpr, K_PAD: tl.constexpr, TOPK_GROUP: tl.constexpr, GROUP_TOP2: tl.constexpr,
                  SCORE: tl.constexpr, RENORMALIZE: tl.constexpr):
    """Route the logits chunks x (a tuple of NC [BLOCK_T, CW] tiles) and store the rows' weights and ids."""
    BLOCK_T: tl.constexpr = x[0].shape[0]
    # 1. scores and selection keys
    if SCORE == 2:  # softmax over the row's experts: each exponential computed once, kept per chunk
        row_max = tl.full((BLOCK_T,), float("-inf"), tl.float32)
        for c in tl.static_range(NC):
            ok = _slot_experts(_chunk_slots(c, CW), G, EG, EG_PAD)[1]
            row_max = tl.maximum(row_max, tl.max(tl.where(ok, x[c], float("-inf")), axis=1))
        total = tl.zeros((BLOCK_T,), tl.float32)
        exps = ()
        for c in tl.static_range(NC):
            ok = _slot_experts(_chunk_slots(c, CW), G, EG, EG_PAD)[1]
            exps = exps + (tl.where(ok, tl.exp(x[c] - row_max[:, None]), 0.0),)
            total += tl.sum(exps[c], axis=1)
    s = ()
    b = ()
    for c in tl.static_range(NC):
        expert, ok = _slot_experts(_chunk_slots(c, CW), G, EG, EG_PAD)
        if SCORE == 0:  # sqrt(softplus(x)), softplus(x) = max(x, 0) + log1p(exp(-|x|))
            s_c = tl.sqrt(tl.maximum(x[c], 0.0) + _log1p_unit(tl.exp(-tl.abs(x[c]))))
        elif SCORE == 1:
            s_c = 1.0 / (1.0 + tl.exp(-x[c]))
        else:
            s_c = exps[c] / total[:, None]
        s_c = tl.where((s_c < float("inf")) & (s_c > float("-inf")), s_c, 0.0)  # NaN and +-inf scores -> 0 (vLLM)
        b_c = s_c
        if bias_ptr is not None:
            b_c = s_c + tl.load(bias_ptr + expert, mask=ok, other=0.0)
        b_c = tl.where(b_c == b_c, tl.maximum(b_c, LOWEST), LOWEST)
        s = s + (s_c,)
        b = b + (tl.where(ok, b_c, float("-inf")),)
    # 2. group limiting (a chunk is a group): keep the TOPK_GROUP groups with the largest max (or top-2 sum) of b
    if G > 1:
        gscore = ()
        kept = ()
        for c in tl.static_range(NC):
            g_c = tl.max(b[c], axis=1)
            if GROUP_TOP2:
                at1 = tl.argmax(b[c], axis=1, tie_break_left=True)
                j = tl.arange(0, CW)[None, :]
                g_c = tl.maximum(g_c + tl.max(tl.where(j == at1[:, None], float("-inf"), b[c]), axis=1), LOWEST)
            gscore = gscore + (g_c,)
            kept = kept + (tl.zeros((BLOCK_T,), tl.int1),)
        for _ in tl.static_range(TOPK_GROUP):
            best = gscore[0]
            best_group = tl.zeros((BLOCK_T,), tl.int32)
            for c in tl.static_range(1, NC):  # later groups take strictly larger scores: ties keep the lowest
                take = gscore[c] > best
                best = tl.where(take, gscore[c], best)
                best_group = tl.where(take, c, best_group)
            knocked = ()
            keep = ()
            for c in tl.static_range(NC):
                knocked = knocked + (tl.where(best_group == c, float("-inf"), gscore[c]),)
                keep = keep + (kept[c] | (best_group == c),)
            gscore = knocked
            kept = keep
        limited = ()
        for c in tl.static_range(NC):
            limited = limited + (tl.where(kept[c][:, None], b[c], float("-inf")),)
        b = limited
    # 3. top-k rounds: fold the chunks lane by lane, then one warp reduction
    col = tl.arange(0, K_PAD)[None, :]
    weights = tl.zeros((BLOCK_T, K_PAD), tl.float32)
    ids = tl.zeros((BLOCK_T, K_PAD), tl.int32)
    for r in tl.static_range(K):
        key = b[0]
        slot = tl.broadcast_to(_chunk_slots(0, CW), (BLOCK_T, CW))
        score = s[0]
        for c in tl.static_range(1, NC):  # a later chunk's slots are higher: it takes strictly larger keys
            take = b[c] > key
            key = tl.where(take, b[c], key)
            slot = tl.where(take, _chunk_slots(c, CW), slot)
            score = tl.where(take, s[c], score)
        top = tl.max(key, axis=1)
        pick = tl.min(tl.where(key == top[:, None], slot, NO_SLOT), axis=1)  # equal keys: the lowest slot
        chosen_s = tl.sum(tl.where(slot == pick[:, None], score, 0.0), axis=1)
        weights = tl.where(col == r, chosen_s[:, None], weights)
        ids = tl.where(col == r, _slot_experts(pick, G, EG, EG_PAD)[0][:, None], ids)
        knocked = ()
        for c in tl.static_range(NC):
            knocked = knocked + (tl.where(_chunk_slots(c, CW) == pick[:, None], float("-inf"), b[c]),)
        b = knocked
    # 4. renormalize (a zero sum divides by 1), scale, mask invalid rows, store
    if RENORMALIZE:
        total_w = tl.sum(weights, axis=1)
        weights = weights / tl.where(total_w > 0.0, total_w, 1.0)[:, None]
    weights = weights * scale
    if valid_ptr is not None:
        keep_row = tl.load(valid_ptr + row, mask=row_ok, other=0) != 0
        weights = tl.where(keep_row[:, None], weights, 0.0)
        ids = tl.where(keep_row[:, None], ids, -1)
    out = row[:, None] * K + col
    out_ok = row_ok[:, None] & (col < K)
    tl.store(w_ptr + out, weights, mask=out_ok)
    tl.store(id_ptr + out, ids, mask=out_ok)


@triton.jit(do_not_specialize=["T", "splits"])  # per-step sizes: one compile whatever the batch
def moe_route_kernel(logits_ptr, stride_t, bias_ptr, valid_ptr, w_ptr, id_ptr, T, splits, scale,
                     G: tl.constexpr, EG: tl.constexpr, EG_PAD: tl.constexpr, NC: tl.constexpr, CW: tl.constexpr,
                     K: tl.constexpr, K_PAD: tl.constexpr, TOPK_GROUP: tl.constexpr, GROUP_TOP2: tl.constexpr,
                     SCORE: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr):
    """Routes BLOCK_T rows of fp32 logits [T, E] (row stride stride_t); the prefill gate's last launch passes its
    partial logits [splits, T, E], summed in split order."""
    row = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = row < T
    _route_chunks(_summed_logits(logits_ptr, row, row_ok, stride_t, T, splits, G, EG, EG_PAD, NC, CW), row, row_ok,
                  bias_ptr, valid_ptr, w_ptr, id_ptr, scale,
                  G, EG, EG_PAD, NC, CW, K, K_PAD, TOPK_GROUP, GROUP_TOP2, SCORE, RENORMALIZE)


@triton.jit
def _summed_logits(logits_ptr, row, row_ok, stride_t, T, splits,
                   G: tl.constexpr, EG: tl.constexpr, EG_PAD: tl.constexpr, NC: tl.constexpr, CW: tl.constexpr):
    """The logits chunks of `row` from [splits, T, E] (row stride stride_t), the splits summed in split order
    (deterministic); padding slots 0."""
    logits = _zero_chunks(NC, row.shape[0], CW)
    for s in range(splits):
        rows = logits_ptr + (s * T + row.to(tl.int64))[:, None] * stride_t
        summed = ()
        for c in tl.static_range(NC):
            expert, ok = _slot_experts(_chunk_slots(c, CW), G, EG, EG_PAD)
            summed = summed + (logits[c] + tl.load(rows + expert, mask=row_ok[:, None] & ok, other=0.0),)
        logits = summed
    return logits


NORM_BLOCK = tl.constexpr(512)  # columns per step of the sum of squares: 32 values a thread for 16 rows on 8 warps


@triton.jit
def _inv_rms(h_rows, row_ok, D, norm_eps, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr = NORM_BLOCK):
    """1 / rms of each token row of h over all D, [BLOCK_T]."""
    ssq = tl.zeros((BLOCK_T,), tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)[None, :]
        h = tl.load(h_rows + d, mask=row_ok[:, None] & (d < D), other=0.0).to(tl.float32)
        ssq += tl.sum(h * h, axis=1)
    return 1.0 / tl.sqrt(ssq / D + norm_eps)


@triton.jit
def _gate_logits(acc, h_rows, row_ok, gate_ptr, norm_ptr, inv_rms, first_slot, d_lo, d_hi, D,
                 G: tl.constexpr, EG: tl.constexpr, EG_PAD: tl.constexpr, NC: tl.constexpr, BLOCK_D: tl.constexpr,
                 UPCAST_DOT: tl.constexpr):
    """acc (NC [BLOCK_T, N] tiles: slots first_slot + [c N, (c + 1) N)) += (the normed h) @ W^T over columns
    [d_lo, d_hi) of D, BLOCK_D at a time: the h tile is loaded and normed once for every chunk."""
    N: tl.constexpr = acc[0].shape[1]
    w_rows = ()
    w_ok = ()
    for c in tl.static_range(NC):
        expert, ok = _slot_experts(tl.arange(0, N) + (first_slot + c * N), G, EG, EG_PAD)
        w_rows = w_rows + (gate_ptr + expert.to(tl.int64)[:, None] * D,)
        w_ok = w_ok + (ok[:, None],)
    for d0 in range(d_lo, d_hi, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)[None, :]
        d_ok = (d < d_hi) & (d < D)
        h = tl.load(h_rows + d, mask=row_ok[:, None] & d_ok, other=0.0)
        if norm_ptr is not None:  # RMS-normalized and rounded to bf16, as the reference does
            g = tl.load(norm_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
            h = round_to_bf16(h.to(tl.float32) * inv_rms[:, None] * g).to(tl.bfloat16)
        summed = ()
        for c in tl.static_range(NC):
            w = tl.load(w_rows[c] + d, mask=w_ok[c] & d_ok, other=0.0)
            if UPCAST_DOT:  # the interpreter cannot multiply bf16; fp32 products of bf16 values are exact
                summed = summed + (tl.dot(h.to(tl.float32), tl.trans(w.to(tl.float32)), acc[c],
                                          input_precision="ieee"),)
            else:
                summed = summed + (tl.dot(h, tl.trans(w), acc[c]),)
        acc = summed
    return acc


@triton.jit
def _zero_chunks(NC: tl.constexpr, BLOCK_T: tl.constexpr, CW: tl.constexpr):
    acc = ()
    for c in tl.static_range(NC):
        acc = acc + (tl.zeros((BLOCK_T, CW), tl.float32),)
    return acc


@triton.jit(do_not_specialize=["T"])  # per-step sizes: one compile whatever the batch
def moe_route_gate_kernel(h_ptr, stride_t, gate_ptr, norm_ptr, norm_eps, bias_ptr, valid_ptr, w_ptr, id_ptr,
                          T, D, scale,
                          G: tl.constexpr, EG: tl.constexpr, EG_PAD: tl.constexpr, NC: tl.constexpr,
                          CW: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr, TOPK_GROUP: tl.constexpr,
                          GROUP_TOP2: tl.constexpr, SCORE: tl.constexpr, RENORMALIZE: tl.constexpr,
                          BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST_DOT: tl.constexpr):
    row = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = row < T
    h_rows = h_ptr + row.to(tl.int64)[:, None] * stride_t
    inv_rms = None
    if norm_ptr is not None:
        inv_rms = _inv_rms(h_rows, row_ok, D, norm_eps, BLOCK_T)
    acc = _gate_logits(_zero_chunks(NC, BLOCK_T, CW), h_rows, row_ok, gate_ptr, norm_ptr, inv_rms, 0, 0, D, D,
                       G, EG, EG_PAD, NC, BLOCK_D, UPCAST_DOT)
    _route_chunks(acc, row, row_ok, bias_ptr, valid_ptr, w_ptr, id_ptr, scale,
                  G, EG, EG_PAD, NC, CW, K, K_PAD, TOPK_GROUP, GROUP_TOP2, SCORE, RENORMALIZE)


@triton.jit
def _gate_part(h_rows, row, row_ok, gate_ptr, norm_ptr, inv_rms, parts_ptr, split, split_d, T, D,
               G: tl.constexpr, EG: tl.constexpr, EG_PAD: tl.constexpr, NP: tl.constexpr, BLOCK_E: tl.constexpr,
               BLOCK_D: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """parts[split, row, experts of slots first..first + BLOCK_E) = the fp32 partial logits over D columns
    [split split_d, +split_d), for slot block `tl.program_id(0) % (NP // BLOCK_E)` (blocks fastest in the grid)."""
    first = tl.program_id(0) % (NP // BLOCK_E) * BLOCK_E
    acc = _gate_logits(_zero_chunks(1, row.shape[0], BLOCK_E), h_rows, row_ok, gate_ptr, norm_ptr, inv_rms, first,
                       split * split_d, split * split_d + split_d, D, G, EG, EG_PAD, 1, BLOCK_D, UPCAST_DOT)[0]
    expert, ok = _slot_experts(first + tl.arange(0, BLOCK_E), G, EG, EG_PAD)
    tl.store(parts_ptr + (split * T + row.to(tl.int64))[:, None] * (G * EG) + expert[None, :], acc,
             mask=row_ok[:, None] & ok[None, :])


@triton.jit(do_not_specialize=["T"])  # per-step sizes: one compile whatever the batch
def moe_route_gate_split_kernel(h_ptr, stride_t, gate_ptr, norm_ptr, norm_eps, bias_ptr, valid_ptr, w_ptr, id_ptr,
                                parts_ptr, tickets_ptr, T, D, split_d, splits, scale,
                                G: tl.constexpr, EG: tl.constexpr, EG_PAD: tl.constexpr, NC: tl.constexpr,
                                CW: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr, TOPK_GROUP: tl.constexpr,
                                GROUP_TOP2: tl.constexpr, SCORE: tl.constexpr, RENORMALIZE: tl.constexpr,
                                BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr,
                                EPI_T: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """The decode gate as a split GEMV: program (tile, s, e), e fastest, computes the fp32 partial logits of token
    tile `tile`, expert slots [e BLOCK_E, +BLOCK_E) over D columns [s split_d, +split_d) into parts[s]; the tile's
    last program to finish (a ticket) sums the splits in order (deterministic) and routes the tile's tokens, EPI_T
    at a time."""
    group = splits * (NC * CW // BLOCK_E)
    tile = tl.program_id(0) // group
    row = tile * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = row < T
    h_rows = h_ptr + row.to(tl.int64)[:, None] * stride_t
    inv_rms = None
    if norm_ptr is not None:
        inv_rms = _inv_rms(h_rows, row_ok, D, norm_eps, BLOCK_T)
    _gate_part(h_rows, row, row_ok, gate_ptr, norm_ptr, inv_rms, parts_ptr, tl.program_id(0) % group // (
        NC * CW // BLOCK_E), split_d, T, D, G, EG, EG_PAD, NC * CW, BLOCK_E, BLOCK_D, UPCAST_DOT)
    # the tile's programs count in: the last to arrive sees every partial (a CTA barrier, one acq_rel atomic)
    tl.debug_barrier()
    if tl.atomic_add(tickets_ptr + tile, 1) == group - 1:
        for sub in range(0, tl.minimum(BLOCK_T, T - tile * BLOCK_T), EPI_T):  # the tile's tokens, EPI_T at a time
            epi_row = tile * BLOCK_T + sub + tl.arange(0, EPI_T)
            epi_ok = epi_row < T
            _route_chunks(_summed_logits(parts_ptr, epi_row, epi_ok, G * EG, T, splits, G, EG, EG_PAD, NC, CW),
                          epi_row, epi_ok,
                          bias_ptr, valid_ptr, w_ptr, id_ptr, scale,
                          G, EG, EG_PAD, NC, CW, K, K_PAD, TOPK_GROUP, GROUP_TOP2, SCORE, RENORMALIZE)


@triton.jit(do_not_specialize=["T"])  # per-step sizes: one compile whatever the batch
def inv_rms_kernel(h_ptr, stride_t, inv_rms_ptr, T, D, norm_eps, BLOCK_D: tl.constexpr):
    """inv_rms[t] = 1 / sqrt(mean_d h[t, d]^2 + eps): the prefill gate's first launch (h read once for the norm), a
    program per row, its loads all in flight at once (BLOCK_D up to 8192 columns)."""
    row = tl.program_id(0) + tl.arange(0, 1)
    row_ok = row < T
    inv_rms = _inv_rms(h_ptr + row.to(tl.int64)[:, None] * stride_t, row_ok, D, norm_eps, 1, BLOCK_D)
    tl.store(inv_rms_ptr + row, inv_rms, mask=row_ok)


@triton.jit(do_not_specialize=["T"])  # per-step sizes: one compile whatever the batch
def gate_gemm_kernel(h_ptr, stride_t, gate_ptr, norm_ptr, inv_rms_ptr, parts_ptr, T, D, split_d, splits,
                     G: tl.constexpr, EG: tl.constexpr, EG_PAD: tl.constexpr, NP: tl.constexpr,
                     BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """The prefill gate's GEMM: program (tile, s, e), e fastest, writes parts[s] for a [BLOCK_T, BLOCK_E] tile of
    token rows and expert slots over D columns [s split_d, +split_d): BLOCK_T = 64 rows are the M side of wgmma,
    the K loop software-pipelined (W straight from its load into the dot)."""
    group = splits * (NP // BLOCK_E)
    row = tl.program_id(0) // group * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = row < T
    inv_rms = None
    if norm_ptr is not None:
        inv_rms = tl.load(inv_rms_ptr + row, mask=row_ok, other=0.0)
    _gate_part(h_ptr + row.to(tl.int64)[:, None] * stride_t, row, row_ok, gate_ptr, norm_ptr, inv_rms, parts_ptr,
               tl.program_id(0) % group // (NP // BLOCK_E), split_d, T, D, G, EG, EG_PAD, NP, BLOCK_E, BLOCK_D,
               UPCAST_DOT)


def chunking(routing) -> tuple[int, int]:
    """(CW, NC): slots per chunk and chunks in the kernels' slot order (one group: the experts, no padding)."""
    if routing.n_group == 1:
        return CHUNK, -(-routing.experts // CHUNK)
    return slot_layout(routing).group_width, routing.n_group  # a chunk is a group


def _slots(problem) -> int:
    width, chunks = chunking(problem.routing)
    return width * chunks


def _routing_constexprs(problem) -> dict:
    r = problem.routing
    width, chunks = chunking(r)
    return dict(G=r.n_group, EG=r.experts // r.n_group, EG_PAD=slot_layout(r).group_width, NC=chunks, CW=width,
                K=r.top_k, K_PAD=triton.next_power_of_2(r.top_k), TOPK_GROUP=r.topk_group,
                GROUP_TOP2=problem.group_form == "top2",
                SCORE=SCORE_CODES[r.score], RENORMALIZE=r.renormalize)


def _routing_args(problem, inputs, config, out):
    """The arguments both kernels share: bias, row mask, outputs (weights, ids), sizes, routing constants."""
    weights, ids = out
    valid = inputs["valid"]
    return dict(bias_ptr=inputs["bias"], valid_ptr=None if valid is None else valid.view(torch.uint8),
                w_ptr=weights, id_ptr=ids, T=problem.tokens, scale=float(problem.routing.scaling_factor),
                BLOCK_T=config["block_t"], **_routing_constexprs(problem))


def plan_route(problem, inputs, config, out):
    logits = inputs["logits"]
    return Launch(moe_route_kernel, grid=(cdiv(problem.tokens, config["block_t"]),),
                  args=dict(logits_ptr=logits, stride_t=logits.stride(0), splits=1,
                            **_routing_args(problem, inputs, config, out)),
                  num_warps=config["num_warps"])


def plan_route_gate(problem, inputs, config, out):
    """One launch (a program per token tile; or split over D and experts, the last program of a tile routing it),
    or with config["separate_route"] three: 1 / rms per token (with a norm), the GEMM into fp32 partial logits,
    the routing of their sums."""
    hidden = inputs["hidden"]
    gemm = dict(h_ptr=hidden, stride_t=hidden.stride(0), gate_ptr=inputs["gate_weight"],
                norm_ptr=inputs["norm_weight"], D=problem.hidden, T=problem.tokens, BLOCK_T=config["block_t"],
                BLOCK_D=config["block_d"], UPCAST_DOT=flashkern.triton_interpreted())
    options = dict(num_warps=config["num_warps"], num_stages=config["num_stages"])
    tiles = cdiv(problem.tokens, config["block_t"])
    splits, split_d = split_plan(problem.hidden, config["splits"], config["block_d"])
    if config["separate_route"]:
        return _plan_gate_launches(problem, inputs, config, out, gemm, options, tiles, splits, split_d)
    args = dict(gemm, norm_eps=float(inputs["norm_eps"]), **_routing_args(problem, inputs, config, out))
    if splits == 1:
        return Launch(moe_route_gate_kernel, grid=(tiles,), args=args, **options)
    group = splits * _slots(problem) // config["block_e"]
    parts = torch.empty((splits, problem.tokens, problem.routing.experts), dtype=torch.float32, device=hidden.device)
    tickets = torch.zeros(tiles, dtype=torch.int32, device=hidden.device)
    return Launch(moe_route_gate_split_kernel, grid=(tiles * group,), cooperating=group,
                  args=dict(args, parts_ptr=parts, tickets_ptr=tickets, split_d=split_d, splits=splits,
                            BLOCK_E=config["block_e"], EPI_T=config["epi_t"]), **options)


def _plan_gate_launches(problem, inputs, config, out, gemm, options, tiles, splits, split_d):
    hidden = inputs["hidden"]
    launches = ()
    inv_rms = None
    if inputs["norm_weight"] is not None:
        inv_rms = torch.empty(problem.tokens, dtype=torch.float32, device=hidden.device)
        launches += (Launch(inv_rms_kernel, grid=(problem.tokens,),
                            args=dict(h_ptr=hidden, stride_t=hidden.stride(0), inv_rms_ptr=inv_rms, T=problem.tokens,
                                      D=problem.hidden, norm_eps=float(inputs["norm_eps"]),
                                      BLOCK_D=min(8192, triton.next_power_of_2(problem.hidden)))),)
    parts = torch.empty((splits, problem.tokens, problem.routing.experts), dtype=torch.float32, device=hidden.device)
    r = _routing_constexprs(problem)
    blocks = _slots(problem) // config["block_e"]
    launches += (Launch(gate_gemm_kernel, grid=(tiles * splits * blocks,),
                        args=dict(gemm, inv_rms_ptr=inv_rms, parts_ptr=parts, split_d=split_d, splits=splits,
                                  G=r["G"], EG=r["EG"], EG_PAD=r["EG_PAD"], NP=_slots(problem),
                                  BLOCK_E=config["block_e"]), **options),)
    rows = config["epi_t"]  # a warp per row, up to 4 warps (moe_route's form)
    routing = dict(_routing_args(problem, inputs, config, out), BLOCK_T=rows)
    return launches + (Launch(moe_route_kernel, grid=(cdiv(problem.tokens, rows),),
                              args=dict(routing, logits_ptr=parts, stride_t=problem.routing.experts, splits=splits),
                              num_warps=_route_warps(rows)),)


def _route_warps(rows: int) -> int:
    """Warps of the separate routing launch: a warp per row, at most 4."""
    return min(4, rows)


# Register model, measured with `flashkern compile-check` (ptxas, sm_90a): the routing steps keep
# several fp32 [BLOCK_T, slots] tiles live, and more than 32 values of each per thread spill
# (block_t=8, one warp, 256 slots: 280 B). The gate's W tile [slots, BLOCK_D] passes through
# registers on its way to the dot: more than 64 bf16 values per thread spill (512 x 64 on
# 8 warps: 96 B; 256 x 128 on 4 warps: 4 KB). 16 warps cap ptxas at 128 registers and spill too.
def _route_values_per_thread(problem, config) -> int:
    return config["block_t"] * _slots(problem) // (32 * config["num_warps"])


def _w_tile_values_per_thread(problem, config) -> int:
    return _slots(problem) * config["block_d"] // (32 * config["num_warps"])


ROUTE_SPACE = Space(
    params={"block_t": (1, 2, 4, 8, 16, 32), "num_warps": (1, 2, 4, 8)},
    gpu_only=("num_warps",),
    constraints={"block_t >= num_warps (a warp per row or more)": lambda p, c: c["block_t"] >= c["num_warps"]},
    limits={"block_t x slots / threads <= 32 (registers)": lambda p, c: _route_values_per_thread(p, c) <= 32},
)


def route_default(problem) -> dict:
    """A warp per token row on 4 warps; two rows a warp from 4096 tokens (fewer, fuller programs).

    Under the interpreter every tl op costs about the same whatever its size: programs take 32 rows.
    """
    if flashkern.triton_interpreted():
        return {"block_t": 32, "num_warps": 8}
    block_t = 8 if problem.tokens >= 4096 else 4
    while block_t > 4 and _route_values_per_thread(problem, {"block_t": block_t, "num_warps": 4}) > 32:
        block_t //= 2
    return {"block_t": block_t, "num_warps": 4}


def _split_w_tile_values_per_thread(problem, config) -> int:
    return config["block_e"] * config["block_d"] // (32 * config["num_warps"])


def _fused(rule):
    """A limit that binds only the one-launch forms (the separate routing launch has its own rows)."""
    return lambda p, c: c["separate_route"] or rule(p, c)


GATE_SPACE = Space(
    params={"block_t": (16, 32, 64, 128), "block_d": (32, 64, 128), "num_warps": (4, 8), "num_stages": (1, 2, 3, 4),
            "splits": (1, 2, 4, 8, 16, 32), "block_e": (16, 64, 128, 256), "epi_t": (1, 4, 8, 16),
            "separate_route": (False, True)},
    gpu_only=("num_warps", "num_stages"),
    constraints={"block_e divides the slots": lambda p, c: _slots(p) % c["block_e"] == 0,
                 "epi_t <= block_t": lambda p, c: c["epi_t"] <= c["block_t"]},
    limits={
        "block_t x slots / threads <= 32 (registers)": _fused(lambda p, c: _route_values_per_thread(p, c) <= 32),
        "slots x block_d / threads <= 64 (registers: the W tile)":
            lambda p, c: c["splits"] > 1 or c["separate_route"] or _w_tile_values_per_thread(p, c) <= 64,
        "split: block_e x block_d / threads <= 64 (registers: the W tile)":
            lambda p, c: (c["splits"] == 1 and not c["separate_route"])
            or _split_w_tile_values_per_thread(p, c) <= 64,
        "separate route: epi_t x slots / routing threads <= 32 (registers)":
            lambda p, c: not c["separate_route"] or c["epi_t"] * _slots(p) <= 32 * 32 * _route_warps(c["epi_t"]),
        "separate route: block_t x block_e / threads <= 128 (registers: the accumulator)":
            lambda p, c: not c["separate_route"] or c["block_t"] * c["block_e"] <= 128 * 32 * c["num_warps"],
        "stages x (slots + block_t) x block_d x 2 B <= 200 KiB (shared memory)":
            lambda p, c: c["num_stages"] * 2 * c["block_d"] * (_slots(p) + c["block_t"]) <= 200 * 1024,
    },
)

SPLIT_GATE_TILES = 4  # 16-row token tiles up to which the GPU default splits D in one launch (decode)
GEMM_TILE_T = 128  # prefill: token rows a GEMM program, the M side of two warpgroups' wgmma (64 below 1024 tokens)


def _expert_block(slots: int, cap: int) -> int:
    """The largest power of 2 up to cap that divides the slots: expert blocks tile them exactly."""
    block = 1
    while block * 2 <= cap and slots % (block * 2) == 0:
        block *= 2
    return block


def _power_of_2_splits(programs: int, round_up: bool = True) -> int:
    """D splits that bring `programs` to about one a SM: SMS / programs rounded up (the decode GEMV: its W stream
    wants every SM) or down (the prefill GEMM: a second wave only adds partials), then down to a power of 2 <= 32."""
    wanted = -(-SMS // programs) if round_up else max(1, SMS // programs)
    return min(32, 1 << wanted.bit_length() - 1)


def gate_default(problem) -> dict:
    """Decode (up to SPLIT_GATE_TILES 16-row tiles): one launch, a split GEMV on 8 warps, 64-slot expert blocks and D
    split so that about SMS programs stream W once per tile, the last one of a tile routing it. Prefill: three
    launches, 1 / rms per token, a GEMM of [128 rows (64 below 1024 tokens), 128 slots] tiles (wgmma on a warpgroup
    per 64 rows, three stages, D split while programs fit in one wave) into fp32 partial logits, and the routing of
    their sums (epi_t rows a program, a warp each: moe_route's form). Model at v41-flash shapes: docs/operators.md.

    Under the interpreter, where each loop step costs the same whatever its size, block_d is 128 and D is not split
    (the GPU's configs are tested directly).
    """
    if flashkern.triton_interpreted():
        return {"block_t": 16, "block_d": 128, "num_warps": 8, "num_stages": 1, "splits": 1, "block_e": 64,
                "epi_t": 16, "separate_route": False}
    slots = _slots(problem)
    tiles = -(-problem.tokens // 16)
    if tiles <= SPLIT_GATE_TILES:
        block_e = _expert_block(slots, 64)
        epi_t = 1 if problem.tokens == 1 else 16  # a lone token routed alone (model: 17.9 -> 6.5 us)
        return {"block_t": 16, "block_d": 64, "num_warps": 8, "num_stages": 2,
                "splits": _power_of_2_splits(tiles * (slots // block_e)), "block_e": block_e, "epi_t": epi_t,
                "separate_route": False}  # (three stages spill 12 B with V3's groups at epi_t 1: ptxas, sm_90a)
    block_e = _expert_block(slots, 128)
    block_t = GEMM_TILE_T if problem.tokens >= 1024 else GEMM_TILE_T // 2
    programs = -(-problem.tokens // block_t) * (slots // block_e)
    return {"block_t": block_t, "block_d": 64, "num_warps": block_t // 16, "num_stages": 3,
            "splits": _power_of_2_splits(programs, round_up=False), "block_e": block_e,
            "epi_t": 8 if problem.tokens >= 4096 else 4, "separate_route": True}
