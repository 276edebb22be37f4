"""The indexer family: every implementation (default and sampled configs) against the reference and oracles.

Hypothesis draws (with the strategies of flashkern.kernels.indexer.cases, which `flashkern check` shares)
storage formats, head counts, ragged key ranges (empty rows, full rows, tails that are not multiples
of a tile), paged layouts with scattered cache blocks, and value shapes for selection (exact repeats,
+-inf, NaN). Scores are compared with the similarity measure of
docs/operators.md section 2 plus identical -inf masks (kernels.indexer.check_logits_result); selections with the property
oracle (kernels.indexer.check_topk_result) and, since every implementation follows the reference's
tie rule, for exact equality too.
"""

import math

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given, note
from hypothesis import strategies as st

import flashkern.ops
from flashkern.kernels._tilelang import GPU, build_sm90, nvcc_path
from flashkern.kernels.indexer import tilelang_logits, triton_topk
from _budget import fraction_of_examples
from _device import DEVICE, on_device
from flashkern import registry
from flashkern.kernels.indexer import (CandidateProblem, Indexer, LogitsProblem, PagedProblem, SparseProblem,
                                       TopkProblem, check_logits_result, check_topk_result,
                                       similarity_diff)
from flashkern.kernels.indexer.problem import split_chunk
from flashkern.kernels.indexer.cases import (candidate_cases, logits_cases, paged_cases, quantized, sparse_cases,
                                             topk_cases)
from flashkern.reference import indexer as ref

OPS = {name: registry.get(name) for name in
       ("mqa_logits", "paged_mqa_logits", "topk_indices", "candidate_blocks", "sparse_mqa_logits")}
KERNELS = ("triton", "tilelang")
CASES = {"mqa_logits": logits_cases, "paged_mqa_logits": paged_cases, "topk_indices": topk_cases,
         "candidate_blocks": candidate_cases, "sparse_mqa_logits": sparse_cases}
EXACT = ("topk_indices", "candidate_blocks")  # selections from exact values follow the reference's tie rule


def run_and_check(op, inputs, backend, config=None):
    expected = op.reference(**inputs)
    actual = op.entry(**inputs, backend=backend, config=config)
    op.compare(inputs, expected, actual)
    if op.name in EXACT and backend != "reference":
        assert torch.equal(actual.cpu(), expected.cpu()), "a selection differs from the reference's tie rule"
    return actual


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("name", sorted(CASES))
@given(data=st.data())
def test_matches_reference(name, backend, data):
    run_and_check(OPS[name], on_device(data.draw(CASES[name]())), backend)


@pytest.mark.parametrize("name", ("topk_indices", "sparse_mqa_logits"))
@given(data=st.data())
def test_reference_selection_passes_the_oracle(name, data):
    """The reference itself satisfies the selection oracle (which the kernels are held to)."""
    run_and_check(OPS[name], on_device(data.draw(CASES[name]())), "reference")


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("name", sorted(CASES))
@fraction_of_examples(1 / 4)
@given(data=st.data())
def test_sampled_configs_match_reference(name, backend, data):
    """Any config of the tuning space (not only the default) is correct."""
    op = OPS[name]
    inputs = on_device(data.draw(CASES[name]()))
    impl = op.implementation(backend)
    config = data.draw(st.sampled_from(impl.space.configs(op.check(inputs), target=DEVICE.type)))
    note(f"config={config}")
    run_and_check(op, inputs, backend, config)


MODEL_SHAPES = {  # the model's indexer at sizes that span several tiles, kept small for the CPU paths
    "mqa_logits": LogitsProblem(9, 1500),
    "paged_mqa_logits": PagedProblem(3, 7, 2, 64),
    "topk_indices": TopkProblem(5, 20000, 2048, has_starts=True),
    "candidate_blocks": CandidateProblem(4, 20000, 2048, 8),
    "sparse_mqa_logits": SparseProblem(3, 3000, 256, 8, 512),
}


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("name", sorted(MODEL_SHAPES))
def test_model_shapes_match_reference(name, backend):
    op = OPS[name]
    run_and_check(op, op.make_inputs(MODEL_SHAPES[name], DEVICE, seed=5), backend)


WIDE_INDEXER_SHAPES = {  # the 64 x 128 indexer (V3.2-style), one format each
    "mqa_logits": LogitsProblem(5, 700, Indexer(64, 128, "fp8")),
    "paged_mqa_logits": PagedProblem(2, 4, 2, 64, Indexer(64, 128, "mxfp4")),
    "sparse_mqa_logits": SparseProblem(3, 900, 64, 8, 128, Indexer(64, 128, "fp8")),
}


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("lens_2d", (False, True), ids=("lens_1d", "lens_2d"))
def test_mtp_tokens_split_over_programs(backend, lens_2d):
    """next_n 6 tokens of a sequence scored 4 and then 2 per program (block_rows 4), and one per program, as the
    defaults do for 64 heads (their scores would not fit the registers together)."""
    op = OPS["paged_mqa_logits"]
    problem = PagedProblem(3, 4, 6, 64, Indexer(64, 128, "mxfp4"), lens_2d=lens_2d)
    inputs = op.make_inputs(problem, DEVICE, seed=11)
    default = op.implementation(backend).default_config(op.check(inputs))
    for block_rows in (4, 1):
        run_and_check(op, inputs, backend, {**default, "block_rows": block_rows})


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("name", sorted(WIDE_INDEXER_SHAPES))
def test_64_heads_match_reference(name, backend):
    op = OPS[name]
    run_and_check(op, op.make_inputs(WIDE_INDEXER_SHAPES[name], DEVICE, seed=7), backend)


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("name", sorted(MODEL_SHAPES))
def test_repeated_runs_are_bitwise_identical(name, backend):
    op = OPS[name]
    inputs = op.make_inputs(MODEL_SHAPES[name], DEVICE, seed=2)
    first, second = (op.entry(**inputs, backend=backend).cpu() for _ in range(2))
    assert torch.equal(first.view(torch.int32), second.view(torch.int32))


@pytest.mark.parametrize("backend", ("reference", *KERNELS))
@pytest.mark.parametrize("fmt, limit", [("fp8", 1e-3), ("mxfp4", 0.02)])
def test_quantized_scores_track_bf16_scores(backend, fmt, limit):
    """Against logits from the unquantized bf16 inputs, similarity diff < 1e-3 (FP8) / 0.02 (FP4)
    (docs/operators.md section 2)."""
    gen = torch.Generator().manual_seed(0)
    rows, keys, h, d = 8, 700, 32, 128
    q = torch.randn(rows, h, d, generator=gen).bfloat16().float()
    k = torch.randn(keys, d, generator=gen).bfloat16().float()
    w = torch.randn(rows, h, generator=gen)
    ks, ke = torch.zeros(rows, dtype=torch.int32), torch.full((rows,), keys, dtype=torch.int32)
    exact = ref.score_keys(q, w, k)
    if fmt == "fp8":
        (q8, q_fold), (k8, k_scale) = ref.quantize_fp8_rows(q), ref.quantize_fp8_rows(k)
        inputs = dict(q=q8, k=k8, k_scale=k_scale, w=w * q_fold, ks=ks, ke=ke)
    else:
        (qp, q_scale), (kp, k_scale) = ref.quantize_mxfp4(q), ref.quantize_mxfp4(k)
        inputs = dict(q=qp, k=kp, k_scale=k_scale, w=w, ks=ks, ke=ke, q_scale=q_scale)
    logits = flashkern.ops.mqa_logits(**on_device(inputs), backend=backend).cpu()
    assert similarity_diff(exact.flatten(), logits.flatten()) < limit


