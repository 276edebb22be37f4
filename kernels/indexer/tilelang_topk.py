"""Top-k selection in TileLang: one source for CUDA and the CPU (C) target.

The rule is reference.select_topk's: rank by value descending, NaN below every number, ties to
the lower position; emit the chosen positions in ascending order, then -1 padding.

Keys. Each fp32 value becomes an int32 key whose signed order is the rank order: the bits of a
negative value have their low 31 bits flipped, NaN becomes INT_MIN (below -inf's key). Radix
digits are taken from the key with its sign bit flipped (the unsigned form of the same order).

Tile plan: one block per row, `threads` threads, the row walked in tiles of threads x items
positions from its start to its end.
  1. radix select (at most 4 passes of 8 bits): each pass histograms, into 256 bins, the digit
     of every eligible key that matches the digits fixed so far (atomics on a shared
     histogram: counts do not depend on their order); suffix sums over the bins (T.cumsum on
     GPU, a loop on CPU) find the bin holding the k-th largest key, whose digit is fixed. The
     first pass also counts the eligible keys: when there are at most k, all are taken. A pass
     whose bin holds exactly the keys still wanted ends the search early.
     The result: a threshold key `thr` and a budget: take keys > thr, and the first `budget`
     keys == thr in position order.
  2. gather: per tile, each thread counts the keys above thr and equal to thr among its
     `items` consecutive positions (packed in one int32: above + 65536 x equal), an inclusive
     scan over the threads gives every thread its output offset (T.cumsum on GPU, a serial
     loop on CPU), and each thread writes its taken positions in ascending order.
Variants: starts (the row is [start, end) instead of [0, end); any int32 starts and ends are clamped to
[0, W]), drop_neg_inf (keys of -inf and NaN are not eligible) and an index map for the sparse path
(emitted c -> blocks[m, c // B] * B + c % B). Values may be fp32 or bf16 (decoded exactly to fp32) and
row-strided.
sorted=True adds a launch that puts the chosen positions in rank order (rank_order_program).
candidate_blocks is two launches: block scores [M, ceil(N / block)] (a thread per block; a zero
maximum stored as +0.0), then the top-k stage over them with drop_neg_inf.
"""

# No `from __future__ import annotations`: TileLang evaluates T.Tensor annotations against the closure.
import tilelang.language as T
import torch

from flashkern.autotune.space import Space
from flashkern.kernels._tilelang import Flavour, row_strided
from flashkern.kernels.indexer.problem import CandidateProblem, TopkProblem

RADIX_BITS = 8
BINS = 1 << RADIX_BITS
PASSES = 32 // RADIX_BITS
SIGN_BIT = -(2**31)  # int32 with only the sign bit set: the key of NaN, the lowest key
INF_BITS = 0x7F800000  # bits of +inf; larger magnitudes are NaN
NEG_INF_KEY = -(2**31) + 0x7FFFFF  # key of -inf: bits 0xFF800000 with the low 31 flipped
EQUAL_UNIT = 1 << 16  # packed tile counts: above + EQUAL_UNIT x equal, each below 2^15


def order_key(value):
    """int32 key of a fp32 value: signed order = rank order, NaN lowest (told by its bits: `x == x` folds to true)."""
    bits = T.reinterpret(value, "int32")
    return T.if_then_else((bits & 0x7FFFFFFF) > INF_BITS, SIGN_BIT, T.if_then_else(bits < 0, bits ^ 0x7FFFFFFF, bits))


def _inclusive_scan(fl: Flavour, size: int, reverse: bool):
    """In-place inclusive prefix (suffix when reverse) sums of int32 [size]: T.cumsum on GPU, a loop on CPU."""

    @T.macro
    def scan(buf):
        if fl.on_gpu:
            T.cumsum(buf, dim=0, reverse=reverse)
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


