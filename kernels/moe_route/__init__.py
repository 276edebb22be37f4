"""Fused MoE routing (docs/operators.md section 1): operator records, entry points, inputs, oracle, cost, presets
(the hypothesis strategies of inputs, for the tests and `flashkern check`, are in cases.py).

Two operators share one routing core:
  moe_route       router logits [T, E] fp32 -> (weights [T, k] fp32, ids [T, k] int32)
  moe_route_gate  hidden [T, D] bf16 and gate weight [E, D] bf16 (optional RMSNorm) -> the same,
                  with the fp32 logits computed on the way (one launch at decode; at prefill a GEMM
                  launch, then the routing)
The math and the choices the spec leaves open are in flashkern.reference.moe_route.
"""

from __future__ import annotations

import torch
from torch import Tensor

from flashkern import checks
from flashkern.dispatch import call
from flashkern.kernels._tilelang import TileLangKernel
from flashkern.kernels._triton import TritonKernel
from flashkern.kernels.moe_route import tilelang_kernels as tl_kernels
from flashkern.kernels.moe_route import triton_kernels as tr_kernels
from flashkern.kernels.moe_route.cases import gate_cases, route_cases
from flashkern.kernels.moe_route.problem import V3, V41_FLASH, RouteProblem, Routing, empty_outputs  # noqa: F401
from flashkern.reference import moe_route as ref
from flashkern.registry import Cost, Implementation, Operator


# ---------------------------------------------------------------- argument checks


