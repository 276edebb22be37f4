"""Engram, hashed n-gram memory (docs/operators.md section 9): the reference, in plain PyTorch.

An Engram layer looks up, per token, one table row per (n-gram order n, hash head j): orders 2 .. max_ngram,
`heads` heads each (V4.1-Flash: orders 2, 3, 4 x 8 heads = 24 rows), and gates them into the hidden streams.

  hash   cid = token_map[token]  (a normalized vocabulary of V' compressed ids; `pad_id` before a sequence's start
         and for any id outside the map); a run of equal sequence ids is one sequence's tokens, in order
         mult[k] = 2 * default_rng(10007 * layer).integers(0, (INT64_MAX // V') // 2, size=max_ngram)[k] + 1
         h_n(t) = XOR_{k < n} cid[t - k] * mult[k]             int64 (each product < INT64_MAX: mult's bound)
         row(t, n, j) = h_n(t) mod prime[n, j] + offset[n, j]    mod: the non-negative remainder
         primes: distinct, ascending from vocab_size - 1, taken by (layer, order, head) in that order over the
         model's Engram layers; offsets: each layer's tables laid end to end (rows = the sum of its primes).
  lookup table [rows, 264] uint8: 256 e4m3 codes, then 8 ue8m0 scales (one per 32 values);
         value[i] = e4m3(code[i]) * 2^(scale[i // 32] - 127), as bf16 (exact); a row id outside the table: zeros.
  gate   per stream s (hc of them): dot = <rms(h_s) * q_w, rms(k_s) * k_w> / sqrt(D), rms(x) = x / sqrt(mean(x^2) +
         eps); g = sigmoid(sign(dot) * sqrt(max(|dot|, 1e-6))); out_s = bf16(h_s + g * v)  (v: one value shared
         by the streams). fp32 inside, bf16 in and out.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from flashkern.reference.formats import mxfp8_decode

ROW_VALUES = 256  # values a table row holds (the model's head dim)
SCALE_BLOCK = 32  # values per ue8m0 scale
ROW_BYTES = ROW_VALUES + ROW_VALUES // SCALE_BLOCK  # 264
DOT_FLOOR = 1e-6  # |dot| is clamped to this before the square root
INT64_MAX = np.iinfo(np.int64).max


@dataclass(frozen=True)
class EngramConfig:
    """The model config's Engram fields (V4.1-Flash's by default)."""

    layer_ids: tuple[int, ...] = (1, 14)
    max_ngram: int = 4
    heads: int = 8
    vocab_size: int = 16_000_000  # the prime search starts here
    compressed_vocab: int = 99_092  # V': the compressed ids' count
    pad_id: int = 2  # the compressed id hashed before a sequence's start

    @property
    def orders(self) -> int:
        return self.max_ngram - 1


@dataclass(frozen=True)
class EngramParams:
    """One Engram layer's hash: token_map int64 [vocabulary] (token id -> compressed id), multipliers int64
    [max_ngram], primes and offsets int64 [orders, heads] (order n = 2 + index), the pad id and the table's rows."""

    layer: int
    token_map: torch.Tensor
    multipliers: torch.Tensor
    primes: torch.Tensor
    offsets: torch.Tensor
    pad_id: int

    @property
    def rows(self) -> int:
        return int(self.primes.sum())

    @property
    def max_ngram(self) -> int:
        return self.multipliers.numel()

    def hash_inputs(self) -> dict:
        """The hash's tables and pad id as engram_hash takes them (keyword arguments)."""
        return dict(token_map=self.token_map, multipliers=self.multipliers, primes=self.primes, offsets=self.offsets,
                    pad_id=self.pad_id)