def selection_macros(fl: Flavour, threads: int, items: int, key_at, eligible, mapped):
    """The top-k stage's two steps as macros over positions [start, end) of row m of a source Src, whose int32 key
    at position n is key_at(Src, m, n) (eligible(key, also) and mapped(Blocks, m, n) as dropping and mapping):

      select(Src, m, start, end, k, state): the radix select; state, an int32 [3] local buffer, receives
          (thr, budget, valid): take the keys > thr and the first `budget` keys == thr, valid = min(#eligible, k);
      gather(Src, m, start, end, k, state, Blocks, Dst, d): writes Dst[d, 0 .. k) = the taken positions (mapped)
          in ascending order, then -1.
    """
    tile = threads * items
    prefix_sums = _inclusive_scan(fl, threads, reverse=False)
    suffix_sums = _inclusive_scan(fl, BINS + 1, reverse=True)

    @T.macro
    def select(Src, m, start, end, k, state):
        hist = fl.shared((BINS + 1,), "int32")  # digit counts (the last stays 0), then keys in the bins >= each
        chosen = fl.shared((1,), "int32")  # the digit of the k-th largest key
        tile_keys = fl.fragment((tile,), "int32")  # the keys of a tile's positions, each computed once
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
                    for i in fl.parallel(tile):
                        n = start + t * tile + i
                        if n < end:
                            tile_keys[i] = key_at(Src, m, n)
                            if eligible(tile_keys[i], ((tile_keys[i] ^ SIGN_BIT) & fixed) == prefix):
                                T.atomic_add(hist[((tile_keys[i] ^ SIGN_BIT) >> shift) & (BINS - 1)], 1)
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
    def gather(Src, m, start, end, k, state, Blocks, Dst, d):
        counts = fl.shared((threads,), "int32")  # packed per-thread tile counts, then their inclusive scan
        mine = fl.fragment((threads,), "int32")  # a thread's packed count
        above_at = fl.fragment((threads,), "int32")  # keys > thr before a thread's next position
        equal_at = fl.fragment((threads,), "int32")  # keys == thr before it
        thread_key = fl.fragment((threads,), "int32")  # a thread's key at its current position
        tiles = T.alloc_var("int32", T.ceildiv(end - start, tile))
        for c0 in T.serial(T.ceildiv(k, threads)):
            for th in fl.parallel(threads):
                if (c0 * threads + th < k) & (c0 * threads + th >= state[2]):
                    Dst[d, c0 * threads + th] = -1
        above = T.alloc_var("int32", 0)  # keys > thr in the tiles done
        equal = T.alloc_var("int32", 0)  # keys == thr in the tiles done
        for t in T.serial(tiles):
            if above + T.min(equal, state[1]) < state[2]:
                for th in fl.parallel(threads):
                    mine[th] = 0
                    for j in T.serial(items):
                        n = start + t * tile + th * items + j
                        if n < end:
                            thread_key[th] = key_at(Src, m, n)
                            if eligible(thread_key[th], thread_key[th] > state[0]):
                                mine[th] = mine[th] + 1
                            elif eligible(thread_key[th], thread_key[th] == state[0]):
                                mine[th] = mine[th] + EQUAL_UNIT
                    counts[th] = mine[th]
                prefix_sums(counts)
                for th in fl.parallel(threads):
                    above_at[th] = above + (counts[th] - mine[th]) % EQUAL_UNIT
                    equal_at[th] = equal + (counts[th] - mine[th]) // EQUAL_UNIT
                    for j in T.serial(items):
                        n = start + t * tile + th * items + j
                        if n < end:
                            thread_key[th] = key_at(Src, m, n)
                            if eligible(thread_key[th], thread_key[th] > state[0]):
                                Dst[d, above_at[th] + T.min(equal_at[th], state[1])] = mapped(Blocks, m, n)
                                above_at[th] = above_at[th] + 1
                            elif eligible(thread_key[th], thread_key[th] == state[0]):
                                if equal_at[th] < state[1]:
                                    Dst[d, above_at[th] + equal_at[th]] = mapped(Blocks, m, n)
                                equal_at[th] = equal_at[th] + 1
                above = above + counts[threads - 1] % EQUAL_UNIT
                equal = equal + counts[threads - 1] // EQUAL_UNIT

    return select, gather


