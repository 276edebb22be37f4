"""Fused MoE routing: every implementation (default config and sampled configs) against the reference.

Hypothesis draws the routing rule (experts, groups, group score, top_k, score), the token count
(odd sizes, tails that are not multiples of a tile) and how values look (normal, exact ties on a
grid or from bf16 rounding, extreme and infinite logits, NaN in valid rows, rows partly or wholly
NaN / +inf / -inf, a dominating bias), with the strategies of flashkern.kernels.moe_route.cases
(shared with `flashkern check`); tensors come from a drawn seed so failures shrink to small
shapes. The property oracle (kernels/moe_route.check_routing_result) accepts near ties (scores
differ by rounding between backends), enforces the lower-id rule on exact ties and checks finite
weights against the reference formula. Fixed cases check that every backend returns bitwise the
same ids on tie-heavy and non-finite inputs, and the vLLM rules for NaN / Inf rows and group scores.
"""

import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st

import flashkern.ops
from _budget import fraction_of_examples
from _device import DEVICE, on_device
from flashkern import registry
from flashkern.kernels._tilelang import CPU as TILELANG_CPU
from flashkern.kernels.cases import narrowed
from flashkern.kernels.moe_route import V3, V41_FLASH, RouteProblem, Routing, check_routing_result
from flashkern.kernels.moe_route.cases import NONFINITE, gate_cases, route_cases
from flashkern.kernels.moe_route.triton_kernels import GEMM_TILE_T
from flashkern.kernels.tiles import split_plan
from flashkern.reference import moe_route as ref

MOE_ROUTE = registry.get("moe_route")
MOE_ROUTE_GATE = registry.get("moe_route_gate")
KERNELS = ("triton", "tilelang")


def run_and_check(op, inputs, backend, config=None):
    actual = op.entry(**inputs, backend=backend, config=config)
    op.compare(inputs, None, actual)
    return actual


@pytest.mark.parametrize("backend", ("reference", *KERNELS))
@given(inputs=route_cases().map(on_device))
def test_moe_route_matches_reference(backend, inputs):
    run_and_check(MOE_ROUTE, inputs, backend)


@pytest.mark.parametrize("backend", ("reference", *KERNELS))
@given(inputs=gate_cases().map(on_device))
def test_moe_route_gate_matches_reference(backend, inputs):
    run_and_check(MOE_ROUTE_GATE, inputs, backend)


@pytest.mark.parametrize("op", (MOE_ROUTE, MOE_ROUTE_GATE), ids=lambda op: op.name)
@pytest.mark.parametrize("backend", KERNELS)
@fraction_of_examples(1 / 4)
@given(data=st.data())
def test_sampled_configs_match_reference(op, backend, data):
    """Any config of the tuning space (not only the default) gives correct routing."""
    inputs = on_device(data.draw(route_cases(max_tokens=200) if op is MOE_ROUTE else gate_cases()))
    impl = op.implementation(backend)
    config = data.draw(st.sampled_from(impl.space.configs(op.check(inputs), target=DEVICE.type)))
    note(f"config={config}")
    run_and_check(op, inputs, backend, config)


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("routing", (V41_FLASH, V3), ids=("v41", "v3"))
def test_model_presets_match_reference(backend, routing):
    """The model's own shapes, at a token count that spans several blocks and a padded tail."""
    problem = RouteProblem(tokens=1000, routing=routing, has_valid=True)
    inputs = MOE_ROUTE.make_inputs(problem, DEVICE, seed=3)
    run_and_check(MOE_ROUTE, inputs, backend)
    gate = RouteProblem(tokens=50, routing=routing, has_valid=True, hidden=5120, has_norm=True)
    run_and_check(MOE_ROUTE_GATE, MOE_ROUTE_GATE.make_inputs(gate, DEVICE, seed=3), backend)


