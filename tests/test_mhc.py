"""mHC: Sinkhorn, pre, post and the V4.1 chain, every implementation against the reference.

Hypothesis draws the inputs from the operators' strategies (flashkern.kernels.mhc.cases, shared with
`flashkern check`): the stream count, token counts and hidden sizes with odd tails, how values look
(large epsilons and few iterations, all-zero token rows, huge magnitudes, a NaN or inf token row),
norm on and off, and each collapse of the layer input. The comparison is the
operator's own (kernels/mhc, docs/operators.md section 4: fp32 gates within 1e-3, bf16 outputs at atol 5e-2 / rtol 1e-2,
Sinkhorn at assert_close's fp32 defaults); the properties the spec names are checked on kernel outputs
besides, the chain against its composition at 1e-2, and the stream-0 collapse bit for bit.
"""

import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st

import flashkern.ops
from _budget import fraction_of_examples
from _device import DEVICE, on_device
from flashkern import registry
from flashkern.kernels.cases import covering
from flashkern.kernels.mhc import MhcProblem, SinkhornProblem
from flashkern.kernels.tiles import split_plan
from flashkern.kernels.mhc.cases import apply_value_mode
from flashkern.reference import mhc as ref
from flashkern.reference.mhc import COLLAPSES

KERNELS = ("triton", "tilelang")
OPS = {name: registry.get(name) for name in ("sinkhorn", "mhc_pre", "mhc_post", "mhc_post_pre")}


def cases(name: str):
    """The operator's strategy (Operator.cases: flashkern.kernels.mhc.cases, as `flashkern check` draws), on DEVICE."""
    return OPS[name].cases().map(on_device)


def run_and_check(op, inputs, backend, config=None):
    expected = op.reference(**inputs)
    actual = op.entry(**inputs, backend=backend, config=config)
    op.compare(inputs, expected, actual)
    return actual


def assert_gate_properties(pre, post, comb, inputs: dict) -> None:
    """pre > pre_eps - tiny, 0 <= post <= post_mult, comb >= 0 (rows with NaN/inf inputs excepted)."""
    finite = torch.isfinite(comb).flatten(1).all(dim=1)
    assert (comb[finite] >= 0).all(), "negative comb entries"
    assert (pre[finite] >= inputs["pre_eps"] - 1e-6).all() and (post[finite] >= 0).all()
    assert (post[finite] <= abs(inputs["post_mult"]) * (1 + 1e-6)).all()


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("name", sorted(OPS))
@given(data=st.data())
def test_matches_reference(name, backend, data):
    inputs = data.draw(cases(name))
    actual = run_and_check(OPS[name], inputs, backend)
    if name in ("mhc_pre", "mhc_post_pre"):
        assert_gate_properties(actual.pre.cpu(), actual.post.cpu(), actual.comb.cpu(), inputs)


@pytest.mark.parametrize("backend", KERNELS)
@fraction_of_examples(1 / 4)
@given(data=st.data())
def test_sampled_configs_match_reference(backend, data):
    """Any config of each tuning space (not only the default) is correct; the operator is drawn too, since
    each TileLang config is a C compile."""
    op = OPS[data.draw(st.sampled_from(sorted(OPS)))]
    inputs = data.draw(cases(op.name))
    impl = op.implementation(backend)
    config = data.draw(st.sampled_from(impl.space.configs(op.check(inputs), target=DEVICE.type)))
    note(f"{op.name} config={config}")
    run_and_check(op, inputs, backend, config)


