"""Top-k selection in Triton: a deterministic radix select per row, and candidate blocks on top of it.

The selection rule is reference.select_topk's: rank by value descending, NaN below every number,
ties to the lower position; emit the chosen positions ascending, then -1 padding.

Order keys: an fp32 bit pattern whose magnitude bits are flipped when negative is an int32 in IEEE
order (-0.0 just below +0.0); NaN takes the lowest int32, below -inf's key. Equal keys are equal
values, so ranking keys descending with ties to the lower position is the rule.

Tile plan of the top-k stage: a program owns BLOCK_M rows and walks their columns [start, end) in
[BLOCK_M, BLOCK_N] tiles; each row has its own 256 histogram bins (one histogram of BLOCK_M x 256).
  1. four radix passes, 8 bits each from the top: histogram the digit of every eligible key whose
     higher digits equal those found so far; scanning a row's bins from the top, the bin
     holding the rank-th largest key gives the next digit, and the rank drops by the keys in the
     bins above. The first pass also counts the eligible keys: rank = min(k, eligible). After the
     last pass `threshold` is the rank-th largest key and `quota` how many keys equal to it are
     taken (the first ones by position).
  2. gather, tiles in ascending order: take every key above the threshold and the first `quota`
     keys equal to it; each taken position goes to its running output slot (a prefix sum of the
     take mask), so the output is ascending and the same on every run.
  3. -1 padding after the taken positions.
Optional per row: starts/ends (default the whole row; any int32, clamped to [0, width]), -inf and NaN not
eligible (drop_neg_inf), and an index map for the sparse path (column c -> blocks[m, c // block] * block + c % block).

With sorted=True a second launch puts the chosen positions in rank order (rank_order_kernel): the
rank of a chosen key is the number of chosen keys above it plus the equal ones at lower positions.

Logits may be fp32 or bf16 and row-strided (unit stride along the row).

Candidate blocks run two launches: block scores (a program per TILE_BLOCKS blocks of the flattened
[rows, blocks] scores, each block a row of a [TILE_BLOCKS, block] tile: the max order key (+0.0 above -0.0) of its
positions below end = clamp(row_end, 0, N), NaN as -inf; the block holding end - 1 is +inf), then the top-k stage
over the scores with -inf not eligible.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

import flashkern
from flashkern.autotune.space import Space
from flashkern.kernels._triton import Launch, register_bound
from flashkern.kernels.indexer.problem import SPLIT_FROM, TopkProblem, split_chunk
from flashkern.kernels.tiles import cdiv, next_power_of_2

NAN_KEY = tl.constexpr(-(2**31))  # the lowest int32: NaN ranks below every number
NEG_INF_KEY = tl.constexpr(-2139095041)  # order key of -inf: 0xFF800000 with its magnitude bits flipped
INF_KEY = tl.constexpr(0x7F800000)  # order key of +inf: its bits
RADIX_BINS = tl.constexpr(256)


@triton.jit
def flip_negative(bits):
    """fp32 bit patterns <-> int32 keys in IEEE order (an involution: negative patterns flip their magnitude bits)."""
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def order_key(x, nan_key):
    """IEEE-ordered int32 key of each fp32 value; NaN gets `nan_key`."""
    return tl.where(x == x, flip_negative(x.to(tl.int32, bitcast=True)), nan_key)


@triton.jit
def _tile_values(row_values, tile, start, end, DROP_NEG_INF: tl.constexpr, BLOCK_N: tl.constexpr, row_positions=None,
                 width=0):
    """Tile `tile` of the rows' columns [BLOCK_M, BLOCK_N]: their positions, fp32 values and which are eligible.

    A column is its own position, or with row_positions (a pointer per row) the position stored there, one of
    [0, width): the candidate list of a split selection (compact_kernel)."""
    col = tile * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    eligible = (col >= start[:, None]) & (col < end[:, None])
    position = col
    if row_positions is not None:
        position = tl.load(row_positions[:, None] + col, mask=eligible, other=0)
        position = tl.minimum(tl.maximum(position, 0), width - 1)  # (always in range, once pass 2 ran)
    x = tl.load(row_values[:, None] + position, mask=eligible, other=0.0).to(tl.float32)  # bf16: exact in fp32
    if DROP_NEG_INF:
        eligible = eligible & (x > float("-inf"))  # false for NaN too
    return position, x, eligible


@triton.jit
def _tile_keys(row_values, tile, start, end, DROP_NEG_INF: tl.constexpr, BLOCK_N: tl.constexpr, row_positions=None,
               width=0):
    """_tile_values with the values' order keys."""
    position, x, eligible = _tile_values(row_values, tile, start, end, DROP_NEG_INF, BLOCK_N, row_positions, width)
    return position, order_key(x, NAN_KEY), eligible


