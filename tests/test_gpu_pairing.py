"""The GPU build's element pairing replayed in Triton's interpreter (kernels/_triton/pairing.py), and the GPU lint
(kernels/gpu_lint.py) on the top-k: the first H200 run's wrong rows come from its histograms' reorder-reshapes.

Each case builds its launches' sm_90a TTGIR (with $FLASHKERN_TRITON_BUILDER's Triton, default this one), then runs
them in the interpreter with every histogram's operands paired as those layouts pair them, in the GPU's default
config. `_reshaped_apart` restores the top-k's histogram as the H200 ran it (values and mask reshaped apart):
under Triton 3.6 the emulation then fails exactly where that run failed (scripts/triton36_check.sh runs it with
3.6), under 3.9 where 3.9's layouts differ too; the shipped histogram passes everywhere.
"""

import functools
import os
import subprocess
import sys

import pytest
import torch

import _reshaped_apart
import flashkern
from flashkern import registry
from flashkern.kernels import gpu_lint
from flashkern.kernels._triton import _stages, pairing
from flashkern.kernels.cases import narrow
from flashkern.kernels.indexer import triton_topk
from flashkern.kernels.indexer.problem import TopkProblem
from test_vllm_topk import DECODE_CASES, PREFILL_CASES, compare_top_k_results, create_random_logits, \
    decode_ends, expected_top_k

pytestmark = pytest.mark.skipif(not flashkern.triton_interpreted(), reason="the emulation runs in the interpreter "
                                "(a GPU runs the compiled kernel itself: scripts/gpu_check.sh)")
TOPK = registry.get("topk_indices")


@functools.cache
def builder_version() -> tuple[int, int]:
    python = os.environ.get(pairing.BUILDER_ENV) or sys.executable
    text = subprocess.run([python, "-c", "import triton; print(triton.__version__)"], capture_output=True,
                          text=True, check=True).stdout
    return tuple(int(part) for part in text.split(".")[:2])


# ---------------------------------------------------------------- the cases of the 2026-12-04 H200 run


def _vllm_prefill(rows, top_k, clean, generation):
    starts = torch.zeros(rows, dtype=torch.int32)
    ends = torch.arange(1, rows + 1, dtype=torch.int32)
    return create_random_logits(starts, ends, 42, clean, generation), starts, ends, top_k


def _vllm_row_starts():
    logits = torch.randn(6, 500, generator=torch.Generator().manual_seed(3))
    starts = torch.tensor([0, 10, 100, 250, 499, 300], dtype=torch.int32)
    ends = torch.tensor([500, 90, 101, 500, 500, 300], dtype=torch.int32)
    return logits, starts, ends, 40


def _vllm_decode(top_k, batch, next_n, clean, generation, vocab):
    gen = torch.Generator().manual_seed(batch * 10 + next_n)
    seq_lens = torch.randint(next_n, vocab, (batch,), generator=gen, dtype=torch.int32)
    seq_lens[0] = vocab
    rows = batch * next_n
    ends = decode_ends(seq_lens, next_n)
    logits = create_random_logits(torch.zeros(rows, dtype=torch.int32), torch.full((rows,), vocab), 42, False,
                                  generation)
    if clean:
        logits[torch.arange(vocab) >= ends[:, None]] = -torch.inf
    return logits, None, ends, top_k


def _vllm_short_seq_lens():
    logits = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    return logits, None, torch.tensor([0, 0, 1, 2, 3, 4, 5, 6], dtype=torch.int32), 4


VLLM_CASES = {  # name: (the case's inputs, whether the H200 run (Triton 3.6) passed it: its tests.log)
    **{f"prefill {rows}x{rows} k{k}": (functools.partial(_vllm_prefill, rows, k, clean, gen),
                                       (rows, k) in ((1, 64), (300, 257)))
       for rows, k, clean, gen in PREFILL_CASES},
    "prefill 6x500 k40 (row starts)": (_vllm_row_starts, True),
    **{f"decode {batch * n}x{vocab} k{k}": (functools.partial(_vllm_decode, k, batch, n, clean, gen, vocab), k == 300)
       for k, batch, n, clean, gen, vocab in DECODE_CASES},
    "decode 8x16 k4 (short lengths)": (_vllm_short_seq_lens, False),
}
BENCH_PASSED = {3: False}  # v41-flash preset index -> passed on the H200 (run1-warm-topk_indices.json): 16 x 65536
# failed ("rows [5]"), every other shape passed


def _topk_launches(logits, starts, ends, k):
    """The GPU default's launches of topk_indices over logits [rows, W] into a new out, and out."""
    problem = TopkProblem(logits.shape[0], logits.shape[1], k, has_starts=starts is not None)
    with flashkern.planning_for_gpu():
        config = triton_topk.topk_default(problem)
    out = torch.empty((problem.rows, k), dtype=torch.int32)
    return triton_topk.select_launches(logits, ends, out, config, starts=starts), out


