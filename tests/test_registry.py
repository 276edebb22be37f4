"""The operator registry, dispatch and device handling, for every registered operator."""

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flashkern
import flashkern.ops
from flashkern import device as devices
from flashkern import registry
from flashkern.dispatch import resolve, rule_choice
from flashkern.kernels.indexer import Indexer
from flashkern.kernels.indexer.cases import MAX_SPARSE_N_BLOCKS

OPERATORS = sorted(registry.operators().values(), key=lambda op: op.name)


def test_every_operator_is_an_op_entry_with_presets_and_both_dsls():
    for op in OPERATORS:
        assert getattr(flashkern.ops, op.name) is op.entry
        assert {impl.name for impl in op.implementations} == {"triton", "tilelang"}
        assert {"smoke"} <= set(op.presets) and all(op.presets.values())
        assert op.cases is not None  # the property tests' draws, shared with `flashkern check`
    assert set(dir(flashkern.ops)) == {op.name for op in OPERATORS}


def test_unknown_operator_is_a_clear_error():
    with pytest.raises(AttributeError, match="no operator 'mystery'"):
        flashkern.ops.mystery
    with pytest.raises(KeyError, match="unknown operator 'mystery'"):
        registry.get("mystery")


def _around_presets(op):
    """Every preset problem, its leading size (tokens, rows, batch) at 1, 17 and 1000, and an indexer's problems
    with a small indexer (4 heads x 64)."""
    for problems in op.presets.values():
        for problem in problems:
            for size in (problem.sizes[0], 1, 17, 1000):
                scaled = problem.with_sizes((size, *problem.sizes[1:]))
                yield scaled
                if hasattr(scaled, "indexer"):
                    yield dataclasses.replace(scaled, indexer=Indexer(4, 64, scaled.indexer.fmt))


@pytest.mark.parametrize("op", OPERATORS, ids=lambda op: op.name)
def test_default_configs_satisfy_their_spaces(op):
    """For the problems around every preset, each default config (this device's, and the GPU's as planned for it)
    is a valid point of its tuning space.

    (The GPU defaults against the GPU limits are checked by test_compile_check, which builds them.)
    """
    target = devices.info().kind
    for problem in _around_presets(op):
        for impl in op.implementations:
            config = impl.default_config(problem)
            assert not impl.space.violations(problem, config, target), (problem.key, impl.name, config)
            impl.space.check(problem, config, target)
            with flashkern.planning_for_gpu():
                impl.space.check(problem, impl.default_config(problem), "cuda")


@pytest.mark.parametrize("op", OPERATORS, ids=lambda op: op.name)
@given(seed=st.integers(0, 2**16), scale=st.sampled_from([1, 3, 17, 1000]))
def test_made_inputs_pass_the_checks_and_shapes_scale(op, seed, scale):
    """The input maker makes what the entry accepts, with the problem it was asked for."""
    problem = op.presets["smoke"][seed % len(op.presets["smoke"])]
    problem = problem.with_sizes((scale, *problem.sizes[1:]))  # the leading size: tokens, rows, batch
    inputs = op.make_inputs(problem, "cpu", seed)
    assert op.check(inputs) == problem
    assert op.cost(problem).bytes > 0 and op.cost(problem).flops > 0


def test_interpreter_is_on_without_a_gpu():
    assert flashkern.triton_interpreted() == (not torch.cuda.is_available())


def test_default_rule_on_this_machine():
    info = devices.info()
    for op in OPERATORS:
        choice = rule_choice(op, info)
        if info.kind == "cpu":
            assert choice is None  # the reference: both kernel paths are correctness paths on CPU
        else:
            assert choice is not None and choice.name == "triton"


def test_device_identity_is_stable_and_names_the_hardware():
    info = devices.info("cpu")
    assert info.kind == "cpu" and info.key.startswith("cpu:") and info.name
    assert devices.info("cpu") is info
    with pytest.raises(ValueError, match="unsupported device type 'meta'"):
        devices.info("meta")


def test_unavailable_backend_is_refused_with_the_reason():
    op = registry.get("moe_route")
    problem = op.presets["smoke"][0]
    old_gpu = devices.DeviceInfo(kind="cuda", name="Old GPU", capability=(7, 0), sm_count=80)
    for impl in op.implementations:
        with pytest.raises(RuntimeError, match=f"backend='{impl.name}' cannot run on Old GPU"):
            resolve(op, problem, old_gpu, impl.name, None)


