"""vLLM's own routing test recipes, restated against flashkern.compat.vllm on every backend.

Sources (vllm-project/vllm, tests/kernels/moe/): test_fused_topk.py (test_fused_topk,
test_fused_topk_bias and their NaN / Inf clamp tests), test_topk_softplus_sqrt.py (sqrtsoftplus,
the DeepSeek-V4 fast path, padding masks, hash routing) and test_grouped_topk.py (grouped routing,
stable ties). Inputs, shapes and tolerances are theirs; each parameter grid is sampled (a few
combinations, not the product) to keep the CPU run short. The references below restate vLLM's
torch references (torch_topk, _torch_topk_softplus_sqrt and the Python grouped_topk) with the tie
rule of vLLM's kernels: a stable descending sort, lower expert (and group) id first.
"""

import itertools
import random

import pytest
import torch
import torch.nn.functional as F

from _device import DEVICE
from flashkern.compat.vllm import fused_topk, fused_topk_bias, grouped_topk

BACKENDS = ("reference", "triton", "tilelang")
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
HIDDEN = 64  # hidden_states only give the token count; vLLM uses 1024 / 2048


def sampled(seed: int, count: int, **axes) -> list:
    """`count` combinations of the axes' values, as pytest params. Greedy over the product in a seeded random
    order: each next combination shows the most values not yet shown, then the most new pairs of values, so
    every value appears when count >= the longest axis and the axes do not move in lockstep."""
    combos = list(itertools.product(*axes.values()))
    random.Random(seed).shuffle(combos)
    chosen, seen_values, seen_pairs = [], set(), set()

    def news(combo):
        values = set(enumerate(combo))
        return len(values - seen_values), len(set(itertools.combinations(sorted(values), 2)) - seen_pairs)

    for _ in range(count):
        best = max(combos, key=news)
        combos.remove(best)
        chosen.append(best)
        seen_values |= set(enumerate(best))
        seen_pairs |= set(itertools.combinations(sorted(enumerate(best)), 2))
    return [pytest.param(*combo, id="-".join(str(v).replace("torch.", "") for v in combo)) for combo in chosen]


def vllm_scores(gating: torch.Tensor, scoring_func: str) -> torch.Tensor:
    x = gating.float()
    if scoring_func == "softmax":
        return torch.softmax(x, dim=-1)
    if scoring_func == "sigmoid":
        return torch.sigmoid(x)
    return F.softplus(x).sqrt()  # threshold 20, as vLLM's test oracle