@triton.jit
def _row_span(starts_ptr, ends_ptr, row, row_ok, width):
    """[start, end) of each row: starts and ends (None: 0 and width; any int32) clamped to [0, width], empty rows
    where not row_ok."""
    start = tl.zeros(row.shape, tl.int32)
    if starts_ptr is not None:
        start = tl.maximum(tl.load(starts_ptr + row, mask=row_ok, other=0), 0)
    end = tl.where(row_ok, width, 0)
    if ends_ptr is not None:
        end = tl.minimum(tl.load(ends_ptr + row, mask=row_ok, other=0), width)
    return start, end


@triton.jit
def _first_digit(x):
    """The split selection's first digit of a fp32 value: the top 8 bits (sign, exponent, two mantissa bits:
    quarter-octave bins) of the unsigned order form of x rounded to fp16 (TensorRT-LLM's first pass; +-inf as
    +-65504), NaN 0. Non-decreasing in the order key, so the keys at or above the rank-th largest have digits at or
    above its."""
    finite = tl.minimum(tl.maximum(x, -65504.0), 65504.0)  # fp16's range, so the conversion never overflows
    half = finite.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)  # sign-extended
    digit = ((half ^ ((half >> 15) & 0x7FFF) ^ 0x8000) >> 8) & 0xFF  # negative: magnitude flipped, sign bit clear
    return tl.where(x == x, digit, 0)


@triton.jit
def _half_of_radix(radix):
    """The fp16 value (as fp32) whose unsigned-order form is `radix` (int32 in [0, 65535])."""
    bits = tl.where(radix >= 0x8000, radix ^ 0x8000, radix ^ 0xFFFF)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _lowest_key_of_digit(digit):
    """The lowest key whose _first_digit is >= digit (int32 [1]), so that a pass compares keys instead of computing
    digits. The bin's lowest half h (low 8 bits of its order form 0) and the half below it, hp: fp32 values round
    to h from their midpoint m up; at m itself ties go to the even one, h when h >= +0 (its mantissa ends in 8
    zeros), hp when h < 0 (h's ends in 8 ones). Digit 0 is NaN's (every key), digits <= 4 hold only -65504 (the
    clamped lowest: every key but NaN), digits >= 252 no value (a key above +inf's)."""
    radix = tl.minimum(tl.maximum(digit, 5), 251) << 8  # (the other digits' keys are set below)
    h = _half_of_radix(radix)
    m = (h + _half_of_radix(radix - 1)) * 0.5  # exact in fp32
    key = flip_negative(m.to(tl.int32, bitcast=True)) + (h < 0).to(tl.int32)
    key = tl.where(digit <= 4, NEG_INF_KEY, tl.where(digit >= 252, INF_KEY + 1, key))
    return tl.where(digit == 0, NAN_KEY, key)


@triton.jit
def suffix_sum(x, axis: tl.constexpr):
    """x's sums from each entry to the end of `axis`. A suspect of the first H200 run's wrong top-k rows (reverse
    scans: triton-lang/triton#4362, #8412); a total minus a forward scan spilled the fused sparse select (520 to
    1388 B), so the scan stays until a GPU run decides (tests/test_indexer.py checks it there; docs/gpu.md)."""
    return tl.cumsum(x, axis, reverse=True)


@triton.jit
def _next_digit(histogram, found, quota, shift):
    """One radix pass's result: histogram [BLOCK_M, 256] of the digit at `shift` among the keys whose higher digits
    are `found`; scanning from the top bin, the bin holding the quota-th largest is the digit, and the quota drops by
    the keys in the bins above it."""
    at_or_above = suffix_sum(histogram, 1)
    digit = tl.sum((at_or_above >= quota[:, None]).to(tl.int32), axis=1) - 1
    quota -= tl.sum(tl.where(tl.arange(0, RADIX_BINS)[None, :] > digit[:, None], histogram, 0), axis=1)
    return found | (digit << shift), quota


