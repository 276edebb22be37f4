"""mHC in TileLang: one source for CUDA and the CPU (C) target.

    sinkhorn:  m = softmax_rows(x) + eps; m /= colsum(m) + eps; then iters - 1 times
               m /= rowsum(m) + eps; m /= colsum(m) + eps                          x [B, n, n] fp32
    post:      out_j = bf16(sum_i comb[i, j] res_i + post_j y)                     [T, n, D] bf16
    pre:       mix = (x @ fn^T) * rsqrt(mean(x^2) + rms_eps), x = residual [T, n * D] in fp32;
               pre = sigmoid(mix[:n] s0 + b[:n]) + pre_eps, post = sigmoid(mix[n:2n] s1 + b[n:2n]) * post_mult,
               comb = sinkhorn(mix[2n:] s2 + b[2n:]); layer_input = bf16(sum_i p_i res_i) with p = pre ("fresh")
               or the carried pre_mix ("carried"), or res_0 copied ("stream0"); optionally RMS-normed
    post_pre:  post, then pre over the new residual (reference/mhc.py is the contract)

Tile plan:
  sinkhorn   a program per block_b matrices, a thread per matrix holding it in registers (the
             `sinkhorn` macro, also run by the epilogue).
  post       grid (T, cdiv(D, block_d)): a thread per column d of a token reads y and the n residual
             streams there and writes all n new streams (the `post_column` macro).
  pre, post_pre: grid (cdiv(T, block_t), splits), (splits, chunk) = split_plan(D, split_k, block_d).
    Block (tile, s) walks its chunk of D in block_d steps through T.Pipelined: per stream j a T.copy of the
    residual tile x_j [block_t, block_d] (TMA on sm_90a; for post_pre the post mapping of the copied residual,
    stored to the new residual and rounded) and of fn's columns [M, block_d] fp32, split into three bf16 planes
    hi + mid + lo (each product with x's bf16 values exact in fp32, so the sum is fp32-accurate); acc [block_t,
    3 M] += x_j planes_j^T (T.gemm: wgmma from shared memory at 64 rows, mma.sync below); the squares, and for
    "carried" / "stream0" the layer input itself, from the same tile. It writes its partials. The epilogue sums
    them in split order, forms the gates and Sinkhorn a thread per token, for "fresh" collapses the residual again
    (L2 at decode) a row and epi_block_d columns at a time (a T.copy to registers), and with a norm rescales the
    stored rows. The tile's last split runs it (a ticket: a barrier, one acq_rel atomic on the tile's counter; one
    launch), or a second launch does, a block per token (config "epilogue", `_programs`).
    Stream 0 is a select, never a one-hot multiply (which would turn another stream's inf into NaN).
    Bound on an H200: HBM at 8192 tokens (the residual, twice for "fresh"); below, instruction issue
    (docs/operators.md section 4).
T, D and the split count are dynamic and the scalars (iters, the epsilons, post_mult) are run-time
arguments, so one compiled kernel per source serves every token count and width; the collapse and the norm are
compile-time. The CPU flavour takes bf16 as uint16
bits; the index math and the summation order are the same for both targets, and fixed, so repeated
runs are bitwise identical.
"""

# No `from __future__ import annotations`: TileLang evaluates T.Tensor annotations against the closure.
from types import SimpleNamespace

import torch

from flashkern.autotune.space import Space
from flashkern.kernels._tilelang import T, Flavour, placeholder
from flashkern.kernels._tilelang.sync import count_in_macro
from flashkern.kernels.tiles import SMS, next_power_of_2, split_plan
from flashkern.kernels.mhc.problem import (
    MhcProblem,
    SinkhornProblem,
    empty_partials,
    epilogue_launch,
)


def _mix_slots(streams: int) -> int:
    """GEMM output columns: the (2 + n) n mixes padded to a power of two of at least 32."""
    return max(32, next_power_of_2((2 + streams) * streams))


