"""MoE routing in Triton: the whole routing in one launch, from logits or from hidden states.

Tile plan: a program owns BLOCK_T token rows and the whole expert axis, laid out as slots
[BLOCK_T, G_PAD, EG_PAD]; slot (g, j) holds expert g * EG + j, padding slots hold -inf keys.
  1. s = score(logits), non-finite s -> 0; b = s + bias (NaN keys -> lowest finite)
  2. groups: score = max or top-2 sum of b per group; keep the topk_group best (ties: lowest
     group), mask the rest to -inf
  3. top_k rounds: row max, lowest expert id at the max, gather s there, knock the slot out
  4. renormalize by the sum (1 when it is 0), scale; invalid rows -> (id -1, weight 0)
The fused-gate kernel first forms the logits tile with tl.dot over D in BLOCK_D steps
(RMS-normalized and rounded to bf16 when a norm weight is given, as the reference does).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

import flashkern
from flashkern.autotune.space import Space
from flashkern.kernels._triton import Launch, round_to_bf16
from flashkern.kernels.moe_route.problem import slot_layout
from flashkern.kernels.tiles import SMS

SCORE_CODES = {"sqrtsoftplus": 0, "sigmoid": 1, "softmax": 2}
LOWEST = tl.constexpr(-3.4028234663852886e38)  # lowest finite fp32: NaN keys rank here, below every number


@triton.jit
def _log1p(u):
    """log(1 + u), accurate for tiny u (Goldberg's correction; no log1p under the interpreter)."""
    v = 1.0 + u
    return tl.where(v == 1.0, u, tl.log(v) * u / (v - 1.0))


@triton.jit
def _route_tile(x, row, row_ok, slot_g, slot_j, slot_ok, bias_ptr, valid_ptr, w_ptr, id_ptr, scale,
                EG: tl.constexpr, G: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr,
                TOPK_GROUP: tl.constexpr, GROUP_TOP2: tl.constexpr, SCORE: tl.constexpr, RENORMALIZE: tl.constexpr):
    """Route a [BLOCK_T, G_PAD, EG_PAD] logits tile and store its weights and ids."""
    expert = slot_g * EG + slot_j
    # 1. scores and selection keys
    if SCORE == 0:  # sqrt(softplus(x)), softplus(x) = max(x, 0) + log1p(exp(-|x|))
        s = tl.sqrt(tl.maximum(x, 0.0) + _log1p(tl.exp(-tl.abs(x))))
    elif SCORE == 1:
        s = 1.0 / (1.0 + tl.exp(-x))
    else:
        row_max = tl.max(tl.max(tl.where(slot_ok, x, float("-inf")), axis=2), axis=1)
        e = tl.where(slot_ok, tl.exp(x - row_max[:, None, None]), 0.0)
        s = e / tl.sum(tl.sum(e, axis=2), axis=1)[:, None, None]
    s = tl.where((s < float("inf")) & (s > float("-inf")), s, 0.0)  # NaN and +-inf scores -> 0 (vLLM)
    b = s
    if bias_ptr is not None:
        b = s + tl.load(bias_ptr + expert, mask=slot_ok, other=0.0)
    b = tl.where(b == b, tl.maximum(b, LOWEST), LOWEST)
    b = tl.where(slot_ok, b, float("-inf"))
    # 2. group limiting: keep the TOPK_GROUP groups with the largest max (or top-2 sum) of b
    if G > 1:
        gscore = tl.max(b, axis=2)
        if GROUP_TOP2:
            at1 = tl.argmax(b, axis=2, tie_break_left=True)
            top2 = tl.max(tl.where(slot_j == at1[:, :, None], float("-inf"), b), axis=2)
            gscore = tl.maximum(gscore + top2, LOWEST)
        group = tl.arange(0, x.shape[1])[None, :]
        gscore = tl.where(group < G, gscore, float("-inf"))
        keep = group < 0
        for _ in tl.static_range(TOPK_GROUP):
            best = tl.argmax(gscore, axis=1, tie_break_left=True)
            hit = group == best[:, None]
            keep = keep | hit
            gscore = tl.where(hit, float("-inf"), gscore)
        b = tl.where(keep[:, :, None], b, float("-inf"))
    # 3. top-k rounds over the flattened slots (slot order = expert order)
    BLOCK_T: tl.constexpr = x.shape[0]
    NP: tl.constexpr = x.shape[1] * x.shape[2]
    b = tl.reshape(b, (BLOCK_T, NP))
    s = tl.reshape(s, (BLOCK_T, NP))
    expert = tl.reshape(expert, (1, NP))
    slot = tl.arange(0, NP)[None, :]
    col = tl.arange(0, K_PAD)[None, :]
    weights = tl.zeros((BLOCK_T, K_PAD), tl.float32)
    ids = tl.zeros((BLOCK_T, K_PAD), tl.int32)
    for r in tl.static_range(K):
        pick = tl.argmax(b, axis=1, tie_break_left=True)
        hit = slot == pick[:, None]
        chosen_s = tl.sum(tl.where(hit, s, 0.0), axis=1)
        chosen_e = tl.sum(tl.where(hit, expert, 0), axis=1)
        weights = tl.where(col == r, chosen_s[:, None], weights)
        ids = tl.where(col == r, chosen_e[:, None], ids)
        b = tl.where(hit, float("-inf"), b)
    # 4. renormalize (a zero sum divides by 1), scale, mask invalid rows, store
    if RENORMALIZE:
        total = tl.sum(weights, axis=1)
        weights = weights / tl.where(total > 0.0, total, 1.0)[:, None]
    weights = weights * scale
    if valid_ptr is not None:
        keep_row = tl.load(valid_ptr + row, mask=row_ok, other=0) != 0
        weights = tl.where(keep_row[:, None], weights, 0.0)
        ids = tl.where(keep_row[:, None], ids, -1)
    out = row[:, None] * K + col
    out_ok = row_ok[:, None] & (col < K)
    tl.store(w_ptr + out, weights, mask=out_ok)
    tl.store(id_ptr + out, ids, mask=out_ok)


@triton.jit
def _slots(BLOCK_T: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, EG: tl.constexpr, EG_PAD: tl.constexpr):
    """Group and in-group index of every slot, [1, G_PAD, 1] and [1, 1, EG_PAD], and the slot mask."""
    slot_g = tl.arange(0, G_PAD)[None, :, None]
    slot_j = tl.arange(0, EG_PAD)[None, None, :]
    return slot_g, slot_j, (slot_g < G) & (slot_j < EG)


@triton.jit(do_not_specialize=["T"])  # per-step sizes: one compile whatever the batch
def moe_route_kernel(logits_ptr, stride_t, bias_ptr, valid_ptr, w_ptr, id_ptr, T, scale,
                     G: tl.constexpr, G_PAD: tl.constexpr, EG: tl.constexpr, EG_PAD: tl.constexpr,
                     K: tl.constexpr, K_PAD: tl.constexpr, TOPK_GROUP: tl.constexpr, GROUP_TOP2: tl.constexpr,
                     SCORE: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr):
    row = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = row < T
    slot_g, slot_j, slot_ok = _slots(BLOCK_T, G, G_PAD, EG, EG_PAD)
    r3 = row[:, None, None]
    x = tl.load(logits_ptr + r3.to(tl.int64) * stride_t + slot_g * EG + slot_j,
                mask=(r3 < T) & slot_ok, other=0.0)
    _route_tile(x, row, row_ok, slot_g, slot_j, slot_ok, bias_ptr, valid_ptr, w_ptr, id_ptr, scale,
                EG, G, K, K_PAD, TOPK_GROUP, GROUP_TOP2, SCORE, RENORMALIZE)


NORM_BLOCK = tl.constexpr(512)  # columns per step of the sum of squares: 32 values a thread for 16 rows on 8 warps


@triton.jit
def _inv_rms(h_rows, row_ok, D, norm_eps, BLOCK_T: tl.constexpr):
    """1 / rms of each token row of h over all D, [BLOCK_T]."""
    ssq = tl.zeros((BLOCK_T,), tl.float32)
    for d0 in range(0, D, NORM_BLOCK):
        d = d0 + tl.arange(0, NORM_BLOCK)[None, :]
        h = tl.load(h_rows + d, mask=row_ok[:, None] & (d < D), other=0.0).to(tl.float32)
        ssq += tl.sum(h * h, axis=1)
    return 1.0 / tl.sqrt(ssq / D + norm_eps)


@triton.jit
def _gate_logits(acc, h_rows, row_ok, gate_ptr, norm_ptr, inv_rms, w_expert, w_ok, d_lo, d_hi, D,
                 BLOCK_D: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """acc [BLOCK_T, slots] += (the normed h) @ W^T over columns [d_lo, d_hi) of D, BLOCK_D at a time."""
    for d0 in range(d_lo, d_hi, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)[None, :]
        d_ok = (d < d_hi) & (d < D)
        h = tl.load(h_rows + d, mask=row_ok[:, None] & d_ok, other=0.0)
        if norm_ptr is not None:  # RMS-normalized and rounded to bf16, as the reference does
            g = tl.load(norm_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
            h = round_to_bf16(h.to(tl.float32) * inv_rms[:, None] * g).to(tl.bfloat16)
        w = tl.load(gate_ptr + w_expert.to(tl.int64)[:, None] * D + d, mask=w_ok[:, None] & d_ok, other=0.0)
        if UPCAST_DOT:  # the interpreter cannot multiply bf16; fp32 products of bf16 values are exact
            acc = tl.dot(h.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(h, tl.trans(w), acc)
    return acc


@triton.jit
def _slot_experts(slot, G: tl.constexpr, EG: tl.constexpr, EG_PAD: tl.constexpr):
    """The expert of each flat slot (g * EG_PAD + j) and whether the slot holds one."""
    return (slot // EG_PAD) * EG + slot % EG_PAD, ((slot // EG_PAD) < G) & ((slot % EG_PAD) < EG)


@triton.jit(do_not_specialize=["T"])  # per-step sizes: one compile whatever the batch
def moe_route_gate_kernel(h_ptr, stride_t, gate_ptr, norm_ptr, norm_eps, bias_ptr, valid_ptr, w_ptr, id_ptr,
                          T, D, scale,
                          G: tl.constexpr, G_PAD: tl.constexpr, EG: tl.constexpr, EG_PAD: tl.constexpr,
                          K: tl.constexpr, K_PAD: tl.constexpr, TOPK_GROUP: tl.constexpr, GROUP_TOP2: tl.constexpr,
                          SCORE: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
                          UPCAST_DOT: tl.constexpr):
    row = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = row < T
    h_rows = h_ptr + row.to(tl.int64)[:, None] * stride_t
    w_expert, w_ok = _slot_experts(tl.arange(0, G_PAD * EG_PAD), G, EG, EG_PAD)
    inv_rms = None
    if norm_ptr is not None:
        inv_rms = _inv_rms(h_rows, row_ok, D, norm_eps, BLOCK_T)
    acc = tl.zeros((BLOCK_T, G_PAD * EG_PAD), tl.float32)
    acc = _gate_logits(acc, h_rows, row_ok, gate_ptr, norm_ptr, inv_rms, w_expert, w_ok, 0, D, D, BLOCK_D, UPCAST_DOT)
    slot_g, slot_j, slot_ok = _slots(BLOCK_T, G, G_PAD, EG, EG_PAD)
    _route_tile(tl.reshape(acc, (BLOCK_T, G_PAD, EG_PAD)), row, row_ok, slot_g, slot_j, slot_ok, bias_ptr, valid_ptr,
                w_ptr, id_ptr, scale, EG, G, K, K_PAD, TOPK_GROUP, GROUP_TOP2, SCORE, RENORMALIZE)


@triton.jit(do_not_specialize=["T"])  # per-step sizes: one compile whatever the batch
def moe_route_gate_split_kernel(h_ptr, stride_t, gate_ptr, norm_ptr, norm_eps, bias_ptr, valid_ptr, w_ptr, id_ptr,
                                parts_ptr, tickets_ptr, T, D, split_d, splits, scale,
                                G: tl.constexpr, G_PAD: tl.constexpr, EG: tl.constexpr, EG_PAD: tl.constexpr,
                                K: tl.constexpr, K_PAD: tl.constexpr, TOPK_GROUP: tl.constexpr,
                                GROUP_TOP2: tl.constexpr, SCORE: tl.constexpr, RENORMALIZE: tl.constexpr,
                                BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr,
                                EPI_T: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """The decode gate as a split GEMV: program (tile, s, e), e fastest, computes the fp32 partial logits of token
    tile `tile`, expert slots [e BLOCK_E, +BLOCK_E) over D columns [s split_d, +split_d) into parts[s]; the tile's
    last program to finish (a ticket) sums the splits in order (deterministic) and routes the tile's tokens, EPI_T
    at a time."""
    NP: tl.constexpr = G_PAD * EG_PAD
    E_TILES: tl.constexpr = NP // BLOCK_E
    group = splits * E_TILES
    tile = tl.program_id(0) // group
    split = tl.program_id(0) % group // E_TILES
    row = tile * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = row < T
    h_rows = h_ptr + row.to(tl.int64)[:, None] * stride_t
    slot = tl.program_id(0) % E_TILES * BLOCK_E + tl.arange(0, BLOCK_E)
    w_expert, w_ok = _slot_experts(slot, G, EG, EG_PAD)
    inv_rms = None
    if norm_ptr is not None:
        inv_rms = _inv_rms(h_rows, row_ok, D, norm_eps, BLOCK_T)
    acc = tl.zeros((BLOCK_T, BLOCK_E), tl.float32)
    acc = _gate_logits(acc, h_rows, row_ok, gate_ptr, norm_ptr, inv_rms, w_expert, w_ok, split * split_d,
                       split * split_d + split_d, D, BLOCK_D, UPCAST_DOT)
    tl.store(parts_ptr + (split * T + row.to(tl.int64))[:, None] * NP + slot[None, :], acc, mask=row_ok[:, None])
    # the tile's programs count in: the last to arrive sees every partial (a CTA barrier, one acq_rel atomic)
    tl.debug_barrier()
    if tl.atomic_add(tickets_ptr + tile, 1) == group - 1:
        slot_g, slot_j, slot_ok = _slots(EPI_T, G, G_PAD, EG, EG_PAD)
        for sub in range(0, tl.minimum(BLOCK_T, T - tile * BLOCK_T), EPI_T):  # the tile's tokens, EPI_T at a time
            epi_row = tile * BLOCK_T + sub + tl.arange(0, EPI_T)
            epi_ok = epi_row < T
            logits = tl.zeros((EPI_T, NP), tl.float32)
            for s in range(splits):
                logits += tl.load(parts_ptr + (s * T + epi_row.to(tl.int64))[:, None] * NP + tl.arange(0, NP)[None, :],
                                  mask=epi_ok[:, None], other=0.0)
            _route_tile(tl.reshape(logits, (EPI_T, G_PAD, EG_PAD)), epi_row, epi_ok, slot_g, slot_j, slot_ok,
                        bias_ptr, valid_ptr, w_ptr, id_ptr, scale, EG, G, K, K_PAD, TOPK_GROUP, GROUP_TOP2, SCORE,
                        RENORMALIZE)


def _routing_constexprs(problem) -> dict:
    r = problem.routing
    layout = slot_layout(r)
    return dict(G=r.n_group, G_PAD=layout.groups, EG=r.experts // r.n_group, EG_PAD=layout.group_width,
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
    return Launch(moe_route_kernel, grid=(triton.cdiv(problem.tokens, config["block_t"]),),
                  args=dict(logits_ptr=logits, stride_t=logits.stride(0), **_routing_args(problem, inputs, config, out)),
                  num_warps=config["num_warps"])


def gate_splits(problem, config) -> tuple[int, int]:
    """(splits of D, columns per split): config["splits"] (1: the one-CTA-per-tile kernel) capped so that every split
    has at least one BLOCK_D step."""
    block_d = config["block_d"]
    splits = max(1, min(config["splits"], -(-problem.hidden // block_d)))
    split_d = block_d * -(-problem.hidden // (splits * block_d))
    return -(-problem.hidden // split_d), split_d


def plan_route_gate(problem, inputs, config, out):
    hidden = inputs["hidden"]
    args = dict(h_ptr=hidden, stride_t=hidden.stride(0), gate_ptr=inputs["gate_weight"],
                norm_ptr=inputs["norm_weight"], norm_eps=float(inputs["norm_eps"]), D=problem.hidden,
                BLOCK_D=config["block_d"], UPCAST_DOT=flashkern.triton_interpreted(),
                **_routing_args(problem, inputs, config, out))
    tiles = triton.cdiv(problem.tokens, config["block_t"])
    splits, split_d = gate_splits(problem, config)
    if splits == 1:
        return Launch(moe_route_gate_kernel, grid=(tiles,), args=args, num_warps=config["num_warps"],
                      num_stages=config["num_stages"])
    group = splits * slot_layout(problem.routing).slots // config["block_e"]
    parts = torch.empty((splits, problem.tokens, slot_layout(problem.routing).slots), dtype=torch.float32,
                        device=hidden.device)
    tickets = torch.zeros(tiles, dtype=torch.int32, device=hidden.device)
    return Launch(moe_route_gate_split_kernel, grid=(tiles * group,), cooperating=group,
                  args=dict(args, parts_ptr=parts, tickets_ptr=tickets, split_d=split_d, splits=splits,
                            BLOCK_E=config["block_e"], EPI_T=config["epi_t"]),
                  num_warps=config["num_warps"], num_stages=config["num_stages"])


# Register model, measured with `flashkern compile-check` (ptxas, sm_90a): the routing steps keep
# several fp32 [BLOCK_T, slots] tiles live, and more than 32 values of each per thread spill
# (block_t=8, one warp, 256 slots: 280 B). The gate's W tile [slots, BLOCK_D] passes through
# registers on its way to the dot: more than 64 bf16 values per thread spill (512 x 64 on
# 8 warps: 96 B; 256 x 128 on 4 warps: 4 KB). 16 warps cap ptxas at 128 registers and spill too.
def _route_values_per_thread(problem, config) -> int:
    return config["block_t"] * slot_layout(problem.routing).slots // (32 * config["num_warps"])


def _w_tile_values_per_thread(problem, config) -> int:
    return slot_layout(problem.routing).slots * config["block_d"] // (32 * config["num_warps"])


ROUTE_SPACE = Space(
    params={"block_t": (1, 2, 4, 8, 16, 32), "num_warps": (1, 2, 4, 8)},
    gpu_only=("num_warps",),
    limits={"block_t x slots / threads <= 32 (registers)": lambda p, c: _route_values_per_thread(p, c) <= 32},
)


def route_default(problem) -> dict:
    """A warp per 128 slots (4 for 384 experts); rows per program grow with the token count, up to 8.

    Under the interpreter every tl op costs about the same whatever its size: programs take 32 rows.
    """
    warps = max(1, min(8, slot_layout(problem.routing).slots // 128))
    if flashkern.triton_interpreted():
        return {"block_t": 32, "num_warps": 8}
    block_t = max(1, min(8, triton.next_power_of_2(max(1, problem.tokens // 1024))))
    while block_t > 1 and _route_values_per_thread(problem, {"block_t": block_t, "num_warps": warps}) > 32:
        block_t //= 2
    return {"block_t": block_t, "num_warps": warps}


def _split_w_tile_values_per_thread(problem, config) -> int:
    return config["block_e"] * config["block_d"] // (32 * config["num_warps"])


GATE_SPACE = Space(
    params={"block_t": (16, 32, 64), "block_d": (32, 64, 128), "num_warps": (4, 8), "num_stages": (1, 2, 3),
            "splits": (1, 2, 4, 8, 16, 32), "block_e": (16, 64, 128), "epi_t": (1, 4, 16)},
    gpu_only=("num_warps", "num_stages"),
    constraints={"block_e <= slots": lambda p, c: c["block_e"] <= slot_layout(p.routing).slots,
                 "epi_t <= block_t": lambda p, c: c["epi_t"] <= c["block_t"]},
    limits={
        "block_t x slots / threads <= 32 (registers)": lambda p, c: _route_values_per_thread(p, c) <= 32,
        "slots x block_d / threads <= 64 (registers: the W tile)":
            lambda p, c: c["splits"] > 1 or _w_tile_values_per_thread(p, c) <= 64,
        "split: block_e x block_d / threads <= 64 (registers: the W tile)":
            lambda p, c: c["splits"] == 1 or _split_w_tile_values_per_thread(p, c) <= 64,
        "stages x (slots + block_t) x block_d x 2 B <= 200 KiB (shared memory)":
            lambda p, c: c["num_stages"] * 2 * c["block_d"] * (slot_layout(p.routing).slots + c["block_t"]) <= 200 * 1024,
    },
)

SPLIT_GATE_TILES = 4  # token tiles up to which the GPU default splits D (decode): each tile re-reads W


def gate_default(problem) -> dict:
    """16-row MMA tiles on 8 warps. Up to SPLIT_GATE_TILES token tiles (decode), a split GEMV (two stages): 64-slot
    expert blocks and D split so that about SMS programs stream W once per tile, the last one of a tile routing it;
    splits a power of 2 (1 to 32); beyond, a program per token tile with all slots, block_d keeping the W tile at 64
    values per thread, three stages.

    Under the interpreter, where each loop step costs the same whatever its size, block_d is 128 and D is not split
    (the split's configs are tested directly).
    """
    if flashkern.triton_interpreted():
        return {"block_t": 16, "block_d": 128, "num_warps": 8, "num_stages": 1, "splits": 1, "block_e": 64,
                "epi_t": 16}
    slots = slot_layout(problem.routing).slots
    tiles = -(-problem.tokens // 16)
    if tiles <= SPLIT_GATE_TILES:
        block_e = min(64, slots)
        splits = min(32, 1 << (-(-SMS // (tiles * (slots // block_e)))).bit_length() - 1)  # a power of 2
        epi_t = 1 if problem.tokens == 1 else 16  # a lone token routed alone (model: 17.9 -> 6.5 us)
        return {"block_t": 16, "block_d": 64, "num_warps": 8, "num_stages": 2, "splits": splits, "block_e": block_e,
                "epi_t": epi_t}  # (three stages spill 12 B with V3's groups at epi_t 1: ptxas, sm_90a)
    block_d = max(32, min(128, 64 * 256 // slots))
    return {"block_t": 16, "block_d": block_d, "num_warps": 8, "num_stages": 3, "splits": 1, "block_e": 64,
            "epi_t": 16}
