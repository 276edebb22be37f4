"""DeepGEMM's indexer ("MQA logits") functions with DeepGEMM's call signatures and return conventions.

    from flashkern.compat.deep_gemm import fp8_fp4_mqa_logits, fp8_fp4_paged_mqa_logits, ...

Each function lands on flashkern.ops.mqa_logits / paged_mqa_logits (`backend=` picks the implementation, "auto"
by default) and takes DeepGEMM's layouts as zero-copy views:
- q = (values, sf or None): FP8 when sf is None (e4m3 values, no q scale: fold it into the weights), else MXFP4
  (int8 packed e2m1 pairs, even element in the low nibble, and one int32 word per (token, head) whose
  little-endian bytes are the ue8m0 scales of its D/32 blocks); kv = (values, sf) alike: e4m3 [N, D] with fp32
  [N], or int8 [N, D/2] with int32 [N].
- The paged cache is DeepGEMM's fused uint8 [blocks, block_kv, 1, D + 4] (FP8) or [.., D/2 + 4] (MXFP4) tensor
  (layout in flashkern.reference.indexer); context_lens [B] (token j of sequence b sees positions
  < context_lens[b] - next_n + j + 1) or [B, next_n] (row b * next_n + j sees positions < context_lens[b, j]).

Where we differ from DeepGEMM:
- clean_logits: every position a row may not see is -inf whatever clean_logits says (DeepGEMM leaves it
  unspecified when not cleaning, so this is one of its allowed outcomes); clean_logits=True is also accepted
  with compressed logits and with 2-D context lengths, which DeepGEMM refuses.
- Outputs are plain tensors: [M, N] contiguous where DeepGEMM returns a view of a buffer with padded rows;
  compressed logits (max_seqlen_k > 0) are gathered from the full [M, N] logits (so the memory saving of
  DeepGEMM's compressed mode is not had); paged logits are a column slice of ours when max_context_len is at
  most max_blocks * block_kv, else padded with -inf.
- ks / ke are clamped to [0, N], as DeepGEMM's kernel does; after that ks <= ke is required.
- get_paged_mqa_logits_metadata returns zeros: our kernels need no schedule (the argument is taken and unused).
- Weights may be fp32 or bf16 (DeepGEMM: bf16 only on SM100 with bf16 logits); the head reduction is fp32.
- Any number of heads, D a power of two in [32, 512] (FP4: D <= 128 in the fused cache), next_n 1 to 8,
  any block_kv, and our kernels run on sm_80+ (FP4 included) and on CPU.
- Not supported: indices= (varlen), which raises NotImplementedError.
"""

from __future__ import annotations

import torch

from flashkern.kernels.indexer import mqa_logits, paged_mqa_logits

__all__ = ["fp8_mqa_logits", "fp8_fp4_mqa_logits", "get_paged_mqa_logits_metadata", "fp8_paged_mqa_logits",
           "fp8_fp4_paged_mqa_logits"]


def _bytes(values: torch.Tensor) -> torch.Tensor:
    """DeepGEMM's int8 packed e2m1 pairs as the uint8 bytes we take (zero-copy)."""
    return values.view(torch.uint8) if values.dtype == torch.int8 else values


def _words(sf: torch.Tensor) -> torch.Tensor:
    """DeepGEMM's int32 ue8m0 words, one per row, as [..., 1]: the packed form our scale arguments take."""
    return sf.unsqueeze(-1) if sf.dtype == torch.int32 else sf


def _queries(q) -> tuple[torch.Tensor, torch.Tensor | None]:
    values, sf = q
    return (values, None) if sf is None else (_bytes(values), _words(sf))


