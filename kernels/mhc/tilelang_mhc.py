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
             streams there and writes all n new streams (the `post_column` macro, shared with the GEMM stage).
  pre, post_pre: one launch, grid (splits, cdiv(T, block_t)) with problem.split_plan(D, split_k, block_d)
    evaluated at run time.
    1. GEMM stage: program (s, tile) walks its chunk of D in block_d steps. Each step fills
       x [block_t, NS x block_d] (stream j in columns j * block_d ..; NS = n padded to a power of two)
       from the residual, or for post_pre from the post-mapped residual, which it stores to the new
       residual first and rounds to bf16; fn [MP, NS x block_d] (MP = (2 + n) n padded to >= 32) the
       same way; acc [block_t, MP] += x . fn^T (T.gemm, fp32 operands: tf32 on GPU, exact on CPU), and
       the squares add up elementwise in a [block_t, block_d] tile reduced once at the end. The collapses
       that need no gates (carried pre_mix, stream 0) store the layer input from the same step and sum its
       squares. Writes mix_parts[s, t, :] and sq_parts[s, t, :].
    2. ticket: a CTA barrier, then one thread's acq_rel atomic add on the tile's counter; the split that
       draws splits - 1 arrived last and sees every partial.
    3. its epilogue: split sums in order s = 0, 1, ..; a thread per token of the tile: rms scale, gates,
       Sinkhorn, stores; then epi_block_t tokens at a time the "fresh" layer input over D in epi_block_d
       tiles, bf16(sum_i pre_i res_i) (re-reading what the tile's splits just read: L2 at decode), its
       squares summed; with a norm weight a last pass rescales the stored row by rsqrt(mean(li^2) +
       norm_eps) * w. The collapse and the norm are run-time flags. Stream 0 is stored as its bf16 bits
       (a select, never a one-hot multiply, which would turn another stream's inf into NaN).
T, D and the split count are dynamic and the scalars (iters, the epsilons, post_mult) are run-time
arguments, so one compiled kernel per source serves every shape. The CPU flavour takes bf16 as uint16
bits; the index math and the summation order are the same for both targets, and fixed, so repeated
runs are bitwise identical.
"""

# No `from __future__ import annotations`: TileLang evaluates T.Tensor annotations against the closure.
import tilelang.language as T
import torch
from flashkern.autotune.space import Space
from flashkern.kernels.tiles import next_power_of_2
from flashkern.kernels._tilelang import Flavour
from flashkern.kernels.mhc.problem import (
    MhcProblem,
    SinkhornProblem,
    empty_partials,
    split_plan,
)
from flashkern.reference.mhc import COLLAPSES

CARRIED, STREAM0 = COLLAPSES.index("carried"), COLLAPSES.index("stream0")  # the epilogue's `collapse` flag


def _mix_slots(streams: int) -> int:
    """GEMM output columns: the (2 + n) n mixes padded to a power of two of at least 32."""
    return max(32, next_power_of_2((2 + streams) * streams))


def _split_plan(hidden, config: dict):
    """problem.split_plan(D, split_k, block_d) for a run-time D: (splits, chunk) as expressions."""
    tiles = T.ceildiv(hidden, config["block_d"])
    per_split = T.ceildiv(tiles, T.min(config["split_k"], tiles))
    return T.ceildiv(tiles, per_split), per_split * config["block_d"]


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
        for it in T.serial(iters):
            if it > 0:
                for i in T.unroll(n):
                    sums[i] = 0.0
                    for j in T.unroll(n):
                        sums[i] = sums[i] + m[i * n + j]
                for k in T.unroll(n * n):
                    m[k] = m[k] / (sums[k // n] + eps)
            for j in T.unroll(n):
                sums[j] = 0.0
                for i in T.unroll(n):
                    sums[j] = sums[j] + m[i * n + j]
            for k in T.unroll(n * n):
                m[k] = m[k] / (sums[k % n] + eps)

    return sinkhorn


def _post_macro(n: int, fl: Flavour):
    """The post mapping of one column of one token (a thread's work)."""

    @T.macro
    def post_column(Y, Res, Post, Comb, Out, t, d, res, out):
        """Out[t, j, d] = bf16(sum_i comb[i, j] res_i + post_j y) for every stream j; out [n] keeps the rounded
        values as fp32; res: local scratch [n]."""
        for i in T.unroll(n):
            res[i] = fl.load_bf16(Res[t, i, d])
        for j in T.unroll(n):
            out[j] = 0.0
            for i in T.unroll(n):
                out[j] = out[j] + Comb[t, i, j] * res[i]
            out[j] = fl.round_bf16(out[j] + Post[t, j] * fl.load_bf16(Y[t, d]))
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
            res = T.alloc_local((n,), "float32")
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


def _pre_program(problem: MhcProblem, config: dict, fl: Flavour, post_first: bool):
    """mhc_pre (post_first: mhc_post_pre) in one launch (module docstring).

    collapse (the index of problem.collapse in COLLAPSES) and has_norm are run-time flags: PreIn [rows, n] is
    read only when collapse is CARRIED (rows = T), Norm [width] only with has_norm (width = D); otherwise they
    are 1-row placeholders. Without post_first, Y, Post and Comb are 1-row placeholders and NewRes is Res.
    """
    n, M, MP, NS = problem.streams, problem.mixes, _mix_slots(problem.streams), next_power_of_2(problem.streams)
    BT, BD, ET, EBD = config["block_t"], config["block_d"], config["epi_block_t"], config["epi_block_d"]
    K = NS * BD
    NT, D, SP = T.dynamic("T"), T.dynamic("D"), T.dynamic("SP")  # SP = splits, allocated by the arguments
    PR, DN, YR = T.dynamic("pre_rows"), T.dynamic("norm_width"), T.dynamic("y_rows")
    splits, chunk = _split_plan(D, config)
    post_column = _post_macro(n, fl)
    sinkhorn = _sinkhorn_macro(n)

    @T.macro
    def stage(Y, Res, Post, Comb, NewRes, Fn, PreIn, LayerInput, MixParts, SqParts, collapse, has_norm, bx, s):
        """Split s of token tile bx: partial mixes and squares; the layer input of the gate-free collapses."""
        x = fl.shared((BT, K), "float32")
        w = fl.shared((MP, K), "float32")
        acc = fl.fragment((BT, MP), "float32")
        squares = fl.fragment((BT, BD), "float32")
        li_squares = fl.fragment((BT, BD), "float32")
        sq = fl.fragment((BT,), "float32")
        li_sq = fl.fragment((BT,), "float32")
        res = T.alloc_local((n,), "float32")
        out = T.alloc_local((n,), "float32")
        li = T.alloc_var("float32")
        T.clear(acc)
        T.clear(squares)
        T.clear(li_squares)
        for kd in T.serial(T.ceildiv(T.min(D - s * chunk, chunk), BD)):  # the split's columns
            d0 = s * chunk + kd * BD
            for r, d in fl.parallel(BT, BD):
                if (bx * BT + r < NT) & (d0 + d < D):
                    if post_first:
                        post_column(Y, Res, Post, Comb, NewRes, bx * BT + r, d0 + d, res, out)
                    else:
                        for j in T.unroll(n):
                            out[j] = fl.load_bf16(Res[bx * BT + r, j, d0 + d])
                    # the layer input of the collapses that need no gates, from this tile
                    if collapse == STREAM0:
                        if post_first:  # the stored new residual's value
                            LayerInput[bx * BT + r, d0 + d] = fl.store_bf16(out[0])
                        else:  # the bits, copied
                            LayerInput[bx * BT + r, d0 + d] = Res[bx * BT + r, 0, d0 + d]
                        li_squares[r, d] = li_squares[r, d] + out[0] * out[0]
                    elif collapse == CARRIED:
                        li = 0.0
                        for j in T.unroll(n):
                            li = li + PreIn[T.min(bx * BT + r, PR - 1), j] * out[j]
                        li = fl.round_bf16(li)
                        LayerInput[bx * BT + r, d0 + d] = fl.store_bf16(li)
                        li_squares[r, d] = li_squares[r, d] + li * li
                else:
                    for j in T.unroll(n):
                        out[j] = 0.0
                for j in T.unroll(NS):
                    x[r, j * BD + d] = T.if_then_else(j < n, out[T.min(j, n - 1)], 0.0)
                for j in T.unroll(n):
                    squares[r, d] = squares[r, d] + out[j] * out[j]
            for m, k in fl.parallel(MP, K):
                w[m, k] = T.if_then_else(
                    (m < M) & (k // BD < n) & (d0 + k % BD < D),
                    Fn[T.min(m, M - 1), T.min(k // BD, n - 1), T.min(d0 + k % BD, D - 1)], 0.0)
            T.gemm(x, w, acc, transpose_B=True)
        T.reduce_sum(squares, sq, dim=1)
        T.reduce_sum(li_squares, li_sq, dim=1)
        for r, m in fl.parallel(BT, MP):
            if (bx * BT + r < NT) & (m < M):
                MixParts[s, bx * BT + r, m] = acc[r, m]
        for r in fl.parallel(BT):
            if bx * BT + r < NT:
                SqParts[s, bx * BT + r, 0] = sq[r]
                SqParts[s, bx * BT + r, 1] = li_sq[r]

    @T.macro
    def epilogue(NewRes, MixParts, SqParts, Scale, Base, Norm, LayerInput, Pre, Post_, Comb_, rms_eps, pre_eps,
                 sinkhorn_eps, post_mult, iters, norm_eps, collapse, has_norm, bx):
        """Token tile bx: split sums, gates and Sinkhorn (a thread per token); then epi_block_t tokens at a time
        the "fresh" layer input and the norm."""
        mix = fl.shared((BT, M + 1), "float32")  # the mixes, then the layer input's sum of squares
        p = fl.shared((BT, n), "float32")  # the fresh collapse's weights
        inv_rms = fl.shared((ET,), "float32")
        squares = fl.fragment((ET, EBD), "float32")
        sq = fl.fragment((ET,), "float32")
        m = T.alloc_local((n * n,), "float32")
        sums = T.alloc_local((n,), "float32")
        total = T.alloc_var("float32")
        rstd = T.alloc_var("float32")
        gate = T.alloc_var("float32")
        t0 = bx * BT

        # 1. split sums, in split order (rows past T sum nothing)
        for r, k in fl.parallel(BT, M):
            total = 0.0
            if t0 + r < NT:
                for s in T.serial(SP):
                    total = total + MixParts[s, t0 + r, k]
            mix[r, k] = total

        # 2. a thread per token: rms scale, gates, Sinkhorn
        for r in fl.parallel(BT):
            t = T.min(t0 + r, NT - 1)
            total = 0.0
            gate = 0.0  # the layer input's squares, then each gate
            if t0 + r < NT:
                for s in T.serial(SP):
                    total = total + SqParts[s, t, 0]
                    gate = gate + SqParts[s, t, 1]
            mix[r, M] = gate
            rstd = 1.0 / T.sqrt(total / T.Cast("float32", n * D) + rms_eps)
            for i in T.unroll(n):
                gate = 1.0 / (1.0 + T.exp(-(mix[r, i] * rstd * Scale[0] + Base[i]))) + pre_eps
                p[r, i] = gate
                if t0 + r < NT:
                    Pre[t, i] = gate
                    Post_[t, i] = 1.0 / (1.0 + T.exp(-(mix[r, n + i] * rstd * Scale[1] + Base[n + i]))) * post_mult
            for k in T.unroll(n * n):
                m[k] = mix[r, 2 * n + k] * rstd * Scale[2] + Base[2 * n + k]
            sinkhorn(m, sums, iters, sinkhorn_eps)
            if t0 + r < NT:
                for k in T.unroll(n * n):
                    Comb_[t, k // n, k % n] = m[k]

        for e in T.serial(T.ceildiv(T.min(BT, NT - t0), ET)):  # the tile's sub-blocks that hold tokens
            te = t0 + e * ET
            # 3. the "fresh" layer input bf16(sum_i pre_i res_i) needs the gates: one more pass over the residual
            #    (the other collapses were stored by the GEMM stage, their squares summed in mix[:, M])
            if (collapse != CARRIED) & (collapse != STREAM0):
                T.clear(squares)
                for kd in T.serial(T.ceildiv(D, EBD)):
                    for r, d in fl.parallel(ET, EBD):
                        if (te + r < NT) & (kd * EBD + d < D):
                            total = 0.0
                            for i in T.unroll(n):
                                total = total + p[e * ET + r, i] * fl.load_bf16(NewRes[te + r, i, kd * EBD + d])
                            total = fl.round_bf16(total)
                            LayerInput[te + r, kd * EBD + d] = fl.store_bf16(total)
                            squares[r, d] = squares[r, d] + total * total
                T.reduce_sum(squares, sq, dim=1)
                for r in fl.parallel(ET):
                    mix[e * ET + r, M] = sq[r]

            # 4. RMSNorm of the stored rows: li * rsqrt(mean(li^2) + norm_eps) * w
            if has_norm != 0:
                for r in fl.parallel(ET):
                    inv_rms[r] = 1.0 / T.sqrt(mix[e * ET + r, M] / T.Cast("float32", D) + norm_eps)
                if fl.on_gpu:
                    T.sync_threads()  # the rows were stored by other threads (and CTAs)
                for kd in T.serial(T.ceildiv(D, EBD)):
                    for r, d in fl.parallel(ET, EBD):
                        if (te + r < NT) & (kd * EBD + d < D):
                            LayerInput[te + r, kd * EBD + d] = fl.store_bf16(
                                fl.load_bf16(LayerInput[te + r, kd * EBD + d]) * inv_rms[r]
                                * fl.load_bf16(Norm[T.min(kd * EBD + d, DN - 1)]))

    @T.prim_func
    def mhc_pre(
        Y: T.Tensor((YR, D), fl.bf16),
        Res: T.Tensor((NT, n, D), fl.bf16),
        Post: T.Tensor((YR, n), "float32"),
        Comb: T.Tensor((YR, n, n), "float32"),
        Fn: T.Tensor((M, n, D), "float32"),
        NewRes: T.Tensor((NT, n, D), fl.bf16),
        MixParts: T.Tensor((SP, NT, M), "float32"),
        SqParts: T.Tensor((SP, NT, 2), "float32"),
        Tickets: T.Tensor((T.ceildiv(NT, BT),), "int32"),
        Scale: T.Tensor((3,), "float32"),
        Base: T.Tensor((M,), "float32"),
        PreIn: T.Tensor((PR, n), "float32"),
        Norm: T.Tensor((DN,), fl.bf16),
        LayerInput: T.Tensor((NT, D), fl.bf16),
        Pre: T.Tensor((NT, n), "float32"),
        PostOut: T.Tensor((NT, n), "float32"),
        CombOut: T.Tensor((NT, n, n), "float32"),
        rms_eps: T.float32,
        pre_eps: T.float32,
        sinkhorn_eps: T.float32,
        post_mult: T.float32,
        iters: T.int32,
        norm_eps: T.float32,
        collapse: T.int32,
        has_norm: T.int32,
    ):
        with T.Kernel(splits, T.ceildiv(NT, BT), threads=config["threads"]) as (s, bx):
            ticket = fl.shared((1,), "int32")
            stage(Y, Res, Post, Comb, NewRes, Fn, PreIn, LayerInput, MixParts, SqParts, collapse, has_norm, bx, s)
            # the tile's splits count in; the last to arrive sees every partial (a CTA barrier, then one acq_rel
            # atomic by one thread, its value shared)
            if fl.on_gpu:
                T.sync_threads()
                if T.get_thread_binding() == 0:
                    ticket[0] = T.atomic_add(Tickets[bx], 1, memory_order="acq_rel", return_prev=True)
                T.sync_threads()
            else:
                ticket[0] = T.atomic_add(Tickets[bx], 1, memory_order="acq_rel", return_prev=True)
            if ticket[0] == SP - 1:
                epilogue(NewRes, MixParts, SqParts, Scale, Base, Norm, LayerInput, Pre, PostOut, CombOut, rms_eps,
                         pre_eps, sinkhorn_eps, post_mult, iters, norm_eps, collapse, has_norm, bx)

    return mhc_pre


def _pre_arguments(problem: MhcProblem, inputs: dict, config: dict, fl: Flavour, post_inputs: tuple | None,
                   new_residual, outputs) -> list:
    """The launch's arguments; post_inputs (y, post, comb) for mhc_post_pre, whose new residual is stored to
    new_residual; outputs the (layer_input, pre, post, comb) to fill."""
    if problem.tokens == 0:
        return None
    residual = inputs["residual"]
    device = residual.device
    splits = split_plan(problem.hidden, config["split_k"], config["block_d"])[0]
    scratch = empty_partials(problem, splits, -(-problem.tokens // config["block_t"]), device)
    n = problem.streams
    y, post, comb = post_inputs or (torch.zeros((1, problem.hidden), dtype=torch.bfloat16, device=device),
                                    torch.zeros((1, n), device=device), torch.zeros((1, n, n), device=device))
    pre_in = inputs["pre_mix"] if problem.collapse == "carried" else torch.zeros((1, n), device=device)
    norm = inputs["norm_weight"] if problem.has_norm else torch.zeros(1, dtype=torch.bfloat16, device=device)
    layer_input, pre, post_out, comb_out = outputs
    return [fl.bf16_arg(y), fl.bf16_arg(residual), post, comb,
            inputs["fn"].view(problem.mixes, n, problem.hidden), fl.bf16_arg(new_residual), *scratch,
            inputs["hc_scale"], inputs["hc_base"], pre_in, fl.bf16_arg(norm), fl.bf16_arg(layer_input), pre,
            post_out, comb_out, float(inputs["rms_eps"]), float(inputs["pre_eps"]), float(inputs["sinkhorn_eps"]),
            float(inputs["post_mult"]), int(inputs["iters"]), float(inputs["norm_eps"]),
            COLLAPSES.index(problem.collapse), int(problem.has_norm)]


def pre_program(problem: MhcProblem, config: dict, fl: Flavour):
    """The GEMM stage over the residual, its last split the epilogue."""
    return _pre_program(problem, config, fl, post_first=False)


def pre_args(problem: MhcProblem, inputs: dict, config: dict, fl: Flavour, out):
    return _pre_arguments(problem, inputs, config, fl, None, inputs["residual"], out)


def post_pre_program(problem: MhcProblem, config: dict, fl: Flavour):
    """The GEMM stage over the post-mapped residual, which it stores; its last split the epilogue of mhc_pre over
    that."""
    return _pre_program(problem, config, fl, post_first=True)


def post_pre_args(problem: MhcProblem, inputs: dict, config: dict, fl: Flavour, out):
    return _pre_arguments(problem, inputs, config, fl, (inputs["y"], inputs["post"], inputs["comb"]), out.residual,
                          out[1:])


# ---------------------------------------------------------------- tuning spaces

# GPU resources, measured with build_sm90 (nvcc --resource-usage, sm_90a, n = 4): sinkhorn 37..40 and post
# 46 registers across their spaces (sinkhorn 89 at n = 8); the epilogue 48 (96 at n = 8; with epi_block_t > 1
# the norm's row sums take a 4 x epi_block_t byte stack frame, not a spill). The GEMM stage unrolls its tile
# loads, so its registers grow with the x loads per thread (block_t x block_d / threads, n residual reads each,
# more with the post mapping) and the fn loads (MP x NS x block_d / threads). At (x, fn) loads per thread:
#   post_pre  (4, 8) 100, (4, 32) 141, (8, 16) 156, (8, 32) 164..168, (16, 32) 230, (8, 64) 254
#   pre       (8, 16) 96, (4, 32) 156, (8, 32) 164..168, (16, 32) 168
# none spilling, but the last ones sit at the 255 cap: at most 8 and 32 then, which also bounds shared memory
# ((block_t + MP) x NS x block_d fp32 tiles) to 96 KiB. The MMA (fp32 operands: tf32 mma.sync 16 x 8 x 8, no
# wgmma) needs the warps to tile [block_t, MP] in 16 x 8 pieces.


def _gemm_loads(problem: MhcProblem, config: dict) -> tuple[int, int]:
    """Per-thread loads of one GEMM-stage step: (x elements, fn elements)."""
    per_step = config["block_d"] * next_power_of_2(problem.streams)
    return (config["block_t"] * config["block_d"] // config["threads"],
            _mix_slots(problem.streams) * per_step // config["threads"])


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
    params={"block_t": (16, 32, 64), "block_d": (8, 16, 32, 64), "split_k": (1, 2, 4, 8, 16, 32),
            "threads": (128, 256), "epi_block_t": (1, 2, 4), "epi_block_d": (128, 256, 512, 1024)},
    gpu_only=("threads",),
    limits={
        "warps <= (block_t / 16) x (MP / 8) (MMA pieces)":
            lambda p, c: c["threads"] // 32 <= c["block_t"] // 16 * (_mix_slots(p.streams) // 8),
        "block_t x block_d / threads <= 8 (registers)": lambda p, c: _gemm_loads(p, c)[0] <= 8,
        "MP x NS x block_d / threads <= 32 (registers)": lambda p, c: _gemm_loads(p, c)[1] <= 32,
        "threads <= epi_block_t x epi_block_d (a thread per epilogue element)":
            lambda p, c: c["threads"] <= c["epi_block_t"] * c["epi_block_d"],
    },
)

SMS = 132  # H100 / H200


def pre_default(problem: MhcProblem) -> dict:
    """64-token tiles on 8 warps (16 on 4 warps up to 16 tokens: the last split sums and gates a whole tile), the
    widest block_d within the register limits; from D = 1024 on (smaller D gains
    nothing from splitting) split_k so that tiles x splits is about 2 x SMS, with at least 4 block_d steps a split
    (decode: 32 splits; prefill of 8192 tokens: 2); the last split of a tile runs the epilogue a token at a time,
    512 columns a step. Few distinct configs, so the tests compile few kernels."""
    block_t = 16 if problem.tokens <= 16 else 64
    config = next(c for c in (
        {"block_t": block_t, "block_d": block_d, "split_k": 1, "threads": 256 if block_t == 64 else 128,
         "epi_block_t": 1, "epi_block_d": 512}
        for block_d in (32, 16, 8)) if not PRE_SPACE.violations(problem, c))
    if problem.hidden >= 1024:
        tiles = -(-max(problem.tokens, 1) // config["block_t"])
        wanted = min(2 * SMS // tiles, problem.hidden // (4 * config["block_d"]))
        config["split_k"] = max(v for v in PRE_SPACE.params["split_k"] if v <= max(1, wanted))
    return config
