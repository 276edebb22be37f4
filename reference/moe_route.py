"""Fused MoE routing: the reference (SPECS.md section 1).

For router logits x [T, E] (fp32):

    s = score(x)                       sqrtsoftplus: sqrt(log(1 + e^x)); sigmoid: 1 / (1 + e^-x);
                                       softmax: e^x / sum_e e^x over the experts of the row
    b = s + bias                       selection keys (bias: per-expert correction, optional)
    with groups (n_group > 1): a group's score is the sum of its two largest b; only the
                               topk_group best groups stay eligible
    ids = top_k of b among eligible experts
    w = s[ids]                         unbiased scores of the chosen experts
    if renormalize: w = w / max(sum(w), 1e-20)
    w = w * scaling_factor

Rows with valid[t] == False give ids -1 and weights 0, whatever their logits (NaN included).

Choices the spec leaves open, fixed here and followed by every implementation:
- a NaN selection key ranks below every number: NaN (and -inf) keys are replaced by the lowest
  finite fp32 before selection, so ids are always in range and distinct; the weight of a
  chosen NaN score is NaN;
- ties may be broken in any order (implementations take the lowest expert id);
- the order of the k entries of a row is unspecified (implementations emit descending b);
- fused gate form: logits = RMSNorm(h) @ W^T in fp32, where RMSNorm is computed in fp32 and
  rounded to bf16 before the product (as an unfused bf16 RMSNorm would), and skipped
  when no norm weight is given.
"""

from __future__ import annotations

import torch

SCORES = ("sqrtsoftplus", "sigmoid", "softmax")

LOWEST = torch.finfo(torch.float32).min


def scores(logits: torch.Tensor, score: str) -> torch.Tensor:
    """Per-expert scores s = score(logits), fp32."""
    x = logits.float()
    if score == "sqrtsoftplus":
        return torch.sqrt(torch.nn.functional.softplus(x))
    if score == "sigmoid":
        return torch.sigmoid(x)
    if score == "softmax":
        return torch.softmax(x, dim=-1)
    raise ValueError(f"score must be one of {SCORES}, got {score!r}")


def selection_keys(s: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """b = s + bias, with NaN and -inf keys moved to the lowest finite fp32 (they rank last)."""
    b = s if bias is None else s + bias.float()
    return torch.where(torch.isnan(b), LOWEST, b).clamp(min=LOWEST)


def group_scores(b: torch.Tensor, n_group: int) -> torch.Tensor:
    """Score of each expert group: the sum of its two largest keys (at least the lowest finite fp32), [T, n_group]."""
    tokens, experts = b.shape
    return b.view(tokens, n_group, experts // n_group).topk(2, dim=-1).values.sum(dim=-1).clamp(min=LOWEST)


def moe_route(
    logits: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    top_k: int,
    score: str = "sqrtsoftplus",
    n_group: int = 1,
    topk_group: int = 1,
    renormalize: bool = True,
    scaling_factor: float = 1.0,
    valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Route each token to top_k experts: returns (weights [T, k] fp32, ids [T, k] int32)."""
    s = scores(logits, score)
    b = selection_keys(s, bias)
    if n_group > 1:
        tokens, experts = b.shape
        best_groups = group_scores(b, n_group).topk(topk_group, dim=-1).indices
        group_mask = torch.zeros(tokens, n_group, dtype=torch.bool, device=b.device)
        group_mask.scatter_(1, best_groups, True)
        eligible = group_mask.repeat_interleave(experts // n_group, dim=1)
        b = b.masked_fill(~eligible, float("-inf"))
    ids = b.topk(top_k, dim=-1).indices
    weights = s.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp(min=1e-20)
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
    hidden: torch.Tensor, gate_weight: torch.Tensor, norm_weight: torch.Tensor | None = None, norm_eps: float = 1e-6
) -> torch.Tensor:
    """Router logits in fp32: RMSNorm(h) @ W^T (h [T, D] bf16, W [E, D] bf16)."""
    if norm_weight is not None:
        hidden = rms_norm_bf16(hidden, norm_weight, norm_eps)
    return hidden.float() @ gate_weight.float().t()


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
    renormalize: bool = True,
    scaling_factor: float = 1.0,
    valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused gate and routing: moe_route(gate_logits(hidden, gate_weight, norm_weight), ...)."""
    logits = gate_logits(hidden, gate_weight, norm_weight, norm_eps)
    return moe_route(
        logits, bias, top_k=top_k, score=score, n_group=n_group, topk_group=topk_group,
        renormalize=renormalize, scaling_factor=scaling_factor, valid=valid,
    )
