"""mHC, manifold-constrained hyper-connections (docs/operators.md section 4): the reference, in plain PyTorch.

The residual is kept as n streams [T, n, D] (n = 4 in the model). Around every sublayer:

  pre:   x = residual flattened to [T, n*D] in fp32
         mix = (x @ fn^T) * rsqrt(mean(x^2) + rms_eps)                 fn [(2+n)n, n*D] fp32
         pre  = sigmoid(mix[:, :n]   * s0 + b[:n])   + pre_eps          the input gates   [T, n]
         post = sigmoid(mix[:, n:2n] * s1 + b[n:2n]) * post_mult        the output gates  [T, n]
         comb = sinkhorn(mix[:, 2n:] viewed [n, n] * s2 + b[2n:])       stream mixing     [T, n, n]
         layer_input = bf16(sum_i w_i * residual_i)                     [T, D], optionally RMS-normed
  post:  out_j = bf16(post_j * y + sum_i comb[i, j] * residual_i)       y: the sublayer output [T, D]

with (s0, s1, s2) = hc_scale and b = hc_base. Sinkhorn (the iteration order is part of the contract):
softmax over each row, + eps; divide by (column sums + eps); then iters - 1 times divide by
(row sums + eps) and by (column sums + eps).

The layer input's collapse (`collapse_kind`), chosen by `pre_mix` and `delayed`:
  delayed=False, no pre_mix   "fresh"    w = pre, the gates computed now (V4)
  delayed=True,  pre_mix      "carried"  w = pre_mix, carried from the previous sublayer (V4.1's delayed pre)
  delayed=True,  no pre_mix   "stream0"  layer_input = residual[:, 0] itself, exactly: the bf16 values copied, no
                                         fp32 sum (V4.1 at model entry; vLLM's mhc_pre_delayed with pre_mix=None)
  delayed=None                           delayed iff pre_mix is given
  delayed=False with a pre_mix is an error. Every kind returns the pre computed now (the next sublayer's pre_mix),
  and the optional RMSNorm applies to the bf16 layer input of every kind.

The V4.1 chain `mhc_post_pre` runs the post of one sublayer and then the pre of the next: literally that
composition (the new residual rounded to bf16 before it feeds the pre).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from flashkern.reference.moe_route import rms_norm_bf16

HC_SCALES = 3  # s0, s1, s2
COLLAPSES = ("fresh", "carried", "stream0")  # what collapses the layer input (module docstring)


class PreOutputs(NamedTuple):
    layer_input: torch.Tensor  # [T, D] bf16
    pre: torch.Tensor  # [T, n] fp32
    post: torch.Tensor  # [T, n] fp32
    comb: torch.Tensor  # [T, n, n] fp32


class ChainOutputs(NamedTuple):
    residual: torch.Tensor  # [T, n, D] bf16: the post of the finished sublayer
    layer_input: torch.Tensor  # [T, D] bf16: the next sublayer's input
    pre: torch.Tensor  # [T, n] fp32: the pre-mix computed now (carried to the next chain)
    post: torch.Tensor  # [T, n] fp32
    comb: torch.Tensor  # [T, n, n] fp32


def mix_width(streams: int) -> int:
    """Rows of fn: n pre + n post + n x n comb logits."""
    return (2 + streams) * streams


def sinkhorn(x: torch.Tensor, iters: int = 20, eps: float = 1e-6) -> torch.Tensor:
    """Near doubly-stochastic projection of logits [..., n, n] (fp32), in the spec's iteration order."""
    m = torch.softmax(x.float(), dim=-1) + eps
    m = m / (m.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        m = m / (m.sum(dim=-1, keepdim=True) + eps)
        m = m / (m.sum(dim=-2, keepdim=True) + eps)
    return m


def mixes(residual: torch.Tensor, fn: torch.Tensor, rms_eps: float) -> torch.Tensor:
    """RMS-scaled mixes [T, (2+n)n]: (x @ fn^T) * rsqrt(mean(x^2) + rms_eps), x = residual as [T, n*D] fp32."""
    x = residual.flatten(1).float()
    return (x @ fn.T) * torch.rsqrt(x.square().mean(dim=1, keepdim=True) + rms_eps)


def gates(mix: torch.Tensor, hc_scale: torch.Tensor, hc_base: torch.Tensor, streams: int, *, pre_eps: float,
          post_mult: float, sinkhorn_eps: float, iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pre [T, n], post [T, n], comb [T, n, n]) from the mixes."""
    n = streams
    pre = torch.sigmoid(mix[:, :n] * hc_scale[0] + hc_base[:n]) + pre_eps
    post = torch.sigmoid(mix[:, n : 2 * n] * hc_scale[1] + hc_base[n : 2 * n]) * post_mult
    logits = (mix[:, 2 * n :] * hc_scale[2] + hc_base[2 * n :]).view(-1, n, n)
    return pre, post, sinkhorn(logits, iters, sinkhorn_eps)


def collapse(residual: torch.Tensor, pre: torch.Tensor, norm_weight: torch.Tensor | None = None,
             norm_eps: float = 1e-6) -> torch.Tensor:
    """The layer input bf16(sum_i pre_i * residual_i) [T, D], then RMSNorm(., norm_weight) when a weight is given."""
    layer_input = torch.einsum("tn,tnd->td", pre, residual.float()).to(torch.bfloat16)
    return layer_input if norm_weight is None else rms_norm_bf16(layer_input, norm_weight, norm_eps)


def collapse_kind(pre_mix: torch.Tensor | None, delayed: bool | None) -> str:
    """The layer input's collapse, one of COLLAPSES (module docstring); delayed=False with a pre_mix raises."""
    if delayed is None:
        delayed = pre_mix is not None
    if pre_mix is not None and not delayed:
        raise ValueError("pre_mix is given, but delayed=False collapses the layer input with the pre-mix computed "
                         "now; pass delayed=True (or None) to collapse with pre_mix, or drop pre_mix")
    return "fresh" if not delayed else "carried" if pre_mix is not None else "stream0"


def layer_input(residual: torch.Tensor, pre: torch.Tensor, *, pre_mix: torch.Tensor | None = None,
                delayed: bool | None = None, norm_weight: torch.Tensor | None = None,
                norm_eps: float = 1e-6) -> torch.Tensor:
    """The layer input [T, D] bf16 of the collapse that pre_mix and delayed select (module docstring); pre is the
    pre-mix computed now."""
    kind = collapse_kind(pre_mix, delayed)
    if kind != "stream0":
        return collapse(residual, pre if kind == "fresh" else pre_mix, norm_weight, norm_eps)
    first = residual[:, 0].clone(memory_format=torch.contiguous_format)  # the stream's bf16 values, copied
    return first if norm_weight is None else rms_norm_bf16(first, norm_weight, norm_eps)


def mhc_pre(residual: torch.Tensor, fn: torch.Tensor, hc_scale: torch.Tensor, hc_base: torch.Tensor, *,
            pre_mix: torch.Tensor | None = None, delayed: bool | None = None, rms_eps: float = 1e-6,
            pre_eps: float = 1e-6, sinkhorn_eps: float = 1e-6, post_mult: float = 2.0, iters: int = 20,
            norm_weight: torch.Tensor | None = None, norm_eps: float = 1e-6) -> PreOutputs:
    """The mHC pre block of one sublayer (module docstring): the gates computed now, and the layer input of the
    collapse that pre_mix and delayed select."""
    streams = residual.shape[1]
    pre, post, comb = gates(mixes(residual, fn, rms_eps), hc_scale, hc_base, streams, pre_eps=pre_eps,
                            post_mult=post_mult, sinkhorn_eps=sinkhorn_eps, iters=iters)
    return PreOutputs(layer_input(residual, pre, pre_mix=pre_mix, delayed=delayed, norm_weight=norm_weight,
                                  norm_eps=norm_eps), pre, post, comb)


def mhc_post(y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """New residual streams out_j = bf16(post_j * y + sum_i comb[i, j] * residual_i) [T, n, D]."""
    mixed = torch.einsum("tij,tid->tjd", comb, residual.float())
    return (mixed + post[:, :, None] * y.float()[:, None, :]).to(torch.bfloat16)


def mhc_post_pre(y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, fn: torch.Tensor,
                 hc_scale: torch.Tensor, hc_base: torch.Tensor, *, pre_mix: torch.Tensor | None = None,
                 delayed: bool | None = None, rms_eps: float = 1e-6, pre_eps: float = 1e-6,
                 sinkhorn_eps: float = 1e-6, post_mult: float = 2.0, iters: int = 20,
                 norm_weight: torch.Tensor | None = None, norm_eps: float = 1e-6) -> ChainOutputs:
    """mhc_post of the finished sublayer, then mhc_pre of the next on the new residual (pre_mix and delayed select
    the layer input's collapse, as in mhc_pre)."""
    new_residual = mhc_post(y, residual, post, comb)
    nxt = mhc_pre(new_residual, fn, hc_scale, hc_base, pre_mix=pre_mix, delayed=delayed, rms_eps=rms_eps,
                  pre_eps=pre_eps, sinkhorn_eps=sinkhorn_eps, post_mult=post_mult, iters=iters,
                  norm_weight=norm_weight, norm_eps=norm_eps)
    return ChainOutputs(new_residual, *nxt)
