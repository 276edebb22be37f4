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
  pre, post_pre: two launches.
    1. GEMM stage, grid (cdiv(T, block_t), splits) with (splits, chunk) = problem.split_plan(D, split_k,
       block_d) from the host (splits as the partials' first dimension, chunk a scalar argument, so the
       model reads the loop's trips from its bounds): program (tile, s) walks its chunk of D in block_d steps. Each step fills
       x [block_t, NS x block_d] (stream j in columns j * block_d ..; NS = n padded to a power of two)
       from the residual, or for post_pre from the post-mapped residual, which it stores to the new
       residual first and rounds to bf16; fn [MP, NS x block_d] (MP = (2 + n) n padded to >= 32) the
       same way; acc [block_t, MP] += x . fn^T (T.gemm, fp32 operands: tf32 on GPU, exact on CPU), and
       the squares add up elementwise in a [block_t, block_d] tile reduced once at the end. Writes
       mix_parts[s, t, :] and sq_parts[s, t, 0].
    2. epilogue, a program per epi_block_t tokens (one source for pre and post_pre):
       split sums in order s = 0, 1, ..; then a thread per token: rms scale, gates, Sinkhorn, stores;
       then the layer input over D in epi_block_d tiles: bf16(sum_i p_i res_i), or stream 0's bf16
       values stored as they are (a select, never a one-hot multiply, which would turn another stream's
       inf into NaN), its squares summed; with a norm weight a second pass rescales the stored row by
       rsqrt(mean(li^2) + norm_eps) * w. The collapse and the norm are run-time flags.
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


# ---------------------------------------------------------------- pre / post_pre: the GEMM stage


def _gemm_program(problem: MhcProblem, config: dict, fl: Flavour, post_first: bool):
    """Split-K partials of x @ fn^T and of sum(x^2) (module docstring, stage 1).

    post_first: x is the post-mapped residual (mhc_post_pre), stored to NewRes on the way.
    """
    n, M, MP, NS = problem.streams, problem.mixes, _mix_slots(problem.streams), next_power_of_2(problem.streams)
    BT, BD = config["block_t"], config["block_d"]
    K = NS * BD
    NT, D, SP = T.dynamic("T"), T.dynamic("D"), T.dynamic("SP")  # SP = splits, allocated by the arguments
    post_column = _post_macro(n, fl)

    @T.macro
    def stage(Y, Res, Post, Comb, NewRes, Fn, MixParts, SqParts, chunk, bx, s):
        x = fl.shared((BT, K), "float32")
        w = fl.shared((MP, K), "float32")
        acc = fl.fragment((BT, MP), "float32")
        squares = fl.fragment((BT, BD), "float32")
        sq = fl.fragment((BT,), "float32")
        res = T.alloc_local((n,), "float32")
        out = T.alloc_local((n,), "float32")
        for r, m in fl.parallel(BT, MP):
            acc[r, m] = 0.0
        for r, d in fl.parallel(BT, BD):
            squares[r, d] = 0.0
        for kd in T.serial(T.ceildiv(T.min(D - s * chunk, chunk), BD)):  # the split's columns
            d0 = s * chunk + kd * BD
            for r, d in fl.parallel(BT, BD):
                if (bx * BT + r < NT) & (d0 + d < D):
                    if post_first:
                        post_column(Y, Res, Post, Comb, NewRes, bx * BT + r, d0 + d, res, out)
                    else:
                        for j in T.unroll(n):
                            out[j] = fl.load_bf16(Res[bx * BT + r, j, d0 + d])
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
        for r, m in fl.parallel(BT, MP):
            if (bx * BT + r < NT) & (m < M):
                MixParts[s, bx * BT + r, m] = acc[r, m]
        for r in fl.parallel(BT):
            if bx * BT + r < NT:
                SqParts[s, bx * BT + r, 0] = sq[r]

    if post_first:
        @T.prim_func
        def mhc_post_gemm(
            Y: T.Tensor((NT, D), fl.bf16),
            Res: T.Tensor((NT, n, D), fl.bf16),
            Post: T.Tensor((NT, n), "float32"),
            Comb: T.Tensor((NT, n, n), "float32"),
            Fn: T.Tensor((M, n, D), "float32"),
            NewRes: T.Tensor((NT, n, D), fl.bf16),
            MixParts: T.Tensor((SP, NT, M), "float32"),
            SqParts: T.Tensor((SP, NT, 2), "float32"),
            chunk: T.int32,
        ):
            with T.Kernel(T.ceildiv(NT, BT), SP, threads=config["threads"]) as (bx, s):
                stage(Y, Res, Post, Comb, NewRes, Fn, MixParts, SqParts, chunk, bx, s)

        return mhc_post_gemm

    @T.prim_func
    def mhc_gemm(
        Res: T.Tensor((NT, n, D), fl.bf16),
        Fn: T.Tensor((M, n, D), "float32"),
        MixParts: T.Tensor((SP, NT, M), "float32"),
        SqParts: T.Tensor((SP, NT, 2), "float32"),
        chunk: T.int32,
    ):
        with T.Kernel(T.ceildiv(NT, BT), SP, threads=config["threads"]) as (bx, s):
            stage(None, Res, None, None, None, Fn, MixParts, SqParts, chunk, bx, s)

    return mhc_gemm


# ---------------------------------------------------------------- pre / post_pre: the epilogue


def _epilogue_program(problem: MhcProblem, config: dict, fl: Flavour):
    """Gates, Sinkhorn and the layer input from the split partials (module docstring, stage 2).

    collapse (the index of problem.collapse in COLLAPSES) and has_norm are run-time flags: PreIn [rows, n] is
    read only when collapse is CARRIED (rows = T), Norm [width] only with has_norm (width = D); otherwise they
    are 1-row placeholders.
    """
    n, M = problem.streams, problem.mixes
    ET, EBD = config["epi_block_t"], config["epi_block_d"]
    NT, D, SP = T.dynamic("T"), T.dynamic("D"), T.dynamic("SP")  # SP: the GEMM stage's splits
    PR, DN = T.dynamic("pre_rows"), T.dynamic("norm_width")
    sinkhorn = _sinkhorn_macro(n)

    @T.prim_func
    def mhc_epilogue(
        Res: T.Tensor((NT, n, D), fl.bf16),
        MixParts: T.Tensor((SP, NT, M), "float32"),
        SqParts: T.Tensor((SP, NT, 2), "float32"),
        Scale: T.Tensor((3,), "float32"),
        Base: T.Tensor((M,), "float32"),
        PreIn: T.Tensor((PR, n), "float32"),
        Norm: T.Tensor((DN,), fl.bf16),
        LayerInput: T.Tensor((NT, D), fl.bf16),
        Pre: T.Tensor((NT, n), "float32"),
        Post: T.Tensor((NT, n), "float32"),
        Comb: T.Tensor((NT, n, n), "float32"),
        rms_eps: T.float32,
        pre_eps: T.float32,
        sinkhorn_eps: T.float32,
        post_mult: T.float32,
        iters: T.int32,
        norm_eps: T.float32,
        collapse: T.int32,
        has_norm: T.int32,
    ):
        with T.Kernel(T.ceildiv(NT, ET), threads=config["epi_threads"]) as bx:
            mix = fl.shared((ET, M), "float32")
            p = fl.shared((ET, n), "float32")  # the collapse weights
            inv_rms = fl.shared((ET,), "float32")
            squares = fl.fragment((ET, EBD), "float32")
            sq = fl.fragment((ET,), "float32")
            m = T.alloc_local((n * n,), "float32")
            sums = T.alloc_local((n,), "float32")
            total = T.alloc_var("float32")
            rstd = T.alloc_var("float32")
            gate = T.alloc_var("float32")

            # 1. split sums, in split order
            for r, k in fl.parallel(ET, M):
                total = 0.0
                for s in T.serial(SP):
                    total = total + MixParts[s, T.min(bx * ET + r, NT - 1), k]
                mix[r, k] = total

            # 2. a thread per token: rms scale, gates, Sinkhorn
            for r in fl.parallel(ET):
                t = T.min(bx * ET + r, NT - 1)
                total = 0.0
                for s in T.serial(SP):
                    total = total + SqParts[s, t, 0]
                rstd = 1.0 / T.sqrt(total / T.Cast("float32", n * D) + rms_eps)
                for i in T.unroll(n):
                    gate = 1.0 / (1.0 + T.exp(-(mix[r, i] * rstd * Scale[0] + Base[i]))) + pre_eps
                    p[r, i] = T.if_then_else(collapse == CARRIED, PreIn[T.min(t, PR - 1), i], gate)
                    if bx * ET + r < NT:
                        Pre[t, i] = gate
                        Post[t, i] = 1.0 / (1.0 + T.exp(-(mix[r, n + i] * rstd * Scale[1] + Base[n + i]))) * post_mult
                for k in T.unroll(n * n):
                    m[k] = mix[r, 2 * n + k] * rstd * Scale[2] + Base[2 * n + k]
                sinkhorn(m, sums, iters, sinkhorn_eps)
                if bx * ET + r < NT:
                    for k in T.unroll(n * n):
                        Comb[t, k // n, k % n] = m[k]

            # 3. layer input = bf16(sum_i p_i res_i) or stream 0 as it is, stored; the squares of the stored values
            #    add up
            for r, d in fl.parallel(ET, EBD):
                squares[r, d] = 0.0
            for kd in T.serial(T.ceildiv(D, EBD)):
                for r, d in fl.parallel(ET, EBD):
                    if (bx * ET + r < NT) & (kd * EBD + d < D):
                        if collapse == STREAM0:
                            LayerInput[bx * ET + r, kd * EBD + d] = Res[bx * ET + r, 0, kd * EBD + d]
                            total = fl.load_bf16(Res[bx * ET + r, 0, kd * EBD + d])
                        else:
                            total = 0.0
                            for i in T.unroll(n):
                                total = total + p[r, i] * fl.load_bf16(Res[bx * ET + r, i, kd * EBD + d])
                            total = fl.round_bf16(total)
                            LayerInput[bx * ET + r, kd * EBD + d] = fl.store_bf16(total)
                        squares[r, d] = squares[r, d] + total * total

            # 4. RMSNorm of the stored rows: li * rsqrt(mean(li^2) + norm_eps) * w
            if has_norm != 0:
                T.reduce_sum(squares, sq, dim=1)
                for r in fl.parallel(ET):
                    inv_rms[r] = 1.0 / T.sqrt(sq[r] / T.Cast("float32", D) + norm_eps)
                if fl.on_gpu:
                    T.sync_threads()  # the rows were stored by other threads
                for kd in T.serial(T.ceildiv(D, EBD)):
                    for r, d in fl.parallel(ET, EBD):
                        if (bx * ET + r < NT) & (kd * EBD + d < D):
                            LayerInput[bx * ET + r, kd * EBD + d] = fl.store_bf16(
                                fl.load_bf16(LayerInput[bx * ET + r, kd * EBD + d]) * inv_rms[r]
                                * fl.load_bf16(Norm[T.min(kd * EBD + d, DN - 1)]))

    return mhc_epilogue


def _epilogue_args(problem: MhcProblem, inputs: dict, fl: Flavour, residual, partials, outputs) -> list:
    """Epilogue arguments: residual is the stage's input (the new residual for post_pre); outputs the
    (layer_input, pre, post, comb) to fill."""
    device = residual.device
    pre_in = inputs["pre_mix"] if problem.collapse == "carried" else torch.zeros((1, problem.streams), device=device)
    norm = inputs["norm_weight"] if problem.has_norm else torch.zeros(1, dtype=torch.bfloat16, device=device)
    layer_input, pre, post, comb = outputs
    return [fl.bf16_arg(residual), *partials, inputs["hc_scale"], inputs["hc_base"], pre_in, fl.bf16_arg(norm),
            fl.bf16_arg(layer_input), pre, post, comb, float(inputs["rms_eps"]), float(inputs["pre_eps"]),
            float(inputs["sinkhorn_eps"]), float(inputs["post_mult"]), int(inputs["iters"]),
            float(inputs["norm_eps"]), COLLAPSES.index(problem.collapse), int(problem.has_norm)]


def _partials(problem: MhcProblem, config: dict, device):
    """The GEMM stage's partial sums, one slice per split of the config's plan, and its chunk of columns."""
    splits, chunk = split_plan(problem.hidden, config["split_k"], config["block_d"])
    return empty_partials(problem, splits, device), chunk


def _fn_arg(problem: MhcProblem, fn):
    """fn [(2+n)n, n * D] as the kernels take it: [(2+n)n, n, D]."""
    return fn.view(problem.mixes, problem.streams, problem.hidden)


def pre_program(problem: MhcProblem, config: dict, fl: Flavour):
    """(GEMM stage over the residual, epilogue)."""
    return _gemm_program(problem, config, fl, post_first=False), _epilogue_program(problem, config, fl)


def pre_args(problem: MhcProblem, inputs: dict, config: dict, fl: Flavour, out):
    if problem.tokens == 0:
        return None
    residual = inputs["residual"]
    partials, chunk = _partials(problem, config, residual.device)
    gemm = [fl.bf16_arg(residual), _fn_arg(problem, inputs["fn"]), *partials, chunk]
    return gemm, _epilogue_args(problem, inputs, fl, residual, partials, out)


def post_pre_program(problem: MhcProblem, config: dict, fl: Flavour):
    """(GEMM stage over the post-mapped residual, which it stores; the epilogue of mhc_pre over that)."""
    return _gemm_program(problem, config, fl, post_first=True), _epilogue_program(problem, config, fl)


def post_pre_args(problem: MhcProblem, inputs: dict, config: dict, fl: Flavour, out):
    if problem.tokens == 0:
        return None
    residual = inputs["residual"]
    partials, chunk = _partials(problem, config, residual.device)
    gemm = [fl.bf16_arg(inputs["y"]), fl.bf16_arg(residual), inputs["post"], inputs["comb"],
            _fn_arg(problem, inputs["fn"]), fl.bf16_arg(out.residual), *partials, chunk]
    return gemm, _epilogue_args(problem, inputs, fl, out.residual, partials, out[1:])


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
            "threads": (128, 256), "epi_block_t": (1, 2, 4), "epi_block_d": (128, 256, 512, 1024),
            "epi_threads": (128, 256)},
    gpu_only=("threads", "epi_threads"),
    limits={
        "warps <= (block_t / 16) x (MP / 8) (MMA pieces)":
            lambda p, c: c["threads"] // 32 <= c["block_t"] // 16 * (_mix_slots(p.streams) // 8),
        "block_t x block_d / threads <= 8 (registers)": lambda p, c: _gemm_loads(p, c)[0] <= 8,
        "MP x NS x block_d / threads <= 32 (registers)": lambda p, c: _gemm_loads(p, c)[1] <= 32,
        "epi_threads <= epi_block_t x epi_block_d (a thread per element)":
            lambda p, c: c["epi_threads"] <= c["epi_block_t"] * c["epi_block_d"],
    },
)

SMS = 132  # H100 / H200


def pre_default(problem: MhcProblem) -> dict:
    """64-token tiles, 8 warps, the widest block_d within the register limits; from D = 1024 on (smaller D gains
    nothing from splitting) split_k so that tiles x splits is about 2 x SMS, with at least 4 block_d steps a split
    (decode: 32 splits; prefill of 8192 tokens: 2); an epilogue program per token, 512 columns a step.
    Few distinct configs, so the tests compile few kernels."""
    config = next(c for c in (
        {"block_t": 64, "block_d": block_d, "split_k": 1, "threads": 256, "epi_block_t": 1, "epi_block_d": 512,
         "epi_threads": 128} for block_d in (32, 16, 8)) if not PRE_SPACE.violations(problem, c))
    if problem.hidden >= 1024:
        tiles = -(-max(problem.tokens, 1) // config["block_t"])
        wanted = min(2 * SMS // tiles, problem.hidden // (4 * config["block_d"]))
        config["split_k"] = max(v for v in PRE_SPACE.params["split_k"] if v <= max(1, wanted))
    return config
