"""KV-cache records and sparse decode attention: the reference (docs/operators.md section 8).

Records. A latent row of 512 values (bf16) is stored as one uint8 record:

    "fp4"    288 B: bytes [0, 256) e2m1 codes, two per byte (even element in the low nibble), then
             bytes [256, 288) one e4m3 scale per 16 values (block b covers values 16b .. 16b + 15).
             sf = e4m3(clamp(amax / 6, 2^-9, 448)); code = e2m1(x / sf) with the division in IEEE fp32
             and rounding to nearest, ties to the even code, saturating at 6.
             value = e2m1 value * sf.
    "mxfp8"  528 B: bytes [0, 512) e4m3 codes, then bytes [512, 528) one ue8m0 scale byte per 32 values.
             e = ceil_ue8m0(amax / 448) at least 1 (so the scale 2^(e - 127) is a normal fp32);
             code = e4m3(x / 2^(e - 127)), round to nearest even (never saturates: |x| <= 448 * scale).
             value = e4m3 value * 2^(e - 127).

Special inputs (the encoders' rules, every implementation bit-exact):
- zero and bf16 subnormals quantize like any value (a zero block: fp4 scale 2^-9, mxfp8 scale 2^-126, zero codes;
  -0 keeps its sign bit);
- +-inf saturates: fp4 scale 448 and code +-6 (value +-2688); mxfp8 scale 2^127 and code +-448 (which
  dequantizes to +-inf again: 448 * 2^127 is beyond fp32), the block's finite values to 0;
- a block holding a NaN stores the NaN scale code (fp4: e4m3 0x7F; mxfp8: ue8m0 0xFF) and zero codes, so the whole
  block dequantizes to NaN.

Paged caches: a cache is uint8 [blocks, block_size, record bytes] (any page stride); slot s is row s % block_size of
page s // block_size. kv_cache_insert writes the records of new tokens at their slots; slot -1 is skipped, and so
is a slot outside [0, blocks * block_size) (an error in checked mode); nothing else is written. Repeated valid
slots are the caller's error (which record lands is unspecified; checked mode refuses them).

Sparse decode attention (MQA over the latent: keys and values are the same dequantized rows):

    s[t, h, j] = scale * q[t, h] . kv[j]      for every selected key j of token t (both caches)
    d[t, h]    = sum_j exp(s[t, h, j]) + exp(sink[h])       (sink only in the denominator; none without sink)
    out[t, h]  = bf16(sum_j exp(s[t, h, j]) / d[t, h] * kv[j]),  lse[t, h] = log d[t, h]

The selected keys of token t are kv_cache[indices[t, i]] and swa_cache[swa_indices[t, i]] for entries that are not
-1 (padding) and are in range (out-of-range entries are padding, an error in checked mode); a slot listed twice
counts twice. A token with no selected key gives out 0 and lse = sink[h] (-inf without a sink). Scores and
softmax in fp32 on the dequantized values; scale defaults to 512^-0.5.

The window by position (in place of swa_indices): token t at position p = positions[t] of sequence s = seq_ids[t]
sees the window-cache keys j with p - window < j <= p and j >= max(0, swa_lower[s]) (the bounded replay's lower
bound; none: 0), found through the window cache's block table: key j is at slot swa_block_table[s, j // block_size]
* block_size + j % block_size; a table entry -1, j // block_size past the table's width, or s outside its rows
give no key (window_slots).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from flashkern.reference.formats import (E2M1_MAX, E4M3_MAX, E4M3_NAN, UE8M0_NAN, e2m1_decode, e2m1_encode,
                                         e4m3_decode, e4m3_encode, mxfp8_decode, ue8m0_ceil,
                                         ue8m0_decode)

LATENT = 512  # values per record
WINDOW = 128  # keys of the sliding window (positions p - 127 .. p)


class Format(NamedTuple):
    """A record layout: `values` codes of `code_bits` bits, then one scale byte per `group` values."""

    name: str
    code_bits: int
    group: int

    @property
    def code_bytes(self) -> int:
        return LATENT * self.code_bits // 8

    @property
    def scales(self) -> int:
        return LATENT // self.group

    @property
    def bytes(self) -> int:
        return self.code_bytes + self.scales


FORMATS = {"fp4": Format("fp4", 4, 16), "mxfp8": Format("mxfp8", 8, 32)}
FP4_MIN_SCALE = 2.0**-9  # the smallest e4m3 subnormal
MXFP8_MIN_EXPONENT = 1  # ue8m0 byte: scales stay normal fp32 numbers (2^-126 and up)


class AttentionOutputs(NamedTuple):
    out: torch.Tensor  # [T, H, 512] bf16
    lse: torch.Tensor  # [T, H] fp32


# ---------------------------------------------------------------- records


def quantize_kv(latent: torch.Tensor, format: str = "fp4") -> torch.Tensor:
    """latent [N, 512] (bf16) -> records [N, bytes] uint8 in `format` (module docstring)."""
    fmt = FORMATS[format]
    x = latent.float().unflatten(-1, (fmt.scales, fmt.group))  # [N, scales, group]
    amax = x.abs().amax(dim=-1, keepdim=True)
    has_nan = torch.isnan(x).any(dim=-1, keepdim=True)
    if format == "fp4":
        sf = e4m3_encode((amax / E2M1_MAX).clamp(FP4_MIN_SCALE, E4M3_MAX))
        codes = e2m1_encode(x / e4m3_decode(sf))
        scale_bytes = torch.where(has_nan, E4M3_NAN, sf)
    else:
        exponent = ue8m0_ceil(amax / E4M3_MAX).clamp(min=MXFP8_MIN_EXPONENT)
        codes = e4m3_encode(x / ue8m0_decode(exponent))
        scale_bytes = torch.where(has_nan, UE8M0_NAN, exponent)
    codes = torch.where(has_nan, 0, codes).to(torch.uint8).flatten(-2)
    if format == "fp4":
        codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return torch.cat((codes, scale_bytes.squeeze(-1).to(torch.uint8)), dim=-1)


def dequantize_kv(records: torch.Tensor, format: str = "fp4") -> torch.Tensor:
    """records [N, bytes] uint8 -> fp32 [N, 512] (module docstring)."""
    fmt = FORMATS[format]
    codes, scale_bytes = records[..., : fmt.code_bytes], records[..., fmt.code_bytes:]
    if format == "mxfp8":
        return mxfp8_decode(codes, scale_bytes, fmt.group)
    values = e2m1_decode(torch.stack((codes & 0xF, codes >> 4), dim=-1).flatten(-2))
    scales = e4m3_decode(scale_bytes.contiguous())
    return (values.unflatten(-1, (fmt.scales, fmt.group)) * scales[..., None]).flatten(-2)


# ---------------------------------------------------------------- paged caches


def cache_rows(cache: torch.Tensor) -> torch.Tensor:
    """A paged cache [blocks, block_size, bytes] as its slots [blocks * block_size, bytes] (a copy if pages are
    strided)."""
    return cache.reshape(-1, cache.shape[-1])


def valid_slots(slots: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """Which slot values address a row of the cache (-1 and out-of-range values do not)."""
    return (slots >= 0) & (slots < cache.shape[0] * cache.shape[1])


def kv_cache_insert(cache: torch.Tensor, slots: torch.Tensor, latent: torch.Tensor, format: str = "fp4") -> torch.Tensor:
    """The cache after writing quantize_kv(latent[i]) at slot slots[i] for every valid slot: a new tensor."""
    rows = cache_rows(cache).clone()
    keep = valid_slots(slots, cache)
    rows[slots[keep].long()] = quantize_kv(latent[keep], format)
    return rows.view(cache.shape)


def gather_keys(cache: torch.Tensor, indices: torch.Tensor, format: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(dequantized rows [T, n, 512] fp32 with padding rows 0, selected [T, n] bool) for slot indices [T, n]."""
    selected = valid_slots(indices, cache)
    rows = cache_rows(cache)[torch.where(selected, indices, 0).long()]
    keys = dequantize_kv(rows, format)
    return torch.where(selected[..., None], keys, 0.0), selected


