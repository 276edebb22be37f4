"""Problem descriptions of the mHC family and the outputs every implementation allocates alike.

The per-call sizes (matrices, tokens) are dynamic in the kernels; the hidden size D is part of the
problem (tuning tables are per D) but TileLang and Triton take it at run time as well, so one
compiled kernel serves every D. Scalars (iters and the epsilons) are run-time arguments too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from flashkern.kernels.tiles import SMS
from flashkern.reference.mhc import COLLAPSES, ChainOutputs, PreOutputs, mix_width
from flashkern.registry import SizedProblem

V41_STREAMS = 4
MODEL_HIDDEN = (4096, 5120, 7168)  # D of the V4.1-Flash-class models the spec names


@dataclass(frozen=True)
class SinkhornProblem(SizedProblem):
    """sinkhorn: a batch of `matrices` n x n logit matrices."""

    matrices: int
    n: int = V41_STREAMS
    SIZES: ClassVar = ("matrices",)


@dataclass(frozen=True)
class MhcProblem(SizedProblem):
    """mhc_pre / mhc_post / mhc_post_pre over `tokens` tokens of `streams` x `hidden` residual streams.

    has_norm: the layer input is RMS-normalized (norm_weight given); collapse: what collapses the layer input
    of mhc_pre / mhc_post_pre, one of reference.mhc.COLLAPSES: "fresh" (the pre computed now, V4), "carried"
    (a carried pre-mix, V4.1's delayed pre) or "stream0" (residual stream 0 itself, V4.1 at model entry).
    """

    tokens: int
    hidden: int
    streams: int = V41_STREAMS
    has_norm: bool = False
    collapse: str = "fresh"
    SIZES: ClassVar = ("tokens",)

    def __post_init__(self):
        if self.collapse not in COLLAPSES:
            raise ValueError(f"collapse must be one of {COLLAPSES}, got {self.collapse!r}")

    @property
    def mixes(self) -> int:
        """Mix outputs per token: (2 + n) n."""
        return mix_width(self.streams)

    @property
    def width(self) -> int:
        """Flattened residual width n x D (the GEMM's reduction length)."""
        return self.streams * self.hidden


def empty_sinkhorn_output(problem: SinkhornProblem, inputs: dict, device) -> torch.Tensor:
    """Uninitialized fp32 matrices shaped as x [..., n, n]."""
    return torch.empty(inputs["x"].shape, dtype=torch.float32, device=device)


def empty_pre_outputs(problem: MhcProblem, inputs: dict, device) -> PreOutputs:
    t, n = problem.tokens, problem.streams
    return PreOutputs(
        layer_input=torch.empty(t, problem.hidden, dtype=torch.bfloat16, device=device),
        pre=torch.empty(t, n, dtype=torch.float32, device=device),
        post=torch.empty(t, n, dtype=torch.float32, device=device),
        comb=torch.empty(t, n, n, dtype=torch.float32, device=device),
    )


def empty_residual(problem: MhcProblem, inputs: dict, device) -> torch.Tensor:
    return torch.empty(problem.tokens, problem.streams, problem.hidden, dtype=torch.bfloat16, device=device)


def empty_chain_outputs(problem: MhcProblem, inputs: dict, device) -> ChainOutputs:
    return ChainOutputs(empty_residual(problem, inputs, device), *empty_pre_outputs(problem, inputs, device))


def empty_partials(problem: MhcProblem, splits: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-K partial sums of the GEMM stage, fp32: mixes [splits, T, (2+n)n] and sums of squares [splits, T, 2]
    (of x, and of the layer input where the GEMM stage stores it)."""
    return (torch.empty(splits, problem.tokens, problem.mixes, dtype=torch.float32, device=device),
            torch.empty(splits, problem.tokens, 2, dtype=torch.float32, device=device))


def epilogue_launch(tokens: int, tiles: int) -> str:
    """Who runs the pre block's epilogue by default: "own_launch" (a second launch, a program per token) from 2
    tokens while the token tiles number at most an eighth of the SMs, where each tile's last split would run it
    alone on one SM and leave most SMs idle; else "last_split" (one launch)."""
    return "own_launch" if 1 < tokens and 8 * tiles <= SMS else "last_split"