@pytest.mark.parametrize("backend", ("reference", *KERNELS))
def test_fp8_key_scale_multiplies_the_head_sum(backend):
    """FP8: logits = (sum_h w relu(q . k)) x k_scale, the scale after the relu (docs/operators.md section 2); with
    negative scales that differs from scaling the key first (relu(q . k x k_scale)), which this tells apart."""
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(4, 8, 64, generator=gen).to(torch.float8_e4m3fn)
    k = torch.randn(50, 64, generator=gen).to(torch.float8_e4m3fn)
    k_scale = -torch.rand(50, generator=gen) - 0.5
    w = torch.randn(4, 8, generator=gen)
    ks, ke = torch.zeros(4, dtype=torch.int32), torch.full((4,), 50, dtype=torch.int32)
    dots = torch.einsum("mhd,nd->mhn", q.float(), k.float())
    after = ((dots.relu() * w[:, :, None]).sum(1) * k_scale).float()
    before = ((dots * k_scale).relu() * w[:, :, None]).sum(1)
    logits = flashkern.ops.mqa_logits(**on_device(dict(q=q, k=k, k_scale=k_scale, w=w, ks=ks, ke=ke)),
                                      backend=backend).cpu()
    torch.testing.assert_close(logits, after, atol=1e-4, rtol=1e-5)
    assert (logits - before).abs().max() > 1.0


@pytest.mark.parametrize("backend", ("reference", *KERNELS))
@pytest.mark.parametrize("name, problem", [("mqa_logits", LogitsProblem(5, 300)),
                                           ("paged_mqa_logits", PagedProblem(3, 3, 1, 64, Indexer(32, 128, "mxfp4")))])
def test_bf16_logits_are_the_fp32_logits_rounded_to_nearest_even(name, problem, backend):
    """logits_dtype=bf16 stores the fp32 logit rounded to nearest even (torch's cast), -inf kept: bit for bit."""
    op = OPS[name]
    inputs = op.make_inputs(problem, DEVICE, seed=3)
    fp32 = op.entry(**inputs, backend=backend).cpu()
    bf16 = op.entry(**{**inputs, "logits_dtype": torch.bfloat16}, backend=backend).cpu()
    assert bf16.dtype == torch.bfloat16 and (fp32 == -torch.inf).any()
    assert torch.equal(bf16.view(torch.int16), fp32.bfloat16().view(torch.int16))


# ---------------------------------------------------------------- storage formats: FP4 ties, ue8m0, packed forms

E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def _ulp_neighbours(x: float) -> list[float]:
    """x and the fp32 values one ulp below and above it."""
    bits = torch.tensor([x], dtype=torch.float32).view(torch.int32)
    return torch.cat((bits - 1, bits, bits + 1)).view(torch.float32).tolist()


def _tie_table() -> list[float]:
    """Every e2m1 midpoint and its fp32 neighbours, and the grid values; both signs (and -0)."""
    magnitudes = [v for m in E2M1_MIDPOINTS for v in _ulp_neighbours(m)] + list(ref.E2M1_GRID)
    return magnitudes + [-v for v in magnitudes]


def _round_to_nearest_even_code(x: float) -> int:
    """Hardware rounding onto e2m1 (IEEE round to nearest, ties to the even code, saturating at 6): the nearest grid
    value, the even index on a tie; the sign bit copied, -0 included."""
    grid = ref.E2M1_GRID
    index = min(range(8), key=lambda i: (abs(abs(x) - grid[i]), i % 2))
    return index | (8 if math.copysign(1.0, x) < 0 else 0)


def _ties_down_code(x: float) -> int:
    """DeepGEMM's _quantize_to_fp4_e2m1: the number of midpoints strictly below |x|; the sign only on a nonzero code."""
    index = sum(abs(x) > boundary for boundary in E2M1_MIDPOINTS)
    return index | (8 if x < 0 and index else 0)


@pytest.mark.parametrize("rounding, peer", [("even", _round_to_nearest_even_code), ("down", _ties_down_code)])
def test_fp4_tie_rule_matches_its_peer_on_every_midpoint(rounding, peer):
    """quantize_mxfp4's two tie rules, on every midpoint, +-1 ulp around each and the grid, both signs; each value in
    its own block of 32 whose maximum is 6 (so the scale is 1, byte 127)."""
    values = _tie_table()
    x = torch.zeros(len(values), ref.MX_BLOCK)
    x[:, 0], x[:, 1] = torch.tensor(values), 6.0
    packed, scale = ref.quantize_mxfp4(x, rounding=rounding)
    assert (scale == ref.UE8M0_BIAS).all()
    codes = (packed[:, 0] & 0xF).tolist()
    expected = [peer(v) for v in values]
    wrong = [(v, got, want) for v, got, want in zip(values, codes, expected) if got != want]
    assert not wrong, f"(value, code, peer's code): {wrong}"


@pytest.mark.parametrize("backend", ("reference", *KERNELS))
def test_ue8m0_byte_ff_is_nan_and_byte_0_is_2_to_the_minus_127(backend):
    """OCP MX: a 0xFF scale byte is NaN (here a key's and a query head's: NaN logits where visible, -inf elsewhere);
    byte 0 is 2^-127 (q scale 2^100 x k scale 2^-127: a finite, exact logit)."""
    decoded = ref.ue8m0_decode(torch.tensor([0, 127, 254, 255], dtype=torch.uint8))
    assert decoded[:3].tolist() == [2.0**-127, 1.0, 2.0**127] and decoded[3].isnan()
    gen = torch.Generator().manual_seed(11)
    inputs = quantized(Indexer(4, 64, "mxfp4"), (3,), (40,), gen, 1.0)
    inputs["ks"], inputs["ke"] = torch.zeros(3, dtype=torch.int32), torch.tensor([40, 20, 40], dtype=torch.int32)
    inputs["k_scale"][5, 1] = 0xFF  # key 5: NaN for every row that sees it
    inputs["q_scale"][1, 2, 0] = 0xFF  # row 1 (head 2): NaN on its visible keys [0, 20)
    inputs["q_scale"][2], inputs["k_scale"][8] = 227, 0
    expected = ref.mqa_logits(**inputs)
    actual = flashkern.ops.mqa_logits(**on_device(inputs), backend=backend).cpu()
    assert expected[:, 5].isnan().all() and expected[1, :20].isnan().all() and (expected[1, 20:] == -torch.inf).all()
    assert torch.equal(actual.isnan(), expected.isnan())
    check_logits_result(expected, actual)
    assert expected[2, 8] != 0
    torch.testing.assert_close(actual[2, 8], expected[2, 8], rtol=1e-5, atol=0)