def window_slots(positions: torch.Tensor, seq_ids: torch.Tensor, block_table: torch.Tensor, block_size: int,
                 window: int = WINDOW, lower: torch.Tensor | None = None) -> torch.Tensor:
    """The window cache's slots [T, window] int64 each query token sees (module docstring): entry i of token t is
    key j = positions[t] - window + 1 + i, -1 where it is not seen or has no page."""
    sequences, width = block_table.shape
    seq = seq_ids.long()
    known = (seq >= 0) & (seq < sequences)
    row = seq.clamp(0, max(sequences - 1, 0))
    low = torch.zeros_like(seq) if lower is None else lower.long()[row].clamp(min=0)
    key = positions.long()[:, None] - window + 1 + torch.arange(window, device=positions.device)[None, :]
    seen = known[:, None] & (key >= low[:, None]) & (key < width * block_size)
    page = block_table.long()[row[:, None], torch.where(seen, key, 0) // block_size] if width else key
    slot = page * block_size + key % block_size
    return torch.where(seen & (page >= 0), slot, -1)


# ---------------------------------------------------------------- attention


def sparse_decode_attention(q, kv_cache, indices, swa_cache=None, swa_indices=None, sink=None, scale=None,
                            kv_format="fp4", swa_format="mxfp8", swa_block_table=None, positions=None, seq_ids=None,
                            window=None, swa_lower=None) -> AttentionOutputs:
    """Sparse MQA attention of q [T, H, 512] over the selected latent rows of both caches (module docstring); the
    window by swa_indices, or by position (swa_block_table, positions, seq_ids, window = WINDOW, swa_lower)."""
    if swa_block_table is not None:
        swa_indices = window_slots(positions, seq_ids, swa_block_table, swa_cache.shape[1],
                                   WINDOW if window is None else window, swa_lower)
    keys, selected = gather_keys(kv_cache, indices, kv_format)
    if swa_cache is not None:
        window, in_window = gather_keys(swa_cache, swa_indices, swa_format)
        keys, selected = torch.cat((keys, window), dim=1), torch.cat((selected, in_window), dim=1)
    scale = LATENT**-0.5 if scale is None else scale
    scores = torch.einsum("thd,tnd->thn", q.float(), keys) * scale
    scores = torch.where(selected[:, None, :], scores, -math.inf)
    extra = torch.full(scores.shape[:2], -math.inf, device=q.device) if sink is None else sink.float().expand(scores.shape[:2])
    lse = torch.logsumexp(torch.cat((scores, extra[..., None]), dim=-1), dim=-1)  # -inf when nothing is selected
    weights = torch.where(selected[:, None, :], torch.exp(scores - lse[..., None]), 0.0)
    out = torch.einsum("thn,tnd->thd", weights, keys)
    return AttentionOutputs(out.to(torch.bfloat16), lse)
