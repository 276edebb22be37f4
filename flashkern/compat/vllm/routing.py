"""vLLM's MoE routing functions with vLLM's call signatures and return conventions.

`from flashkern.compat.vllm import fused_topk_bias` replaces vLLM's import of the same name
(vllm/model_executor/layers/fused_moe/router/):

    fused_topk_bias(...)  fused_topk_bias_router.py  -> (weights fp32 [M, k], ids int32 or indices_type [M, k])
    fused_topk(...)       fused_topk_router.py       -> (weights, ids, token_expert_indices int32 [M, k])
    grouped_topk(...)     grouped_topk_router.py     -> (weights fp32 [M, k], ids int32 [M, k])

All three run flashkern.ops.moe_route (one launch) on gating_output converted to fp32 logits
(fp32, bf16 or fp16 accepted), with its semantics (reference/moe_route.py), which are those of
vLLM's CUDA routing kernels: scores by scoring_func, NaN and +-inf scores set to 0, the correction
bias for selection only, ids in descending key with ties to the lower expert id (and group),
weights divided by their sum when it is positive (renormalize), then times routed_scaling_factor
(whether or not renormalize). grouped_topk scores a group by its largest score without a bias
and by the sum of its two largest biased scores with one, as vLLM's grouped_topk does.

Where vLLM's implementations disagree among themselves, these follow its CUDA kernels; differences
from vLLM that a caller may notice:
- a +inf logit under sqrtsoftplus scores 0 (vLLM's kernel returns NaN weights for it);
- vLLM's Python grouped_topk leaves tie order unspecified and lets NaN propagate; its fused kernel
  divides by sum + 1e-20 and gives all-invalid rows 1/topk; here one rule holds everywhere;
- vLLM reads the padding mask from its forward context; here it is the keyword is_padding
  (bool [M], True = padding row: ids -1, weights 0);
- hash routing (input_tokens, hash_indices_table) is not supported: NotImplementedError;
- grouped_topk with num_expert_group=0 (its default) routes without groups;
- every function also takes backend= ("auto" | "reference" | "triton" | "tilelang").
"""

from __future__ import annotations

import torch

from flashkern import checks
from flashkern.kernels.moe_route import moe_route

__all__ = ["fused_topk", "fused_topk_bias", "grouped_topk"]

GATING_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64, torch.uint32)


def _logits(hidden_states, gating_output) -> torch.Tensor:
    """gating_output [M, E] as fp32 logits, after checking that hidden_states has the same M tokens."""
    gating = checks.tensor("gating_output", gating_output, dtype=GATING_DTYPES, shape=(None, None), strided=True)
    if not isinstance(hidden_states, torch.Tensor):
        raise TypeError(f"hidden_states must be a torch.Tensor, got {type(hidden_states).__name__}")
    if hidden_states.dim() == 0 or hidden_states.shape[0] != gating.shape[0]:
        raise ValueError(f"hidden_states has shape {list(hidden_states.shape)} but gating_output has "
                         f"{gating.shape[0]} tokens: both must have the same number of rows")
    return gating.float()


def _bias(e_score_correction_bias, experts: int, device) -> torch.Tensor | None:
    bias = checks.optional_tensor("e_score_correction_bias", e_score_correction_bias, dtype=GATING_DTYPES,
                                  shape=(experts,), device=device)
    return None if bias is None else bias.float()


def _valid(is_padding, tokens: int, device) -> torch.Tensor | None:
    padding = checks.optional_tensor("is_padding", is_padding, dtype=torch.bool, shape=(tokens,), device=device)
    return None if padding is None else ~padding


def _route(hidden_states, gating_output, scoring_func, scorings, bias, topk, *, is_padding, backend, **rule):
    logits = _logits(hidden_states, gating_output)
    tokens, experts = logits.shape
    checks.choice("scoring_func", scoring_func, scorings)
    checks.integer("topk", topk, low=1, high=experts, why=lambda: f"{experts} experts")
    return moe_route(logits, _bias(bias, experts, logits.device), top_k=topk, score=scoring_func,
                     valid=_valid(is_padding, tokens, logits.device), backend=backend, **rule)


def _ids_as(ids: torch.Tensor, indices_type, padded: bool) -> torch.Tensor:
    if indices_type is None:
        return ids
    checks.choice("indices_type", indices_type, INDEX_DTYPES)
    if padded and indices_type == torch.uint32:
        raise ValueError("indices_type=torch.uint32 cannot hold the -1 ids of padding rows (is_padding given); "
                         "use torch.int32 or torch.int64")
    return ids.to(indices_type)


