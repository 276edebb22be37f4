"""MoE routing in TileLang: one source for CUDA and the CPU (C) target, one launch per call.

Tile plan: a block owns BLOCK_T token rows and the whole expert axis as x[BLOCK_T, G, EG]
(expert g * EG + j at [., g, j]); every step is a parallel map or a row reduction over it:
  1. s = score(x), b = s + bias (NaN keys -> lowest finite)
  2. groups: gscore = top-2 sum of b per group; TOPK_GROUP rounds of (max, lowest id) pick the
     groups to keep; b = -inf elsewhere
  3. K rounds: m = row max of b; a = lowest expert id where b == m; gather s at a; b[a] = -inf
  4. renormalize, scale; invalid rows -> (id -1, weight 0)
Reductions run in two stages (over j, then over g). Argmax is (max, then min of the ids at the
max), so ties go to the lowest expert id on both targets.
The fused-gate program computes x with T.gemm over D in BLOCK_D steps first
(h RMS-normalized and rounded to bf16 when a norm weight is given, as the reference does).
"""

# No `from __future__ import annotations`: TileLang evaluates T.Tensor annotations against the closure.
import tilelang.language as T
import torch

from flashkern.autotune.space import Space
from flashkern.kernels._tilelang import Flavour
from flashkern.kernels.moe_route.problem import empty_outputs

LOWEST = -3.4028234663852886e38  # lowest finite fp32: NaN keys rank here, below every number
NO_ID = 1.0e9  # larger than any expert id; ids travel as exact fp32 integers through min-reductions


