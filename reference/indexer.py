"""Sparse MQA scoring (the indexer) and top-k selection: the reference (docs/operators.md sections 2, 3).

Scoring, for query rows m with H heads and keys n (dimension D), on dequantized values:

    logits[m, n] = sum_h w[m, h] * relu(q[m, h] . k[n]) * k_scale[n]    for ks[m] <= n < ke[m]
                 = -inf                                                  elsewhere

FP8: k_scale[n] (the key's fp32 scale) multiplies the head sum, as written (and as DeepGEMM applies it), not the
key before the relu: the two agree for the non-negative scales a quantizer writes, and this one is defined for
every scale. MXFP4: the factor is 1; the power-of-two block scales are applied when q and k are unpacked.

Out-of-range values (any int32 index value is memory-safe; nothing outside a tensor is read, and
what an out-of-range value points at counts as padding):
- ks, ke: row m scores key n iff max(ks[m], 0) <= n < min(ke[m], N); empty when ks >= ke.
- paged context lengths: a row's end (below) is clamped to [0, max_blocks * block_size];
  block table entries are read only inside a row's visible range, and an entry outside
  [0, cache blocks) makes its block's positions -inf.
- topk_indices ends, starts: position n is eligible iff max(starts, 0) <= n < min(ends, N).
- candidate_blocks row_end: clamped to [0, N] (the pinned newest block holds min(row_end, N) - 1;
  none when it is <= 0).
- sparse_mqa_logits blocks: an id outside [0, ceil(N / block)) counts as -1 (no candidate).

The logit is computed in fp32; `logits_dtype=torch.bfloat16` (mqa_logits, paged_mqa_logits) stores
it rounded to the nearest bf16 (ties to even; -inf stays -inf), as DeepGEMM's bf16 logits.

Storage forms (the format is told by q's dtype):
- FP8: q [M, H, D] and k [N, D] e4m3; k_scale [N] fp32 per key; q's per-token scale is folded
  into w by the caller.
- MXFP4: q [M, H, D/2] and k [N, D/2] uint8, two e2m1 codes per byte (even element in the low
  nibble; code = sign << 3 | index into 0, 0.5, 1, 1.5, 2, 3, 4, 6), with ue8m0 block scales per
  32 values q_scale [M, H, D/32] and k_scale [N, D/32] (uint8 exponent bytes e, scale 2^(e - 127);
  e = 0 is 2^-127, e = 0xFF is NaN as in OCP MX): an indexer key of D = 128 is 64 B + 4 B = 68 B.
  Scales may also come as DeepGEMM packs them (pack_ue8m0_to_int): int32 [..., ceil(D/128)]
  whose little-endian bytes are the ue8m0 bytes (byte j = block j), read as a zero-copy uint8
  view (`ue8m0_bytes`).
- The FP4 encoder (`quantize_mxfp4`) rounds to the e2m1 grid with a chosen tie rule: "even"
  (round to nearest, ties to the even code: what hardware converters do) or "down" (a value on a
  midpoint takes the lower magnitude: 0.75 -> 0.5, 1.75 -> 1.5, 3.5 -> 3, as DeepGEMM's torch
  encoder); both saturate at 6. Decoding is the same for both.

Decode (`paged_mqa_logits`): sequence b has next_n query tokens (1 to 8); output rows are
b * next_n + j, columns the positions 0 .. max_blocks * block_size - 1 of the sequence, whose keys
live in a paged cache: position p is slot p % block_size of cache block block_table[b, p // block_size].
Row b * next_n + j sees positions [0, end), -inf elsewhere, with context_lens either
- 1-D [B]: end = context_lens[b] - next_n + j + 1 (token j sits at position context_lens[b] - next_n + j), or
- 2-D [B, next_n]: end = context_lens[b, j] (DeepGEMM's per-token lengths).
The cache is either two tensors, data [blocks, block_size, D or D/2] and scales [blocks, block_size]
fp32 / [blocks, block_size, D/32] ue8m0, or DeepGEMM's fused pages (k_scale None): uint8
[blocks, block_size, 1, D + 4] (FP8) or [blocks, block_size, 1, D/2 + 4] (MXFP4) where each page
holds all block_size data rows first, then one 4-byte scale word per token (FP8: the fp32 scale of
token t at page byte block_size * D + 4t; MXFP4: the ue8m0 bytes of token t at block_size * D/2 + 4t),
read as zero-copy views (`fused_cache_views`); the page stride may exceed the page's bytes.

Selection, with the choices the spec leaves open fixed here (every implementation follows them):
- `topk_indices`: per row the k largest among positions [start, end); NaN ranks below every
  number (-inf included); ties go to the lower position; the result lists the chosen
  positions in ascending order (or, with sorted=True, in rank order: largest value first,
  equal values by position), then -1 padding (valid prefix length min(end - start, k)).
  Logits may be fp32 or bf16 (ranked by their exact fp32 values).
- `candidate_blocks`: block score = max of the block's positions below row_end (NaN counts as
  -inf, -0.0 as +0.0); the block holding row_end - 1 scores +inf; the top n_blocks blocks (ties to the lower
  block id) in ascending id order, blocks scoring -inf (or NaN) replaced by -1 at the end.
- `sparse_mqa_logits`: score only the positions inside a row's candidate blocks (and inside
  [ks, ke)), take the top_k of them with the rule above (positions scoring -inf or NaN are not
  taken), and return their absolute positions in candidate-slot order (ascending when the
  blocks are, as candidate_blocks gives them), then -1 padding. Repeated block ids are the
  caller's error (their positions would repeat).
"""