@pytest.mark.parametrize("backend", ("reference", *KERNELS))
def test_every_expert_tied(backend):
    """All keys equal: ties go to the lowest groups, then the lowest ids, in ascending order."""
    inputs = on_device(dict(logits=torch.zeros(33, 64), bias=None, valid=None, **Routing(64, 8, "sigmoid", 4, 2).kwargs()))
    weights, ids = run_and_check(MOE_ROUTE, inputs, backend)
    assert (ids.cpu() == torch.arange(8, dtype=torch.int32)).all()
    torch.testing.assert_close(weights, torch.full_like(weights, 1 / 8))


def tie_and_nonfinite_rows(gen: torch.Generator, experts: int, repeats: int = 4) -> torch.Tensor:
    """Logits whose keys tie exactly or are not finite, `repeats` rows of each kind: bf16-rounded normals,
    a coarse grid, all-equal rows, a grid with some NaN, some +inf and some -inf, rows that are all NaN,
    all +inf, all -inf or a mix of the three, and a grid far below 0 (sigmoid scores near 1e-26: a tiny
    but positive sum to renormalize by)."""
    nan, inf = float("nan"), float("inf")

    def grid():
        return torch.randint(-3, 4, (repeats, experts), generator=gen).float() / 2

    def some(value):
        rows = grid()
        rows[torch.rand(repeats, experts, generator=gen) < 0.3] = value
        return rows

    kinds = [
        (2 * torch.randn(repeats, experts, generator=gen)).bfloat16().float(),
        grid(),
        torch.full((repeats, experts), 0.75),
        some(nan), some(inf), some(-inf),
        torch.full((repeats, experts), nan), torch.full((repeats, experts), inf), torch.full((repeats, experts), -inf),
        NONFINITE[torch.randint(0, 3, (repeats, experts), generator=gen)],
        grid() - 60,
    ]
    return torch.cat(kinds)


BITWISE_CASES = [  # (routing, with a bias, with a row mask)
    (Routing(7, 5, "sqrtsoftplus"), False, False),
    (V41_FLASH, True, False),
    (V3, True, True),
    (Routing(64, 8, "softmax", n_group=8, topk_group=3), False, False),  # "auto" without a bias: "max"
    (Routing(64, 4, "sigmoid", n_group=4, topk_group=2, group_score="max", renormalize=False, scaling_factor=2.5),
     True, False),
    (Routing(16, 4, "softmax", n_group=4, topk_group=2, group_score="top2"), False, True),
]


@pytest.mark.parametrize("routing, has_bias, has_valid", BITWISE_CASES,
                         ids=[f"{r.experts}x{r.top_k}-{r.score}-g{r.n_group}-{r.group_score}" + "-bias" * b + "-valid" * v
                              for r, b, v in BITWISE_CASES])