def _route_macro(problem, block_t: int, fl: Flavour):
    """The routing steps 1-4 for a [block_t, G, EG] logits tile, as a TileLang macro."""
    r = problem.routing
    E, G, K, TOPK_GROUP = r.experts, r.n_group, r.top_k, r.topk_group
    EG = E // G
    BT = block_t
    NEG_INF = -T.infinity("float32")

    @T.macro
    def route(x, row0, n_rows, Bias, Valid, Weights, Ids):
        s = fl.fragment((BT, G, EG), "float32")
        b = fl.fragment((BT, G, EG), "float32")
        scratch = fl.fragment((BT, G, EG), "float32")
        per_group = fl.fragment((BT, G), "float32")
        per_row = fl.fragment((BT,), "float32")
        picked = fl.fragment((BT,), "float32")
        w_sel = fl.fragment((BT, K), "float32")
        id_sel = fl.fragment((BT, K), "float32")

        # 1. scores and selection keys
        if r.score == "sqrtsoftplus":  # sqrt(max(x, 0) + log1p(exp(-|x|))), log1p by Goldberg's correction
            for i, g, j in fl.parallel(BT, G, EG):
                scratch[i, g, j] = T.exp(-T.max(x[i, g, j], -x[i, g, j]))
            for i, g, j in fl.parallel(BT, G, EG):
                s[i, g, j] = T.sqrt(T.max(x[i, g, j], 0.0) + T.if_then_else(
                    1.0 + scratch[i, g, j] == 1.0, scratch[i, g, j],
                    T.log(1.0 + scratch[i, g, j]) * scratch[i, g, j] / ((1.0 + scratch[i, g, j]) - 1.0)))
        elif r.score == "sigmoid":
            for i, g, j in fl.parallel(BT, G, EG):
                s[i, g, j] = 1.0 / (1.0 + T.exp(-x[i, g, j]))
        else:  # softmax over the experts of a row
            T.reduce_max(x, per_group, dim=2)
            T.reduce_max(per_group, per_row, dim=1)
            for i, g, j in fl.parallel(BT, G, EG):
                scratch[i, g, j] = T.exp(x[i, g, j] - per_row[i])
            T.reduce_sum(scratch, per_group, dim=2)
            T.reduce_sum(per_group, per_row, dim=1)
            for i, g, j in fl.parallel(BT, G, EG):
                s[i, g, j] = scratch[i, g, j] / per_row[i]
        for i, g, j in fl.parallel(BT, G, EG):
            if problem.has_bias:
                b[i, g, j] = s[i, g, j] + Bias[g * EG + j]
            else:
                b[i, g, j] = s[i, g, j]
        for i, g, j in fl.parallel(BT, G, EG):
            b[i, g, j] = T.if_then_else(b[i, g, j] == b[i, g, j], T.max(b[i, g, j], LOWEST), LOWEST)

        # 2. group limiting
        if G > 1:
            top1 = fl.fragment((BT, G), "float32")
            gscore = fl.fragment((BT, G), "float32")
            keep = fl.fragment((BT, G), "float32")
            T.reduce_max(b, top1, dim=2)
            for i, g, j in fl.parallel(BT, G, EG):
                scratch[i, g, j] = T.if_then_else(b[i, g, j] == top1[i, g], T.Cast("float32", j), NO_ID)
            T.reduce_min(scratch, per_group, dim=2)  # in-group position of the first maximum
            for i, g, j in fl.parallel(BT, G, EG):
                scratch[i, g, j] = T.if_then_else(T.Cast("float32", j) == per_group[i, g], NEG_INF, b[i, g, j])
            T.reduce_max(scratch, per_group, dim=2)  # second largest
            for i, g in fl.parallel(BT, G):
                gscore[i, g] = T.max(top1[i, g] + per_group[i, g], LOWEST)
                keep[i, g] = 0.0
            for _ in T.unroll(TOPK_GROUP):
                T.reduce_max(gscore, per_row, dim=1)
                for i, g in fl.parallel(BT, G):
                    top1[i, g] = T.if_then_else(gscore[i, g] == per_row[i], T.Cast("float32", g), NO_ID)
                T.reduce_min(top1, picked, dim=1)
                for i, g in fl.parallel(BT, G):
                    if T.Cast("float32", g) == picked[i]:
                        keep[i, g] = 1.0
                        gscore[i, g] = NEG_INF
            for i, g, j in fl.parallel(BT, G, EG):
                b[i, g, j] = T.if_then_else(keep[i, g] > 0.0, b[i, g, j], NEG_INF)

        # 3. top-k rounds
        for i, k in fl.parallel(BT, K):
            w_sel[i, k] = 0.0
            id_sel[i, k] = 0.0
        for rnd in T.unroll(K):
            T.reduce_max(b, per_group, dim=2)
            T.reduce_max(per_group, per_row, dim=1)
            for i, g, j in fl.parallel(BT, G, EG):
                scratch[i, g, j] = T.if_then_else(b[i, g, j] == per_row[i], T.Cast("float32", g * EG + j), NO_ID)
            T.reduce_min(scratch, per_group, dim=2)
            T.reduce_min(per_group, picked, dim=1)
            for i, g, j in fl.parallel(BT, G, EG):
                scratch[i, g, j] = T.if_then_else(T.Cast("float32", g * EG + j) == picked[i], s[i, g, j], 0.0)
            T.reduce_sum(scratch, per_group, dim=2)
            T.reduce_sum(per_group, per_row, dim=1)
            for i, k in fl.parallel(BT, K):
                w_sel[i, k] = T.if_then_else(k == rnd, per_row[i], w_sel[i, k])
                id_sel[i, k] = T.if_then_else(k == rnd, picked[i], id_sel[i, k])
            for i, g, j in fl.parallel(BT, G, EG):
                if T.Cast("float32", g * EG + j) == picked[i]:
                    b[i, g, j] = NEG_INF

        # 4. renormalize, scale, store; invalid rows get (-1, 0)
        T.reduce_sum(w_sel, per_row, dim=1)
        for i, k in fl.parallel(BT, K):
            if row0 + i < n_rows:
                if problem.has_valid and Valid[T.min(row0 + i, n_rows - 1)] == 0:
                    Weights[row0 + i, k] = 0.0
                    Ids[row0 + i, k] = -1
                else:
                    if r.renormalize:
                        Weights[row0 + i, k] = w_sel[i, k] / T.max(per_row[i], 1e-20) * r.scaling_factor
                    else:
                        Weights[row0 + i, k] = w_sel[i, k] * r.scaling_factor
                    Ids[row0 + i, k] = T.Cast("int32", id_sel[i, k])

    return route