def stable_topk(values: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest values per row, descending, ties to the lower index (vLLM's kernels)."""
    return values.sort(dim=-1, descending=True, stable=True).indices[:, :k]


def torch_topk(gating, topk, renormalize, scoring_func="softmax", bias=None, routed_scaling_factor=1.0):
    """vLLM's torch_topk (test_fused_topk.py) and _torch_topk_softplus_sqrt (test_topk_softplus_sqrt.py):
    select on score + bias, weigh by the unbiased score, divide by the sum, scale."""
    s = vllm_scores(gating, scoring_func)
    ids = stable_topk(s if bias is None else s + bias.float(), topk)
    weights = s.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights * routed_scaling_factor).float(), ids.int()


def torch_grouped_topk(gating, topk, renormalize, num_expert_group, topk_group, scoring_func, routed_scaling_factor,
                       bias):
    """vLLM's Python grouped_topk: a group scores its max (no bias) or the sum of its top-2 biased scores."""
    s = vllm_scores(gating, scoring_func)
    tokens, experts = s.shape
    keys = s if bias is None else s + bias.float()
    grouped = keys.view(tokens, num_expert_group, -1)
    group_scores = grouped.amax(dim=-1) if bias is None else grouped.topk(2, dim=-1).values.sum(dim=-1)
    group_mask = torch.zeros(tokens, num_expert_group).scatter_(1, stable_topk(group_scores, topk_group), 1.0)
    eligible = group_mask[:, :, None].expand(-1, -1, experts // num_expert_group).reshape(tokens, experts)
    ids = stable_topk(keys.masked_fill(eligible == 0, float("-inf")), topk)
    weights = s.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights * routed_scaling_factor).float(), ids.int()


def on_device(*tensors):
    return [None if t is None else t.to(DEVICE) for t in tensors]


def sorted_by_id(weights, ids):
    """(weights, ids) of each row reordered by ascending id (vLLM's softplus tests compare sorted ids)."""
    order = ids.long().argsort(dim=-1)
    return weights.gather(1, order), ids.long().gather(1, order)


# ---------------------------------------------------------------- test_fused_topk.py


TOPK_GRID = dict(m=(1, 33, 56), e=(6, 16), topk=(3, 4), renormalize=(True, False), scoring_func=("softmax", "sigmoid"),
                 dtype=DTYPES)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("m, e, topk, renormalize, scoring_func, dtype", sampled(1, 4, **TOPK_GRID))
def test_fused_topk(backend, m, e, topk, renormalize, scoring_func, dtype):
    torch.manual_seed(0)
    hidden, gating = on_device(torch.randn(m, HIDDEN, dtype=dtype), torch.randn(m, e, dtype=dtype))
    weights, ids, token_expert_indices = fused_topk(hidden, gating, topk, renormalize, scoring_func=scoring_func,
                                                    backend=backend)
    expected_w, expected_ids = torch_topk(gating.cpu(), topk, renormalize, scoring_func)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids.cpu(), expected_ids)
    torch.testing.assert_close(weights.cpu(), expected_w, atol=1e-2, rtol=1e-2)
    source_rows = torch.arange(topk)[None, :] * m + torch.arange(m)[:, None]  # vLLM's kernel: k * num_rows + r
    assert token_expert_indices.dtype == torch.int32 and torch.equal(token_expert_indices.cpu(), source_rows.int())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("m, e, topk, renormalize, scoring_func, dtype", sampled(2, 4, **TOPK_GRID))
def test_fused_topk_bias(backend, m, e, topk, renormalize, scoring_func, dtype):
    torch.manual_seed(0)
    hidden, gating, bias = on_device(torch.randn(m, HIDDEN, dtype=dtype), torch.randn(m, e, dtype=dtype),
                                     torch.randn(e))
    weights, ids = fused_topk_bias(hidden, gating, scoring_func, bias, topk, renormalize, backend=backend)
    expected_w, expected_ids = torch_topk(gating.cpu(), topk, renormalize, scoring_func, bias.cpu())
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids.cpu(), expected_ids)
    torch.testing.assert_close(weights.cpu(), expected_w, atol=1e-2, rtol=1e-2)


CLAMP_GRID = dict(e=(6, 8, 16), topk=(3, 4), scoring_func=("softmax", "sigmoid"), bad=("nan", "inf"), dtype=DTYPES)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("with_bias", (False, True), ids=("fused_topk", "fused_topk_bias"))
@pytest.mark.parametrize("e, topk, scoring_func, bad, dtype", sampled(3, 3, **CLAMP_GRID))
def test_fused_topk_nan_inf_clamp(backend, with_bias, e, topk, scoring_func, bad, dtype):
    """Rows 1-3 entirely NaN or +inf: k distinct in-range ids and finite weights; row 0 as usual."""
    torch.manual_seed(0)
    gating = torch.randn(4, e, dtype=dtype)
    gating[1:] = float(bad)
    bias = torch.randn(e) if with_bias else None
    hidden, gating, bias = on_device(torch.randn(4, HIDDEN, dtype=dtype), gating, bias)
    if with_bias:
        weights, ids = fused_topk_bias(hidden, gating, scoring_func, bias, topk, False, backend=backend)
    else:
        weights, ids, _ = fused_topk(hidden, gating, topk, False, scoring_func=scoring_func, backend=backend)
    weights, ids = weights.cpu(), ids.cpu()
    expected_w, expected_ids = torch_topk(gating[:1].cpu(), topk, False, scoring_func, None if bias is None else bias.cpu())
    assert torch.equal(ids[:1], expected_ids)
    torch.testing.assert_close(weights[:1], expected_w, atol=1e-2, rtol=1e-2)
    for row in range(1, 4):
        assert ids[row].unique().numel() == topk and ((ids[row] >= 0) & (ids[row] < e)).all()
    assert torch.isfinite(weights).all()