from __future__ import annotations

import torch

from flashkern.reference.formats import (E2M1_GRID, E4M3_MAX, FP4_ROUNDING, UE8M0_BIAS, UE8M0_NAN,  # noqa: F401
                                         e2m1_decode, e2m1_encode, ue8m0_ceil, ue8m0_decode)

MX_BLOCK = 32  # values per ue8m0 scale in the MXFP4 form


# ---------------------------------------------------------------- storage formats


def ue8m0_bytes(scale: torch.Tensor, blocks: int) -> torch.Tensor:
    """ue8m0 scales [..., blocks] uint8 from uint8 bytes (as they are) or from DeepGEMM's packed int32 words
    [..., ceil(blocks / 4)] (little-endian: byte j of the row = block j): a zero-copy view."""
    if scale.dtype != torch.int32:
        return scale
    if scale.shape[-1] == 1 and scale.stride(-1) != 1:  # a one-word row's stride is arbitrary: make it unit
        scale = scale.as_strided(scale.shape, (*scale.stride()[:-1], 1))
    return scale.view(torch.uint8)[..., :blocks]


def unpack_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Dequantize MXFP4: packed [..., D/2] uint8 (even element low nibble), scale [..., D/32] ue8m0 bytes (or
    packed int32 words, see ue8m0_bytes) -> fp32 [..., D]."""
    scale = ue8m0_bytes(scale, packed.shape[-1] * 2 // MX_BLOCK)
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)
    return e2m1_decode(codes) * ue8m0_decode(scale).repeat_interleave(MX_BLOCK, dim=-1)


def quantize_mxfp4(x: torch.Tensor, rounding: str = "even") -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [..., D] -> (packed e2m1 [..., D/2] uint8, ue8m0 scales [..., D/32] uint8).

    Per block of 32: scale = 2^ceil(log2(r)) for the fp32 r = amax / 6, taken from r's bits (exponent, plus one if
    the mantissa is nonzero; at least 2^-126, at most 2^127; byte 0 for an all-zero block), so |x| / scale <= 6;
    codes round x / scale to the nearest e2m1 value, saturating at 6. A value exactly between two grid values goes to
    the even code with rounding="even" (round to nearest even, as hardware converters) or to the lower magnitude
    with rounding="down" (DeepGEMM's torch encoder: 0.75 -> 0.5, 1.75 -> 1.5, 3.5 -> 3). A negative value that
    rounds to 0 (and -0) keeps its sign (code 8, -0) with "even", as hardware converters; "down" never gives -0.
    """
    blocks = x.float().unflatten(-1, (-1, MX_BLOCK))
    scale_byte = ue8m0_ceil(blocks.abs().amax(dim=-1, keepdim=True) / 6.0)
    code = e2m1_encode(blocks / ue8m0_decode(scale_byte), rounding).flatten(-2)
    packed = code[..., 0::2] | (code[..., 1::2] << 4)
    return packed, scale_byte.squeeze(-1).to(torch.uint8)