def topk_stage_program(config: dict, fl: Flavour, *, has_starts: bool = False, drop_neg_inf: bool = False,
                       map_block: int = 0, bf16: bool = False):
    """Top-k of values [M, W] (fp32, or bf16 with bf16) over [starts, ends) per row -> out int32 [M, k] (see the
    module docstring). Values and the block map may be row-strided.

    k is dynamic like the sizes: one compiled kernel serves every k (k = 512 and 2048 alike).
    """
    rows, width, mapped_blocks, k = T.dynamic("M"), T.dynamic("W"), T.dynamic("NB"), T.dynamic("K")
    dtype, value = _values(fl, bf16)
    select, gather = selection_macros(fl, config["threads"], config["items"],
                                      lambda values, m, n: order_key(value(values[m, n])), dropping(drop_neg_inf),
                                      mapping(map_block))

    @T.prim_func
    def topk_stage(
        Values: row_strided((rows, width), dtype, "values"),
        Ends: T.Tensor((rows,), "int32"),
        Starts: T.Tensor((rows if has_starts else 1,), "int32"),
        Blocks: row_strided((rows, mapped_blocks), "int32", "blocks") if map_block else T.Tensor((1, 1), "int32"),
        Out: T.Tensor((rows, k), "int32"),
    ):
        with T.Kernel(rows, threads=config["threads"]) as m:
            state = T.alloc_local((3,), "int32")  # thr, budget, valid
            # any int32 starts / ends: the row's positions are [max(start, 0), min(end, W)), empty when start >= end
            start = T.alloc_var("int32", T.min(T.max(Starts[m], 0), width) if has_starts else 0)
            end = T.alloc_var("int32", T.max(T.min(Ends[m], width), start))
            select(Values, m, start, end, k, state)  # 1. radix select
            gather(Values, m, start, end, k, state, Blocks, Out, m)  # 2. gather in ascending tiles

    return topk_stage


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
        starts = torch.zeros(1, dtype=torch.int32, device=device)
    if blocks is None:
        blocks = torch.zeros((1, 1), dtype=torch.int32, device=device)
    return [_values_arg(values, fl), ends, starts, blocks, out]


def _values_arg(values, fl: Flavour):
    return fl.bf16_arg(values) if values.dtype == torch.bfloat16 else values


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


def topk_program(problem: TopkProblem, config: dict, fl: Flavour):
    """The top-k stage; with sorted=True, then the rank-order stage."""
    select = topk_stage_program(config, fl, has_starts=problem.has_starts, bf16=problem.bf16_logits)
    return (select, rank_order_program(config, fl, bf16=problem.bf16_logits)) if problem.by_score else select


def topk_args(problem: TopkProblem, inputs: dict, config: dict, fl: Flavour, out):
    logits = inputs["logits"]
    if not problem.by_score:
        return topk_stage_args(logits, inputs["ends"], out, fl, starts=inputs["starts"])
    chosen = torch.empty_like(out)  # ascending, between the stages
    select_args = topk_stage_args(logits, inputs["ends"], chosen, fl, starts=inputs["starts"])
    if select_args is None:  # nothing chosen: the rank order is all -1 too
        out.fill_(-1)
        return None
    return select_args, [_values_arg(logits, fl), chosen, out]


# GPU resources, measured with build_sm90 (nvcc --resource-usage, sm_90a), threads x items: 128x32 40
# registers, 256x4 32, 512x8 48, 512x32 48, 1024x2 39, 1024x8 40, 1024x16 40 (with starts, drop_neg_inf
# and the index map or without), never a spill, so 1024 threads fit (<= 64 registers each); the
# block-score stage uses 24. Shared memory: the 1 KiB histogram, aliased with the 4 B x threads tile
# counts (at most 4 KiB). Nothing in the space spills or overflows shared memory: no GPU limits needed.
TOPK_SPACE = Space(
    params={"threads": (128, 256, 512, 1024), "items": (2, 4, 8, 16, 32)},
    constraints={
        "threads x items < 32768 (a tile's counts are packed in 16-bit halves)":
            lambda p, c: c["threads"] * c["items"] < 1 << 15,
    },
    gpu_only=("threads",),
)