def fused_topk_bias(hidden_states, gating_output, scoring_func, e_score_correction_bias, topk, renormalize,
                    indices_type=None, input_tokens=None, hash_indices_table=None, routed_scaling_factor=1.0,
                    *, is_padding=None, backend="auto"):
    """Top-k routing with an optional correction bias (vLLM's fused_topk_bias; DeepSeek-V4's sqrtsoftplus).

    Args:
        hidden_states: [M, ...] (only its token count is used); gating_output: [M, E] fp32 / bf16 / fp16.
        scoring_func: "softmax" | "sigmoid" | "sqrtsoftplus".
        e_score_correction_bias: [E] (selection only) or None; topk; renormalize.
        indices_type: dtype of the ids (torch.int32 when None; int64 and uint32 also).
        input_tokens, hash_indices_table: hash routing, not supported (must be None).
        routed_scaling_factor: multiplies the weights, after renormalization.
        is_padding: [M] bool, True for padding rows (ids -1, weights 0), or None.
    Returns:
        (weights fp32 [M, topk], ids [M, topk]), each row in descending biased score.
    """
    for name, value in (("input_tokens", input_tokens), ("hash_indices_table", hash_indices_table)):
        if value is not None:
            raise NotImplementedError(f"{name}: hash routing (ids = hash_indices_table[input_tokens]) is not "
                                      f"supported by flashkern; pass {name}=None")
    weights, ids = _route(hidden_states, gating_output, scoring_func, ("softmax", "sigmoid", "sqrtsoftplus"),
                          e_score_correction_bias, topk, renormalize=renormalize,
                          scaling_factor=checks.real("routed_scaling_factor", routed_scaling_factor),
                          is_padding=is_padding, backend=backend)
    return weights, _ids_as(ids, indices_type, is_padding is not None)


def fused_topk(hidden_states, gating_output, topk, renormalize, indices_type=None, scoring_func="softmax",
               *, is_padding=None, backend="auto"):
    """Top-k routing without bias or scaling (vLLM's fused_topk).

    Args:
        hidden_states: [M, ...] (only its token count is used); gating_output: [M, E] fp32 / bf16 / fp16.
        topk, renormalize; indices_type: dtype of the ids (torch.int32 when None; int64 and uint32 also);
        scoring_func: "softmax" | "sigmoid".
        is_padding: [M] bool, True for padding rows (ids -1, weights 0), or None.
    Returns:
        (weights fp32 [M, topk], ids [M, topk], token_expert_indices int32 [M, topk]) with
        token_expert_indices[r, j] = j * M + r.
    """
    weights, ids = _route(hidden_states, gating_output, scoring_func, ("softmax", "sigmoid"), None, topk,
                          renormalize=renormalize, is_padding=is_padding, backend=backend)
    tokens = ids.shape[0]
    slot = torch.arange(topk, dtype=torch.int32, device=ids.device)[None, :]
    token_expert_indices = slot * tokens + torch.arange(tokens, dtype=torch.int32, device=ids.device)[:, None]
    return weights, _ids_as(ids, indices_type, is_padding is not None), token_expert_indices


def grouped_topk(hidden_states, gating_output, topk, renormalize, num_expert_group=0, topk_group=0,
                 scoring_func="softmax", routed_scaling_factor=1.0, e_score_correction_bias=None,
                 *, is_padding=None, backend="auto"):
    """Group-limited top-k routing (vLLM's grouped_topk; DeepSeek-V2/V3).

    Only the topk_group of the num_expert_group expert groups with the best group scores stay eligible:
    a group's largest score without a bias (V2), the sum of its two largest (score + bias) with one (V3).

    Args:
        hidden_states: [M, ...] (only its token count is used); gating_output: [M, E] fp32 / bf16 / fp16.
        topk, renormalize; num_expert_group (0: no groups), topk_group; scoring_func: "softmax" | "sigmoid";
        routed_scaling_factor: multiplies the weights, after renormalization;
        e_score_correction_bias: [E] (selection only) or None.
        is_padding: [M] bool, True for padding rows (ids -1, weights 0), or None.
    Returns:
        (weights fp32 [M, topk], ids int32 [M, topk]), each row in descending biased score.
    """
    grouped = checks.integer("num_expert_group", num_expert_group, low=0) > 0
    return _route(hidden_states, gating_output, scoring_func, ("softmax", "sigmoid"), e_score_correction_bias, topk,
                  n_group=num_expert_group if grouped else 1, topk_group=topk_group if grouped else 1,
                  group_score="auto", renormalize=renormalize,
                  scaling_factor=checks.real("routed_scaling_factor", routed_scaling_factor),
                  is_padding=is_padding, backend=backend)