@pytest.mark.parametrize("backend", ("reference", *KERNELS))
def test_sinkhorn_after_20_iterations_is_doubly_stochastic(backend):
    """Logits ~ N(0, 1): after the default 20 iterations rows and columns sum to 1 (columns were just
    normalized: within 1e-5; rows within 1e-3), entries are non-negative. (Wider logits converge slower:
    at N(0, 2^2) one matrix in 10 is still 1e-3 off in a row after 20 iterations, in the reference too.)"""
    x = on_device(dict(x=torch.randn(500, 4, 4, generator=torch.Generator().manual_seed(3))))["x"]
    comb = flashkern.ops.sinkhorn(x, backend=backend).cpu()
    assert (comb >= 0).all()
    torch.testing.assert_close(comb.sum(dim=-2), torch.ones(500, 4), atol=1e-5, rtol=0)
    torch.testing.assert_close(comb.sum(dim=-1), torch.ones(500, 4), atol=1e-3, rtol=0)


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("hidden", [4096, 5120, 7168])
def test_model_chain_matches_reference_and_the_unfused_composition(backend, hidden):
    """V4.1 at the model widths: the delayed chain with the fused RMSNorm equals the reference, and equals
    this backend's own mhc_post then mhc_pre (the new residual bitwise; the layer input collapsed with the
    carried pre-mix, as the reference does). Repeated runs are bitwise identical."""
    problem = MhcProblem(3, hidden, collapse="carried", has_norm=True)
    op = OPS["mhc_post_pre"]
    inputs = op.make_inputs(problem, DEVICE, seed=hidden)
    chain = run_and_check(op, inputs, backend)
    again = op.entry(**inputs, backend=backend)
    for first, second in zip(chain, again):
        assert torch.equal(first, second), "repeated runs differ"

    post_args = {k: inputs[k] for k in ("y", "residual", "post", "comb")}
    pre_args = {k: v for k, v in inputs.items() if k not in (*post_args, "pre_mix", "delayed")}
    new_residual = flashkern.ops.mhc_post(**post_args, backend=backend)
    assert torch.equal(chain.residual, new_residual), "the chain's residual differs from mhc_post's"
    unfused = flashkern.ops.mhc_pre(new_residual, **pre_args, backend=backend)
    tolerance = dict(atol=1e-2, rtol=1e-2)  # docs/operators.md section 4: the fused chain within 1e-2
    for name in ("pre", "post", "comb"):
        torch.testing.assert_close(getattr(chain, name), getattr(unfused, name), **tolerance)
    carried = ref.collapse(new_residual.cpu(), inputs["pre_mix"].cpu(), inputs["norm_weight"].cpu(),
                           inputs["norm_eps"])
    torch.testing.assert_close(chain.layer_input.cpu().float(), carried.float(), **tolerance)


