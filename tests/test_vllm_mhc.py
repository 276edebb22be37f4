"""vLLM's mHC kernel tests (tests/kernels/test_mhc_kernels.py), restated for flashkern.compat.vllm on every backend.

The references below are written from vLLM's documented torch references:
- mhc_pre_ref and mhc_post_ref: the TileLang examples vLLM's tests compare with.
- mhc_pre_delayed_torch: vllm/model_executor/kernels/mhc/torch.py.
- rms_norm_ref: `_C.rms_norm`, csrc/layernorm_kernels.cu.
Inputs and tolerances are vLLM's. The shapes are scaled down for CPU:
- V4: (T, D) in {(1, 4096), (4, 7168), (8, 4096)}, where vLLM runs T in {1, 4, 8, 128} x D in {4096, 7168};
- the V4.1 delayed pre at D = 5120 with (T, sinkhorn_repeat, norm_eps) in {(0, 20, 1e-6), (1, 1, 1e-6),
  (9, 20, 1e-20)}, where vLLM runs T = 1 with 20 iterations too, and 33 (norm_eps 1e-20), 128 and 1024.

The delayed pre's post, comb and next_pre_mix are held to vLLM's FP32 tolerance, 1e-5 / 1e-4, which vLLM applies
to its FP32 TileLang GEMM. The CPU kernels compute fp32 GEMMs. On a GPU, Triton's two-tf32 GEMM is about fp32.
TileLang's T.gemm with fp32 operands lowers to tf32 on a GPU (README), so there TileLang gets vLLM's TF32
tolerance, 1e-3 / 1e-3, the one vLLM gives its own tf32 (DeepGEMM) projection.
"""

import pytest
import torch

from _device import DEVICE
from flashkern.compat import vllm

BACKENDS = ("reference", "triton", "tilelang")
N = 4  # hc_mult in every DeepSeek-V4 test
MIXES = (2 + N) * N
V4_SCALARS = (1e-6, 1e-6, 1e-6, 1.0, 20)  # rms_eps, hc_pre_eps, hc_sinkhorn_eps, hc_post_mult_value, repeat
V4_SHAPES = [(1, 4096), (4, 7168), (8, 4096)]  # T x D of vLLM: {1, 4, 8, 128} x {4096, 7168}


# ---------------------------------------------------------------- references (vLLM's, restated)


def sinkhorn_ref(logits, repeat, eps):
    m = logits.softmax(-1) + eps
    m = m / (m.sum(-2, keepdim=True) + eps)
    for _ in range(repeat - 1):
        m = m / (m.sum(-1, keepdim=True) + eps)
        m = m / (m.sum(-2, keepdim=True) + eps)
    return m


def _coefficients(x, fn, hc_scale, hc_base, rms_eps, pre_eps, sinkhorn_eps, post_mult, repeat):
    """(pre [T, n], post [T, n], comb [T, n, n]) from x [T, K] fp32 and fn [(2+n)n, K], the RMS over K."""
    mixes = (x @ fn.T) * torch.rsqrt(x.square().mean(-1, keepdim=True) + rms_eps)
    scale = torch.cat([hc_scale[0].expand(N), hc_scale[1].expand(N), hc_scale[2].expand(N * N)])
    mixes = mixes * scale + hc_base
    pre = mixes[:, :N].sigmoid() + pre_eps
    post = mixes[:, N:2 * N].sigmoid() * post_mult
    return pre, post, sinkhorn_ref(mixes[:, 2 * N:].view(-1, N, N), repeat, sinkhorn_eps)


def mhc_pre_ref(residual, fn, hc_scale, hc_base, *scalars):
    """(post [T, n, 1], comb [T, n, n], layer_input [T, D] bf16): collapse with the pre computed now."""
    pre, post, comb = _coefficients(residual.flatten(1).float(), fn, hc_scale, hc_base, *scalars)
    return post.unsqueeze(-1), comb, (residual.float() * pre.unsqueeze(-1)).sum(-2).bfloat16()