def quantize_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [..., D] -> (e4m3 [..., D], fp32 scale [...]) with scale = amax / 448 per row (1 for zero rows)."""
    amax = x.float().abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / E4M3_MAX, 1.0)
    return (x.float() / scale[..., None]).to(torch.float8_e4m3fn), scale


def dequantize_queries(q: torch.Tensor, q_scale: torch.Tensor | None) -> torch.Tensor:
    return q.float() if q.dtype == torch.float8_e4m3fn else unpack_mxfp4(q, q_scale)


def fused_cache_views(k_cache: torch.Tensor, fp4: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(data, scales) zero-copy views of DeepGEMM's fused paged cache (module docstring).

    k_cache: uint8 [blocks, block_size, 1, D + 4] (FP8) or [blocks, block_size, 1, D/2 + 4] (MXFP4, D <= 128) with
    unit last stride, tokens packed (stride(1) = bytes per token), page stride and storage offset multiples of 4.
    Returns data [blocks, block_size, D] e4m3 / [blocks, block_size, D/2] uint8 and scales [blocks, block_size] fp32
    / [blocks, block_size, D/32] ue8m0 bytes, with the page stride as their leading stride.
    """
    if k_cache.dtype != torch.uint8 or k_cache.dim() != 4 or k_cache.shape[2] != 1 or k_cache.shape[3] <= 4:
        raise ValueError("k_cache with k_scale=None must be a fused uint8 cache [blocks, block_size, 1, bytes per "
                         f"token], got {str(k_cache.dtype).replace('torch.', '')} {list(k_cache.shape)}")
    blocks, block_size, _, token_bytes = k_cache.shape
    stored = token_bytes - 4  # D e4m3 bytes or D/2 packed e2m1 bytes, then a 4-byte scale word
    page_stride, token_stride, _, byte_stride = k_cache.stride()
    if byte_stride != 1 or (block_size > 1 and token_stride != token_bytes):
        raise ValueError(f"k_cache must be packed within a page (strides [*, {token_bytes}, *, 1], got "
                         f"{list(k_cache.stride())}); pass k_cache.contiguous()")
    if page_stride % 4 or k_cache.storage_offset() % 4:
        raise ValueError(f"k_cache: the page stride ({page_stride}) and storage offset ({k_cache.storage_offset()}) "
                         "must be multiples of 4 (the scale words are 4-byte aligned); pass k_cache.contiguous()")
    if fp4 and stored > 2 * MX_BLOCK:
        raise ValueError(f"k_cache: a fused MXFP4 token holds 4 scale bytes, so D <= 128, got D = {2 * stored}")
    data_bytes = block_size * stored
    data = torch.as_strided(k_cache, (blocks, block_size, stored), (page_stride, stored, 1))
    words = torch.as_strided(k_cache, (blocks, block_size, 4), (page_stride, 4, 1),
                             k_cache.storage_offset() + data_bytes)
    if fp4:
        return data, words[..., : 2 * stored // MX_BLOCK]
    return data.view(torch.float8_e4m3fn), words.view(torch.float32)[..., 0]


# ---------------------------------------------------------------- scoring


def score_keys(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """sum_h w[m, h] * relu(q[m, h] . keys[m?, n]) for dequantized q [M, H, D], w [M, H], keys [N, D] or [M, N, D]."""
    dots = torch.einsum("mhd,nd->mhn" if keys.dim() == 2 else "mhd,mnd->mhn", q, keys)
    return (dots.relu() * w[:, :, None]).sum(dim=1)


def key_logits(q, q_scale, w, k, k_scale) -> torch.Tensor:
    """The module docstring's logits [M, N] before masking, for keys k [N, ..] (k_scale [N, ..]) or per row
    [M, N, ..] (k_scale [M, N, ..]): FP8, the head sum over the e4m3 values times the key's fp32 scale (after the
    relu, so a scale of any sign gives the formula's value); MXFP4, on the unpacked values (their power-of-two
    block scales applied inside the dot products)."""
    queries = dequantize_queries(q, q_scale)
    if k.dtype == torch.float8_e4m3fn:
        return score_keys(queries, w.float(), k.float()) * k_scale.float()
    return score_keys(queries, w.float(), unpack_mxfp4(k, k_scale))


def mqa_logits(q, k, k_scale, w, ks, ke, q_scale=None, logits_dtype=torch.float32) -> torch.Tensor:
    """Dense ragged indexer logits [M, N] fp32 or bf16 (see the module docstring)."""
    logits = key_logits(q, q_scale, w, k, k_scale)
    n = torch.arange(k.shape[0], device=k.device)
    inside = (n >= ks[:, None]) & (n < ke[:, None])
    return logits.masked_fill(~inside, -torch.inf).to(logits_dtype)


def paged_mqa_logits(q, k_cache, k_scale, w, block_table, context_lens, q_scale=None,
                     logits_dtype=torch.float32) -> torch.Tensor:
    """Decode indexer logits [B * next_n, max_blocks * block_size] fp32 or bf16 over a paged key cache (separate
    data and scales, or fused pages with k_scale None); context_lens [B] or [B, next_n].

    Every position of the table is scored and masked (no host reads of the lengths): a row's end is clamped to
    [0, width], and positions in blocks whose table entry is outside [0, cache blocks) are -inf."""
    if k_scale is None:
        k_cache, k_scale = fused_cache_views(k_cache, fp4=q.dtype != torch.float8_e4m3fn)
    batch, next_n = q.shape[:2]
    cache_blocks, block_size = k_cache.shape[:2]
    width = block_table.shape[1] * block_size
    logits = torch.full((batch * next_n, width), -torch.inf, device=q.device)
    if cache_blocks == 0:  # no keys at all
        return logits.to(logits_dtype)
    if context_lens.dim() == 2:
        ends = context_lens.long()
    else:  # token j sits at position context_lens[b] - next_n + j
        ends = context_lens.long()[:, None] - next_n + 1 + torch.arange(next_n, device=q.device)
    visible = torch.arange(width, device=q.device) < ends.clamp(0, width)[:, :, None]  # [B, next_n, width]
    pages = block_table.long()
    followed = ((pages >= 0) & (pages < cache_blocks)).repeat_interleave(block_size, dim=1)  # [B, width]
    pages = pages.clamp(0, cache_blocks - 1)
    for b in range(batch):
        rows = slice(b * next_n, (b + 1) * next_n)
        scores = key_logits(q[b], None if q_scale is None else q_scale[b], w[rows], k_cache[pages[b]].flatten(0, 1),
                            k_scale[pages[b]].flatten(0, 1))  # keys [width, ..]
        logits[rows] = scores.masked_fill(~(visible[b] & followed[b]), -torch.inf)
    return logits.to(logits_dtype)


# ---------------------------------------------------------------- selection


def order_keys(values: torch.Tensor) -> torch.Tensor:
    """int64 keys with the order of fp32 values, NaN below -inf: key(a) > key(b) iff a ranks above b."""
    bits = values.float().contiguous().view(torch.int32).long()
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # IEEE order as signed integers
    return torch.where(torch.isnan(values), -(2**31), ordered + 1)  # NaN below -inf


def _rank_keys(values: torch.Tensor, eligible: torch.Tensor) -> torch.Tensor:
    """Non-negative int64 keys ordering eligible values by the rule (ties to the lower position); -1 if ineligible."""
    position = torch.arange(values.shape[-1], device=values.device)
    key = (order_keys(values) + 2**31) * 2**22 + (2**22 - 1 - position)  # positions < 2^22 (4M)
    return torch.where(eligible, key, -1)


def select_topk(values: torch.Tensor, eligible: torch.Tensor, k: int, *, by_score: bool = False) -> torch.Tensor:
    """Per row, the positions of the k largest eligible values (rule above), then -1 padding: int32 [M, k].

    The positions come in ascending order, or with by_score in rank order (the largest value first; equal
    values by position)."""
    rows, n = values.shape
    out = torch.full((rows, k), -1, dtype=torch.int32, device=values.device)
    if n == 0 or k == 0:
        return out
    take = min(k, n)
    keys, positions = _rank_keys(values, eligible).topk(take, dim=1)  # keys are distinct: rank order
    positions = torch.where(keys >= 0, positions, n)  # ineligible last
    if not by_score:
        positions = positions.sort(dim=1).values
    out[:, :take] = torch.where(positions < n, positions, -1).int()
    return out


def topk_indices(logits, ends, k, starts=None, sorted=False) -> torch.Tensor:
    """Top-k positions per row of logits [M, N] (fp32 or bf16) among [starts, ends) (starts default 0): int32 [M, k],
    ascending, or in rank order when sorted."""
    n = torch.arange(logits.shape[1], device=logits.device)
    eligible = n < ends[:, None]
    if starts is not None:
        eligible &= n >= starts[:, None]
    return select_topk(logits, eligible, k, by_score=sorted)


def block_scores(logits: torch.Tensor, row_end: torch.Tensor, block: int) -> torch.Tensor:
    """Block scores [M, ceil(N / block)]: the max of each block's positions below end = clamp(row_end, 0, N)
    (NaN as -inf, -0.0 as +0.0); the block holding end - 1 scores +inf."""
    rows, n = logits.shape
    nb = -(-n // block)
    end = row_end.clamp(0, n)
    position = torch.arange(nb * block, device=logits.device)
    padded = torch.nn.functional.pad(logits.float(), (0, nb * block - n), value=-torch.inf)
    padded = padded.nan_to_num(nan=-torch.inf, posinf=torch.inf, neginf=-torch.inf)
    padded = torch.where(padded == 0, 0.0, padded)  # -0.0 as +0.0: a block's maximum is one number
    padded = padded.masked_fill(position >= end[:, None], -torch.inf)
    scores = padded.view(rows, nb, block).amax(dim=2)
    newest = (end.long() - 1).div(block, rounding_mode="floor")
    return torch.where(torch.arange(nb, device=logits.device) == newest[:, None], torch.inf, scores)


def candidate_blocks(logits, row_end, n_blocks=2048, block=8) -> torch.Tensor:
    """The V4.1 first level: ids of the n_blocks best blocks of `block` positions per row, int32 [M, n_blocks]."""
    scores = block_scores(logits, row_end, block)
    return select_topk(scores, scores > -torch.inf, n_blocks)


def candidate_positions(blocks: torch.Tensor, block: int, keys: int) -> torch.Tensor:
    """Absolute position of every slot of the candidate blocks [M, n_blocks] of `keys` keys: [M, n_blocks * block],
    -1 in blocks whose id is outside [0, ceil(keys / block)) (-1 included)."""
    offsets = torch.arange(block, device=blocks.device, dtype=torch.int32)
    valid = (blocks >= 0) & (blocks < -(-keys // block))
    positions = torch.where(valid, blocks, 0)[:, :, None] * block + offsets
    return torch.where(valid[:, :, None], positions, -1).flatten(1)


def candidate_scores(q, k, k_scale, w, ks, ke, blocks, block=8, q_scale=None):
    """(positions, scores) of every candidate slot [M, n_blocks * block]; scores are -inf outside [ks, ke), past
    the keys and in blocks without a valid id."""
    positions = candidate_positions(blocks, block, k.shape[0])
    inside = ((positions >= 0) & (positions >= ks[:, None]) & (positions < ke[:, None])
              & (positions < k.shape[0]))
    if k.shape[0] == 0:
        return positions, torch.full(positions.shape, -torch.inf, device=positions.device)
    gathered = positions.clamp(0, k.shape[0] - 1).long()
    scores = key_logits(q, q_scale, w, k[gathered], k_scale[gathered])  # only the candidates' keys
    return positions, scores.masked_fill(~inside, -torch.inf)


def sparse_mqa_logits(q, k, k_scale, w, ks, ke, blocks, top_k=512, block=8, q_scale=None) -> torch.Tensor:
    """V4.1 second level: top_k absolute positions per row, scored only inside candidate blocks, int32 [M, top_k]."""
    positions, scores = candidate_scores(q, k, k_scale, w, ks, ke, blocks, block, q_scale)
    chosen = select_topk(scores, scores > -torch.inf, top_k)
    return torch.where(chosen >= 0, positions.gather(1, chosen.clamp(min=0).long()), -1)
