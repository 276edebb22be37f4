"""MoE routing in TileLang: one source for CUDA and the CPU (C) target.

Tile plan: rows are routed ROWS at a time on a slot tile x[ROWS, NP], a warp per row on the GPU (slot n of row i
in lane n % 32 of warp i: every row reduction is a warp shuffle, no shared memory). One group: slot = expert, NP
the experts rounded up to 32 (384 stay 384). Groups: slot g * WP + j holds expert g * EG + j, WP, GP being EG, G
padded to powers of two, NP = GP * WP. Padding slots are masked. Every step is a parallel map or a row reduction:
  1. s = score(x), non-finite s -> 0; b = s + bias (NaN keys -> lowest finite, padding -> -inf)
  2. groups (G > 1): on a [ROWS, GP, WP] copy of b, gscore = max (or top-2 sum) per group;
     TOPK_GROUP rounds of (max, lowest group) choose the groups; b = -inf elsewhere
  3. K rounds: m = row max of b; a = lowest slot where b == m; gather s at a; b[a] = -inf
  4. renormalize by the sum (1 when it is 0), scale; invalid rows -> (id -1, weight 0)
Argmax is (max, then min of the slots at the max): ties go to the lowest expert id.
moe_route: a block routes block_t rows of fp32 logits.
moe_route_gate: the GEMM into fp32 partial logits (a block per [block_t tokens, block_e experts] tile and D split:
h and W tiles copied to shared memory, h RMS-normalized and rounded to bf16 there as the reference does, T.gemm into
a fragment over a pipelined K loop; 16-row mma.sync tiles at decode, 64- or 128-row wgmma tiles at prefill), then
moe_route over the partials summed in split order. At decode one launch: every block forms its tile's 1 / rms (the
rows are few, and in L2), and the tile's last block to count in (a ticket) routes the tile. At prefill
(`separate_route`) three: 1 / rms per token (a block per row), the GEMM, the routing spread over the SMs.
"""

# No `from __future__ import annotations`: TileLang evaluates T.Tensor annotations against the closure.
import torch

from flashkern.autotune.space import Space
from flashkern.kernels._tilelang import T, Flavour, placeholder, row_strided
from flashkern.kernels._tilelang.sync import count_in_macro
from flashkern.kernels.moe_route.problem import LOG1P_UNIT, slot_layout
from flashkern.kernels.tiles import SMS, split_plan

LOWEST = -3.4028234663852886e38  # lowest finite fp32: NaN keys rank here, below every number
NO_SLOT = 1.0e9  # above every slot index; slots travel as exact fp32 integers through min-reductions
RMS_BLOCK_D = 8192  # the gate's 1 / rms stage: columns a step at most


def log1p_unit(u):
    """log(1 + u) for u in [0, 1]: u + u^2 P(u), P by Horner's rule over problem.LOG1P_UNIT (9 FMAs)."""
    p = T.float32(LOG1P_UNIT[-1])
    for c in reversed(LOG1P_UNIT[:-1]):
        p = p * u + T.float32(c)
    return u + u * u * p


