"""mHC in Triton: Sinkhorn, the post mapping, and the pre block (alone or fused behind a post).

    sinkhorn:      m = softmax_rows(x) + eps; m /= col sums + eps; iters - 1 times: m /= row sums + eps, col sums + eps
    post:          out[t, j, d] = bf16(sum_i comb[t, i, j] residual[t, i, d] + post[t, j] y[t, d])
    pre:           mix[t, m] = (sum_{j,d} x[t, j, d] fn[m, j D + d]) * rsqrt(sum x^2 / (n D) + rms_eps)
                   pre = sigmoid(mix[:n] s0 + b[:n]) + pre_eps, post = sigmoid(mix[n:2n] s1 + b[n:2n]) post_mult,
                   comb = sinkhorn(mix[2n:] as [n, n] s2 + b[2n:]),
                   layer_input[t, d] = bf16(sum_i p_i residual[t, i, d]) with p = pre ("fresh") or the carried
                   pre_mix ("carried"), or residual[t, 0, d] copied ("stream0"); then optionally
                   bf16(li rsqrt(mean(li^2) + norm_eps) norm_weight) over the rounded li
    post_pre:      pre on x = post(y, residual, post, comb) (stored as the new residual)

Tile plan (n streams padded to NP, a power of two; padded streams and D tails are masked):
  sinkhorn:  a program owns BLOCK_B matrices as a [BLOCK_B, NP, NP] tile and iterates in registers.
  post:      grid (cdiv(T, BLOCK_T), cdiv(D, BLOCK_D)); a program forms the [BLOCK_T, NP, BLOCK_D] output tile,
             one input stream at a time (fp32 sum over i, then + post y, rounded to nearest-even bf16).
  pre / post_pre: grid (splits, cdiv(T, BLOCK_T)) with (splits, chunk) = split_plan(D, split_k,
             BLOCK_D). Program (s, tile) walks columns [s chunk, min(D, (s + 1) chunk)) of every stream of BLOCK_T
             tokens. Per BLOCK_D step it holds x [BLOCK_T, NP, BLOCK_D] in fp32 (the residual, or the post tile,
             stored as the new residual and used rounded), adds its squares to sq and one dot [BLOCK_T, NP BLOCK_D]
             x [NP BLOCK_D, M_PAD] (fn^T, M = (2 + n) n padded to M_PAD >= 16) to the mixes; the collapses that
             need no gates ("carried", "stream0") store their layer input from the same tile. It writes its
             partials. The epilogue sums the partials in split order 0..S-1, forms the gates and Sinkhorn, then,
             EPI_BLOCK_T tokens at a time, "fresh" collapses the residual EPI_BLOCK_D columns at a time (a re-read:
             L2 at decode), and with HAS_NORM a last pass rescales the stored rows. Either the tile's last split
             runs it (a ticket: a CTA barrier, one acq_rel atomic on the tile's counter; one launch), or a second
             launch of cdiv(T, EPI_BLOCK_T) programs does, spread over the SMs (config "epilogue").
             Stream 0 is a select, never a one-hot multiply (which would turn another stream's inf into NaN).
The GEMM reaches fp32 accuracy in two tf32 MMAs (x holds bf16 values, exact in tf32; fn is split in a tf32
high part and the exact rest). Every sum has a fixed order, so repeated runs are bitwise identical. Token rows
are addressed in int64. Bound on an H200: HBM (residual, fn once per tile), 2.4 FLOP per byte.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

import flashkern
from flashkern.autotune.space import Space
from flashkern.kernels.tiles import SMS, cdiv, next_power_of_2, split_plan
from flashkern.kernels._triton import Launch, register_bound, round_to_bf16
from flashkern.kernels.mhc.problem import empty_partials, epilogue_launch
from flashkern.reference.mhc import mix_width


@triton.jit
def _sinkhorn(logits, N: tl.constexpr, iters, eps):
    """Sinkhorn of a [B, NP, NP] fp32 logits tile whose first N rows and columns are real (padding stays 0)."""
    NP: tl.constexpr = logits.shape[1]
    row_ok = tl.arange(0, NP)[None, :, None] < N
    col_ok = tl.arange(0, NP)[None, None, :] < N
    ok = row_ok & col_ok
    x = tl.where(ok, logits, float("-inf"))
    row_max = tl.where(row_ok, tl.max(x, axis=2, keep_dims=True), 0.0)
    e = tl.exp(x - row_max)
    m = tl.where(ok, e / tl.where(row_ok, tl.sum(e, axis=2, keep_dims=True), 1.0) + eps, 0.0)
    m = m / tl.where(col_ok, tl.sum(m, axis=1, keep_dims=True) + eps, 1.0)
    for _ in range(1, iters):
        m = m / tl.where(row_ok, tl.sum(m, axis=2, keep_dims=True) + eps, 1.0)
        m = m / tl.where(col_ok, tl.sum(m, axis=1, keep_dims=True) + eps, 1.0)
    return m


@triton.jit
def _post_tile(y_ptr, res_ptr, post_ptr, comb_ptr, t, t_ok, d, D, N: tl.constexpr, NP: tl.constexpr):
    """bf16(sum_i comb[t, i, j] residual[t, i, d] + post[t, j] y[t, d]) as fp32 [BT, NP, BD], 0 where masked.

    t: token ids [BT, 1, 1] (int64) with their mask t_ok; d: columns [1, 1, BD], real where d < D.
    """
    j = tl.arange(0, NP)[None, :, None]
    gate_ok = t_ok & (j < N)
    row_ok = t_ok & (d < D)
    mixed = tl.zeros((t.shape[0], NP, d.shape[2]), tl.float32)
    for i in tl.static_range(N):
        c = tl.load(comb_ptr + t * (N * N) + i * N + j, mask=gate_ok, other=0.0)
        r = tl.load(res_ptr + t * (N * D) + i * D + d, mask=row_ok, other=0.0).to(tl.float32)
        mixed += c * r
    y = tl.load(y_ptr + t * D + d, mask=row_ok, other=0.0).to(tl.float32)
    return round_to_bf16(mixed + tl.load(post_ptr + t * N + j, mask=gate_ok, other=0.0) * y)


@triton.jit
def _dot_bf16_fp32(x, w, acc):
    """acc + x @ w for fp32 x holding bf16 values and fp32 w, to about fp32 accuracy in two tf32 MMAs.

    x is exact in tf32, so only w needs splitting: w = hi + lo with hi its top 19 bits (a tf32 value) and lo the
    exact rest (Triton's tf32x3 with x's low part 0, one MMA less and no split copy of x).
    """
    w_hi = (w.to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)
    acc = tl.dot(x, w_hi, acc, input_precision="tf32")
    return tl.dot(x, w - w_hi, acc, input_precision="tf32")


@triton.jit(do_not_specialize=["matrices"])  # per-step sizes: one compile whatever the batch
def mhc_sinkhorn_kernel(x_ptr, out_ptr, matrices, iters, eps,
                        N: tl.constexpr, NP: tl.constexpr, BLOCK_B: tl.constexpr):
    """Sinkhorn of matrices [BLOCK_B program, +BLOCK_B) of x [matrices, N, N]."""
    b = (tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)).to(tl.int64)[:, None, None]
    i = tl.arange(0, NP)[None, :, None]
    j = tl.arange(0, NP)[None, None, :]
    offset = b * (N * N) + i * N + j
    ok = (b < matrices) & (i < N) & (j < N)
    m = _sinkhorn(tl.load(x_ptr + offset, mask=ok, other=0.0), N, iters, eps)
    tl.store(out_ptr + offset, m, mask=ok)


@triton.jit(do_not_specialize=["T"])  # per-step sizes: one compile whatever the batch
def mhc_post_kernel(y_ptr, res_ptr, post_ptr, comb_ptr, out_ptr, T, D,
                    N: tl.constexpr, NP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """New residual streams of tokens [BLOCK_T program_id(0), +BLOCK_T), columns [BLOCK_D program_id(1), +BLOCK_D)."""
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)[:, None, None]
    j = tl.arange(0, NP)[None, :, None]
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)[None, None, :]
    x = _post_tile(y_ptr, res_ptr, post_ptr, comb_ptr, t, t < T, d, D, N, NP)
    tl.store(out_ptr + t * (N * D) + j * D + d, x.to(tl.bfloat16), mask=(t < T) & (j < N) & (d < D))


@triton.jit
def _gates(t, mix_parts_ptr, sq_parts_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, T, D, splits,
           rms_eps, pre_eps, sinkhorn_eps, post_mult, iters, N: tl.constexpr, NP: tl.constexpr, M: tl.constexpr):
    """pre, post and comb of tokens t [BLOCK_T] (int64) from the split partials, summed in split order."""
    t_ok = t < T
    t2 = t[:, None]
    i2 = tl.arange(0, NP)[None, :]
    t3 = t[:, None, None]
    i3 = tl.arange(0, NP)[None, :, None]
    j3 = tl.arange(0, NP)[None, None, :]
    gate_ok = t_ok[:, None] & (i2 < N)
    comb_real = (i3 < N) & (j3 < N)
    comb_ok = t_ok[:, None, None] & comb_real
    comb_at = i3 * N + j3
    pre_mix = tl.zeros((t.shape[0], NP), tl.float32)
    post_mix = tl.zeros((t.shape[0], NP), tl.float32)
    comb_mix = tl.zeros((t.shape[0], NP, NP), tl.float32)
    sq = tl.zeros((t.shape[0],), tl.float32)
    for s in range(splits):
        part = s * T + t
        row2 = mix_parts_ptr + part[:, None] * M
        pre_mix += tl.load(row2 + i2, mask=gate_ok, other=0.0)
        post_mix += tl.load(row2 + N + i2, mask=gate_ok, other=0.0)
        comb_mix += tl.load(mix_parts_ptr + part[:, None, None] * M + 2 * N + comb_at, mask=comb_ok, other=0.0)
        sq += tl.load(sq_parts_ptr + 2 * part, mask=t_ok, other=0.0)
    # rows past T compute on zeros and are not stored
    inv_rms = 1.0 / tl.sqrt(sq / (N * D) + rms_eps)
    s0 = tl.load(scale_ptr)
    s1 = tl.load(scale_ptr + 1)
    s2 = tl.load(scale_ptr + 2)
    pre_logit = pre_mix * inv_rms[:, None] * s0 + tl.load(base_ptr + i2, mask=i2 < N, other=0.0)
    pre = 1.0 / (1.0 + tl.exp(-pre_logit)) + pre_eps
    post_logit = post_mix * inv_rms[:, None] * s1 + tl.load(base_ptr + N + i2, mask=i2 < N, other=0.0)
    post = 1.0 / (1.0 + tl.exp(-post_logit)) * post_mult
    comb_logit = (comb_mix * inv_rms[:, None, None] * s2
                  + tl.load(base_ptr + 2 * N + comb_at, mask=comb_real, other=0.0))
    comb = _sinkhorn(comb_logit, N, iters, sinkhorn_eps)
    tl.store(pre_ptr + t2 * N + i2, pre, mask=gate_ok)
    tl.store(post_ptr + t2 * N + i2, post, mask=gate_ok)
    tl.store(comb_ptr + t3 * (N * N) + comb_at, comb, mask=comb_ok)


@triton.jit
def _finish_layer_input(t, res_ptr, sq_parts_ptr, pre_ptr, norm_ptr, li_ptr, T, D, splits, norm_eps,
                        N: tl.constexpr, NP: tl.constexpr, COLLAPSE: tl.constexpr, HAS_NORM: tl.constexpr,
                        BLOCK_D: tl.constexpr):
    """What is left of the layer input of tokens t [EPI_BLOCK_T] (int64) once the gates are stored: the "fresh"
    collapse bf16(sum_i pre_i residual_i) (the others were stored by the GEMM stage), then the RMSNorm."""
    t_ok = t < T
    li_rows = li_ptr + t[:, None] * D
    li_sq = tl.zeros((t.shape[0],), tl.float32)
    if COLLAPSE == "fresh":
        i2 = tl.arange(0, NP)[None, :]
        pre = tl.load(pre_ptr + t[:, None] * N + i2, mask=t_ok[:, None] & (i2 < N), other=0.0)
        res_rows = res_ptr + t[:, None, None] * (N * D) + tl.arange(0, NP)[None, :, None] * D
        ssq = tl.zeros((t.shape[0], BLOCK_D), tl.float32)
        for d0 in range(0, D, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            row_ok = t_ok[:, None] & (d < D)[None, :]
            r = tl.load(res_rows + d[None, None, :], mask=row_ok[:, None, :] & (i2[:, :, None] < N),
                        other=0.0).to(tl.float32)
            li = round_to_bf16(tl.sum(pre[:, :, None] * r, axis=1))
            tl.store(li_rows + d[None, :], li.to(tl.bfloat16), mask=row_ok)
            if HAS_NORM:
                ssq += li * li
        li_sq = tl.sum(ssq, axis=1)
    elif HAS_NORM:
        for s in range(splits):
            li_sq += tl.load(sq_parts_ptr + 2 * (s * T + t) + 1, mask=t_ok, other=0.0)
    if HAS_NORM:  # over the rounded values
        inv = 1.0 / tl.sqrt(li_sq / D + norm_eps)
        tl.debug_barrier()  # the stored layer input is read back below
        for d0 in range(0, D, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            row_ok = t_ok[:, None] & (d < D)[None, :]
            li = tl.load(li_rows + d[None, :], mask=row_ok, other=0.0).to(tl.float32)
            g = tl.load(norm_ptr + d, mask=d < D, other=0.0).to(tl.float32)
            tl.store(li_rows + d[None, :], round_to_bf16(li * inv[:, None] * g[None, :]).to(tl.bfloat16), mask=row_ok)


@triton.jit(do_not_specialize=["T"])  # per-step sizes: one compile whatever the batch
def mhc_pre_kernel(res_ptr, fn_ptr, mix_parts_ptr, sq_parts_ptr, tickets_ptr,
                   y_ptr, post_in_ptr, comb_in_ptr, new_res_ptr,  # HAS_POST: the post mapping feeding the GEMM
                   scale_ptr, base_ptr, pre_mix_ptr, norm_ptr, li_ptr, pre_ptr, post_ptr, comb_ptr,
                   T, D, chunk, rms_eps, pre_eps, sinkhorn_eps, post_mult, iters, norm_eps,
                   N: tl.constexpr, NP: tl.constexpr, M: tl.constexpr, M_PAD: tl.constexpr,
                   BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, HAS_POST: tl.constexpr, COLLAPSE: tl.constexpr,
                   HAS_NORM: tl.constexpr, EPI_BLOCK_T: tl.constexpr, EPI_BLOCK_D: tl.constexpr,
                   LAST_SPLIT_EPILOGUE: tl.constexpr):
    """Split program_id(0) of tokens [BLOCK_T program_id(1), +BLOCK_T): partial mixes and squares (and the layer
    input of the collapses that need no gates); with LAST_SPLIT_EPILOGUE the tile's last split to finish runs the
    epilogue (else mhc_epilogue_kernel does, in the next launch)."""
    split = tl.program_id(0)
    splits = tl.num_programs(0)
    tile = tl.program_id(1)
    t = (tile * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    t_ok = t < T
    t3 = t[:, None, None]
    j3 = tl.arange(0, NP)[None, :, None]
    # fn^T rows k = j BLOCK_D + (d - d0): the order of x's [NP, BLOCK_D] columns flattened
    k = tl.arange(0, NP * BLOCK_D)
    k_stream = k // BLOCK_D
    k_column = k % BLOCK_D
    m = tl.arange(0, M_PAD)
    fn_cols = fn_ptr + m[None, :] * (N * D)
    acc = tl.zeros((BLOCK_T, M_PAD), tl.float32)
    sq = tl.zeros((BLOCK_T,), tl.float32)
    li_sq = tl.zeros((BLOCK_T,), tl.float32)
    if COLLAPSE == "carried":
        carried = tl.load(pre_mix_ptr + t[:, None] * N + tl.arange(0, NP)[None, :],
                          mask=t_ok[:, None] & (tl.arange(0, NP) < N)[None, :], other=0.0)
    start = split * chunk
    for d0 in range(start, tl.minimum(D, start + chunk), BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        d3 = d[None, None, :]
        x_ok = (t3 < T) & (j3 < N) & (d3 < D)
        if HAS_POST:
            x = _post_tile(y_ptr, res_ptr, post_in_ptr, comb_in_ptr, t3, t3 < T, d3, D, N, NP)
            tl.store(new_res_ptr + t3 * (N * D) + j3 * D + d3, x.to(tl.bfloat16), mask=x_ok)
        else:
            x = tl.load(res_ptr + t3 * (N * D) + j3 * D + d3, mask=x_ok, other=0.0).to(tl.float32)
        sq += tl.sum(tl.sum(x * x, axis=2), axis=1)
        fn_ok = (k_stream < N) & (d0 + k_column < D)
        w = tl.load(fn_cols + (k_stream * D + d0 + k_column)[:, None], mask=fn_ok[:, None] & (m < M)[None, :],
                    other=0.0)
        acc = _dot_bf16_fp32(tl.reshape(x, (BLOCK_T, NP * BLOCK_D)), w, acc)
        if COLLAPSE != "fresh":  # the layer input needs no gates: stored from this tile, no second residual read
            li_ok = t_ok[:, None] & (d < D)[None, :]
            li_at = li_ptr + t[:, None] * D + d[None, :]
            if COLLAPSE == "carried":
                li = round_to_bf16(tl.sum(carried[:, :, None] * x, axis=1))
                tl.store(li_at, li.to(tl.bfloat16), mask=li_ok)
            elif HAS_POST:  # stream 0 of the tile: a select (-0.0 is the sum's identity, so every bit stays)
                li = tl.sum(tl.where(j3 == 0, x, -0.0), axis=1)
                tl.store(li_at, li.to(tl.bfloat16), mask=li_ok)
            else:  # stream 0's stored bf16 bits, copied
                first = tl.load(res_ptr + t[:, None] * (N * D) + d[None, :], mask=li_ok, other=0.0)
                tl.store(li_at, first, mask=li_ok)
                li = first.to(tl.float32)
            if HAS_NORM:
                li_sq += tl.sum(li * li, axis=1)
    part = split * T + t
    tl.store(mix_parts_ptr + part[:, None] * M + m[None, :], acc, mask=t_ok[:, None] & (m < M)[None, :])
    tl.store(sq_parts_ptr + 2 * part, sq, mask=t_ok)
    tl.store(sq_parts_ptr + 2 * part + 1, li_sq, mask=t_ok)
    if LAST_SPLIT_EPILOGUE:
        # the tile's splits count in: the last to arrive sees every partial (a CTA barrier, one acq_rel atomic)
        tl.debug_barrier()
        if tl.atomic_add(tickets_ptr + tile, 1) == splits - 1:
            _gates(t, mix_parts_ptr, sq_parts_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, T, D, splits,
                   rms_eps, pre_eps, sinkhorn_eps, post_mult, iters, N, NP, M)
            if COLLAPSE == "fresh" or HAS_NORM:
                tl.debug_barrier()  # the stored pre is read back
                for sub in range(0, tl.minimum(BLOCK_T, T - tile * BLOCK_T), EPI_BLOCK_T):  # sub-blocks of tokens
                    _finish_layer_input((tile * BLOCK_T + sub + tl.arange(0, EPI_BLOCK_T)).to(tl.int64),
                                        new_res_ptr if HAS_POST else res_ptr, sq_parts_ptr, pre_ptr, norm_ptr,
                                        li_ptr, T, D, splits, norm_eps, N, NP, COLLAPSE, HAS_NORM, EPI_BLOCK_D)


@triton.jit(do_not_specialize=["T"])  # per-step sizes: one compile whatever the batch
def mhc_epilogue_kernel(res_ptr, mix_parts_ptr, sq_parts_ptr, scale_ptr, base_ptr, norm_ptr, li_ptr, pre_ptr,
                        post_ptr, comb_ptr, T, D, splits, rms_eps, pre_eps, sinkhorn_eps, post_mult, iters,
                        norm_eps, N: tl.constexpr, NP: tl.constexpr, M: tl.constexpr, COLLAPSE: tl.constexpr,
                        HAS_NORM: tl.constexpr, EPI_BLOCK_T: tl.constexpr, EPI_BLOCK_D: tl.constexpr):
    """The epilogue of tokens [EPI_BLOCK_T program_id(0), +EPI_BLOCK_T) once every split has stored its partials:
    at small batches it spreads over the SMs what the last split of a tile would do alone."""
    t = (tl.program_id(0) * EPI_BLOCK_T + tl.arange(0, EPI_BLOCK_T)).to(tl.int64)
    _gates(t, mix_parts_ptr, sq_parts_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, T, D, splits,
           rms_eps, pre_eps, sinkhorn_eps, post_mult, iters, N, NP, M)
    if COLLAPSE == "fresh" or HAS_NORM:
        tl.debug_barrier()  # the stored pre is read back
        _finish_layer_input(t, res_ptr, sq_parts_ptr, pre_ptr, norm_ptr, li_ptr, T, D, splits, norm_eps,
                            N, NP, COLLAPSE, HAS_NORM, EPI_BLOCK_D)


# ---------------------------------------------------------------- plans


def _streams(n: int) -> dict:
    return dict(N=n, NP=next_power_of_2(n))


def _mix_pad(n: int) -> int:
    """Mixes padded to a power of two >= 16 (tl.dot's smallest N side)."""
    return max(16, next_power_of_2(mix_width(n)))


def plan_sinkhorn(problem, inputs: dict, config: dict, out):
    """Sinkhorn of x [..., n, n]: a program per block_b matrices."""
    x = inputs["x"]
    return Launch(mhc_sinkhorn_kernel, grid=(cdiv(problem.matrices, config["block_b"]),),
                  args=dict(x_ptr=x, out_ptr=out, matrices=problem.matrices, iters=int(inputs["iters"]),
                            eps=float(inputs["eps"]), BLOCK_B=config["block_b"], **_streams(problem.n)),
                  num_warps=config["num_warps"])


def plan_post(problem, inputs: dict, config: dict, out):
    """New residual streams [T, n, D]: a program per token and block_d columns."""
    grid = (cdiv(problem.tokens, config["block_t"]), cdiv(problem.hidden, config["block_d"]))
    return Launch(mhc_post_kernel, grid=grid,
                  args=dict(y_ptr=inputs["y"], res_ptr=inputs["residual"], post_ptr=inputs["post"],
                            comb_ptr=inputs["comb"], out_ptr=out, T=problem.tokens, D=problem.hidden,
                            BLOCK_T=config["block_t"], BLOCK_D=config["block_d"], **_streams(problem.streams)),
                  num_warps=config["num_warps"])


def _pre_launch(problem, inputs: dict, config: dict, outputs, post_args: dict | None):
    """mhc_pre (mhc_post_pre when post_args are given): the GEMM stage, grid (splits, token tiles), with the
    epilogue run by each tile's last split, or by a second launch of cdiv(T, epi_block_t) programs."""
    t, d, n = problem.tokens, problem.hidden, problem.streams
    splits, chunk = split_plan(d, config["split_k"], config["block_d"])
    tiles = cdiv(t, config["block_t"])
    mix_parts, sq_parts = empty_partials(problem, splits, inputs["residual"].device)
    last_split = config["epilogue"] == "last_split"
    # per call, so calls on several streams never share them
    tickets = torch.zeros(tiles, dtype=torch.int32, device=mix_parts.device) if last_split else None
    has_post = post_args is not None
    epilogue_args = dict(
        mix_parts_ptr=mix_parts, sq_parts_ptr=sq_parts, scale_ptr=inputs["hc_scale"], base_ptr=inputs["hc_base"],
        norm_ptr=inputs["norm_weight"], li_ptr=outputs.layer_input, pre_ptr=outputs.pre, post_ptr=outputs.post,
        comb_ptr=outputs.comb, T=t, D=d, rms_eps=float(inputs["rms_eps"]), pre_eps=float(inputs["pre_eps"]),
        sinkhorn_eps=float(inputs["sinkhorn_eps"]), post_mult=float(inputs["post_mult"]), iters=int(inputs["iters"]),
        norm_eps=float(inputs["norm_eps"]), M=problem.mixes, COLLAPSE=problem.collapse, HAS_NORM=problem.has_norm,
        EPI_BLOCK_T=config["epi_block_t"], EPI_BLOCK_D=config["epi_block_d"], **_streams(n))
    gemm = Launch(
        mhc_pre_kernel, grid=(splits, tiles), cooperating=splits if last_split else 1,
        args=dict(res_ptr=inputs["residual"], fn_ptr=inputs["fn"], tickets_ptr=tickets,
                  **(post_args if has_post else dict.fromkeys(("y_ptr", "post_in_ptr", "comb_in_ptr", "new_res_ptr"))),
                  pre_mix_ptr=inputs["pre_mix"] if problem.collapse == "carried" else None, chunk=chunk,
                  M_PAD=_mix_pad(n), BLOCK_T=config["block_t"], BLOCK_D=config["block_d"], HAS_POST=has_post,
                  LAST_SPLIT_EPILOGUE=last_split, **epilogue_args),
        num_warps=config["num_warps"], num_stages=config["num_stages"], options=register_bound(config["num_warps"]))
    if last_split:
        return gemm
    epilogue = Launch(
        mhc_epilogue_kernel, grid=(cdiv(t, config["epi_block_t"]),),
        args=dict(res_ptr=post_args["new_res_ptr"] if has_post else inputs["residual"], splits=splits,
                  **epilogue_args),
        num_warps=config["num_warps"])
    return gemm, epilogue


def plan_pre(problem, inputs: dict, config: dict, out):
    """PreOutputs(layer_input, pre, post, comb): the GEMM stage on the residual, its last split the epilogue."""
    return _pre_launch(problem, inputs, config, out, None)


def plan_post_pre(problem, inputs: dict, config: dict, out):
    """ChainOutputs(residual, layer_input, pre, post, comb): the GEMM stage on the post mapping (stored as the new
    residual), then the epilogue on the new residual."""
    post_args = dict(y_ptr=inputs["y"], post_in_ptr=inputs["post"], comb_in_ptr=inputs["comb"],
                     new_res_ptr=out.residual)
    return _pre_launch(problem, inputs, config, out, post_args)


# ---------------------------------------------------------------- spaces and defaults
# Register model, measured with ptxas (sm_90a, Triton 3.9).
# GEMM stage: what matters is the x tile [block_t, NP block_d] plus the fn^T tile [NP block_d, M_PAD] in fp32
# per thread (the dot operands, fn's split, the post tile's inputs). At 24 values per thread every build with
# 2 or 3 stages was clean (n = 1, 2, 4, 8; 120-255 registers, the most with HAS_POST); at 32, 7 of 9 spilled
# (24-764 B), at 40 and more every HAS_POST build. One stage (no pipelining) spilled in 6 of 17 sampled builds
# within the limits (16-636 B, HAS_POST), 2 and 3 stages in none of 25: the space has 2 and 3. Steps narrower
# than 16 columns spill at fewer values (n = 4 block_t 128 x block_d 8: 48 B; n = 8 block_t 32 x block_d 4:
# 800 B) but were clean in 16-row tiles, which n = 8 needs (its 80 mixes pad to 128). Shared memory stays under
# 60 KB within these limits.
# Epilogue (the last split, on the GEMM's warps): the gates of the whole token tile, [block_t, NP, NP] (at most 16
# values per thread within the GEMM limits), then [epi_block_t, NP, epi_block_d] tiles plus [epi_block_t,
# epi_block_d]: measured as a launch of its own, 32 columns per thread at n = 4 took 128 registers with the norm
# pass, 64 columns at n = 1 or 2 took 204-251 (no spill): the limit counts NP as >= 4; token blocks of 1-8 at 128
# values per thread built clean, 16 and more spilled. In the one launch: n = 4, block_t 128 x block_d 8 on 8 warps
# with epi_block_t 8 x epi_block_d 1024 (the largest) takes 231 registers, no spill.
# Post kernel: [NP, block_d]; 64 values per thread take 128 registers, 128 take 211-255, 256 spill (4104 B).
# Sinkhorn: [block_b, NP, NP] with a few tiles live; 64 values per thread take 145-208 registers, 128 spill.
MAX_NUMEL = 2**20  # Triton's largest tensor
GEMM_VALUES_PER_THREAD = 24


def _sinkhorn_values_per_thread(problem, config) -> int:
    return config["block_b"] * next_power_of_2(problem.n) ** 2 // (32 * config["num_warps"])


SINKHORN_SPACE = Space(
    params={"block_b": tuple(2**e for e in range(11)), "num_warps": (1, 2, 4, 8)},
    gpu_only=("num_warps",),
    limits={"block_b x n^2 / threads <= 64 (registers)": lambda p, c: _sinkhorn_values_per_thread(p, c) <= 64},
)


def sinkhorn_default(problem) -> dict:
    """GPU: 4 warps, 4 values per thread, fewer matrices per program while that leaves under 2 programs per SM.
    Interpreter (each tl op costs about the same whatever its size): up to 1024 matrices per program."""
    if flashkern.triton_interpreted():
        return {"block_b": min(1024, next_power_of_2(max(1, problem.matrices))), "num_warps": 4}
    block_b = max(1, 512 // next_power_of_2(problem.n) ** 2)
    while block_b > 1 and cdiv(problem.matrices, block_b) < 2 * SMS:
        block_b //= 2
    return {"block_b": block_b, "num_warps": 4}


TOKEN_BLOCKS = (1, 2, 4, 8, 16, 32, 64)
INTERPRETED_TILE = 2**16  # values per interpreted tile: large enough that the per-op cost amortizes


def _interpreted_tokens(problem, width: int) -> int:
    """Tokens per program under the interpreter: as many as fit a tile of `width` values each (at most 64)."""
    return max(1, min(64, next_power_of_2(max(1, problem.tokens)), INTERPRETED_TILE // width))


def _post_values_per_thread(problem, config) -> int:
    tile = config["block_t"] * next_power_of_2(problem.streams) * config["block_d"]
    return tile // (32 * config["num_warps"])


POST_SPACE = Space(
    params={"block_t": TOKEN_BLOCKS, "block_d": tuple(2**e for e in range(6, 13)), "num_warps": (1, 2, 4, 8)},
    gpu_only=("num_warps",),
    constraints={"block_t x n x block_d <= 2^20 (Triton's largest tensor)":
                 lambda p, c: c["block_t"] * next_power_of_2(p.streams) * c["block_d"] <= MAX_NUMEL},
    limits={"block_t x n x block_d / threads <= 64 (registers)":
            lambda p, c: _post_values_per_thread(p, c) <= 64},
)


def post_default(problem) -> dict:
    """GPU: a token per program on 4 warps, 16 values per thread, narrower tiles (down to 128 columns) while under
    2 programs per SM. Interpreter: up to 4096 columns and 2^16 values per program."""
    np_ = next_power_of_2(problem.streams)
    if flashkern.triton_interpreted():
        block_d = max(64, min(4096, next_power_of_2(problem.hidden)))
        return {"block_t": _interpreted_tokens(problem, np_ * block_d), "block_d": block_d, "num_warps": 4}
    block_d = max(64, 2048 // np_)
    while block_d > 128 and problem.tokens * cdiv(problem.hidden, block_d) < 2 * SMS:
        block_d //= 2
    return {"block_t": 1, "block_d": block_d, "num_warps": 4}


def _dot_k(problem, config) -> int:
    """The GEMM stage's reduction length per step, NP x block_d."""
    return next_power_of_2(problem.streams) * config["block_d"]


def _gemm_values(problem, config) -> int:
    """The x [block_t, K] and fn^T [K, M_PAD] tiles of the GEMM stage."""
    return _dot_k(problem, config) * (config["block_t"] + _mix_pad(problem.streams))


def _epilogue_values_per_thread(problem, config) -> int:
    """The [epi_block_t, NP, epi_block_d] tile per thread, counted at NP >= 4 (the [epi_block_d] vectors weigh as
    much)."""
    tile = config["epi_block_t"] * max(4, next_power_of_2(problem.streams)) * config["epi_block_d"]
    return tile // (32 * config["num_warps"])


PRE_SPACE = Space(
    params={"block_t": (16, 32, 64, 128), "block_d": tuple(2**e for e in range(2, 10)),
            "split_k": (1, 2, 4, 8, 16, 32), "num_warps": (4, 8), "num_stages": (2, 3),
            "epi_block_t": TOKEN_BLOCKS, "epi_block_d": tuple(2**e for e in range(7, 13)),
            "epilogue": ("last_split", "own_launch")},
    gpu_only=("num_warps", "num_stages"),
    constraints={
        "n x block_d >= 16 (tl.dot's smallest K)": lambda p, c: _dot_k(p, c) >= 16,
        "x and fn tiles <= 2^20 values (Triton's largest tensor)":
            lambda p, c: _dot_k(p, c) * max(c["block_t"], _mix_pad(p.streams)) <= MAX_NUMEL,
        "epi_block_t x n x epi_block_d <= 2^20 (Triton's largest tensor)":
            lambda p, c: c["epi_block_t"] * next_power_of_2(p.streams) * c["epi_block_d"] <= MAX_NUMEL,
        "epi_block_t <= block_t when the last split runs the epilogue (it walks the token tile)":
            lambda p, c: c["epilogue"] != "last_split" or c["epi_block_t"] <= c["block_t"],
    },
    limits={
        f"n x block_d x (block_t + mixes) / threads <= {GEMM_VALUES_PER_THREAD} (registers)":
            lambda p, c: _gemm_values(p, c) // (32 * c["num_warps"]) <= GEMM_VALUES_PER_THREAD,
        "block_d >= 16 unless block_t = 16 (registers)": lambda p, c: c["block_d"] >= 16 or c["block_t"] == 16,
        "epi_block_t x max(n, 4) x epi_block_d / threads <= 128 (registers)":
            lambda p, c: _epilogue_values_per_thread(p, c) <= 128,
        "epi_block_t <= 8 (registers: the gate and Sinkhorn tiles of 16 tokens spilled)":
            lambda p, c: c["epi_block_t"] <= 8,
    },
)


def pre_default(problem) -> dict:
    """GPU: token tiles of 16 rows up to 256 tokens (more GEMM CTAs than the splits alone give) on 4 warps (8 where
    no block_d fits 4: 8 streams), else 64 (fn's fp32 columns are split into tf32 parts once a tile) on 8; block_d the widest within the register
    limits (up to 64; below 16 in 16-row tiles), 2 stages; split_k so that tiles x splits ~ 2 programs per SM,
    with at least 4 block_d steps per split; the epilogue a token per program, in its own launch from 2 tokens on
    while the tiles number at most an eighth of the SMs (a tile's last split runs it alone on one SM).
    Interpreter: one split and the widest tiles, 2^16 values of tokens per epilogue program (each tl op costs
    about the same whatever its size), run by the last split (one launch)."""
    np_ = next_power_of_2(problem.streams)
    if flashkern.triton_interpreted():
        block_t = max(16, min(64, next_power_of_2(max(1, problem.tokens))))
        block_d = max(16, min(512, next_power_of_2(problem.hidden)))
        epi_block_d = max(128, min(4096, next_power_of_2(problem.hidden)))
        return {"block_t": block_t, "block_d": block_d, "split_k": 1, "num_warps": 8, "num_stages": 2,
                "epi_block_t": _interpreted_tokens(problem, np_ * epi_block_d), "epi_block_d": epi_block_d,
                "epilogue": "last_split"}
    block_t = 16 if problem.tokens <= 256 else 64
    # 16 rows are one MMA tile in M, so the warps split its N side and each redoes the tile's elementwise work
    # (the post mapping, the squares): 4 warps, not 8 (model, 128 tokens: mhc_post_pre 17.4 -> 12.0 us)
    # (8 where 4 leave no block_d within the register limits: 8 streams)
    for warps in (4, 8) if block_t == 16 else (8,):
        config = {"block_t": block_t, "block_d": 64, "split_k": 1, "num_warps": warps, "num_stages": 2,
                  "epi_block_t": 1, "epi_block_d": max(128, 8192 // np_), "epilogue": "last_split"}
        while config["block_d"] > 4 and PRE_SPACE.violations(problem, config):
            if config["block_d"] > 16 or config["block_t"] == 16:
                config["block_d"] //= 2
            else:
                config["block_t"] //= 2
        if not PRE_SPACE.violations(problem, config):
            break
    if problem.tokens == 1:  # a compile-time 1 for the JIT: that build spills at block_d 32 (128 registers), not at 16
        config["block_d"] = min(config["block_d"], 16)
    tiles = cdiv(max(1, problem.tokens), config["block_t"])  # of the block_t the limits left
    config["epilogue"] = epilogue_launch(problem.tokens, tiles)
    while (config["split_k"] < 32 and tiles * config["split_k"] * 2 <= 2 * SMS
           and config["split_k"] * 2 * 4 * config["block_d"] <= problem.hidden):
        config["split_k"] *= 2
    return config
