"""Engram, hashed n-gram memory (docs/operators.md section 9): operator records.

  engram_hash    token ids [T] of runs of sequences -> table row ids int64 [T, orders x heads]
  engram_lookup  table [R, 264] uint8 (256 e4m3 + 8 ue8m0) and row ids [T, L] -> bf16 [T, L, 256]; the table may be
                 pinned host memory read by the GPU (UVA)
  engram_gate    streams h [T, hc, D], keys k [T, hc, D], value v [T, D] -> h + sigmoid(signed sqrt(dot)) v
The math is in flashkern.reference.engram; the host table (transparent huge pages) and prefetch in
flashkern.kernels.engram.host; the strategies the tests and `flashkern check` draw inputs from in
flashkern.kernels.engram.cases.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from flashkern import checks
from flashkern.dispatch import call
from flashkern.kernels._tilelang import TileLangKernel
from flashkern.kernels._triton import TritonKernel
from flashkern.kernels.compare import assert_within
from flashkern.kernels.engram import tilelang_engram, triton_engram
from flashkern.kernels.engram.cases import gate_cases, hash_cases, lookup_cases
from flashkern.kernels.engram.problem import (V41_HEADS, V41_NGRAM, GateProblem, HashProblem, LookupProblem,
                                              empty_rows, empty_streams, empty_values)
from flashkern.reference import engram as ref
from flashkern.registry import Cost, Implementation, Operator

__all__ = ["GateProblem", "HashProblem", "LookupProblem", "OPERATORS", "model_params", "make_table"]

INT_IDS = (torch.int32, torch.int64)
MAX_NGRAM = 8  # lookback registers per token
MAX_STREAMS = 16
INT64_LIMIT = 2**63

# ---------------------------------------------------------------- argument checks


def check_hash(inputs: dict) -> HashProblem:
    token_ids = checks.tensor("token_ids", inputs["token_ids"], dtype=INT_IDS, shape=(None,))
    device, tokens = token_ids.device, token_ids.shape[0]
    checks.tensor("seq_ids", inputs["seq_ids"], dtype=INT_IDS, shape=(tokens,), device=device)
    token_map = checks.tensor("token_map", inputs["token_map"], dtype=torch.int64, shape=(None,), device=device)
    checks.integer("token_map.shape[0]", token_map.shape[0], low=1)
    multipliers = checks.tensor("multipliers", inputs["multipliers"], dtype=torch.int64, shape=(None,), device=device)
    max_ngram = checks.integer("max_ngram (multipliers.shape[0])", multipliers.shape[0], low=2, high=MAX_NGRAM)
    primes = checks.tensor("primes", inputs["primes"], dtype=torch.int64, shape=(max_ngram - 1, None), device=device)
    heads = checks.integer("heads (primes.shape[1])", primes.shape[1], low=1, high=64)
    checks.tensor("offsets", inputs["offsets"], dtype=torch.int64, shape=(max_ngram - 1, heads), device=device)
    checks.integer("pad_id", inputs["pad_id"], low=0, high=2**31 - 1)
    history = checks.optional_tensor("history", inputs["history"], dtype=torch.int64, shape=(None, max_ngram - 1),
                                     device=device)
    return HashProblem(tokens, max_ngram, heads, history=history is not None)


def check_hash_values(inputs: dict, problem: HashProblem) -> None:
    """Token ids in the map, history ids in it or -1, sequence ids in the history's rows (when given); primes >= 1,
    offsets >= 0, and no product id x multiplier reaching 2^63 (the hash never wraps)."""
    vocabulary, history = inputs["token_map"].shape[0], inputs["history"]
    checks.values_in("token_ids", inputs["token_ids"], 0, vocabulary - 1, why=f"the token map holds {vocabulary} ids")
    if history is not None:
        checks.values_in("history", history, 0, vocabulary - 1, allow=-1,
                         why=f"the token map holds {vocabulary} ids; -1: none")
        sequences = history.shape[0]
        checks.values_in("seq_ids", inputs["seq_ids"], 0, sequences - 1, why=f"history holds {sequences} sequences")
    checks.values_in("primes", inputs["primes"], 1, INT64_LIMIT - 1, why="each head's table has rows")
    checks.values_in("offsets", inputs["offsets"], 0, INT64_LIMIT - 1, why="row ids are table rows")
    ids, mult = inputs["token_map"], inputs["multipliers"]
    checks.values_in("token_map", ids, 0, INT64_LIMIT - 1, why="compressed ids are non-negative")
    checks.values_in("multipliers", mult, 0, INT64_LIMIT - 1, why="the hash's multipliers are non-negative")
    largest = max(int(ids.max()), inputs["pad_id"]) * int(mult.max())
    if largest >= INT64_LIMIT:
        raise ValueError(f"token_map and multipliers: the product {largest} of the largest id and multiplier "
                         f"reaches 2^63 (the hash would wrap; reference.engram.multipliers bounds them by V')")


def table_device_ok(table: Tensor, device: torch.device) -> bool:
    """The table lives with the row ids, or in pinned host memory that a CUDA kernel reads through UVA."""
    return table.device == device or (device.type == "cuda" and table.device.type == "cpu" and table.is_pinned())


def check_lookup(inputs: dict) -> LookupProblem:
    rows = checks.tensor("rows", inputs["rows"], dtype=INT_IDS, shape=(None, None))
    table = checks.tensor("table", inputs["table"], dtype=torch.uint8, shape=(None, ref.ROW_BYTES), strided=True)
    if not table_device_ok(table, rows.device):
        raise ValueError(f"table is on {table.device}, rows on {rows.device}: the table must be with the rows, or "
                         f"pinned host memory (table.pin_memory(), flashkern.kernels.engram.host.HostTable) for rows "
                         f"on a GPU")
    return LookupProblem(rows.shape[0], rows.shape[1], host=table.device != rows.device)


def check_lookup_values(inputs: dict, problem: LookupProblem) -> None:
    rows = inputs["table"].shape[0]
    checks.values_in("rows", inputs["rows"], 0, rows - 1, why=f"the table holds {rows} rows")


def check_gate(inputs: dict) -> GateProblem:
    h = checks.tensor("h", inputs["h"], dtype=torch.bfloat16, shape=(None, None, None))
    tokens, streams, hidden = h.shape
    checks.integer("streams (h.shape[1])", streams, low=1, high=MAX_STREAMS)
    checks.integer("D (h.shape[2])", hidden, low=1)
    checks.tensor("k", inputs["k"], dtype=torch.bfloat16, shape=(tokens, streams, hidden), device=h.device)
    checks.tensor("v", inputs["v"], dtype=torch.bfloat16, shape=(tokens, hidden), device=h.device)
    for name in ("q_w", "k_w"):
        checks.tensor(name, inputs[name], dtype=torch.bfloat16, shape=(hidden,), device=h.device)
    if checks.real("eps", inputs["eps"]) < 0:
        raise ValueError(f"eps must be >= 0, got {inputs['eps']!r}")
    return GateProblem(tokens, hidden, streams)


# ---------------------------------------------------------------- realistic inputs

V4_VOCABULARY = 129_280  # the tokenizer's vocabulary the token map covers
GPU_TABLE_ROWS = 2**20 + 7  # 277 MB: 5x the H200's L2, so rows come from HBM as they do from a 94 GiB table


@functools.cache
def model_params(max_ngram: int = V41_NGRAM, heads: int = V41_HEADS, layer: int = 1) -> ref.EngramParams:
    """Engram layer `layer`'s hash with the model's primes and multipliers for this n-gram shape, over a synthetic
    token map of the tokenizer's vocabulary (CPU tensors)."""
    config = ref.EngramConfig(max_ngram=max_ngram, heads=heads)
    token_map = ref.synthetic_token_map(V4_VOCABULARY, config.compressed_vocab)
    return ref.engram_params(layer, token_map, config)