def _keys(values: torch.Tensor, sf: torch.Tensor, fp4: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return (_bytes(values), _words(sf)) if fp4 else (values, sf)


def _weights(weights: torch.Tensor) -> torch.Tensor:
    return weights.float() if weights.dtype == torch.bfloat16 else weights


def _no_indices(indices) -> None:
    if indices is not None:
        raise NotImplementedError("indices (DeepGEMM's varlen paged mode) is not supported: pass indices=None")


def fp8_fp4_mqa_logits(q, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end, clean_logits: bool = True,
                       max_seqlen_k: int = 0, logits_dtype=torch.float32, *, backend: str = "auto") -> torch.Tensor:
    """logits[i, j] = sum_h relu(q[i, h] . kv[j] * kv_sf[j]) * weights[i, h] for ks[i] <= j < ke[i], else -inf.

    Args (DeepGEMM's):
        q: (q [M, H, D] e4m3, None) or (q [M, H, D/2] int8 packed e2m1, q_sf [M, H] int32 packed ue8m0).
        kv: (kv [N, D] e4m3, kv_sf [N] fp32) or (kv [N, D/2] int8, kv_sf [N] int32).
        weights: [M, H] fp32 (or bf16).  cu_seq_len_k_start, cu_seq_len_k_end: [M] int32 ks, ke.
        clean_logits: accepted; positions outside [ks, ke) are always -inf.
        max_seqlen_k: 0 for logits [M, N]; > 0 for compressed logits [M, max_seqlen_k] whose column j is key
            ks[i] + j (-inf where j >= ke[i] - ks[i]).
        logits_dtype: torch.float32 or torch.bfloat16.
        backend: "auto" | "reference" | "triton" | "tilelang".
    """
    q_values, q_scale = _queries(q)
    k, k_scale = _keys(*kv, fp4=q_scale is not None)
    keys = k.shape[0]
    ks, ke = cu_seq_len_k_start.clamp(0, keys), cu_seq_len_k_end.clamp(0, keys)
    logits = mqa_logits(q_values, k, k_scale, _weights(weights), ks, ke, q_scale=q_scale, logits_dtype=logits_dtype,
                        backend=backend)
    if max_seqlen_k <= 0:
        return logits
    if keys == 0:
        return torch.full((logits.shape[0], max_seqlen_k), -torch.inf, dtype=logits.dtype, device=logits.device)
    offset = torch.arange(max_seqlen_k, device=logits.device)
    column = (ks[:, None] + offset).clamp(max=keys - 1).long()
    return logits.gather(1, column).masked_fill(offset >= (ke - ks)[:, None], -torch.inf)


def fp8_mqa_logits(q, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end, clean_logits: bool = True,
                   max_seqlen_k: int = 0, *, backend: str = "auto") -> torch.Tensor:
    """DeepGEMM's legacy FP8 form: q [M, H, D] e4m3 (no q scale), kv = (e4m3 [N, D], fp32 [N]); fp32 logits."""
    return fp8_fp4_mqa_logits((q, None), kv, weights, cu_seq_len_k_start, cu_seq_len_k_end, clean_logits,
                              max_seqlen_k, backend=backend)


def get_paged_mqa_logits_metadata(context_lens, block_kv: int, num_sms: int, indices=None) -> torch.Tensor:
    """DeepGEMM's schedule for paged_mqa_logits: our kernels need none, so this is int32 zeros [num_sms + 1, 2] on
    context_lens' device (pass it on; it is not read)."""
    _no_indices(indices)
    return torch.zeros(num_sms + 1, 2, dtype=torch.int32, device=context_lens.device)


def fp8_fp4_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, schedule_meta, max_context_len: int,
                             clean_logits: bool = False, logits_dtype=torch.float32, indices=None, *,
                             backend: str = "auto") -> torch.Tensor:
    """Decode logits [B * next_n, max_context_len] over DeepGEMM's fused paged cache; rows b * next_n + j.

    Args (DeepGEMM's):
        q: (q [B, next_n, H, D] e4m3, None) or (q [B, next_n, H, D/2] int8, q_sf [B, next_n, H] int32).
        kv_cache: uint8 [blocks, block_kv, 1, D + 4] (FP8) or [blocks, block_kv, 1, D/2 + 4] (MXFP4), fused pages.
        weights: [B * next_n, H] fp32 (or bf16).  context_lens: [B] or [B, next_n] int32.
        block_table: [B, max_blocks] int32.  schedule_meta: from get_paged_mqa_logits_metadata (unused).
        max_context_len: output columns.  clean_logits: accepted; positions a row may not see are always -inf.
        logits_dtype: torch.float32 or torch.bfloat16.  indices: must be None (varlen is not supported).
        backend: "auto" | "reference" | "triton" | "tilelang".
    Returns: a view of our logits [B * next_n, max_blocks * block_kv] sliced to max_context_len columns, or those
    logits padded with -inf when max_context_len is larger.
    """
    _no_indices(indices)
    q_values, q_scale = _queries(q)
    logits = paged_mqa_logits(q_values, kv_cache, None, _weights(weights), block_table, context_lens,
                              q_scale=q_scale, logits_dtype=logits_dtype, backend=backend)
    width = logits.shape[1]
    if max_context_len <= width:
        return logits[:, :max_context_len]
    return torch.nn.functional.pad(logits, (0, max_context_len - width), value=-torch.inf)


def fp8_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, schedule_meta, max_context_len: int,
                         clean_logits: bool = False, indices=None, *, backend: str = "auto") -> torch.Tensor:
    """DeepGEMM's legacy FP8 form: q [B, next_n, H, D] e4m3 (no q scale), fused FP8 cache; fp32 logits."""
    return fp8_fp4_paged_mqa_logits((q, None), kv_cache, weights, context_lens, block_table, schedule_meta,
                                    max_context_len, clean_logits, torch.float32, indices, backend=backend)