def is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin for n < 3.3e24 (these bases suffice)."""
    if n < 2:
        return False
    bases = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)
    if n in bases:
        return True
    if any(n % b == 0 for b in bases):
        return False
    d, r = n - 1, 0
    while d % 2 == 0:
        d, r = d // 2, r + 1
    for a in bases:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def layer_primes(config: EngramConfig) -> dict[int, list[list[int]]]:
    """Every Engram layer's primes [orders][heads]: distinct, ascending from vocab_size - 1, in (layer, order, head)
    order."""
    found, candidate = {}, config.vocab_size - 1
    for layer in config.layer_ids:
        found[layer] = []
        for _ in range(config.orders):
            heads = []
            for _ in range(config.heads):
                candidate += 1
                while not is_prime(candidate):
                    candidate += 1
                heads.append(candidate)
            found[layer].append(heads)
    return found


def multipliers(layer: int, config: EngramConfig) -> torch.Tensor:
    """The layer's odd multipliers [max_ngram] (numpy's default_rng, PCG64: a stream numpy keeps fixed)."""
    bound = max(1, (INT64_MAX // config.compressed_vocab) // 2)
    drawn = np.random.default_rng(10007 * layer).integers(0, bound, size=(config.max_ngram,), dtype=np.int64)
    return torch.from_numpy(drawn * 2 + 1)


def engram_params(layer: int, token_map: torch.Tensor, config: EngramConfig = EngramConfig()) -> EngramParams:
    """The hash of Engram layer `layer` (one of config.layer_ids) for a token map (token id -> compressed id,
    each below config.compressed_vocab: `synthetic_token_map` for tests)."""
    if layer not in config.layer_ids:
        raise ValueError(f"layer {layer} is not an Engram layer of the config ({config.layer_ids})")
    primes = torch.tensor(layer_primes(config)[layer], dtype=torch.int64)
    offsets = (primes.flatten().cumsum(0) - primes.flatten()).view_as(primes)
    return EngramParams(layer, token_map.to(torch.int64), multipliers(layer, config), primes, offsets,
                        config.pad_id)


def synthetic_token_map(vocabulary: int, compressed_vocab: int, seed: int = 0) -> torch.Tensor:
    """A stand-in for the normalized vocabulary: every compressed id used, the rest of the tokens folded onto them
    at random (the real map normalizes the tokenizer's strings: NFKC, accents stripped, lowercased)."""
    gen = torch.Generator().manual_seed(seed)
    folded = torch.randint(0, compressed_vocab, (vocabulary,), generator=gen)
    folded[torch.randperm(vocabulary, generator=gen)[:compressed_vocab]] = torch.arange(compressed_vocab)
    return folded


def compressed_ids(ids: torch.Tensor, token_map: torch.Tensor, pad_id: int) -> torch.Tensor:
    """token_map[ids] (int64); an id outside the map (-1, history's "none", included) gives the pad id."""
    inside = (ids >= 0) & (ids < token_map.shape[0])
    return torch.where(inside, token_map[ids.clamp(0, max(token_map.shape[0] - 1, 0))].long(), pad_id)


def engram_hash(token_ids: torch.Tensor, seq_ids: torch.Tensor, token_map: torch.Tensor, multipliers: torch.Tensor,
                primes: torch.Tensor, offsets: torch.Tensor, pad_id: int,
                history: torch.Tensor | None = None) -> torch.Tensor:
    """Row ids int64 [T, orders * heads] (order-major: order 2's heads first) of the tokens `token_ids` [T].

    A run of equal `seq_ids` [T] is one sequence's next tokens in order (how an engine lays out a batch); a token's
    lookback is the tokens before it in its run, then, before the run, its sequence's `history` row (int64 [S,
    max_ngram - 1], that sequence's last token ids before this call, oldest first; -1: none, the sequence starts
    there), then the pad id: where history is None or the sequence id is outside [0, S). So a chunked prefill and
    its decode steps, each given the ids before it, hash as one call. Any token id outside [0, len(token_map))
    hashes as the pad id. token_map, multipliers, primes and offsets: EngramParams.hash_inputs()."""
    lookback = multipliers.numel() - 1
    tokens = token_ids.shape[0]
    cid = compressed_ids(token_ids.long(), token_map, pad_id)
    seq = seq_ids.long()
    depth = torch.zeros(tokens, dtype=torch.int64)  # earlier tokens of the run, up to the lookback
    same = torch.ones(tokens, dtype=torch.bool)
    for k in range(1, lookback + 1):
        same[:k] = False
        same[k:] &= seq[k:] == seq[:-k]
        depth += same
    known = history is not None and history.shape[0] > 0
    in_history = (seq >= 0) & (seq < history.shape[0]) if known else torch.zeros(tokens, dtype=torch.bool)
    h = cid * multipliers[0]
    rows = []
    for k in range(1, lookback + 1):  # h_n = h_{n-1} XOR cid[t - k] * mult[k], n = k + 1
        in_call = cid[(torch.arange(tokens) - k).clamp(min=0)]
        before = torch.full((tokens,), pad_id, dtype=torch.int64)
        if known:
            column = (lookback - k + depth).clamp(min=0)  # history's column for the k - depth-th id before the run
            kept = history.long()[seq.clamp(0, history.shape[0] - 1), column.clamp(max=lookback - 1)]
            before = torch.where(in_history, compressed_ids(kept, token_map, pad_id), pad_id)
        h = h ^ (torch.where(depth >= k, in_call, before) * multipliers[k])
        rows.append(torch.remainder(h[:, None], primes[k - 1]) + offsets[k - 1])
    return torch.cat(rows, dim=1) if rows else torch.empty(tokens, 0, dtype=torch.int64)


def engram_lookup(table: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """bf16 [*rows.shape, 256] on the rows' device: the table rows dequantized; row ids outside [0, table rows) give
    zeros. (The table may be in host memory while the rows are on a GPU.)"""
    inside = (rows >= 0) & (rows < table.shape[0])
    records = table[torch.where(inside, rows, 0).long().to(table.device)].to(rows.device)
    values = mxfp8_decode(records[..., :ROW_VALUES], records[..., ROW_VALUES:], SCALE_BLOCK)
    return torch.where(inside[..., None], values, 0.0).to(torch.bfloat16)


def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)


def engram_gate(h: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_w: torch.Tensor, k_w: torch.Tensor,
                eps: float) -> torch.Tensor:
    """bf16 [T, hc, D]: h [T, hc, D] the streams, k [T, hc, D] a key per stream, v [T, D] the shared value, q_w and
    k_w [D] the norms' weights (module docstring)."""
    h32, k32 = h.float(), k.float()
    dot = (rms(h32, eps) * q_w.float() * rms(k32, eps) * k_w.float()).sum(dim=-1) / h.shape[-1] ** 0.5
    gate = torch.sigmoid(dot.sign() * dot.abs().clamp(min=DOT_FLOOR).sqrt())
    return (h32 + gate[..., None] * v.float()[:, None, :]).to(torch.bfloat16)