def _to(inputs: dict, device) -> dict:
    return {k: v.to(device) if isinstance(v, Tensor) else v for k, v in inputs.items()}


def batch_runs(tokens: int, gen: torch.Generator) -> Tensor:
    """Sequence ids int64 [tokens] of a serving batch: runs of 1 to 2 x 64 tokens (decode steps and prefill chunks),
    sequence s the s-th run."""
    lengths = []
    while sum(lengths) < tokens:
        lengths.append(int(torch.randint(1, 129, (1,), generator=gen)))
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[:tokens]


def make_hash_inputs(problem: HashProblem, device="cpu", seed: int = 0) -> dict:
    """Uniform token ids of the tokenizer's vocabulary in runs (batch_runs); with history, each sequence's last
    ids before the call, a new sequence's -1."""
    gen = torch.Generator().manual_seed(seed)
    params = model_params(problem.max_ngram, problem.heads)
    seq_ids = batch_runs(problem.tokens, gen)
    history = None
    if problem.history:
        sequences = int(seq_ids[-1]) + 1 if problem.tokens else 0
        history = torch.randint(0, V4_VOCABULARY, (sequences, problem.max_ngram - 1), generator=gen)
        history[torch.rand(sequences, generator=gen) < 0.25] = -1
    tables = {name: value.clone() if isinstance(value, Tensor) else value
              for name, value in params.hash_inputs().items()}
    inputs = dict(token_ids=torch.randint(0, V4_VOCABULARY, (problem.tokens,), generator=gen), seq_ids=seq_ids,
                  **tables, history=history)
    return _to(inputs, device)