def _sinkhorn_macro(n: int):
    """Sinkhorn of one n x n matrix held flat in a thread's local m [n * n], in the reference's order."""

    @T.macro
    def sinkhorn(m, sums, iters, eps):
        """m <- sinkhorn(m); sums: local scratch [n]."""
        for i in T.unroll(n):
            sums[i] = m[i * n]
            for j in T.unroll(n - 1):
                sums[i] = T.max(sums[i], m[i * n + j + 1])
            for j in T.unroll(n):
                m[i * n + j] = T.exp(m[i * n + j] - sums[i])
            sums[i] = 0.0
            for j in T.unroll(n):
                sums[i] = sums[i] + m[i * n + j]
            for j in T.unroll(n):
                m[i * n + j] = m[i * n + j] / sums[i] + eps
        for it in T.serial(iters):  # a reciprocal a row or column, then products: n divisions, not n * n
            if it > 0:
                for i in T.unroll(n):
                    sums[i] = 0.0
                    for j in T.unroll(n):
                        sums[i] = sums[i] + m[i * n + j]
                    sums[i] = 1.0 / (sums[i] + eps)
                for k in T.unroll(n * n):
                    m[k] = m[k] * sums[k // n]
            for j in T.unroll(n):
                sums[j] = 0.0
                for i in T.unroll(n):
                    sums[j] = sums[j] + m[i * n + j]
                sums[j] = 1.0 / (sums[j] + eps)
            for k in T.unroll(n * n):
                m[k] = m[k] * sums[k % n]

    return sinkhorn


def _post_macro(n: int, fl: Flavour):
    """The post mapping of one column of one token (a thread's work)."""

    @T.macro
    def post_column(Y, Res, Post, Comb, Out, t, d, res, out):
        """Out[t, j, d] = bf16(sum_i comb[i, j] res_i + post_j y) for every stream j; out [n] keeps the rounded
        values as fp32; res: local scratch [n + 1] (the n residual values, then y: each loaded once, as the
        stores to Out may alias them for the compiler)."""
        for i in T.unroll(n):
            res[i] = fl.load_bf16(Res[t, i, d])
        res[n] = fl.load_bf16(Y[t, d])
        for j in T.unroll(n):
            out[j] = 0.0
            for i in T.unroll(n):
                out[j] = out[j] + Comb[t, i, j] * res[i]
            out[j] = fl.round_bf16(out[j] + Post[t, j] * res[n])
            Out[t, j, d] = fl.store_bf16(out[j])

    return post_column


# ---------------------------------------------------------------- sinkhorn


def sinkhorn_program(problem: SinkhornProblem, config: dict, fl: Flavour):
    """Out [B, n, n] = sinkhorn(X [B, n, n]): block_b matrices a program, a thread each."""
    n, BB = problem.n, config["block_b"]
    B = T.dynamic("B")
    sinkhorn = _sinkhorn_macro(n)

    @T.prim_func
    def mhc_sinkhorn(
        X: T.Tensor((B, n, n), "float32"),
        Out: T.Tensor((B, n, n), "float32"),
        iters: T.int32,
        eps: T.float32,
    ):
        with T.Kernel(T.ceildiv(B, BB), threads=config["threads"]) as bx:
            m = T.alloc_local((n * n,), "float32")
            sums = T.alloc_local((n,), "float32")
            for b in fl.parallel(BB):
                if bx * BB + b < B:
                    for k in T.unroll(n * n):
                        m[k] = X[bx * BB + b, k // n, k % n]
                    sinkhorn(m, sums, iters, eps)
                    for k in T.unroll(n * n):
                        Out[bx * BB + b, k // n, k % n] = m[k]

    return mhc_sinkhorn


def sinkhorn_args(problem: SinkhornProblem, inputs: dict, config: dict, fl: Flavour, out):
    if problem.matrices == 0:
        return None
    n = problem.n
    return [inputs["x"].view(-1, n, n), out.view(-1, n, n), int(inputs["iters"]), float(inputs["eps"])]


# ---------------------------------------------------------------- post


def post_program(problem: MhcProblem, config: dict, fl: Flavour):
    """Out [T, n, D] bf16 from y [T, D], residual [T, n, D], post [T, n], comb [T, n, n]."""
    n, BD = problem.streams, config["block_d"]
    NT, D = T.dynamic("T"), T.dynamic("D")
    post_column = _post_macro(n, fl)

    @T.prim_func
    def mhc_post(
        Y: T.Tensor((NT, D), fl.bf16),
        Res: T.Tensor((NT, n, D), fl.bf16),
        Post: T.Tensor((NT, n), "float32"),
        Comb: T.Tensor((NT, n, n), "float32"),
        Out: T.Tensor((NT, n, D), fl.bf16),
    ):
        with T.Kernel(NT, T.ceildiv(D, BD), threads=config["threads"]) as (t, bd):
            res = T.alloc_local((n + 1,), "float32")
            out = T.alloc_local((n,), "float32")
            for d in fl.parallel(BD):
                if bd * BD + d < D:
                    post_column(Y, Res, Post, Comb, Out, t, bd * BD + d, res, out)

    return mhc_post


def post_args(problem: MhcProblem, inputs: dict, config: dict, fl: Flavour, out):
    if problem.tokens == 0:
        return None
    return [fl.bf16_arg(inputs["y"]), fl.bf16_arg(inputs["residual"]), inputs["post"], inputs["comb"],
            fl.bf16_arg(out)]


# ---------------------------------------------------------------- pre / post_pre: one launch


def _plane_rows(mixes: int, block_t: int) -> int:
    """Rows of the GEMM's fn operand: the (2 + n) n mixes three times (fn's bf16 planes hi, mid, lo), padded to 8
    (wgmma's N step), or to 32 below 64 token rows (mma.sync, 8 columns a warp)."""
    step = 8 if block_t >= 64 else 32
    return -(-3 * mixes // step) * step


def _threads(config: dict) -> int:
    """A warpgroup (128 threads) per 64 token rows (wgmma's M side); one below 64 rows (mma.sync)."""
    return max(128, 2 * config["block_t"])


def _fused_program(problem: MhcProblem, config: dict, fl: Flavour, post_first: bool, stage: str = "fused"):
    """The split-K GEMM pass over a token tile and, in the tile's last split to count in, the epilogue (module
    docstring). post_first: x is the post-mapped residual (mhc_post_pre), stored to NewRes on the way. stage:
    "fused" (both, one launch), "gemm" (the pass alone) or "epilogue" (a block per token, after a "gemm" launch).

    The collapse and the norm are the problem's: PreIn [rows, n] is read only for "carried" (rows = T), Norm [width]
    only with has_norm (width = D); otherwise they are 1-row placeholders.
    """
    n, M = problem.streams, problem.mixes
    W = _plane_rows(M, config["block_t"])
    BT, BD, stages = config["block_t"], config["block_d"], config["num_stages"]
    ED = config["epi_block_d"]
    ER = 1 if stage == "epilogue" else BT  # token rows of a block's epilogue
    NT, D, SP = T.dynamic("T"), T.dynamic("D"), T.dynamic("SP")  # SP = splits, allocated by the arguments
    PR, DN = T.dynamic("pre_rows"), T.dynamic("norm_width")
    plane = "bfloat16" if fl.on_gpu else "float32"  # the C target multiplies the same rounded values in fp32
    sinkhorn = _sinkhorn_macro(n)
    count_in = count_in_macro(fl)

    def streams(macro, *args):
        """macro(j, *args) for every stream j, unrolled here: a T.copy into a buffer of a list needs a Python index."""
        for j in range(n):
            macro(j, *args)

    @T.macro
    def load_stream(j, Src, tiles, t0, d0):
        T.copy(Src[t0:t0 + BT, j, d0:d0 + BD], tiles[j])

    @T.macro
    def load_rows(j, Src, b, t, d0):
        """Stream j of row t, columns d0.. + ED: registers (0 past the end)."""
        T.copy(Src[t, j, d0:d0 + ED], b.rows[j])

    @T.macro
    def post_stream(j, Y, Res, NewRes, b, t0, d0):
        """x_j <- bf16(sum_i comb[i, j] res_i + post_j y) over the tile, stored to NewRes."""
        for r, d in fl.parallel(BT, BD):
            value = fl.round_bf16(sum([b.mixing[r, i * n + j] * fl.load_bf16(b.res[i][r, d]) for i in range(n)])
                                  + b.gates[r, j] * fl.load_bf16(b.y[r, d]))
            b.x[j][r, d] = fl.store_bf16(value)
            if (t0 + r < NT) & (d0 + d < D):
                NewRes[t0 + r, j, d0 + d] = fl.store_bf16(value)

    @T.macro
    def load_residual(j, Res, b, t0, d0):
        T.copy(Res[t0:t0 + BT, j, d0:d0 + BD], b.res[j])

    @T.macro
    def fn_planes(j, Fn, b, d0):
        """fn's columns of stream j as three bf16 planes, hi + mid + lo: their products with x's bf16 values are
        exact in fp32. Rows past 3 M stay 0."""
        T.copy(Fn[0:M, j, d0:d0 + BD], b.f[j])
        for m, d in fl.parallel(M, BD):
            hi = T.alloc_var("float32")
            mid = T.alloc_var("float32")
            hi = fl.round_bf16(b.f[j][m, d])
            mid = fl.round_bf16(b.f[j][m, d] - hi)
            b.w[j][m, d] = T.Cast(plane, hi)
            b.w[j][M + m, d] = T.Cast(plane, mid)
            b.w[j][2 * M + m, d] = T.Cast(plane, fl.round_bf16(b.f[j][m, d] - hi - mid))

    @T.macro
    def clear_padding(j, b):
        for m, d in fl.parallel(W - 3 * M, BD):
            b.w[j][3 * M + m, d] = T.Cast(plane, 0.0)

    @T.macro
    def mma(j, b):
        """acc += x_j w_j^T: wgmma from shared memory on sm_90a."""
        if fl.on_gpu:
            T.gemm(b.x[j], b.w[j], b.acc, transpose_B=True)
        else:  # the C target's gemm multiplies fp32: x's bf16 bits decoded
            for r, d in T.grid(BT, BD):
                b.xf[r, d] = fl.load_bf16(b.x[j][r, d])
            T.gemm(b.xf, b.w[j], b.acc, transpose_B=True)

    @T.macro
    def split_pass(Y, Res, PostIn, CombIn, NewRes, Fn, PreIn, LayerInput, MixParts, SqParts, chunk, bx, s, b):
        """Partial mixes and squares of split s of token tile bx; the layer input where it needs no gates."""
        t0 = bx * BT
        for r, i in fl.parallel(BT, n):
            b.carried[r, i] = PreIn[T.min(t0 + r, PR - 1), i]
            if post_first:
                b.gates[r, i] = PostIn[T.min(t0 + r, NT - 1), i]
        if post_first:
            for r, k in fl.parallel(BT, n * n):
                b.mixing[r, k] = CombIn[T.min(t0 + r, NT - 1), k // n, k % n]
        if W > 3 * M:
            streams(clear_padding, b)
        T.clear(b.acc)
        T.clear(b.squares)
        if problem.collapse != "fresh":
            T.clear(b.li_squares)
        for kd in T.Pipelined(T.ceildiv(T.min(D - s * chunk, chunk), BD), num_stages=stages):
            d0 = s * chunk + kd * BD
            if post_first:
                streams(load_residual, Res, b, t0, d0)
                T.copy(Y[t0:t0 + BT, d0:d0 + BD], b.y)
                streams(post_stream, Y, Res, NewRes, b, t0, d0)
            else:
                streams(load_stream, Res, b.x, t0, d0)
            streams(fn_planes, Fn, b, d0)
            for r, d in fl.parallel(BT, BD):
                b.squares[r, d] = b.squares[r, d] + sum([fl.load_bf16(b.x[j][r, d]) * fl.load_bf16(b.x[j][r, d])
                                                         for j in range(n)])
                if problem.collapse != "fresh":  # needs no gates: stored from this tile, no second residual read
                    li = T.alloc_var("float32")
                    if problem.collapse == "stream0":  # a select, never a one-hot multiply: stream 0's bits as they are
                        li = fl.load_bf16(b.x[0][r, d])
                        if (t0 + r < NT) & (d0 + d < D):
                            LayerInput[t0 + r, d0 + d] = b.x[0][r, d]
                    else:
                        li = fl.round_bf16(sum([b.carried[r, j] * fl.load_bf16(b.x[j][r, d]) for j in range(n)]))
                        if (t0 + r < NT) & (d0 + d < D):
                            LayerInput[t0 + r, d0 + d] = fl.store_bf16(li)
                    b.li_squares[r, d] = b.li_squares[r, d] + li * li
            streams(mma, b)
        T.reduce_sum(b.squares, b.sq, dim=1)
        if problem.collapse != "fresh":
            T.reduce_sum(b.li_squares, b.li_sq, dim=1)
        T.copy(b.acc, b.mixes)
        for r, m in fl.parallel(BT, M):
            if t0 + r < NT:
                MixParts[s, t0 + r, m] = b.mixes[r, m] + (b.mixes[r, M + m] + b.mixes[r, 2 * M + m])
        for r in fl.parallel(BT):
            if t0 + r < NT:
                SqParts[s, t0 + r, 0] = b.sq[r]
                if problem.collapse != "fresh":
                    SqParts[s, t0 + r, 1] = b.li_sq[r]

    @T.macro
    def epilogue(Src, MixParts, SqParts, Scale, Base, Norm, LayerInput, Pre, Post, Comb, rms_eps, pre_eps,
                 sinkhorn_eps, post_mult, iters, norm_eps, bx, b):
        """Gates, Sinkhorn and what is left of the layer input of tokens [ER bx, ER bx + ER), from every split's
        partials."""
        t0 = bx * ER
        m = T.alloc_local((n * n,), "float32")
        sums = T.alloc_local((n,), "float32")
        total = T.alloc_var("float32")
        rstd = T.alloc_var("float32")
        gate = T.alloc_var("float32")
        weights = T.alloc_local((n,), "float32")
        # 1. split sums, in split order
        for r, k in fl.parallel(ER, M):
            total = 0.0
            if t0 + r < NT:
                for s in T.serial(SP):
                    total = total + MixParts[s, t0 + r, k]
            b.mix[r, k] = total
        # 2. a thread per token: rms scale, gates, Sinkhorn; the pre as the collapse weights; the layer input's
        #    squares where the splits summed them
        for r in fl.parallel(ER):
            if t0 + r < NT:  # rows past the tokens idle
                total = 0.0
                for s in T.serial(SP):
                    total = total + SqParts[s, t0 + r, 0]
                rstd = 1.0 / T.sqrt(total / T.Cast("float32", n * D) + rms_eps)
                if problem.collapse != "fresh" and problem.has_norm:
                    total = 0.0
                    for s in T.serial(SP):
                        total = total + SqParts[s, t0 + r, 1]
                    b.li_rows[r] = total
                for i in T.unroll(n):
                    gate = 1.0 / (1.0 + T.exp(-(b.mix[r, i] * rstd * Scale[0] + Base[i]))) + pre_eps
                    b.carried[r, i] = gate
                    Pre[t0 + r, i] = gate
                    Post[t0 + r, i] = 1.0 / (1.0 + T.exp(-(b.mix[r, n + i] * rstd * Scale[1] + Base[n + i]))) * post_mult
                for k in T.unroll(n * n):
                    m[k] = b.mix[r, 2 * n + k] * rstd * Scale[2] + Base[2 * n + k]
                sinkhorn(m, sums, iters, sinkhorn_eps)
                for k in T.unroll(n * n):
                    Comb[t0 + r, k // n, k % n] = m[k]
        # 3. "fresh": layer input = bf16(sum_i pre_i res_i), the residual read again (L2 at decode), a row of the
        #    tile's tokens epi_block_d columns at a time
        if problem.collapse == "fresh":
            for row in T.serial(T.min(NT - t0, ER)):
                for i in T.unroll(n):  # the row's weights in registers
                    weights[i] = b.carried[row, i]
                if problem.has_norm:
                    T.clear(b.li_tile)
                for kd in T.serial(T.ceildiv(D, ED)):
                    streams(load_rows, Src, b, t0 + row, kd * ED)
                    for d in fl.parallel(ED):
                        b.li_row[d] = fl.round_bf16(sum([weights[i] * fl.load_bf16(b.rows[i][d]) for i in range(n)]))
                        if problem.has_norm:
                            b.li_tile[d] = b.li_tile[d] + b.li_row[d] * b.li_row[d]
                    for d in fl.parallel(ED):
                        if kd * ED + d < D:
                            LayerInput[t0 + row, kd * ED + d] = fl.store_bf16(b.li_row[d])
                if problem.has_norm:
                    T.reduce_sum(b.li_tile, b.li_part, dim=0)
                    b.li_rows[row] = b.li_part[0]
        # 4. RMSNorm of the stored rows: li * rsqrt(mean(li^2) + norm_eps) * w
        if problem.has_norm:
            for r in fl.parallel(ER):
                b.li_rows[r] = 1.0 / T.sqrt(b.li_rows[r] / T.Cast("float32", D) + norm_eps)
            if fl.on_gpu:
                T.sync_threads()  # the rows were stored by other threads
            for row in T.serial(T.min(NT - t0, ER)):
                weights[0] = b.li_rows[row]  # the row's scale in a register
                for kd in T.serial(T.ceildiv(D, ED)):
                    T.copy(LayerInput[t0 + row, kd * ED:kd * ED + ED], b.stored)
                    T.copy(Norm[kd * ED:kd * ED + ED], b.weight)
                    for d in fl.parallel(ED):
                        b.normed[d] = fl.load_bf16(b.stored[d]) * weights[0] * fl.load_bf16(b.weight[d])
                    for d in fl.parallel(ED):
                        if kd * ED + d < D:
                            LayerInput[t0 + row, kd * ED + d] = fl.store_bf16(b.normed[d])

    def buffers():
        """The block's buffers (shared memory and fragments on the GPU), for its stage."""
        b = SimpleNamespace(carried=fl.shared((ER, n), "float32"))  # the layer input's collapse weights
        if stage != "epilogue":
            b.__dict__.update(
                x=[fl.shared((BT, BD), fl.bf16) for _ in range(n)],  # the GEMM's A side, a tile per stream
                res=[fl.shared((BT, BD), fl.bf16) for _ in range(n if post_first else 0)],  # what post maps
                y=fl.shared((BT, BD) if post_first else (1, 1), fl.bf16),
                gates=fl.shared((BT, n), "float32"),  # post_first: the incoming post
                mixing=fl.shared((BT, n * n), "float32"),  # post_first: the incoming comb
                f=[fl.shared((M, BD), "float32") for _ in range(n)],  # fn's columns of the step
                w=[fl.shared((W, BD), plane) for _ in range(n)],  # the B side: row p M + m is plane p of mix m
                xf=fl.shared((BT, BD) if not fl.on_gpu else (1, 1), "float32"),  # the C target's decoded A side
                acc=fl.fragment((BT, W), "float32"),
                mixes=fl.shared((BT, W), "float32"),
                squares=fl.fragment((BT, BD), "float32"),
                sq=fl.fragment((BT,), "float32"),
            )
            if stage == "fused":
                b.ticket = fl.shared((1,), "int32")
            if problem.collapse != "fresh":  # the layer input's squares
                b.__dict__.update(li_squares=fl.fragment((BT, BD), "float32"), li_sq=fl.fragment((BT,), "float32"))
        if stage != "gemm":
            b.__dict__.update(
                mix=fl.shared((ER, M), "float32"),
                li_rows=fl.shared((ER,), "float32"),  # the layer input's squares, then its norm's scale
            )
            if problem.has_norm:  # the norm pass's stored rows, weights and results
                b.__dict__.update(stored=fl.fragment((ED,), fl.bf16), weight=fl.fragment((ED,), fl.bf16),
                                  normed=fl.fragment((ED,), "float32"))
            if problem.collapse == "fresh":  # the residual rows, the layer input and its squares
                b.__dict__.update(rows=[fl.fragment((ED,), fl.bf16) for _ in range(n)],
                                  li_row=fl.fragment((ED,), "float32"), li_tile=fl.fragment((ED,), "float32"),
                                  li_part=fl.fragment((1,), "float32"))
        return b

    @T.macro
    def fused(Y, Res, PostIn, CombIn, NewRes, Fn, MixParts, SqParts, Tickets, Scale, Base, PreIn, Norm, LayerInput,
              Pre, Post, Comb, rms_eps, pre_eps, sinkhorn_eps, post_mult, iters, norm_eps, chunk,
              bx, s):
        if problem.hidden % 8 == 0:  # rows of 16-byte multiples: the tiles' copies can be TMA
            T.assume(D % 8 == 0)
        b = buffers()
        if stage != "epilogue":
            split_pass(Y, Res, PostIn, CombIn, NewRes, Fn, PreIn, LayerInput, MixParts, SqParts, chunk, bx, s, b)
        if stage == "fused":
            count_in(Tickets, bx, b.ticket)  # the split that draws SP - 1 sees every partial
        if stage == "epilogue" or (stage == "fused" and b.ticket[0] == SP - 1):
            epilogue(NewRes if post_first else Res, MixParts, SqParts, Scale, Base, Norm, LayerInput, Pre, Post, Comb,
                     rms_eps, pre_eps, sinkhorn_eps, post_mult, iters, norm_eps, bx, b)

    grid, threads = ((NT, 1), 128) if stage == "epilogue" else ((T.ceildiv(NT, BT), SP), _threads(config))
    if post_first:
        @T.prim_func
        def mhc_post_pre(
            Y: T.Tensor((NT, D), fl.bf16),
            Res: T.Tensor((NT, n, D), fl.bf16),
            PostIn: T.Tensor((NT, n), "float32"),
            CombIn: T.Tensor((NT, n, n), "float32"),
            NewRes: T.Tensor((NT, n, D), fl.bf16),
            Fn: T.Tensor((M, n, D), "float32"),
            MixParts: T.Tensor((SP, NT, M), "float32"),
            SqParts: T.Tensor((SP, NT, 2), "float32"),
            Tickets: T.Tensor((T.ceildiv(NT, BT),), "int32"),
            Scale: T.Tensor((3,), "float32"),
            Base: T.Tensor((M,), "float32"),
            PreIn: T.Tensor((PR, n), "float32"),
            Norm: T.Tensor((DN,), fl.bf16),
            LayerInput: T.Tensor((NT, D), fl.bf16),
            Pre: T.Tensor((NT, n), "float32"),
            Post: T.Tensor((NT, n), "float32"),
            Comb: T.Tensor((NT, n, n), "float32"),
            rms_eps: T.float32, pre_eps: T.float32, sinkhorn_eps: T.float32, post_mult: T.float32, iters: T.int32,
            norm_eps: T.float32, chunk: T.int32,
        ):
            with T.Kernel(*grid, threads=threads) as (bx, s):
                fused(Y, Res, PostIn, CombIn, NewRes, Fn, MixParts, SqParts, Tickets, Scale, Base, PreIn, Norm,
                      LayerInput, Pre, Post, Comb, rms_eps, pre_eps, sinkhorn_eps, post_mult, iters, norm_eps,
                      chunk, bx, s)

        return mhc_post_pre

    @T.prim_func
    def mhc_pre(
        Res: T.Tensor((NT, n, D), fl.bf16),
        Fn: T.Tensor((M, n, D), "float32"),
        MixParts: T.Tensor((SP, NT, M), "float32"),
        SqParts: T.Tensor((SP, NT, 2), "float32"),
        Tickets: T.Tensor((T.ceildiv(NT, BT),), "int32"),
        Scale: T.Tensor((3,), "float32"),
        Base: T.Tensor((M,), "float32"),
        PreIn: T.Tensor((PR, n), "float32"),
        Norm: T.Tensor((DN,), fl.bf16),
        LayerInput: T.Tensor((NT, D), fl.bf16),
        Pre: T.Tensor((NT, n), "float32"),
        Post: T.Tensor((NT, n), "float32"),
        Comb: T.Tensor((NT, n, n), "float32"),
        rms_eps: T.float32, pre_eps: T.float32, sinkhorn_eps: T.float32, post_mult: T.float32, iters: T.int32,
        norm_eps: T.float32, chunk: T.int32,
    ):
        with T.Kernel(*grid, threads=threads) as (bx, s):
            fused(None, Res, None, None, None, Fn, MixParts, SqParts, Tickets, Scale, Base, PreIn, Norm, LayerInput,
                  Pre, Post, Comb, rms_eps, pre_eps, sinkhorn_eps, post_mult, iters, norm_eps, chunk, bx, s)

    return mhc_pre


def _fused_args(problem: MhcProblem, inputs: dict, config: dict, fl: Flavour, outputs) -> list:
    """The launch's arguments after the GEMM's input: outputs the (layer_input, pre, post, comb) to fill."""
    residual = inputs["residual"]
    device = residual.device
    splits, chunk = split_plan(problem.hidden, config["split_k"], config["block_d"])
    tiles = -(-problem.tokens // config["block_t"])
    # per call, so calls on several streams never share them; unread when the epilogue has its own launch
    tickets = (torch.zeros if config["epilogue"] == "last_split" else torch.empty)(tiles, dtype=torch.int32,
                                                                                  device=device)
    pre_in = inputs["pre_mix"] if problem.collapse == "carried" else placeholder((1, problem.streams), torch.float32, device)
    norm = inputs["norm_weight"] if problem.has_norm else placeholder((1,), torch.bfloat16, device)
    layer_input, pre, post, comb = outputs
    fn = inputs["fn"].view(problem.mixes, problem.streams, problem.hidden)
    return [fl.tma_arg(fn), *empty_partials(problem, splits, device), tickets, inputs["hc_scale"],
            inputs["hc_base"], pre_in, fl.bf16_arg(norm), fl.bf16_arg(layer_input), pre, post, comb,
            float(inputs["rms_eps"]), float(inputs["pre_eps"]), float(inputs["sinkhorn_eps"]),
            float(inputs["post_mult"]), int(inputs["iters"]), float(inputs["norm_eps"]),
            chunk]


def _programs(problem: MhcProblem, config: dict, fl: Flavour, post_first: bool):
    """One fused launch, or the GEMM pass and then the epilogue, a block per token (config "epilogue")."""
    if config["epilogue"] == "last_split":
        return _fused_program(problem, config, fl, post_first)
    return tuple(_fused_program(problem, config, fl, post_first, stage) for stage in ("gemm", "epilogue"))


def _stage_args(config: dict, args: list | None):
    """The launch's arguments, once per stage: both stages read and write the same buffers."""
    return args if args is None or config["epilogue"] == "last_split" else (args, args)


def pre_program(problem: MhcProblem, config: dict, fl: Flavour):
    return _programs(problem, config, fl, post_first=False)


def pre_args(problem: MhcProblem, inputs: dict, config: dict, fl: Flavour, out):
    if problem.tokens == 0:
        return None
    return _stage_args(config, [fl.bf16_arg(fl.tma_arg(inputs["residual"])),
                                *_fused_args(problem, inputs, config, fl, out)])


def post_pre_program(problem: MhcProblem, config: dict, fl: Flavour):
    return _programs(problem, config, fl, post_first=True)


def post_pre_args(problem: MhcProblem, inputs: dict, config: dict, fl: Flavour, out):
    if problem.tokens == 0:
        return None
    return _stage_args(config, [fl.bf16_arg(fl.tma_arg(inputs["y"])), fl.bf16_arg(fl.tma_arg(inputs["residual"])),
                                inputs["post"], inputs["comb"], fl.bf16_arg(out.residual),
                                *_fused_args(problem, inputs, config, fl, out[1:])])


# ---------------------------------------------------------------- tuning spaces

# GPU resources, measured with build_sm90 (nvcc --resource-usage, sm_90a, n = 4): sinkhorn 37..40 and post
# 46 registers across their spaces (sinkhorn 89 at n = 8).


def _shared_bytes(problem: MhcProblem, config: dict) -> int:
    """Shared memory of the one pre launch: the x (and, post_first, residual) tiles and fn's fp32 columns per
    pipeline stage, fn's planes, the accumulator's copy."""
    n, M, BT, BD = problem.streams, problem.mixes, config["block_t"], config["block_d"]
    staged = n * BT * BD * 2 * 2 + BT * BD * 2 + n * M * BD * 4  # x and the post's residual, y, fn (bytes)
    return config["num_stages"] * staged + (n * BD * 2 + BT * 4) * _plane_rows(M, BT)


SHARED_LIMIT = 200 * 1024  # of the 227 KiB a block may take on sm_90a, room for the small buffers and barriers


SINKHORN_SPACE = Space(
    params={"block_b": (64, 128, 256, 512), "threads": (64, 128, 256)},
    gpu_only=("threads",),
    limits={"threads <= block_b (a thread per matrix)": lambda p, c: c["threads"] <= c["block_b"]},
)


def sinkhorn_default(problem: SinkhornProblem) -> dict:
    """A thread per matrix, 128 a program."""
    return {"block_b": 128, "threads": 128}


POST_SPACE = Space(
    params={"block_d": (128, 256, 512, 1024), "threads": (64, 128, 256)},
    gpu_only=("threads",),
    limits={"threads <= block_d (a thread per column)": lambda p, c: c["threads"] <= c["block_d"]},
)


def post_default(problem: MhcProblem) -> dict:
    """512 columns a program, 4 per thread."""
    return {"block_d": 512, "threads": 128}


PRE_SPACE = Space(
    params={"block_t": (16, 32, 64, 128), "block_d": (16, 32, 64), "split_k": (1, 2, 4, 8, 16, 32, 64, 128), "num_stages": (1, 2, 3),
            "epi_block_d": (256, 512, 1024, 2048), "epilogue": ("last_split", "own_launch")},
    gpu_only=("num_stages",),
    limits={"shared memory <= 200 KiB": lambda p, c: _shared_bytes(p, c) <= SHARED_LIMIT},
)


def pre_default(problem: MhcProblem) -> dict:
    """Token tiles of 16 rows (mma.sync) up to 2048 tokens: more tiles, more blocks for the GEMM and, where the
    tiles' last splits run it, for the epilogue; 64 (a warpgroup's wgmma) above. The widest block_d that fits
    shared memory in 2 stages (else 16 in 1 stage: n = 8). From D = 1024 on (smaller D gains nothing from
    splitting) split_k so that tiles x splits stays within the SMs (a block an SM: its shared memory), with at
    least 4 block_d steps a split (decode and 128 tokens: 16 splits; 1024: 2; 8192: 1). The epilogue 2048 columns
    a step, run as `epilogue_launch` says (its own launch, a block per token, at small batches)."""
    block_t = 16 if problem.tokens <= 2048 else 64
    config = next(c for c in ({"block_t": block_t, "block_d": block_d, "split_k": 1, "num_stages": stages,
                               "epi_block_d": 2048}
                              for block_d, stages in ((64, 2), (32, 2), (16, 2), (16, 1)))
                  if not PRE_SPACE.violations(problem, c))
    tiles = -(-max(problem.tokens, 1) // block_t)
    config["epilogue"] = epilogue_launch(problem.tokens, tiles)
    if problem.hidden >= 1024:
        wanted = min(SMS // tiles, problem.hidden // (4 * config["block_d"]))
        config["split_k"] = max(v for v in PRE_SPACE.params["split_k"] if v <= max(1, wanted))
    return config
