"""vLLM's indexer top-k per row ops (`torch.ops._C.top_k_per_row_prefill` / `top_k_per_row_decode`), on topk_indices.

Both write the chosen positions into a caller-allocated `indices` [num_rows, top_k] int32 buffer and return nothing,
as vLLM's ops do; the logits are read through the strides the caller passes (vLLM passes logits.stride(0) and
logits.stride(1)). A row with at most top_k positions gets all of them, then -1; a longer row gets exactly top_k.

Where flashkern differs from vLLM (both are within vLLM's contract, which fixes the chosen set only):
- the chosen positions come in ascending position order (vLLM's kernel leaves long rows in an unspecified order);
- ties at the cut go to the lower position, deterministically (vLLM's are resolved in atomic order);
- NaN ranks below every number.
"""

from __future__ import annotations

import torch

from flashkern import checks
from flashkern.kernels.indexer import topk_indices

__all__ = ["top_k_per_row_prefill", "top_k_per_row_decode"]


def _strided_logits(logits: torch.Tensor, num_rows: int, stride0: int, stride1: int) -> torch.Tensor:
    """The [num_rows, logits.size(1)] view vLLM's kernel reads: row r at r * stride0, column c at c * stride1."""
    checks.tensor("logits", logits, dtype=(torch.float32, torch.bfloat16), shape=(None, None), strided=True)
    checks.integer("num_rows", num_rows, low=0, high=logits.shape[0])
    return logits.as_strided((num_rows, logits.shape[1]), (stride0, stride1))


def _write(indices: torch.Tensor, chosen: torch.Tensor) -> None:
    checks.tensor("indices", indices, dtype=torch.int32, shape=chosen.shape, device=chosen.device)
    indices.copy_(chosen)


def top_k_per_row_prefill(logits, row_starts, row_ends, indices, num_rows, stride0, stride1, top_k, *,
                          backend="auto") -> None:
    """indices[r] = the top_k positions of logits row r within [row_starts[r], row_ends[r]), counted from the row's
    start (vLLM: "indexes already skip the rowStart"), then -1.

    Args: logits [rows, N] fp32 (bf16 also taken); row_starts, row_ends [num_rows] int32; indices [num_rows, top_k]
    int32 (written); stride0, stride1: the logits strides to read with (stride1 must be 1).
    """
    view = _strided_logits(logits, num_rows, stride0, stride1)
    chosen = topk_indices(view, row_ends, top_k, starts=row_starts, backend=backend)
    _write(indices, torch.where(chosen >= 0, chosen - row_starts[:, None], -1))


def decode_row_ends(seq_lens: torch.Tensor, next_n: int, num_rows: int) -> torch.Tensor:
    """Each decode row's end: seq_lens [B, next_n] per row as given, or from seq_lens [B] token r % next_n of
    sequence r // next_n sees seq_lens - next_n + r % next_n + 1 positions; clamped at 0 (vLLM's current rule)."""
    checks.integer("next_n", next_n, low=1)
    if seq_lens.dim() == 2:
        checks.tensor("seq_lens", seq_lens, dtype=torch.int32, shape=(None, next_n))
        ends = seq_lens.reshape(-1)
    else:
        checks.tensor("seq_lens", seq_lens, dtype=torch.int32, shape=(None,))
        offsets = torch.arange(next_n, dtype=torch.int32, device=seq_lens.device)
        ends = (seq_lens[:, None] - next_n + 1 + offsets).reshape(-1)
    if ends.shape[0] != num_rows:
        raise ValueError(f"num_rows={num_rows} does not match seq_lens {list(seq_lens.shape)} with next_n={next_n}")
    return ends.clamp(min=0).int()


def top_k_per_row_decode(logits, next_n, seq_lens, indices, num_rows, stride0, stride1, top_k, *,
                         backend="auto") -> None:
    """indices[r] = the top_k positions of logits row r among [0, end_r) (decode_row_ends), then -1.

    Args: logits [rows, N] fp32 (bf16 also taken); next_n: query tokens per sequence; seq_lens [B] or [B, next_n]
    int32; indices [num_rows, top_k] int32 (written); stride0, stride1: the logits strides to read with.
    """
    view = _strided_logits(logits, num_rows, stride0, stride1)
    ends = decode_row_ends(seq_lens, next_n, num_rows)
    _write(indices, topk_indices(view, ends, top_k, backend=backend))
