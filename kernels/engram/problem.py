"""Problem descriptions of the Engram family: the n-gram hash, the table lookup and the gate.

The token count is dynamic in the kernels; the n-gram shape (max_ngram, heads), whether a history is given, the
lookups per token, where the table lives and the hidden size are each part of a problem (the kernels take the
hidden size at run time too, so one compiled gate serves every D).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from flashkern.reference.engram import ROW_VALUES
from flashkern.registry import SizedProblem

V41_NGRAM, V41_HEADS = 4, 8  # orders 2..4, 8 hash heads each: 24 rows a token
V41_STREAMS = 4  # the hidden streams the gate mixes into (mHC's n)


@dataclass(frozen=True)
class HashProblem(SizedProblem):
    """engram_hash: `tokens` token ids hashed to (max_ngram - 1) x heads row ids each; history: each sequence's
    last ids before the call are given."""

    tokens: int
    max_ngram: int = V41_NGRAM
    heads: int = V41_HEADS
    history: bool = False
    SIZES: ClassVar = ("tokens",)

    @property
    def columns(self) -> int:
        """Row ids a token: orders x heads."""
        return (self.max_ngram - 1) * self.heads


@dataclass(frozen=True)
class LookupProblem(SizedProblem):
    """engram_lookup: `tokens` x `lookups` table rows gathered and dequantized to bf16 [tokens, lookups, 256];
    host: the table is in pinned host memory read by a GPU kernel (UVA), not in the GPU's own memory."""

    tokens: int
    lookups: int = (V41_NGRAM - 1) * V41_HEADS
    host: bool = False
    SIZES: ClassVar = ("tokens",)

    @property
    def rows(self) -> int:
        """Table rows a call reads: tokens x lookups."""
        return self.tokens * self.lookups


@dataclass(frozen=True)
class GateProblem(SizedProblem):
    """engram_gate: `tokens` tokens of `streams` hidden streams of width `hidden`."""

    tokens: int
    hidden: int
    streams: int = V41_STREAMS
    SIZES: ClassVar = ("tokens",)


def empty_rows(problem: HashProblem, inputs: dict, device) -> torch.Tensor:
    return torch.empty(problem.tokens, problem.columns, dtype=torch.int64, device=device)


def empty_values(problem: LookupProblem, inputs: dict, device) -> torch.Tensor:
    return torch.empty(*inputs["rows"].shape, ROW_VALUES, dtype=torch.bfloat16, device=device)


def empty_streams(problem: GateProblem, inputs: dict, device) -> torch.Tensor:
    return torch.empty(problem.tokens, problem.streams, problem.hidden, dtype=torch.bfloat16, device=device)
