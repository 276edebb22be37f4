"""Sparse MQA scoring (the indexer) and top-k selection (docs/operators.md sections 2, 3): operator records.

  mqa_logits         dense ragged scoring: q [M, H, D], keys [N, D] -> logits [M, N] fp32 or bf16
  paged_mqa_logits   decode scoring over a paged key cache (two tensors, or DeepGEMM's fused pages), context
                     lengths per sequence or per token, next_n 1 to 8 -> logits [B * next_n, max_blocks * block_size]
  topk_indices       top-k positions per row of a logits matrix -> int32 [M, k]
  candidate_blocks   V4.1 first level: the best n_blocks blocks of 8 positions -> int32 [M, n_blocks]
  sparse_mqa_logits  V4.1 second level: scoring inside candidate blocks, top_k absolute positions

Storage forms: FP8 (e4m3 with a fp32 scale per key) and MXFP4 (packed e2m1 with ue8m0 scales per
32 values, as bytes or DeepGEMM's packed int32 words). The math, formats and selection rule are in
flashkern.reference.indexer; DeepGEMM's call signatures are in flashkern.compat.deep_gemm. The hypothesis
strategies of inputs, for the tests and `flashkern check`, are in cases.py.
"""

from __future__ import annotations

import torch
from torch import Tensor

from flashkern import checks
from flashkern.dispatch import call
from flashkern.kernels._tilelang import TileLangKernel
from flashkern.kernels._triton import TritonKernel
from flashkern.kernels.indexer import cases, tilelang_logits, tilelang_topk, triton_logits, triton_topk
from flashkern.kernels.indexer.problem import (V41_INDEXER, CandidateProblem, Indexer, LogitsProblem,
                                               PagedProblem, SparseProblem, TopkProblem, causal_ends, kept_per_span,
                                               kept_width, span_slots)
from flashkern.reference import indexer as ref
from flashkern.registry import Cost, Implementation, Operator

__all__ = ["CandidateProblem", "Indexer", "LogitsProblem", "PagedProblem", "SparseProblem", "TopkProblem",
           "V41_INDEXER", "check_logits_result", "check_topk_result", "OPERATORS"]

# ---------------------------------------------------------------- argument checks

LOGITS_DTYPES = (torch.float32, torch.bfloat16)  # of logits the scoring ops write and the selection ops read
MAX_NEXT_N = 8  # query tokens per sequence in decode (MTP)