def make_table(rows: int, gen: torch.Generator, out: Tensor | None = None) -> Tensor:
    """A table [rows, 264] of random finite e4m3 codes (a trained table holds no NaN; the test cases draw them) and
    scales 2^-27 .. 2^22 (bytes 100 .. 149); written into `out` when given (a host table)."""
    table = torch.empty(rows, ref.ROW_BYTES, dtype=torch.uint8) if out is None else out
    codes = torch.randint(0, 255, (rows, ref.ROW_VALUES), dtype=torch.uint8, generator=gen)
    table[:, :ref.ROW_VALUES] = torch.where(codes & 0x7F == 0x7F, codes - 1, codes)  # 0x7F / 0xFF: NaN
    table[:, ref.ROW_VALUES:] = torch.randint(100, 150, (rows, ref.ROW_BYTES - ref.ROW_VALUES), dtype=torch.uint8,
                                              generator=gen)
    return table


def make_lookup_inputs(problem: LookupProblem, device="cpu", seed: int = 0) -> dict:
    """Uniform row ids over a table of GPU_TABLE_ROWS rows on a GPU (in pinned host memory for a host problem), or
    on the CPU a table of 16 rows a lookup (at least 4099)."""
    gen = torch.Generator().manual_seed(seed)
    on_gpu = torch.device(device).type == "cuda"
    table_rows = GPU_TABLE_ROWS if on_gpu else max(4099, 16 * problem.rows)
    table = make_table(table_rows, gen)
    rows = torch.randint(0, table_rows, (problem.tokens, problem.lookups), generator=gen)
    table = table.pin_memory() if problem.host and on_gpu else table.to(device)
    return dict(table=table, rows=rows.to(device))


def make_gate_inputs(problem: GateProblem, device="cpu", seed: int = 0) -> dict:
    """Streams, keys and value ~ N(0, 1), norm weights 1 + N(0, 0.1^2), eps 1e-6."""
    gen = torch.Generator().manual_seed(seed)
    t, n, d = problem.tokens, problem.streams, problem.hidden
    h, k = (torch.randn(t, n, d, generator=gen).bfloat16() for _ in range(2))
    q_w, k_w = ((1 + 0.1 * torch.randn(d, generator=gen)).bfloat16() for _ in range(2))
    return _to(dict(h=h, k=k, v=torch.randn(t, d, generator=gen).bfloat16(), q_w=q_w, k_w=k_w, eps=1e-6), device)


# ---------------------------------------------------------------- comparisons