def route_program(problem, config, fl: Flavour):
    """Routing from fp32 logits [T, E]."""
    r = problem.routing
    E, G, K = r.experts, r.n_group, r.top_k
    EG = E // G
    BT = config["block_t"]
    n_rows = T.dynamic("T")
    route = _route_macro(problem, BT, fl)

    @T.prim_func
    def moe_route(
        Logits: T.Tensor((n_rows, E), "float32"),
        Bias: T.Tensor((E if problem.has_bias else 1,), "float32"),
        Valid: T.Tensor((n_rows if problem.has_valid else 1,), "uint8"),
        Weights: T.Tensor((n_rows, K), "float32"),
        Ids: T.Tensor((n_rows, K), "int32"),
    ):
        with T.Kernel(T.ceildiv(n_rows, BT), threads=config["threads"]) as bx:
            x = fl.fragment((BT, G, EG), "float32")
            for i, g, j in fl.parallel(BT, G, EG):
                x[i, g, j] = T.if_then_else(
                    bx * BT + i < n_rows, Logits[T.min(bx * BT + i, n_rows - 1), g * EG + j], 0.0)
            route(x, bx * BT, n_rows, Bias, Valid, Weights, Ids)

    return moe_route


def route_gate_program(problem, config, fl: Flavour):
    """Gate GEMM (with optional RMSNorm) and routing from bf16 hidden states [T, D]."""
    r = problem.routing
    E, G, K = r.experts, r.n_group, r.top_k
    EG = E // G
    D = problem.hidden
    BT, BD = config["block_t"], config["block_d"]
    n_rows = T.dynamic("T")
    route = _route_macro(problem, BT, fl)
    operand = "bfloat16" if fl.on_gpu else "float32"  # T.gemm operands: bf16 on GPU, decoded fp32 on CPU

    @T.prim_func
    def moe_route_gate(
        H: T.Tensor((n_rows, D), fl.bf16),
        Wg: T.Tensor((E, D), fl.bf16),
        Norm: T.Tensor((D if problem.has_norm else 1,), fl.bf16),
        Bias: T.Tensor((E if problem.has_bias else 1,), "float32"),
        Valid: T.Tensor((n_rows if problem.has_valid else 1,), "uint8"),
        Weights: T.Tensor((n_rows, K), "float32"),
        Ids: T.Tensor((n_rows, K), "int32"),
    ):
        with T.Kernel(T.ceildiv(n_rows, BT), threads=config["threads"]) as bx:
            h_tile = fl.shared((BT, BD), operand)
            w_tile = fl.shared((E, BD), operand)
            acc = fl.fragment((BT, E), "float32")
            inv_rms = fl.fragment((BT,), "float32")
            logits = fl.shared((BT, E), "float32")
            x = fl.fragment((BT, G, EG), "float32")

            if problem.has_norm:  # pass 1: inv_rms = 1 / sqrt(mean(h^2) + eps)
                sq = fl.fragment((BT, BD), "float32")
                part = fl.fragment((BT,), "float32")
                for i in fl.parallel(BT):
                    inv_rms[i] = 0.0
                for kd in T.serial(T.ceildiv(D, BD)):
                    for i, d in fl.parallel(BT, BD):
                        sq[i, d] = T.if_then_else(
                            (bx * BT + i < n_rows) & (kd * BD + d < D),
                            fl.load_bf16(H[T.min(bx * BT + i, n_rows - 1), T.min(kd * BD + d, D - 1)]), 0.0)
                        sq[i, d] = sq[i, d] * sq[i, d]
                    T.reduce_sum(sq, part, dim=1)
                    for i in fl.parallel(BT):
                        inv_rms[i] = inv_rms[i] + part[i]
                for i in fl.parallel(BT):
                    inv_rms[i] = 1.0 / T.sqrt(inv_rms[i] / D + problem.norm_eps)

            for i, e in fl.parallel(BT, E):
                acc[i, e] = 0.0
            for kd in T.Pipelined(T.ceildiv(D, BD), num_stages=config["num_stages"]):  # pass 2: logits = h @ W^T
                for i, d in fl.parallel(BT, BD):
                    if problem.has_norm:
                        h_tile[i, d] = T.if_then_else(
                            (bx * BT + i < n_rows) & (kd * BD + d < D),
                            fl.round_bf16(fl.load_bf16(H[T.min(bx * BT + i, n_rows - 1), T.min(kd * BD + d, D - 1)])
                                          * inv_rms[i] * fl.load_bf16(Norm[T.min(kd * BD + d, D - 1)])),
                            0.0)
                    else:
                        h_tile[i, d] = T.if_then_else(
                            (bx * BT + i < n_rows) & (kd * BD + d < D),
                            fl.load_bf16(H[T.min(bx * BT + i, n_rows - 1), T.min(kd * BD + d, D - 1)]), 0.0)
                if fl.on_gpu:
                    T.copy(Wg[0, kd * BD], w_tile)
                else:
                    for e, d in T.grid(E, BD):
                        w_tile[e, d] = T.if_then_else(kd * BD + d < D, fl.load_bf16(Wg[e, T.min(kd * BD + d, D - 1)]), 0.0)
                T.gemm(h_tile, w_tile, acc, transpose_B=True)

            for i, e in fl.parallel(BT, E):
                logits[i, e] = acc[i, e]
            for i, g, j in fl.parallel(BT, G, EG):
                x[i, g, j] = logits[i, g * EG + j]
            route(x, bx * BT, n_rows, Bias, Valid, Weights, Ids)

    return moe_route_gate