def route_slots(routing) -> tuple[int, int, int]:
    """(GP, WP, NP): groups and their width padded (powers of 2 for the [rows, GP, WP] group view), and the slots a
    row, GP x WP. One group: the experts rounded up to a warp's 32 lanes, no more (384 stay 384)."""
    if routing.n_group == 1:
        width = -(-routing.experts // 32) * 32
        return 1, width, width
    layout = slot_layout(routing)
    return layout.groups, layout.group_width, layout.slots


def lanes(fl: Flavour, rows: int, slots: int, tiles: tuple, group_tiles: tuple):
    """On the GPU, a warp per row: slot n of row i in lane n % 32 of warp i, at local index n // 32 (the [rows, GP, WP]
    group views likewise by their flat slot), so every row reduction is a warp shuffle; threads = 32 rows. Slots
    fewer than a warp keep TileLang's own layout; the C target has none."""
    if not fl.on_gpu or slots % 32:
        return
    flat = T.Fragment((rows, slots), forward_thread_fn=lambda i, n: i * 32 + n % 32,
                      forward_index_fn=lambda i, n: n // 32)
    layouts = {tile: flat for tile in tiles}
    if group_tiles:
        width = slots // group_tiles[0].shape[1]
        grouped = T.Fragment((rows, slots // width, width),
                             forward_thread_fn=lambda i, g, j: i * 32 + (g * width + j) % 32,
                             forward_index_fn=lambda i, g, j: (g * width + j) // 32)
        layouts.update({tile: grouped for tile in group_tiles})
    T.annotate_layout(layouts)


def _route_macro(problem, rows: int, fl: Flavour):
    """Steps 1-4 for a [rows, NP] logits tile, as a TileLang macro."""
    r = problem.routing
    G, EG, K, TOPK_GROUP = r.n_group, r.experts // r.n_group, r.top_k, r.topk_group
    GP, WP, NP = route_slots(r)
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
        if G > 1:
            b3 = fl.fragment((rows, GP, WP), "float32")
            scratch3 = fl.fragment((rows, GP, WP), "float32")
            lanes(fl, rows, NP, (x, s, b, scratch), (b3, scratch3))
        else:
            lanes(fl, rows, NP, (x, s, b, scratch), ())
        per_row = fl.fragment((rows,), "float32")
        picked = fl.fragment((rows,), "float32")
        w_sel = fl.fragment((rows, KP), "float32")
        slot_sel = fl.fragment((rows, KP), "float32")

        # 1. scores and selection keys
        if r.score == "sqrtsoftplus":  # sqrt(max(x, 0) + log1p(exp(-|x|))), log1p by problem.LOG1P_UNIT
            for i, n in fl.parallel(rows, NP):
                scratch[i, n] = T.exp(-T.max(x[i, n], -x[i, n]))
            for i, n in fl.parallel(rows, NP):
                s[i, n] = T.if_then_else(real(n), T.sqrt(T.max(x[i, n], 0.0) + log1p_unit(scratch[i, n])), 0.0)
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


def _route_rows_macro(problem, rows: int, fl: Flavour, splits: int):
    """route_rows(Logits, row0, n_rows, ...): steps 1-4 for rows row0 .. row0 + rows - 1 of fp32 logits [T, E], or
    of the gate's partial logits [splits, T, E] summed in split order (splits > 0)."""
    E = problem.routing.experts
    route, real, expert, NP = _route_macro(problem, rows, fl)

    @T.macro
    def route_rows(Logits, row0, n_rows, Bias, Valid, Weights, Ids, scale, renormalize):
        x = fl.fragment((rows, NP), "float32")
        for i, n in fl.parallel(rows, NP):
            row, column = T.min(row0 + i, n_rows - 1), T.min(expert(n), E - 1)
            keep = (row0 + i < n_rows) & real(n)
            if splits:
                x[i, n] = 0.0
                for part in T.serial(splits):
                    x[i, n] = x[i, n] + T.if_then_else(keep, Logits[part, row, column], 0.0)
            else:
                x[i, n] = T.if_then_else(keep, Logits[row, column], 0.0)
        route(x, row0, n_rows, Bias, Valid, Weights, Ids, scale, renormalize)

    return route_rows


def _route_tensors(problem, n_rows):
    """The routing's other parameters: bias, valid, weights, ids (rows: the dynamic n_rows)."""
    E, K = problem.routing.experts, problem.routing.top_k
    return (T.Tensor((E if problem.has_bias else 1,), "float32"), T.Tensor((n_rows if problem.has_valid else 1,), "uint8"),
            T.Tensor((n_rows, K), "float32"), T.Tensor((n_rows, K), "int32"))


def route_program(problem, config, fl: Flavour, splits: int = 0):
    """Routing from fp32 logits [T, E]; with splits > 0, from the gate's partial logits [splits, T, E], summed in
    split order."""
    E = problem.routing.experts
    BT = config["block_t"]
    n_rows = T.dynamic("T")
    route_rows = _route_rows_macro(problem, BT, fl, splits)
    source = T.Tensor((splits, n_rows, E), "float32") if splits else row_strided((n_rows, E), "float32", "logits")
    bias, valid, weights, ids = _route_tensors(problem, n_rows)

    @T.prim_func
    def moe_route(Logits: source, Bias: bias, Valid: valid, Weights: weights, Ids: ids, scale: T.float32,
                  renormalize: T.int32):
        with T.Kernel(T.ceildiv(n_rows, BT), threads=32 * BT) as bx:  # a warp per row
            route_rows(Logits, bx * BT, n_rows, Bias, Valid, Weights, Ids, scale, renormalize)

    return moe_route


def _inv_rms_macro(problem, fl: Flavour):
    """inv_rms(H, row, norm_eps, out, i): out[i] = 1 / sqrt(mean_d h[row, d]^2 + eps), the CTA's threads over up to
    8192 columns a step (one step at v41-flash's 5120: every load of the row in flight at once)."""
    D = problem.hidden
    BD = min(RMS_BLOCK_D, 1 << (D - 1).bit_length())

    @T.macro
    def inv_rms(H, row, norm_eps, out, i):
        sq = fl.fragment((BD,), "float32")
        part = fl.fragment((1,), "float32")
        total = fl.fragment((1,), "float32")
        total[0] = 0.0
        for kd in T.serial(T.ceildiv(D, BD)):
            for d in fl.parallel(BD):
                sq[d] = T.if_then_else(kd * BD + d < D, fl.load_bf16(H[row, T.min(kd * BD + d, D - 1)]), 0.0)
                sq[d] = sq[d] * sq[d]
            T.reduce_sum(sq, part, dim=0)
            total[0] = total[0] + part[0]
        out[i] = 1.0 / T.sqrt(total[0] / D + norm_eps)

    return inv_rms


def inv_rms_program(problem, config, fl: Flavour):
    """The separate gate's first stage: 1 / rms of every row, a block per row."""
    n_rows = T.dynamic("T")
    inv_rms = _inv_rms_macro(problem, fl)

    @T.prim_func
    def inv_rms_rows(H: row_strided((n_rows, problem.hidden), fl.bf16, "hidden"),
                     InvRms: T.Tensor((n_rows,), "float32"), norm_eps: T.float32):
        with T.Kernel(n_rows, threads=128) as row:
            inv_rms(H, row, norm_eps, InvRms, row)

    return inv_rms_rows


def _gate_tile_macro(problem, config, fl: Flavour, n_rows, aligned: bool):
    """gate_tile(H, Wg, Norm, scale, Parts, bx, by, bz): Parts[bz, t, e] = sum over split bz's D columns of
    x[t, d] W[e, d] for the [block_t tokens, block_e experts] tile (bx, by), x = bf16(h scale norm) (or h; scale:
    the tile's 1 / rms per row, in shared memory so the h-tile loop may use every thread). T.gemm into a fragment
    over a pipelined K loop. `aligned` (gate_layout: h's rows start on 16-byte boundaries) lets the h tile's copy
    be a cp.async that zero-fills the rows past the last, where it is otherwise loads the loop waits on."""
    E, D = problem.routing.experts, problem.hidden
    BT, BE, BD = config["block_t"], config["block_e"], config["block_d"]
    per_split = split_plan(D, config["splits"], BD)[1] // BD  # block_d steps a split
    operand = "bfloat16" if fl.on_gpu else "float32"  # T.gemm operands: bf16 on GPU, decoded fp32 on CPU

    @T.macro
    def gate_tile(H, Wg, Norm, scale, Parts, bx, by, bz):
        if fl.on_gpu and aligned:
            T.assume(H.strides[0] % 8 == 0)
        h_tile = fl.shared((BT, BD), operand)
        w_tile = fl.shared((BE, BD), operand)
        acc = fl.fragment((BT, BE), "float32")
        if fl.on_gpu and problem.has_norm:  # h and the norm weight as copied, normalized into h_tile
            h_raw = T.alloc_shared((BT, BD), fl.bf16)
            norm = T.alloc_shared((BD,), fl.bf16)
        T.clear(acc)
        for step in T.Pipelined(T.min(per_split, T.ceildiv(D, BD) - bz * per_split), num_stages=config["num_stages"]):
            d0 = (bz * per_split + step) * BD
            if fl.on_gpu:  # the tiles copied (cp.async / TMA, out-of-range rows and columns zero), then normed
                T.copy(Wg[by * BE, d0], w_tile)
                if problem.has_norm:
                    T.copy(H[bx * BT, d0], h_raw)
                    T.copy(Norm[d0], norm)
                    for i, d in T.Parallel(BT, BD):  # RMS-normalized and rounded to bf16, as the reference does
                        h_tile[i, d] = T.Cast(operand, T.Cast("float32", h_raw[i, d]) * scale[i]
                                              * T.Cast("float32", norm[d]))
                else:
                    T.copy(H[bx * BT, d0], h_tile)
            else:
                for i, d in T.grid(BT, BD):
                    value = fl.load_bf16(H[T.min(bx * BT + i, n_rows - 1), T.min(d0 + d, D - 1)])
                    if problem.has_norm:
                        value = fl.round_bf16(value * scale[i] * fl.load_bf16(Norm[T.min(d0 + d, D - 1)]))
                    h_tile[i, d] = T.if_then_else((bx * BT + i < n_rows) & (d0 + d < D), value, 0.0)
                for e, d in T.grid(BE, BD):
                    w_tile[e, d] = T.if_then_else((by * BE + e < E) & (d0 + d < D),
                                                  fl.load_bf16(Wg[T.min(by * BE + e, E - 1), T.min(d0 + d, D - 1)]),
                                                  0.0)
            T.gemm(h_tile, w_tile, acc, transpose_B=True)
        for i, e in fl.parallel(BT, BE):
            if (bx * BT + i < n_rows) & (by * BE + e < E):
                Parts[bz, bx * BT + i, by * BE + e] = acc[i, e]

    return gate_tile


def gate_gemm_program(problem, config, fl: Flavour, aligned: bool):
    """The separate gate's GEMM stage: a block per [block_t tokens, block_e experts] tile and split (gate_tile),
    1 / rms from the first stage."""
    E, D = problem.routing.experts, problem.hidden
    BT, BE = config["block_t"], config["block_e"]
    splits = split_plan(D, config["splits"], config["block_d"])[0]
    n_rows = T.dynamic("T")
    gate_tile = _gate_tile_macro(problem, config, fl, n_rows, aligned)

    @T.prim_func
    def gate_gemm(
        H: row_strided((n_rows, D), fl.bf16, "hidden"),
        Wg: T.Tensor((E, D), fl.bf16),
        Norm: T.Tensor((D if problem.has_norm else 1,), fl.bf16),
        InvRms: T.Tensor((n_rows if problem.has_norm else 1,), "float32"),
        Parts: T.Tensor((splits, n_rows, E), "float32"),
    ):
        with T.Kernel(T.ceildiv(n_rows, BT), T.ceildiv(E, BE), splits, threads=config["threads"]) as (bx, by, bz):
            scale = fl.shared((BT,), "float32")
            if problem.has_norm:
                for i in fl.parallel(BT):
                    scale[i] = InvRms[T.min(bx * BT + i, n_rows - 1)]
            gate_tile(H, Wg, Norm, scale, Parts, bx, by, bz)

    return gate_gemm


def gate_fused_program(problem, config, fl: Flavour, aligned: bool):
    """The decode gate in one launch: CTA (tile, e, s) forms 1 / rms of the tile's rows (with a norm: the rows are
    a few at decode, read from L2 by every CTA of the tile), then its partial logits (gate_tile); the tile's last CTA
    to count in (a ticket) sums the splits in order and routes the tile's rows, a warp each."""
    E, D = problem.routing.experts, problem.hidden
    BT, BE = config["block_t"], config["block_e"]
    splits = split_plan(D, config["splits"], config["block_d"])[0]
    group = -(-E // BE) * splits  # the CTAs of a token tile
    warps = config["threads"] // 32
    n_rows = T.dynamic("T")
    gate_tile = _gate_tile_macro(problem, config, fl, n_rows, aligned)
    inv_rms = _inv_rms_macro(problem, fl)
    route_rows = _route_rows_macro(problem, warps, fl, splits)
    count_in = count_in_macro(fl)
    bias, valid, weights, ids = _route_tensors(problem, n_rows)

    @T.prim_func
    def gate_fused(
        H: row_strided((n_rows, D), fl.bf16, "hidden"),
        Wg: T.Tensor((E, D), fl.bf16),
        Norm: T.Tensor((D if problem.has_norm else 1,), fl.bf16),
        Parts: T.Tensor((splits, n_rows, E), "float32"),
        Tickets: T.Tensor((T.ceildiv(n_rows, BT),), "int32"),
        Bias: bias, Valid: valid, Weights: weights, Ids: ids,
        norm_eps: T.float32,
        scale: T.float32,
        renormalize: T.int32,
    ):
        with T.Kernel(T.ceildiv(n_rows, BT), T.ceildiv(E, BE), splits, threads=config["threads"]) as (bx, by, bz):
            row_scale = fl.shared((BT,), "float32")
            ticket = fl.shared((1,), "int32")
            if problem.has_norm:
                for i in fl.parallel(BT):  # rows past the last: their h is zero, and so their scale
                    row_scale[i] = 0.0
                for r in T.serial(T.min(BT, n_rows - bx * BT)):
                    inv_rms(H, bx * BT + r, norm_eps, row_scale, r)
            gate_tile(H, Wg, Norm, row_scale, Parts, bx, by, bz)
            count_in(Tickets, bx, ticket)
            if ticket[0] == group - 1:
                for p in T.serial(T.ceildiv(T.min(BT, n_rows - bx * BT), warps)):
                    route_rows(Parts, bx * BT + p * warps, n_rows, Bias, Valid, Weights, Ids, scale, renormalize)

    return gate_fused


def route_gate_program(problem, config, fl: Flavour, aligned: bool):
    """One launch (gate_fused_program), or in stages (separate_route): 1 / rms per token (with a norm), the GEMM
    into fp32 partial logits, their routing spread over the SMs."""
    if not config["separate_route"]:
        return gate_fused_program(problem, config, fl, aligned)
    splits = split_plan(problem.hidden, config["splits"], config["block_d"])[0]
    route = route_program(problem, {"block_t": config["route_rows"]}, fl, splits=splits)
    gemm = gate_gemm_program(problem, config, fl, aligned)
    return (inv_rms_program(problem, config, fl), gemm, route) if problem.has_norm else (gemm, route)


# Automatic warp specialization would hand the W copies to producer warps while every thread builds the normalized
# h tile: the GEMM keeps one group of threads for both.
GATE_PASS_CONFIGS = {"tl.disable_warp_specialized": True}


def _bias_valid_args(problem, inputs: dict, device) -> list:
    bias = inputs["bias"] if problem.has_bias else placeholder((1,), torch.float32, device)
    valid = inputs["valid"].view(torch.uint8) if problem.has_valid else placeholder((1,), torch.uint8, device, fill=1)
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


def gate_layout(inputs: dict) -> bool:
    """Whether h's rows start on 16-byte boundaries (its data pointer and row stride: metadata), so that the GEMM may
    copy them in 16-byte pieces."""
    hidden = inputs["hidden"]
    return hidden.data_ptr() % 16 == 0 and hidden.stride(0) % 8 == 0


def route_gate_args(problem, inputs: dict, config: dict, fl, out):
    """One launch's arguments, or the stages' ((1 / rms,) GEMM, routing); the partial logits, the row scales and
    the tickets (zero before each call, and per call: calls on several streams never share them) are scratch."""
    if problem.tokens == 0:
        return None
    hidden = inputs["hidden"]
    device = hidden.device
    splits = split_plan(problem.hidden, config["splits"], config["block_d"])[0]
    parts = torch.empty((splits, problem.tokens, problem.routing.experts), dtype=torch.float32, device=device)
    norm = inputs["norm_weight"] if problem.has_norm else torch.ones(1, dtype=torch.bfloat16, device=device)
    operands = [fl.bf16_arg(fl.tma_arg(hidden)), fl.bf16_arg(fl.tma_arg(inputs["gate_weight"])), fl.bf16_arg(norm)]
    routing = [*_bias_valid_args(problem, inputs, device), *out]
    if not config["separate_route"]:
        tickets = torch.zeros(-(-problem.tokens // config["block_t"]), dtype=torch.int32, device=device)
        return [*operands, parts, tickets, *routing, float(problem.norm_eps), *_rule_args(problem)]
    inv_rms = torch.empty(problem.tokens if problem.has_norm else 1, dtype=torch.float32, device=device)
    gemm = [*operands, inv_rms, parts]
    route = [parts, *routing, *_rule_args(problem)]
    if problem.has_norm:
        return [fl.bf16_arg(hidden), inv_rms, float(problem.norm_eps)], gemm, route
    return gemm, route


# A warp per row: each thread holds slots / 32 values of each of the ~4 fp32 [rows, slots] routing tiles (x, s, b,
# scratch): 12 each for 384 experts.
ROUTE_SPACE = Space(params={"block_t": (1, 2, 4, 8)})


def route_default(problem) -> dict:
    """A warp per row; 4 rows (warps) a block once tokens are plentiful, else 1."""
    return {"block_t": 4 if problem.tokens >= 512 else 1}


def _gate_shared_bytes(config) -> int:
    return config["num_stages"] * 2 * config["block_d"] * (config["block_e"] + config["block_t"])


GATE_SPACE = Space(
    params={"block_t": (16, 32, 64, 128), "block_e": (32, 64, 128), "block_d": (32, 64, 128),
            "splits": (1, 2, 4, 8, 16, 32), "route_rows": (1, 2, 4), "threads": (128, 256), "num_stages": (1, 2, 3),
            "separate_route": (False, True)},
    gpu_only=("threads", "num_stages"),
    limits={
        "route_rows only for a separate routing launch": lambda p, c: c["separate_route"] or c["route_rows"] == 1,
        "block_t x block_e / threads <= 128 (registers: the accumulator)":
            lambda p, c: c["block_t"] * c["block_e"] <= 128 * c["threads"],
        "bf16 tiles x stages <= 200 KiB (shared memory)": lambda p, c: _gate_shared_bytes(c) <= 200 * 1024,
    },
)

DECODE_TOKENS = 64  # up to here the GEMM's M side is a 16-row mma.sync tile and D splits over about every SM
ONE_LAUNCH_TOKENS = 4  # up to here the decode gate is one launch: its rows' 1 / rms and routing in one pass of 4 warps


def gate_default(problem) -> dict:
    """Decode (up to DECODE_TOKENS): 16-row tiles (mma.sync), 64-expert blocks, D split until about SMS blocks
    (rounded up: W's stream wants every SM), two stages. Prefill: 64-row tiles (a warpgroup's wgmma; 128 rows on 8
    warps from 1024 tokens), 128-expert blocks, three stages, D split while the blocks fit one wave. One launch up to
    ONE_LAUNCH_TOKENS (model, T = 1: 6.5 us and one launch against 5.5 us and three); beyond, the rows' 1 / rms one
    after another and a routing pass per 4 rows, each a round trip, cost more than two launches (T = 16: 14.0 us
    against 5.5), and the routing stage takes route_rows rows a block (moe_route's default for the tokens)."""
    experts = problem.routing.experts
    if problem.tokens <= DECODE_TOKENS:
        block_t, block_e, threads, stages = 16, 64, 128, 2
    else:
        block_t = 128 if problem.tokens >= 1024 else 64
        block_e, threads, stages = 128, 2 * block_t, 3
    blocks = -(-max(problem.tokens, 1) // block_t) * -(-experts // block_e)
    wanted = -(-SMS // blocks) if problem.tokens <= DECODE_TOKENS else max(1, SMS // blocks)
    splits = max(v for v in GATE_SPACE.params["splits"] if v <= wanted)
    separate = problem.tokens > ONE_LAUNCH_TOKENS
    return {"block_t": block_t, "block_e": block_e, "block_d": 64, "splits": splits, "threads": threads,
            "num_stages": stages, "route_rows": 4 if problem.tokens >= 512 and separate else 1,
            "separate_route": separate}
