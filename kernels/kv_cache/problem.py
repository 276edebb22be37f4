"""Problem descriptions of the KV-cache family: record codecs, the cache write and sparse decode attention.

Sizes that vary per call (rows, tokens, selected keys per token) are dynamic in the kernels; the record formats,
the head count and which optional inputs are present are part of a kernel's specialization.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from flashkern.kernels.tiles import SMS
from flashkern.reference.kv_cache import FORMATS, LATENT, AttentionOutputs
from flashkern.registry import SizedProblem


WINDOW_BY_POSITION = ("swa_block_table", "positions", "seq_ids", "window", "swa_lower")  # sparse_decode_attention's
CACHE_BLOCK = 64  # tokens per cache page in the presets (FlashMLA's page size)


@dataclass(frozen=True)
class CodecProblem(SizedProblem):
    """quantize_kv / dequantize_kv / kv_cache_insert: `rows` latent rows in record format `format`."""

    rows: int
    format: str = "fp4"
    SIZES: ClassVar = ("rows",)

    @property
    def record_bytes(self) -> int:
        return FORMATS[self.format].bytes


@dataclass(frozen=True)
class AttentionProblem(SizedProblem):
    """sparse_decode_attention: `tokens` query tokens of `heads` heads, each attending to `topk` slots of the
    main cache and `window` slots of the window cache (window = 0 and swa False without one); sink: per-head
    sink logits given; window_by_position: the window's keys come from its block table and the tokens' positions
    (else from an index list)."""

    tokens: int
    topk: int
    window: int = 0
    heads: int = 64
    kv_format: str = "fp4"
    swa_format: str = "mxfp8"
    swa: bool = False
    sink: bool = False
    window_by_position: bool = False
    SIZES: ClassVar = ("tokens", "topk", "window")

    @property
    def keys(self) -> int:
        """Selected keys per token, both caches."""
        return self.topk + self.window


def empty_records(problem: CodecProblem, inputs: dict, device) -> torch.Tensor:
    return torch.empty(problem.rows, problem.record_bytes, dtype=torch.uint8, device=device)


def empty_latent(problem: CodecProblem, inputs: dict, device) -> torch.Tensor:
    return torch.empty(problem.rows, LATENT, dtype=torch.float32, device=device)


def empty_attention(problem: AttentionProblem, inputs: dict, device) -> AttentionOutputs:
    return AttentionOutputs(torch.empty(problem.tokens, problem.heads, LATENT, dtype=torch.bfloat16, device=device),
                            torch.empty(problem.tokens, problem.heads, dtype=torch.float32, device=device))


def paged(records: torch.Tensor, block_size: int = CACHE_BLOCK, fill: int = 0) -> torch.Tensor:
    """Records [N, bytes] as a paged cache [ceil(N / block_size), block_size, bytes] (at least one page), the slots
    past N filled with `fill` bytes."""
    blocks = -(-max(records.shape[0], 1) // block_size)
    cache = torch.full((blocks * block_size, records.shape[1]), fill, dtype=torch.uint8, device=records.device)
    cache[: records.shape[0]] = records
    return cache.view(blocks, block_size, records.shape[1])


def window_table(gen: torch.Generator, first: list[int], last: list[int], block_size: int,
                 spare: int = 0) -> tuple[torch.Tensor, int]:
    """A window cache's block table [S, ceil((max(last) + 1) / block_size)] int32 whose sequence s has pages for its
    positions max(first[s], 0) .. last[s] (earlier pages -1), the page ids shuffled over pages + spare; and the
    number of pages the cache needs."""
    width = max(last) // block_size + 1
    table = torch.full((len(last), width), -1, dtype=torch.int32)
    needed = [(s, p) for s in range(len(last))
              for p in range(max(first[s], 0) // block_size, last[s] // block_size + 1)]
    ids = torch.randperm(len(needed) + spare, generator=gen)[: len(needed)]
    for (s, p), page in zip(needed, ids.tolist()):
        table[s, p] = page
    return table, len(needed) + spare


@dataclass(frozen=True)
class KeySplits:
    """How sparse_decode_attention walks its keys: a token's selected keys are key blocks of block_n entries, first
    ceil(topk / block_n) blocks of `indices` (kv_cache), then ceil(window / block_n) blocks of `swa_indices`
    (swa_cache), so that a block reads one cache in one format; `splits` CTAs per (token, head group) take
    `blocks_per_split` consecutive blocks each (the last may take fewer). With one split the first stage writes
    out and lse itself; otherwise it writes fp32 partials (the unnormalized output, the running max and sum per
    split) that a combine stage merges, the sink joining there."""

    kv_blocks: int
    swa_blocks: int
    splits: int
    blocks_per_split: int

    @property
    def blocks(self) -> int:
        return self.kv_blocks + self.swa_blocks


def key_splits(problem: AttentionProblem, block_h: int, block_n: int, max_splits: int) -> KeySplits:
    """Split the keys while tokens x head groups x splits stays within one wave of the H200's SMs (at most
    max_splits splits, at least one key block each; the attention takes one CTA per SM): T = 1, H = 64 with 512 +
    128 keys in blocks of 64 gives 10 splits, T = 64 with all 64 heads in a CTA 2; T >= 66 gives 1."""
    kv_blocks, swa_blocks = -(-problem.topk // block_n), -(-problem.window // block_n)
    blocks = kv_blocks + swa_blocks
    ctas = max(problem.tokens * -(-problem.heads // block_h), 1)
    wanted = max(1, min(max_splits, SMS // ctas, blocks))
    per_split = -(-blocks // wanted) if blocks else 1
    return KeySplits(kv_blocks, swa_blocks, -(-blocks // per_split) if blocks else 1, per_split)