def mhc_post_ref(x, residual, post_layer_mix, comb_res_mix):
    """bf16(post * x + comb^T @ residual) [T, n, D]."""
    return (x.float().unsqueeze(-2) * post_layer_mix + torch.bmm(comb_res_mix.mT, residual.float())).bfloat16()


def mhc_pre_delayed_torch(residual, fn, hc_scale, hc_base, *scalars, pre_mix=None, x=None):
    """(post [T, n, 1], comb, layer_input, next_pre_mix [T, n]): coefficients from the residual, or from x
    (broadcast entry, fn [(2+n)n, D]); the layer input is residual stream 0 itself without a carried pre_mix."""
    source = residual.flatten(1) if x is None else x
    pre, post, comb = _coefficients(source.float(), fn, hc_scale, hc_base, *scalars)
    if pre_mix is None:
        layer_input = residual[:, 0]
    else:
        layer_input = (pre_mix.unsqueeze(-1) * residual.float()).sum(1).to(residual.dtype)
    return post.unsqueeze(-1), comb, layer_input, pre


def rms_norm_ref(x, weight, eps):
    """vLLM's `_C.rms_norm` on bf16: bf16(bf16(x * rsqrt(mean(x^2) + eps)) * w), the variance in fp32."""
    h = x.float()
    normalized = (h * torch.rsqrt(h.square().mean(-1, keepdim=True) + eps)).bfloat16()
    return (normalized.float() * weight.float()).bfloat16()


# ---------------------------------------------------------------- inputs


def _randn(gen, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)


def _v4_projection(gen, hidden):
    """vLLM's V4 recipe: fn ~ 1e-4 N(0, 1) (1 + 0.01 stream), scale and base ~ 0.1 N(0, 1)."""
    ramp = (1 + 0.01 * torch.arange(N)).view(1, -1, 1)
    fn = (torch.randn(MIXES, N, hidden, generator=gen) * 1e-4 * ramp).flatten(1).to(DEVICE)
    return fn, _randn(gen, 3) * 0.1, _randn(gen, MIXES) * 0.1


def _post_inputs(gen, tokens, hidden):
    """x, residual (bf16), post_layer_mix [T, n, 1] and comb_res_mix, all ~ N(0, 1)."""
    return (_randn(gen, tokens, hidden, dtype=torch.bfloat16), _randn(gen, tokens, N, hidden, dtype=torch.bfloat16),
            _randn(gen, tokens, N, 1), _randn(gen, tokens, N, N))


def _close(actual, expected, atol, rtol):
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e, atol=atol, rtol=rtol)


# ---------------------------------------------------------------- V4: mhc_pre, mhc_post, mhc_fused_post_pre


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("tokens, hidden", V4_SHAPES)
def test_mhc_pre(tokens, hidden, backend):
    gen = torch.Generator().manual_seed(0)
    residual = _randn(gen, tokens, N, hidden, dtype=torch.bfloat16)
    args = (residual, *_v4_projection(gen, hidden), *V4_SCALARS)
    _close(vllm.mhc_pre(*args, backend=backend), mhc_pre_ref(*args), atol=5e-2, rtol=1e-2)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("tokens, hidden", V4_SHAPES)
def test_mhc_post(tokens, hidden, backend):
    args = _post_inputs(torch.Generator().manual_seed(0), tokens, hidden)
    torch.testing.assert_close(vllm.mhc_post(*args, backend=backend), mhc_post_ref(*args), atol=5e-2, rtol=1e-2)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("tokens, hidden", V4_SHAPES)
def test_mhc_fused_post_pre(tokens, hidden, backend):
    gen = torch.Generator().manual_seed(0)
    post_args = _post_inputs(gen, tokens, hidden)
    pre_args = (*_v4_projection(gen, hidden), *V4_SCALARS)
    residual_cur = mhc_post_ref(*post_args)
    expected = (residual_cur, *mhc_pre_ref(residual_cur, *pre_args))
    _close(vllm.mhc_fused_post_pre(*post_args, *pre_args, backend=backend), expected, atol=1e-2, rtol=1e-2)


