"""MoE routing in TileLang: one source for CUDA and the CPU (C) target, one launch per call.

Tile plan: rows are routed ROWS at a time on a slot tile x[ROWS, NP] (slot g * WP + j holds
expert g * EG + j; WP, GP are EG, G padded to powers of two, NP = GP * WP; padding slots are
masked). Every step is a parallel map or a row reduction:
  1. s = score(x), non-finite s -> 0; b = s + bias (NaN keys -> lowest finite, padding -> -inf)
  2. groups (G > 1): on a [ROWS, GP, WP] copy of b, gscore = max (or top-2 sum) per group;
     TOPK_GROUP rounds of (max, lowest group) choose the groups; b = -inf elsewhere
  3. K rounds: m = row max of b; a = lowest slot where b == m; gather s at a; b[a] = -inf
  4. renormalize by the sum (1 when it is 0), scale; invalid rows -> (id -1, weight 0)
Argmax is (max, then min of the slots at the max): ties go to the lowest expert id.
moe_route: a block routes block_t rows of fp32 logits.
moe_route_gate: a block computes a [block_t, E] logits tile with T.gemm over D in block_d
steps (h RMS-normalized and rounded to bf16 first when a norm weight is given, as the
reference does), stages it in shared memory, and routes it route_rows rows at a time.
"""

# No `from __future__ import annotations`: TileLang evaluates T.Tensor annotations against the closure.
import tilelang.language as T
import torch

from flashkern.autotune.space import Space
from flashkern.kernels._tilelang import Flavour, row_strided
from flashkern.kernels.moe_route.problem import slot_layout

LOWEST = -3.4028234663852886e38  # lowest finite fp32: NaN keys rank here, below every number
NO_SLOT = 1.0e9  # above every slot index; slots travel as exact fp32 integers through min-reductions