def _bias_valid_args(problem, inputs: dict, device) -> list:
    bias = inputs["bias"] if problem.has_bias else torch.zeros(1, device=device)
    valid = inputs["valid"].view(torch.uint8) if problem.has_valid else torch.ones(1, dtype=torch.uint8, device=device)
    return [bias, valid]


def route_args(problem, inputs: dict, fl):
    logits = inputs["logits"].contiguous()
    weights, ids = empty_outputs(problem, logits.device)
    if problem.tokens == 0:
        return None, (weights, ids)
    return [logits, *_bias_valid_args(problem, inputs, logits.device), weights, ids], (weights, ids)


def route_gate_args(problem, inputs: dict, fl):
    hidden = inputs["hidden"].contiguous()
    device = hidden.device
    weights, ids = empty_outputs(problem, device)
    if problem.tokens == 0:
        return None, (weights, ids)
    norm = inputs["norm_weight"] if problem.has_norm else torch.ones(1, dtype=torch.bfloat16, device=device)
    args = [fl.bf16_arg(hidden), fl.bf16_arg(inputs["gate_weight"]), fl.bf16_arg(norm),
            *_bias_valid_args(problem, inputs, device), weights, ids]
    return args, (weights, ids)


def _tile_values_per_thread(problem, config) -> int:
    """fp32 values of the [block_t, E] working tiles (about five live) held by each thread."""
    return 5 * config["block_t"] * problem.routing.experts // config["threads"]


ROUTE_SPACE = Space(
    params={"block_t": (1, 2, 4, 8, 16), "threads": (32, 64, 128, 256)},
    constraints={"5 x block_t x experts / threads <= 160 (registers)": lambda p, c: _tile_values_per_thread(p, c) <= 160},
)


def route_default(problem) -> dict:
    """A warp per 96 experts (4 warps for E = 384), 4 rows per block once tokens are plentiful."""
    return {"block_t": 4 if problem.tokens >= 512 else 1, "threads": 128}


def _gate_shared_bytes(problem, config) -> int:
    e = problem.routing.experts
    return config["num_stages"] * 2 * config["block_d"] * (e + config["block_t"]) + 4 * config["block_t"] * e


GATE_SPACE = Space(
    params={"block_t": (16, 32, 64), "block_d": (32, 64, 128), "threads": (128, 256), "num_stages": (1, 2, 3)},
    constraints={
        "5 x block_t x experts / threads <= 160 (registers)": lambda p, c: _tile_values_per_thread(p, c) <= 160,
        "bf16 tiles x stages + fp32 logits <= 200 KiB (shared memory)": lambda p, c: _gate_shared_bytes(p, c) <= 200 * 1024,
    },
)


def gate_default(problem) -> dict:
    """16-row MMA tiles, 64-wide K steps, double-buffered W tiles, 8 warps."""
    return {"block_t": 16, "block_d": 64, "threads": 256, "num_stages": 2}
