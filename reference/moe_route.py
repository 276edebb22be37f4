"""Fused MoE routing: the reference (docs/operators.md section 1), following vLLM's routing kernels.

For router logits x [T, E] (fp32):

    s = score(x)                       sqrtsoftplus: sqrt(log(1 + e^x)); sigmoid: 1 / (1 + e^-x);
                                       softmax: e^x / sum_e e^x over the experts of the row
    s = s if s is finite else 0        NaN and +-inf scores become 0 (vLLM's nan_to_num on the scores)
    b = s + bias                       selection keys (bias: per-expert correction, optional);
                                       a NaN key (only a NaN bias makes one) ranks below every number
    with groups (n_group > 1): every group gets a score from its keys b,
        "max":  the largest b of the group (vLLM's grouped_topk without a bias, the V2 form: b = s there)
        "top2": the sum of the group's two largest b (vLLM's grouped_topk with a bias, the V3 form)
        group_score="auto" (the default) is "top2" with a bias and "max" without, as in vLLM;
        only the topk_group best groups stay eligible
    ids = top_k of b among eligible experts, in descending b
    w = s[ids]                         unbiased scores of the chosen experts
    if renormalize: w = w / (sum(w) if sum(w) > 0 else 1)
    w = w * scaling_factor             (whether or not renormalize)

Rows with valid[t] == False give ids -1 and weights 0, whatever their logits (NaN included).

Rules every implementation follows exactly (so all backends return the same ids for the same scores):
- ties, among experts and among groups, go to the lower id; the k entries of a row are in descending
  b, ties in ascending id (a stable descending sort, as vLLM's kernels order them);
- non-finite scores count as 0, so rows with NaN or infinite logits (some or all) give k distinct
  in-range ids and finite weights: an all-NaN row gives the top_k of the bias (the lowest ids without
  one) with weight 0 (the zero sum renormalizes by 1). With softmax, one NaN or +inf logit makes every
  score of its row NaN, hence 0. Deviation from vLLM: its sqrtsoftplus kernel clamps only NaN and
  returns NaN weights for a +inf logit; here +inf scores become 0 as well, so weights are always finite;
- NaN and -inf keys are replaced by the lowest finite fp32 before selection, so a NaN bias ranks its
  expert last;
- fused gate form: logits = RMSNorm(h) @ W^T in fp32, where RMSNorm is computed in fp32 and
  rounded to bf16 before the product (as an unfused bf16 RMSNorm would), and skipped
  when no norm weight is given.
Scores are computed by each backend's own exp/log/sqrt, so they agree to rounding, not bitwise: ids are
identical across backends wherever that rounding does not reorder two keys (exact ties from equal
logits always break the same way). On GPUs, flush-to-zero may also tie the scores of logits below about
-87, which the CPU paths tell apart.
"""

from __future__ import annotations

import torch

SCORES = ("sqrtsoftplus", "sigmoid", "softmax")
GROUP_SCORES = ("auto", "max", "top2")

LOWEST = torch.finfo(torch.float32).min


def scores(logits: torch.Tensor, score: str) -> torch.Tensor:
    """Per-expert scores s = score(logits), fp32, with non-finite scores (NaN, +-inf) set to 0."""
    x = logits.float()
    if score == "sqrtsoftplus":
        s = torch.sqrt(torch.nn.functional.softplus(x))
    elif score == "sigmoid":
        s = torch.sigmoid(x)
    elif score == "softmax":
        s = torch.softmax(x, dim=-1)
    else:
        raise ValueError(f"score must be one of {SCORES}, got {score!r}")
    return torch.where(torch.isfinite(s), s, 0.0)