def topk_default(problem: TopkProblem) -> dict:
    """A block per row, its width growing with the row: 256 threads below 8K positions, 1024 from 64K."""
    if problem.positions >= 1 << 16:
        return {"threads": 1024, "items": 8}
    if problem.positions >= 1 << 13:
        return {"threads": 512, "items": 8}
    return {"threads": 256, "items": 4}


# ---------------------------------------------------------------- candidate_blocks


def block_max_program(block: int, config: dict, fl: Flavour, *, bf16: bool = False):
    """Block scores [M, NB] of logits [M, N] (fp32, or bf16 with bf16; row-strided) below end = clamp(row_end, 0, N)
    (NaN as -inf, the block holding end - 1 +inf), a thread each."""
    per_block = config["score_threads"]
    rows, width, n_blocks = T.dynamic("M"), T.dynamic("N"), T.dynamic("NB")
    inf = T.infinity("float32")
    dtype, value = _values(fl, bf16)

    @T.prim_func
    def block_max(
        Logits: row_strided((rows, width), dtype, "logits"),
        RowEnd: T.Tensor((rows,), "int32"),
        Scores: T.Tensor((rows, n_blocks), "float32"),
    ):
        with T.Kernel(rows, T.ceildiv(n_blocks, per_block), threads=per_block) as (m, bx):  # rows may pass 65535: x
            best = fl.fragment((per_block,), "float32")
            end = T.alloc_var("int32", T.max(T.min(RowEnd[m], width), 0))  # any int32 row_end: clamped to [0, N]
            for b in fl.parallel(per_block):
                best[b] = -inf
                for j in T.serial(block):
                    n = (bx * per_block + b) * block + j
                    if n < end:  # the comparison is false for NaN: it counts as -inf
                        best[b] = T.if_then_else(value(Logits[m, n]) > best[b], value(Logits[m, n]), best[b])
                if bx * per_block + b < n_blocks:
                    newest = (end > 0) & (bx * per_block + b == (end - 1) // block)
                    # a zero maximum is stored as +0.0 (-0.0 ranks below it; which zero a max keeps is arbitrary)
                    zero_as_positive = T.if_then_else(best[b] == 0.0, 0.0, best[b])
                    Scores[m, bx * per_block + b] = T.if_then_else(newest, inf, zero_as_positive)

    return block_max


def blocks_program(problem: CandidateProblem, config: dict, fl: Flavour):
    """(block scores, top-k of them with -inf blocks dropped)."""
    return (block_max_program(problem.block, config, fl, bf16=problem.bf16_logits),
            topk_stage_program(config, fl, drop_neg_inf=True))


def blocks_args(problem: CandidateProblem, inputs: dict, config: dict, fl: Flavour, out):
    logits, row_end = inputs["logits"], inputs["row_end"]
    rows, width = logits.shape
    if rows == 0 or width == 0:  # no blocks: all -1
        out.fill_(-1)
        return None
    scores = torch.empty((rows, problem.blocks), dtype=torch.float32, device=logits.device)
    return [_values_arg(logits, fl), row_end, scores], topk_stage_args(scores, None, out, fl)


BLOCKS_SPACE = Space(
    params={"score_threads": (64, 128, 256), **TOPK_SPACE.params},
    constraints=TOPK_SPACE.constraints,
    gpu_only=("score_threads", "threads"),
)


def blocks_default(problem: CandidateProblem) -> dict:
    """128 blocks per scoring block; the top-k stage as topk_default for a row of ceil(N / block) scores."""
    return {"score_threads": 128, **topk_default(TopkProblem(problem.rows, problem.blocks, problem.n_blocks))}