def test_backends_return_identical_ids(routing, has_bias, has_valid):
    """Exact ties (bf16 values, coarse grids, all-equal rows) and NaN / +-inf logits: every backend returns
    bitwise the reference's ids (one tie rule, lower id first) and finite weights close to its weights."""
    gen = torch.Generator().manual_seed(routing.experts)
    logits = tie_and_nonfinite_rows(gen, routing.experts)
    bias = torch.randint(-1, 2, (routing.experts,), generator=gen).float() / 4 if has_bias else None
    valid = torch.rand(logits.shape[0], generator=gen) < 0.8 if has_valid else None
    inputs = on_device(dict(logits=logits, bias=bias, valid=valid, **routing.kwargs()))
    expected_w, expected_ids = MOE_ROUTE.entry(**inputs, backend="reference")
    assert torch.isfinite(expected_w).all()
    for backend in KERNELS:
        weights, ids = run_and_check(MOE_ROUTE, inputs, backend)
        differ = torch.nonzero((ids != expected_ids).any(dim=1)).flatten().tolist()
        assert not differ, f"{backend}: ids differ from the reference's in rows {differ}"
        assert torch.isfinite(weights).all()
        torch.testing.assert_close(weights, expected_w, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("score", ("sqrtsoftplus", "sigmoid"))
@pytest.mark.parametrize("backend", ("reference", *KERNELS))
def test_some_nan_logits_weigh_zero(backend, score):
    """Issue 10's thorough-profile failure: E = 7, top_k = 5, four NaN logits in a row gave NaN weights in
    the reference and ~1e20 next to NaN in TileLang. Now (vLLM's clamp): NaN scores count 0, so the three
    finite experts come first (descending score), then the lowest NaN experts; weights renormalize over the
    finite three, and the NaN experts weigh 0."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 7, generator=gen)
    for row in range(6):
        logits[row, torch.randperm(7, generator=gen)[:4]] = float("nan")
    weights, ids = flashkern.ops.moe_route(logits.to(DEVICE), top_k=5, score=score, backend=backend)
    weights, ids = weights.cpu(), ids.cpu()
    s = torch.sigmoid(logits) if score == "sigmoid" else torch.nn.functional.softplus(logits).sqrt()
    for row in range(6):
        finite = torch.nonzero(~logits[row].isnan()).flatten()
        finite = finite[s[row, finite].argsort(descending=True, stable=True)]
        nan_ids = torch.nonzero(logits[row].isnan()).flatten()[:2]
        assert ids[row].tolist() == finite.tolist() + nan_ids.tolist()
        expected = torch.cat([s[row, finite] / s[row, finite].sum(), torch.zeros(2)])
        torch.testing.assert_close(weights[row], expected, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("score", ref.SCORES)
@pytest.mark.parametrize("backend", ("reference", *KERNELS))
def test_nonfinite_rows_route_by_the_bias(backend, score):
    """Rows entirely NaN, +inf or -inf, or mixing NaN and -inf (vLLM's clamp tests): every score is 0, or 1
    for sigmoid of +inf, so the ids are the top_k of the bias (ties to the lower id) and the weights 0, or
    1/k renormalized."""
    gen = torch.Generator().manual_seed(11)
    bias = torch.randint(-1, 2, (40,), generator=gen).float() / 4  # many exact ties
    logits = torch.tensor([float("nan"), float("inf"), float("-inf")])[:, None].repeat(1, 40)
    logits = torch.cat([logits, NONFINITE[0::2][torch.randint(0, 2, (3, 40), generator=gen)]])  # NaN / -inf mixes
    weights, ids = flashkern.ops.moe_route(logits.to(DEVICE), bias.to(DEVICE), top_k=6, score=score,
                                           scaling_factor=1.5, backend=backend)
    weights, ids = weights.cpu(), ids.cpu()
    assert (ids == bias.argsort(descending=True, stable=True)[:6].int()).all()
    sigmoid_of_inf = torch.zeros(6, 1)
    sigmoid_of_inf[1] = 1.0 if score == "sigmoid" else 0.0  # the all +inf row
    assert torch.equal(weights, (sigmoid_of_inf * 1.5 / 6).expand(6, 6))


@pytest.mark.parametrize("backend", ("reference", *KERNELS))
def test_group_score_max_and_top2(backend):
    """Group 0 holds one strong expert, group 1 two good ones: the max picks group 0, the top-2 sum group 1.
    "auto" is "max" without a bias and "top2" with one (vLLM's grouped_topk)."""
    logits = torch.tensor([[5.0, -5.0, -5.0, -5.0, 3.0, 3.0, -5.0, -5.0]]).to(DEVICE)
    zero_bias = torch.zeros(8, device=DEVICE)
    group_0, group_1 = [0, 1], [4, 5]  # (sigmoid: group 0 scores 0.993 / 1.000, group 1 0.953 / 1.905)
    for group_score, bias, expected in (("max", None, group_0), ("top2", None, group_1), ("auto", None, group_0),
                                        ("auto", zero_bias, group_1), ("max", zero_bias, group_0)):
        _, ids = flashkern.ops.moe_route(logits, bias, top_k=2, score="sigmoid", n_group=2, topk_group=1,
                                         group_score=group_score, backend=backend)
        assert ids.cpu().tolist() == [expected], (group_score, bias)


@pytest.mark.parametrize("backend", ("reference", *KERNELS))
def test_dominant_bias_decides_selection_not_weights(backend):
    """A bias of +100 on six experts selects exactly them; weights stay the unbiased scores."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(57, 384, generator=gen)
    chosen = torch.tensor([3, 77, 150, 200, 301, 383])
    bias = torch.zeros(384)
    bias[chosen] = 100.0
    weights, ids = flashkern.ops.moe_route(logits.to(DEVICE), bias.to(DEVICE), top_k=6, score="sqrtsoftplus",
                                           scaling_factor=1.5, backend=backend)
    weights, ids = weights.cpu(), ids.cpu()
    assert (ids.sort(dim=1).values == chosen.int()).all()
    s = ref.scores(logits, "sqrtsoftplus")[:, chosen]
    expected = s / s.sum(dim=1, keepdim=True) * 1.5
    torch.testing.assert_close(weights.gather(1, ids.argsort(dim=1)), expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ("reference", *KERNELS))
def test_invalid_rows_with_nan_logits(backend):
    logits = torch.full((9, 256), float("nan"))
    valid = torch.zeros(9, dtype=torch.bool)
    logits[4] = torch.randn(256)
    valid[4] = True
    weights, ids = flashkern.ops.moe_route(logits.to(DEVICE), torch.zeros(256, device=DEVICE), valid=valid.to(DEVICE),
                                           backend=backend, **V3.kwargs())
    weights, ids, valid = weights.cpu(), ids.cpu(), valid.cpu()
    assert (ids[valid == 0] == -1).all() and (weights[valid == 0] == 0).all()
    assert (ids[4] >= 0).all()


@pytest.mark.parametrize("op", (MOE_ROUTE, MOE_ROUTE_GATE), ids=lambda op: op.name)
@pytest.mark.parametrize("backend", ("reference", *KERNELS))
def test_zero_tokens(op, backend):
    problem = RouteProblem(tokens=0, routing=V41_FLASH, hidden=64 if op is MOE_ROUTE_GATE else 0)
    weights, ids = op.entry(**op.make_inputs(problem, DEVICE), backend=backend)
    assert weights.shape == (0, 6) and ids.shape == (0, 6) and ids.dtype == torch.int32


@pytest.mark.parametrize("backend", KERNELS)
def test_repeated_runs_are_bitwise_identical(backend):
    inputs = MOE_ROUTE.make_inputs(RouteProblem(tokens=300, routing=V3, has_valid=True), DEVICE, seed=1)
    first, second = (MOE_ROUTE.entry(**inputs, backend=backend) for _ in range(2))
    assert torch.equal(first[1], second[1]) and torch.equal(first[0].view(torch.int32), second[0].view(torch.int32))


@pytest.mark.parametrize("routing", narrowed([pytest.param(V41_FLASH, id="v41"), pytest.param(V3, id="v3")]))
def test_split_gate_in_the_gpus_default_config(routing):
    """The GPU's default at decode splits the Triton gate GEMV over D and expert blocks (fp32 partials; a token tile's
    last program to finish sums them in split order and routes the tile), where the interpreter's default keeps a
    program per tile: 1 token with the RMSNorm, 16 (one full tile) without, 33 (three tiles, the last ragged) with,
    against the oracle, and bitwise the same when run again."""
    impl = MOE_ROUTE_GATE.implementation("triton")
    for tokens, norm in ((1, True), (16, False), (33, True)):
        problem = RouteProblem(tokens=tokens, routing=routing, has_bias=True, has_valid=True, hidden=1024,
                               has_norm=norm)
        inputs = MOE_ROUTE_GATE.make_inputs(problem, DEVICE, seed=tokens)
        with flashkern.planning_for_gpu():
            config = impl.default_config(MOE_ROUTE_GATE.check(dict(inputs)))
        assert split_plan(problem.hidden, config["splits"], config["block_d"])[0] > 1, config
        first = run_and_check(MOE_ROUTE_GATE, inputs, "triton", config)
        second = MOE_ROUTE_GATE.entry(**inputs, backend="triton", config=config)
        assert torch.equal(first[1], second[1]) and torch.equal(first[0].view(torch.int32), second[0].view(torch.int32))


@pytest.mark.parametrize("routing", narrowed([pytest.param(V41_FLASH, id="v41"), pytest.param(V3, id="v3")]))
def test_tilelang_decode_gate_in_one_launch_and_in_stages(routing):
    """TileLang's decode gate in one launch (the GPU default for a few tokens): every CTA of a token tile forms its
    rows' 1 / rms, its partial logits over a D split, and the tile's last CTA to count in (a ticket) sums the splits in
    order and routes the tile's rows a warp at a time; `separate_route` (the default from 16 tokens) runs the same
    partials through three launches. 1 token with the RMSNorm, 16 (one full tile) without, 33 (three tiles, the last
    ragged) with, D split in both, against the oracle, and bitwise the same when run again."""
    impl = MOE_ROUTE_GATE.implementation("tilelang")
    for tokens, norm in ((1, True), (16, False), (33, True)):
        problem = RouteProblem(tokens=tokens, routing=routing, has_bias=True, has_valid=True, hidden=1024,
                               has_norm=norm)
        inputs = MOE_ROUTE_GATE.make_inputs(problem, DEVICE, seed=tokens)
        checked = MOE_ROUTE_GATE.check(dict(inputs))
        with flashkern.planning_for_gpu():
            config = impl.default_config(checked)
        assert config["separate_route"] == (tokens > 1), config
        assert split_plan(problem.hidden, config["splits"], config["block_d"])[0] > 1, config
        for separate, launches in ((False, 1), (True, 3 if norm else 2)):
            variant = dict(config, separate_route=separate)
            assert len(impl.kernel.programs(checked, variant, TILELANG_CPU, True)) == launches
            first = run_and_check(MOE_ROUTE_GATE, inputs, "tilelang", variant)
            second = MOE_ROUTE_GATE.entry(**inputs, backend="tilelang", config=variant)
            assert torch.equal(first[1], second[1])
            assert torch.equal(first[0].view(torch.int32), second[0].view(torch.int32))


@pytest.mark.parametrize("routing, tokens, norm", narrowed([pytest.param(V41_FLASH, 65, True, id="v41"),
                                                            pytest.param(V3, 130, False, id="v3")]))
def test_prefill_gate_in_the_gpus_default_config(routing, tokens, norm):
    """The GPU's default at prefill runs the Triton gate as three launches (1 / rms per token, a GEMM into fp32 partial
    logits split over D and expert blocks, the routing of their summed partials), where the interpreter's default
    keeps one: 65 tokens with the RMSNorm (V4.1 routing), 130 without (V3's, in wide profiles); the default (64-row
    tiles, D split at 65 tokens) and its 128-row tiles (from 1024 tokens) unsplit, against the oracle and bitwise the
    same when run again."""
    impl = MOE_ROUTE_GATE.implementation("triton")
    problem = RouteProblem(tokens=tokens, routing=routing, has_bias=True, has_valid=True, hidden=1024, has_norm=norm)
    inputs = MOE_ROUTE_GATE.make_inputs(problem, DEVICE, seed=tokens)
    with flashkern.planning_for_gpu():
        config = impl.default_config(MOE_ROUTE_GATE.check(dict(inputs)))
    assert config["separate_route"] and config["block_t"] == GEMM_TILE_T // 2, config
    for variant in (config, dict(config, block_t=GEMM_TILE_T, num_warps=8, splits=1)):
        first = run_and_check(MOE_ROUTE_GATE, inputs, "triton", variant)
        second = MOE_ROUTE_GATE.entry(**inputs, backend="triton", config=variant)
        assert torch.equal(first[1], second[1])
        assert torch.equal(first[0].view(torch.int32), second[0].view(torch.int32))


# ---------------------------------------------------------------- the oracle catches wrong answers


def _reference_case(seed=0):
    inputs = MOE_ROUTE.make_inputs(RouteProblem(tokens=64, routing=V3, has_valid=True), "cpu", seed=seed)
    return inputs, [t.clone() for t in ref.moe_route(**inputs)]


def _check(inputs, weights, ids):
    check_routing_result(inputs["logits"], inputs, weights, ids, key_tol=1e-6, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("corruption", ["swap_in_unselected", "duplicate_id", "weight_off", "padding_row",
                                        "wrong_group", "out_of_range", "unnormalized", "one_group_short",
                                        "swapped_order", "nonfinite_weight", "group_by_max"])
def test_oracle_rejects_wrong_routing(corruption):
    inputs, (weights, ids) = _reference_case()
    _check(inputs, weights, ids)  # the reference itself passes
    row = int(torch.nonzero(inputs["valid"])[0])
    b = ref.selection_keys(ref.scores(inputs["logits"], "sigmoid"), inputs["bias"])
    if corruption == "swap_in_unselected":  # replace the best chosen expert by the worst expert of a kept group
        group = int(ids[row, 0]) // 32
        members = torch.arange(group * 32, group * 32 + 32)
        worst = members[b[row, members].argmin()]
        ids[row, b[row, ids[row].long()].argmax()] = worst
    elif corruption == "duplicate_id":
        ids[row, 1] = ids[row, 0]
    elif corruption == "weight_off":
        weights[row, 0] += 1e-3
    elif corruption == "padding_row":
        weights[int(torch.nonzero(~inputs["valid"])[0]), 0] = 0.5
    elif corruption == "wrong_group":  # an expert from the worst group
        worst_group = ref.group_scores(b, 8, "top2")[row].argmin()
        ids[row, -1] = int(worst_group) * 32
    elif corruption == "out_of_range":
        ids[row, 0] = 256
    elif corruption == "unnormalized":
        weights[row] *= 1.01
    elif corruption == "one_group_short":  # route every row among only topk_group - 1 = 3 groups
        weights, ids = ref.moe_route(**{**inputs, "topk_group": 3})
    elif corruption == "swapped_order":  # the row's first two entries exchanged (ids and weights)
        ids[row, :2], weights[row, :2] = ids[row, [1, 0]], weights[row, [1, 0]]
    elif corruption == "nonfinite_weight":
        weights[row, 0] = float("inf")
    elif corruption == "group_by_max":  # groups chosen by their max key though a bias asks for the top-2 sum
        weights, ids = ref.moe_route(**{**inputs, "group_score": "max"})
    with pytest.raises(AssertionError):
        _check(inputs, weights, ids)


@pytest.mark.parametrize("corruption", ["tie_to_higher_id", "tied_out_of_order"])
def test_oracle_rejects_wrong_tie_order(corruption):
    """All-equal logits: only ids 0..k-1 in ascending order are right (any k distinct ids are within key_tol)."""
    inputs = dict(logits=torch.zeros(3, 16), bias=None, valid=None, **Routing(16, 4, "sigmoid").kwargs())
    weights, ids = ref.moe_route(**inputs)
    _check(inputs, weights, ids)
    if corruption == "tie_to_higher_id":
        ids[1, 3] = 9
    else:
        ids[1, :2] = ids[1, [1, 0]]
    with pytest.raises(AssertionError, match="tie"):
        _check(inputs, weights, ids)


# ---------------------------------------------------------------- bad input


def _good_route_args():
    return on_device(dict(logits=torch.randn(5, 64), bias=torch.zeros(64), top_k=4, score="sigmoid", n_group=8,
                          topk_group=2, valid=torch.ones(5, dtype=torch.bool)))


BAD_ROUTE_ARGS = [
    (dict(logits=torch.randn(5, 64).bfloat16()), TypeError, "logits must be float32"),
    (dict(logits=torch.randn(5, 64, 1)), ValueError, "logits must have shape"),
    (dict(logits=torch.randn(64, 5).t()), ValueError, "logits must have unit stride along its last dimension"),
    (dict(logits=[[0.0] * 64] * 5), TypeError, "logits must be a torch.Tensor"),
    (dict(bias=torch.zeros(63)), ValueError, "bias must have shape [64]"),
    (dict(bias=torch.zeros(64, dtype=torch.float64)), TypeError, "bias must be float32"),
    (dict(bias=torch.zeros(64, device="meta")), ValueError, "bias is on meta"),  # on_device leaves meta tensors
    (dict(valid=torch.ones(5)), TypeError, "valid must be bool"),
    (dict(valid=torch.ones(4, dtype=torch.bool)), ValueError, "valid must have shape [5]"),
    (dict(top_k=65, n_group=1, topk_group=1), ValueError, "top_k=65"),
    (dict(top_k=17), ValueError, "top_k=17"),  # more than the 16 experts in 2 of 8 groups
    (dict(top_k=0), ValueError, "top_k=0"),
    (dict(top_k=2.0), TypeError, "top_k must be an int"),
    (dict(n_group=7), ValueError, "n_group=7 does not divide the 64 experts"),
    (dict(n_group=64, topk_group=1), ValueError, "n_group=64 leaves one expert per group"),
    (dict(topk_group=9), ValueError, "topk_group=9"),
    (dict(score="relu"), ValueError, "score must be one of"),
    (dict(group_score="sum"), ValueError, "group_score must be one of"),
    (dict(scaling_factor=float("nan")), ValueError, "scaling_factor must be a finite number"),
    (dict(renormalize=1), TypeError, "renormalize must be a bool"),
    (dict(backend="cuda"), ValueError, "backend must be one of"),
    (dict(backend="triton", config={"block_t": 3, "num_warps": 4}), ValueError, "config['block_t'] = 3"),
    (dict(backend="tilelang", config={"block": 4}), ValueError, "config: unknown keys ['block']"),
    (dict(backend="reference", config={"block_t": 1}), ValueError, "config is for a kernel"),
]


@pytest.mark.parametrize("changes, error, message", BAD_ROUTE_ARGS, ids=[m for _, _, m in BAD_ROUTE_ARGS])
def test_bad_route_arguments_are_named_before_launch(monkeypatch, changes, error, message):
    for impl in MOE_ROUTE.implementations:  # a launch would fail the test instead of raising the named error
        monkeypatch.setattr(type(impl.kernel), "run", lambda *a: pytest.fail("a kernel ran despite bad input"))
    with pytest.raises(error, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")):
        flashkern.ops.moe_route(**{**_good_route_args(), **on_device(changes)})


BAD_GATE_ARGS = [
    (dict(hidden=torch.randn(5, 32)), TypeError, "hidden must be bfloat16"),
    (dict(gate_weight=torch.randn(64, 31).bfloat16()), ValueError, r"gate_weight must have shape \[\*, 32\]"),
    (dict(gate_weight=torch.randn(64, 32)), TypeError, "gate_weight must be bfloat16"),
    (dict(norm_weight=torch.ones(31).bfloat16()), ValueError, r"norm_weight must have shape \[32\]"),
    (dict(norm_eps=0.0), ValueError, "norm_eps must be positive"),
    (dict(top_k=65, n_group=1, topk_group=1), ValueError, "top_k=65"),
]


@pytest.mark.parametrize("changes, error, message", BAD_GATE_ARGS, ids=[m for _, _, m in BAD_GATE_ARGS])
def test_bad_gate_arguments_are_named(changes, error, message):
    args = on_device(dict(hidden=torch.randn(5, 32).bfloat16(), gate_weight=torch.randn(64, 32).bfloat16(),
                          norm_weight=torch.ones(32).bfloat16(), top_k=4, score="sigmoid", n_group=8, topk_group=2))
    with pytest.raises(error, match=message):
        flashkern.ops.moe_route_gate(**{**args, **on_device(changes)})