@triton.jit
def select_in_registers(key, eligible, k):
    """The top-k stage's rule on one row held in registers: key [C] int32 order keys, eligible [C]; returns take [C],
    the min(k, eligible) largest eligible keys (ties to the lower index)."""
    found = tl.zeros((1,), tl.int32)  # as the top-k stage: unsigned-order bits of the threshold, and its quota
    quota = tl.minimum(tl.full((1,), k, tl.int32), tl.sum(eligible.to(tl.int32), axis=0))
    radix = key ^ NAN_KEY
    for p in tl.static_range(4):
        shift = 24 - 8 * p
        counted = eligible
        if p > 0:
            counted = counted & ((radix >> (shift + 8)) == (found >> (shift + 8)))
        histogram = tl.histogram((radix >> shift) & 0xFF, RADIX_BINS, mask=counted)
        found, quota = _next_digit(histogram[None, :], found, quota, shift)
    threshold = found ^ NAN_KEY
    tie = (eligible & (key == threshold)).to(tl.int32)
    return (eligible & (key > threshold)) | ((tie != 0) & (tl.cumsum(tie, 0) - 1 < quota))


@triton.jit
def masked_histogram(bins, counted, NUM_BINS: tl.constexpr):
    """tl.histogram of a tile's `bins` (any shape, values in [0, NUM_BINS)) where `counted`, flattened.

    The mask is folded into the bins (-1 where not counted) before the one reshape and read back from it. A reshape
    that only feeds a histogram may reorder elements on the GPU (each thread's registers reused in order), and two
    tensors of different layouts reshaped apart pair one column's mask with another's bin: the first H200 run's
    wrong top-k rows (docs/gpu.md). One reshape keeps every bin with its own mask (flashkern.kernels.gpu_lint)."""
    flat = tl.reshape(tl.where(counted, bins, -1), (bins.numel,))
    return tl.histogram(flat, NUM_BINS, mask=flat >= 0)


@triton.jit
def _digit_histogram(key, counted, found, shift: tl.constexpr, MATCH_FOUND: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr):
    """One tile's share of a radix pass, [BLOCK_M, 256]: each row's counts of the digit at `shift` among its counted
    keys (with MATCH_FOUND, those whose higher digits are `found`)."""
    radix = key ^ NAN_KEY
    if MATCH_FOUND:
        counted = counted & ((radix >> (shift + 8)) == (found[:, None] >> (shift + 8)))
    bin_of = tl.arange(0, BLOCK_M)[:, None] * RADIX_BINS + ((radix >> shift) & 0xFF)  # a row's own 256 bins
    return tl.reshape(masked_histogram(bin_of, counted, BLOCK_M * RADIX_BINS), (BLOCK_M, RADIX_BINS))


