"""Hypothesis strategies of indexer inputs, shared by tests/test_indexer.py and `flashkern check`.

Each strategy draws one input dict of CPU tensors (callers move it to their device) with the keyword
arguments of the entry point; the default strategy of each operator (its record's `cases`):
  logits_cases()     mqa_logits: an indexer shape and storage format (INDEXERS: 32 x 128 or 4 x 64 heads x dim,
                     FP8 or MXFP4), rows and keys small or past a tile, values of magnitude 1, 1e-3 or 300 with
                     some all-zero keys, key ranges (causal, random, full, or every other row empty), fp32 or bf16
                     logits
  paged_cases()      paged_mqa_logits: batch, next_n 1, 2 or 6, block size 16 or 64, each sequence's blocks
                     scattered over a cache with spare blocks, table entries past the context -7 (never read),
                     context lengths per sequence or per token (one full table / row), fp32 or bf16 logits
  topk_cases()       topk_indices: rows, positions up to max_positions, k from 1 to 2048 (more than the positions,
                     often), ragged ends (one full row), optional starts, sorted or not, fp32 or bf16 logits, and
                     how the values look (VALUE_MODES: normal, exact ties, +-inf / +-3e38 / -0, NaN and -inf)
  candidate_cases()  candidate_blocks: rows, positions up to 4000, n_blocks 1 to 2048, blocks of 4 or 8 positions,
                     ragged row ends (one full row), the value modes and dtypes of topk_cases
  sparse_cases()     sparse_mqa_logits: an indexer and key ranges as logits_cases, per row distinct candidate block
                     ids in random order (some past the row's range), -1 padded, and top_k 1 to 512
Tensors come from a drawn seed, so failures shrink to small shapes; note() describes each case. Narrow runs (the
`ci` profile, kernels/cases.py) draw the specializing choices (indexer, next_n, block size, k, flags, logits dtype)
as combinations of the operator's presets, and the rest as above.
"""

from __future__ import annotations

import torch
from hypothesis import note
from hypothesis import strategies as st

from flashkern.kernels.cases import preset_pool, seeded, specialization
from flashkern.kernels.indexer.problem import Indexer, causal_ends
from flashkern.reference import indexer as ref

# Drawn indexer shapes: the model's, and a small one (each is a compiled specialization per kernel).
INDEXERS = st.sampled_from([Indexer(32, 128, "fp8"), Indexer(32, 128, "mxfp4"), Indexer(4, 64, "fp8"),
                            Indexer(4, 64, "mxfp4")])
LOGITS_DTYPES = st.sampled_from([torch.float32, torch.float32, torch.bfloat16])  # paged logits may be bf16
VALUE_MODES = ("normal", "ties", "extreme", "nan")


def _logits_dtype(problem) -> torch.dtype:
    return torch.bfloat16 if problem.bf16_logits else torch.float32


def quantized(indexer: Indexer, q_lead: tuple, k_lead: tuple, gen, magnitude: float) -> dict:
    """q, k, k_scale, q_scale and w in the drawn format; some keys all zero (a zero scale row); FP8: some key
    scales negative (the scale multiplies the head sum, after the relu: reference/indexer.py)."""
    h, d = indexer.heads, indexer.dim
    q = torch.randn(*q_lead, h, d, generator=gen) * magnitude
    k = torch.randn(*k_lead, d, generator=gen) * magnitude
    k.view(-1, d)[:: 7] = 0.0
    w = torch.randn(*q_lead, h, generator=gen)
    if indexer.fmt == "fp8":
        (q8, q_fold), (k8, k_scale) = ref.quantize_fp8_rows(q), ref.quantize_fp8_rows(k)
        k_scale.view(-1)[3::5] *= -1
        return dict(q=q8, k=k8, k_scale=k_scale, q_scale=None, w=w * q_fold)
    (qp, q_scale), (kp, k_scale) = ref.quantize_mxfp4(q), ref.quantize_mxfp4(k)
    return dict(q=qp, k=kp, k_scale=k_scale, q_scale=q_scale, w=w)


