"""vLLM's mHC ops (DeepSeek-V4 / V4.1) with vLLM's call signatures and return conventions.

    vLLM (torch.ops.vllm.<name>_tilelang)   here                         flashkern operator
    mhc_pre                                 mhc_pre                      mhc_pre, delayed=False
    mhc_post                                mhc_post                     mhc_post
    mhc_fused_post_pre                      mhc_fused_post_pre           mhc_post_pre, delayed=False
    mhc_pre_delayed (V4.1)                  mhc_pre_delayed              mhc_pre, delayed=True
    mhc_fused_post_pre_delayed (V4.1)       mhc_fused_post_pre_delayed   mhc_post_pre, delayed=True

The semantics are vLLM's torch references (vllm/model_executor/kernels/mhc/torch.py) and flashkern's
(flashkern/reference/mhc.py), which agree:
- The post gates come back as [..., n, 1]. post_layer_mix may be [..., n, 1] or [..., n].
- The delayed ops collapse the layer input with the carried pre_mix. Without one, the layer input is
  residual stream 0 exactly (vLLM's model entry). They also return the pre-mix computed now
  (next_pre_mix), which the next sublayer carries.
- norm_weight fuses the RMSNorm of the next sublayer's input, applied to the bf16 layer input:
  bf16(li * rsqrt(mean(li^2) + norm_eps) * w), rounded once. vLLM's unfused `_C.rms_norm` rounds
  li * rsqrt(...) to bf16, multiplies by w and rounds again: the two differ by at most a bf16 rounding.
- Token dimensions: every token-indexed tensor may have leading dimensions [..., n, D]. They must be
  contiguous there, and the outputs carry the same leading dimensions.
- n_splits and tile_n tune vLLM's kernels only. They are accepted and ignored: flashkern's configs choose
  their own split.
- Arguments map to flashkern's as follows, and errors name flashkern's argument:
    x -> y (the sublayer output), post_layer_mix -> post, comb_res_mix -> comb, hc_pre_eps -> pre_eps,
    hc_sinkhorn_eps -> sinkhorn_eps, hc_post_mult_value -> post_mult, sinkhorn_repeat -> iters.
Every function takes backend= "auto" | "reference" | "triton" | "tilelang" (flashkern.dispatch).
"""

from __future__ import annotations

import torch

import flashkern.ops as ops
from flashkern import checks

__all__ = ["mhc_pre", "mhc_post", "mhc_fused_post_pre", "mhc_pre_delayed", "mhc_fused_post_pre_delayed"]


def _tokens(name: str, value, trailing: int):
    """value [..., trailing dims] as [T, trailing dims]: a view of a contiguous tensor. Other values pass unchanged,
    for the operator's checks to name."""
    if isinstance(value, torch.Tensor) and value.dim() > trailing + 1:
        if not value.is_contiguous():
            raise ValueError(f"{name} must be contiguous (strides {list(value.stride())}); pass {name}.contiguous()")
        return value.view(-1, *value.shape[-trailing:])
    return value


def _post_gates(post_layer_mix, residual):
    """post_layer_mix [..., n, 1] or [..., n] as [T, n]."""
    if (isinstance(post_layer_mix, torch.Tensor) and isinstance(residual, torch.Tensor)
            and post_layer_mix.dim() == residual.dim() and post_layer_mix.shape[-1] == 1):
        post_layer_mix = post_layer_mix.squeeze(-1)
    return _tokens("post_layer_mix", post_layer_mix, 1)


