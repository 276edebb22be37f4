"""Hypothesis strategies of MoE routing inputs, shared by tests/test_moe_route.py and `flashkern check`.

Each strategy draws one input dict of CPU tensors (callers move it to their device) with the keyword
arguments of the entry point:
  routings()    the routing rule: V4.1-Flash, V3, or a random rule with a valid group structure
                (experts, groups, group score, top_k, score, renormalize, scaling factor)
  route_cases() moe_route inputs: the token count (odd sizes, tails that are not multiples of a tile),
                a bias and a row mask or not, and how the logits look (VALUE_MODES: normal, exact ties on a
                grid or from bf16 rounding, extreme and infinite logits, NaN in valid rows, rows partly or
                wholly NaN / +inf / -inf, a dominating bias); padding rows hold NaN and +inf
  gate_cases()  moe_route_gate inputs: hidden sizes odd and round, normal or large hidden states, an
                optional RMSNorm weight, bias and row mask (padding rows of the hidden state are NaN)
Tensors come from a drawn seed, so failures shrink to small shapes; note() describes each case. Narrow runs (the
`ci` profile, kernels/cases.py) draw the gate's rule and specialization from the model rules and NARROW_GATES.
"""

from __future__ import annotations

import torch
from hypothesis import note
from hypothesis import strategies as st

from flashkern.kernels.cases import narrow, seeded, specialization
from flashkern.kernels.moe_route.problem import V3, V41_FLASH, Routing
from flashkern.reference import moe_route as ref

VALUE_MODES = ("normal", "ties", "bf16", "extreme", "nan_in_valid_rows", "nonfinite_rows", "dominant_bias")
NONFINITE = torch.tensor([float("nan"), float("inf"), float("-inf")])
# Narrow runs (kernels/cases.py): per model rule, the gate's (hidden, bias, row mask, RMSNorm) combinations, between
# them each flag on and off and hidden sizes off every tile (the model's 5120 / 7168 are the build check's)
NARROW_GATES = {V41_FLASH: [(257, True, False, True), (37, False, True, False)],
                V3: [(70, True, True, True), (128, False, False, False)]}


@st.composite
def routings(draw, model_only: bool = False) -> Routing:
    """The two model rules, or (unless model_only) a random rule with a valid group structure."""
    kind = draw(st.sampled_from(["v41", "v3"] + ([] if model_only else ["random"])))
    if kind == "v41":
        return V41_FLASH
    if kind == "v3":
        return V3
    experts = draw(st.sampled_from([2, 7, 16, 40, 64, 160, 384]))
    n_group = draw(st.sampled_from([g for g in (1, 2, 4, 8) if experts % g == 0 and (g == 1 or experts // g >= 2)]))
    topk_group = draw(st.integers(1, n_group)) if n_group > 1 else 1
    group_score = draw(st.sampled_from(ref.GROUP_SCORES)) if n_group > 1 else "auto"
    top_k = draw(st.integers(1, min(12, topk_group * experts // n_group)))
    return Routing(experts=experts, top_k=top_k, score=draw(st.sampled_from(ref.SCORES)), n_group=n_group,
                   topk_group=topk_group, group_score=group_score, renormalize=draw(st.booleans()),
                   scaling_factor=draw(st.sampled_from([1.0, 1.5, 2.5])))


def fill_values(gen: torch.Generator, tokens: int, experts: int, mode: str, valid, has_bias: bool):
    """(logits, bias) in the drawn value mode; invalid rows get NaN (and some inf) logits."""
    logits = 2.0 * torch.randn(tokens, experts, generator=gen)
    bias = 0.1 * torch.randn(experts, generator=gen) if has_bias else None
    if mode == "ties":  # a coarse grid: many exactly equal scores and group sums
        logits = torch.randint(-3, 4, (tokens, experts), generator=gen).float() / 2
        if bias is not None:
            bias = torch.randint(-1, 2, (experts,), generator=gen).float() / 4
    elif mode == "bf16":  # values that went through bf16, as router logits often did: exact ties are common
        logits = logits.bfloat16().float()
        if bias is not None:
            bias = bias.bfloat16().float()
    elif mode == "extreme":
        pick = torch.randint(0, 6, (tokens, experts), generator=gen)
        big = torch.tensor([1e4, -1e4, 88.0, -88.0, float("inf"), float("-inf")])
        logits = torch.where(torch.rand(tokens, experts, generator=gen) < 0.3, big[pick], logits)
    elif mode == "nan_in_valid_rows":
        logits[torch.rand(tokens, experts, generator=gen) < 0.05] = float("nan")
    elif mode == "nonfinite_rows":  # half the rows: NaN, +inf or -inf in every entry, or in half of them
        bad = NONFINITE[torch.randint(0, 3, (tokens, 1), generator=gen)].expand(tokens, experts)
        whole = torch.rand(tokens, 1, generator=gen) < 0.5
        hit = (torch.rand(tokens, 1, generator=gen) < 0.5) & (whole | (torch.rand(tokens, experts, generator=gen) < 0.5))
        logits = torch.where(hit, bad, logits)
    elif mode == "dominant_bias" and bias is not None:
        bias[torch.randperm(experts, generator=gen)[: max(1, experts // 8)]] = 100.0
    if valid is not None:
        logits[~valid] = float("nan")
        logits[~valid, :1] = float("inf")
    return logits, bias


@st.composite
def route_cases(draw, max_tokens: int = 3000, routing=None):
    """moe_route inputs (the default strategy of the operator: `flashkern check moe_route`)."""
    routing = routing or draw(routings())
    tokens = draw(st.one_of(st.integers(1, 40), st.integers(41, max_tokens)))
    mode = draw(st.sampled_from(VALUE_MODES))
    has_bias, has_valid = draw(st.booleans()), draw(st.booleans())
    gen = seeded(draw)
    valid = torch.rand(tokens, generator=gen) < 0.8 if has_valid else None
    logits, bias = fill_values(gen, tokens, routing.experts, mode, valid, has_bias)
    note(f"{routing} tokens={tokens} mode={mode} bias={has_bias} valid={has_valid}")
    return dict(logits=logits, bias=bias, valid=valid, **routing.kwargs())


@st.composite
def gate_cases(draw):
    """moe_route_gate inputs (the default strategy of the operator: `flashkern check moe_route_gate`)."""
    routing = draw(routings(model_only=narrow()))
    tokens = draw(st.one_of(st.integers(1, 20), st.integers(21, 300)))
    hidden, has_bias, has_valid, has_norm = specialization(
        draw, st.tuples(st.one_of(st.integers(1, 70), st.sampled_from([128, 257, 513])), st.booleans(), st.booleans(),
                        st.booleans()),
        lambda: NARROW_GATES[routing])
    gen = seeded(draw)
    valid = torch.rand(tokens, generator=gen) < 0.8 if has_valid else None
    h = torch.randn(tokens, hidden, generator=gen) * draw(st.sampled_from([1.0, 30.0]))
    if valid is not None:
        h[~valid] = float("nan")  # padding rows of the hidden state hold garbage
    note(f"{routing} tokens={tokens} hidden={hidden} bias={has_bias} valid={has_valid} norm={has_norm}")
    return dict(
        hidden=h.to(torch.bfloat16),
        gate_weight=(torch.randn(routing.experts, hidden, generator=gen) / hidden**0.5).to(torch.bfloat16),
        bias=0.1 * torch.randn(routing.experts, generator=gen) if has_bias else None,
        norm_weight=(1 + 0.1 * torch.randn(hidden, generator=gen)).to(torch.bfloat16) if has_norm else None,
        norm_eps=1e-6, valid=valid, **routing.kwargs())