def test_driver_queries_fail_softly_without_a_driver():
    """cuda-python is installed everywhere; without a driver its queries give nothing, not an error."""
    if torch.cuda.is_available():
        pytest.skip("a CUDA driver is present")
    assert devices._driver_attributes(0) == {}


def _specializations_drawn(op, profile: str, examples: int) -> set:
    """The specializations of `examples` cases of op's strategy drawn under a hypothesis profile (each case must
    pass the operator's checks)."""
    previous, seen = settings.get_current_profile_name(), set()
    settings.load_profile(profile)
    try:
        @settings(max_examples=examples, derandomize=True, database=None)
        @given(inputs=op.cases())
        def collect(inputs):
            seen.add(op.check(inputs).specialization())

        collect()
    finally:
        settings.load_profile(previous)
    return seen


@pytest.mark.parametrize("op", OPERATORS, ids=lambda op: op.name)
def test_narrow_and_wide_draws_are_valid_inputs_and_wide_ones_vary_more(op):
    """Every strategy draws inputs its operator accepts under the narrow (`ci`) and the wide (`thorough`) profile
    (kernels/cases.py), and the wide draws select at least as many specializations."""
    narrow_specs, wide_specs = _specializations_drawn(op, "ci", 8), _specializations_drawn(op, "thorough", 8)
    assert narrow_specs and len(wide_specs) >= len(narrow_specs)


@pytest.mark.parametrize("name", ["paged_mqa_logits", "sparse_mqa_logits", "topk_indices",
                                  "sparse_decode_attention"])
def test_narrow_profiles_draw_the_presets_specializations_and_wide_ones_every_kind(name):
    """Under `ci` every drawn case compiles one of the preset specializations (kernels/cases.py); under `thorough`
    the same strategy draws others too."""
    op = registry.get(name)
    pool = {problem.specialization() for problems in op.presets.values() for problem in problems}
    if name == "sparse_mqa_logits":  # the strategy cuts the presets' candidate lists
        pool = {p.__class__(**{**p.__dict__, "n_blocks": min(p.n_blocks, MAX_SPARSE_N_BLOCKS)}) for p in pool}
    narrow_specs, wide_specs = _specializations_drawn(op, "ci", 20), _specializations_drawn(op, "thorough", 20)
    assert narrow_specs and narrow_specs <= pool
    assert wide_specs - pool


@pytest.mark.parametrize("config", ["notadict", [("block_t", 4)], 3])
def test_a_config_that_is_not_a_dict_is_named(config):
    logits = torch.randn(3, 384)
    with pytest.raises(TypeError, match="^config must be a dict of tuning parameters, got "):
        flashkern.ops.moe_route(logits, torch.zeros(384), top_k=6, backend="triton", config=config)


FRESH_PROCESS_OPS = """
import sys

import flashkern  # nothing else: the custom ops must exist now
import torch

assert "tilelang" not in sys.modules, "importing flashkern loaded TileLang"  # schemas, not kernels
names = sorted(flashkern.registry.operators())
for name in names:
    op = flashkern.registry.get(name)
    inputs = op.make_inputs(op.presets["smoke"][0], "cpu", 0)
    overload, args, kwargs = flashkern.library.call_arguments(name, dict(inputs))
    assert overload is getattr(torch.ops.flashkern, name).default
    returned = getattr(torch.ops.flashkern, name)(*args, **kwargs, backend="reference")
    expected = op.reference(**op.make_inputs(op.presets["smoke"][0], "cpu", 0))
    if hasattr(expected, "_fields"):  # the op returns a plain tuple where the entry point names its fields
        returned = type(expected)(*returned)
    actual = inputs[op.mutates] if op.mutates else returned
    op.compare(inputs, expected, actual)
print(" ".join(names))
"""


def test_the_custom_ops_exist_once_flashkern_is_imported():
    """A fresh process that imports only flashkern (an engine calling torch.ops, or loading a compiled graph that
    names the ops) finds torch.ops.flashkern.<name> for every operator, and each gives the reference's result;
    TileLang is not loaded until a TileLang kernel is needed."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", FRESH_PROCESS_OPS], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == sorted(registry.operators())
