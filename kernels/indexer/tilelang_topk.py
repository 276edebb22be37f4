"""Top-k selection in TileLang: one source for CUDA and the CPU (C) target.

The rule is reference.select_topk's: rank by value descending, NaN below every number, ties to
the lower position; emit the chosen positions in ascending order, then -1 padding.

Keys. Each fp32 value becomes an int32 key whose signed order is the rank order: the bits of a
negative value have their low 31 bits flipped, NaN becomes INT_MIN (below -inf's key). Radix
digits are taken from the key with its sign bit flipped (the unsigned form of the same order).

Tile plan: one block per row, `threads` threads, the row walked in tiles of threads x items
positions from its start to its end; a thread holds its `items` adjacent positions' keys in
registers (each value loaded once per tile; a row of one tile is loaded once for every pass).
  1. radix select (at most 4 passes of 8 bits): each pass histograms, into 256 bins, the digit
     of every eligible key that matches the digits fixed so far (atomics on a shared
     histogram: counts do not depend on their order); suffix sums over the bins find the bin
     holding the k-th largest key, whose digit is fixed. The first pass also counts the
     eligible keys: when there are at most k, all are taken. A pass whose bin holds exactly
     the keys still wanted ends the search early.
     The result: a threshold key `thr` and a budget: take keys > thr, and the first `budget`
     keys == thr in position order.
  2. gather: per tile, each thread counts the keys above thr and equal to thr among its
     positions (packed in one int32: above + 65536 x equal), an inclusive scan over the
     threads gives every thread its output offset, and each thread writes its taken
     positions in ascending order.
Scans (_inclusive_scan): on GPU warp shuffles and the warps' totals through shared memory (every
warp works; T.cumsum walks the entries with one warp), on CPU a serial loop.
Split over CTAs (config["chunks"] > 1 and chunk = problem.split_chunk(M, W, chunks, threads x items) > 0,
a whole number of tiles; C = ceil(W / chunk) chunks a row), first_digit(): quarter-octave bins of |x|:
  pass 1, grid M x C (chunk_histogram_program): CTA (m, c) histograms first_digit() of the eligible values of
     columns [max(start, c chunk), min(end, (c + 1) chunk)) in per-warp shared sub-histograms, adds its nonzero
     bins to total[m, 256] (global atomics) and stores suffix[m, c, b] = its keys with digit >= b;
  pass 2, grid M x C (compact_program): rank = min(k, sum total[m]), d = the bin of the rank-th largest key
     (255 when rank = 0); CTA (m, c) writes its chunk's eligible positions whose key is >= the lowest key of
     digit d, ascending, to positions[m, sum_{c' < c} suffix[m, c', d] ..]; counts[m] = sum_c' suffix[m, c', d]
     >= rank (CTA c = 0);
  pass 3, a CTA per row: the top-k stage over the candidates 0 .. counts[m] (pass 2 stores their keys beside their
     positions: read in order, not gathered; emitted index positions[m, n]): ascending candidates keep the position
     order of ties.
Variants: starts (the row is [start, end) instead of [0, end); any int32 starts and ends are clamped to
[0, W]), drop_neg_inf (keys of -inf and NaN are not eligible) and an index map for the sparse path
(emitted c -> blocks[m, c // B] * B + c % B). Values may be fp32 or bf16 (decoded exactly to fp32) and
row-strided.
sorted=True adds a launch that puts the chosen positions in rank order (rank_order_program).
candidate_blocks is two launches: block scores [M, ceil(N / block)] (a thread per block; a zero
maximum stored as +0.0), then the top-k stage over them with drop_neg_inf. Split (chunks > 1 and at least two
score tiles a row), the score tiles of score_threads blocks are the chunks: the block-score kernel publishes
pass 1 for the scores it writes (eligible: > -inf), then passes 2 (several score tiles a CTA: split_chunk's chunk
of the scores) and 3 over the scores with drop_neg_inf.
"""

# No `from __future__ import annotations`: TileLang evaluates T.Tensor annotations against the closure.
import torch

from flashkern.autotune.space import Space
from flashkern.kernels._tilelang import T, Flavour, placeholder, row_strided
from flashkern.kernels.indexer.problem import SPLIT_FROM, CandidateProblem, TopkProblem, split_chunk

RADIX_BITS = 8
BINS = 1 << RADIX_BITS
PASSES = 32 // RADIX_BITS
SIGN_BIT = -(2**31)  # int32 with only the sign bit set: the key of NaN, the lowest key
INF_BITS = 0x7F800000  # bits of +inf; larger magnitudes are NaN
NEG_INF_KEY = -(2**31) + 0x7FFFFF  # key of -inf: bits 0xFF800000 with the low 31 flipped
EQUAL_UNIT = 1 << 16  # packed tile counts: above + EQUAL_UNIT x equal, each below 2^15
WARP = 32  # threads a pass-1 sub-histogram counts for


def order_key(value):
    """int32 key of a fp32 value: signed order = rank order, NaN lowest (told by its bits: `x == x` folds to true)."""
    return key_of_bits(T.reinterpret(value, "int32"))


def key_of_bits(bits):
    """order_key of the fp32 value whose bits are `bits` (int32). It names `bits` three times: pass a register, not a
    load, where the expression is not already one (tile_loader)."""
    return T.if_then_else((bits & 0x7FFFFFFF) > INF_BITS, SIGN_BIT, T.if_then_else(bits < 0, bits ^ 0x7FFFFFFF, bits))


def first_digit(bits):
    """The split selection's first digit of the fp32 value whose int32 bits are `bits`: quarter-octave bins of |x| in
    [2^-15, 2^17) (the exponent's low 5 bits and the top two mantissa bits), smaller magnitudes at the middle (127:
    -0 to -2^-15, 128: +0 to 2^-15), larger at the ends (255: 2^17 to +inf; 0: -inf, NaN and below -2^17).
    Non-decreasing in the order key, so the keys at or above the rank-th largest have digits at or above its; integer
    ops on the bits (no key needed), where TensorRT-LLM rounds to fp16 for the same bins."""
    magnitude = bits & 0x7FFFFFFF
    octaves = T.min(T.max((magnitude >> 21) - 448, 0), 127)  # the bin of |x| among 128
    return T.if_then_else(magnitude > INF_BITS, 0, T.if_then_else(bits >= 0, 128 + octaves, 127 - octaves))