def selection_keys(s: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """b = s + bias, with NaN and -inf keys moved to the lowest finite fp32 (they rank last)."""
    b = s if bias is None else s + bias.float()
    return torch.where(torch.isnan(b), LOWEST, b).clamp(min=LOWEST)


def group_form(group_score: str, has_bias: bool) -> str:
    """The group score a call uses, "max" or "top2": group_score="auto" means "top2" with a bias, else "max"."""
    if group_score not in GROUP_SCORES:
        raise ValueError(f"group_score must be one of {GROUP_SCORES}, got {group_score!r}")
    if group_score == "auto":
        return "top2" if has_bias else "max"
    return group_score


def group_scores(b: torch.Tensor, n_group: int, form: str) -> torch.Tensor:
    """Score of each expert group from its keys, [T, n_group]: the largest ("max") or the sum of the two
    largest ("top2", at least the lowest finite fp32)."""
    tokens, experts = b.shape
    grouped = b.view(tokens, n_group, experts // n_group)
    if form == "max":
        return grouped.amax(dim=-1)
    return grouped.topk(2, dim=-1).values.sum(dim=-1).clamp(min=LOWEST)


def top_indices(keys: torch.Tensor, k: int) -> torch.Tensor:
    """Positions of the k largest keys of each row, in descending key, ties to the lower position."""
    return keys.sort(dim=-1, descending=True, stable=True).indices[:, :k]


def renormalized(weights: torch.Tensor) -> torch.Tensor:
    """w / (sum(w) if sum(w) > 0 else 1) per row."""
    total = weights.sum(dim=-1, keepdim=True)
    return weights / torch.where(total > 0, total, 1.0)


def moe_route(
    logits: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    top_k: int,
    score: str = "sqrtsoftplus",
    n_group: int = 1,
    topk_group: int = 1,
    group_score: str = "auto",
    renormalize: bool = True,
    scaling_factor: float = 1.0,
    valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Route each token to top_k experts: returns (weights [T, k] fp32, ids [T, k] int32), in descending key."""
    s = scores(logits, score)
    b = selection_keys(s, bias)
    if n_group > 1:
        tokens, experts = b.shape
        best_groups = top_indices(group_scores(b, n_group, group_form(group_score, bias is not None)), topk_group)
        group_mask = torch.zeros(tokens, n_group, dtype=torch.bool, device=b.device)
        group_mask.scatter_(1, best_groups, True)
        eligible = group_mask.repeat_interleave(experts // n_group, dim=1)
        b = b.masked_fill(~eligible, float("-inf"))
    ids = top_indices(b, top_k)
    weights = s.gather(1, ids)
    if renormalize:
        weights = renormalized(weights)
    weights = weights * scaling_factor
    if valid is not None:
        weights = weights.masked_fill(~valid[:, None], 0.0)
        ids = ids.masked_fill(~valid[:, None], -1)
    return weights, ids.to(torch.int32)


def rms_norm_bf16(hidden: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in fp32, rounded to bf16: bf16(h * rsqrt(mean(h^2) + eps) * g)."""
    h = hidden.float()
    return (h * torch.rsqrt(h.pow(2).mean(dim=-1, keepdim=True) + eps) * norm_weight.float()).to(torch.bfloat16)


def gate_logits(
    hidden: torch.Tensor, gate_weight: torch.Tensor, norm_weight: torch.Tensor | None = None, norm_eps: float = 1e-6,
    absolute: bool = False,
) -> torch.Tensor:
    """Router logits in fp32: RMSNorm(h) @ W^T (h [T, D] bf16, W [E, D] bf16); absolute=True gives
    |RMSNorm(h)| @ |W|^T, the scale of each logit's rounding error."""
    if norm_weight is not None:
        hidden = rms_norm_bf16(hidden, norm_weight, norm_eps)
    hidden, gate_weight = hidden.float(), gate_weight.float()
    return hidden.abs() @ gate_weight.abs().t() if absolute else hidden @ gate_weight.t()


def moe_route_gate(
    hidden: torch.Tensor,
    gate_weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
    top_k: int,
    score: str = "sqrtsoftplus",
    n_group: int = 1,
    topk_group: int = 1,
    group_score: str = "auto",
    renormalize: bool = True,
    scaling_factor: float = 1.0,
    valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused gate and routing: moe_route(gate_logits(hidden, gate_weight, norm_weight), ...)."""
    logits = gate_logits(hidden, gate_weight, norm_weight, norm_eps)
    return moe_route(
        logits, bias, top_k=top_k, score=score, n_group=n_group, topk_group=topk_group, group_score=group_score,
        renormalize=renormalize, scaling_factor=scaling_factor, valid=valid,
    )
