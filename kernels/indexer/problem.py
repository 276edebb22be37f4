"""Problem descriptions of the indexer family: what one call's shapes and static options are.

Sizes that vary per call (rows, key counts, batch) are dynamic in the kernels; everything else
(heads, dim, storage format, k, block sizes) is part of a kernel's specialization.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from flashkern.kernels.tiles import SMS
from flashkern.registry import SizedProblem


@dataclass(frozen=True)
class Indexer:
    """The indexer of a model: heads x dim and the storage format of q and k."""

    heads: int = 32
    dim: int = 128
    fmt: str = "fp8"  # "fp8": e4m3 with a fp32 scale per key; "mxfp4": packed e2m1 with ue8m0 scales per 32

    @property
    def key(self) -> str:
        return f"H={self.heads} D={self.dim} {self.fmt}"

    @property
    def packed_dim(self) -> int:
        """Stored elements per q head / key row: D e4m3 values or D/2 bytes of e2m1 pairs."""
        return self.dim if self.fmt == "fp8" else self.dim // 2


V41_INDEXER = Indexer(32, 128, "fp8")


@dataclass(frozen=True)
class LogitsProblem(SizedProblem):
    """mqa_logits: M query rows against N keys; bf16_logits: the logits stored as bf16 (else fp32)."""

    rows: int
    keys: int
    indexer: Indexer = V41_INDEXER
    bf16_logits: bool = False
    SIZES: ClassVar = ("rows", "keys")


@dataclass(frozen=True)
class PagedProblem(SizedProblem):
    """paged_mqa_logits: `batch` sequences of next_n query tokens; block tables of max_blocks cache blocks;
    lens_2d: context lengths per token [B, next_n] (else per sequence [B]); bf16_logits: bf16 logits."""

    batch: int
    max_blocks: int
    next_n: int = 1
    block_size: int = 64
    indexer: Indexer = V41_INDEXER
    lens_2d: bool = False
    bf16_logits: bool = False
    SIZES: ClassVar = ("batch", "max_blocks")

    @property
    def width(self) -> int:
        """Output columns: every position a block table can address."""
        return self.max_blocks * self.block_size


@dataclass(frozen=True)
class TopkProblem(SizedProblem):
    """topk_indices: k of `positions` columns per row; by_score: the output in rank order (sorted=True)."""

    rows: int
    positions: int
    k: int = 2048
    has_starts: bool = False
    by_score: bool = False
    bf16_logits: bool = False
    SIZES: ClassVar = ("rows", "positions")


SPLIT_CTAS = SMS  # CTAs a split selection's passes aim for: one an SM
SPLIT_FROM = 1 << 15  # positions per row from which both DSLs' GPU defaults split rows (shorter: the split's three
#                      launches cost more latency than one CTA's passes, Triton model 8.6 against 7.6 us at 8K)


def split_chunk(rows: int, width: int, max_chunks: int, tile: int) -> int:
    """Columns per CTA of a split selection of [rows, width] (both DSLs): up to max_chunks CTAs per row, about
    SPLIT_CTAS in all, each a whole number of `tile`-column tiles; 0 when each row stays in one CTA (the one-launch
    top-k stage)."""
    chunks = min(max_chunks, -(-width // tile), max(1, -(-SPLIT_CTAS // max(rows, 1))))
    return 0 if chunks <= 1 else tile * -(-width // (chunks * tile))


@dataclass(frozen=True)
class CandidateProblem(SizedProblem):
    """candidate_blocks: n_blocks blocks of `block` positions per row of `positions` logits."""

    rows: int
    positions: int
    n_blocks: int = 2048
    block: int = 8
    bf16_logits: bool = False
    SIZES: ClassVar = ("rows", "positions")

    @property
    def blocks(self) -> int:
        """Blocks per row: ceil(positions / block)."""
        return -(-self.positions // self.block)


@dataclass(frozen=True)
class SparseProblem(SizedProblem):
    """sparse_mqa_logits: M rows scored inside n_blocks candidate blocks of `block` keys each, top_k kept."""

    rows: int
    keys: int
    n_blocks: int = 2048
    block: int = 8
    top_k: int = 512
    indexer: Indexer = V41_INDEXER
    SIZES: ClassVar = ("rows", "keys")

    @property
    def candidates(self) -> int:
        """Candidate positions per row: n_blocks * block."""
        return self.n_blocks * self.block


def span_slots(config: dict) -> int:
    """Candidate slots one sparse_mqa_logits span (a program or block) scores: tiles key tiles of block_n."""
    return config["tiles"] * config["block_n"]


def kept_per_span(problem: SparseProblem, config: dict) -> int:
    """Candidates a span keeps: min(top_k, its slots); the row's top_k are among them."""
    return min(problem.top_k, span_slots(config))


def kept_width(problem: SparseProblem, config: dict) -> int:
    """Kept candidates of a row over all its spans: the width the merge reads."""
    return -(-problem.candidates // span_slots(config)) * kept_per_span(problem, config)


def causal_ends(rows: int, keys: int) -> torch.Tensor:
    """ke of a causal prefill chunk: the M rows are the last M positions of the N keys."""
    return (torch.arange(rows) + keys - rows + 1).clamp(0, keys).int()