@triton.jit
def _gather_tile(position, key, eligible, threshold, quota, taken, ties_seen, out_row, k, row_blocks,
                 BLOCK: tl.constexpr):
    """One tile of the gather: its keys above the threshold and the ties within the quota go to the rows' next
    output slots, in column order (mapped through the rows' blocks unless row_blocks is None); returns the updated
    counts of taken positions and of ties seen. Slots past k are never written, whatever the counts say (passes
    that disagree cannot write outside the output)."""
    tie = (eligible & (key == threshold)).to(tl.int32)
    tie_rank = ties_seen[:, None] + tl.cumsum(tie, 1) - 1
    take = (eligible & (key > threshold)) | ((tie != 0) & (tie_rank < quota[:, None]))
    slot = taken[:, None] + tl.cumsum(take.to(tl.int32), 1) - 1
    index = position
    if row_blocks is not None:
        index = tl.load(row_blocks + position // BLOCK, mask=take, other=0) * BLOCK + position % BLOCK
    tl.store(out_row + slot, index, mask=take & (slot < k))
    return taken + tl.sum(take.to(tl.int32), axis=1), ties_seen + tl.sum(tie, axis=1)


@triton.jit(do_not_specialize=["rows"])  # per-step sizes: one compile whatever the batch
def topk_kernel(values_ptr, stride_row, rows, width, starts_ptr, ends_ptr, blocks_ptr, stride_blocks, positions_ptr,
                out_ptr, k, DROP_NEG_INF: tl.constexpr, ENDS_BOUND_WALK: tl.constexpr, BLOCK: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = row < rows
    row = row.to(tl.int64)
    row_values = values_ptr + row * stride_row
    row_positions = None
    if positions_ptr is not None:  # columns are the [rows, width] candidate list's entries
        row_positions = positions_ptr + row * width
    start, walk_end = _row_span(starts_ptr, ends_ptr, row, row_ok, width)
    end = walk_end
    if ENDS_BOUND_WALK:  # columns past the ends hold no eligible value: the masks stay uniform over the width
        end = tl.where(row_ok, width, 0)
    first_tile = tl.min(start) // BLOCK_N
    end_tile = tl.cdiv(tl.max(walk_end), BLOCK_N)

    # the first tile stays in registers through every pass (a row of one tile is read once)
    first = _tile_keys(row_values, first_tile, start, end, DROP_NEG_INF, BLOCK_N, row_positions, width)

    # 1. radix select: digits of the rank-th largest key, 8 bits at a time (in the key's unsigned
    #    order, key ^ NAN_KEY), while `quota` counts down to its rank among the keys that share them
    found = tl.zeros((BLOCK_M,), tl.int32)  # unsigned-order bits of the threshold found so far
    quota = tl.full((BLOCK_M,), k, tl.int32)
    for p in tl.static_range(4):
        shift = 24 - 8 * p  # a constexpr: p is static
        histogram = _digit_histogram(first[1], first[2], found, shift, p > 0, BLOCK_M, BLOCK_N)
        for tile in range(first_tile + 1, end_tile):
            _, key, counted = _tile_keys(row_values, tile, start, end, DROP_NEG_INF, BLOCK_N, row_positions, width)
            histogram += _digit_histogram(key, counted, found, shift, p > 0, BLOCK_M, BLOCK_N)
        if p == 0:
            quota = tl.minimum(quota, tl.sum(histogram, axis=1))
        found, quota = _next_digit(histogram, found, quota, shift)
    threshold = (found ^ NAN_KEY)[:, None]

    # 2. gather in ascending column order
    out_row = out_ptr + row[:, None] * k
    row_blocks = None
    if blocks_ptr is not None:
        row_blocks = blocks_ptr + row[:, None] * stride_blocks
    taken = tl.zeros((BLOCK_M,), tl.int32)
    ties_seen = tl.zeros((BLOCK_M,), tl.int32)
    taken, ties_seen = _gather_tile(first[0], first[1], first[2], threshold, quota, taken, ties_seen, out_row, k,
                                    row_blocks, BLOCK)
    for tile in range(first_tile + 1, end_tile):
        position, key, eligible = _tile_keys(row_values, tile, start, end, DROP_NEG_INF, BLOCK_N, row_positions,
                                             width)
        taken, ties_seen = _gather_tile(position, key, eligible, threshold, quota, taken, ties_seen, out_row, k,
                                        row_blocks, BLOCK)

    # 3. -1 padding
    for tile in range(tl.min(taken) // BLOCK_N, tl.cdiv(k, BLOCK_N)):
        slot = tile * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        tl.store(out_row + slot, tl.full((BLOCK_M, BLOCK_N), -1, tl.int32),
                 mask=row_ok[:, None] & (slot >= taken[:, None]) & (slot < k))


@triton.jit
def rank_order_kernel(values_ptr, stride_row, chosen_ptr, out_ptr, k, BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr):
    """The chosen positions of a row (ascending, then -1) in rank order: entry i goes to output slot
    #{j: key_j > key_i} + #{j < i: key_j == key_i} (equal values keep their position order); -1 padding stays.

    A program per row compares [BLOCK_I, BLOCK_J] tiles of the row's chosen keys: O(k^2) compares, all parallel.
    """
    row = tl.program_id(0).to(tl.int64)
    row_values = values_ptr + row * stride_row
    row_chosen = chosen_ptr + row * k
    for i0 in range(0, k, BLOCK_I):
        i = i0 + tl.arange(0, BLOCK_I)
        pos_i = tl.load(row_chosen + i, mask=i < k, other=-1)
        key_i = order_key(tl.load(row_values + pos_i, mask=pos_i >= 0, other=0.0).to(tl.float32), NAN_KEY)[:, None]
        rank = tl.zeros((BLOCK_I,), tl.int32)
        for j0 in range(0, k, BLOCK_J):
            j = j0 + tl.arange(0, BLOCK_J)
            pos_j = tl.load(row_chosen + j, mask=j < k, other=-1)
            key_j = order_key(tl.load(row_values + pos_j, mask=pos_j >= 0, other=0.0).to(tl.float32), NAN_KEY)[None, :]
            ahead = (key_j > key_i) | ((key_j == key_i) & (j[None, :] < i[:, None]))
            rank += tl.sum((ahead & (pos_j >= 0)[None, :]).to(tl.int32), axis=1)
        tl.store(out_ptr + row * k + tl.where(pos_i >= 0, rank, i), pos_i, mask=i < k)


@triton.jit
def _publish_histogram(histogram, total_ptr, suffix_ptr, row, chunk_id, chunks):
    """A chunk's first-digit histogram [256]: added to its row's total (atomics on the bins it holds) and stored as
    suffix sums (keys in the bins >= each) for the compaction's offsets."""
    bins = tl.arange(0, RADIX_BINS)
    tl.atomic_add(total_ptr + row * RADIX_BINS + bins, histogram, mask=histogram > 0)
    tl.store(suffix_ptr + (row * chunks + chunk_id) * RADIX_BINS + bins, suffix_sum(histogram, 0))


@triton.jit
def chunk_histogram_kernel(values_ptr, stride_row, width, starts_ptr, ends_ptr, total_ptr, suffix_ptr, chunk, chunks,
                           DROP_NEG_INF: tl.constexpr, BLOCK_N: tl.constexpr):
    """Split selection, pass 1: program row * chunks + c histograms the first digit of the eligible keys of columns
    [c * chunk, (c + 1) * chunk) of its row (_publish_histogram)."""
    row = tl.program_id(0).to(tl.int64) // chunks
    chunk_id = tl.program_id(0) % chunks
    rows = row + tl.zeros((1,), tl.int64)  # the row as a [1] vector, for the row-tile helpers
    start, end = _row_span(starts_ptr, ends_ptr, rows, rows >= 0, width)
    lo = tl.maximum(start, chunk_id * chunk)
    hi = tl.minimum(end, chunk_id * chunk + chunk)
    histogram = tl.zeros((RADIX_BINS,), tl.int32)
    for tile in range(tl.min(lo) // BLOCK_N, tl.cdiv(tl.max(hi), BLOCK_N)):
        _, x, counted = _tile_values(values_ptr + rows * stride_row, tile, lo, hi, DROP_NEG_INF, BLOCK_N)
        histogram += masked_histogram(_first_digit(x), counted, RADIX_BINS)
    _publish_histogram(histogram, total_ptr, suffix_ptr, row, chunk_id, chunks)


@triton.jit
def compact_kernel(values_ptr, stride_row, width, starts_ptr, ends_ptr, total_ptr, suffix_ptr, chunk, chunks,
                   positions_ptr, counts_ptr, k, DROP_NEG_INF: tl.constexpr, BLOCK_N: tl.constexpr,
                   CHUNKS_PAD: tl.constexpr):
    """Split selection, pass 2: from the row's histogram, the first digit d of its min(k, eligible)-th largest key;
    program row * chunks + c writes the positions of its chunk's eligible keys whose first digit is >= d, ascending,
    to positions[row, offset ..], offset = such keys in the chunks before c; counts[row] = such keys in the row."""
    row = tl.program_id(0).to(tl.int64) // chunks
    chunk_id = tl.program_id(0) % chunks
    rows = row + tl.zeros((1,), tl.int64)
    histogram = tl.load(total_ptr + row * RADIX_BINS + tl.arange(0, RADIX_BINS))[None, :]
    quota = tl.minimum(tl.full((1,), k, tl.int32), tl.sum(histogram, axis=1))
    found, _ = _next_digit(histogram, tl.zeros((1,), tl.int32), quota, 24)
    digit = (found >> 24) & 0xFF
    lowest = _lowest_key_of_digit(digit)
    other = tl.arange(0, CHUNKS_PAD)
    kept = tl.load(suffix_ptr + (row * chunks + other) * RADIX_BINS + digit, mask=other < chunks, other=0)
    offset = tl.sum(tl.where(other < chunk_id, kept, 0))
    if chunk_id == 0:
        tl.store(counts_ptr + rows, tl.sum(kept) + tl.zeros((1,), tl.int32))
    start, end = _row_span(starts_ptr, ends_ptr, rows, rows >= 0, width)
    lo = tl.maximum(start, chunk_id * chunk)
    hi = tl.minimum(end, chunk_id * chunk + chunk)
    row_candidates = positions_ptr + row * width
    for tile in range(tl.min(lo) // BLOCK_N, tl.cdiv(tl.max(hi), BLOCK_N)):
        position, key, eligible = _tile_keys(values_ptr + rows * stride_row, tile, lo, hi, DROP_NEG_INF, BLOCK_N)
        keep = eligible & (key >= lowest[:, None])  # first digit >= digit
        slot = offset + tl.cumsum(keep.to(tl.int32), 1) - 1
        tl.store(row_candidates + slot, position, mask=keep & (slot < width))  # (pass 1's counts fit the row)
        offset += tl.sum(keep.to(tl.int32))


@triton.jit
def block_max_kernel(logits_ptr, stride_row, width, row_end_ptr, scores_ptr, n_scores, total_ptr, suffix_ptr,
                     BLOCK: tl.constexpr, BLOCK_PAD: tl.constexpr, TILE_BLOCKS: tl.constexpr):
    """Program row * tiles + t scores blocks [t * TILE_BLOCKS, (t + 1) * TILE_BLOCKS) of its row; with total_ptr its
    tile is also a chunk of the split selection over the scores: it publishes their first-digit histogram (pass 1 of
    the selection folded into the one read of the logits)."""
    tiles = tl.cdiv(n_scores, TILE_BLOCKS)
    row = tl.program_id(0).to(tl.int64) // tiles
    tile = tl.program_id(0) % tiles
    block_id = tile * TILE_BLOCKS + tl.arange(0, TILE_BLOCKS)
    score_ok = block_id < n_scores
    end = tl.minimum(tl.maximum(tl.load(row_end_ptr + row), 0), width)  # any int32 row_end
    slot = tl.arange(0, BLOCK_PAD)[None, :]
    position = block_id[:, None] * BLOCK + slot
    x = tl.load(logits_ptr + row * stride_row + position, mask=(slot < BLOCK) & (position < end),
                other=float("-inf")).to(tl.float32)
    x = tl.where(x == 0.0, 0.0, x)  # -0.0 as +0.0, as the reference's maximum
    best = flip_negative(tl.max(order_key(x, NEG_INF_KEY), axis=1)).to(tl.float32, bitcast=True)
    best = tl.where((end > 0) & (block_id == (end - 1) // BLOCK), float("inf"), best)
    tl.store(scores_ptr + row * n_scores + block_id, best, mask=score_ok)
    if total_ptr is not None:
        histogram = tl.histogram(_first_digit(best), RADIX_BINS,
                                 mask=score_ok & (best > float("-inf")))
        _publish_histogram(histogram, total_ptr, suffix_ptr, row, tile, tiles)


# ---------------------------------------------------------------- plans


def topk_launch(values, ends, out, config, *, starts=None, drop_neg_inf=False, ends_bound_walk=False, blocks=None,
                block=1, positions=None) -> Launch:
    """The top-k stage over values [M, W] (fp32 or bf16, row-strided) into out int32 [M, k]: ascending positions.

    ends/starts [M] int32 (any values: clamped to [0, W]) or None (the whole row); drop_neg_inf: -inf and NaN are not
    eligible; ends_bound_walk: ends only bound the tiles walked, the columns past them holding no eligible value
    (masks then stay uniform over a row's width, so that loads vectorize); blocks [M, W // block] int32
    (row-strided) or None: emitted column c becomes blocks[m, c // block] * block + c % block; positions
    int32 [M, W] or None: column c of row m stands for position positions[m, c] (a split selection's candidates).
    """
    rows, width = values.shape
    k = out.shape[1]
    return Launch(
        topk_kernel, grid=(cdiv(rows, config["block_m"]),),
        args=dict(values_ptr=values, stride_row=values.stride(0), rows=rows, width=width, starts_ptr=starts,
                  ends_ptr=ends, blocks_ptr=blocks, stride_blocks=0 if blocks is None else blocks.stride(0),
                  positions_ptr=positions, out_ptr=out, k=k, DROP_NEG_INF=drop_neg_inf,
                  ENDS_BOUND_WALK=ends_bound_walk, BLOCK=block, BLOCK_M=config["block_m"],
                  BLOCK_N=config["block_n"]),
        num_warps=config["num_warps"], options=register_bound(config["num_warps"]),
    )


def split_buffers(rows: int, chunks: int, width: int, device) -> dict:
    """A split selection's scratch: the rows' first-digit histograms (chunks add into them) and candidate counts,
    zeroed in one piece; each chunk's suffix sums; the candidate positions."""
    bins = RADIX_BINS.value
    zeroed = torch.zeros(rows * (bins + 1), dtype=torch.int32, device=device)
    return dict(total_ptr=zeroed[:rows * bins].view(rows, bins),
                suffix_ptr=torch.empty((rows, chunks, bins), dtype=torch.int32, device=device),
                positions_ptr=torch.empty((rows, width), dtype=torch.int32, device=device),
                counts_ptr=zeroed[rows * bins:])


def split_select(values, out, config, chunk, buffers, *, starts=None, ends=None, drop_neg_inf=False, blocks=None,
                 block=1) -> tuple[Launch, Launch]:
    """Passes 2 and 3 of a split selection of values [M, W] into out [M, k], after pass 1 filled buffers' histograms
    over chunks of `chunk` columns: the compaction of the candidates (first digit >= the k-th largest key's), then
    the top-k stage over them (a row per CTA, reading only the candidates)."""
    rows, width = values.shape
    chunks = buffers["suffix_ptr"].shape[1]
    compact = Launch(
        compact_kernel, grid=(rows * chunks,), cooperating=chunks,
        args=dict(values_ptr=values, stride_row=values.stride(0), width=width, starts_ptr=starts, ends_ptr=ends,
                  **buffers, chunk=chunk, chunks=chunks, k=out.shape[1], DROP_NEG_INF=drop_neg_inf,
                  BLOCK_N=min(config["block_n"], next_power_of_2(chunk)),
                  CHUNKS_PAD=next_power_of_2(chunks)),
        num_warps=config["num_warps"])
    return compact, topk_launch(values, buffers["counts_ptr"], out, config, drop_neg_inf=drop_neg_inf, blocks=blocks,
                                block=block, positions=buffers["positions_ptr"])


def select_launches(values, ends, out, config, *, starts=None) -> tuple[Launch, ...]:
    """topk_indices' selection of values [M, W] into out: the one-launch top-k stage, or split over CTAs
    (split_chunk): pass 1 (chunk_histogram_kernel), then split_select."""
    rows, width = values.shape
    chunk = split_chunk(rows, width, config["chunks"], config["block_n"])
    if not chunk:
        return (topk_launch(values, ends, out, config, starts=starts),)
    chunks = -(-width // chunk)
    buffers = split_buffers(rows, chunks, width, values.device)
    histogram = Launch(
        chunk_histogram_kernel, grid=(rows * chunks,), cooperating=chunks,
        args=dict(values_ptr=values, stride_row=values.stride(0), width=width, starts_ptr=starts, ends_ptr=ends,
                  total_ptr=buffers["total_ptr"], suffix_ptr=buffers["suffix_ptr"], chunk=chunk, chunks=chunks,
                  DROP_NEG_INF=False, BLOCK_N=config["block_n"]),
        num_warps=config["num_warps"])
    return (histogram, *split_select(values, out, config, chunk, buffers, starts=starts, ends=ends))


def rank_order_launch(values, chosen, out, config) -> Launch:
    """The rank-order stage: chosen's positions into out int32 [M, k], the largest value first."""
    rows, k = chosen.shape
    block_i, block_j = _rank_tiles(k, config)
    return Launch(rank_order_kernel, grid=(rows,),
                  args=dict(values_ptr=values, stride_row=values.stride(0), chosen_ptr=chosen, out_ptr=out, k=k,
                            BLOCK_I=block_i, BLOCK_J=block_j),
                  num_warps=config["num_warps"])


def plan_topk(problem, inputs, config, out):
    if not problem.by_score:
        return select_launches(inputs["logits"], inputs["ends"], out, config, starts=inputs["starts"])
    chosen = torch.empty_like(out)  # ascending, between the stages
    return (*select_launches(inputs["logits"], inputs["ends"], chosen, config, starts=inputs["starts"]),
            rank_order_launch(inputs["logits"], chosen, out, config))


def plan_candidate_blocks(problem, inputs, config, out):
    """Block scores, then their top-k (-inf dropped); split (config["chunks"] > 1 and several score tiles per row),
    the block-score tiles are the selection's chunks and publish its first pass."""
    logits, block = inputs["logits"], inputs["block"]
    scores = torch.empty((problem.rows, problem.blocks), dtype=torch.float32, device=logits.device)
    tile = config["tile_blocks"]
    tiles = cdiv(problem.blocks, tile)
    split = config["chunks"] > 1 and tiles > 1
    buffers = split_buffers(problem.rows, tiles, problem.blocks, logits.device) if split else {}
    block_max = Launch(
        block_max_kernel, grid=(problem.rows * tiles,), cooperating=tiles if split else 1,
        args=dict(logits_ptr=logits, stride_row=logits.stride(0), width=problem.positions,
                  row_end_ptr=inputs["row_end"], scores_ptr=scores, n_scores=problem.blocks,
                  total_ptr=buffers.get("total_ptr"), suffix_ptr=buffers.get("suffix_ptr"), BLOCK=block,
                  BLOCK_PAD=next_power_of_2(block), TILE_BLOCKS=tile),
        num_warps=config["num_warps"],
    )
    if split:
        return (block_max, *split_select(scores, out, config, tile, buffers, drop_neg_inf=True))
    return block_max, topk_launch(scores, None, out, config, drop_neg_inf=True)


# ---------------------------------------------------------------- spaces and defaults

# Register model, measured with ptxas -v for sm_90a (build_sm90). Per thread, the top-k stage keeps a
# few copies of its [BLOCK_M, BLOCK_N] tile (keys, masks, prefix sums) and of its [BLOCK_M, 256]
# histogram; block scores a few of their [TILE_BLOCKS, block] tile. Up to 8 warps (255 registers):
#   tile values/thread 16 -> 80 registers, 32 -> 168..241, 64 -> 255 + 568 B spilled;
#   histogram bins/thread 4 (block_m 4, 8 warps) -> 104..241 registers, 8 (block_m 8) -> 96 B spilled;
#   block-score values/thread 4 -> 34, 16 -> 94, 32 -> 168, 64 -> 324 B spilled.
# 16 warps cap ptxas at 128 registers: tile values 16 -> 117 registers, 32 -> 280 B spilled; tile 16
# with bins 2 -> 128, with bins 4 -> 256 B spilled. So: 32 values per thread (16 on 16 warps), of
# which histogram bins at most an eighth.
def _values_budget(config) -> int:
    return 32 if config["num_warps"] <= 8 else 16


def _threads(config) -> int:
    return 32 * config["num_warps"]


def _tile_fits(config) -> bool:
    return config["block_m"] * config["block_n"] // _threads(config) <= _values_budget(config)


def _histogram_fits(config) -> bool:
    return config["block_m"] * 256 // _threads(config) <= _values_budget(config) // 8


def _scores_fit(problem, config) -> bool:
    return config["tile_blocks"] * next_power_of_2(problem.block) // _threads(config) <= _values_budget(config)


_TOPK_PARAMS = {"block_m": (1, 2, 4, 8, 16, 32), "block_n": (512, 1024, 2048, 4096, 8192, 16384),
                "num_warps": (4, 8, 16), "chunks": (1, 4, 16, 64)}
_TOPK_LIMITS = {
    "block_m x block_n / threads <= 32, 16 on 16 warps (registers)": lambda p, c: _tile_fits(c),
    "block_m x 256 / threads <= 4, 2 on 16 warps (registers: the histogram)": lambda p, c: _histogram_fits(c),
}

TOPK_SPACE = Space(params=_TOPK_PARAMS, gpu_only=("num_warps",), limits=_TOPK_LIMITS)

BLOCKS_SPACE = Space(
    params={"tile_blocks": (64, 128, 256, 512, 1024, 2048), **_TOPK_PARAMS},
    gpu_only=("num_warps",),
    limits={**_TOPK_LIMITS, "tile_blocks x block / threads <= 32, 16 on 16 warps (registers)": _scores_fit},
)

INTERPRETED_TILE = 131072  # elements per tile op under the interpreter


def _rank_tiles(k: int, config) -> tuple[int, int]:
    """(BLOCK_I, BLOCK_J) of the rank-order stage: its [BLOCK_I, BLOCK_J] compare tile at the top-k tile's values per
    thread (under the interpreter, up to 1024 x 1024, Triton's largest tensor: each tl op costs about the same
    whatever its size)."""
    k_pad = next_power_of_2(k)
    if flashkern.triton_interpreted():
        return min(k_pad, 1024), min(k_pad, 1024)
    block_j = min(k_pad, 256)
    return max(1, min(k_pad, _values_budget(config) * _threads(config) // block_j)), block_j


def topk_default(problem) -> dict:
    """A row per program on 8 warps in tiles of up to 4096 (16 values per thread); rows of SPLIT_FROM positions
    or more split over up to 64 CTAs each (split_chunk: about one CTA an SM in all).

    Under the interpreter every tl op costs about the same whatever its size: a row in as few tiles
    as allowed, as many rows per program as fit INTERPRETED_TILE elements, and no split (the split's
    configs are tested directly).
    """
    if flashkern.triton_interpreted():
        block_n = max(512, min(16384, next_power_of_2(max(1, problem.positions))))
        block_m = max(1, min(32, INTERPRETED_TILE // block_n, next_power_of_2(max(1, problem.rows))))
        return {"block_m": block_m, "block_n": block_n, "num_warps": 8, "chunks": 1}
    return {"block_m": 1, "block_n": max(512, min(4096, next_power_of_2(max(1, problem.positions)))),
            "num_warps": 8, "chunks": 64 if problem.positions >= SPLIT_FROM else 1}


def blocks_default(problem) -> dict:
    """Block-score tiles of 16 values per thread on 8 warps (2048 blocks under the interpreter), each a chunk of
    the split selection over the scores; the top-k stage as topk_default runs the scores."""
    select = topk_default(TopkProblem(problem.rows, problem.blocks, problem.n_blocks))
    if flashkern.triton_interpreted():
        return {"tile_blocks": 2048, **select}
    tile_blocks = max(64, min(2048, 16 * _threads(select) // next_power_of_2(problem.block)))
    return {"tile_blocks": tile_blocks, **select}