# ---------------------------------------------------------------- V4.1: the delayed pre


def _coefficient_tolerance(backend: str) -> dict:
    """vLLM's FP32 tolerance; its TF32 one for TileLang's tf32 GEMM on a GPU (module docstring)."""
    tf32 = backend == "tilelang" and DEVICE.type == "cuda"
    return dict(atol=1e-3, rtol=1e-3) if tf32 else dict(atol=1e-5, rtol=1e-4)


def _v41_inputs(gen, tokens, entry):
    """vLLM's V4.1 recipe at D = 5120: (residual, fn, scale, base), pre_mix, x for the entry."""
    hidden = 5120
    residual = _randn(gen, tokens, N, hidden, dtype=torch.bfloat16)
    if tokens > 1:
        residual[0] = 0
    fn = _randn(gen, MIXES, N, hidden) * 0.02
    x = pre_mix = None
    if entry == "broadcast":
        x = residual[:, 0].contiguous()
        residual = x.unsqueeze(1).expand(-1, N, -1).contiguous()
        fn = fn.sum(1)
    else:
        fn = fn.flatten(1)
    if entry == "carried":
        pre_mix = torch.rand(tokens, N, generator=gen).to(DEVICE)
        if tokens > 1:  # a constant collapse just above 1 rounds to bf16 1 before the RMSNorm
            residual[1] = 1
            pre_mix[1] = torch.tensor([1.003, 0.0, 0.0, 0.0])
    scale = torch.tensor([0.5, 0.25, 1.0], device=DEVICE)
    return (residual, fn, scale, _randn(gen, MIXES)), pre_mix, x


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fused_norm", [False, True])
@pytest.mark.parametrize("entry", ["broadcast", "identity", "carried"])
@pytest.mark.parametrize("tokens, repeat, norm_eps", [(0, 20, 1e-6), (1, 1, 1e-6), (9, 20, 1e-20)])
def test_deepseek_v41_mhc_pre_delayed(tokens, repeat, norm_eps, entry, fused_norm, backend):
    """The layer input collapsed with the carried pre-mix, or stream 0 itself (bit for bit) without one; the new
    pre-mix returned. With the norm fused: the unfused collapse followed by _C.rms_norm, and the row whose
    collapse (1.003) rounds to bf16 1 before the norm exactly."""
    gen = torch.Generator().manual_seed(0)
    tensors, pre_mix, x = _v41_inputs(gen, tokens, entry)
    args = (*tensors, 1e-20, 1e-6, 1e-6, 2.0, repeat)
    expected = mhc_pre_delayed_torch(*args, pre_mix=pre_mix, x=x)
    norm = {}
    if fused_norm:
        weight = (0.5 + torch.rand(5120, generator=gen)).to(torch.bfloat16).to(DEVICE)
        norm = dict(norm_weight=weight, norm_eps=norm_eps)
        expected = (*expected[:2], rms_norm_ref(expected[2], weight, norm_eps), expected[3])
    actual = vllm.mhc_pre_delayed(*args, pre_mix=pre_mix, x=x, **norm, backend=backend)
    for i in (0, 1, 3):
        torch.testing.assert_close(actual[i], expected[i], **_coefficient_tolerance(backend))
    if pre_mix is None and not fused_norm:
        torch.testing.assert_close(actual[2], expected[2], atol=0, rtol=0)
    else:
        torch.testing.assert_close(actual[2], expected[2], atol=1.6e-2, rtol=1e-2)
    if fused_norm and entry == "carried" and tokens > 1:
        torch.testing.assert_close(actual[2][1], expected[2][1], atol=0, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("carried, capture_aux", [(False, True), (True, False)])
def test_mhc_fused_post_pre_delayed(carried, capture_aux, backend):
    """mhc_post, then the delayed pre on the bf16 new residual, aux = bf16(mean over streams of residual_cur).
    vLLM has no test of it. The tolerances are the ones a vLLM plugin's test attributes to upstream: coefficients
    5e-3, residual, layer input and aux 1.6e-2 / 1e-2. Without a carried pre-mix the layer input is the new
    residual's stream 0 exactly."""
    gen = torch.Generator().manual_seed(1)
    post_args = _post_inputs(gen, 4, 5120)
    pre_args = (_randn(gen, MIXES, N * 5120) * 0.02, torch.tensor([0.5, 0.25, 1.0], device=DEVICE),
                _randn(gen, MIXES), 1e-20, 1e-6, 1e-6, 2.0, 20)
    pre_mix = torch.rand(4, N, generator=gen).to(DEVICE) if carried else None
    residual_cur = mhc_post_ref(*post_args)
    post, comb, layer_input, next_pre_mix = mhc_pre_delayed_torch(residual_cur, *pre_args, pre_mix=pre_mix)
    aux = residual_cur.float().mean(1).bfloat16() if capture_aux else residual_cur.new_empty(0, 5120)
    actual = vllm.mhc_fused_post_pre_delayed(*post_args, *pre_args, pre_mix=pre_mix, capture_aux=capture_aux,
                                             backend=backend)
    _close([actual[i] for i in (0, 3, 5)], (residual_cur, layer_input, aux), atol=1.6e-2, rtol=1e-2)
    _close([actual[i] for i in (1, 2, 4)], (post, comb, next_pre_mix), atol=5e-3, rtol=5e-3)
    if not carried:
        torch.testing.assert_close(actual[3], actual[0][:, 0], atol=0, rtol=0)


# ---------------------------------------------------------------- conventions of the compat layer


def test_leading_token_dims_and_ignored_tuning_arguments():
    """[..., n, D] inputs give the flattened call's outputs with the leading dims back; post_layer_mix as [..., n]
    or [..., n, 1]; n_splits and tile_n change nothing."""
    gen = torch.Generator().manual_seed(2)
    x, residual, post, comb = _post_inputs(gen, 6, 64)
    projection = (*_v4_projection(gen, 64), *V4_SCALARS)
    lead = lambda t: t.view(2, 3, *t.shape[1:])  # noqa: E731
    flat = vllm.mhc_fused_post_pre(x, residual, post, comb, *projection, backend="reference")
    shaped = vllm.mhc_fused_post_pre(lead(x), lead(residual), lead(post).squeeze(-1), lead(comb), *projection,
                                     n_splits=4, tile_n=2, backend="reference")
    for a, b in zip(shaped, flat, strict=True):
        assert torch.equal(a, lead(b))
    pre = vllm.mhc_pre(lead(residual), *projection, 4, backend="reference")
    for a, b in zip(pre, vllm.mhc_pre(residual, *projection, backend="reference"), strict=True):
        assert torch.equal(a, lead(b))
    assert torch.equal(vllm.mhc_post(lead(x), lead(residual), lead(post), lead(comb), backend="reference"),
                       lead(vllm.mhc_post(x, residual, post, comb, backend="reference")))


def test_bad_arguments_are_named():
    gen = torch.Generator().manual_seed(3)
    residual = _randn(gen, 2, 3, 64, dtype=torch.bfloat16)
    broadcast_fn, scale, base = _randn(gen, 15, 64), torch.ones(3, device=DEVICE), torch.zeros(15, device=DEVICE)
    scalars = (1e-20, 1e-6, 1e-6, 2.0, 20)
    with pytest.raises(NotImplementedError, match=r"x= .*n a power of two, got n=3"):
        vllm.mhc_pre_delayed(residual, broadcast_fn, scale, base, *scalars, x=residual[:, 0].contiguous())
    strided = _randn(gen, 2, 2, 4, 64, dtype=torch.bfloat16).transpose(0, 1)
    with pytest.raises(ValueError, match=r"residual must be contiguous .*residual\.contiguous\(\)"):
        vllm.mhc_pre(strided, *_v4_projection(gen, 64), *V4_SCALARS)
    post_args = _post_inputs(gen, 2, 64)
    with pytest.raises(TypeError, match="capture_aux must be a bool"):
        vllm.mhc_fused_post_pre_delayed(*post_args, *_v4_projection(gen, 64), *scalars, capture_aux=1)