def compare_rows(inputs: dict, expected: Tensor, actual: Tensor) -> None:
    """Bit-exact row ids."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, (actual.dtype, list(actual.shape))
    off = expected.cpu() != actual.cpu()
    if off.any():
        at = torch.nonzero(off)[0].tolist()
        raise AssertionError(f"{int(off.sum())} of {off.numel()} row ids differ; first at {at}: "
                             f"{int(actual.cpu()[tuple(at)])} vs {int(expected.cpu()[tuple(at)])}")


def compare_values(inputs: dict, expected: Tensor, actual: Tensor) -> None:
    """Bit-exact bf16 (the dequantized values are exact), NaN where the reference has NaN."""
    assert_within("values", expected, actual, 0.0)


BF16_ULP = 2.0**-7  # bf16's spacing relative to a value's leading power of two (at most)
FP32_U = 2.0**-24


def gate_error(inputs: dict) -> Tensor:
    """A bound on |g - g_ref| [T, hc] from summing the dot in another fp32 order (error analysis): the dot's error
    4 sqrt(D) u sum|h q_w k k_w| rstd_h rstd_k / sqrt(D) (Higham's probabilistic bound for a D-term fp32 sum, as the
    attention's score), through sigmoid's slope (<= 1/4) and the root's (1 / (2 sqrt(max(|dot|, 1e-6)))), plus g's
    own rounding."""
    h, k = inputs["h"].cpu().double(), inputs["k"].cpu().double()
    q_w, k_w, eps, d = inputs["q_w"].cpu().double(), inputs["k_w"].cpu().double(), inputs["eps"], h.shape[-1]
    rstd = torch.rsqrt(h.square().mean(-1) + eps) * torch.rsqrt(k.square().mean(-1) + eps)
    magnitude = (h * q_w * k * k_w).abs().sum(-1) * rstd / d**0.5
    dot = (h * q_w * k * k_w).sum(-1) * rstd / d**0.5
    dot_error = 4 * d**0.5 * FP32_U * magnitude
    return (0.25 * dot_error / (2 * dot.abs().clamp(min=ref.DOT_FLOOR).sqrt()) + 4 * FP32_U).nan_to_num(0.0).float()


def compare_gate(inputs: dict, expected: Tensor, actual: Tensor) -> None:
    """Within one bf16 rounding of the reference (h + g v rounded from nearby fp32 values lands on the same or the
    next bf16) plus g's error (gate_error) times |v|; NaN and inf exactly."""
    v = inputs["v"].cpu().float()[:, None, :]
    allowed = BF16_ULP * expected.cpu().float().abs() + gate_error(inputs)[..., None] * v.abs() + 2.0**-133
    assert_within("out", expected, actual, allowed)


# ---------------------------------------------------------------- cost

INT64, BF16 = 8, 2
MOD_OPS = 40  # a 64-bit remainder (emulated: no 64-bit divider) in operations


def hash_cost(p: HashProblem) -> Cost:
    """Per token: its id and sequence id, max_ngram - 1 earlier ids and sequence ids (cached), max_ngram map
    entries (random reads), the history row; products, XORs and a remainder per row id; row ids written."""
    read = p.tokens * (2 * INT64 + p.max_ngram * INT64 + (p.max_ngram - 1) * INT64 * p.history)
    return Cost(flops=p.tokens * (2 * p.max_ngram + p.columns * (MOD_OPS + 1)),
                bytes=read + p.tokens * p.columns * INT64)


def lookup_cost(p: LookupProblem) -> Cost:
    """A row id and a 264-byte record read, 256 bf16 values written, per lookup; a multiply per value. A host
    table's records cross the host link."""
    return Cost(flops=2 * p.rows * ref.ROW_VALUES, bytes=p.rows * (INT64 + ref.ROW_BYTES + ref.ROW_VALUES * BF16),
                host_bytes=p.rows * ref.ROW_BYTES if p.host else 0.0)


def gate_cost(p: GateProblem) -> Cost:
    """h, k read and out written per stream, v and the weights once; two squares, the dot's two products and the
    gated add per element."""
    streams = p.tokens * p.streams * p.hidden
    return Cost(flops=8 * streams, bytes=3 * streams * BF16 + p.tokens * p.hidden * BF16 + 2 * p.hidden * BF16)


# ---------------------------------------------------------------- presets

MODEL_TOKENS = (1, 64, 4096)
MODEL_HIDDEN = (4096, 5120, 7168)
FLASH_HIDDEN = 5120

HASH_PRESETS = {"smoke": (HashProblem(1), HashProblem(37, history=True)),
                "v41-flash": tuple(HashProblem(t, history=True) for t in MODEL_TOKENS)}
LOOKUP_PRESETS = {"smoke": (LookupProblem(1), LookupProblem(37)),
                  "v41-flash": tuple(LookupProblem(t) for t in MODEL_TOKENS),
                  "v41-flash-host": tuple(LookupProblem(t, host=True) for t in MODEL_TOKENS)}
GATE_PRESETS = {"smoke": (GateProblem(1, 256), GateProblem(37, 576)),
                **{f"d{d}": tuple(GateProblem(t, d) for t in MODEL_TOKENS) for d in MODEL_HIDDEN}}
GATE_PRESETS["v41-flash"] = GATE_PRESETS[f"d{FLASH_HIDDEN}"]


# ---------------------------------------------------------------- entry points and records


def engram_hash(token_ids: Tensor, seq_ids: Tensor, token_map: Tensor, multipliers: Tensor, primes: Tensor,
                offsets: Tensor, *, pad_id: int = 2, history: Tensor | None = None, backend: str = "auto",
                config: dict | None = None, out: Tensor | None = None) -> Tensor:
    """Engram's table row ids of each token: for orders n = 2 .. max_ngram and heads j,
    row = (XOR_{k < n} cid[t - k] mult[k]) mod primes[n - 2, j] + offsets[n - 2, j] (int64).

    cid = token_map[id], the pad id for an id outside the map; a run of equal seq_ids is one sequence's tokens in
    order, whose lookback continues into history[seq] (the ids before the call, oldest first, -1 none) and then
    the pad id. token_map, multipliers, primes, offsets and pad_id: reference.engram.engram_params(...).hash_inputs().

    Args:
        token_ids: [T] int32 / int64. seq_ids: [T] int32 / int64. token_map: [V] int64. multipliers: [max_ngram]
        int64. primes, offsets: [max_ngram - 1, heads] int64. history: [S, max_ngram - 1] int64 or None.
    Returns:
        [T, (max_ngram - 1) x heads] int64, order-major.
    """
    return call(ENGRAM_HASH, locals())


def engram_lookup(table: Tensor, rows: Tensor, *, backend: str = "auto", config: dict | None = None,
                  out: Tensor | None = None) -> Tensor:
    """Engram table rows, dequantized: value[i] = e4m3(code[i]) x 2^(scale[i // 32] - 127) as bf16 (exact).

    A row id outside [0, R) gives zeros and reads nothing (checked mode refuses it). The table may be pinned host
    memory (HostTable, or table.pin_memory()) while the rows are on a GPU: the kernels read it through UVA.

    Args:
        table: [R, 264] uint8 (256 e4m3 codes, 8 ue8m0 scales a row; rows may be strided). rows: [T, L] int32 /
        int64.
    Returns:
        [T, L, 256] bf16.
    """
    return call(ENGRAM_LOOKUP, locals())


def engram_gate(h: Tensor, k: Tensor, v: Tensor, q_w: Tensor, k_w: Tensor, eps: float = 1e-6, *,
                backend: str = "auto", config: dict | None = None, out: Tensor | None = None) -> Tensor:
    """Engram's gated add, per token and stream s: dot = <rms(h_s) q_w, rms(k_s) k_w> / sqrt(D),
    g = sigmoid(sign(dot) sqrt(max(|dot|, 1e-6))), out_s = bf16(h_s + g v); rms(x) = x / sqrt(mean(x^2) + eps).

    Args:
        h: [T, hc, D] bf16 streams. k: [T, hc, D] bf16 keys. v: [T, D] bf16 value. q_w, k_w: [D] bf16. eps: >= 0.
    Returns:
        [T, hc, D] bf16.
    """
    return call(ENGRAM_GATE, locals())


def _implementations(stem: str, layout=None) -> tuple[Implementation, ...]:
    """The Triton and TileLang implementations of one operator (plans, spaces and defaults named after `stem`)."""
    tilelang = TileLangKernel(getattr(tilelang_engram, f"{stem}_program"), getattr(tilelang_engram, f"{stem}_args"),
                              layout=getattr(tilelang_engram, f"{stem}_layout", None))
    return (
        Implementation("triton", TritonKernel(getattr(triton_engram, f"plan_{stem}")),
                       getattr(triton_engram, f"{stem.upper()}_SPACE"), getattr(triton_engram, f"{stem}_default")),
        Implementation("tilelang", tilelang, getattr(tilelang_engram, f"{stem.upper()}_SPACE"),
                       getattr(tilelang_engram, f"{stem}_default")),
    )


ENGRAM_HASH = Operator(
    name="engram_hash", summary="Engram n-gram hash: token ids to table row ids (orders x heads a token)",
    entry=engram_hash, reference=ref.engram_hash, implementations=_implementations("hash"),
    check=check_hash, outputs=empty_rows, make_inputs=make_hash_inputs, compare=compare_rows, cost=hash_cost,
    presets=HASH_PRESETS, check_values=check_hash_values, cases=hash_cases,
)

ENGRAM_LOOKUP = Operator(
    name="engram_lookup", summary="Engram table gather and MXFP8 dequantization to bf16 (device or pinned host table)",
    entry=engram_lookup, reference=ref.engram_lookup, implementations=_implementations("lookup"),
    check=check_lookup, outputs=empty_values, make_inputs=make_lookup_inputs, compare=compare_values,
    cost=lookup_cost, presets=LOOKUP_PRESETS, check_values=check_lookup_values, cases=lookup_cases,
)

ENGRAM_GATE = Operator(
    name="engram_gate", summary="Engram gate: h + sigmoid(signed sqrt(<rms(h) q_w, rms(k) k_w> / sqrt(D))) v",
    entry=engram_gate, reference=ref.engram_gate, implementations=_implementations("gate"),
    check=check_gate, outputs=empty_streams, make_inputs=make_gate_inputs, compare=compare_gate, cost=gate_cost,
    presets=GATE_PRESETS, cases=gate_cases,
)

OPERATORS = (ENGRAM_HASH, ENGRAM_LOOKUP, ENGRAM_GATE)