@pytest.mark.parametrize("backend", ("reference", *KERNELS))
@pytest.mark.parametrize("collapse", COLLAPSES)
def test_chain_is_post_then_pre(backend, collapse):
    """Each collapse: the chain's layer input is that of mhc_pre (same pre_mix and delayed) on the new residual."""
    op = OPS["mhc_post_pre"]
    inputs = op.make_inputs(MhcProblem(5, 100, has_norm=True, collapse=collapse), DEVICE, seed=1)
    chain = op.entry(**inputs, backend=backend)
    new_residual = flashkern.ops.mhc_post(*(inputs[k] for k in ("y", "residual", "post", "comb")), backend=backend)
    pre_args = {k: v for k, v in inputs.items() if k not in ("y", "residual", "post", "comb")}
    unfused = flashkern.ops.mhc_pre(new_residual, **pre_args, backend=backend)
    torch.testing.assert_close(chain.layer_input.float(), unfused.layer_input.float(), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize(*covering(collapse=COLLAPSES, name=("mhc_pre", "mhc_post_pre"), backend=KERNELS,
                                   epilogue=("last_split", "own_launch")))
def test_split_k_in_the_gpus_default_config(backend, epilogue, name, collapse):
    """The split-K path as the GPU runs it (the interpreter's default has one split): several splits of each token
    tile, a ragged last tile, the epilogue run by the tile's last split to count in (Triton: in sub-blocks), or
    by a second launch (Triton: of 4-token programs, the last one ragged; TileLang: a block per token). Equal to the reference, bitwise
    repeatable, and within the fused tolerance of the one-split result."""
    op = OPS[name]
    # the narrowest widths whose GPU defaults split (TileLang splits from D = 1024 on), each with a ragged tail
    problem = MhcProblem(37, 1056 if backend == "tilelang" else 264, has_norm=True, collapse=collapse)
    inputs = op.make_inputs(problem, DEVICE, seed=11)
    impl = op.implementation(backend)
    with flashkern.planning_for_gpu():
        config = impl.default_config(problem)
    config = {**config, "block_t": 16, "epilogue": epilogue}  # three token tiles
    if backend == "triton":
        config["epi_block_t"] = 4  # last split: four epilogue blocks a tile
    assert split_plan(problem.hidden, config["split_k"], config["block_d"])[0] > 1, config
    split = run_and_check(op, inputs, backend, config)
    again = op.entry(**inputs, backend=backend, config=config)
    for first, second in zip(split, again):
        assert torch.equal(first, second), "repeated runs differ"
    whole = op.entry(**inputs, backend=backend, config={**config, "split_k": 1})
    for first, second in zip(split, whole):
        torch.testing.assert_close(first.float(), second.float(), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("backend", KERNELS)
def test_gates_are_fp32_accurate(backend):
    """The GEMM with fp32 fn is fp32-accurate (Triton: a tf32 high part and the rest; TileLang: three bf16 planes,
    exact products with the residual's bf16 values): pre, post and comb within 2e-5 of the reference, where fn
    rounded once to bf16 or tf32 is off by about 1e-3."""
    op = OPS["mhc_pre"]
    inputs = op.make_inputs(MhcProblem(37, 1056), DEVICE, seed=3)
    expected, actual = op.reference(**inputs), op.entry(**inputs, backend=backend)
    for name in ("pre", "post", "comb"):
        torch.testing.assert_close(getattr(actual, name), getattr(expected, name), atol=2e-5, rtol=0, msg=name)


@pytest.mark.parametrize("name, collapse", (("mhc_pre", "fresh"), ("mhc_post_pre", "carried")))
def test_tilelang_prefill_default_on_ragged_tiles(name, collapse):
    """TileLang's GPU default at prefill (4096 tokens: 64-row tiles, wgmma's padding of fn's planes, 2 splits), run on
    70 tokens (a ragged second tile) with the norm: equal to the reference and bitwise repeatable."""
    op = OPS[name]
    impl = op.implementation("tilelang")
    with flashkern.planning_for_gpu():
        config = impl.default_config(MhcProblem(4096, 1056, has_norm=True, collapse=collapse))
    assert config["block_t"] == 64 and split_plan(1056, config["split_k"], config["block_d"])[0] > 1, config
    inputs = op.make_inputs(MhcProblem(70, 1056, has_norm=True, collapse=collapse), DEVICE, seed=12)
    first = run_and_check(op, inputs, "tilelang", config)
    for one, other in zip(first, op.entry(**inputs, backend="tilelang", config=config)):
        assert torch.equal(one, other), "repeated runs differ"


@pytest.mark.parametrize("backend", ("reference", *KERNELS))
def test_stream0_layer_input_is_stream_zero_exactly(backend):
    """delayed=True without pre_mix (vLLM's model entry): the layer input is residual[:, 0] bit for bit, a select:
    inf and NaN in the other streams do not reach it (a one-hot multiply would give 0 * inf = NaN), -0.0 and -inf
    in stream 0 pass unchanged. The chain's layer input is its new residual's stream 0, bit for bit. (That the
    gates are still computed is checked by test_matches_reference, which draws every collapse.)"""
    inputs = OPS["mhc_pre"].make_inputs(MhcProblem(4, 100, collapse="stream0"), "cpu", seed=5)
    residual = inputs["residual"]
    residual[1, 1, 7], residual[1, 2, 8] = float("inf"), float("nan")
    residual[2, 0, 3], residual[3, 0, 4] = -0.0, float("-inf")
    layer_input = flashkern.ops.mhc_pre(**on_device(inputs), backend=backend).layer_input.cpu()
    assert torch.equal(layer_input.view(torch.int16), residual[:, 0].view(torch.int16))
    chain_inputs = OPS["mhc_post_pre"].make_inputs(MhcProblem(4, 100, collapse="stream0"), DEVICE, seed=6)
    chain = flashkern.ops.mhc_post_pre(**chain_inputs, backend=backend)
    assert torch.equal(chain.layer_input.view(torch.int16), chain.residual[:, 0].view(torch.int16))


@pytest.mark.parametrize("backend", ("reference", *KERNELS))
@pytest.mark.parametrize("name", sorted(OPS))
def test_no_tokens(name, backend):
    op = OPS[name]
    collapse = "carried" if name == "mhc_post_pre" else "stream0"
    problem = SinkhornProblem(0) if name == "sinkhorn" else MhcProblem(0, 64, collapse=collapse)
    inputs = op.make_inputs(problem, DEVICE, seed=0)
    expected, actual = op.reference(**inputs), op.entry(**inputs, backend=backend)
    for e, a in zip(*((expected, actual) if isinstance(expected, tuple) else ((expected,), (actual,)))):
        assert a.shape == e.shape and a.dtype == e.dtype and a.numel() == 0


def _reject_launches(monkeypatch):
    for op in OPS.values():
        for impl in op.implementations:  # a launch would fail the test instead of raising the named error
            monkeypatch.setattr(type(impl.kernel), "run", lambda *a: pytest.fail("a kernel ran despite bad input"))


def _good(name: str) -> dict:
    op = OPS[name]
    collapse = "carried" if name == "mhc_post_pre" else "fresh"
    problem = SinkhornProblem(3) if name == "sinkhorn" else MhcProblem(3, 16, collapse=collapse)
    return op.make_inputs(problem, DEVICE, seed=0)


BAD_ARGS = [
    ("sinkhorn", dict(x=torch.zeros(4)), ValueError, r"x must be a tensor of n x n matrices"),
    ("sinkhorn", dict(x=torch.zeros(2, 3, 4)), ValueError, r"x must have shape \[2, 4, 4\]"),
    ("sinkhorn", dict(x=torch.zeros(2, 9, 9)), ValueError, r"n \(x.shape\[-1\]\)=9 must be in \[1, 8\]"),
    ("sinkhorn", dict(x=torch.zeros(2, 4, 4, dtype=torch.float64)), TypeError, "x must be float32"),
    ("sinkhorn", dict(x=torch.zeros(4, 4, 2).transpose(0, 2)), ValueError, "x must be contiguous"),
    ("sinkhorn", dict(iters=0), ValueError, r"iters=0 must be in \[1, 1000\]"),
    ("sinkhorn", dict(eps=-1e-6), ValueError, "eps must be >= 0"),
    ("sinkhorn", dict(eps=float("nan")), ValueError, "eps must be a finite number"),
    ("mhc_pre", dict(residual=torch.zeros(3, 4, 16)), TypeError, "residual must be bfloat16"),
    ("mhc_pre", dict(residual=torch.zeros(3, 16, 4, dtype=torch.bfloat16).transpose(1, 2)), ValueError,
     "residual must be contiguous"),
    ("mhc_pre", dict(fn=torch.zeros(24, 60)), ValueError, r"fn must have shape \[24, 64\]"),
    ("mhc_pre", dict(hc_scale=torch.zeros(2)), ValueError, r"hc_scale must have shape \[3\]"),
    ("mhc_pre", dict(hc_base=torch.zeros(24, dtype=torch.float16)), TypeError, "hc_base must be float32"),
    ("mhc_pre", dict(norm_weight=torch.ones(15, dtype=torch.bfloat16)), ValueError,
     r"norm_weight must have shape \[16\]"),
    ("mhc_pre", dict(rms_eps=-1.0), ValueError, "rms_eps must be >= 0"),
    ("mhc_pre", dict(iters=2.5), TypeError, "iters must be an int"),
    ("mhc_pre", dict(residual=torch.zeros(3, 9, 16, dtype=torch.bfloat16)), ValueError,
     r"n \(residual.shape\[1\]\)=9 must be in \[1, 8\]"),
    ("mhc_post", dict(y=torch.zeros(3, 15, dtype=torch.bfloat16)), ValueError, r"y must have shape \[3, 16\]"),
    ("mhc_post", dict(comb=torch.zeros(3, 4, 4).transpose(1, 2)), ValueError, "comb must be contiguous"),
    ("mhc_post", dict(post=torch.zeros(3, 4, dtype=torch.bfloat16)), TypeError, "post must be float32"),
    ("mhc_post", dict(residual=torch.zeros(3, 4, 0, dtype=torch.bfloat16), y=torch.zeros(3, 0, dtype=torch.bfloat16)),
     ValueError, r"D \(residual.shape\[2\]\)=0 must be at least 1"),
    ("mhc_pre", dict(pre_mix=torch.rand(3, 4), delayed=False), ValueError, "pre_mix is given, but delayed=False"),
    ("mhc_pre", dict(pre_mix=torch.rand(3, 4).double()), TypeError, "pre_mix must be float32"),
    ("mhc_pre", dict(delayed=1), TypeError, "delayed must be a bool"),
    ("mhc_post_pre", dict(pre_mix=torch.zeros(3, 3)), ValueError, r"pre_mix must have shape \[3, 4\]"),
    ("mhc_post_pre", dict(delayed=False), ValueError, r"pre_mix is given, but delayed=False .*drop pre_mix"),
    ("mhc_post_pre", dict(fn=torch.zeros(24, 64, dtype=torch.bfloat16)), TypeError, "fn must be float32"),
    ("mhc_post_pre", dict(post_mult=float("inf")), ValueError, "post_mult must be a finite number"),
    ("mhc_post_pre", dict(backend="triton", config={"nonsense": 1}), ValueError, "config: unknown keys"),
]


@pytest.mark.parametrize("name, changes, error, message", BAD_ARGS, ids=[m for *_, m in BAD_ARGS])
def test_bad_arguments_are_named_before_launch(monkeypatch, name, changes, error, message):
    _reject_launches(monkeypatch)
    with pytest.raises(error, match=message):
        OPS[name].entry(**{**_good(name), **on_device(changes)})


@pytest.mark.parametrize("corruption", ["pre_eps dropped", "comb transposed", "residual 4% off", "post scaled"])
def test_comparison_rejects(corruption):
    """The comparisons can fail: wrong answers of the kinds a kernel bug gives are rejected."""
    op = OPS["mhc_post_pre"]
    made = op.make_inputs(MhcProblem(9, 37, collapse="carried"), "cpu", 4)
    inputs = apply_value_mode(torch.Generator().manual_seed(0), made, "large_eps")
    good = op.reference(**inputs)
    if corruption == "pre_eps dropped":
        bad = good._replace(pre=good.pre - inputs["pre_eps"])
    elif corruption == "comb transposed":
        bad = good._replace(comb=good.comb.transpose(1, 2))
    elif corruption == "residual 4% off":  # above the bf16 tolerance (5e-2 + 1%) for entries beyond 1.7
        bad = good._replace(residual=(good.residual.float() * 1.04).bfloat16())
    else:
        bad = good._replace(post=good.post * 1.01)
    op.compare(inputs, good, good)
    with pytest.raises(AssertionError):
        op.compare(inputs, good, bad)


@pytest.mark.parametrize("streams", (1, 2, 4, 8))
def test_gpu_defaults_of_the_pre_block_satisfy_their_spaces(monkeypatch, streams):
    """The GPU default configs of mhc_pre / mhc_post_pre (which the CPU tests never pick: the interpreter has its
    own) lie within their tuning spaces' register and shape limits for every stream count and size, and Triton's
    split count and epilogue follow the tiles of the block_t the limits left."""
    from flashkern.kernels.mhc import tilelang_mhc, triton_mhc
    from flashkern.kernels.mhc.problem import epilogue_launch

    monkeypatch.setattr(flashkern, "triton_interpreted", lambda: False)
    for tokens in (1, 2, 16, 128, 300, 1024, 8192):
        for hidden in (64, 1000, 4096, 7168):
            problem = MhcProblem(tokens, hidden, streams=streams)
            for module in (triton_mhc, tilelang_mhc):
                config = module.pre_default(problem)
                assert not module.PRE_SPACE.violations(problem, config, "cuda"), (module.__name__, problem, config)
            config = triton_mhc.pre_default(problem)
            tiles = -(-tokens // config["block_t"])
            assert config["epilogue"] == epilogue_launch(tokens, tiles), (problem, config)
            assert config["split_k"] == 1 or tiles * config["split_k"] <= 2 * 132, (problem, config)
