"""Sparse MQA scoring (the indexer) and top-k selection: the reference (SPECS.md section 2).

Scoring, for query rows m with H heads and keys n (dimension D), on dequantized values:

    logits[m, n] = sum_h w[m, h] * relu(q[m, h] . k[n]) * k_scale[n]    for ks[m] <= n < ke[m]
                 = -inf                                                  elsewhere

Storage forms (the format is told by q's dtype):
- FP8: q [M, H, D] and k [N, D] e4m3; k_scale [N] fp32 per key; q's per-token scale is folded
  into w by the caller.
- MXFP4: q [M, H, D/2] and k [N, D/2] uint8, two e2m1 codes per byte (even element in the low
  nibble), with ue8m0 block scales q_scale [M, H, D/32] and k_scale [N, D/32] (uint8 exponent
  bytes e, scale 2^(e - 127)): an indexer key of D = 128 is 64 B + 4 B = 68 B.

Decode (`paged_mqa_logits`): sequence b has next_n query tokens; token j sits at position
context_lens[b] - next_n + j and sees positions [0, context_lens[b] - next_n + j + 1) of its
sequence, whose keys live in a paged cache: position p is slot p % block_size of cache block
block_table[b, p // block_size]. Output rows are b * next_n + j, columns the positions
0 .. max_blocks * block_size - 1.

Selection, with the choices the spec leaves open fixed here (every implementation follows them):
- `topk_indices`: per row the k largest among positions [start, end); NaN ranks below every
  number (-inf included); ties go to the lower position; the result lists the chosen
  positions in ascending order, then -1 padding (valid prefix length min(end - start, k)).
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

E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitudes of e2m1 codes 0..7; bit 3 is the sign
E4M3_MAX = 448.0
MX_BLOCK = 32  # values per ue8m0 scale in the MXFP4 form
UE8M0_BIAS = 127


# ---------------------------------------------------------------- storage formats


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """fp32 value of each e2m1 code (0..15)."""
    grid = torch.tensor(E2M1_GRID, device=codes.device)
    value = grid[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -value, value)


def unpack_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Dequantize MXFP4: packed [..., D/2] uint8 (even element low nibble), scale [..., D/32] ue8m0 -> fp32 [..., D]."""
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)
    block_scale = torch.exp2(scale.float() - UE8M0_BIAS).repeat_interleave(MX_BLOCK, dim=-1)
    return e2m1_decode(codes) * block_scale


def quantize_mxfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [..., D] -> (packed e2m1 [..., D/2] uint8, ue8m0 scales [..., D/32] uint8).

    Per block of 32: scale = 2^ceil(log2(amax / 6)) (so |x| / scale <= 6); codes round x / scale
    to the nearest e2m1 value, ties to the even code.
    """
    blocks = x.float().unflatten(-1, (-1, MX_BLOCK))
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    exponent = torch.ceil(torch.log2(amax / 6.0)).nan_to_num(0.0, neginf=-UE8M0_BIAS).clamp(-UE8M0_BIAS, UE8M0_BIAS)
    magnitude = (blocks.abs() / torch.exp2(exponent)).clamp(max=6.0)
    grid = torch.tensor(E2M1_GRID, device=x.device)
    midpoints = (grid[1:] + grid[:-1]) / 2
    code = torch.searchsorted(midpoints, magnitude.contiguous())  # a midpoint itself goes to the lower code
    tie = (code < len(midpoints)) & (magnitude == midpoints[code.clamp(max=len(midpoints) - 1)])
    code = code + (tie & (code % 2 == 1)).long()  # ... unless that code is odd: ties to even
    code = (code | torch.where(blocks < 0, 8, 0)).to(torch.uint8).flatten(-2)
    packed = code[..., 0::2] | (code[..., 1::2] << 4)
    return packed, (exponent.squeeze(-1) + UE8M0_BIAS).to(torch.uint8)


def quantize_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [..., D] -> (e4m3 [..., D], fp32 scale [...]) with scale = amax / 448 per row (1 for zero rows)."""
    amax = x.float().abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / E4M3_MAX, 1.0)
    return (x.float() / scale[..., None]).to(torch.float8_e4m3fn), scale


def dequantize_keys(k: torch.Tensor, k_scale: torch.Tensor) -> torch.Tensor:
    """Keys as fp32 [..., D] with their scale applied: e4m3 * per-key scale, or MXFP4 blocks."""
    if k.dtype == torch.float8_e4m3fn:
        return k.float() * k_scale[..., None]
    return unpack_mxfp4(k, k_scale)


def dequantize_queries(q: torch.Tensor, q_scale: torch.Tensor | None) -> torch.Tensor:
    return q.float() if q.dtype == torch.float8_e4m3fn else unpack_mxfp4(q, q_scale)


# ---------------------------------------------------------------- scoring