def _emulated_vllm_case(name, setup=None) -> tuple[bool, int]:
    """(whether case `name` passes vLLM's checks with the GPU's pairing, lint findings in its launches)."""
    logits, starts, ends, k = VLLM_CASES[name][0]()
    launches, out = _topk_launches(logits, starts, ends, k)
    hazards = sum(len(gpu_lint.lint_ttgir(text)) for text in pairing.run_as_built(launches, setup))
    chosen = out if starts is None else torch.where(out >= 0, out - starts[:, None], -1)
    zeros = torch.zeros(len(ends), dtype=torch.int32)
    row_starts = zeros if starts is None else starts
    try:
        compare_top_k_results(logits, chosen, expected_top_k(logits, row_starts, ends, k), row_starts, ends, k)
    except AssertionError:
        return False, hazards
    return True, hazards


def _emulated_bench_shape(index, setup=None) -> bool:
    """Whether topk_indices at v41-flash shape `index` (the bench's inputs: seed 0) passes with the GPU's pairing."""
    problem = TOPK.presets["v41-flash"][index]
    inputs = TOPK.make_inputs(problem, "cpu", seed=0)
    TOPK.check(inputs)
    impl = TOPK.implementation("triton")
    with flashkern.planning_for_gpu():
        config = impl.default_config(problem)
    out = TOPK.empty_outputs(problem, inputs)
    pairing.run_as_built(_stages(impl.kernel.plan(problem, inputs, config, out)), setup)
    try:
        TOPK.compare(inputs, TOPK.reference(**inputs), out)
    except AssertionError:
        return False
    return True


@pytest.fixture
def histogram_reshaped_apart(monkeypatch):
    """The top-k's histogram as the H200 ran it, here and in the builder: the builder's setup function."""
    monkeypatch.setattr(triton_topk, "masked_histogram", _reshaped_apart.histogram_reshaped_apart)
    return _reshaped_apart.install


# ---------------------------------------------------------------- the old histogram fails, the lint sees it


def test_the_lint_flags_the_histograms_reshaped_apart_and_passes_the_shipped_ones(histogram_reshaped_apart):
    """Both top-k sites (the top-k stage's per-row histogram, the split's first pass) with values and mask reshaped
    apart are flagged in the GPU default's build (a split shape: every stage); the shipped top-k is clean."""
    logits = torch.randn(4, 70000, generator=torch.Generator().manual_seed(0))
    launches, _ = _topk_launches(logits, None, torch.full((4,), 70000, dtype=torch.int32), 2048)
    names = [launch.kernel.fn.__name__ for launch in launches]
    assert names == ["chunk_histogram_kernel", "compact_kernel", "topk_kernel"], names
    old = [gpu_lint.lint_ttgir(text) for text in pairing.ttgir_of(launches, histogram_reshaped_apart)]
    assert old[0] and old[2] and not old[1], old
    assert all("reorder_pairing" in h and "tt.histogram" in h for found in old for h in found)
    assert not any(gpu_lint.lint_ttgir(text) for text in pairing.ttgir_of(launches))


CAUGHT_ON_EVERY_VERSION = ("prefill 32x32 k7", "decode 8x16 k4 (short lengths)", "decode 4x70000 k2048")


@pytest.mark.parametrize("name", CAUGHT_ON_EVERY_VERSION)
def test_the_emulation_fails_the_histograms_reshaped_apart(name, histogram_reshaped_apart):
    """The cases whose H200 failure Triton 3.9's layouts reproduce too (a row's end inside a tile; the split path)
    fail under the emulation, with the lint flagging their build."""
    passed, hazards = _emulated_vllm_case(name, histogram_reshaped_apart)
    assert not passed and hazards


@pytest.mark.skipif(builder_version() != (3, 6), reason="the H200 ran Triton 3.6: scripts/triton36_check.sh runs "
                    "this with $FLASHKERN_TRITON_BUILDER set to its 3.6 environment")
def test_the_emulation_reproduces_the_h200_runs_outcomes(histogram_reshaped_apart):
    """With the H200's Triton (3.6) building, the old histogram passes and fails the vLLM recipes and the bench
    shapes exactly as the H200 did, and every failure's build is flagged by the lint."""
    for name, (_, h200_passed) in VLLM_CASES.items():
        passed, hazards = _emulated_vllm_case(name, histogram_reshaped_apart)
        assert passed == h200_passed, name
        assert passed or hazards, name
    for index, h200_passed in BENCH_PASSED.items():
        assert _emulated_bench_shape(index, histogram_reshaped_apart) == h200_passed, TOPK.presets["v41-flash"][index]


# ---------------------------------------------------------------- the shipped top-k under the emulation

SHIPPED_CASES = CAUGHT_ON_EVERY_VERSION if narrow() else tuple(VLLM_CASES)


@pytest.mark.parametrize("name", SHIPPED_CASES)
def test_the_shipped_topk_passes_the_vllm_recipes_as_built(name):
    """The vLLM recipes (CI: those the old histogram fails on every version) pass with the GPU build's pairing,
    whose top-k histograms the lint finds clean."""
    assert _emulated_vllm_case(name) == (True, 0)


@pytest.mark.skipif(narrow(), reason="the bench shapes (16 x 64K to 16 x 512K in the interpreter) take minutes: "
                    "the thorough profile runs them")
@pytest.mark.parametrize("index", range(len(TOPK.presets["v41-flash"])))
def test_the_shipped_topk_passes_the_bench_shapes_as_built(index):
    assert _emulated_bench_shape(index)