def lowest_key_of_digit(digit):
    """The lowest key whose first_digit is >= digit (0 .. 255), so that a compaction compares keys: NaN's for digit 0
    (every key), +0's for 128, else the first key of the bin's 10-bit prefix."""
    return T.if_then_else(digit >= 128, T.if_then_else(digit == 128, 0, (digit + 320) << 21),
                          T.if_then_else(digit == 0, SIGN_BIT, SIGN_BIT | ((digit + 448) << 21)))


def _inclusive_scan(fl: Flavour, size: int, reverse: bool, threads: int):
    """scan(buf): in place, the inclusive prefix (suffix when reverse) sums of int32 buf[size], by a CTA of `threads`.

    GPU: thread th sums the `per` = ceil(size / threads) entries th x per .. of the scan order (a running sum, kept
    in place), a warp's threads scan their sums by shuffles (lane l adds lane l - 2^s's, s = 0 .. 4), the warps'
    totals meet in shared memory and each entry adds the sums of the threads before its own (lane l reads warp l's
    total, a butterfly sums them over the warp): every warp works, two barriers (T.cumsum, a single warp walking 32
    entries at a time, serializes the scan). CPU: a serial loop."""
    per, warps = -(-size // threads), max(1, threads // WARP)

    def at(i):
        return size - 1 - i if reverse else i

    @T.macro
    def scan(buf):
        if fl.on_gpu:
            own = T.alloc_fragment((threads,), "int32")  # the sum of a thread's entries
            ahead = T.alloc_fragment((threads,), "int32")  # the sums up to its thread: over its warp, then the CTA
            shifted = T.alloc_fragment((threads,), "int32")  # a shuffle's result (every lane shuffles)
            warp_sum = T.alloc_shared((warps,), "int32")
            for th in T.Parallel(threads):
                own[th] = 0
                for i in T.unroll(per):
                    if th * per + i < size:
                        own[th] = own[th] + buf[at(th * per + i)]
                        buf[at(th * per + i)] = own[th]
                ahead[th] = own[th]
                for s in T.unroll(5):
                    shifted[th] = T.shfl_up(ahead[th], 1 << s)
                    if th % WARP >= (1 << s):
                        ahead[th] = ahead[th] + shifted[th]
                if th % WARP == WARP - 1:
                    warp_sum[th // WARP] = ahead[th]
            for th in T.Parallel(threads):  # + the totals of the warps before: lane l reads warp l's, a warp sum
                lane = th % WARP
                warp = th // WARP
                shifted[th] = T.if_then_else(lane < T.min(warp, warps), warp_sum[T.min(lane, warps - 1)], 0)
                for s in T.unroll(5):
                    shifted[th] = shifted[th] + T.shfl_xor(shifted[th], 1 << s)
                ahead[th] = ahead[th] + shifted[th]
                for i in T.unroll(per):
                    if th * per + i < size:
                        buf[at(th * per + i)] = buf[at(th * per + i)] + ahead[th] - own[th]
        elif reverse:
            for i in T.serial(size - 1):
                buf[size - 2 - i] = buf[size - 2 - i] + buf[size - 1 - i]
        else:
            for i in T.serial(size - 1):
                buf[i + 1] = buf[i + 1] + buf[i]

    return scan


def _values(fl: Flavour, bf16: bool):
    """(storage dtype of a values / logits tensor, its element's fp32 value): bf16 is exact in fp32."""
    return (fl.bf16, fl.load_bf16) if bf16 else ("float32", lambda stored: stored)


def dropping(drop_neg_inf: bool):
    """eligible(key, also): `also`, and under drop_neg_inf not for keys of -inf and NaN."""
    return (lambda key, also: (key > NEG_INF_KEY) & also) if drop_neg_inf else (lambda key, also: also)


def mapping(map_block: int):
    """mapped(blocks, m, n): the index emitted for position n of row m (the sparse path's block map when map_block)."""
    return (lambda blocks, m, n: blocks[m, n // map_block] * map_block + n % map_block) if map_block else (
        lambda blocks, m, n: n)


def tile_loader(fl: Flavour, threads: int, items: int, bits_at, contiguous: bool = True, keyed: bool = True):
    """load(Src, m, start, end, t, keys): keys[th, j] <- the order key (keyed, else the value's bits) at position n
    of tile t of [start, end), n = start + t x tile + th x items + j (contiguous: a thread's items adjacent, the
    gather's order) or start + t x tile + j x threads + th (coalesced), 0 past end. bits_at(Src, m, n) is the int32
    bits of the fp32 value at n: one load, then the key from the register (order_key of a load would load it three
    times)."""
    tile = threads * items

    def position(start, t, th, j):
        return start + t * tile + (th * items + j if contiguous else j * threads + th)

    @T.macro
    def load(Src, m, start, end, t, keys):
        for th in fl.parallel(threads):
            for j in T.unroll(items):
                n = position(start, t, th, j)
                keys[th, j] = T.if_then_else(n < end, bits_at(Src, m, n), 0)
                if keyed:
                    keys[th, j] = key_of_bits(keys[th, j])

    return load, position


def selection_macros(fl: Flavour, threads: int, items: int, bits_at, eligible, mapped, keyed: bool = True):
    """The top-k stage's two steps as macros over positions [start, end) of row m of a source Src, whose fp32 value
    at position n has the int32 bits bits_at(Src, m, n) (keyed=False: whose order key it is; eligible(key, also) and
    mapped(Blocks, m, n) as dropping and mapping), in tiles of threads x items positions (a thread's `items`
    adjacent); keys, a fragment int32 [threads, items], holds a tile's keys in registers:

      select(Src, m, start, end, k, state, keys): the radix select; state, an int32 [3] local buffer, receives
          (thr, budget, valid): take the keys > thr and the first `budget` keys == thr, valid = min(#eligible, k).
          A row of one tile is loaded once: its keys stay in `keys` across the passes (and for the gather);
      gather(Src, m, start, end, k, state, Blocks, Dst, d, keys): after select over the same [start, end), writes
          Dst[d, 0 .. k) = the taken positions (mapped) in ascending order, then -1 (a one-tile row's keys are still
          in `keys`).

    Src and Blocks are whatever bits_at and mapped take: a tensor, or a tuple of them (the split's candidates).
    """
    tile = threads * items
    prefix_sums = _inclusive_scan(fl, threads, False, threads)
    suffix_sums = _inclusive_scan(fl, BINS + 1, True, threads)
    load, position = tile_loader(fl, threads, items, bits_at, keyed=keyed)

    @T.macro
    def select(Src, m, start, end, k, state, keys):
        hist = fl.shared((BINS + 1,), "int32")  # digit counts (the last stays 0), then keys in the bins >= each
        chosen = fl.shared((1,), "int32")  # the digit of the k-th largest key
        tiles = T.alloc_var("int32", T.ceildiv(end - start, tile))
        wanted = T.alloc_var("int32", k)  # keys still to take inside the current prefix
        prefix = T.alloc_var("int32", 0)  # digits fixed so far (sign-flipped key bits) ...
        fixed = T.alloc_var("int32", 0)  # ... and the mask of those bits
        valid = T.alloc_var("int32", k)  # output length: min(#eligible, k)
        thr = T.alloc_var("int32", SIGN_BIT)
        budget = T.alloc_var("int32", k)
        searching = T.alloc_var("int32", 1)
        digit = T.alloc_var("int32", 0)
        below = T.alloc_var("int32", 0)  # keys in the bins above the chosen digit's
        in_bin = T.alloc_var("int32", 0)  # keys in the chosen digit's bin
        for p in T.serial(PASSES):
            if searching == 1:
                shift = 32 - RADIX_BITS * (p + 1)
                for b in fl.parallel(BINS + 1):
                    hist[b] = 0
                for t in T.serial(tiles):
                    if (p == 0) | (tiles > 1):  # a one-tile row stays in registers after the first pass
                        load(Src, m, start, end, t, keys)
                    for th in fl.parallel(threads):
                        for j in T.unroll(items):
                            if eligible(keys[th, j], (position(start, t, th, j) < end)
                                        & (((keys[th, j] ^ SIGN_BIT) & fixed) == prefix)):
                                T.atomic_add(hist[((keys[th, j] ^ SIGN_BIT) >> shift) & (BINS - 1)], 1)
                suffix_sums(hist)
                for b in fl.parallel(BINS):  # the one bin where the count from the top reaches `wanted`
                    if (hist[b] >= wanted) & (hist[b + 1] < wanted):
                        chosen[0] = b
                if (p == 0) & (hist[0] <= k):  # at most k eligible keys: take them all
                    valid = hist[0]
                    searching = 0
                else:
                    digit = chosen[0]
                    below = hist[digit + 1]
                    in_bin = hist[digit] - below
                    wanted = wanted - below
                    prefix = prefix | (digit << shift)
                    fixed = fixed | ((BINS - 1) << shift)
                    if in_bin == wanted:  # the whole bin is taken: every key >= its lowest
                        thr = (prefix ^ SIGN_BIT) - 1
                        budget = 0
                        searching = 0
                    elif p == PASSES - 1:
                        thr = prefix ^ SIGN_BIT
                        budget = wanted
                        searching = 0
        state[0] = thr
        state[1] = budget
        state[2] = valid

    @T.macro
    def gather(Src, m, start, end, k, state, Blocks, Dst, d, keys):
        counts = fl.shared((threads,), "int32")  # packed per-thread tile counts, then their inclusive scan
        mine = fl.fragment((threads,), "int32")  # a thread's packed count
        above_at = fl.fragment((threads,), "int32")  # keys > thr before a thread's next position
        equal_at = fl.fragment((threads,), "int32")  # keys == thr before it
        gather_tiles = T.alloc_var("int32", T.ceildiv(end - start, tile))  # named apart from select's (CUDA C names)
        for c0 in T.serial(T.ceildiv(k, threads)):
            for th in fl.parallel(threads):
                if (c0 * threads + th < k) & (c0 * threads + th >= state[2]):
                    Dst[d, c0 * threads + th] = -1
        above = T.alloc_var("int32", 0)  # keys > thr in the tiles done
        equal = T.alloc_var("int32", 0)  # keys == thr in the tiles done
        for t in T.serial(gather_tiles):
            if above + T.min(equal, state[1]) < state[2]:
                if gather_tiles > 1:  # one tile: its keys are in registers since the select
                    load(Src, m, start, end, t, keys)
                for th in fl.parallel(threads):
                    mine[th] = 0
                    for j in T.unroll(items):
                        if position(start, t, th, j) < end:
                            mine[th] = mine[th] + T.if_then_else(
                                eligible(keys[th, j], keys[th, j] > state[0]), 1,
                                T.if_then_else(eligible(keys[th, j], keys[th, j] == state[0]), EQUAL_UNIT, 0))
                    counts[th] = mine[th]
                prefix_sums(counts)
                for th in fl.parallel(threads):
                    above_at[th] = above + (counts[th] - mine[th]) % EQUAL_UNIT
                    equal_at[th] = equal + (counts[th] - mine[th]) // EQUAL_UNIT
                    for j in T.unroll(items):
                        if position(start, t, th, j) < end:
                            if eligible(keys[th, j], keys[th, j] > state[0]):
                                Dst[d, above_at[th] + T.min(equal_at[th], state[1])] = mapped(
                                    Blocks, m, position(start, t, th, j))
                                above_at[th] = above_at[th] + 1
                            elif eligible(keys[th, j], keys[th, j] == state[0]):
                                if equal_at[th] < state[1]:
                                    Dst[d, above_at[th] + equal_at[th]] = mapped(Blocks, m, position(start, t, th, j))
                                equal_at[th] = equal_at[th] + 1
                above = above + counts[threads - 1] % EQUAL_UNIT
                equal = equal + counts[threads - 1] // EQUAL_UNIT

    return select, gather


def topk_stage_program(config: dict, fl: Flavour, *, has_starts: bool = False, drop_neg_inf: bool = False,
                       map_block: int = 0, bf16: bool = False, positions: bool = False):
    """Top-k of values [M, W] (fp32, or bf16 with bf16) over [starts, ends) per row -> out int32 [M, k] (see the
    module docstring). Values and the block map may be row-strided.

    positions: the split's pass 3, over a candidate list instead (no starts; Ends = the rows' candidate counts): entry
    n of row m has the order key Keys[m, n] and emits Positions[m, n] (then the block map, if any), both int32
    [M, W], written by pass 2: the candidates' keys are read in order, not gathered.

    k is dynamic like the sizes: one compiled kernel serves every k (k = 512 and 2048 alike).
    """
    rows, width, mapped_blocks, k = T.dynamic("M"), T.dynamic("W"), T.dynamic("NB"), T.dynamic("K")
    dtype, value = _values(fl, bf16)
    eligible, mapped = dropping(drop_neg_inf), mapping(map_block)
    if positions:  # Src = Keys, Blocks = (Positions, Blocks)
        select, gather = selection_macros(fl, config["threads"], config["items"], lambda keys, m, n: keys[m, n],
                                          eligible, lambda chosen, m, n: mapped(chosen[1], m, chosen[0][m, n]),
                                          keyed=False)
    else:
        select, gather = selection_macros(fl, config["threads"], config["items"],
                                          lambda values, m, n: T.reinterpret(value(values[m, n]), "int32"), eligible,
                                          mapped)
    blocks_type = row_strided((rows, mapped_blocks), "int32", "blocks") if map_block else T.Tensor((1, 1), "int32")
    if positions:
        return _candidates_program(config, fl, select, gather, blocks_type)

    @T.prim_func
    def topk_stage(
        Values: row_strided((rows, width), dtype, "values"),
        Ends: T.Tensor((rows,), "int32"),
        Starts: T.Tensor((rows if has_starts else 1,), "int32"),
        Blocks: blocks_type,
        Out: T.Tensor((rows, k), "int32"),
    ):
        with T.Kernel(rows, threads=config["threads"]) as m:
            state = T.alloc_local((3,), "int32")  # thr, budget, valid
            keys = fl.fragment((config["threads"], config["items"]), "int32")  # a tile's keys
            # any int32 starts / ends: the row's positions are [max(start, 0), min(end, W)), empty when start >= end
            start = T.alloc_var("int32", T.min(T.max(Starts[m], 0), width) if has_starts else 0)
            end = T.alloc_var("int32", T.max(T.min(Ends[m], width), start))
            select(Values, m, start, end, k, state, keys)  # 1. radix select
            gather(Values, m, start, end, k, state, Blocks, Out, m, keys)  # 2. gather in ascending tiles

    return topk_stage


def _candidates_program(config: dict, fl: Flavour, select, gather, blocks_type):
    """topk_stage_program's kernel over a split's candidate list (positions=True), from its selection macros."""
    rows, width, k = T.dynamic("M"), T.dynamic("W"), T.dynamic("K")

    @T.prim_func
    def topk_candidates(
        Keys: T.Tensor((rows, width), "int32"),
        Positions: T.Tensor((rows, width), "int32"),
        Counts: T.Tensor((rows,), "int32"),
        Blocks: blocks_type,
        Out: T.Tensor((rows, k), "int32"),
    ):
        with T.Kernel(rows, threads=config["threads"]) as m:
            state = T.alloc_local((3,), "int32")  # thr, budget, valid
            keys = fl.fragment((config["threads"], config["items"]), "int32")  # a tile's keys
            end = T.alloc_var("int32", T.max(T.min(Counts[m], width), 0))  # counts[m] <= W: clamped all the same
            select(Keys, m, 0, end, k, state, keys)
            gather(Keys, m, 0, end, k, state, (Positions, Blocks), Out, m, keys)

    return topk_candidates


def topk_stage_args(values, ends, out, fl: Flavour, *, starts=None, blocks=None):
    """Arguments of topk_stage_program's kernel writing out int32 [M, k] (ends None: every row ends at W), or None
    when there is nothing to launch (no rows or no positions: out filled with -1 here)."""
    rows, width = values.shape
    device = values.device
    if rows == 0 or width == 0:
        out.fill_(-1)
        return None
    if ends is None:
        ends = torch.full((rows,), width, dtype=torch.int32, device=device)
    if starts is None:
        starts = placeholder((1,), torch.int32, device)
    if blocks is None:
        blocks = placeholder((1, 1), torch.int32, device)
    return [_values_arg(values, fl), ends, starts, blocks, out]


def _values_arg(values, fl: Flavour):
    return fl.bf16_arg(values) if values.dtype == torch.bfloat16 else values


# ---------------------------------------------------------------- the split selection (passes 1 and 2)


def _publisher(fl: Flavour, threads: int):
    """publish(Hist, Total, Suffix, m, c): a chunk's first-digit counts, Hist int32 [warps, BINS + 1] per-warp
    sub-histograms of a CTA of `threads` (the last bin counts what is not counted: no branch around an atomic),
    summed per bin; the nonzero bins added to Total[m, :] (global atomics), the
    suffix sums (keys in the bins >= b) stored to Suffix[m, c, :].

    The bins are summed in a loop over max(BINS, threads) with b < BINS guarded: over BINS alone, a CTA of more
    threads would replicate the loop's iterations over its threads, each adding the bin to Total again."""
    warps, span = max(1, threads // WARP), max(BINS, threads)
    suffix_sums = _inclusive_scan(fl, BINS + 1, True, threads)

    @T.macro
    def publish(Hist, Total, Suffix, m, c):
        binned = fl.shared((BINS + 1,), "int32")  # the chunk's counts (the last stays 0), then their suffix sums
        counts = fl.fragment((span,), "int32")  # a bin's count over the warps
        for b in fl.parallel(BINS + 1):
            binned[b] = 0
        for b in fl.parallel(span):
            if b < BINS:
                counts[b] = 0
                for w in T.serial(warps):
                    counts[b] = counts[b] + Hist[w, b]
                binned[b] = counts[b]
                if counts[b] > 0:
                    T.atomic_add(Total[m, b], counts[b])
        suffix_sums(binned)
        for b in fl.parallel(BINS):
            Suffix[m, c, b] = binned[b]

    return publish


def chunk_bounds(Starts, Ends, m, c, chunk, width, has_starts: bool):
    """(lo, hi): chunk c's columns [lo, hi) of row m's [max(start, 0), min(end, W)) (any int32 starts and ends;
    empty when start >= end or past the row), as expressions for two T.alloc_var (the traffic model reads loop
    extents through such named locals)."""
    start = T.min(T.max(Starts[m], 0), width) if has_starts else 0
    end = T.max(T.min(Ends[m], width), start)
    lo = T.max(start, c * chunk)
    return lo, T.max(T.min(end, c * chunk + chunk), lo)


def chunk_histogram_program(config: dict, fl: Flavour, *, has_starts: bool = False, bf16: bool = False):
    """Split selection, pass 1 (grid M x C): CTA (m, c) counts first_digit() of the keys of columns
    [max(start, c chunk), min(end, (c + 1) chunk)) of row m and publishes them (_publisher) to Total [M, 256]
    (zeroed by the caller) and Suffix [M, C, 256].

    Counting: one shared sub-histogram per warp (thread th counts into warp th // 32's; on GPU the threads of
    T.Parallel(threads) are the CTA's, so contention on a bin is a warp's at most, not the CTA's: a row of equal
    keys hits one bin), the sub-histograms summed per bin before publishing; a thread reads `items` positions
    `threads` apart (coalesced)."""
    threads, items = config["threads"], config["items"]
    tile, warps = threads * items, max(1, threads // WARP)
    rows, width, chunks = T.dynamic("M"), T.dynamic("W"), T.dynamic("C")
    dtype, value = _values(fl, bf16)
    publish = _publisher(fl, threads)
    load, position = tile_loader(fl, threads, items, lambda values, m, n: T.reinterpret(value(values[m, n]), "int32"),
                                 contiguous=False, keyed=False)

    @T.prim_func
    def chunk_histogram(
        Values: row_strided((rows, width), dtype, "values"),
        Ends: T.Tensor((rows,), "int32"),
        Starts: T.Tensor((rows if has_starts else 1,), "int32"),
        Total: T.Tensor((rows, BINS), "int32"),
        Suffix: T.Tensor((rows, chunks, BINS), "int32"),
        chunk: T.int32,
    ):
        with T.Kernel(rows, chunks, threads=threads) as (m, c):  # rows may pass 65535: x
            hist = fl.shared((warps, BINS + 1), "int32")  # per warp; the last bin: positions past the chunk
            keys = fl.fragment((threads, items), "int32")  # a tile's values' bits, positions `threads` apart, digits
            lo = T.alloc_var("int32", chunk_bounds(Starts, Ends, m, c, chunk, width, has_starts)[0])
            hi = T.alloc_var("int32", chunk_bounds(Starts, Ends, m, c, chunk, width, has_starts)[1])
            tiles = T.alloc_var("int32", T.ceildiv(hi - lo, tile))
            for w, b in fl.parallel(warps, BINS + 1):
                hist[w, b] = 0
            for t in T.serial(tiles):
                load(Values, m, lo, hi, t, keys)
                for th in fl.parallel(threads):
                    for j in T.unroll(items):  # the digit in a register: the index stays int32 math
                        keys[th, j] = T.if_then_else(position(lo, t, th, j) < hi, first_digit(keys[th, j]), BINS)
                        T.atomic_add(hist[th // WARP, keys[th, j]], 1)
            publish(hist, Total, Suffix, m, c)

    return chunk_histogram


def compact_program(threads: int, items: int, fl: Flavour, *, has_starts: bool = False, drop_neg_inf: bool = False,
                    bf16: bool = False):
    """Split selection, pass 2 (grid M x ceil(C / per), `threads` threads in tiles of threads x items), CTA (m, g)
    over the `per` pass-1 chunks g per .. of row m (columns [g chunk, (g + 1) chunk), chunk = per x pass 1's): from
    Total[m], the first digit d of the rank-th largest eligible key, rank = min(k, sum Total[m]); the CTA writes its
    columns' eligible positions whose key is >= lowest_key_of_digit(d) (whose first digit is >= d), ascending, to
    Positions[m, offset ..] and their keys to Keys[m, offset ..], offset = sum_{c' < g per} Suffix[m, c', d]; CTA
    (m, 0) writes Counts[m] = sum_c' Suffix[m, c', d] (<= W). Per tile: a thread flags its `items` adjacent
    positions (keys in registers), counts them, a CTA scan of the counts gives each thread its first slot, and it
    writes its flagged positions and keys there in order. (per > 1 where pass 1's chunks are small, the block
    scores': each CTA sums the suffixes of the chunks before its own.)"""
    rows, width, chunks = T.dynamic("M"), T.dynamic("W"), T.dynamic("C")
    tile = threads * items
    dtype, value = _values(fl, bf16)
    suffix_sums = _inclusive_scan(fl, BINS + 1, True, threads)
    prefix_sums = _inclusive_scan(fl, threads, False, threads)
    eligible = dropping(drop_neg_inf)
    load, position = tile_loader(fl, threads, items, lambda values, m, n: T.reinterpret(value(values[m, n]), "int32"))

    @T.prim_func
    def compact(
        Values: row_strided((rows, width), dtype, "values"),
        Ends: T.Tensor((rows,), "int32"),
        Starts: T.Tensor((rows if has_starts else 1,), "int32"),
        Total: T.Tensor((rows, BINS), "int32"),
        Suffix: T.Tensor((rows, chunks, BINS), "int32"),
        Positions: T.Tensor((rows, width), "int32"),
        Keys: T.Tensor((rows, width), "int32"),
        Counts: T.Tensor((rows,), "int32"),
        chunk: T.int32,
        per: T.int32,
        k: T.int32,
    ):
        with T.Kernel(rows, T.ceildiv(chunks, per), threads=threads) as (m, c):  # rows may pass 65535: x
            hist = fl.shared((BINS + 1,), "int32")  # the row's counts (the last 0), then keys in the bins >= each
            chosen = fl.shared((1,), "int32")
            per_chunk = fl.shared((threads,), "int32")  # candidates of chunks c0 threads .., then their prefix sums
            counts = fl.shared((threads,), "int32")  # a tile's flagged positions per thread, then their prefix sums
            keys = fl.fragment((threads, items), "int32")  # a tile's keys
            taken = fl.fragment((threads, items), "int32")  # 1 where a key is a candidate
            mine = fl.fragment((threads,), "int32")  # a thread's flagged positions in the tile
            slot = fl.fragment((threads,), "int32")  # where a thread's next flagged position goes
            for b in fl.parallel(BINS + 1):
                hist[b] = T.if_then_else(b < BINS, Total[m, T.min(b, BINS - 1)], 0)
            suffix_sums(hist)
            rank = T.alloc_var("int32", T.min(T.max(k, 0), hist[0]))
            for b in fl.parallel(BINS):  # exactly one bin: the rank-th largest key's, the top one when rank = 0
                if (hist[b] >= rank) & ((hist[b + 1] < rank) | (b == BINS - 1)):
                    chosen[0] = b
            digit = T.alloc_var("int32", chosen[0])
            low = T.alloc_var("int32", lowest_key_of_digit(digit))
            offset = T.alloc_var("int32", 0)  # candidates in the chunks before c
            kept = T.alloc_var("int32", 0)  # candidates in the row
            for c0 in T.serial(T.ceildiv(chunks, threads)):  # the chunks' candidates, `threads` chunks at a time
                for th in fl.parallel(threads):
                    per_chunk[th] = T.if_then_else(c0 * threads + th < chunks,
                                                   Suffix[m, T.min(c0 * threads + th, chunks - 1), digit], 0)
                prefix_sums(per_chunk)
                before = T.alloc_var("int32", T.min(c * per - c0 * threads, threads))  # chunks before c's among these
                if before > 0:
                    offset = offset + per_chunk[before - 1]
                kept = kept + per_chunk[threads - 1]
            if c == 0:
                Counts[m] = kept
            lo = T.alloc_var("int32", chunk_bounds(Starts, Ends, m, c, chunk, width, has_starts)[0])
            hi = T.alloc_var("int32", chunk_bounds(Starts, Ends, m, c, chunk, width, has_starts)[1])
            chunk_tiles = T.alloc_var("int32", T.ceildiv(hi - lo, tile))
            for t in T.serial(chunk_tiles):
                load(Values, m, lo, hi, t, keys)
                for th in fl.parallel(threads):
                    mine[th] = 0
                    for j in T.unroll(items):
                        taken[th, j] = T.if_then_else(
                            eligible(keys[th, j], (position(lo, t, th, j) < hi) & (keys[th, j] >= low)), 1, 0)
                        mine[th] = mine[th] + taken[th, j]
                    counts[th] = mine[th]
                prefix_sums(counts)
                for th in fl.parallel(threads):
                    slot[th] = offset + counts[th] - mine[th]
                    for j in T.unroll(items):
                        if taken[th, j] == 1:
                            Positions[m, slot[th]] = position(lo, t, th, j)
                            Keys[m, slot[th]] = keys[th, j]
                        slot[th] = slot[th] + taken[th, j]
                offset = offset + counts[threads - 1]

    return compact


def split_buffers(rows: int, chunks: int, width: int, device) -> dict:
    """A split selection's scratch: the rows' first-digit histograms (zeroed: chunks add into them), each chunk's
    suffix sums, the candidate positions, their keys and their counts."""
    return dict(total=torch.zeros((rows, BINS), dtype=torch.int32, device=device),
                suffix=torch.empty((rows, chunks, BINS), dtype=torch.int32, device=device),
                positions=torch.empty((rows, width), dtype=torch.int32, device=device),
                keys=torch.empty((rows, width), dtype=torch.int32, device=device),
                counts=torch.empty((rows,), dtype=torch.int32, device=device))


def split_select_args(values, out, chunk: int, buffers: dict, fl: Flavour, *, ends=None, starts=None,
                      per: int = 1) -> tuple:
    """(pass 2's, pass 3's) arguments of a split selection of values [M, W] into out [M, k], after pass 1 filled
    buffers' histograms over chunks of `chunk` columns (ends None: every row ends at W); pass 2 takes `per` of them
    a CTA."""
    rows, width = values.shape
    device = values.device
    if ends is None:
        ends = torch.full((rows,), width, dtype=torch.int32, device=device)
    if starts is None:
        starts = placeholder((1,), torch.int32, device)
    compact = [_values_arg(values, fl), ends, starts, buffers["total"], buffers["suffix"], buffers["positions"],
               buffers["keys"], buffers["counts"], chunk * per, per, out.shape[1]]
    select = [buffers["keys"], buffers["positions"], buffers["counts"],
              placeholder((1, 1), torch.int32, device), out]
    return compact, select


RANK_CHUNK = 1024  # chosen keys staged in shared memory at a time (4 KiB)


def rank_order_program(config: dict, fl: Flavour, *, bf16: bool = False):
    """The chosen positions of each row (ascending, then -1) in rank order: entry i goes to output slot
    #{j: key_j > key_i} + #{j < i: key_j == key_i} (equal values keep their position order); -1 padding stays.

    A block per row; each thread ranks one chosen entry at a time against the row's chosen keys, staged in
    shared memory RANK_CHUNK at a time: O(k^2 / threads) compares per thread.
    """
    threads = config["threads"]
    rows, width, k = T.dynamic("M"), T.dynamic("W"), T.dynamic("K")
    dtype, value = _values(fl, bf16)

    def key_of(Values, Chosen, m, j):
        """The key of chosen entry j, or the lowest key (never counted ahead of a valid entry) past the valid ones."""
        position = Chosen[m, T.min(j, k - 1)]
        return T.if_then_else((j < k) & (position >= 0), order_key(value(Values[m, T.max(position, 0)])), SIGN_BIT)

    @T.prim_func
    def rank_order(
        Values: row_strided((rows, width), dtype, "values"),
        Chosen: T.Tensor((rows, k), "int32"),
        Out: T.Tensor((rows, k), "int32"),
    ):
        with T.Kernel(rows, threads=threads) as m:
            keys = fl.shared((RANK_CHUNK,), "int32")  # keys of chosen entries j0 * RANK_CHUNK ..
            key_i = fl.fragment((threads,), "int32")
            rank = fl.fragment((threads,), "int32")
            for i0 in T.serial(T.ceildiv(k, threads)):
                for th in fl.parallel(threads):
                    key_i[th] = key_of(Values, Chosen, m, i0 * threads + th)
                    rank[th] = 0
                for j0 in T.serial(T.ceildiv(k, RANK_CHUNK)):
                    for c in fl.parallel(RANK_CHUNK):
                        keys[c] = key_of(Values, Chosen, m, j0 * RANK_CHUNK + c)
                    for th in fl.parallel(threads):
                        for c in T.serial(RANK_CHUNK):
                            ahead = (keys[c] > key_i[th]) | ((keys[c] == key_i[th]) & (j0 * RANK_CHUNK + c < i0 * threads + th))
                            if ahead:
                                rank[th] = rank[th] + 1
                for th in fl.parallel(threads):
                    if i0 * threads + th < k:
                        position = Chosen[m, i0 * threads + th]
                        Out[m, T.if_then_else(position >= 0, rank[th], i0 * threads + th)] = position

    return rank_order


# ---------------------------------------------------------------- topk_indices


def _split(config: dict) -> bool:
    """Whether a config's programs hold the split selection (whether a call splits is split_chunk's: its sizes)."""
    return config.get("chunks", 1) > 1


def topk_program(problem: TopkProblem, config: dict, fl: Flavour):
    """The top-k stage; with sorted=True, then the rank-order stage. With chunks > 1 the stages are (the one-CTA
    top-k stage, pass 1, pass 2, pass 3[, rank order]): a call runs the first or the next three (split_chunk)."""
    bf16 = problem.bf16_logits
    select = topk_stage_program(config, fl, has_starts=problem.has_starts, bf16=bf16)
    if _split(config):
        select = (select, chunk_histogram_program(config, fl, has_starts=problem.has_starts, bf16=bf16),
                  compact_program(config["threads"], config["items"], fl, has_starts=problem.has_starts, bf16=bf16),
                  topk_stage_program(config, fl, bf16=bf16, positions=True))
    else:
        select = (select,)
    return (*select, rank_order_program(config, fl, bf16=bf16)) if problem.by_score else select


def _select_args(problem: TopkProblem, inputs: dict, config: dict, fl: Flavour, out) -> tuple | None:
    """The selection stages' arguments (topk_program's stages but the rank order), None: nothing to launch."""
    logits = inputs["logits"]
    one_cta = topk_stage_args(logits, inputs["ends"], out, fl, starts=inputs["starts"])
    if not _split(config) or one_cta is None:
        return None if one_cta is None else (one_cta,)
    rows, width = logits.shape
    chunk = split_chunk(rows, width, config["chunks"], config["threads"] * config["items"])
    if not chunk:
        return one_cta, None, None, None
    chunks = -(-width // chunk)
    buffers = split_buffers(rows, chunks, width, logits.device)
    ends, starts = one_cta[1], one_cta[2]  # as the one-CTA stage takes them (starts: a dummy without)
    histogram = [_values_arg(logits, fl), ends, starts, buffers["total"], buffers["suffix"], chunk]
    return (None, histogram, *split_select_args(logits, out, chunk, buffers, fl, ends=ends, starts=starts))


def topk_args(problem: TopkProblem, inputs: dict, config: dict, fl: Flavour, out):
    if not problem.by_score:
        select = _select_args(problem, inputs, config, fl, out)
        return None if select is None else select[0] if len(select) == 1 else select
    chosen = torch.empty_like(out)  # ascending, between the stages
    select = _select_args(problem, inputs, config, fl, chosen)
    if select is None:  # nothing chosen: the rank order is all -1 too
        out.fill_(-1)
        return None
    return (*select, [_values_arg(inputs["logits"], fl), chosen, out])


# GPU resources, measured with build_sm90 (nvcc --resource-usage, sm_90a): a thread keeps `items` keys in
# registers, so registers grow with items; one-CTA stage / pass 1 / pass 2 / pass 3, threads x items: 128x32
# 96/78/90/109, 256x4 47/24/40/50, 256x16 72/46/61/72, 512x8 56/32/39/55, 512x32 96/80/93/119, 1024x2
# 40/30/32/32, 1024x8 48/31/32/54, 1024x16 64/46/55/55 (1024 threads: at most 64 each; 1024x32 is outside the
# space); the block-score stages 20-24. Never a spill. Shared memory: the 1 KiB histogram and the 4 B x threads
# tile counts (at most 4 KiB); pass 1 a 1 KiB sub-histogram per warp (33 KiB at 1024 threads). Nothing in the
# space spills or overflows shared memory: no GPU limits needed.
TOPK_SPACE = Space(
    params={"threads": (128, 256, 512, 1024), "items": (2, 4, 8, 16, 32), "chunks": (1, 4, 16, 64)},
    constraints={
        "threads x items < 32768 (a tile's counts are packed in 16-bit halves)":
            lambda p, c: c["threads"] * c["items"] < 1 << 15,
    },
    gpu_only=("threads",),
)


def topk_default(problem: TopkProblem) -> dict:
    """256 threads: a block per row below SPLIT_FROM positions in tiles of 256 x 8; longer rows split over up to 64
    CTAs each (split_chunk: about one CTA an SM in all) in tiles of 256 x 16. The candidate pass (a CTA per row over
    what the compaction kept) is bound by its per-pass overhead, which grows with the warps: 256 threads model
    faster than 512 (H200 model, kernel us, 256x8 / 512x8: 8K 6.4 / 7.1; split 256x16 / 256x8 / 512x8: 16 rows of
    512K 26.0 / 30.5 / 27.6, one row of 512K 9.7 / 9.5 / 10.7, 16 rows of 64K 9.7 / 9.5 / 10.7)."""
    if problem.positions >= SPLIT_FROM:
        return {"threads": 256, "items": 16, "chunks": 64}
    return {"threads": 256, "items": 8, "chunks": 1}


# ---------------------------------------------------------------- candidate_blocks


def block_max_program(block: int, config: dict, fl: Flavour, *, bf16: bool = False, publish: bool = False):
    """Block scores [M, NB] of logits [M, N] (fp32, or bf16 with bf16; row-strided) below end = clamp(row_end, 0, N)
    (NaN as -inf, the block holding end - 1 +inf), a thread each.

    publish: each CTA's score_threads blocks are also a chunk of the split selection over the scores: it publishes
    pass 1 for the scores it writes (eligible: > -inf; per-warp sub-histograms, _publisher) to Total [M, 256]
    (zeroed by the caller) and Suffix [M, ceil(NB / score_threads), 256], so the logits are read once."""
    per_block = config["score_threads"]
    warps = max(1, per_block // WARP)
    rows, width, n_blocks, chunks = T.dynamic("M"), T.dynamic("N"), T.dynamic("NB"), T.dynamic("C")
    inf = T.infinity("float32")
    dtype, value = _values(fl, bf16)
    publisher = _publisher(fl, per_block)
    eligible = dropping(True)

    @T.macro
    def score(Logits, RowEnd, Scores, m, bx, best):
        """best[b] <- the score of block bx * per_block + b, stored to Scores where the block exists."""
        end = T.alloc_var("int32", T.max(T.min(RowEnd[m], width), 0))  # any int32 row_end: clamped to [0, N]
        loaded = fl.fragment((per_block,), "float32")  # one logit in a register: loaded once, compared
        for b in fl.parallel(per_block):
            best[b] = -inf
            for j in T.serial(block):
                n = (bx * per_block + b) * block + j
                loaded[b] = T.if_then_else(n < end, value(Logits[m, n]), -inf)
                # the comparison is false for NaN: it counts as -inf
                best[b] = T.if_then_else(loaded[b] > best[b], loaded[b], best[b])
            newest = (end > 0) & (bx * per_block + b == (end - 1) // block)
            # a zero maximum is stored as +0.0 (-0.0 ranks below it; which zero a max keeps is arbitrary)
            best[b] = T.if_then_else(newest, inf, T.if_then_else(best[b] == 0.0, 0.0, best[b]))
            if bx * per_block + b < n_blocks:
                Scores[m, bx * per_block + b] = best[b]

    @T.prim_func
    def block_max(
        Logits: row_strided((rows, width), dtype, "logits"),
        RowEnd: T.Tensor((rows,), "int32"),
        Scores: T.Tensor((rows, n_blocks), "float32"),
    ):
        with T.Kernel(rows, T.ceildiv(n_blocks, per_block), threads=per_block) as (m, bx):  # rows may pass 65535: x
            best = fl.fragment((per_block,), "float32")
            score(Logits, RowEnd, Scores, m, bx, best)

    @T.prim_func
    def block_max_published(
        Logits: row_strided((rows, width), dtype, "logits"),
        RowEnd: T.Tensor((rows,), "int32"),
        Scores: T.Tensor((rows, n_blocks), "float32"),
        Total: T.Tensor((rows, BINS), "int32"),
        Suffix: T.Tensor((rows, chunks, BINS), "int32"),
    ):
        with T.Kernel(rows, T.ceildiv(n_blocks, per_block), threads=per_block) as (m, bx):  # rows may pass 65535: x
            best = fl.fragment((per_block,), "float32")
            hist = fl.shared((warps, BINS + 1), "int32")  # per warp; the last bin: what is not counted
            for w, b in fl.parallel(warps, BINS + 1):
                hist[w, b] = 0
            score(Logits, RowEnd, Scores, m, bx, best)
            digits = fl.fragment((per_block,), "int32")  # a score's first digit (BINS: not counted)
            for b in fl.parallel(per_block):
                digits[b] = T.if_then_else(eligible(order_key(best[b]), bx * per_block + b < n_blocks),
                                           first_digit(T.reinterpret(best[b], "int32")), BINS)
                T.atomic_add(hist[b // WARP, digits[b]], 1)
            publisher(hist, Total, Suffix, m, bx)

    return block_max_published if publish else block_max


def blocks_program(problem: CandidateProblem, config: dict, fl: Flavour):
    """(block scores, top-k of them with -inf blocks dropped); with chunks > 1, (block scores, block scores
    publishing pass 1, pass 2, pass 3, the one-CTA top-k stage): a call runs the first and last, or the middle three
    (at least two score tiles a row)."""
    block_max = block_max_program(problem.block, config, fl, bf16=problem.bf16_logits)
    select = topk_stage_program(config, fl, drop_neg_inf=True)
    if not _split(config):
        return block_max, select
    return (block_max, block_max_program(problem.block, config, fl, bf16=problem.bf16_logits, publish=True),
            compact_program(config["threads"], config["items"], fl, drop_neg_inf=True),
            topk_stage_program(config, fl, drop_neg_inf=True, positions=True), select)


def blocks_args(problem: CandidateProblem, inputs: dict, config: dict, fl: Flavour, out):
    logits, row_end = inputs["logits"], inputs["row_end"]
    rows, width = logits.shape
    if rows == 0 or width == 0:  # no blocks: all -1
        out.fill_(-1)
        return None
    scores = torch.empty((rows, problem.blocks), dtype=torch.float32, device=logits.device)
    block_max = [_values_arg(logits, fl), row_end, scores]
    tiles = -(-problem.blocks // config["score_threads"])
    if not _split(config):
        return block_max, topk_stage_args(scores, None, out, fl)
    if tiles < 2:
        return block_max, None, None, None, topk_stage_args(scores, None, out, fl)
    buffers = split_buffers(rows, tiles, problem.blocks, logits.device)
    # pass 2 takes as many score tiles a CTA as split_chunk's chunk of the scores holds (all of a row: no split)
    per = -(-(split_chunk(rows, problem.blocks, config["chunks"], config["score_threads"]) or problem.blocks)
            // config["score_threads"])
    return (None, [*block_max, buffers["total"], buffers["suffix"]],
            *split_select_args(scores, out, config["score_threads"], buffers, fl, per=per), None)


BLOCKS_SPACE = Space(
    params={"score_threads": (64, 128, 256), **TOPK_SPACE.params},
    constraints=TOPK_SPACE.constraints,
    gpu_only=("score_threads", "threads"),
)


def blocks_default(problem: CandidateProblem) -> dict:
    """128 blocks per scoring block; the top-k stage as topk_default for a row of ceil(N / block) scores (on GPU
    split: the scoring blocks are its chunks)."""
    return {"score_threads": 128, **topk_default(TopkProblem(problem.rows, problem.blocks, problem.n_blocks))}