def _scale_width(value, blocks: int) -> int:
    """Stored width of a ue8m0 scale argument: `blocks` bytes, or ceil(blocks / 4) packed int32 words."""
    return -(-blocks // 4) if isinstance(value, torch.Tensor) and value.dtype == torch.int32 else blocks


def kernel_views(inputs: dict) -> None:
    """Replace the zero-copy forms the entry points accept by the views the kernels and the reference take:
    DeepGEMM's fused paged cache (k_cache with k_scale None) by its data and scale views (ref.fused_cache_views,
    which also checks the cache's strides and alignment), packed int32 ue8m0 scales by their bytes."""
    fp4 = inputs["q"].dtype == torch.uint8
    if "k_cache" in inputs and inputs["k_scale"] is None:
        inputs["k_cache"], inputs["k_scale"] = ref.fused_cache_views(inputs["k_cache"], fp4=fp4)
    if fp4:
        blocks = 2 * inputs["q"].shape[-1] // ref.MX_BLOCK
        for name in ("k_scale", "q_scale"):
            if inputs[name].dtype == torch.int32:
                inputs[name] = ref.ue8m0_bytes(inputs[name], blocks)


def _check_keys(inputs: dict, k_name: str, k_lead: tuple, indexer: Indexer, device) -> None:
    """k (or k_cache) and k_scale in the separate form: e4m3 keys with fp32 scales, or packed e2m1 with ue8m0 scales."""
    if indexer.fmt == "fp8":
        k = checks.tensor(k_name, inputs[k_name], dtype=torch.float8_e4m3fn, shape=(*k_lead, indexer.dim),
                          device=device, strided=True)
        checks.tensor("k_scale", inputs["k_scale"], dtype=torch.float32, shape=k.shape[:-1], device=device,
                      strided=len(k_lead) > 1)  # per key: 1-D (contiguous) for a flat key table
        return
    k = checks.tensor(k_name, inputs[k_name], dtype=torch.uint8, shape=(*k_lead, indexer.dim // 2), device=device,
                      strided=True)
    scale = inputs["k_scale"]
    checks.tensor("k_scale", scale, dtype=(torch.uint8, torch.int32),
                  shape=(*k.shape[:-1], _scale_width(scale, indexer.dim // ref.MX_BLOCK)), device=device, strided=True)


def _check_qk(inputs: dict, q_lead: tuple, k_lead: tuple, k_name: str = "k") -> tuple[Indexer, torch.device]:
    """Storage format, heads and dim from q; k, k_scale and q_scale must agree. Leads: the leading sizes.

    The zero-copy forms (packed int32 ue8m0 scales, a fused paged cache) are checked as given, then replaced in
    `inputs` by their kernel views (kernel_views)."""
    q = inputs["q"]
    checks.tensor("q", q, dtype=(torch.float8_e4m3fn, torch.uint8), shape=(*q_lead, None, None), strided=True)
    device = q.device
    fmt = "fp8" if q.dtype == torch.float8_e4m3fn else "mxfp4"
    heads, stored = q.shape[-2:]
    dim = stored if fmt == "fp8" else 2 * stored
    if heads == 0:
        raise ValueError(f"q must have at least one head, got shape {list(q.shape)}")
    if dim < 32 or dim > 512 or dim & (dim - 1):
        raise ValueError(f"q: head dim {dim} is not supported (a power of two in [32, 512])")
    indexer = Indexer(heads, dim, fmt)
    fused = k_name == "k_cache" and inputs["k_scale"] is None  # DeepGEMM's fused pages
    if fused:
        checks.tensor("k_cache", inputs["k_cache"], dtype=torch.uint8, shape=(None, None, 1, stored + 4),
                      device=device, strided=True)
    else:
        _check_keys(inputs, k_name, k_lead, indexer, device)
    if fmt == "fp8" and inputs["q_scale"] is not None:
        raise ValueError("q_scale is for MXFP4 queries; fold an FP8 query scale into w")
    if fmt == "mxfp4":
        if inputs["q_scale"] is None:
            raise ValueError("q_scale is required for MXFP4 (uint8) queries: ue8m0 scales [..., H, D/32]")
        checks.tensor("q_scale", inputs["q_scale"], dtype=(torch.uint8, torch.int32),
                      shape=(*q.shape[:-2], heads, _scale_width(inputs["q_scale"], dim // ref.MX_BLOCK)),
                      device=device, strided=True)
    kernel_views(inputs)
    if fused:
        _check_keys(inputs, k_name, k_lead, indexer, device)
    return indexer, device


def _check_ragged(inputs: dict, rows: int, heads: int, device) -> None:
    checks.tensor("w", inputs["w"], dtype=torch.float32, shape=(rows, heads), device=device, strided=True)
    checks.tensor("ks", inputs["ks"], dtype=torch.int32, shape=(rows,), device=device)
    checks.tensor("ke", inputs["ke"], dtype=torch.int32, shape=(rows,), device=device)


def _ragged_values(inputs: dict, problem) -> None:
    keys = problem.keys
    checks.values_in("ks", inputs["ks"], 0, keys, why=f"key positions of {keys} keys")
    checks.values_in("ke", inputs["ke"], inputs["ks"], keys, why=f"ks <= ke <= {keys} keys")


def check_mqa_logits(inputs: dict) -> LogitsProblem:
    indexer, device = _check_qk(inputs, (None,), (None,))
    rows, keys = inputs["q"].shape[0], inputs["k"].shape[0]
    _check_ragged(inputs, rows, indexer.heads, device)
    bf16 = _check_logits_dtype(inputs) == torch.bfloat16
    return LogitsProblem(rows, keys, indexer, bf16)


def _check_logits_dtype(inputs: dict) -> torch.dtype:
    return checks.choice("logits_dtype", inputs["logits_dtype"], LOGITS_DTYPES)


def check_paged(inputs: dict) -> PagedProblem:
    indexer, device = _check_qk(inputs, (None, None), (None, None), k_name="k_cache")
    batch, next_n = inputs["q"].shape[:2]
    block_size = inputs["k_cache"].shape[1]
    if not 1 <= next_n <= MAX_NEXT_N:
        raise ValueError(f"q must hold 1 to {MAX_NEXT_N} query tokens per sequence (next_n), got {next_n}")
    if block_size == 0:
        raise ValueError("k_cache must have a nonzero block size")
    checks.tensor("w", inputs["w"], dtype=torch.float32, shape=(batch * next_n, indexer.heads), device=device,
                  strided=True)
    table = checks.tensor("block_table", inputs["block_table"], dtype=torch.int32, shape=(batch, None), device=device,
                          strided=True)
    lens = inputs["context_lens"]
    lens_2d = isinstance(lens, torch.Tensor) and lens.dim() == 2  # per token [B, next_n], else per sequence [B]
    checks.tensor("context_lens", lens, dtype=torch.int32, shape=(batch, next_n) if lens_2d else (batch,),
                  device=device)
    bf16 = _check_logits_dtype(inputs) == torch.bfloat16
    return PagedProblem(batch, table.shape[1], next_n, block_size, indexer, lens_2d, bf16)


def _paged_values(inputs: dict, problem: PagedProblem) -> None:
    lens, table = inputs["context_lens"], inputs["block_table"]
    cache_blocks = inputs["k_cache"].shape[0]
    checks.values_in("context_lens", lens, 0, problem.width, why=f"the block table addresses {problem.width} positions")
    seen = lens.amax(dim=1) if problem.lens_2d else lens  # positions read per sequence
    used = torch.arange(problem.max_blocks, device=table.device) * problem.block_size < seen[:, None]
    checks.values_in("block_table", torch.where(used, table, 0), 0, cache_blocks - 1,
                     why=f"cache block ids of {cache_blocks} blocks, for blocks within context_lens")


def _check_k(k, *, name: str = "k") -> int:
    return checks.integer(name, k, low=1, high=1 << 16)


def check_topk(inputs: dict) -> TopkProblem:
    logits = checks.tensor("logits", inputs["logits"], dtype=LOGITS_DTYPES, shape=(None, None), strided=True)
    rows, positions = logits.shape
    k = _check_k(inputs["k"])
    checks.tensor("ends", inputs["ends"], dtype=torch.int32, shape=(rows,), device=logits.device)
    starts = checks.optional_tensor("starts", inputs["starts"], dtype=torch.int32, shape=(rows,), device=logits.device)
    by_score = checks.flag("sorted", inputs["sorted"])
    return TopkProblem(rows, positions, k, starts is not None, by_score, logits.dtype == torch.bfloat16)


def _topk_values(inputs: dict, problem: TopkProblem) -> None:
    positions = problem.positions
    checks.values_in("ends", inputs["ends"], 0, positions, why=f"logits has {positions} positions")
    if inputs["starts"] is not None:
        checks.values_in("starts", inputs["starts"], 0, inputs["ends"], why="0 <= starts <= ends")


def check_candidates(inputs: dict) -> CandidateProblem:
    logits = checks.tensor("logits", inputs["logits"], dtype=LOGITS_DTYPES, shape=(None, None), strided=True)
    rows, positions = logits.shape
    checks.tensor("row_end", inputs["row_end"], dtype=torch.int32, shape=(rows,), device=logits.device)
    n_blocks = _check_k(inputs["n_blocks"], name="n_blocks")
    block = checks.integer("block", inputs["block"], low=1, high=256)
    return CandidateProblem(rows, positions, n_blocks, block, logits.dtype == torch.bfloat16)


def _candidate_values(inputs: dict, problem: CandidateProblem) -> None:
    positions = problem.positions
    checks.values_in("row_end", inputs["row_end"], 0, positions, why=f"logits has {positions} positions")


def check_sparse(inputs: dict) -> SparseProblem:
    indexer, device = _check_qk(inputs, (None,), (None,))
    rows, keys = inputs["q"].shape[0], inputs["k"].shape[0]
    _check_ragged(inputs, rows, indexer.heads, device)
    block = checks.integer("block", inputs["block"], low=1, high=256)
    top_k = _check_k(inputs["top_k"], name="top_k")
    blocks = checks.tensor("blocks", inputs["blocks"], dtype=torch.int32, shape=(rows, None), device=device,
                           strided=True)
    if blocks.shape[1] == 0:
        raise ValueError("blocks must list at least one candidate block per row")
    return SparseProblem(rows, keys, blocks.shape[1], block, top_k, indexer)


def _sparse_values(inputs: dict, problem: SparseProblem) -> None:
    _ragged_values(inputs, problem)
    keys, block = problem.keys, problem.block
    last = max(-(-keys // block) - 1, -1)
    checks.values_in("blocks", inputs["blocks"], 0, last, why=f"block ids of {keys} keys in blocks of {block}",
                     allow=-1)


# ---------------------------------------------------------------- outputs (uninitialized; the kernels write every element)


def _logits_output(rows: int, width: int, problem, device) -> torch.Tensor:
    return torch.empty((rows, width), dtype=_logits_dtype(problem.bf16_logits), device=device)


def _index_output(rows: int, width: int, device) -> torch.Tensor:
    return torch.empty((rows, width), dtype=torch.int32, device=device)


def logits_outputs(problem: LogitsProblem, inputs: dict, device) -> torch.Tensor:
    return _logits_output(problem.rows, problem.keys, problem, device)


def paged_outputs(problem: PagedProblem, inputs: dict, device) -> torch.Tensor:
    return _logits_output(problem.batch * problem.next_n, problem.width, problem, device)


def topk_outputs(problem: TopkProblem, inputs: dict, device) -> torch.Tensor:
    return _index_output(problem.rows, problem.k, device)


def candidate_outputs(problem: CandidateProblem, inputs: dict, device) -> torch.Tensor:
    return _index_output(problem.rows, problem.n_blocks, device)


def sparse_outputs(problem: SparseProblem, inputs: dict, device) -> torch.Tensor:
    return _index_output(problem.rows, problem.top_k, device)


# ---------------------------------------------------------------- realistic inputs


def _queries_keys(indexer: Indexer, q_lead: tuple, k_lead: tuple, gen: torch.Generator) -> tuple[dict, torch.Tensor]:
    """Quantized q and k from N(0, 1) values, and w ~ N(0, 1/(H*D)) with the FP8 query scale folded in."""
    h, d = indexer.heads, indexer.dim
    q = torch.randn(*q_lead, h, d, generator=gen)
    k = torch.randn(*k_lead, d, generator=gen)
    w = torch.randn(*q_lead, h, generator=gen) / (h * d) ** 0.5
    if indexer.fmt == "fp8":
        q8, q_fold = ref.quantize_fp8_rows(q)
        k8, k_scale = ref.quantize_fp8_rows(k)
        return dict(q=q8, k=k8, k_scale=k_scale, q_scale=None), w * q_fold
    (qp, q_scale), (kp, k_scale) = ref.quantize_mxfp4(q), ref.quantize_mxfp4(k)
    return dict(q=qp, k=kp, k_scale=k_scale, q_scale=q_scale), w


def _to(inputs: dict, device) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def make_logits_inputs(problem: LogitsProblem, device="cpu", seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    qk, w = _queries_keys(problem.indexer, (problem.rows,), (problem.keys,), gen)
    ke = causal_ends(problem.rows, problem.keys)
    return _to(dict(**qk, w=w, ks=torch.zeros_like(ke), ke=ke, logits_dtype=_logits_dtype(problem.bf16_logits)),
               device)


def make_paged_inputs(problem: PagedProblem, device="cpu", seed: int = 0) -> dict:
    """Full contexts but for a few short ones; each sequence's blocks scattered over a shared cache with spares.
    Per-token lengths (lens_2d) as DeepGEMM's tests draw them: random below the sequence's, the last token's equal."""
    gen = torch.Generator().manual_seed(seed)
    b, nb, bs = problem.batch, problem.max_blocks, problem.block_size
    cache_blocks = b * nb + 3
    qk, w = _queries_keys(problem.indexer, (b, problem.next_n), (cache_blocks, bs), gen)
    qk["k_cache"] = qk.pop("k")
    table = torch.randperm(cache_blocks, generator=gen)[: b * nb].view(b, nb).int()
    lens = torch.full((b,), problem.width, dtype=torch.int32)
    lens[1::3] = (problem.width * 2 // 3) + 1  # a ragged tail block
    lens = lens.clamp(min=problem.next_n)
    if problem.lens_2d:
        lens = torch.cat(((torch.rand(b, problem.next_n - 1, generator=gen) * (lens[:, None] + 1)).int(),
                          lens[:, None]), dim=1)
    return _to(dict(**qk, w=w.flatten(0, 1), block_table=table, context_lens=lens,
                    logits_dtype=_logits_dtype(problem.bf16_logits)), device)


def _logits_like(rows: int, positions: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Indexer-like logits (relu sums: non-negative, many near zero) and causal ends, -inf past the end."""
    ends = causal_ends(rows, positions)
    logits = torch.randn(rows, positions, generator=gen).relu() * 3
    logits = logits.masked_fill(torch.arange(positions) >= ends[:, None], -torch.inf)
    return logits, ends


def _logits_dtype(bf16_logits: bool) -> torch.dtype:
    return torch.bfloat16 if bf16_logits else torch.float32


def make_topk_inputs(problem: TopkProblem, device="cpu", seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    logits, ends = _logits_like(problem.rows, problem.positions, gen)
    starts = (ends // 4).int() if problem.has_starts else None
    return _to(dict(logits=logits.to(_logits_dtype(problem.bf16_logits)), ends=ends, k=problem.k, starts=starts,
                    sorted=problem.by_score), device)


def make_candidate_inputs(problem: CandidateProblem, device="cpu", seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    logits, ends = _logits_like(problem.rows, problem.positions, gen)
    return _to(dict(logits=logits.to(_logits_dtype(problem.bf16_logits)), row_end=ends, n_blocks=problem.n_blocks,
                    block=problem.block), device)


def make_sparse_inputs(problem: SparseProblem, device="cpu", seed: int = 0) -> dict:
    """Causal rows; each row's candidates: its newest block and random other visible blocks, ascending, -1 padded."""
    gen = torch.Generator().manual_seed(seed)
    qk, w = _queries_keys(problem.indexer, (problem.rows,), (problem.keys,), gen)
    ke = causal_ends(problem.rows, problem.keys)
    blocks = torch.full((problem.rows, problem.n_blocks), -1, dtype=torch.int32)
    for m, end in enumerate(ke.tolist()):
        visible = -(-end // problem.block)
        if visible:
            others = torch.randperm(visible - 1, generator=gen)[: problem.n_blocks - 1]
            chosen = torch.cat((others, torch.tensor([visible - 1]))).sort().values
            blocks[m, : len(chosen)] = chosen.int()
    return _to(dict(**qk, w=w, ks=torch.zeros_like(ke), ke=ke, blocks=blocks, top_k=problem.top_k,
                    block=problem.block), device)


# ---------------------------------------------------------------- oracles


def similarity_diff(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per row, 1 - 2 * sum(x * y) / sum(x^2 + y^2) over the entries where both are finite (0 for empty rows)."""
    finite = torch.isfinite(x) & torch.isfinite(y)
    x, y = torch.where(finite, x.double(), 0.0), torch.where(finite, y.double(), 0.0)
    denominator = (x * x + y * y).sum(dim=-1)
    return torch.where(denominator > 0, 1 - 2 * (x * y).sum(dim=-1) / denominator.clamp(min=1e-300), 0.0)


def _first(bad: torch.Tensor) -> list:
    """Up to 8 offending rows (a [rows] mask) or entries (a [rows, n] mask), for error messages."""
    return torch.nonzero(bad).flatten().tolist()[:8] if bad.dim() == 1 else torch.nonzero(bad)[:8].tolist()


def check_logits_result(expected: torch.Tensor, actual: torch.Tensor, max_diff: float = 5e-6,
                        atol_of_row: float = 1e-4) -> None:
    """Indexer logits agree: the same dtype and shape, identical -inf masks, no NaN where the reference has none,
    per-row similarity diff < max_diff (docs/operators.md section 2), and each entry within atol_of_row x the row's
    largest magnitude."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, (actual.dtype, actual.shape)
    expected, actual = expected.cpu().float(), actual.cpu().float()
    mask_differs = (expected == -torch.inf) != (actual == -torch.inf)
    assert not mask_differs.any(), f"-inf masks differ at {_first(mask_differs)}"
    new_nan = torch.isnan(actual) & ~torch.isnan(expected)
    assert not new_nan.any(), f"NaN where the reference is a number at {_first(new_nan)}"
    diff = similarity_diff(expected, actual)
    bad = diff >= max_diff
    assert not bad.any(), f"rows {_first(bad)}: similarity diff {diff[bad][:4].tolist()} >= {max_diff}"
    finite = torch.isfinite(expected)
    scale = torch.where(finite, expected.abs(), 0.0).amax(dim=-1, keepdim=True).clamp(min=1e-30)
    err = torch.where(finite, (actual - expected).abs() / scale, 0.0)
    bad = err > atol_of_row
    assert not bad.any(), f"entries {_first(bad)} off by up to {err.max().item():.3g} of their row's scale"


def check_topk_result(values: torch.Tensor, eligible: torch.Tensor, k: int, out: torch.Tensor,
                      tol: float = 0.0) -> None:
    """Property oracle of a top-k result (docs/operators.md section 3): the valid prefix has length
    min(#eligible, k), then -1; indices are eligible and unique; min(selected) >= max(unselected eligible) in the
    rule's order (NaN lowest), up to `tol` x the row's largest finite magnitude (for scores a kernel recomputes)."""
    rows = values.shape[0]
    assert out.dtype == torch.int32 and out.shape == (rows, k), (out.dtype, out.shape)
    values, eligible, out = values.cpu(), eligible.cpu(), out.cpu().long()
    count = eligible.sum(dim=1).clamp(max=k)
    layout = torch.where(torch.arange(k) < count[:, None], out >= 0, out == -1).all(dim=1)
    assert layout.all(), f"rows {_first(~layout)}: the valid prefix is not min(#eligible, k) long, then -1"
    chosen, taken = out.clamp(min=0), out >= 0
    in_range = torch.where(taken, out < values.shape[1], True).all(dim=1)
    assert in_range.all(), f"indices out of range in rows {_first(~in_range)}"
    allowed = torch.where(taken, eligible.gather(1, chosen), True).all(dim=1)
    assert allowed.all(), f"ineligible positions chosen in rows {_first(~allowed)}"
    hits = torch.zeros(eligible.shape, dtype=torch.long).scatter_add_(1, chosen, taken.long())
    repeated = (hits > 1).any(dim=1)
    assert not repeated.any(), f"repeated indices in rows {_first(repeated)}"
    selected = hits > 0
    key = ref.order_keys(values)
    if tol:  # a kernel ranked its own rounding of these values: selected ones get a margin of tol x the row scale
        scale = torch.where(torch.isfinite(values), values.abs(), 0.0).amax(dim=1, keepdim=True)
        key = torch.where(selected, ref.order_keys(values + tol * scale), key)
    lowest_selected = torch.where(selected, key, torch.iinfo(torch.int64).max).amin(dim=1)
    best_other = torch.where(eligible & ~selected, key, torch.iinfo(torch.int64).min).amax(dim=1)
    beaten = lowest_selected < best_other
    assert not beaten.any(), f"rows {_first(beaten)}: an unselected value beats a selected one"


BF16_LOGITS_DIFF = 3e-5  # DeepGEMM's similarity bound for bf16 logits
BF16_ULP = 2**-7  # of a value's magnitude, at most: two roundings of nearby fp32 logits differ by up to one


# Hopper's FP8 tensor cores sum a dot product in a narrower accumulator than fp32 (about 14 bits: DeepSeek-V3
# report, section 3.3.2; Triton's and TileLang's FP8 MMAs on sm_90 do not promote within a 128-wide dot): on an
# H200 both DSLs' FP8 scores sat up to 4.3e-4 of their row's largest score from the fp32 reference (the same
# entries on both), where every CPU path is exact to 1e-4.
FP8_MMA_ERROR_OF_ROW = 2e-3


def score_error_of_row(inputs: dict, exact: float) -> float:
    """How far (x its row's largest magnitude) a kernel's score may sit from the reference: FP8 queries on a GPU
    FP8_MMA_ERROR_OF_ROW, else `exact` (the CPU paths, and MXFP4, whose values reach the MMA as bf16)."""
    q = inputs["q"]
    return FP8_MMA_ERROR_OF_ROW if q.is_cuda and q.dtype == torch.float8_e4m3fn else exact


def compare_logits(inputs: dict, expected, actual) -> None:
    atol_of_row = score_error_of_row(inputs, 1e-4)
    if expected.dtype == torch.bfloat16:
        check_logits_result(expected, actual, max_diff=BF16_LOGITS_DIFF, atol_of_row=atol_of_row + BF16_ULP)
    else:
        check_logits_result(expected, actual, atol_of_row=atol_of_row)


def check_topk_order(values: torch.Tensor, out: torch.Tensor, by_score: bool) -> None:
    """The valid prefix of each row of a top-k result is in ascending position order, or (by_score) in rank order:
    each entry ranks above the next (a larger value, or an equal one at a lower position; NaN lowest)."""
    values, out = values.cpu(), out.cpu().long()
    here, after = out[:, :-1], out[:, 1:]
    pairs = (here >= 0) & (after >= 0)
    if by_score:
        key = ref.order_keys(values)
        key_here, key_after = key.gather(1, here.clamp(min=0)), key.gather(1, after.clamp(min=0))
        in_order = (key_here > key_after) | ((key_here == key_after) & (here < after))
    else:
        in_order = here < after
    wrong = (pairs & ~in_order).any(dim=1)
    assert not wrong.any(), f"rows {_first(wrong)} are not in {'rank' if by_score else 'ascending'} order"


def compare_topk(inputs: dict, expected, actual) -> None:
    logits = inputs["logits"]
    n = torch.arange(logits.shape[1], device=logits.device)
    eligible = n < inputs["ends"][:, None]
    if inputs["starts"] is not None:
        eligible &= n >= inputs["starts"][:, None]
    check_topk_result(logits, eligible, inputs["k"], actual)
    check_topk_order(logits, actual, inputs["sorted"])


def compare_candidates(inputs: dict, expected, actual) -> None:
    """The rule fixes the chosen set (maxima are exact; ties go to the lower block id): equal as sorted rows."""
    assert actual.dtype == torch.int32 and actual.shape == expected.shape, (actual.dtype, actual.shape)
    sort = lambda ids: torch.where(ids < 0, torch.iinfo(torch.int32).max, ids).sort(dim=1).values  # noqa: E731
    differs = (sort(expected.cpu()) != sort(actual.cpu())).any(dim=1)
    assert not differs.any(), f"rows {_first(differs)} choose other blocks"


def compare_sparse(inputs: dict, expected, actual) -> None:
    """Property oracle on the candidate slots, ranked by the reference's scores (kernels round differently)."""
    positions, scores = ref.candidate_scores(**{name: inputs[name] for name in (
        "q", "k", "k_scale", "w", "ks", "ke", "blocks", "block", "q_scale")})
    positions, scores = positions.cpu(), scores.cpu()
    assert actual.dtype == torch.int32 and actual.shape == (positions.shape[0], inputs["top_k"]), actual.shape
    actual = actual.cpu()
    # map absolute positions back to candidate slots (first match; a repeated position is caught as a repeat)
    match = (actual[:, :, None] == positions[:, None, :]) & (actual[:, :, None] >= 0)
    found = match.any(dim=2)
    stray = (actual >= 0) & ~found
    assert not stray.any(), f"rows {_first(stray.any(dim=1))} return positions outside their candidates"
    slots = torch.where(found, match.int().argmax(dim=2), -1).int()
    check_topk_result(scores, scores > -torch.inf, inputs["top_k"], slots, tol=score_error_of_row(inputs, 1e-5))


# ---------------------------------------------------------------- cost


def _key_bytes(indexer: Indexer) -> int:
    """Bytes of one stored key row with its scale: D + 4 (FP8) or D/2 + D/32 (MXFP4: 68 B at D = 128)."""
    return indexer.dim + 4 if indexer.fmt == "fp8" else indexer.dim // 2 + indexer.dim // ref.MX_BLOCK


def _query_bytes(indexer: Indexer) -> int:
    """Bytes of one query row: H key-sized rows (their scale folded into w for FP8) and H fp32 weights."""
    return indexer.heads * (_key_bytes(indexer) - (4 if indexer.fmt == "fp8" else 0) + 4)


def _logit_bytes(p) -> int:
    return 2 if p.bf16_logits else 4


def logits_cost(p: LogitsProblem) -> Cost:
    """Every pair scored (the causal inputs score about half; benchmarks count valid pairs)."""
    return Cost(flops=2 * p.rows * p.keys * p.indexer.heads * p.indexer.dim,
                bytes=p.rows * _query_bytes(p.indexer) + p.keys * _key_bytes(p.indexer)
                + p.rows * (_logit_bytes(p) * p.keys + 8), math="fp8")


def paged_cost(p: PagedProblem) -> Cost:
    """Context lengths: one int32 per sequence, or per token (lens_2d)."""
    queries = p.batch * p.next_n
    lens = queries if p.lens_2d else p.batch
    return Cost(flops=2 * queries * p.width * p.indexer.heads * p.indexer.dim,
                bytes=queries * _query_bytes(p.indexer) + p.batch * p.width * _key_bytes(p.indexer)
                + _logit_bytes(p) * queries * p.width + 4 * (p.batch * p.max_blocks + lens), math="fp8")


def topk_cost(p: TopkProblem) -> Cost:
    """A few compares per value (one radix pass each); the logits read once, indices written once."""
    return Cost(flops=5 * p.rows * p.positions, bytes=4 * p.rows * (p.positions + p.k + 2))


def candidates_cost(p: CandidateProblem) -> Cost:
    return Cost(flops=p.rows * (p.positions + 5 * p.blocks), bytes=4 * p.rows * (p.positions + p.n_blocks + 1))


def sparse_cost(p: SparseProblem) -> Cost:
    return Cost(flops=2 * p.rows * p.candidates * p.indexer.heads * p.indexer.dim + 5 * p.rows * p.candidates,
                bytes=p.rows * (_query_bytes(p.indexer) + p.candidates * _key_bytes(p.indexer)
                                + 4 * (p.n_blocks + p.top_k + 2)), math="fp8")


# ---------------------------------------------------------------- presets

CONTEXTS = (8192, 65536, 524288)  # the 8K / 64K / 512K context presets
MXFP4_INDEXER = Indexer(32, 128, "mxfp4")


def _per_format(make) -> dict:
    return {"v41-flash": make(V41_INDEXER), "v41-flash-mxfp4": make(MXFP4_INDEXER)}


LOGITS_PRESETS = {
    "smoke": (LogitsProblem(5, 300, V41_INDEXER), LogitsProblem(3, 200, MXFP4_INDEXER)),
    **_per_format(lambda ix: tuple(LogitsProblem(rows, n, ix) for n in CONTEXTS for rows in (1, 16))),
}
PAGED_PRESETS = {  # decode: contexts of 8K and 64K positions in 64-position cache blocks (smoke: MTP next_n 6 too)
    "smoke": (PagedProblem(2, 5, 2, 64, V41_INDEXER), PagedProblem(2, 3, 1, 64, MXFP4_INDEXER),
              PagedProblem(2, 3, 6, 64, V41_INDEXER, lens_2d=True, bf16_logits=True)),
    **_per_format(lambda ix: tuple(PagedProblem(b, n // 64, next_n, 64, ix)
                                   for n in CONTEXTS[:2] for b in (1, 8) for next_n in (1, 2))),
}
TOPK_PRESETS = {
    "smoke": (TopkProblem(4, 3000, 512), TopkProblem(3, 2000, 64, by_score=True, bf16_logits=True)),
    "v41-flash": tuple(TopkProblem(rows, n, 512) for n in CONTEXTS for rows in (1, 16)),
    "k2048": tuple(TopkProblem(rows, n, 2048) for n in CONTEXTS for rows in (1, 16)),
}
CANDIDATE_PRESETS = {
    "smoke": (CandidateProblem(3, 2000, 64, 8),),
    "v41-flash": tuple(CandidateProblem(rows, n, 2048, 8) for n in CONTEXTS for rows in (1, 16)),
}
SPARSE_PRESETS = {
    "smoke": (SparseProblem(3, 1000, 32, 8, 64, V41_INDEXER), SparseProblem(2, 700, 16, 8, 32, MXFP4_INDEXER)),
    **_per_format(lambda ix: tuple(SparseProblem(rows, n, 2048, 8, 512, ix) for n in CONTEXTS for rows in (1, 16))),
}


# ---------------------------------------------------------------- sparse: scoring stage, then the top-k stage


def _merge_problem(kept_width: int, problem: SparseProblem) -> TopkProblem:
    """The top-k stage that merges a row's kept candidates (its config depends on their count and top_k only)."""
    return TopkProblem(0, kept_width, problem.top_k)


def _merge_map(problem: SparseProblem, inputs: dict, positions: torch.Tensor | None) -> tuple:
    """(index map, its block) of the merge: the kept positions, or (None: spans keep every slot in place) the
    candidate blocks themselves."""
    return (inputs["blocks"], problem.block) if positions is None else (positions, 1)


def plan_sparse_triton(problem: SparseProblem, inputs: dict, config: dict, out: torch.Tensor):
    """Each span's best candidates (scored and selected in registers), then the top-k stage merges a row's."""
    select, kept, positions, kept_end = triton_logits.plan_sparse_select(problem, inputs, config)
    blocks, block = _merge_map(problem, inputs, positions)
    merge_config = triton_topk.topk_default(_merge_problem(kept.shape[1], problem))
    merge = triton_topk.topk_launch(kept, kept_end, out, merge_config, drop_neg_inf=True, ends_bound_walk=True,
                                    blocks=blocks, block=block)
    return select, merge


def sparse_program_tilelang(problem: SparseProblem, config: dict, fl, aligned: bool):
    """Each span's best candidates (scored into and selected in shared memory), then the top-k stage merges a row's;
    `aligned`: tilelang_logits.sparse_layout."""
    merge_config = tilelang_topk.topk_default(_merge_problem(kept_width(problem, config), problem))
    in_place = kept_per_span(problem, config) == span_slots(config)
    return (tilelang_logits.sparse_select_program(problem, config, fl, aligned),
            tilelang_topk.topk_stage_program(merge_config, fl, drop_neg_inf=True,
                                             map_block=problem.block if in_place else 1))


def sparse_args_tilelang(problem: SparseProblem, inputs: dict, config: dict, fl, out: torch.Tensor):
    select_args, (kept, positions, kept_end) = tilelang_logits.sparse_select_args(problem, inputs, config, fl)
    blocks, _ = _merge_map(problem, inputs, positions)
    merge_args = tilelang_topk.topk_stage_args(kept, kept_end, out, fl, blocks=blocks)
    if select_args is None:  # no keys: nothing scored, every row -1
        out.fill_(-1)
        return None
    return select_args, merge_args


# ---------------------------------------------------------------- entry points and records


def mqa_logits(q: Tensor, k: Tensor, k_scale: Tensor, w: Tensor, ks: Tensor, ke: Tensor, *, q_scale: Tensor | None = None,
               logits_dtype: torch.dtype = torch.float32, backend: str = "auto", config: dict | None = None,
               out: Tensor | None = None) -> Tensor:
    """Dense ragged indexer logits: sum_h w[m, h] * relu(q[m, h] . k[n]) * k_scale[n] for ks[m] <= n < ke[m], else -inf.

    Args (q, k, k_scale, w, q_scale: any strides but a unit last one, except a 1-D k_scale):
        q: [M, H, D] e4m3 (FP8; its per-token scale folded into w) or [M, H, D/2] uint8 (MXFP4 e2m1 pairs).
        k: [N, D] e4m3 or [N, D/2] uint8.
        k_scale: [N] fp32 (FP8) or ue8m0 (MXFP4): [N, D/32] uint8, or DeepGEMM's packed int32 [N, ceil(D/128)].
        w: [M, H] fp32 head weights.  ks, ke: [M] int32 key ranges, 0 <= ks <= ke <= N.
        q_scale: ue8m0 [M, H, D/32] uint8 or int32 [M, H, ceil(D/128)] for MXFP4 queries, else None.
        logits_dtype: torch.float32, or torch.bfloat16 (the fp32 logit rounded to nearest even).
    Returns: logits [M, N] in logits_dtype.
    Out-of-range values (refused only in checked mode, flashkern.checks): any int32 ks, ke is safe; row m scores key n
    iff max(ks[m], 0) <= n < min(ke[m], N) (none when ks >= ke), -inf elsewhere.
    """
    return call(MQA_LOGITS, locals())


def paged_mqa_logits(q: Tensor, k_cache: Tensor, k_scale: Tensor | None, w: Tensor, block_table: Tensor,
                     context_lens: Tensor, *, q_scale: Tensor | None = None, logits_dtype: torch.dtype = torch.float32,
                     backend: str = "auto", config: dict | None = None, out: Tensor | None = None) -> Tensor:
    """Decode indexer logits over a paged key cache: row b * next_n + j sees positions [0, end) of sequence b, with
    end = context_lens[b] - next_n + j + 1 (1-D context_lens) or context_lens[b, j] (2-D).

    Args (q, k_cache, k_scale, w, block_table, q_scale: any strides but a unit last one):
        q: [B, next_n, H, D] e4m3 or [B, next_n, H, D/2] uint8 (next_n 1 to 8).
        k_cache, k_scale: data [blocks, block_size, D] e4m3 or [blocks, block_size, D/2] uint8, and scales
            [blocks, block_size] fp32 or ue8m0 [blocks, block_size, D/32] uint8 / [.., ceil(D/128)] int32;
            or DeepGEMM's fused pages: k_cache uint8 [blocks, block_size, 1, D + 4] (FP8) or [.., D/2 + 4] (MXFP4)
            with k_scale None (the layout is in flashkern.reference.indexer).
        w: [B * next_n, H] fp32.  block_table: [B, max_blocks] int32.  context_lens: [B] or [B, next_n] int32.
        q_scale: [B, next_n, H, D/32] uint8 (or int32 [.., ceil(D/128)]) for MXFP4, else None.
        logits_dtype: torch.float32 or torch.bfloat16.
    Returns: logits [B * next_n, max_blocks * block_size] in logits_dtype, -inf outside each row's visible range.
    Out-of-range values (refused only in checked mode, flashkern.checks): any int32 context_lens is safe, a row's end
    clamped to [0, max_blocks * block_size]; table entries are read only inside a row's visible range, and one
    outside [0, blocks) reads nothing: its block's positions are -inf.
    """
    return call(PAGED_MQA_LOGITS, locals())


def topk_indices(logits: Tensor, ends: Tensor, k: int, *, starts: Tensor | None = None, sorted: bool = False,
                 backend: str = "auto", config: dict | None = None, out: Tensor | None = None) -> Tensor:
    """The k largest positions per row among [starts, ends) (NaN lowest, ties to the lower position).

    Args:
        logits: [M, N] fp32 or bf16, any row stride (unit stride along a row).
        ends, starts: [M] int32 (starts default 0).  k: positions to keep.
        sorted: the chosen positions in rank order (the largest value first, equal values by position) instead of
            ascending position order.
    Returns: int32 [M, k]: the chosen positions, then -1 (min(ends - starts, k) valid).
    Out-of-range values (refused only in checked mode, flashkern.checks): any int32 ends, starts is safe; position n
    is eligible iff max(starts, 0) <= n < min(ends, N) (none when starts >= ends).
    """
    return call(TOPK_INDICES, locals())


def candidate_blocks(logits: Tensor, row_end: Tensor, n_blocks: int = 2048, block: int = 8, *, backend: str = "auto",
                     config: dict | None = None, out: Tensor | None = None) -> Tensor:
    """V4.1 first level: the n_blocks best blocks of `block` positions per row (block score = max over its positions
    below row_end; the newest block is always kept; ties to the lower block id).

    Args: logits [M, N] fp32 or bf16, any row stride (unit stride along a row); row_end [M] int32.
    Returns: int32 [M, n_blocks] block ids in ascending order, then -1 (for blocks scoring -inf).
    Out-of-range values (refused only in checked mode, flashkern.checks): any int32 row_end is safe, clamped to [0, N]
    (the kept newest block holds min(row_end, N) - 1; none when row_end <= 0).
    """
    return call(CANDIDATE_BLOCKS, locals())


def sparse_mqa_logits(q: Tensor, k: Tensor, k_scale: Tensor, w: Tensor, ks: Tensor, ke: Tensor, blocks: Tensor, *,
                      top_k: int = 512, block: int = 8, q_scale: Tensor | None = None, backend: str = "auto",
                      config: dict | None = None, out: Tensor | None = None) -> Tensor:
    """V4.1 second level: score only positions inside each row's candidate blocks (and [ks, ke)), keep the top_k.

    Args: q, k, k_scale, w, ks, ke, q_scale as mqa_logits; blocks: [M, n_blocks] int32 candidate block ids
    (-1 = none), e.g. from candidate_blocks; block: positions per block.
    Returns: int32 [M, top_k] absolute positions (in candidate order), then -1.
    Out-of-range values (refused only in checked mode, flashkern.checks): ks, ke as mqa_logits; a block id outside
    [0, ceil(N / block)) counts as -1 (its slots score -inf); no key outside [0, N) is read.
    """
    return call(SPARSE_MQA_LOGITS, locals())


MQA_LOGITS = Operator(
    name="mqa_logits",
    summary="indexer logits, dense ragged (FP8 or MXFP4 keys)",
    entry=mqa_logits,
    reference=ref.mqa_logits,
    implementations=(
        Implementation("triton", TritonKernel(triton_logits.plan_mqa_logits), triton_logits.LOGITS_SPACE,
                       triton_logits.logits_default),
        Implementation("tilelang", TileLangKernel(tilelang_logits.logits_program, tilelang_logits.logits_args),
                       tilelang_logits.LOGITS_SPACE, tilelang_logits.logits_default),
    ),
    check=check_mqa_logits,
    outputs=logits_outputs,
    check_values=_ragged_values,
    prepare=kernel_views,
    make_inputs=make_logits_inputs,
    cases=cases.logits_cases,
    compare=compare_logits,
    cost=logits_cost,
    presets=LOGITS_PRESETS,
)

PAGED_MQA_LOGITS = Operator(
    name="paged_mqa_logits",
    summary="indexer logits for decode over a paged key cache (next_n 1 to 8)",
    entry=paged_mqa_logits,
    reference=ref.paged_mqa_logits,
    implementations=(
        Implementation("triton", TritonKernel(triton_logits.plan_paged_mqa_logits), triton_logits.PAGED_SPACE,
                       triton_logits.paged_default),
        Implementation("tilelang", TileLangKernel(tilelang_logits.paged_program, tilelang_logits.paged_args),
                       tilelang_logits.PAGED_SPACE, tilelang_logits.paged_default),
    ),
    check=check_paged,
    outputs=paged_outputs,
    check_values=_paged_values,
    prepare=kernel_views,
    make_inputs=make_paged_inputs,
    cases=cases.paged_cases,
    compare=compare_logits,
    cost=paged_cost,
    presets=PAGED_PRESETS,
)

TOPK_INDICES = Operator(
    name="topk_indices",
    summary="top-k positions per row over [start, end), -1 padded",
    entry=topk_indices,
    reference=ref.topk_indices,
    implementations=(
        Implementation("triton", TritonKernel(triton_topk.plan_topk), triton_topk.TOPK_SPACE, triton_topk.topk_default),
        Implementation("tilelang", TileLangKernel(tilelang_topk.topk_program, tilelang_topk.topk_args),
                       tilelang_topk.TOPK_SPACE, tilelang_topk.topk_default),
    ),
    check=check_topk,
    outputs=topk_outputs,
    check_values=_topk_values,
    make_inputs=make_topk_inputs,
    cases=cases.topk_cases,
    compare=compare_topk,
    cost=topk_cost,
    presets=TOPK_PRESETS,
)

CANDIDATE_BLOCKS = Operator(
    name="candidate_blocks",
    summary="V4.1 first level: top blocks by block maximum, newest block pinned",
    entry=candidate_blocks,
    reference=ref.candidate_blocks,
    implementations=(
        Implementation("triton", TritonKernel(triton_topk.plan_candidate_blocks), triton_topk.BLOCKS_SPACE,
                       triton_topk.blocks_default),
        Implementation("tilelang", TileLangKernel(tilelang_topk.blocks_program, tilelang_topk.blocks_args),
                       tilelang_topk.BLOCKS_SPACE, tilelang_topk.blocks_default),
    ),
    check=check_candidates,
    outputs=candidate_outputs,
    check_values=_candidate_values,
    make_inputs=make_candidate_inputs,
    cases=cases.candidate_cases,
    compare=compare_candidates,
    cost=candidates_cost,
    presets=CANDIDATE_PRESETS,
)

SPARSE_MQA_LOGITS = Operator(
    name="sparse_mqa_logits",
    summary="V4.1 second level: scoring inside candidate blocks, top-k absolute positions",
    entry=sparse_mqa_logits,
    reference=ref.sparse_mqa_logits,
    implementations=(
        Implementation("triton", TritonKernel(plan_sparse_triton), triton_logits.SPARSE_SPACE,
                       triton_logits.sparse_default),
        Implementation("tilelang", TileLangKernel(sparse_program_tilelang, sparse_args_tilelang,
                                                  layout=tilelang_logits.sparse_layout),
                       tilelang_logits.SPARSE_SPACE, tilelang_logits.sparse_default),
    ),
    check=check_sparse,
    outputs=sparse_outputs,
    check_values=_sparse_values,
    prepare=kernel_views,
    make_inputs=make_sparse_inputs,
    cases=cases.sparse_cases,
    compare=compare_sparse,
    cost=sparse_cost,
    presets=SPARSE_PRESETS,
)

OPERATORS = (MQA_LOGITS, PAGED_MQA_LOGITS, TOPK_INDICES, CANDIDATE_BLOCKS, SPARSE_MQA_LOGITS)