def _check_routing(inputs: dict, experts: int) -> Routing:
    checks.choice("score", inputs["score"], ref.SCORES)
    n_group = checks.integer("n_group", inputs["n_group"], low=1, high=experts, why=lambda: f"{experts} experts")
    if experts % n_group:
        raise ValueError(f"n_group={n_group} does not divide the {experts} experts")
    if n_group > 1 and experts // n_group < 2:
        raise ValueError(f"n_group={n_group} leaves one expert per group; groups need at least two (as in vLLM)")
    topk_group = checks.integer("topk_group", inputs["topk_group"], low=1, high=n_group,
                                why=lambda: f"n_group={n_group}")
    eligible = topk_group * (experts // n_group)
    top_k = checks.integer("top_k", inputs["top_k"], low=1, high=eligible, why=lambda: (
        f"{experts} experts" if n_group == 1 else f"{eligible} experts in {topk_group} of {n_group} groups"))
    return Routing(experts=experts, top_k=top_k, score=inputs["score"], n_group=n_group, topk_group=topk_group,
                   group_score=checks.choice("group_score", inputs["group_score"], ref.GROUP_SCORES),
                   renormalize=checks.flag("renormalize", inputs["renormalize"]),
                   scaling_factor=checks.real("scaling_factor", inputs["scaling_factor"]))


def _check_common(inputs: dict, tokens: int, experts: int, device) -> dict:
    bias = checks.optional_tensor("bias", inputs["bias"], dtype=torch.float32, shape=(experts,), device=device)
    valid = checks.optional_tensor("valid", inputs["valid"], dtype=torch.bool, shape=(tokens,), device=device)
    return dict(routing=_check_routing(inputs, experts), has_bias=bias is not None, has_valid=valid is not None)


def check_route(inputs: dict) -> RouteProblem:
    logits = checks.tensor("logits", inputs["logits"], dtype=torch.float32, shape=(None, None), strided=True)
    tokens, experts = logits.shape
    if experts == 0:
        raise ValueError("logits must have at least one expert column, got shape " + str(list(logits.shape)))
    return RouteProblem(tokens=tokens, **_check_common(inputs, tokens, experts, logits.device))


def check_route_gate(inputs: dict) -> RouteProblem:
    hidden = checks.tensor("hidden", inputs["hidden"], dtype=torch.bfloat16, shape=(None, None), strided=True)
    tokens, dim = hidden.shape
    if dim == 0:
        raise ValueError("hidden must have a nonzero hidden size, got shape " + str(list(hidden.shape)))
    gate = checks.tensor("gate_weight", inputs["gate_weight"], dtype=torch.bfloat16, shape=(None, dim),
                         device=hidden.device)
    if gate.shape[0] == 0:
        raise ValueError("gate_weight must have at least one expert row")
    norm = checks.optional_tensor("norm_weight", inputs["norm_weight"], dtype=torch.bfloat16, shape=(dim,),
                                  device=hidden.device)
    eps = checks.real("norm_eps", inputs["norm_eps"], positive=True)
    return RouteProblem(tokens=tokens, hidden=dim, has_norm=norm is not None, norm_eps=eps,
                        **_check_common(inputs, tokens, gate.shape[0], hidden.device))


# ---------------------------------------------------------------- realistic inputs


def _common_inputs(problem: RouteProblem, gen: torch.Generator) -> dict:
    r = problem.routing
    inputs = dict(bias=0.1 * torch.randn(r.experts, generator=gen) if problem.has_bias else None,
                  valid=None, **r.kwargs())
    if problem.has_valid:  # the last eighth of the rows are padding
        valid = torch.ones(problem.tokens, dtype=torch.bool)
        valid[problem.tokens - problem.tokens // 8:] = False
        inputs["valid"] = valid
    return inputs


def _to(inputs: dict, device) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def make_route_inputs(problem: RouteProblem, device="cpu", seed: int = 0) -> dict:
    """Router logits ~ N(0, 2^2); correction bias ~ N(0, 0.1^2); padding rows hold NaN logits."""
    gen = torch.Generator().manual_seed(seed)
    inputs = _common_inputs(problem, gen)
    logits = 2.0 * torch.randn(problem.tokens, problem.routing.experts, generator=gen)
    if inputs["valid"] is not None:
        logits[~inputs["valid"]] = float("nan")
    return _to(dict(logits=logits, **inputs), device)


def make_route_gate_inputs(problem: RouteProblem, device="cpu", seed: int = 0) -> dict:
    """Hidden states ~ N(0, 1) and a gate weight ~ N(0, 1/D), both bf16; norm weight ~ 1 + N(0, 0.1^2)."""
    gen = torch.Generator().manual_seed(seed)
    inputs = _common_inputs(problem, gen)
    d, e = problem.hidden, problem.routing.experts
    inputs.update(
        hidden=torch.randn(problem.tokens, d, generator=gen).to(torch.bfloat16),
        gate_weight=(torch.randn(e, d, generator=gen) / d**0.5).to(torch.bfloat16),
        norm_weight=(1 + 0.1 * torch.randn(d, generator=gen)).to(torch.bfloat16) if problem.has_norm else None,
        norm_eps=problem.norm_eps,
    )
    return _to(inputs, device)


# ---------------------------------------------------------------- the oracle


SCORE_SLOPE = {"sigmoid": 0.25, "sqrtsoftplus": 0.33, "softmax": 2.0}  # bounds on |d score / d logit| (softmax: of
# one score, when every logit moves by at most the same amount: |ds_i| <= 2 s_i max|dx| <= 2 max|dx|)


def check_routing_result(logits: torch.Tensor, inputs: dict, weights: torch.Tensor, ids: torch.Tensor,
                         key_tol: float, atol: float, rtol: float, exact_ties: bool = True,
                         logit_error: torch.Tensor | None = None) -> None:
    """Property oracle for one routing result (reference/moe_route.py).

    Invalid rows: ids -1 and weights 0, exactly. Valid rows: ids distinct and in range; every
    chosen expert lies in a group that may be among the topk_group best (group scores within
    key_tol of the worst kept group count as tied); the chosen keys are >= every other key in
    the groups the selection must have kept: those beating the best droppable group, and those
    it used (ties within key_tol pass); the row is in descending key (within key_tol); weights are
    finite and equal the reference formula applied to the chosen ids (atol/rtol).
    logit_error [T, E]: a bound on how far the kernel's logits may be from `logits` (a computed GEMM's rounding);
    each row's largest bound, through the score's slope, widens the key comparisons and the weights' tolerance.
    With exact_ties (when `logits` are the kernel's own inputs), experts with identical inputs
    (logit and bias; their keys are equal on every backend) follow the tie rule exactly: an
    unchosen one in a used group never has a lower id than a chosen one, and chosen ones appear
    in ascending id.
    """
    tokens, experts = logits.shape
    k, n_group, topk_group = inputs["top_k"], inputs["n_group"], inputs["topk_group"]
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32, (weights.dtype, ids.dtype)
    assert weights.shape == (tokens, k) and ids.shape == (tokens, k), (weights.shape, ids.shape)
    weights, ids, logits = weights.cpu(), ids.cpu(), logits.cpu()
    valid = torch.ones(tokens, dtype=torch.bool) if inputs["valid"] is None else inputs["valid"].cpu()
    bad_padding = (ids[~valid] != -1).any(dim=1) | (weights[~valid] != 0).any(dim=1)
    assert not bad_padding.any(), f"invalid rows {torch.nonzero(~valid)[bad_padding].flatten().tolist()[:8]} not (-1, 0)"
    ids, logits = ids[valid].long(), logits[valid]
    rows = ids.shape[0]
    score_error = torch.zeros(rows, 1, dtype=torch.float64) if logit_error is None else (
        SCORE_SLOPE[inputs["score"]] * logit_error.cpu()[valid].double().amax(dim=1, keepdim=True))
    if rows == 0:
        return
    out_of_range = ((ids < 0) | (ids >= experts)).any(dim=1)
    assert not out_of_range.any(), f"ids out of range in rows {torch.nonzero(out_of_range).flatten().tolist()[:8]}"
    chosen = torch.zeros(rows, experts, dtype=torch.bool).scatter_(1, ids, True)
    repeated = chosen.sum(dim=1) != k
    assert not repeated.any(), f"repeated ids in rows {torch.nonzero(repeated).flatten().tolist()[:8]}: {ids[repeated][:4]}"
    nonfinite = ~torch.isfinite(weights[valid]).all(dim=1)
    assert not nonfinite.any(), f"non-finite weights in rows {torch.nonzero(nonfinite).flatten().tolist()[:8]}"

    s = ref.scores(logits, inputs["score"])
    bias = None if inputs["bias"] is None else inputs["bias"].cpu()
    b = ref.selection_keys(s, bias).double()
    def near(lo, hi, keys=1):
        """lo >= hi up to key_tol, and up to the keys' possible error (sums of `keys` keys: group scores)."""
        slack = 2 * keys * (score_error if lo.dim() == 2 else score_error[:, 0])  # per row
        return (lo >= hi) | (lo >= hi - key_tol * (1 + hi.abs()) - slack)

    must_keep = torch.ones(rows, experts, dtype=torch.bool)
    used = torch.ones(rows, 1, dtype=torch.bool)
    if n_group > 1:
        form = ref.group_form(inputs["group_score"], bias is not None)
        gscore = ref.group_scores(b, n_group, form)
        ranked = gscore.sort(dim=1, descending=True).values
        worst_kept = ranked[:, topk_group - 1 : topk_group]
        best_dropped = ranked[:, topk_group : topk_group + 1] if topk_group < n_group else torch.full_like(worst_kept, -torch.inf)
        summed = 2 if ref.group_form(inputs["group_score"], bias is not None) == "top2" else 1
        surely = ~near(best_dropped, gscore, summed)  # beats every group a correct selection may drop: always kept
        possible = near(gscore, worst_kept, summed)  # ties with the worst kept group: may be kept
        used = chosen.view(rows, n_group, -1).any(dim=2)
        outside = (used & ~possible).any(dim=1)
        assert not outside.any(), f"rows {torch.nonzero(outside).flatten().tolist()[:8]} chose experts outside the top groups"
        kept = surely | used
        too_many = kept.sum(dim=1) > topk_group
        assert not too_many.any(), f"rows {torch.nonzero(too_many).flatten().tolist()[:8]} use more than topk_group groups"
        must_keep = kept.repeat_interleave(experts // n_group, dim=1)
        used = used.repeat_interleave(experts // n_group, dim=1)
    lowest_chosen = torch.where(chosen, b, torch.inf).amin(dim=1)
    best_other = torch.where(must_keep & ~chosen, b, -torch.inf).amax(dim=1)
    beaten = ~near(lowest_chosen, best_other)
    assert not beaten.any(), (
        f"rows {torch.nonzero(beaten).flatten().tolist()[:8]}: a chosen key is below an unchosen one "
        f"(chosen min {lowest_chosen[beaten][:4].tolist()}, other max {best_other[beaten][:4].tolist()})")
    chosen_keys = b.gather(1, ids)
    unordered = ~near(chosen_keys[:, :-1], chosen_keys[:, 1:]).all(dim=1)
    assert not unordered.any(), (
        f"rows {torch.nonzero(unordered).flatten().tolist()[:8]} are not in descending key: "
        f"{chosen_keys[unordered][:2]}")

    if exact_ties:  # identical inputs: keys equal on every backend, so the lower id must win exactly
        # NaN, -inf and (but for sigmoid, where it scores 1) +inf logits all score 0 on every backend
        zero = torch.isnan(logits) | torch.isneginf(logits) | (torch.isposinf(logits) & (inputs["score"] != "sigmoid"))
        x = torch.where(zero, -torch.inf, logits)
        same = x.gather(1, ids)[:, :, None] == x[:, None, :]  # [rows, k, experts]: chosen vs every expert
        if bias is not None:
            same &= bias[ids][:, :, None] == bias[None, None, :]
        lower = torch.arange(experts)[None, None, :] < ids[:, :, None]
        passed_over = (same & lower & (used & ~chosen)[:, None, :]).any(dim=(1, 2))
        assert not passed_over.any(), (
            f"rows {torch.nonzero(passed_over).flatten().tolist()[:8]}: a tie went to a higher id")
        tied_pairs = same.gather(2, ids[:, None, :].expand(-1, k, -1))  # [rows, k, k]: chosen p vs chosen q
        later = torch.arange(k)[:, None] < torch.arange(k)[None, :]
        out_of_order = (tied_pairs & later & (ids[:, :, None] > ids[:, None, :])).any(dim=(1, 2))
        assert not out_of_order.any(), (
            f"rows {torch.nonzero(out_of_order).flatten().tolist()[:8]}: tied experts not in ascending id")

    expected = s.gather(1, ids)
    weight_error = score_error.float()
    if inputs["renormalize"]:  # w_i = s_i / sum s: moves by (ds_i + w_i sum ds) / sum s
        weight_error = weight_error * (1 + k) / expected.sum(dim=1, keepdim=True).clamp_min(1e-30)
        expected = ref.renormalized(expected)
    scale = inputs["scaling_factor"]
    expected = expected * scale
    off = (weights[valid] - expected).abs() > atol + rtol * expected.abs() + abs(scale) * weight_error
    assert not off.any(), (f"weights off in rows {torch.nonzero(off.any(dim=1)).flatten().tolist()[:8]}: "
                           f"got {weights[valid][off][:4].tolist()}, expected {expected[off][:4].tolist()}")


def compare_route(inputs: dict, expected, actual) -> None:
    check_routing_result(inputs["logits"], inputs, *actual, key_tol=1e-6, atol=2e-5, rtol=1e-5)


def compare_route_gate(inputs: dict, expected, actual) -> None:
    """The kernel's logits are D-long fp32 dot products summed in its own order: each may be off by
    D u sum_d |h_d w_d| (u = 2^-24; any summation order), which cancellation can make large against the logit
    itself. That bound (doubled) flows through the scores into the key and weight comparisons."""
    hidden, weight = inputs["hidden"].cpu(), inputs["gate_weight"].cpu()
    norm = None if inputs["norm_weight"] is None else inputs["norm_weight"].cpu()
    logits = ref.gate_logits(hidden, weight, norm, inputs["norm_eps"])
    magnitude = ref.gate_logits(hidden, weight, norm, inputs["norm_eps"], absolute=True)
    error = 2 * hidden.shape[1] * 2.0**-24 * magnitude
    check_routing_result(logits, inputs, *actual, key_tol=1e-6, atol=2e-5, rtol=1e-5, exact_ties=False,
                         logit_error=torch.nan_to_num(error, nan=0.0))


# ---------------------------------------------------------------- cost


def route_cost(problem: RouteProblem) -> Cost:
    t, r = problem.tokens, problem.routing
    # per expert: score (~4 ops), bias, and a compare + select in each of the k rounds
    flops = t * r.experts * (6 + 2 * r.top_k)
    moved = t * r.experts * 4 + t * r.top_k * 8 + (r.experts * 4 if problem.has_bias else 0) + (t if problem.has_valid else 0)
    return Cost(flops=flops, bytes=moved)


def route_gate_cost(problem: RouteProblem) -> Cost:
    t, d, e = problem.tokens, problem.hidden, problem.routing.experts
    base = route_cost(problem)
    gemm_bytes = 2 * (t * d + e * d + (d if problem.has_norm else 0))
    return Cost(flops=base.flops + 2 * t * d * e, bytes=base.bytes - t * e * 4 + gemm_bytes, math="bf16")


# ---------------------------------------------------------------- presets


def _presets(hidden_v41: int, hidden_v3: int, norm: bool, model_tokens, smoke_tokens) -> dict:
    def grid(routing, hidden, tokens):
        return tuple(RouteProblem(tokens=t, routing=routing, hidden=hidden, has_norm=norm and bool(hidden))
                     for t in tokens)

    return {
        "smoke": grid(V41_FLASH, hidden_v41, smoke_tokens) + grid(V3, hidden_v3, smoke_tokens),
        "v41-flash": grid(V41_FLASH, hidden_v41, model_tokens),
        "v3": grid(V3, hidden_v3, model_tokens),
    }


ROUTE_PRESETS = _presets(0, 0, False, model_tokens=(1, 16, 128, 1024, 4096, 16384), smoke_tokens=(1, 37, 256))
# V4.1-Flash hidden 5120 (the gate reads the RMS-normalized residual); V3 hidden 7168
GATE_PRESETS = _presets(5120, 7168, True, model_tokens=(1, 16, 128, 1024, 4096), smoke_tokens=(1, 37))


# ---------------------------------------------------------------- entry points and records


def moe_route(logits: Tensor, bias: Tensor | None = None, *, top_k: int, score: str = "sqrtsoftplus", n_group: int = 1,
              topk_group: int = 1, group_score: str = "auto", renormalize: bool = True, scaling_factor: float = 1.0,
              valid: Tensor | None = None, backend: str = "auto", config: dict | None = None,
              out: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """Fused MoE routing from router logits, in one kernel launch, with vLLM's routing rules.

    s = score(logits), non-finite scores set to 0; b = s + bias; [groups: keep the topk_group groups
    with the best group scores]; ids = top_k of b in descending b, ties to the lower id; w = s[ids]
    (unbiased), divided by its sum when that is positive if renormalize, times scaling_factor.
    Rows with valid == False give ids -1 and weights 0. Weights are always finite; every backend
    breaks ties the same way. The full contract is in flashkern.reference.moe_route.

    Args:
        logits: [T, E] fp32 router logits (rows may be strided).
        bias: [E] fp32 correction bias (selection only), or None.
        top_k, score ("sqrtsoftplus" | "sigmoid" | "softmax"), n_group, topk_group, renormalize,
        scaling_factor: the routing rule (V4.1-Flash: 6, "sqrtsoftplus", 1, 1, True, 1.5).
        group_score: "auto" (vLLM's rule: "top2" with a bias, "max" without) | "max" (a group's largest
            key) | "top2" (the sum of its two largest keys).
        valid: [T] bool row mask, or None.
        backend: "reference" | "triton" | "tilelang" | "auto"; config: explicit tuning config.
    Returns:
        (weights [T, top_k] fp32, ids [T, top_k] int32), each row in descending key.
    """
    return call(MOE_ROUTE, locals())


def moe_route_gate(hidden: Tensor, gate_weight: Tensor, bias: Tensor | None = None, *, norm_weight: Tensor | None = None,
                   norm_eps: float = 1e-6, top_k: int, score: str = "sqrtsoftplus", n_group: int = 1,
                   topk_group: int = 1, group_score: str = "auto", renormalize: bool = True,
                   scaling_factor: float = 1.0, valid: Tensor | None = None, backend: str = "auto",
                   config: dict | None = None, out: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """Fused gate and MoE routing: logits = RMSNorm(hidden) @ gate_weight^T in fp32, then moe_route.

    Args:
        hidden: [T, D] bf16 hidden states (rows may be strided); gate_weight: [E, D] bf16.
        norm_weight: [D] bf16 RMSNorm weight, or None for no norm; norm_eps: its epsilon.
            The normalized hidden state is rounded to bf16 before the product (as an unfused norm would).
        The other arguments and the result are those of moe_route.
    """
    return call(MOE_ROUTE_GATE, locals())


MOE_ROUTE = Operator(
    name="moe_route",
    summary="MoE routing from fp32 logits: scores, bias, groups, top-k, weights",
    entry=moe_route,
    reference=ref.moe_route,
    implementations=(
        Implementation("triton", TritonKernel(tr_kernels.plan_route), tr_kernels.ROUTE_SPACE, tr_kernels.route_default),
        Implementation("tilelang", TileLangKernel(tl_kernels.route_program, tl_kernels.route_args), tl_kernels.ROUTE_SPACE,
                       tl_kernels.route_default),
    ),
    check=check_route,
    outputs=empty_outputs,
    make_inputs=make_route_inputs,
    compare=compare_route,
    cost=route_cost,
    presets=ROUTE_PRESETS,
    cases=route_cases,
)

MOE_ROUTE_GATE = Operator(
    name="moe_route_gate",
    summary="gate GEMM (+RMSNorm) and MoE routing from bf16 hidden states",
    entry=moe_route_gate,
    reference=ref.moe_route_gate,
    implementations=(
        Implementation("triton", TritonKernel(tr_kernels.plan_route_gate), tr_kernels.GATE_SPACE,
                       tr_kernels.gate_default),
        Implementation("tilelang", TileLangKernel(tl_kernels.route_gate_program, tl_kernels.route_gate_args,
                                      gpu_pass_configs=tl_kernels.GATE_PASS_CONFIGS, layout=tl_kernels.gate_layout),
                       tl_kernels.GATE_SPACE, tl_kernels.gate_default),
    ),
    check=check_route_gate,
    outputs=empty_outputs,
    make_inputs=make_route_gate_inputs,
    compare=compare_route_gate,
    cost=route_gate_cost,
    presets=GATE_PRESETS,
    cases=gate_cases,
)

OPERATORS = (MOE_ROUTE, MOE_ROUTE_GATE)