def _packed_words(scale: torch.Tensor, padded: bool) -> torch.Tensor:
    """DeepGEMM's pack_ue8m0_to_int: the ue8m0 bytes [..., D/32] four per int32 (byte j = block j, little-endian;
    the last word padded with 0x7F), optionally as a row-padded view of a garbage-filled buffer."""
    width = -(-scale.shape[-1] // 4)
    pad = torch.full((*scale.shape[:-1], 4 * width - scale.shape[-1]), 0x7F, dtype=torch.uint8)
    words = torch.cat((scale.cpu(), pad), dim=-1).view(torch.int32).to(scale.device)
    if padded:
        buffer = torch.full((*words.shape[:-1], width + 3), -1, dtype=torch.int32, device=scale.device)
        buffer[..., :width] = words
        words = buffer[..., :width]
    return words


@pytest.mark.parametrize("backend", ("reference", *KERNELS))
@pytest.mark.parametrize("name, problem", [("mqa_logits", LogitsProblem(3, 200, Indexer(32, 128, "mxfp4"))),
                                           ("paged_mqa_logits", PagedProblem(3, 3, 1, 64, Indexer(32, 128, "mxfp4"))),
                                           ("mqa_logits", LogitsProblem(4, 100, Indexer(4, 64, "mxfp4")))])
def test_packed_int32_scales_read_as_their_bytes(name, problem, backend):
    """q_scale / k_scale as DeepGEMM's int32 words (contiguous, and row-padded views) give the uint8 form's logits."""
    op = OPS[name]
    inputs = op.make_inputs(problem, DEVICE, seed=4)
    expected = op.entry(**inputs, backend=backend).cpu()
    for padded in (False, True):
        words = {arg: _packed_words(inputs[arg], padded) for arg in ("q_scale", "k_scale")}
        actual = op.entry(**{**inputs, **words}, backend=backend).cpu()
        assert torch.equal(actual.view(torch.int32), expected.view(torch.int32)), f"padded={padded}"


def _fused_pages(k_cache: torch.Tensor, k_scale: torch.Tensor, padding: int) -> torch.Tensor:
    """DeepGEMM's fused page layout from our two tensors: per page the data rows, then a 4-byte scale word per token
    (fp32, or the ue8m0 bytes padded with 0x7F); pages `padding` bytes apart beyond their size."""
    blocks, block_size, stored = k_cache.shape
    data = k_cache.cpu().contiguous().view(torch.uint8).reshape(blocks, -1)
    if k_scale.dtype == torch.float32:
        words = k_scale.cpu().contiguous().view(torch.uint8).reshape(blocks, -1)
    else:
        pad = torch.full((blocks, block_size, 4 - k_scale.shape[-1]), 0x7F, dtype=torch.uint8)
        words = torch.cat((k_scale.cpu(), pad), dim=-1).reshape(blocks, -1)
    page = torch.cat((data, words), dim=1)
    buffer = torch.full((blocks, page.shape[1] + padding), 0xFF, dtype=torch.uint8, device=k_cache.device)
    buffer[:, : page.shape[1]] = page.to(k_cache.device)
    return buffer[:, : page.shape[1]].view(blocks, block_size, 1, stored + 4)


@pytest.mark.parametrize("backend", ("reference", *KERNELS))
@pytest.mark.parametrize("problem", [PagedProblem(2, 5, 2, 64), PagedProblem(3, 3, 1, 64, Indexer(32, 128, "mxfp4"))],
                         ids=["fp8", "mxfp4"])
def test_fused_paged_cache_gives_the_separate_caches_logits(problem, backend):
    """k_cache in DeepGEMM's fused pages with k_scale=None (page stride padded) is read as zero-copy views: the same
    logits as the two-tensor form, bit for bit."""
    op = OPS["paged_mqa_logits"]
    inputs = op.make_inputs(problem, DEVICE, seed=6)
    expected = op.entry(**inputs, backend=backend).cpu()
    fused = _fused_pages(inputs["k_cache"], inputs["k_scale"], padding=12)
    data, scale = ref.fused_cache_views(fused, fp4=problem.indexer.fmt == "mxfp4")
    assert data.data_ptr() == fused.data_ptr() and torch.equal(data.cpu().view(torch.uint8),
                                                               inputs["k_cache"].cpu().view(torch.uint8))
    actual = op.entry(**{**inputs, "k_cache": fused, "k_scale": None}, backend=backend).cpu()
    assert torch.equal(actual.view(torch.int32), expected.view(torch.int32))


def sparse_scoring(logits_inputs: dict) -> dict:
    """mqa_logits inputs as sparse_mqa_logits takes them (it returns positions, not logits: no logits_dtype)."""
    return {name: value for name, value in logits_inputs.items() if name != "logits_dtype"}


@pytest.mark.parametrize("backend", ("reference", *KERNELS))
def test_two_level_selection_equals_dense_when_every_block_is_a_candidate(backend):
    """With every block a candidate (context <= n_blocks * block), the sparse top-k is the dense top-k."""
    problem = LogitsProblem(6, 900)
    inputs = OPS["mqa_logits"].make_inputs(problem, DEVICE, seed=9)
    dense = flashkern.ops.mqa_logits(**inputs, backend=backend)
    blocks = flashkern.ops.candidate_blocks(dense, inputs["ke"], n_blocks=128, block=8, backend=backend)
    assert ((blocks >= 0).sum(dim=1).cpu() == (inputs["ke"].cpu() + 7) // 8).all()
    sparse = flashkern.ops.sparse_mqa_logits(**sparse_scoring(inputs), blocks=blocks, top_k=64, block=8,
                                             backend=backend)
    eligible = torch.arange(900, device=DEVICE) < inputs["ke"][:, None]
    check_topk_result(dense, eligible, 64, sparse, tol=1e-5)  # slot = position here; two kernels round differently


def _exact_tie_inputs(problem: SparseProblem) -> dict:
    """sparse_mqa_logits inputs whose scores are exact in fp32 whatever the summation order: unit queries and keys,
    w = 1/H, so every candidate scores D, except keys of 2 (every 37th position: 2D), NaN (k_scale NaN at every
    53rd) and rows' ranges (row 1 starts at 500). The selection is then fixed by the tie rule alone."""
    inputs = OPS["sparse_mqa_logits"].make_inputs(problem, DEVICE, seed=13)
    n = torch.arange(problem.keys, device=DEVICE)
    heads = problem.indexer.heads
    inputs["q"] = torch.ones_like(inputs["q"], dtype=torch.float32).to(inputs["q"].dtype)
    inputs["k"] = torch.where(n[:, None] % 37 == 0, 2.0, 1.0).expand(-1, problem.indexer.dim).to(inputs["k"].dtype)
    inputs["k_scale"] = torch.where(n % 53 == 0, torch.nan, 1.0).float()
    inputs["w"] = torch.full_like(inputs["w"], 1 / heads)
    inputs["ks"][1] = 500
    return inputs


@pytest.mark.parametrize("backend", KERNELS)
def test_sparse_spans_in_the_gpus_default_config(backend):
    """The GPU's default splits a row's candidates into spans, each keeping its best top_k, and a second stage merges
    a row's (Triton's interpreter default holds a row in one span): four spans, the last ragged, top_k below a span;
    then spans of 64 slots, below top_k, which keep every slot in place. Random scores against the reference and
    oracle, then exact ties across spans, which only the tie rule orders."""
    op = OPS["sparse_mqa_logits"]
    problem = SparseProblem(4, 4000, 400, 8, 96)
    inputs = op.make_inputs(problem, DEVICE, seed=13)
    with flashkern.planning_for_gpu():
        config = op.implementation(backend).default_config(op.check(inputs))
    span = config["tiles"] * config["block_n"]
    assert problem.top_k < span < problem.candidates, config  # several spans, each dropping candidates
    tied = _exact_tie_inputs(problem)
    expected = op.reference(**tied).cpu()
    assert (expected[:, -1] >= 0).all() and (torch.arange(4000)[expected[0]] % 37 != 0).any()  # ties decide
    in_place = {**config, "tiles": 1, "block_n": 64}  # spans below top_k keep every slot where it is
    for config in (config, in_place):
        run_and_check(op, inputs, backend, config)
        assert torch.equal(op.entry(**tied, backend=backend, config=config).cpu(), expected), config


@pytest.mark.parametrize("fmt", ("fp8", "mxfp4"))
@pytest.mark.parametrize("backend", KERNELS)
def test_dense_blocks_in_the_gpus_default_config(backend, fmt):
    """The GPU's default for 16 rows of 512K keys (many key tiles a block, several rows a block) on 11 rows of 5000
    keys: three blocks of tiles a row block, the last ragged. The first eight rows see only keys [1000, 2700), so
    whole tiles are seen by no row of their block (a block streams only the tiles that meet its rows' ranges, and
    stores -inf elsewhere); two rows are empty, one sees every key."""
    op = OPS["mqa_logits"]
    with flashkern.planning_for_gpu():
        config = op.implementation(backend).default_config(LogitsProblem(16, 524288, Indexer(32, 128, fmt)))
    assert config["tiles"] > 1 and config["block_m"] > 1, config
    inputs = op.make_inputs(LogitsProblem(11, 5000, Indexer(32, 128, fmt)), DEVICE, seed=21)
    ranges = [(1000, 1900), (1300, 1400), (1200, 2100), (700, 700), (2200, 2200), (1100, 2600), (1000, 1500),
              (2600, 2700), (4900, 5000), (4990, 5000), (0, 5000)]
    inputs["ks"] = torch.tensor([lo for lo, _ in ranges], dtype=torch.int32, device=DEVICE)
    inputs["ke"] = torch.tensor([hi for _, hi in ranges], dtype=torch.int32, device=DEVICE)
    run_and_check(op, inputs, backend, config)


@pytest.mark.parametrize("block_size, fmt", ((16, "fp8"), (64, "mxfp4")))
@pytest.mark.parametrize("backend", KERNELS)
def test_paged_blocks_in_the_gpus_default_config(backend, block_size, fmt):
    """The GPU's default for 8 sequences of 1024 cache blocks (TileLang: several key tiles a block) on 3 sequences
    of 40 cache blocks of 16 (a tile copied as 8 pieces, one a cache block) or 64 positions: a block streams the
    tiles its tokens see and stores -inf past them. Sequence 1 sees two thirds of its table, sequence 2 its first
    two positions; table entries past a context (one outside the cache) are never followed."""
    op = OPS["paged_mqa_logits"]
    with flashkern.planning_for_gpu():
        config = op.implementation(backend).default_config(PagedProblem(8, 1024, 2, block_size, Indexer(32, 128, fmt)))
    problem = PagedProblem(3, 40, 2, block_size, Indexer(32, 128, fmt))
    if backend == "tilelang":
        assert config["tiles"] > 1, config
    inputs = op.make_inputs(problem, DEVICE, seed=5)
    inputs["context_lens"][2] = 2  # two tokens: the first sees position 0, the second 0 and 1
    inputs["block_table"][2, 1:] = -7  # past its context
    inputs["block_table"][1, -1] = 10**6  # past its context and outside the cache
    run_and_check(op, inputs, backend, config)


# ---------------------------------------------------------------- the oracles catch wrong answers


def _split_tile(backend: str, config: dict) -> int:
    """Columns a CTA of the selection walks per step: split chunks are whole tiles."""
    return config["block_n"] if backend == "triton" else config["threads"] * config["items"]


def _selection_rows(rows: int, width: int, seed: int) -> torch.Tensor:
    """Logits whose selection stresses a split over CTAs: random rows, one of equal values (every position a
    candidate), NaN every 7th position, -inf but for a few values, and repeats of few values (ties straddling
    chunks)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, width, generator=gen)
    logits[1] = 0.25
    logits[2, ::7] = math.nan
    logits[3] = -math.inf
    logits[3, torch.randint(width, (40,), generator=gen)] = 1.0
    logits[4] = torch.randint(-3, 3, (width,), generator=gen).float()
    return logits


@pytest.mark.parametrize("by_score", (False, True), ids=("ascending", "sorted"))
@pytest.mark.parametrize("backend", KERNELS)
def test_split_selection_in_the_gpus_config(backend, by_score):
    """The GPU's config for 16 rows of 512K positions (its default, with rows split over up to 64 CTAs: Triton's
    default, TileLang's tuning choice) splits a row over CTAs (first-digit histograms merged per row, the
    candidates compacted, the top-k stage over them; the CPU default keeps a row in one CTA), on 6 rows of 20000:
    several chunks, the last ragged; rows from _selection_rows, ends below the width and below k, starts past a
    chunk; fp32 and bf16, against the reference exactly."""
    op = OPS["topk_indices"]
    with flashkern.planning_for_gpu():
        config = {**op.implementation(backend).default_config(TopkProblem(16, 524288, 512)), "chunks": 64}
    assert split_chunk(6, 20000, config["chunks"], _split_tile(backend, config)) not in (0, 20000), config
    logits = _selection_rows(6, 20000, seed=3)
    ends = torch.tensor([20000, 19999, 15000, 20000, 20000, 300], dtype=torch.int32)
    starts = torch.tensor([0, 9000, 1, 0, 4100, 0], dtype=torch.int32)
    for dtype in (torch.float32, torch.bfloat16):
        inputs = on_device(dict(logits=logits.to(dtype), ends=ends, starts=starts, k=512, sorted=by_score))
        run_and_check(op, inputs, backend, config)


def _directed_rows(case: str, width: int, k: int) -> torch.Tensor:
    """Rows whose selection turns on one key (three rows: the marked keys at the row's start, middle and end, so
    they fall in different chunks of a split):
      kth_below_a_bin_edge: the k - 1 largest keys about 1000, the k-th 1.0 and the rest -5 or below: the k-th and
          (k - 1)-th keys lie in different first-digit bins (the split's) and different top radix digits (the
          one-CTA select's), so a rank off by one drops the k-th key;
      ties_at_the_kth: k - 2 keys of 1000 and up, then six keys equal at 2.0 for the last two places (ties go to the
          lower positions), straddling chunks;
      k_is_one: random rows with one largest key."""
    gen = torch.Generator().manual_seed(11)
    rows = []
    for where in (0, width // 2, width - 1):
        row = -5.0 - torch.rand(width, generator=gen)
        spots = torch.randperm(width, generator=gen)
        if case == "kth_below_a_bin_edge":
            row[spots[:k - 1]] = 1000.0 + torch.arange(k - 1) * 0.25
            row[where] = 1.0
        elif case == "ties_at_the_kth":
            row[spots[:k - 2]] = 1000.0 + torch.arange(k - 2) * 0.25
            tied = spots[k - 2: k + 3]
            row[tied[tied != where]] = 2.0
            row[where] = 2.0
        else:
            row = torch.randn(width, generator=gen)
            row[where] = 7.0
        rows.append(row)
    return torch.stack(rows)


@pytest.mark.parametrize("path", ("one_cta", "split"))
@pytest.mark.parametrize("case, k", (("kth_below_a_bin_edge", 512), ("ties_at_the_kth", 64), ("k_is_one", 1)))
@pytest.mark.parametrize("backend", KERNELS)
def test_directed_selections_in_the_gpus_configs(backend, case, k, path):
    """Keys that decide a selection alone (_directed_rows), in the GPU's configs: its one-CTA default (8K positions)
    and its split (16 x 512K, up to 64 CTAs a row) on rows of 20000, against the reference exactly."""
    op = OPS["topk_indices"]
    width = 20000
    with flashkern.planning_for_gpu():
        config = op.implementation(backend).default_config(TopkProblem(16, 8192 if path == "one_cta" else 524288, k))
    if path == "split":
        config = {**config, "chunks": 64}
    assert bool(split_chunk(3, width, config["chunks"], _split_tile(backend, config))) == (path == "split"), config
    logits = _directed_rows(case, width, k)
    run_and_check(op, on_device(dict(logits=logits, ends=torch.full((3,), width, dtype=torch.int32), starts=None,
                                     k=k, sorted=False)), backend, config)


@pytest.mark.parametrize("backend", KERNELS)
def test_split_candidate_blocks_in_the_gpus_config(backend):
    """The GPU's config for 16 rows of 512K positions, split (its default, with up to 64 CTAs a row): block-score
    tiles are the chunks of the split selection over the scores and publish its first pass; on 5 rows of 20000
    positions (2500 block scores: several tiles) with _selection_rows and row ends from empty to the full row,
    against the reference exactly."""
    op = OPS["candidate_blocks"]
    with flashkern.planning_for_gpu():
        config = {**op.implementation(backend).default_config(CandidateProblem(16, 524288)), "chunks": 64}
    row_end = torch.tensor([20000, 17777, 0, 20000, 5000], dtype=torch.int32)
    inputs = on_device(dict(logits=_selection_rows(5, 20000, seed=4), row_end=row_end, n_blocks=300, block=8))
    run_and_check(op, inputs, backend, config)


@pytest.mark.parametrize("corruption", ["unmask", "mask", "one_entry", "nan"])
def test_logits_oracle_rejects(corruption):
    inputs = OPS["mqa_logits"].make_inputs(LogitsProblem(4, 300), "cpu", seed=1)
    expected = ref.mqa_logits(**inputs)
    actual = expected.clone()
    check_logits_result(expected, actual)
    row = 0  # its range ends before the last key
    n = int(inputs["ke"][row]) - 1
    if corruption == "unmask":
        actual[row, n + 1] = 0.0
    elif corruption == "mask":
        actual[row, n] = -torch.inf
    elif corruption == "one_entry":
        actual[row, n] *= 1.01
    else:
        actual[row, n] = torch.nan
    with pytest.raises(AssertionError):
        check_logits_result(expected, actual)


@pytest.mark.parametrize("corruption", ["swap_lower", "duplicate", "short", "long", "out_of_range", "ineligible",
                                        "nan_over_number"])
def test_topk_oracle_rejects(corruption):
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(3, 50, generator=gen)
    values[2, 40:] = torch.nan
    eligible = torch.arange(50) < torch.tensor([50, 30, 45])[:, None]
    k = 8
    out = ref.select_topk(values, eligible, k)
    check_topk_result(values, eligible, k, out)
    if corruption == "swap_lower":
        out[0, 0] = int(torch.where(out[0].long().new_zeros(50).scatter_(0, out[0].long(), 1).bool(), torch.inf,
                                    values[0]).argmin())
    elif corruption == "duplicate":
        out[0, 1] = out[0, 0]
    elif corruption == "short":
        out[0, -1] = -1
    elif corruption == "long":
        out = ref.select_topk(values, eligible, 60)[:, :k]
        out[1, 0] = -1
    elif corruption == "out_of_range":
        out[0, 0] = 50
    elif corruption == "ineligible":
        out[1, 0] = 35
    else:  # row 2 has 40 numbers: choosing a NaN over any of them is wrong
        out[2, 0] = 41
    with pytest.raises(AssertionError):
        check_topk_result(values, eligible, k, out)


# ---------------------------------------------------------------- bad input


def _good_logits_args():
    inputs = OPS["mqa_logits"].make_inputs(LogitsProblem(3, 40), DEVICE, seed=0)
    return inputs


BAD_LOGITS_ARGS = [
    (dict(q=torch.zeros(3, 32, 128)), TypeError, "q must be float8_e4m3fn or uint8"),
    (dict(q=torch.zeros(3, 32, 100, dtype=torch.float8_e4m3fn)), ValueError, "head dim 100 is not supported"),
    (dict(k=torch.zeros(40, 64, dtype=torch.float8_e4m3fn)), ValueError, r"k must have shape \[\*, 128\]"),
    (dict(k=torch.zeros(40, 128, dtype=torch.uint8)), TypeError, "k must be float8_e4m3fn"),
    (dict(k_scale=torch.ones(39)), ValueError, r"k_scale must have shape \[40\]"),
    (dict(w=torch.ones(3, 16)), ValueError, r"w must have shape \[3, 32\]"),
    (dict(ks=torch.zeros(3, dtype=torch.int64)), TypeError, "ks must be int32"),
    (dict(ke=torch.tensor([1, 41, 2], dtype=torch.int32)), ValueError, r"ke\[1\] = 41 is out of range"),
    (dict(ks=torch.tensor([0, 5, 0], dtype=torch.int32), ke=torch.tensor([1, 4, 2], dtype=torch.int32)),
     ValueError, r"ke\[1\] = 4 is out of range: must be in \[5, 40\]"),
    (dict(q_scale=torch.zeros(3, 32, 4, dtype=torch.uint8)), ValueError, "q_scale is for MXFP4"),
    (dict(q=torch.zeros(3, 32, 64, dtype=torch.uint8), k=torch.zeros(40, 64, dtype=torch.uint8),
          k_scale=torch.zeros(40, 1, dtype=torch.int32), q_scale=torch.zeros(3, 32, 2, dtype=torch.int32)), ValueError,
     r"q_scale must have shape \[3, 32, 1\]"),
    (dict(q=torch.zeros(3, 32, 64, dtype=torch.uint8), k=torch.zeros(40, 64, dtype=torch.uint8),
          k_scale=torch.zeros(40, 4), q_scale=torch.zeros(3, 32, 4, dtype=torch.uint8)), TypeError,
     "k_scale must be uint8 or int32"),
    (dict(logits_dtype=torch.float64), ValueError, "logits_dtype must be one of"),
    (dict(q=torch.zeros(3, 32, 64, dtype=torch.uint8), k=torch.zeros(40, 64, dtype=torch.uint8),
          k_scale=torch.zeros(40, 4, dtype=torch.uint8)), ValueError, "q_scale is required for MXFP4"),
    (dict(backend="triton", config={"nonsense": 1}), ValueError, "config: unknown keys"),
]


def _reject_launches(monkeypatch):
    for op in OPS.values():
        for impl in op.implementations:  # a launch would fail the test instead of raising the named error
            monkeypatch.setattr(type(impl.kernel), "run", lambda *a: pytest.fail("a kernel ran despite bad input"))


@pytest.mark.parametrize("changes, error, message", BAD_LOGITS_ARGS, ids=[m for _, _, m in BAD_LOGITS_ARGS])
def test_bad_logits_arguments_are_named_before_launch(monkeypatch, changes, error, message):
    _reject_launches(monkeypatch)
    with pytest.raises(error, match=message):
        flashkern.ops.mqa_logits(**{**_good_logits_args(), **on_device(changes)})


def _good_paged_args():
    return OPS["paged_mqa_logits"].make_inputs(PagedProblem(2, 3, 2, 16), DEVICE, seed=0)


BAD_PAGED_ARGS = [
    (dict(q=torch.zeros(2, 9, 32, 128, dtype=torch.float8_e4m3fn), w=torch.ones(18, 32)), ValueError,
     "1 to 8 query tokens"),
    (dict(context_lens=torch.zeros(2, 3, dtype=torch.int32)), ValueError, r"context_lens must have shape \[2, 2\]"),
    (dict(context_lens=torch.tensor([[48, 2], [0, 49]], dtype=torch.int32)), ValueError, r"context_lens\[1, 1\] = 49"),
    (dict(logits_dtype=torch.float16), ValueError, "logits_dtype must be one of"),
    (dict(k_cache=torch.zeros(9, 16, 1, 100, dtype=torch.uint8), k_scale=None), ValueError,
     r"k_cache must have shape \[\*, \*, 1, 132\]"),
    (dict(k_cache=torch.zeros(9, 16 * 132 + 2, dtype=torch.uint8)[:, : 16 * 132].view(9, 16, 1, 132), k_scale=None),
     ValueError, r"k_cache: the page stride \(2114\)"),
    (dict(k_cache=torch.zeros(9, 16, 1, 140, dtype=torch.uint8)[..., :132], k_scale=None), ValueError,
     "k_cache must be packed within a page"),
    (dict(context_lens=torch.tensor([48, 49], dtype=torch.int32)), ValueError, r"context_lens\[1\] = 49"),
    (dict(block_table=torch.tensor([[0, 1, 2], [3, 99, 5]], dtype=torch.int32)), ValueError, r"block_table\[1, 1\] = 99"),
    (dict(block_table=torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int64)), TypeError, "block_table must be int32"),
    (dict(w=torch.ones(2, 32)), ValueError, r"w must have shape \[4, 32\]"),
    (dict(k_scale=torch.ones(8, 16)), ValueError, r"k_scale must have shape \[9, 16\]"),
]


@pytest.mark.parametrize("changes, error, message", BAD_PAGED_ARGS, ids=[m for _, _, m in BAD_PAGED_ARGS])
def test_bad_paged_arguments_are_named_before_launch(monkeypatch, changes, error, message):
    _reject_launches(monkeypatch)
    with pytest.raises(error, match=message):
        flashkern.ops.paged_mqa_logits(**{**_good_paged_args(), **on_device(changes)})


BAD_SELECTION_ARGS = [
    ("topk_indices", dict(logits=torch.zeros(3, 10).double()), TypeError, "logits must be float32"),
    ("topk_indices", dict(ends=torch.tensor([1, 11, 2], dtype=torch.int32)), ValueError, r"ends\[1\] = 11"),
    ("topk_indices", dict(starts=torch.tensor([0, 3, 0], dtype=torch.int32)), ValueError, r"starts\[1\] = 3"),
    ("topk_indices", dict(k=0), ValueError, "k=0"),
    ("topk_indices", dict(k=4.0), TypeError, "k must be an int"),
    ("topk_indices", dict(sorted=1), TypeError, "sorted must be a bool"),
    ("topk_indices", dict(logits=torch.zeros(3, 10).half()), TypeError, "logits must be float32 or bfloat16"),
    ("candidate_blocks", dict(row_end=torch.tensor([1, 2], dtype=torch.int32)), ValueError, r"row_end must have shape \[3\]"),
    ("candidate_blocks", dict(block=0), ValueError, "block=0"),
    ("candidate_blocks", dict(n_blocks=-1), ValueError, "n_blocks=-1"),
]


def _good_selection_args(name):
    logits = torch.randn(3, 10)
    if name == "topk_indices":
        return dict(logits=logits, ends=torch.tensor([10, 2, 5], dtype=torch.int32), k=4,
                    starts=torch.tensor([0, 2, 1], dtype=torch.int32))
    return dict(logits=logits, row_end=torch.tensor([10, 2, 5], dtype=torch.int32), n_blocks=2, block=4)


@pytest.mark.parametrize("name, changes, error, message", BAD_SELECTION_ARGS, ids=[m for *_, m in BAD_SELECTION_ARGS])
def test_bad_selection_arguments_are_named_before_launch(monkeypatch, name, changes, error, message):
    _reject_launches(monkeypatch)
    with pytest.raises(error, match=message):
        OPS[name].entry(**on_device({**_good_selection_args(name), **changes}))


BAD_SPARSE_ARGS = [
    (dict(blocks=torch.tensor([[0, 5], [1, -1], [2, 3]], dtype=torch.int32)), ValueError, r"blocks\[0, 1\] = 5"),
    (dict(blocks=torch.tensor([[0, -2], [1, -1], [2, 3]], dtype=torch.int32)), ValueError, r"blocks\[0, 1\] = -2"),
    (dict(blocks=torch.zeros(3, 0, dtype=torch.int32)), ValueError, "at least one candidate block"),
    (dict(top_k=0), ValueError, "top_k=0"),
]


@pytest.mark.parametrize("changes, error, message", BAD_SPARSE_ARGS, ids=[m for _, _, m in BAD_SPARSE_ARGS])
def test_bad_sparse_arguments_are_named_before_launch(monkeypatch, changes, error, message):
    _reject_launches(monkeypatch)
    blocks = torch.tensor([[0, 4], [1, -1], [2, 3]], dtype=torch.int32)
    args = {**sparse_scoring(_good_logits_args()), "blocks": blocks, "top_k": 8, "block": 8}
    with pytest.raises(error, match=message):
        flashkern.ops.sparse_mqa_logits(**on_device({**args, **changes}))


@pytest.mark.parametrize("backend", ("reference", *KERNELS))
def test_empty_rows(backend):
    for name, problem in (("mqa_logits", LogitsProblem(0, 30)), ("topk_indices", TopkProblem(0, 30, 4)),
                          ("candidate_blocks", CandidateProblem(0, 30, 4, 8)),
                          ("sparse_mqa_logits", SparseProblem(0, 30, 4, 8, 8))):
        op = OPS[name]
        out = op.entry(**op.make_inputs(problem, DEVICE), backend=backend)
        assert out.shape[0] == 0, name


def test_sparse_key_gather_is_16_byte_cp_async_only_where_k_rows_are_aligned():
    """sparse_mqa_logits' span stage gathers FP8 key rows in 16-byte cp.async pieces where k's rows start on 16-byte
    boundaries (`sparse_layout`, from metadata only), else a byte at a time: both sm_90a builds, and the layout
    told from a contiguous k, a k one byte into its storage and a k with a row stride of 136 bytes."""
    if nvcc_path() is None:
        pytest.skip("nvcc is needed for the sm_90a build")
    problem = SparseProblem(2, 64)
    inputs = OPS["sparse_mqa_logits"].make_inputs(problem, "cpu", seed=0)
    k = inputs["k"]
    padded = torch.empty(k.shape[0], 136, dtype=k.dtype)[:, :128]
    shifted = torch.empty(k.numel() + 1, dtype=torch.uint8)[1:].view(k.dtype).view(k.shape)
    assert tilelang_logits.sparse_layout(inputs)
    assert not tilelang_logits.sparse_layout({**inputs, "k": shifted})
    assert not tilelang_logits.sparse_layout({**inputs, "k": padded})
    config = tilelang_logits.sparse_default(problem)
    for aligned in (True, False):
        select = tilelang_logits.sparse_select_program(problem, config, GPU, aligned)
        census = build_sm90(select).census
        assert (census.cp_async > 0) == aligned, (aligned, census)


def test_tilelang_first_digit_bins_and_lowest_keys_agree():
    """The TileLang split selection's first digit of a value (counted by pass 1, from its bits) and the lowest key of
    each digit (compared by pass 2) agree at every bin edge: digit(lowest(d)) >= d > digit(lowest(d) - 1); the digit
    never falls as the key rises (specials, bin edges and random values sorted); bins are quarter octaves (1, 1.25,
    .. 2 consecutive)."""
    import tilelang.language as T

    from flashkern.kernels._tilelang import compile_cpu
    from flashkern.kernels.indexer import tilelang_topk as tk

    n = T.dynamic("N")

    @T.prim_func
    def digits(Bits: T.Tensor((n,), "int32"), Digits: T.Tensor((n,), "int32"), Lowest: T.Tensor((256,), "int32")):
        with T.Kernel(1, threads=1):
            for i in T.serial(n):
                Digits[i] = tk.first_digit(Bits[i])
            for d in T.serial(256):
                Lowest[d] = tk.lowest_key_of_digit(d)

    kernel = compile_cpu(digits)

    def key(values):  # the kernels' int32 key: the reference's int64 one less 1 (it lifts numbers above NaN's)
        return torch.where(torch.isnan(values), ref.order_keys(values), ref.order_keys(values) - 1)

    def run(keys):
        """(first digits of the values whose kernel keys are `keys`, lowest keys of the digits)."""
        keys = keys.long()
        bits = torch.where(keys < 0, keys ^ 0x7FFFFFFF, keys).to(torch.int32)  # NaN's key: the bits of a NaN
        out, lowest = torch.empty_like(bits), torch.empty(256, dtype=torch.int32)
        kernel(bits, out, lowest)
        return out, lowest

    _, lowest = run(torch.zeros(1))
    values = torch.tensor([float("nan"), -float("inf"), -3e38, -2.0**17, -1.0, -2.0**-15, -1e-30, -0.0, 0.0, 1e-30,
                           2.0**-15, 1.0, 1.25, 1.5, 1.75, 2.0, 2.0**17, 3e38, float("inf")])
    keys = torch.cat([key(values), key(torch.randn(4096) * 2.0 ** torch.randint(-20, 20, (4096,))),
                      lowest.long(), (lowest.long() - 1).clamp(min=-(2**31))])
    found, _ = run(torch.sort(keys).values)
    assert bool((found[1:] >= found[:-1]).all()), "the first digit falls as the key rises"
    at, below = run(lowest)[0], run((lowest.long() - 1).clamp(min=-(2**31)))[0]
    d = torch.arange(256, dtype=torch.int32)
    assert bool((at >= d).all()), [int(x) for x in torch.nonzero(at < d)]
    assert bool((below[1:] < d[1:]).all()), [int(x) + 1 for x in torch.nonzero(below[1:] >= d[1:])]
    quarter = run(key(torch.tensor([1.0, 1.25, 1.5, 1.75, 2.0])))[0]
    assert quarter.tolist() == list(range(int(quarter[0]), int(quarter[0]) + 5)), quarter
    assert run(key(torch.tensor([float("nan"), -float("inf"), -0.0, 0.0, float("inf")])))[0].tolist() == [
        0, 0, 127, 128, 255]


NAN_KEEPING_RELU_PTX = """
import json, sys
import flashkern
from flashkern import registry
from flashkern.kernels import _triton

ptx = []
assemble = _triton.assemble
_triton.assemble = lambda text, *rest, **named: ptx.append(text) or assemble(text, *rest, **named)  # (this process only)
op = registry.get(sys.argv[1])
impl = op.implementation("triton")
problem = op.presets["smoke"][0]
inputs = op.make_inputs(problem, "cpu", 0)
op.check(inputs)
with flashkern.planning_for_gpu():
    config = impl.default_config(problem)
impl.build_stages_sm90(problem, inputs, config, op.empty_outputs(problem, inputs))
print(json.dumps(["max.NaN.f32" in text for text in ptx]))
"""


def test_scoring_relu_keeps_nan_on_the_gpu():
    """The GPU's relu keeps NaN (max.NaN.f32): the interpreter's maximum keeps NaN whatever its flag and the C target
    selects, so only the sm_90a builds tell a NaN-dropping max apart. Triton's PTX, TileLang's imported function
    (each DSL's three scorers share the relu's code: mqa_logits builds fastest)."""
    import json
    import os
    import subprocess
    import sys

    name = "mqa_logits"
    if nvcc_path() is None:
        pytest.skip("nvcc (and ptxas) absent: no sm_90a build to read")
    found = subprocess.run([sys.executable, "-c", NAN_KEEPING_RELU_PTX, name], capture_output=True, text=True,
                           env={**os.environ, "TRITON_INTERPRET": "0"}, check=True).stdout
    assert any(json.loads(found.splitlines()[-1])), "no max.NaN.f32 in any stage's PTX"
    assert "max.NaN.f32" in tilelang_logits.RELU_KEEPING_NAN
    op = registry.get(name)
    problem = op.presets["smoke"][0]
    impl = op.implementation("tilelang")
    inputs = op.make_inputs(problem, "cpu", 0)
    op.check(inputs)
    from flashkern.kernels._tilelang import lower_sm90

    sources = [lower_sm90(func)[0] for func in impl.kernel.programs(problem, impl.default_config(problem), GPU,
                                                                      impl.kernel.layout_of(inputs))]
    assert any("fk_relu_keeping_nan(" in source.split("extern \"C\"")[-1] for source in sources)


# ---------------------------------------------------------------- the radix select's Triton primitives


@triton.jit
def _radix_primitives(keys_ptr, counted_ptr, lengths_ptr, histogram_ptr, suffix_ptr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr):
    row = tl.arange(0, BLOCK_M)
    column = tl.arange(0, BLOCK_N)
    at = row[:, None] * BLOCK_N + column[None, :]
    bins = row[:, None] * 256 + tl.arange(0, 256)[None, :]
    # as the top-k counts: a loaded flag and the row's end (built from arange: a layout of its own on sm_90a)
    counted = (tl.load(counted_ptr + at) != 0) & (column[None, :] < tl.load(lengths_ptr + row)[:, None])
    histogram = triton_topk._digit_histogram(tl.load(keys_ptr + at), counted, tl.zeros((BLOCK_M,), tl.int32), 24,
                                             False, BLOCK_M, BLOCK_N)
    tl.store(histogram_ptr + bins, histogram)
    tl.store(suffix_ptr + bins, triton_topk.suffix_sum(histogram, 1))


@pytest.mark.parametrize(("rows", "columns", "num_warps"), [(1, 4096, 8), (1, 512, 8), (16, 512, 8), (16, 128, 4)])
def test_the_radix_selects_histogram_and_suffix_sums(rows, columns, num_warps):
    """The top-k's per-row first-digit histogram (masked, rows x 256 bins in one tl.histogram) and its suffix sums,
    against torch, wherever the suite runs, in the tiles the GPU runs (topk_default: a row of 512 to 4096 on 8
    warps), with rows ending mid-tile: the GPU's top-k failed there where the interpreter's did not (docs/gpu.md,
    "First run"; on CPU tests/test_gpu_pairing.py replays the GPU's pairing)."""
    gen = torch.Generator().manual_seed(rows * columns)
    keys = torch.randint(-(2**31), 2**31 - 1, (rows, columns), generator=gen, dtype=torch.int64).int()
    flags = torch.rand(rows, columns, generator=gen) < 0.7
    lengths = torch.randint(1, columns + 1, (rows,), generator=gen, dtype=torch.int32)
    histogram, suffix = (torch.empty(rows, 256, dtype=torch.int32, device=DEVICE) for _ in range(2))
    _radix_primitives[(1,)](keys.to(DEVICE), flags.int().to(DEVICE), lengths.to(DEVICE), histogram, suffix,
                            BLOCK_M=rows, BLOCK_N=columns, num_warps=num_warps)
    counted = flags & (torch.arange(columns)[None, :] < lengths[:, None])
    digit = ((keys ^ -(2**31)) >> 24) & 0xFF
    expected = torch.zeros(rows, 256, dtype=torch.int32).scatter_add_(1, digit.long(), counted.int())
    assert torch.equal(histogram.cpu(), expected)
    assert torch.equal(suffix.cpu(), expected.flip(1).cumsum(1).flip(1).int())


# ---------------------------------------------------------------- stores stay inside their outputs

SENTINEL = 0x5A5A5A5A  # int32 guard words either side of a guarded buffer
GUARD = 80000  # wider than a row: the overshoot of a selection or a compaction that disagrees with its counts


def _guarded(shape) -> tuple[torch.Tensor, torch.Tensor]:
    """(the whole buffer, a view of `shape` inside it with GUARD sentinel words on each side)."""
    numel = math.prod(shape)
    whole = torch.full((GUARD + numel + GUARD,), SENTINEL, dtype=torch.int32)
    return whole, whole[GUARD:GUARD + numel].view(shape)


def _guards_hold(whole: torch.Tensor) -> bool:
    return bool((whole[:GUARD] == SENTINEL).all() and (whole[-GUARD:] == SENTINEL).all())


@pytest.mark.skipif(not flashkern.triton_interpreted(), reason="counts are corrupted in the interpreter")
@pytest.mark.parametrize("split", (False, True), ids=("one_cta", "split"))
def test_triton_topk_writes_inside_its_outputs_when_its_passes_disagree(monkeypatch, split):
    """Histograms that disagree with the keys they count, as a miscompile or a race would make them (every pass
    counts twice its tile in the row's lowest bin: the threshold is the lowest key, so every key is taken, and the
    split's compaction keeps every key at offsets twice their place), give a wrong selection but no store outside
    the output or the split's candidate list: the sentinels around both stay (guards wider than any overshoot,
    so that a stray store is an assertion, not a corrupted heap). The GPU's default configs (the one-CTA stage,
    and the split's three passes)."""
    from triton.runtime import interpreter

    histogram = interpreter.interpreter_builder.create_histogram

    def corrupted(data, bins, mask):
        rows_counted = histogram(data, bins, mask).data.size // 256
        counts = np.zeros((rows_counted, 256), dtype=np.int32)
        counts[:, 0] = 2 * data.data.size // rows_counted
        return interpreter.TensorHandle(counts.reshape(-1), tl.int32)

    candidates = []

    def guarded_buffers(rows, chunks, width, device):
        buffers = split_buffers(rows, chunks, width, device)
        whole, buffers["positions_ptr"] = _guarded((rows, width))
        candidates.append(whole)
        return buffers

    split_buffers = triton_topk.split_buffers
    monkeypatch.setattr(interpreter.interpreter_builder, "create_histogram", corrupted)
    monkeypatch.setattr(triton_topk, "split_buffers", guarded_buffers)
    rows, width, k = (3, 70000, 512) if split else (3, 3000, 512)
    with flashkern.planning_for_gpu():
        config = triton_topk.topk_default(TopkProblem(rows, width, k))
    assert bool(split_chunk(rows, width, config["chunks"], config["block_n"])) == split, config
    logits = torch.randn(rows, width, generator=torch.Generator().manual_seed(9))
    whole, out = _guarded((rows, k))
    for launch in triton_topk.select_launches(logits, torch.full((rows,), width, dtype=torch.int32), out, config):
        launch()
    assert _guards_hold(whole), "a store outside the output"
    assert len(candidates) == split and all(map(_guards_hold, candidates)), "a store outside the candidate list"


def test_tilelang_compaction_writes_inside_the_candidate_list_when_offsets_overshoot():
    """The split's compaction after a pass 1 that disagrees with the keys (the row's total all in the lowest bin, so
    every key is kept; each chunk's sums doubled, so its offset is twice its place, the last chunks' past the row)
    stores no candidate outside the positions and keys it fills: the sentinels stay. TileLang's safe-memory pass
    guards every global store by its buffer's extents on both targets (the sm_90a source holds the guard too),
    so its kernels need no bounds of their own."""
    from flashkern.kernels._tilelang import CPU, compile_cpu, lower_sm90
    from flashkern.kernels.indexer import tilelang_topk

    rows, width, k = 2, 6000, 512
    config = {"threads": 128, "items": 4, "chunks": 8}
    chunk = split_chunk(rows, width, config["chunks"], config["threads"] * config["items"])
    assert chunk and width // chunk > 1, chunk
    chunks = -(-width // chunk)
    logits = torch.randn(rows, width, generator=torch.Generator().manual_seed(4))
    buffers = tilelang_topk.split_buffers(rows, chunks, width, "cpu")
    histogram = compile_cpu(tilelang_topk.chunk_histogram_program(config, CPU))
    ends = torch.full((rows,), width, dtype=torch.int32)
    starts = torch.zeros(1, dtype=torch.int32)
    histogram(logits, ends, starts, buffers["total"], buffers["suffix"], chunk)
    buffers["total"][:] = 0
    buffers["total"][:, 0] = width
    buffers["suffix"] *= 2
    guards = {name: _guarded((rows, width)) for name in ("positions", "keys")}
    buffers.update({name: view for name, (_, view) in guards.items()})
    out = torch.empty((rows, k), dtype=torch.int32)
    compact_args, _ = tilelang_topk.split_select_args(logits, out, chunk, buffers, CPU, ends=ends)
    compile_cpu(tilelang_topk.compact_program(config["threads"], config["items"], CPU))(*compact_args)
    assert all(_guards_hold(whole) for whole, _ in guards.values())
    assert (buffers["counts"] == 2 * width).all()  # it ran with the disagreeing sums
    source = lower_sm90(tilelang_topk.compact_program(256, 16, GPU))[0]
    for store in ("Positions[", "Keys["):
        at = source.index(store)
        assert "if (slot[0] < W) {" in source[source.rfind("if (taken", 0, at):at], store