def _route_macro(problem, rows: int, fl: Flavour):
    """Steps 1-4 for a [rows, NP] logits tile, as a TileLang macro."""
    r = problem.routing
    G, EG, K, TOPK_GROUP = r.n_group, r.experts // r.n_group, r.top_k, r.topk_group
    layout = slot_layout(r)
    GP, WP, NP = layout.groups, layout.group_width, layout.slots
    KP = 1 << (K - 1).bit_length()  # the chosen-expert tile is padded to a power of two as well
    POS_INF = T.infinity("float32")
    NEG_INF = -POS_INF

    def real(n):  # slot n holds an expert
        return ((n // WP) < G) & ((n % WP) < EG)

    def expert(n):
        return (n // WP) * EG + n % WP

    @T.macro
    def argmax(keys, scratch, width, best, picked):
        """best = row max of keys[rows, width]; picked = the lowest index holding it (as fp32)."""
        T.reduce_max(keys, best, dim=1)
        for i, n in fl.parallel(rows, width):
            scratch[i, n] = T.if_then_else(keys[i, n] == best[i], T.Cast("float32", n), NO_SLOT)
        T.reduce_min(scratch, picked, dim=1)

    @T.macro
    def route(x, row0, n_rows, Bias, Valid, Weights, Ids, scale, renormalize):
        s = fl.fragment((rows, NP), "float32")
        b = fl.fragment((rows, NP), "float32")
        scratch = fl.fragment((rows, NP), "float32")
        per_row = fl.fragment((rows,), "float32")
        picked = fl.fragment((rows,), "float32")
        w_sel = fl.fragment((rows, KP), "float32")
        slot_sel = fl.fragment((rows, KP), "float32")

        # 1. scores and selection keys
        if r.score == "sqrtsoftplus":  # sqrt(max(x, 0) + log1p(exp(-|x|))), log1p by Goldberg's correction
            for i, n in fl.parallel(rows, NP):
                scratch[i, n] = T.exp(-T.max(x[i, n], -x[i, n]))
            for i, n in fl.parallel(rows, NP):
                s[i, n] = T.if_then_else(real(n), T.sqrt(T.max(x[i, n], 0.0) + T.if_then_else(
                    1.0 + scratch[i, n] == 1.0, scratch[i, n],
                    T.log(1.0 + scratch[i, n]) * scratch[i, n] / ((1.0 + scratch[i, n]) - 1.0))), 0.0)
        elif r.score == "sigmoid":
            for i, n in fl.parallel(rows, NP):
                s[i, n] = T.if_then_else(real(n), 1.0 / (1.0 + T.exp(-x[i, n])), 0.0)
        else:  # softmax over the experts of a row
            for i, n in fl.parallel(rows, NP):
                scratch[i, n] = T.if_then_else(real(n), x[i, n], NEG_INF)
            T.reduce_max(scratch, per_row, dim=1)
            for i, n in fl.parallel(rows, NP):
                scratch[i, n] = T.if_then_else(real(n), T.exp(x[i, n] - per_row[i]), 0.0)
            T.reduce_sum(scratch, per_row, dim=1)
            for i, n in fl.parallel(rows, NP):
                s[i, n] = scratch[i, n] / per_row[i]
        for i, n in fl.parallel(rows, NP):  # NaN and +-inf scores -> 0 (vLLM), then the keys
            s[i, n] = T.if_then_else((s[i, n] < POS_INF) & (s[i, n] > NEG_INF), s[i, n], 0.0)
            if problem.has_bias:
                b[i, n] = s[i, n] + Bias[T.min(expert(n), r.experts - 1)]
            else:
                b[i, n] = s[i, n]
        for i, n in fl.parallel(rows, NP):
            b[i, n] = T.if_then_else(real(n), T.if_then_else(b[i, n] == b[i, n], T.max(b[i, n], LOWEST), LOWEST),
                                     NEG_INF)

        # 2. group limiting
        if G > 1:
            b3 = fl.fragment((rows, GP, WP), "float32")
            top1 = fl.fragment((rows, GP), "float32")
            top2 = fl.fragment((rows, GP), "float32")  # the second largest b, then argmax scratch
            keep = fl.fragment((rows, GP), "float32")
            # the group argmax has its own per-row buffers: sharing the top-k rounds' would tie their layouts
            # on the GPU to this [rows, GP] tile and replicate the [rows, NP] tiles in every thread
            group_best = fl.fragment((rows,), "float32")
            group_picked = fl.fragment((rows,), "float32")
            for i, g, j in fl.parallel(rows, GP, WP):
                b3[i, g, j] = b[i, g * WP + j]
            T.reduce_max(b3, top1, dim=2)  # group score "max"
            if problem.group_form == "top2":
                scratch3 = fl.fragment((rows, GP, WP), "float32")
                for i, g, j in fl.parallel(rows, GP, WP):
                    scratch3[i, g, j] = T.if_then_else(b3[i, g, j] == top1[i, g], T.Cast("float32", j), NO_SLOT)
                T.reduce_min(scratch3, top2, dim=2)  # in-group position of the first maximum
                for i, g, j in fl.parallel(rows, GP, WP):
                    scratch3[i, g, j] = T.if_then_else(T.Cast("float32", j) == top2[i, g], NEG_INF, b3[i, g, j])
                T.reduce_max(scratch3, top2, dim=2)  # second largest
                for i, g in fl.parallel(rows, GP):
                    top1[i, g] = T.max(top1[i, g] + top2[i, g], LOWEST)  # group score "top2"
            for i, g in fl.parallel(rows, GP):
                top1[i, g] = T.if_then_else(g < G, top1[i, g], NEG_INF)
                keep[i, g] = 0.0
            for _ in T.unroll(TOPK_GROUP):
                argmax(top1, top2, GP, group_best, group_picked)
                for i, g in fl.parallel(rows, GP):
                    if T.Cast("float32", g) == group_picked[i]:
                        keep[i, g] = 1.0
                        top1[i, g] = NEG_INF
            for i, g, j in fl.parallel(rows, GP, WP):
                b3[i, g, j] = T.if_then_else(keep[i, g] > 0.0, b3[i, g, j], NEG_INF)
            for i, g, j in fl.parallel(rows, GP, WP):
                b[i, g * WP + j] = b3[i, g, j]

        # 3. top-k rounds
        for i, k in fl.parallel(rows, KP):
            w_sel[i, k] = 0.0
            slot_sel[i, k] = 0.0
        for rnd in T.unroll(K):
            argmax(b, scratch, NP, per_row, picked)
            for i, n in fl.parallel(rows, NP):
                scratch[i, n] = T.if_then_else(T.Cast("float32", n) == picked[i], s[i, n], 0.0)
            T.reduce_sum(scratch, per_row, dim=1)
            for i, k in fl.parallel(rows, KP):
                w_sel[i, k] = T.if_then_else(k == rnd, per_row[i], w_sel[i, k])
                slot_sel[i, k] = T.if_then_else(k == rnd, picked[i], slot_sel[i, k])
            for i, n in fl.parallel(rows, NP):
                if T.Cast("float32", n) == picked[i]:
                    b[i, n] = NEG_INF

        # 4. renormalize (a zero sum divides by 1), scale, store; invalid rows get (-1, 0)
        T.reduce_sum(w_sel, per_row, dim=1)
        for i, k in fl.parallel(rows, KP):
            if (row0 + i < n_rows) & (k < K):
                if problem.has_valid and Valid[T.min(row0 + i, n_rows - 1)] == 0:
                    Weights[row0 + i, k] = 0.0
                    Ids[row0 + i, k] = -1
                else:
                    Weights[row0 + i, k] = (w_sel[i, k] / T.if_then_else((renormalize != 0) & (per_row[i] > 0.0),
                                                                          per_row[i], 1.0) * scale)
                    Ids[row0 + i, k] = expert(T.Cast("int32", slot_sel[i, k]))

    return route, real, expert, NP


def route_program(problem, config, fl: Flavour):
    """Routing from fp32 logits [T, E]."""
    E, K = problem.routing.experts, problem.routing.top_k
    BT = config["block_t"]
    n_rows = T.dynamic("T")
    route, real, expert, NP = _route_macro(problem, BT, fl)

    @T.prim_func
    def moe_route(
        Logits: row_strided((n_rows, E), "float32", "logits"),
        Bias: T.Tensor((E if problem.has_bias else 1,), "float32"),
        Valid: T.Tensor((n_rows if problem.has_valid else 1,), "uint8"),
        Weights: T.Tensor((n_rows, K), "float32"),
        Ids: T.Tensor((n_rows, K), "int32"),
        scale: T.float32,
        renormalize: T.int32,
    ):
        with T.Kernel(T.ceildiv(n_rows, BT), threads=config["threads"]) as bx:
            x = fl.fragment((BT, NP), "float32")
            for i, n in fl.parallel(BT, NP):
                x[i, n] = T.if_then_else(
                    (bx * BT + i < n_rows) & real(n),
                    Logits[T.min(bx * BT + i, n_rows - 1), T.min(expert(n), E - 1)], 0.0)
            route(x, bx * BT, n_rows, Bias, Valid, Weights, Ids, scale, renormalize)

    return moe_route


def route_gate_program(problem, config, fl: Flavour):
    """Gate GEMM (with optional RMSNorm) and routing from bf16 hidden states [T, D]."""
    E, K, D = problem.routing.experts, problem.routing.top_k, problem.hidden
    BT, BD, RB = config["block_t"], config["block_d"], config["route_rows"]
    n_rows = T.dynamic("T")
    route, real, expert, NP = _route_macro(problem, RB, fl)
    operand = "bfloat16" if fl.on_gpu else "float32"  # T.gemm operands: bf16 on GPU, decoded fp32 on CPU

    @T.prim_func
    def moe_route_gate(
        H: row_strided((n_rows, D), fl.bf16, "hidden"),
        Wg: T.Tensor((E, D), fl.bf16),
        Norm: T.Tensor((D if problem.has_norm else 1,), fl.bf16),
        Bias: T.Tensor((E if problem.has_bias else 1,), "float32"),
        Valid: T.Tensor((n_rows if problem.has_valid else 1,), "uint8"),
        Weights: T.Tensor((n_rows, K), "float32"),
        Ids: T.Tensor((n_rows, K), "int32"),
        scale: T.float32,
        renormalize: T.int32,
        norm_eps: T.float32,
    ):
        with T.Kernel(T.ceildiv(n_rows, BT), threads=config["threads"]) as bx:
            h_tile = fl.shared((BT, BD), operand)
            w_tile = fl.shared((E, BD), operand)
            acc = fl.fragment((BT, E), "float32")
            inv_rms = fl.shared((BT,), "float32")  # shared, so the h-tile loop may use every thread
            logits = fl.shared((BT, E), "float32")
            x = fl.fragment((RB, NP), "float32")

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
                    inv_rms[i] = 1.0 / T.sqrt(inv_rms[i] / D + norm_eps)

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

            for chunk in T.serial(BT // RB):  # route the tile RB rows at a time
                for i, n in fl.parallel(RB, NP):
                    x[i, n] = T.if_then_else(real(n), logits[chunk * RB + i, T.min(expert(n), E - 1)], 0.0)
                route(x, bx * BT + chunk * RB, n_rows, Bias, Valid, Weights, Ids, scale, renormalize)

    return moe_route_gate


# Automatic warp specialization moves the RMSNorm pass into producer warps and gives the routing
# tiles a row-per-thread layout (255 registers, ~20 KB of spills at V3 shapes); without it they stay small.
GATE_PASS_CONFIGS = {"tl.disable_warp_specialized": True}


def _bias_valid_args(problem, inputs: dict, device) -> list:
    bias = inputs["bias"] if problem.has_bias else torch.zeros(1, device=device)
    valid = inputs["valid"].view(torch.uint8) if problem.has_valid else torch.ones(1, dtype=torch.uint8, device=device)
    return [bias, valid]


def _rule_args(problem) -> list:
    """The routing rule's run-time scalars: the scaling factor and whether to renormalize (kernel arguments rather
    than constants, so that models differing only in them share one compiled kernel)."""
    return [float(problem.routing.scaling_factor), int(problem.routing.renormalize)]


def route_args(problem, inputs: dict, config: dict, fl, out):
    if problem.tokens == 0:
        return None
    logits = inputs["logits"]
    return [logits, *_bias_valid_args(problem, inputs, logits.device), *out, *_rule_args(problem)]


def route_gate_args(problem, inputs: dict, config: dict, fl, out):
    if problem.tokens == 0:
        return None
    hidden = inputs["hidden"]
    device = hidden.device
    norm = inputs["norm_weight"] if problem.has_norm else torch.ones(1, dtype=torch.bfloat16, device=device)
    return [fl.bf16_arg(hidden), fl.bf16_arg(inputs["gate_weight"]), fl.bf16_arg(norm),
            *_bias_valid_args(problem, inputs, device), *out, *_rule_args(problem), float(problem.norm_eps)]


# Register model: routing keeps ~4 fp32 [rows, slots] tiles live (x, s, b, scratch); the gate adds
# its [block_t, E] accumulator. Per-thread values must stay well under the 255-register limit.
def _route_values(problem, rows: int, threads: int) -> int:
    return 4 * rows * slot_layout(problem.routing).slots // threads


ROUTE_SPACE = Space(
    params={"block_t": (1, 2, 4, 8), "threads": (32, 64, 128, 256)},
    gpu_only=("threads",),
    limits={
        "4 x block_t x slots / threads <= 128 (registers)":
            lambda p, c: _route_values(p, c["block_t"], c["threads"]) <= 128,
    },
)


def route_default(problem) -> dict:
    """A warp per 128 slots (4 warps for 384 experts); 4 rows per block once tokens are plentiful."""
    return {"block_t": 4 if problem.tokens >= 512 else 1, "threads": 128}


def _gate_shared_bytes(problem, config) -> int:
    e = problem.routing.experts
    return config["num_stages"] * 2 * config["block_d"] * (e + config["block_t"]) + 4 * config["block_t"] * e


GATE_SPACE = Space(
    params={"block_t": (16, 32, 64), "route_rows": (1, 2, 4), "block_d": (32, 64, 128), "threads": (128, 256),
            "num_stages": (1, 2, 3)},
    gpu_only=("threads", "num_stages"),
    limits={
        "4 x route_rows x slots / threads + block_t x experts / threads <= 128 (registers)":
            lambda p, c: _route_values(p, c["route_rows"], c["threads"])
            + c["block_t"] * p.routing.experts // c["threads"] <= 128,
        "bf16 tiles x stages + fp32 logits <= 200 KiB (shared memory)":
            lambda p, c: _gate_shared_bytes(p, c) <= 200 * 1024,
    },
)


def gate_default(problem) -> dict:
    """16-row MMA tiles, 64-wide K steps, double-buffered W tiles, 4 warps; routed 2 rows at a time."""
    return {"block_t": 16, "route_rows": 2, "block_d": 64, "threads": 128, "num_stages": 2}