def score_keys(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """sum_h w[m, h] * relu(q[m, h] . keys[m?, n]) for dequantized q [M, H, D], w [M, H], keys [N, D] or [M, N, D]."""
    dots = torch.einsum("mhd,nd->mhn" if keys.dim() == 2 else "mhd,mnd->mhn", q, keys)
    return (dots.relu() * w[:, :, None]).sum(dim=1)


def mqa_logits(q, k, k_scale, w, ks, ke, q_scale=None) -> torch.Tensor:
    """Dense ragged indexer logits [M, N] fp32 (see the module docstring)."""
    logits = score_keys(dequantize_queries(q, q_scale), w.float(), dequantize_keys(k, k_scale))
    n = torch.arange(k.shape[0], device=k.device)
    inside = (n >= ks[:, None]) & (n < ke[:, None])
    return logits.masked_fill(~inside, -torch.inf)


def paged_mqa_logits(q, k_cache, k_scale, w, block_table, context_lens, q_scale=None) -> torch.Tensor:
    """Decode indexer logits [B * next_n, max_blocks * block_size] fp32 over a paged key cache."""
    batch, next_n = q.shape[:2]
    block_size = k_cache.shape[1]
    width = block_table.shape[1] * block_size
    positions = torch.arange(width, device=q.device)
    logits = torch.full((batch * next_n, width), -torch.inf, device=q.device)
    for b in range(batch):
        ends = context_lens[b] - next_n + 1 + torch.arange(next_n, device=q.device)  # per query token
        seen = int(ends.max().clamp(min=0))
        blocks = block_table[b, : -(-seen // block_size)].long()
        keys = dequantize_keys(k_cache[blocks], k_scale[blocks]).flatten(0, 1)[:seen]
        rows = slice(b * next_n, (b + 1) * next_n)
        queries = dequantize_queries(q[b], None if q_scale is None else q_scale[b])
        scores = score_keys(queries, w[rows].float(), keys)
        logits[rows, :seen] = scores.masked_fill(positions[:seen] >= ends[:, None], -torch.inf)
    return logits


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


def select_topk(values: torch.Tensor, eligible: torch.Tensor, k: int) -> torch.Tensor:
    """Per row, the ascending positions of the k largest eligible values (rule above), then -1 padding: int32 [M, k]."""
    rows, n = values.shape
    out = torch.full((rows, k), -1, dtype=torch.int32, device=values.device)
    if n == 0 or k == 0:
        return out
    take = min(k, n)
    keys, positions = _rank_keys(values, eligible).topk(take, dim=1)
    positions = torch.where(keys >= 0, positions, n).sort(dim=1).values  # ineligible sort last
    out[:, :take] = torch.where(positions < n, positions, -1).int()
    return out


def topk_indices(logits, ends, k, starts=None) -> torch.Tensor:
    """Top-k positions per row of logits [M, N] among [starts, ends) (starts default 0): int32 [M, k]."""
    n = torch.arange(logits.shape[1], device=logits.device)
    eligible = n < ends[:, None]
    if starts is not None:
        eligible &= n >= starts[:, None]
    return select_topk(logits, eligible, k)


def block_scores(logits: torch.Tensor, row_end: torch.Tensor, block: int) -> torch.Tensor:
    """Block scores [M, ceil(N / block)]: the max of each block's positions below row_end (NaN as -inf,
    -0.0 as +0.0); the block holding row_end - 1 scores +inf."""
    rows, n = logits.shape
    nb = -(-n // block)
    position = torch.arange(nb * block, device=logits.device)
    padded = torch.nn.functional.pad(logits.float(), (0, nb * block - n), value=-torch.inf)
    padded = padded.nan_to_num(nan=-torch.inf, posinf=torch.inf, neginf=-torch.inf)
    padded = torch.where(padded == 0, 0.0, padded)  # -0.0 as +0.0: a block's maximum is one number
    padded = padded.masked_fill(position >= row_end[:, None], -torch.inf)
    scores = padded.view(rows, nb, block).amax(dim=2)
    newest = (row_end.long() - 1).div(block, rounding_mode="floor")
    has_newest = row_end > 0
    scores[has_newest, newest[has_newest]] = torch.inf
    return scores


def candidate_blocks(logits, row_end, n_blocks=2048, block=8) -> torch.Tensor:
    """The V4.1 first level: ids of the n_blocks best blocks of `block` positions per row, int32 [M, n_blocks]."""
    scores = block_scores(logits, row_end, block)
    return select_topk(scores, scores > -torch.inf, n_blocks)


def candidate_positions(blocks: torch.Tensor, block: int) -> torch.Tensor:
    """Absolute position of every slot of the candidate blocks [M, n_blocks]: [M, n_blocks * block], -1 in -1 blocks."""
    offsets = torch.arange(block, device=blocks.device, dtype=torch.int32)
    positions = blocks[:, :, None] * block + offsets
    return torch.where(blocks[:, :, None] >= 0, positions, -1).flatten(1)


def candidate_scores(q, k, k_scale, w, ks, ke, blocks, block=8, q_scale=None):
    """(positions, scores) of every candidate slot [M, n_blocks * block]; scores are -inf outside [ks, ke), past
    the keys and in -1 blocks."""
    positions = candidate_positions(blocks, block)
    inside = (positions >= ks[:, None]) & (positions < ke[:, None]) & (positions < k.shape[0])
    if k.shape[0] == 0:
        return positions, torch.full(positions.shape, -torch.inf, device=positions.device)
    gathered = positions.clamp(0, k.shape[0] - 1).long()
    keys = dequantize_keys(k[gathered], k_scale[gathered])  # only the candidates' keys
    scores = score_keys(dequantize_queries(q, q_scale), w.float(), keys)
    return positions, scores.masked_fill(~inside, -torch.inf)


def sparse_mqa_logits(q, k, k_scale, w, ks, ke, blocks, top_k=512, block=8, q_scale=None) -> torch.Tensor:
    """V4.1 second level: top_k absolute positions per row, scored only inside candidate blocks, int32 [M, top_k]."""
    positions, scores = candidate_scores(q, k, k_scale, w, ks, ke, blocks, block, q_scale)
    chosen = select_topk(scores, scores > -torch.inf, top_k)
    return torch.where(chosen >= 0, positions.gather(1, chosen.clamp(min=0).long()), -1)