# ---------------------------------------------------------------- test_topk_softplus_sqrt.py


SOFTPLUS_GRID = dict(m=(1, 33, 128), e=(128, 256, 384), topk=(6, 8), renormalize=(True, False),
                     routed_scaling_factor=(1.0, 1.5), dtype=DTYPES)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("m, e, topk, renormalize, routed_scaling_factor, dtype", sampled(4, 3, **SOFTPLUS_GRID))
def test_fused_topk_softplus_sqrt(backend, m, e, topk, renormalize, routed_scaling_factor, dtype):
    torch.manual_seed(0)
    hidden, gating, bias = on_device(torch.randn(m, HIDDEN, dtype=dtype), torch.randn(m, e, dtype=dtype),
                                     torch.randn(e))
    weights, ids = fused_topk_bias(hidden, gating, "sqrtsoftplus", bias, topk, renormalize,
                                   routed_scaling_factor=routed_scaling_factor, backend=backend)
    expected = torch_topk(gating.cpu(), topk, renormalize, "sqrtsoftplus", bias.cpu(), routed_scaling_factor)
    (weights, ids), (expected_w, expected_ids) = sorted_by_id(weights.cpu(), ids.cpu()), sorted_by_id(*expected)
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(weights, expected_w, atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("m, e, indices_type", [(0, 256, torch.uint32), (17, 256, torch.uint32), (17, 384, torch.int64)])
def test_dsv4_fast_topk(backend, m, e, indices_type):
    """vLLM's DeepSeek-V4 fast path form: fp32 gating, k 6, renormalize, scale 1.5; ids exact in place."""
    torch.manual_seed(0)
    hidden, gating, bias = on_device(torch.randn(m, HIDDEN), torch.randn(m, e), torch.randn(e))
    weights, ids = fused_topk_bias(hidden, gating, "sqrtsoftplus", bias, 6, True, indices_type=indices_type,
                                   routed_scaling_factor=1.5, backend=backend)
    expected_w, expected_ids = torch_topk(gating.cpu(), 6, True, "sqrtsoftplus", bias.cpu(), 1.5)
    assert ids.dtype == indices_type and ids.shape == (m, 6)
    assert torch.equal(ids.cpu().to(torch.int64), expected_ids.long())
    torch.testing.assert_close(weights.cpu(), expected_w, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dsv4_fast_topk_padding(backend):
    """Padding rows (every other row) hold NaN logits and are masked: ids -1 and weights 0 exactly."""
    torch.manual_seed(0)
    gating, bias = torch.randn(17, 256), torch.randn(256)
    is_padding = torch.zeros(17, dtype=torch.bool)
    is_padding[1::2] = True
    gating[is_padding] = float("nan")
    hidden, gating_d, bias_d, is_padding_d = on_device(torch.randn(17, HIDDEN), gating, bias, is_padding)
    weights, ids = fused_topk_bias(hidden, gating_d, "sqrtsoftplus", bias_d, 6, True, routed_scaling_factor=1.5,
                                   is_padding=is_padding_d, backend=backend)
    weights, ids = weights.cpu(), ids.cpu()
    assert (ids[is_padding] == -1).all() and (weights[is_padding] == 0).all()
    expected_w, expected_ids = torch_topk(gating[~is_padding], 6, True, "sqrtsoftplus", bias, 1.5)
    assert torch.equal(ids[~is_padding], expected_ids)
    torch.testing.assert_close(weights[~is_padding], expected_w, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("use_bias, use_padding_mask, pad_with_nan, e, dtype", [
    (True, True, True, 256, torch.bfloat16),
    (True, False, True, 128, torch.float32),
    (False, True, False, 384, torch.float16),
    (False, False, True, 256, torch.float32),
])
def test_fused_topk_softplus_sqrt_padding(backend, use_bias, use_padding_mask, pad_with_nan, e, dtype):
    """M = 8, k = 6, pad rows 1, 3, 5, 7. The bias in [-2, -1) makes pad rows look selectable unless the mask is
    used. Masked pad rows: ids -1, weights 0. Unmasked NaN rows: every score 0 (vLLM's clamp), so the ids are
    the top 6 of the bias (or 0..5) and the weights 0, finite."""
    torch.manual_seed(0)
    gating = torch.randn(8, e, dtype=dtype)
    is_padding = torch.zeros(8, dtype=torch.bool)
    is_padding[1::2] = True
    if pad_with_nan:
        gating[is_padding] = float("nan")
    bias = -(torch.rand(e) + 1) if use_bias else None
    mask = is_padding if use_padding_mask else None
    hidden, gating_d, bias_d, mask_d = on_device(torch.randn(8, HIDDEN, dtype=dtype), gating, bias, mask)
    weights, ids = fused_topk_bias(hidden, gating_d, "sqrtsoftplus", bias_d, 6, True, is_padding=mask_d,
                                   backend=backend)
    weights, ids = weights.cpu(), ids.cpu()
    if use_padding_mask:
        assert (ids[is_padding] == -1).all() and (weights[is_padding] == 0).all()
    if pad_with_nan:
        assert torch.isfinite(weights[is_padding]).all() and (weights[is_padding] == 0).all()
    if pad_with_nan and not use_padding_mask:
        expected_pad_ids = torch.arange(6) if bias is None else stable_topk(bias[None], 6)[0]
        assert (ids[is_padding] == expected_pad_ids.int()).all()
    rows = ~is_padding if use_padding_mask or pad_with_nan else torch.ones(8, dtype=torch.bool)
    expected = torch_topk(gating[rows], 6, True, "sqrtsoftplus", bias)
    (got_w, got_ids), (expected_w, expected_ids) = sorted_by_id(weights[rows], ids[rows]), sorted_by_id(*expected)
    assert torch.equal(got_ids, expected_ids)
    torch.testing.assert_close(got_w, expected_w, atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("argument", ("input_tokens", "hash_indices_table"))
def test_hash_routing_is_refused_by_name(argument):
    gating = torch.randn(4, 256)
    hash_args = {argument: torch.zeros(4 if argument == "input_tokens" else (1024, 6), dtype=torch.int64)}
    with pytest.raises(NotImplementedError, match=argument):
        fused_topk_bias(torch.randn(4, HIDDEN), gating, "sqrtsoftplus", None, 6, True, **hash_args)


# ---------------------------------------------------------------- test_grouped_topk.py


GROUPED_GRID = dict(shape=((16, 2, 8, 2), (256, 8, 8, 4)), m=(1, 33, 64), renormalize=(True, False),
                    scoring_func=("softmax", "sigmoid"), routed_scaling_factor=(1.0, 2.5),
                    dtype=(torch.bfloat16, torch.float32), with_bias=(True, False))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape, m, renormalize, scoring_func, routed_scaling_factor, dtype, with_bias",
                         sampled(5, 4, **GROUPED_GRID))
def test_grouped_topk(backend, shape, m, renormalize, scoring_func, routed_scaling_factor, dtype, with_bias):
    e, topk, num_expert_group, topk_group = shape
    torch.manual_seed(0)
    hidden, gating, bias = on_device(torch.randn(m, HIDDEN, dtype=dtype), torch.randn(m, e, dtype=dtype),
                                     torch.randn(e) if with_bias else None)
    weights, ids = grouped_topk(hidden, gating, topk, renormalize, num_expert_group, topk_group, scoring_func,
                                routed_scaling_factor, bias, backend=backend)
    expected_w, expected_ids = torch_grouped_topk(gating.cpu(), topk, renormalize, num_expert_group, topk_group,
                                                  scoring_func, routed_scaling_factor, None if bias is None else bias.cpu())
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert torch.equal(ids.cpu(), expected_ids)
    torch.testing.assert_close(weights.cpu(), expected_w, atol=2e-2, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", ((16, 2, 8, 2), (256, 8, 8, 4)), ids=str)
def test_grouped_topk_stable_ties(backend, shape):
    """Zero logits and a zero bias: every group and expert ties, so the lowest ids win: ids 0..k-1, w 2.5 / k."""
    e, topk, num_expert_group, topk_group = shape
    hidden, gating, bias = on_device(torch.randn(3, HIDDEN), torch.zeros(3, e, dtype=torch.bfloat16), torch.zeros(e))
    weights, ids = grouped_topk(hidden, gating, topk, True, num_expert_group, topk_group, "sigmoid", 2.5, bias,
                                backend=backend)
    assert torch.equal(ids.cpu(), torch.arange(topk, dtype=torch.int32).expand(3, topk))
    torch.testing.assert_close(weights.cpu(), torch.full((3, topk), 2.5 / topk), atol=2e-5, rtol=0)


# ---------------------------------------------------------------- bad input


def _gating():
    return torch.randn(5, 16)


BAD_CALLS = [
    (lambda: fused_topk(torch.randn(5, 8), _gating(), 3, True, scoring_func="sqrtsoftplus"), ValueError,
     "scoring_func must be one of"),
    (lambda: fused_topk(torch.randn(4, 8), _gating(), 3, True), ValueError, "hidden_states has shape"),
    (lambda: fused_topk(torch.randn(5, 8), _gating().double(), 3, True), TypeError, "gating_output must be"),
    (lambda: fused_topk(torch.randn(5, 8), _gating(), 17, True), ValueError, "topk=17"),
    (lambda: fused_topk(torch.randn(5, 8), _gating(), 3, True, indices_type=torch.float32), ValueError,
     "indices_type must be one of"),
    (lambda: fused_topk_bias(torch.randn(5, 8), _gating(), "sigmoid", torch.zeros(15), 3, True), ValueError,
     r"e_score_correction_bias must have shape \[16\]"),
    (lambda: fused_topk_bias(torch.randn(5, 8), _gating(), "sigmoid", None, 3, True, routed_scaling_factor=float("nan")),
     ValueError, "routed_scaling_factor must be a finite number"),
    (lambda: fused_topk_bias(torch.randn(5, 8), _gating(), "sigmoid", None, 3, True, is_padding=torch.zeros(5)),
     TypeError, "is_padding must be bool"),
    (lambda: fused_topk_bias(torch.randn(5, 8), _gating(), "sigmoid", None, 3, True, indices_type=torch.uint32,
                             is_padding=torch.zeros(5, dtype=torch.bool)), ValueError, "uint32 cannot hold the -1"),
    (lambda: grouped_topk(torch.randn(5, 8), _gating(), 2, True, num_expert_group=-1), ValueError,
     "num_expert_group=-1"),
    (lambda: grouped_topk(torch.randn(5, 8), _gating(), 2, True, num_expert_group=4, topk_group=5), ValueError,
     "topk_group=5"),
]


@pytest.mark.parametrize("call, error, message", BAD_CALLS, ids=[m for _, _, m in BAD_CALLS])
def test_bad_arguments_are_named(call, error, message):
    with pytest.raises(error, match=message):
        call()
