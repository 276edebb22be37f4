"""KV-cache records and sparse decode attention (docs/operators.md section 8): operator records.

  quantize_kv               latent [N, 512] bf16 -> records [N, 288 (fp4) or 528 (mxfp8)] uint8
  dequantize_kv             records -> fp32 [N, 512]
  kv_cache_insert           quantize new tokens and write them at their slots of a paged cache, in place
  sparse_decode_attention   q [T, H, 512] over top-k slots of the FP4 cache and the window of the MXFP8 cache
                            -> AttentionOutputs(out [T, H, 512] bf16, lse [T, H] fp32)
The math is in flashkern.reference.kv_cache; the strategies the tests and `flashkern check` draw inputs from in
flashkern.kernels.kv_cache.cases.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import Tensor

from flashkern import checks
from flashkern.dispatch import call
from flashkern.kernels._tilelang import TileLangKernel
from flashkern.kernels._triton import TritonKernel
from flashkern.kernels.compare import assert_within
from flashkern.kernels.kv_cache import tilelang_attention, tilelang_records, triton_attention, triton_records
from flashkern.kernels.kv_cache.cases import attention_cases, codec_cases
from flashkern.kernels.kv_cache.problem import (CACHE_BLOCK, WINDOW_BY_POSITION, AttentionProblem, CodecProblem,
                                                empty_attention, empty_latent, empty_records, paged, window_table)
from flashkern.reference import kv_cache as ref
from flashkern.reference.kv_cache import FORMATS, LATENT, AttentionOutputs
from flashkern.registry import Cost, Implementation, Operator

__all__ = ["AttentionProblem", "CodecProblem", "OPERATORS", "WINDOW_BY_POSITION", "compare_attention"]

FORMAT_NAMES = tuple(FORMATS)
MAX_HEADS = 128
MAX_WINDOW = 1 << 16  # keys of a window by position (the model's: 128)
DECODE_TOKENS = 64  # make_attention_inputs: up to this many tokens are a decode batch (a sequence each)

# ---------------------------------------------------------------- argument checks


def _format(name: str, value) -> ref.Format:
    return FORMATS[checks.choice(name, value, FORMAT_NAMES)]


def check_quantize(inputs: dict) -> CodecProblem:
    _format("format", inputs["format"])
    latent = checks.tensor("latent", inputs["latent"], dtype=torch.bfloat16, shape=(None, LATENT), strided=True)
    return CodecProblem(latent.shape[0], inputs["format"])


def check_dequantize(inputs: dict) -> CodecProblem:
    fmt = _format("format", inputs["format"])
    records = checks.tensor("records", inputs["records"], dtype=torch.uint8, shape=(None, fmt.bytes), strided=True)
    return CodecProblem(records.shape[0], fmt.name)


def check_cache(name: str, cache, fmt: ref.Format, device=None) -> torch.Tensor:
    """A paged cache uint8 [blocks, block_size, record bytes]: records packed within a page, any page stride that
    keeps pages apart (a slice of a larger page allocation, say)."""
    checks.tensor(name, cache, dtype=torch.uint8, shape=(None, None, fmt.bytes), device=device, strided=True)
    blocks, block_size, _ = cache.shape
    if block_size > 1 and cache.stride(1) != fmt.bytes:
        raise ValueError(f"{name} must hold its records packed within a page (stride(1) = {fmt.bytes} for "
                         f"{fmt.name}), got strides {list(cache.stride())}; pass {name}.contiguous()")
    if blocks > 1 and cache.stride(0) < block_size * fmt.bytes:
        raise ValueError(f"{name} must have pages apart (page stride {cache.stride(0)} < {block_size} x {fmt.bytes} "
                         f"bytes); pass {name}.contiguous()")
    return cache


def check_insert(inputs: dict) -> CodecProblem:
    fmt = _format("format", inputs["format"])
    cache = check_cache("cache", inputs["cache"], fmt)
    latent = checks.tensor("latent", inputs["latent"], dtype=torch.bfloat16, shape=(None, LATENT), device=cache.device,
                           strided=True)
    checks.tensor("slots", inputs["slots"], dtype=torch.int32, shape=(latent.shape[0],), device=cache.device)
    return CodecProblem(latent.shape[0], fmt.name)


def check_insert_values(inputs: dict, problem: CodecProblem) -> None:
    """Slots in [0, blocks * block_size) or -1; no valid slot twice."""
    cache, slots = inputs["cache"], inputs["slots"]
    rows = cache.shape[0] * cache.shape[1]
    checks.values_in("slots", slots, 0, rows - 1, why=f"the cache holds {rows} slots", allow=-1)
    used = slots[slots >= 0]
    if used.numel() != torch.unique(used).numel():
        raise ValueError("slots repeats a slot: which token's record would land there is unspecified")


def check_attention(inputs: dict) -> AttentionProblem:
    q = checks.tensor("q", inputs["q"], dtype=torch.bfloat16, shape=(None, None, LATENT), strided=True)
    tokens, heads, _ = q.shape
    checks.integer("H (q.shape[1])", heads, low=1, high=MAX_HEADS)
    kv_fmt = _format("kv_format", inputs["kv_format"])
    swa_fmt = _format("swa_format", inputs["swa_format"])
    check_cache("kv_cache", inputs["kv_cache"], kv_fmt, q.device)
    indices = checks.tensor("indices", inputs["indices"], dtype=torch.int32, shape=(tokens, None), device=q.device,
                            strided=True)
    swa_cache, by_position = inputs["swa_cache"], inputs.get("swa_block_table") is not None
    if by_position and inputs["swa_indices"] is not None:
        raise ValueError("pass swa_indices or swa_block_table (the window by position), not both")
    if swa_cache is None and (inputs["swa_indices"] is not None or by_position):
        raise ValueError(f"{'swa_block_table' if by_position else 'swa_indices'} needs swa_cache")
    if swa_cache is not None and not (by_position or inputs["swa_indices"] is not None):
        raise ValueError("swa_cache needs swa_indices or swa_block_table (the window by position)")
    if not by_position:
        for name in WINDOW_BY_POSITION[1:]:
            if inputs.get(name) is not None:
                raise ValueError(f"{name} belongs to the window by position: pass swa_block_table too")
    window = 0
    if swa_cache is not None:
        check_cache("swa_cache", swa_cache, swa_fmt, q.device)
    if by_position:
        table = checks.tensor("swa_block_table", inputs["swa_block_table"], dtype=torch.int32, shape=(None, None),
                              device=q.device, strided=True)
        for name in ("positions", "seq_ids"):
            if inputs.get(name) is None:
                raise ValueError(f"the window by position (swa_block_table) needs {name}")
            checks.tensor(name, inputs[name], dtype=torch.int32, shape=(tokens,), device=q.device)
        checks.optional_tensor("swa_lower", inputs.get("swa_lower"), dtype=torch.int32, shape=(table.shape[0],),
                               device=q.device)
        window = ref.WINDOW if inputs.get("window") is None else checks.integer("window", inputs.get("window"), low=1,
                                                                             high=MAX_WINDOW)
    elif swa_cache is not None:
        window = checks.tensor("swa_indices", inputs["swa_indices"], dtype=torch.int32, shape=(tokens, None),
                               device=q.device, strided=True).shape[1]
    checks.optional_tensor("sink", inputs["sink"], dtype=torch.float32, shape=(heads,), device=q.device)
    if inputs["scale"] is not None:
        checks.real("scale", inputs["scale"], positive=True)
    return AttentionProblem(tokens, indices.shape[1], window, heads, kv_fmt.name, swa_fmt.name,
                            swa=swa_cache is not None, sink=inputs["sink"] is not None,
                            window_by_position=by_position)


def check_attention_values(inputs: dict, problem: AttentionProblem) -> None:
    """Index entries in [0, slots of their cache) or -1; by position: sequence ids rows of the block table,
    positions inside its pages, its entries pages of the window cache or -1."""
    for cache_name, index_name in (("kv_cache", "indices"), ("swa_cache", "swa_indices")):
        if inputs[cache_name] is not None and inputs[index_name] is not None:
            rows = inputs[cache_name].shape[0] * inputs[cache_name].shape[1]
            checks.values_in(index_name, inputs[index_name], 0, rows - 1, why=f"{cache_name} holds {rows} slots",
                             allow=-1)
    if problem.window_by_position:
        table, (pages, block_size) = inputs["swa_block_table"], inputs["swa_cache"].shape[:2]
        checks.values_in("seq_ids", inputs["seq_ids"], 0, table.shape[0] - 1,
                         why=f"swa_block_table has {table.shape[0]} rows")
        checks.values_in("positions", inputs["positions"], 0, table.shape[1] * block_size - 1,
                         why=f"swa_block_table holds {table.shape[1]} pages of {block_size} a sequence")
        checks.values_in("swa_block_table", table, 0, pages - 1, why=f"swa_cache has {pages} pages", allow=-1)


# ---------------------------------------------------------------- outputs


def written_cache(problem: CodecProblem, inputs: dict, device) -> Tensor:
    """kv_cache_insert writes into the cache it is given (on "meta": its metadata)."""
    cache = inputs["cache"]
    return cache if torch.device(device) == cache.device else torch.empty_like(cache, device=device)


# ---------------------------------------------------------------- realistic inputs

def _latent(rows: int, gen: torch.Generator) -> Tensor:
    """Latent rows ~ N(0, 1) with a few larger channels, as attention latents after their norm."""
    x = torch.randn(rows, LATENT, generator=gen)
    return (x * (1 + 3 * (torch.rand(LATENT, generator=gen) < 0.02))).to(torch.bfloat16)


def _to(inputs: dict, device) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def make_quantize_inputs(problem: CodecProblem, device="cpu", seed: int = 0) -> dict:
    return _to(dict(latent=_latent(problem.rows, torch.Generator().manual_seed(seed)), format=problem.format), device)


def make_dequantize_inputs(problem: CodecProblem, device="cpu", seed: int = 0) -> dict:
    latent = _latent(problem.rows, torch.Generator().manual_seed(seed))
    return _to(dict(records=ref.quantize_kv(latent, problem.format), format=problem.format), device)


def make_insert_inputs(problem: CodecProblem, device="cpu", seed: int = 0) -> dict:
    """New tokens written at random free slots of a cache twice their number (a few padding slots)."""
    gen = torch.Generator().manual_seed(seed)
    latent = _latent(problem.rows, gen)
    cache = paged(ref.quantize_kv(_latent(2 * problem.rows + 1, gen), problem.format))
    slots = torch.randperm(cache.shape[0] * cache.shape[1], generator=gen)[: problem.rows].int()
    slots[torch.rand(problem.rows, generator=gen) < 0.05] = -1
    return _to(dict(cache=cache, slots=slots, latent=latent, format=problem.format), device)


def make_attention_inputs(problem: AttentionProblem, device="cpu", seed: int = 0) -> dict:
    """The model's decode step: a compressed cache of 4 x topk tokens (at least 2048) from which each token selects
    topk distinct slots, and a window cache holding each token's last `window` positions (the first tokens' windows
    reach before position 0: padding)."""
    gen = torch.Generator().manual_seed(seed)
    t, h = problem.tokens, problem.heads
    kv_rows = max(4 * problem.topk, 2048)
    kv_cache = paged(ref.quantize_kv(_latent(kv_rows, gen), problem.kv_format))
    indices = torch.rand(t, kv_rows, generator=gen).argsort(dim=1)[:, : problem.topk].int().clone(
        memory_format=torch.contiguous_format)  # row stride topk at T = 1 too, as an engine's buffers have it
    inputs = dict(q=torch.randn(t, h, LATENT, generator=gen).to(torch.bfloat16), kv_cache=kv_cache, indices=indices,
                  swa_cache=None, swa_indices=None, sink=None, scale=None, kv_format=problem.kv_format,
                  swa_format=problem.swa_format, **dict.fromkeys(WINDOW_BY_POSITION))
    if problem.window_by_position:
        inputs.update(_window_by_position(problem, gen))
    elif problem.swa:
        w = problem.window
        inputs["swa_cache"] = paged(ref.quantize_kv(_latent(t + w, gen), problem.swa_format))
        positions = torch.arange(t)[:, None] - w + 1 + torch.arange(w)[None, :]  # token i sees i - w + 1 .. i
        inputs["swa_indices"] = torch.where(positions >= 0, positions + w - 1, -1).int()
    if problem.sink:
        inputs["sink"] = torch.randn(h, generator=gen)
    return _to(inputs, device)


def _window_by_position(problem: AttentionProblem, gen: torch.Generator) -> dict:
    """Decode (T <= 64): a sequence a token, at positions 1000 + 37 s; prefill: one sequence, the chunk's T
    consecutive positions from 1000. The window cache holds each sequence's pages of its last window + T positions,
    in shuffled order."""
    decode = problem.tokens <= DECODE_TOKENS
    positions = 1000 + (37 * torch.arange(problem.tokens) if decode else torch.arange(problem.tokens))
    seq_ids = torch.arange(problem.tokens) if decode else torch.zeros(problem.tokens, dtype=torch.int64)
    first, last = (positions.tolist(),) * 2 if decode else ([1000], [1000 + problem.tokens - 1])
    table, pages = window_table(gen, [p - problem.window + 1 for p in first], last, CACHE_BLOCK)
    return dict(swa_cache=paged(ref.quantize_kv(_latent(pages * CACHE_BLOCK, gen), problem.swa_format)),
                swa_block_table=table, positions=positions.int(), seq_ids=seq_ids.int(), window=problem.window)


def window_indices(inputs: dict) -> Tensor | None:
    """The window's slots as an index list [T, W] (the window by position resolved), or None without a window."""
    if inputs.get("swa_block_table") is None:
        return inputs["swa_indices"]
    return ref.window_slots(inputs["positions"], inputs["seq_ids"], inputs["swa_block_table"],
                            inputs["swa_cache"].shape[1], inputs.get("window") or ref.WINDOW, inputs.get("swa_lower"))