def _ranges(draw, gen, rows: int, keys: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ks, ke) int32: causal, random, full, or random with every other row empty."""
    kind = draw(st.sampled_from(["causal", "random", "full", "empty_rows"]))
    if kind == "causal":
        ks, ke = torch.zeros(rows, dtype=torch.long), causal_ends(rows, keys)
    elif kind == "full":
        ks, ke = torch.zeros(rows, dtype=torch.long), torch.full((rows,), keys)
    else:
        a, b = torch.randint(0, keys + 1, (2, rows), generator=gen)
        ks, ke = torch.minimum(a, b), torch.maximum(a, b)
        if kind == "empty_rows":
            ke[::2] = ks[::2]
    note(f"ranges={kind}")
    return ks.int(), ke.int()


def selection_values(gen, rows: int, positions: int, mode: str) -> torch.Tensor:
    """Logits to select from, in a value mode (VALUE_MODES): indexer-like (relu, many zeros), few distinct values,
    +-inf / +-3e38 / 0 with -0 rows, or NaN and -inf."""
    values = torch.randn(rows, positions, generator=gen).relu() * 3
    if mode == "ties":  # few distinct values: many exact repeats straddle the k-th
        values = torch.randint(-3, 3, (rows, positions), generator=gen).float()
    elif mode == "extreme":
        pick = torch.randint(0, 5, (rows, positions), generator=gen)
        special = torch.tensor([torch.inf, -torch.inf, 3e38, -3e38, 0.0])
        values = torch.where(torch.rand(rows, positions, generator=gen) < 0.3, special[pick], values)
        values[::3] = -0.0
    elif mode == "nan":
        values[torch.rand(rows, positions, generator=gen) < 0.2] = torch.nan
        values[torch.rand(rows, positions, generator=gen) < 0.2] = -torch.inf
    return values


def candidate_lists(gen, ke: torch.Tensor, n_blocks: int, block: int, keys: int) -> torch.Tensor:
    """Per row: distinct block ids (visible ones mostly, sometimes past ke), random order, -1 padded."""
    total = -(-keys // block)
    blocks = torch.full((len(ke), n_blocks), -1, dtype=torch.int32)
    for m in range(len(ke)):
        chosen = torch.randperm(total, generator=gen)[: int(torch.randint(0, n_blocks + 1, (1,), generator=gen))]
        blocks[m, : len(chosen)] = chosen.int()
        blocks[m] = blocks[m, torch.randperm(n_blocks, generator=gen)]
    return blocks


@st.composite
def logits_cases(draw):
    """mqa_logits inputs (the default strategy of the operator: `flashkern check mqa_logits`)."""
    indexer, logits_dtype = specialization(draw, st.tuples(INDEXERS, LOGITS_DTYPES), preset_pool(
        "mqa_logits", lambda p: (p.indexer, _logits_dtype(p))))
    rows = draw(st.one_of(st.integers(1, 8), st.integers(9, 70)))
    keys = draw(st.one_of(st.integers(1, 40), st.integers(41, 700)))
    gen = seeded(draw)
    inputs = quantized(indexer, (rows,), (keys,), gen, draw(st.sampled_from([1.0, 1e-3, 300.0])))
    inputs["ks"], inputs["ke"] = _ranges(draw, gen, rows, keys)
    inputs["logits_dtype"] = logits_dtype
    note(f"{indexer} rows={rows} keys={keys} {inputs['logits_dtype']}")
    return inputs


@st.composite
def paged_cases(draw):
    """paged_mqa_logits inputs (the default strategy of the operator: `flashkern check paged_mqa_logits`)."""
    indexer, next_n, block_size, lens_2d, logits_dtype = specialization(
        draw, st.tuples(INDEXERS, st.sampled_from([1, 2, 6]), st.sampled_from([16, 64]), st.booleans(), LOGITS_DTYPES),
        preset_pool("paged_mqa_logits", lambda p: (p.indexer, p.next_n, p.block_size, p.lens_2d, _logits_dtype(p))))
    batch, max_blocks = draw(st.integers(1, 5)), draw(st.integers(1, 6))
    gen = seeded(draw)
    cache_blocks = batch * max_blocks + draw(st.integers(0, 3))
    inputs = quantized(indexer, (batch, next_n), (cache_blocks, block_size), gen, 1.0)
    inputs["k_cache"] = inputs.pop("k")
    inputs["w"] = inputs["w"].flatten(0, 1)
    lens = torch.randint(0, max_blocks * block_size + 1, (batch,), generator=gen).int()
    lens[0] = max_blocks * block_size  # one full table
    table = torch.randperm(cache_blocks, generator=gen)[: batch * max_blocks].view(batch, max_blocks).int()
    used = torch.arange(max_blocks) * block_size < lens[:, None].long()
    inputs["block_table"] = torch.where(used, table, -7)  # entries past the context are garbage, never read
    if lens_2d:  # per token [B, next_n]: up to the sequence's length, in any order; one full row
        lens = (torch.rand(batch, next_n, generator=gen) * (lens[:, None] + 1)).int().clamp(max=lens[:, None])
        lens[0, -1] = max_blocks * block_size
    inputs["context_lens"] = lens
    inputs["logits_dtype"] = logits_dtype
    note(f"{indexer} batch={batch} next_n={next_n} block_size={block_size} max_blocks={max_blocks} lens={lens.tolist()} "
         f"{inputs['logits_dtype']}")
    return inputs


@st.composite
def topk_cases(draw, max_positions: int = 3000):
    """topk_indices inputs (the default strategy of the operator: `flashkern check topk_indices`)."""
    k, has_starts, by_score, dtype = specialization(
        draw, st.tuples(st.sampled_from([1, 7, 64, 512, 2048]), st.booleans(), st.booleans(), LOGITS_DTYPES),
        preset_pool("topk_indices", lambda p: (p.k, p.has_starts, p.by_score, _logits_dtype(p))))
    rows = draw(st.integers(1, 24))
    positions = draw(st.one_of(st.integers(1, 40), st.integers(41, max_positions)))
    mode = draw(st.sampled_from(VALUE_MODES))
    gen = seeded(draw)
    ends = torch.randint(0, positions + 1, (rows,), generator=gen).int()
    ends[0] = positions
    starts = (torch.rand(rows, generator=gen) * (ends + 1)).int().clamp(max=ends) if has_starts else None
    note(f"rows={rows} positions={positions} k={k} mode={mode} starts={starts is not None} sorted={by_score} {dtype}")
    return dict(logits=selection_values(gen, rows, positions, mode).to(dtype), ends=ends, k=k, starts=starts,
                sorted=by_score)


@st.composite
def candidate_cases(draw):
    """candidate_blocks inputs (the default strategy of the operator: `flashkern check candidate_blocks`)."""
    n_blocks, block, dtype = specialization(
        draw, st.tuples(st.sampled_from([1, 5, 64, 2048]), st.sampled_from([8, 4]), LOGITS_DTYPES),
        preset_pool("candidate_blocks", lambda p: (p.n_blocks, p.block, _logits_dtype(p))))
    rows = draw(st.integers(1, 16))
    positions = draw(st.one_of(st.integers(1, 40), st.integers(41, 4000)))
    mode = draw(st.sampled_from(VALUE_MODES))
    gen = seeded(draw)
    row_end = torch.randint(0, positions + 1, (rows,), generator=gen).int()
    row_end[0] = positions
    note(f"rows={rows} positions={positions} n_blocks={n_blocks} block={block} mode={mode} {dtype}")
    return dict(logits=selection_values(gen, rows, positions, mode).to(dtype), row_end=row_end, n_blocks=n_blocks,
                block=block)


MAX_SPARSE_N_BLOCKS = 40  # candidate lists per row drawn for sparse_mqa_logits (presets' longer lists are cut to it)


@st.composite
def sparse_cases(draw):
    """sparse_mqa_logits inputs (the default strategy of the operator: `flashkern check sparse_mqa_logits`)."""
    indexer, block, n_blocks, top_k = specialization(
        draw, st.tuples(INDEXERS, st.sampled_from([8, 4]), st.integers(1, MAX_SPARSE_N_BLOCKS),
                        st.sampled_from([1, 16, 64, 512])),
        preset_pool("sparse_mqa_logits", lambda p: (p.indexer, p.block, min(p.n_blocks, MAX_SPARSE_N_BLOCKS), p.top_k)))
    rows, keys = draw(st.integers(1, 12)), draw(st.one_of(st.integers(1, 40), st.integers(41, 600)))
    gen = seeded(draw)
    inputs = quantized(indexer, (rows,), (keys,), gen, 1.0)
    inputs["ks"], inputs["ke"] = _ranges(draw, gen, rows, keys)
    inputs.update(blocks=candidate_lists(gen, inputs["ke"], n_blocks, block, keys), top_k=top_k, block=block)
    note(f"{indexer} rows={rows} keys={keys} block={block} n_blocks={n_blocks} top_k={top_k}")
    return inputs