def _lead(residual: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """A [T, ...] output with the residual's leading token dimensions."""
    return out.view(*residual.shape[:-2], *out.shape[1:])


def _scalars(rms_eps, hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value, sinkhorn_repeat, norm_weight, norm_eps):
    """vLLM's scalars and norm as flashkern's keyword arguments."""
    return dict(rms_eps=rms_eps, pre_eps=hc_pre_eps, sinkhorn_eps=hc_sinkhorn_eps, post_mult=hc_post_mult_value,
                iters=sinkhorn_repeat, norm_weight=norm_weight, norm_eps=norm_eps)


def mhc_pre(residual, fn, hc_scale, hc_base, rms_eps, hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value,
            sinkhorn_repeat, n_splits=1, norm_weight=None, norm_eps=1e-6, *, backend="auto"):
    """vLLM's mhc_pre, the V4 pre block: the layer input collapsed with the pre computed now.

    Args:
        residual: [..., n, D] bf16. fn: [(2+n)n, n*D] fp32. hc_scale: [3] fp32. hc_base: [(2+n)n] fp32.
        n_splits: ignored. norm_weight: [D] bf16 or None.
    Returns:
        (post_mix [..., n, 1] fp32, comb_mix [..., n, n] fp32, layer_input [..., D] bf16).
    """
    out = ops.mhc_pre(_tokens("residual", residual, 2), fn, hc_scale, hc_base, delayed=False, backend=backend,
                      **_scalars(rms_eps, hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value, sinkhorn_repeat,
                                 norm_weight, norm_eps))
    return _lead(residual, out.post.unsqueeze(-1)), _lead(residual, out.comb), _lead(residual, out.layer_input)


def mhc_post(x, residual, post_layer_mix, comb_res_mix, *, backend="auto"):
    """vLLM's mhc_post: out_j = bf16(post_j * x + sum_i comb[i, j] * residual_i), in fp32.

    Args:
        x: [..., D] bf16. residual: [..., n, D] bf16. post_layer_mix: [..., n, 1] or [..., n] fp32.
        comb_res_mix: [..., n, n] fp32.
    Returns:
        [..., n, D] bf16.
    """
    out = ops.mhc_post(_tokens("x", x, 1), _tokens("residual", residual, 2), _post_gates(post_layer_mix, residual),
                       _tokens("comb_res_mix", comb_res_mix, 2), backend=backend)
    return _lead(residual, out)


def mhc_fused_post_pre(x, residual, post_layer_mix, comb_res_mix, fn, hc_scale, hc_base, rms_eps, hc_pre_eps,
                       hc_sinkhorn_eps, hc_post_mult_value, sinkhorn_repeat, n_splits=1, tile_n=1, norm_weight=None,
                       norm_eps=1e-6, *, backend="auto"):
    """vLLM's mhc_fused_post_pre: mhc_post, then the V4 mhc_pre on the bf16 new residual.

    Args: those of mhc_post and mhc_pre. n_splits and tile_n are ignored.
    Returns:
        (residual_cur [..., n, D] bf16, post_mix_cur [..., n, 1], comb_mix_cur [..., n, n],
        layer_input_cur [..., D] bf16).
    """
    chain = ops.mhc_post_pre(
        _tokens("x", x, 1), _tokens("residual", residual, 2), _post_gates(post_layer_mix, residual),
        _tokens("comb_res_mix", comb_res_mix, 2), fn, hc_scale, hc_base, delayed=False, backend=backend,
        **_scalars(rms_eps, hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value, sinkhorn_repeat, norm_weight, norm_eps))
    return (_lead(residual, chain.residual), _lead(residual, chain.post.unsqueeze(-1)), _lead(residual, chain.comb),
            _lead(residual, chain.layer_input))


def _broadcast_fn(residual, fn, x):
    """The broadcast entry's fn [(2+n)n, D], the sum over streams of the full fn, as the full fn [(2+n)n, n*D]
    that gives the same mixes from the residual: fn / n in every stream. The residual is x expanded to the n
    streams (vLLM's precondition), so sum_j r_j . fn / n = x . fn and mean(r^2) = mean(x^2), up to the fp32
    summation order. Dividing by n is exact in fp32 for n a power of two (where |fn| >= 2^-126 n, above the
    subnormals); for other n, NotImplementedError."""
    residual = checks.tensor("residual", residual, dtype=torch.bfloat16, shape=(None, None, None))
    tokens, n, hidden = residual.shape
    checks.tensor("x", x, dtype=torch.bfloat16, shape=(tokens, hidden), device=residual.device)
    checks.tensor("fn", fn, dtype=torch.float32, shape=((2 + n) * n, hidden), device=residual.device)
    if n & (n - 1):
        raise NotImplementedError(f"x= (the broadcast entry) needs n a power of two, got n={n}: splitting fn evenly "
                                  "over the streams would round; pass the expanded residual and the full fn instead")
    return (fn / n).repeat(1, n)


def mhc_pre_delayed(residual, fn, hc_scale, hc_base, rms_eps, hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value,
                    sinkhorn_repeat, pre_mix=None, x=None, norm_weight=None, norm_eps=1e-6, *, backend="auto"):
    """vLLM's mhc_pre_delayed (V4.1): the gates computed now from this sublayer's residual, and the layer input
    collapsed with the carried pre_mix. Without one, the layer input is residual[:, 0] exactly (model entry).

    x (the broadcast entry at the first layer): x = the embedding [T, D] and fn [(2+n)n, D] = the full fn summed
    over the streams, with residual = x expanded to the n streams, as vLLM requires. The mixes equal vLLM's, which
    it computes from x (RMS over D). Here they come from the residual, with fn split evenly over the streams
    (_broadcast_fn: exact for n a power of two, NotImplementedError otherwise). This reads the n streams where
    vLLM reads x once.

    Args:
        residual: [..., n, D] bf16. fn: [(2+n)n, n*D] fp32 ([(2+n)n, D] with x). pre_mix: [..., n] fp32 or None.
        x: [..., D] bf16 or None. norm_weight: [D] bf16 or None.
    Returns:
        (post [..., n, 1] fp32, comb [..., n, n] fp32, layer_input [..., D] bf16, next_pre_mix [..., n] fp32).
    """
    flat = _tokens("residual", residual, 2)
    if x is not None:
        fn = _broadcast_fn(flat, fn, _tokens("x", x, 1))
    out = ops.mhc_pre(flat, fn, hc_scale, hc_base, pre_mix=_tokens("pre_mix", pre_mix, 1), delayed=True,
                      backend=backend, **_scalars(rms_eps, hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value,
                                                  sinkhorn_repeat, norm_weight, norm_eps))
    return (_lead(residual, out.post.unsqueeze(-1)), _lead(residual, out.comb), _lead(residual, out.layer_input),
            _lead(residual, out.pre))


def mhc_fused_post_pre_delayed(x, residual, post_layer_mix, comb_res_mix, fn, hc_scale, hc_base, rms_eps, hc_pre_eps,
                               hc_sinkhorn_eps, hc_post_mult_value, sinkhorn_repeat, pre_mix=None, norm_weight=None,
                               norm_eps=1e-6, capture_aux=False, *, backend="auto"):
    """vLLM's mhc_fused_post_pre_delayed (V4.1): mhc_post, then mhc_pre_delayed on the bf16 new residual.

    aux, when capture_aux: bf16(mean over the streams of residual_cur), computed by PyTorch from residual_cur after
    the kernels. Otherwise an empty [0, D] bf16 tensor.

    Args: those of mhc_post and mhc_pre_delayed (without x). capture_aux: bool.
    Returns:
        (residual_cur [..., n, D] bf16, post [..., n, 1], comb [..., n, n], layer_input [..., D] bf16,
        next_pre_mix [..., n], aux [..., D] or [0, D] bf16).
    """
    checks.flag("capture_aux", capture_aux)
    chain = ops.mhc_post_pre(
        _tokens("x", x, 1), _tokens("residual", residual, 2), _post_gates(post_layer_mix, residual),
        _tokens("comb_res_mix", comb_res_mix, 2), fn, hc_scale, hc_base, pre_mix=_tokens("pre_mix", pre_mix, 1),
        delayed=True, backend=backend,
        **_scalars(rms_eps, hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value, sinkhorn_repeat, norm_weight, norm_eps))
    new = chain.residual
    aux = (_lead(residual, new.float().mean(dim=1).to(torch.bfloat16)) if capture_aux
           else new.new_empty(0, new.shape[-1]))
    return (_lead(residual, new), _lead(residual, chain.post.unsqueeze(-1)), _lead(residual, chain.comb),
            _lead(residual, chain.layer_input), _lead(residual, chain.pre), aux)