# ---------------------------------------------------------------- comparisons


def compare_bytes(inputs: dict, expected: Tensor, actual: Tensor) -> None:
    """Bit-exact: every byte (records, or the whole cache: nothing but the new records may change)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, (
        f"got {actual.dtype} {list(actual.shape)}, expected {expected.dtype} {list(expected.shape)}")
    e, a = expected.cpu().reshape(-1, expected.shape[-1]), actual.cpu().reshape(-1, actual.shape[-1])
    off = e != a
    if off.any():
        row, byte = torch.nonzero(off)[0].tolist()
        raise AssertionError(f"{int(off.sum())} bytes differ in {int(off.any(dim=1).sum())} of {e.shape[0]} rows; "
                             f"first: row {row} byte {byte}: {a[row, byte].item():#04x} vs {e[row, byte].item():#04x}")


def compare_values(inputs: dict, expected: Tensor, actual: Tensor) -> None:
    """Bit-exact fp32 (NaN where the reference has NaN)."""
    torch.testing.assert_close(actual.cpu(), expected.cpu(), rtol=0, atol=0, equal_nan=True)


OUT_TOLERANCE = dict(atol=1e-3, rtol=2 / 128)  # FlashMLA's check of the bf16 output
LSE_TOLERANCE = dict(atol=1e-5, rtol=1e-6)
P_ROUNDING = 2.0**-8  # the kernels may round the softmax weights to bf16 (2^-9 relative) for the P.V product
FP32_EPS = 2.0**-24


def _error_scales(inputs: dict) -> tuple[Tensor, Tensor]:
    """Per (token, head): sum_j p_j |v_j| (what rounding p scales with) [T, H, 512], and the largest score magnitude
    scale * sum_d |q_d k_jd| (what a reordered fp32 dot product's rounding scales with) [T, H]."""
    keys, selected = ref.gather_keys(inputs["kv_cache"], inputs["indices"], inputs["kv_format"])
    if inputs["swa_cache"] is not None:
        window, in_window = ref.gather_keys(inputs["swa_cache"], window_indices(inputs), inputs["swa_format"])
        keys, selected = torch.cat((keys, window), dim=1), torch.cat((selected, in_window), dim=1)
    scale = LATENT**-0.5 if inputs["scale"] is None else inputs["scale"]
    q = inputs["q"].float().cpu()
    keys, selected = keys.cpu(), selected.cpu()
    magnitude = torch.einsum("thd,tnd->thn", q.abs(), keys.abs()) * scale
    scores = torch.where(selected[:, None, :], torch.einsum("thd,tnd->thn", q, keys) * scale, -torch.inf)
    none = torch.full((*scores.shape[:-1], 1), -torch.inf)  # a -inf column: rows without keys stay defined
    weights = torch.nan_to_num(torch.softmax(torch.cat((scores, none), -1), -1)[..., :-1])
    spread = torch.einsum("thn,tnd->thd", weights, keys.abs())
    magnitude = torch.cat((torch.where(selected[:, None, :], magnitude, 0.0), none.clamp(min=0.0)), dim=-1)
    return spread, magnitude.amax(dim=-1)


def compare_attention(inputs: dict, expected: AttentionOutputs, actual: AttentionOutputs) -> None:
    """out within FlashMLA's 1e-3 abs + 2/128 relative plus what rounding p to bf16 and summing the scores in
    another order may cost (error analysis: P_ROUNDING, and a score's rounding 4 sqrt(D) u sum_d |q_d k_d| scale,
    Higham's probabilistic bound of a D-term fp32 dot product, times sum_j p_j |v_j|); lse within 1e-5 abs + 1e-6
    relative plus that score error. NaN and inf exactly where the reference has them."""
    for name in AttentionOutputs._fields:
        e, a = getattr(expected, name), getattr(actual, name)
        assert a.dtype == e.dtype and a.shape == e.shape, (
            f"{name}: got {a.dtype} {list(a.shape)}, expected {e.dtype} {list(e.shape)}")
    spread, magnitude = _error_scales(inputs)
    score_error = 4 * LATENT**0.5 * FP32_EPS * magnitude
    out_allowed = (OUT_TOLERANCE["atol"] + OUT_TOLERANCE["rtol"] * expected.out.cpu().float().abs()
                   + (P_ROUNDING + 2 * score_error[..., None]) * spread)
    assert_within("out", expected.out, actual.out, out_allowed)
    lse = expected.lse.cpu()
    assert_within("lse", lse, actual.lse, LSE_TOLERANCE["atol"] + LSE_TOLERANCE["rtol"] * lse.abs() + score_error)


# ---------------------------------------------------------------- cost

BF16, FP32, INT32 = 2, 4, 4


def quantize_cost(p: CodecProblem) -> Cost:
    """bf16 in, records out; per value ~ 6 ops (|x|, max, divide, round, pack)."""
    return Cost(flops=6 * p.rows * LATENT, bytes=p.rows * (LATENT * BF16 + p.record_bytes))


def dequantize_cost(p: CodecProblem) -> Cost:
    return Cost(flops=2 * p.rows * LATENT, bytes=p.rows * (p.record_bytes + LATENT * FP32))


def insert_cost(p: CodecProblem) -> Cost:
    """quantize_kv plus the slot of each row."""
    return Cost(flops=6 * p.rows * LATENT, bytes=p.rows * (LATENT * BF16 + p.record_bytes + INT32))


def attention_cost(p: AttentionProblem) -> Cost:
    """QK and PV: 2 x 2 x 512 flops per head and selected key; every token reads its own selected records (no reuse
    across tokens assumed: decode tokens of different sequences share none), q and out once."""
    records = p.topk * FORMATS[p.kv_format].bytes + p.window * FORMATS[p.swa_format].bytes
    moved = p.tokens * (records + (p.topk + p.window) * INT32 + 2 * p.heads * LATENT * BF16 + p.heads * FP32)
    return Cost(flops=4 * LATENT * p.tokens * p.heads * p.keys, bytes=moved, math="bf16")


# ---------------------------------------------------------------- presets

V41_HEADS, V41_TOPK, V41_WINDOW = 64, 512, 128
CODEC_ROWS = (1, 64, 4096)


def _codec_presets(smoke=(1, 37)) -> dict:
    return {"smoke": tuple(CodecProblem(n, f) for n in smoke for f in FORMAT_NAMES),
            "v41-flash": tuple(CodecProblem(n, f) for n in CODEC_ROWS for f in FORMAT_NAMES)}


ATTENTION_PRESETS = {  # the window by slots, then by position (decode T = 1, 64; prefill chunks of 2048, 8192)
    "smoke": (AttentionProblem(1, 64, 16, 16, swa=True, sink=True), AttentionProblem(3, 37, 0, 8),
              AttentionProblem(5, 16, 16, 16, swa=True, sink=True, window_by_position=True)),
    "v41-flash": tuple(AttentionProblem(t, V41_TOPK, V41_WINDOW, V41_HEADS, swa=True, sink=True)
                       for t in (1, 8, 64, 4096))
    + tuple(AttentionProblem(t, V41_TOPK, V41_WINDOW, V41_HEADS, swa=True, sink=True, window_by_position=True)
            for t in (1, 64, 2048, 8192)),
}


# ---------------------------------------------------------------- entry points and records


def quantize_kv(latent: Tensor, format: str = "fp4", *, backend: str = "auto", config: dict | None = None,
                out: Tensor | None = None) -> Tensor:
    """Latent rows to KV-cache records (docs/operators.md section 8.1).

    fp4 (288 B): e2m1 codes of x / sf, sf = e4m3(clamp(amax / 6, 2^-9, 448)) per 16 values (IEEE division, round
    to nearest even, saturating); mxfp8 (528 B): e4m3 codes of x / 2^(e - 127), e = max(ceil_ue8m0(amax / 448), 1)
    per 32 values. A block holding a NaN gets the NaN scale code and zero codes.

    Args:
        latent: [N, 512] bf16 (rows may be strided). format: "fp4" or "mxfp8".
    Returns:
        [N, 288 or 528] uint8 records.
    """
    return call(QUANTIZE_KV, locals())


def dequantize_kv(records: Tensor, format: str = "fp4", *, backend: str = "auto", config: dict | None = None,
                  out: Tensor | None = None) -> Tensor:
    """KV-cache records to values: code value x block scale (docs/operators.md section 8.1).

    Args:
        records: [N, 288 or 528] uint8 (rows may be strided). format: "fp4" or "mxfp8".
    Returns:
        [N, 512] fp32 (exact: every record value is an fp32 number).
    """
    return call(DEQUANTIZE_KV, locals())


def kv_cache_insert(cache: Tensor, slots: Tensor, latent: Tensor, format: str = "fp4", *, backend: str = "auto",
                    config: dict | None = None) -> None:
    """Quantize new tokens and write their records into a paged cache, in place, in one launch.

    cache[s // block_size, s % block_size] = quantize_kv(latent[i], format) for s = slots[i]; slot -1 is skipped,
    as is a slot outside the cache (an error in checked mode, as is a repeated slot); nothing else is written.

    Args:
        cache: [blocks, block_size, 288 or 528] uint8, written in place (records packed within a page; any page
            stride). slots: [N] int32. latent: [N, 512] bf16 (rows may be strided). format: "fp4" or "mxfp8".
    """
    return call(KV_CACHE_INSERT, locals())


def sparse_decode_attention(q: Tensor, kv_cache: Tensor, indices: Tensor, *, swa_cache: Tensor | None = None,
                            swa_indices: Tensor | None = None, swa_block_table: Tensor | None = None,
                            positions: Tensor | None = None, seq_ids: Tensor | None = None, window: int | None = None,
                            swa_lower: Tensor | None = None, sink: Tensor | None = None, scale: float | None = None,
                            kv_format: str = "fp4", swa_format: str = "mxfp8", backend: str = "auto",
                            config: dict | None = None, out: AttentionOutputs | None = None) -> AttentionOutputs:
    """Sparse MQA attention over the latent (K = V) from two paged record caches (docs/operators.md section 8.3).

    s_j = scale * q[t, h] . kv_j over the selected rows j of token t (indices[t] in kv_cache, swa_indices[t] or the
    window by position in swa_cache; -1 and out-of-range entries are padding, out-of-range an error in checked mode);
    d = sum_j exp(s_j) + exp(sink[h]); out = bf16(sum_j exp(s_j) / d * kv_j); lse = log d. No selected key:
    out 0, lse = sink[h] (-inf without a sink).

    Args:
        q: [T, H, 512] bf16 (H <= 128; strided tokens and heads allowed). kv_cache: [blocks, block_size, bytes]
            uint8 in kv_format. indices: [T, topk] int32 slots (rows may be strided).
        swa_cache: the window cache in swa_format, or None; its keys by slot, swa_indices [T, W] int32, or by
            position (docs/operators.md section 8.4): swa_block_table [S, pages] int32 (the window cache's pages of
            each sequence, -1 none; rows may be strided), positions [T] int32 (each token's position in its
            sequence), seq_ids [T] int32 (its row of the table), window (default 128: keys p - window < j <= p),
            swa_lower [S] int32 or None (per sequence, the lowest position the window reads: a bounded replay's
            bound, flashkern.replay). Entries past the table or -1 give no key; ids and positions outside the table
            are errors in checked mode.
        sink: [H] fp32 or None. scale: default 512^-0.5. kv_format, swa_format: "fp4" or "mxfp8".
    Returns:
        AttentionOutputs(out [T, H, 512] bf16, lse [T, H] fp32).
    """
    return call(SPARSE_DECODE_ATTENTION, locals())


def _implementations(triton_module, tilelang_module, stem: str) -> tuple[Implementation, ...]:
    """The Triton and TileLang implementations of one operator: plan_<stem>, <stem>_program, <stem>_args,
    <STEM>_SPACE and <stem>_default in the two modules (and the TileLang module's <stem>_layout, if any)."""
    space, default = f"{stem.upper()}_SPACE", f"{stem}_default"
    return (
        Implementation("triton", TritonKernel(getattr(triton_module, f"plan_{stem}")), getattr(triton_module, space),
                       getattr(triton_module, default)),
        Implementation("tilelang", TileLangKernel(getattr(tilelang_module, f"{stem}_program"),
                                                  getattr(tilelang_module, f"{stem}_args"),
                                                  layout=getattr(tilelang_module, f"{stem}_layout", None)),
                       getattr(tilelang_module, space), getattr(tilelang_module, default)),
    )


QUANTIZE_KV = Operator(
    name="quantize_kv", summary="latent rows to FP4 (288 B) or MXFP8 (528 B) KV-cache records",
    entry=quantize_kv, reference=ref.quantize_kv,
    implementations=_implementations(triton_records, tilelang_records, "quantize"),
    check=check_quantize, outputs=empty_records, make_inputs=make_quantize_inputs, compare=compare_bytes,
    cost=quantize_cost, presets=_codec_presets(), cases=partial(codec_cases, "quantize_kv"),
)

DEQUANTIZE_KV = Operator(
    name="dequantize_kv", summary="FP4 / MXFP8 KV-cache records to fp32 latent rows",
    entry=dequantize_kv, reference=ref.dequantize_kv,
    implementations=_implementations(triton_records, tilelang_records, "dequantize"),
    check=check_dequantize, outputs=empty_latent, make_inputs=make_dequantize_inputs, compare=compare_values,
    cost=dequantize_cost, presets=_codec_presets(), cases=partial(codec_cases, "dequantize_kv"),
)

KV_CACHE_INSERT = Operator(
    name="kv_cache_insert", summary="quantize new tokens into their slots of a paged FP4 / MXFP8 cache, in place",
    entry=kv_cache_insert, reference=ref.kv_cache_insert,
    implementations=_implementations(triton_records, tilelang_records, "insert"),
    check=check_insert, outputs=written_cache, make_inputs=make_insert_inputs, compare=compare_bytes,
    cost=insert_cost, presets=_codec_presets(), cases=partial(codec_cases, "kv_cache_insert"),
    check_values=check_insert_values, mutates="cache",
)

SPARSE_DECODE_ATTENTION = Operator(
    name="sparse_decode_attention", summary="sparse MQA decode / prefill attention over FP4 top-k and MXFP8 window",
    entry=sparse_decode_attention, reference=ref.sparse_decode_attention,
    implementations=_implementations(triton_attention, tilelang_attention, "attention"),
    check=check_attention, outputs=empty_attention, make_inputs=make_attention_inputs, compare=compare_attention,
    cost=attention_cost, presets=ATTENTION_PRESETS, cases=attention_cases, check_values=check_attention_values,
)

OPERATORS = (QUANTIZE_KV, DEQUANTIZE_KV, KV_CACHE_INSERT, SPARSE_DECODE_ATTENTION)
