"""`flashkern check`: the tests' strategies from the command line, failures shrunk into runnable snippets."""

from types import SimpleNamespace

import pytest
import torch
from hypothesis import strategies as st

from flashkern import check, registry
from flashkern_cli import main

CPU = torch.device("cpu")


def test_a_kernel_that_matches_passes(capsys):
    assert main(["check", "sinkhorn", "--backend", "triton", "--examples", "4", "--seed", "3", "--device", "cpu"]) == 0
    assert "sinkhorn triton: 4 examples (seed 3) match the reference" in capsys.readouterr().out


def test_a_config_is_checked_where_its_space_allows_it(capsys):
    op = registry.get("moe_route")
    config = op.implementation("triton").default_config(op.presets["smoke"][0])
    assert main(["check", "moe_route", "--backend", "triton", "--config", __import__("json").dumps(config),
                 "--examples", "3", "--device", "cpu"]) == 0
    with pytest.raises(SystemExit, match="--config needs --backend"):
        main(["check", "moe_route", "--config", "{}"])


def _summing_op():
    """An operator whose 'kernel' is wrong once a vector has more than 3 elements."""
    return SimpleNamespace(
        name="summing", cases=lambda: st.integers(0, 60).map(lambda n: dict(x=torch.arange(float(n)))),
        reference=lambda x: x.sum(), result_of=lambda inputs, backend, config: inputs["x"][:3].sum(),
        compare=lambda inputs, expected, actual: torch.testing.assert_close(actual, expected),
        implementation=lambda name: None, check=lambda inputs: None)


def test_a_failure_is_shrunk_to_the_smallest_case():
    seen = []
    failure = check.run(_summing_op(), "reference", None, 50, 0, CPU, on_example=lambda: seen.append(1))
    assert failure is not None and isinstance(failure.error, AssertionError)
    assert failure.inputs["x"].numel() == 4  # the smallest vector the kernel gets wrong
    assert seen


@pytest.mark.parametrize("matrices", [2, 40])  # inline, and saved to a file (more than INLINE_ELEMENTS values)
def test_the_snippet_reruns_the_case(tmp_path, matrices):
    op = registry.get("sinkhorn")
    problem = op.presets["smoke"][0].with_sizes((matrices,))
    inputs = op.make_inputs(problem, "cpu", 0)
    inputs["x"].view(-1)[:3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    code = check.snippet(op, "triton", None, inputs, tmp_path)
    assert ("torch.load" in code) == (matrices == 40)
    namespace = {}
    exec(compile(code, "snippet", "exec"), namespace)  # passes: the case matches
    expected = op.entry(**inputs, backend="triton")
    assert torch.equal(namespace["out"].nan_to_num(), expected.nan_to_num())
