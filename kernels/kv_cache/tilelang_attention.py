"""Sparse decode attention over FP4 / MXFP8 KV-cache records in TileLang: one source for CUDA and the CPU (C) target.

    s_j = scale * q[t, h] . kv_j over the selected keys j of token t (both caches; -1 / out-of-range slots are none)
    d = sum_j exp(s_j) + exp(sink[h]);  out = bf16(sum_j exp(s_j) / d * kv_j);  lse = log d

grid (T, ceil(H / block_h), splits); tile: block_h heads (the MMA's M side; K = V) x block_n keys x 512 columns.
  1. q_tile [block_h, 512] once; per key block (key_splits: top-k blocks, then the window's, by index row or by
     position) the records gathered to shared memory and decoded once into k_tile bf16 (bf16x2 pairs: bits placed,
     two exact multiplies), 16-byte stores; shared_window: window blocks whose keys tokens of the call hold are
     read from bf16 rows a stage 0 decoded once per token (docs/operators.md 8.4);
  2. s = q_tile . k_tile^T * scale, online softmax in fp32 (shift 0 where m is not finite), p rounded to bf16,
     acc = acc alpha + p . k_tile (T.gemm: wgmma at 64 heads);
  3. out and lse (the sink joins), or fp32 partials for `combine_program`, staged in shared memory, 16-byte stores.
H200: issue-bound (the decode, the QK k-steps, the rescale); T = 4096 near the tensor term (584 us, 59% of the
bf16 peak). The key loop is not pipelined (TileLang 0.1.15 pipelines cp.async gathers only over static trip
counts). CPU: the tiles are local fp32 buffers of the same bf16 values; docs/operators.md 8.3.
"""

# No `from __future__ import annotations`: TileLang evaluates T.Tensor annotations against the closure.
import torch

from flashkern.autotune.space import Space
from flashkern.kernels._tilelang import T, Flavour, codecs, placeholder, row_strided
from flashkern.kernels.kv_cache.problem import WINDOW_BY_POSITION, AttentionProblem, key_splits
from flashkern.kernels.kv_cache.tilelang_records import cache_arg, scale_value, slot_locator
from flashkern.kernels.tiles import SMS
from flashkern.reference.kv_cache import FORMATS, LATENT

COMBINE_THREADS = 128
COMBINE_COLUMNS = 128  # a combine block's columns; its heads: the config's combine_heads (combine_heads_for)
BF16_PER_16_BYTES = 8


def neg_inf():
    return -T.infinity("float32")


def _finite(x):
    return (x > neg_inf()) & (x < T.infinity("float32"))


def _shift(m):
    """What the softmax subtracts for a running max m: m itself, 0 where m is +-inf (or NaN)."""
    return T.if_then_else(_finite(m), m, T.float32(0))


def _rescale(m, shift):
    """exp(shift(m) - shift): the weight of sums taken at max m when the shift moves to `shift`; 0 with no keys."""
    return T.if_then_else(m == neg_inf(), T.float32(0), T.exp(_shift(m) - shift))


def _sink(Sink, h, has_sink):
    """The sink logit of head h, -inf without a sink."""
    return T.if_then_else(has_sink != 0, Sink[h], neg_inf())


def shares_window(problem: AttentionProblem, config: dict) -> bool:
    """Whether the plan decodes the window once for the call (docs/operators.md section 8.4, "Sharing the window's
    decodes"): each token's own window record into bf16 rows first (window_rows), which the key loop reads for the
    window keys that tokens of the call hold; by position only, where the config asks (`shared_window`)."""
    return problem.window_by_position and bool(config.get("shared_window", 0))


def _not_held(Positions, SeqIds, t, source, key):
    """Whether token `source` of the call is not token t's key `key` (the same sequence, at that position): outside
    the call, another sequence or another position."""
    clamped = T.min(T.max(source, 0), Positions.shape[0] - 1)
    return ((source < 0) | (source >= Positions.shape[0]) | (SeqIds[clamped] != SeqIds[t])
            | (Positions[clamped] != key))


def pair_bits(fmt, rec, n, g, j):
    """The bf16x2 bits of codes 2j, 2j + 1 of scale block g of record n in rec, before the rebias."""
    if fmt.name == "fp4":
        return codecs.e2m1_pair_bf16x2(rec[n, g * (fmt.group // 2) + j])
    first = g * fmt.group + 2 * j
    return codecs.e4m3_pair_bf16x2(rec[n, first], rec[n, first + 1])


def rebias(fmt):
    """The bf16x2 power of two that takes pair_bits to the codes' values."""
    return T.uint32(codecs.E2M1_REBIAS_BF16X2 if fmt.name == "fp4" else codecs.E4M3_REBIAS_BF16X2)


def _cache_tensor(fmt, blocks, block_size, page_stride):
    """A paged record cache uint8 [blocks, block_size, bytes] with any page stride."""
    return T.StridedTensor((blocks, block_size, fmt.bytes), (page_stride, fmt.bytes, 1), "uint8")


def attend_program(problem: AttentionProblem, config: dict, fl: Flavour, aligned: bool):
    """Stage 1 (module docstring): out / lse directly with one split (the partials are then placeholders
    [1, 1, H, ..]), else the partials [splits, T, H, ..] (acc; m and l); with the shared window (shares_window)
    also stage 0, window_rows, which decodes each token's own window record once for the key loop to read. The
    heads, the window (0 without a window cache) and has_sink are run-time values, so problems that differ only in
    them share one compiled kernel; `aligned` (attention_layout) chooses the GPU's loads at build time, so a kernel
    holds one load path."""
    BH, BN = config["block_h"], config["block_n"]
    kv_fmt, swa_fmt = FORMATS[problem.kv_format], FORMATS[problem.swa_format]
    operand = "bfloat16" if fl.on_gpu else "float32"  # the gemm tiles: bf16 values either way
    NT, H, TOPK, W = T.dynamic("T"), T.dynamic("heads"), T.dynamic("topk"), T.dynamic("window")
    KB, KBS, KPS = T.dynamic("kv_blocks"), T.dynamic("kv_block_size"), T.dynamic("kv_page_stride")
    SB, SBS, SPS = T.dynamic("swa_blocks"), T.dynamic("swa_block_size"), T.dynamic("swa_page_stride")
    SP, PT = T.dynamic("splits"), T.dynamic("partial_tokens")
    # the window by position: block table [sequences, width], positions and sequence ids of the T tokens, lower
    # bounds per sequence (sizes of their own: without them the arguments are one-element placeholders)
    NS, NP, NQ, NL = (T.dynamic(name) for name in ("sequences", "table_width", "position_count", "lower_count"))
    NW = T.dynamic("swa_index_rows")  # T, or 0 for the window by position
    NR = T.dynamic("window_rows")  # T with the shared window, else 1
    window_by_position, shared = problem.window_by_position, shares_window(problem, config)
    kv_key_blocks = T.ceildiv(TOPK, BN)  # then ceil(W / BN) window blocks
    key_blocks = kv_key_blocks + T.ceildiv(W, BN)

    def as_operand(x):
        """An fp32 value as a gemm operand: bf16 on the GPU, rounded to bf16 in fp32 on the CPU."""
        return T.Cast("bfloat16", x) if fl.on_gpu else fl.round_bf16(x)

    def bf16_operand(stored):
        """A stored bf16 element (of q, or of a decoded window row) as a gemm operand (exact)."""
        return stored if fl.on_gpu else fl.load_bf16(stored)

    @T.macro
    def fill_rows(tile, rows, c0, width, piece, strides, value):
        """tile[r, c0 + c] = value(r, c0 + c) over [rows, width] of a tile that global loads fill. On the GPU with
        `aligned` set (the host found the source 16-byte aligned and its `strides` multiples of a `piece`, the
        elements in 16 bytes) in 16-byte pieces through cp.async (a power-of-two count of pieces a row keeps the
        thread-to-piece map in shifts); otherwise a row at a time, element by element."""
        if fl.on_gpu:
            if aligned:
                for stride in strides:
                    T.assume(stride % piece == 0)
                for r, c in T.Parallel(rows, width, coalesced_width=T.int32(piece), prefer_async=True):
                    tile[r, c0 + c] = value(r, c0 + c)
            else:
                for r in T.serial(rows):
                    for c in T.Parallel(width):
                        tile[r, c0 + c] = value(r, c0 + c)
        else:
            for r, c in T.grid(rows, width):
                tile[r, c0 + c] = value(r, c0 + c)

    @T.macro
    def load_q(Q, t, h0, q_tile):
        """q_tile = the block's heads of token t (rows past H zero)."""
        fill_rows(q_tile, BH, 0, LATENT, BF16_PER_16_BYTES, Q.strides[:2], lambda h, d: T.if_then_else(
            h0 + h < H, bf16_operand(Q[t, T.min(h0 + h, H - 1), d]), T.Cast(operand, 0)))

    def listed(Indices, t, first):
        """locate(Cache, n, page, row): where entry first + n of the index row Indices[t] is (page -1: none)."""
        locate_slot = slot_locator()

        @T.macro
        def locate(Cache, n, page, row):
            locate_slot(Cache, T.if_then_else(first + n < Indices.shape[1],
                                              Indices[t, T.min(first + n, Indices.shape[1] - 1)], -1), page, row, n)
        return locate

    def by_table(Table, SeqIds, Lower, has_lower, token_of, position_of, entry_ok, key):
        """locate(Cache, n, page, row) for entry n: key position j = position_of(n) of sequence SeqIds[token_of(n)],
        seen where entry_ok(n), j >= max(Lower[seq], 0) (has_lower) and its page's table entry is a page of Cache
        (row[n] holds the clamped sequence id meanwhile, key[n] j); every table read is clamped into the table."""
        @T.macro
        def locate(Cache, n, page, row):
            row[n] = T.min(T.max(SeqIds[token_of(n)], 0), Table.shape[0] - 1)
            key[n] = position_of(n)
            page[n] = T.if_then_else(
                (SeqIds[token_of(n)] == row[n]) & entry_ok(n) & (key[n] >= 0)
                & (key[n] >= T.if_then_else(has_lower != 0, Lower[T.min(row[n], Lower.shape[0] - 1)], 0))
                & (key[n] // Cache.shape[1] < Table.shape[1]),
                Table[row[n], T.min(T.max(key[n], 0) // Cache.shape[1], Table.shape[1] - 1)], -1)
            page[n] = T.if_then_else((page[n] >= 0) & (page[n] < Cache.shape[0]), page[n], -1)
            row[n] = T.if_then_else(page[n] >= 0, key[n] % Cache.shape[1], 0)
        return locate

    def by_position(Table, Positions, SeqIds, Lower, has_lower, t, first, key):
        """Window entry e = first + n of token t (reference.window_slots): key Positions[t] - W + 1 + e, e < W."""
        return by_table(Table, SeqIds, Lower, has_lower, lambda n: t, lambda n: Positions[t] - W + 1 + first + n,
                        lambda n: first + n < W, key)

    def own_records(Table, Positions, SeqIds, t0, key):
        """Entry n: token t0 + n's own window record (its position, no lower bound; none past the tokens)."""
        token_of = lambda n: T.min(t0 + n, Positions.shape[0] - 1)  # noqa: E731
        return by_table(Table, SeqIds, SeqIds, 0, token_of, lambda n: Positions[token_of(n)],
                        lambda n: t0 + n < Positions.shape[0], key)

    @T.macro
    def decode_keys(Cache, fmt, page, row, rec, k_tile):
        """The located key block's records gathered and dequantized once into k_tile (zero rows for none)."""
        for c0, width in ((0, fmt.code_bytes), (fmt.code_bytes, fmt.bytes - fmt.code_bytes)):  # codes, then scales
            fill_rows(rec, BN, c0, width, 16, Cache.strides[:1], lambda n, b: T.if_then_else(
                page[n] >= 0, Cache[T.Cast("int64", page[n]), row[n], b], T.uint8(0)))
        for n, g in fl.parallel(BN, fmt.scales):  # a none slot's record is zeros: its values decode to 0
            # two codes -> a bf16x2 (codecs), times the rebias, times the scale: both exact
            scale2 = codecs.bf16x2_of_f32(scale_value(fmt, rec, n, g))
            values = T.alloc_local((fmt.group,), operand)
            for j in T.unroll(fmt.group // 2):
                fl.put_bf16x2(values, 2 * j, fl.mul_bf16x2(fl.mul_bf16x2(pair_bits(fmt, rec, n, g, j), rebias(fmt)),
                                                           scale2))
            for e in T.vectorized(fmt.group):
                k_tile[n, g * fmt.group + e] = values[e]

    @T.macro
    def load_keys(Cache, locate, fmt, page, row, rec, k_tile):
        """A key block: page and row of each of its BN entries (`locate`; page -1: none), the records gathered,
        dequantized once into k_tile (zero rows for none)."""
        for n in fl.parallel(BN):  # (sizes spelled out, never bound to a local name: that renames their variable)
            locate(Cache, n, page, row)
        decode_keys(Cache, fmt, page, row, rec, k_tile)

    @T.macro
    def find_decoded_end(Swa, SwaTable, Positions, SeqIds, Lower, has_lower, t, block, first, page, row, key,
                         decoded_end):
        """The shared window: decoded_end[0] = block + 1 where window entries first .. of token t hold a key that no
        token of the call holds as its own (token t - W + 1 + e, the same sequence, that position); called over the
        blocks in order, it leaves the end of the blocks to decode."""
        for n in fl.parallel(BN):
            by_position(SwaTable, Positions, SeqIds, Lower, has_lower, t, first, key)(Swa, n, page, row)
        for n in fl.parallel(BN):
            if (page[n] >= 0) & _not_held(Positions, SeqIds, t, t - W + 1 + first + n, key[n]):
                decoded_end[0] = block + 1

    @T.macro
    def load_window_rows(Swa, SwaTable, Positions, SeqIds, Lower, has_lower, Rows, t, first, page, row, key, k_tile):
        """The shared window's key block of token t (entries first .., every key held by a token of the call): read
        from those tokens' decoded Rows (16-byte loads; zero rows for none)."""
        for n in fl.parallel(BN):
            by_position(SwaTable, Positions, SeqIds, Lower, has_lower, t, first, key)(Swa, n, page, row)
        for n in fl.parallel(BN):
            key[n] = T.min(T.max(t - W + 1 + first + n, 0), Rows.shape[0] - 1)  # the row to read
        fill_rows(k_tile, BN, 0, LATENT, BF16_PER_16_BYTES, (), lambda n, d: T.if_then_else(
            page[n] >= 0, bf16_operand(Rows[key[n], d]), T.Cast(operand, 0)))

    @T.macro
    def attend_keys(q_tile, k_tile, page, scale, s, p_tile, acc, m, l, m_new, block_max, block_sum, alpha):
        """Scores of the key block, online softmax (module docstring), acc += p . k_tile."""
        T.gemm(q_tile, k_tile, s, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
        for h, n in fl.parallel(BH, BN):
            s[h, n] = T.if_then_else(page[n] >= 0, s[h, n] * scale, neg_inf())
        T.reduce_max(s, block_max, dim=1)
        for h in fl.parallel(BH):  # (helpers get buffer elements: a nested expression would be copied into each use)
            m_new[h] = T.max(m[h], block_max[h])
            block_max[h] = _shift(m_new[h])
            alpha[h] = _rescale(m[h], block_max[h])
            m[h] = m_new[h]
        for h, n in fl.parallel(BH, BN):
            s[h, n] = T.exp(s[h, n] - block_max[h])
        T.reduce_sum(s, block_sum, dim=1)
        for h in fl.parallel(BH):
            l[h] = l[h] * alpha[h] + block_sum[h]
        for h, d in fl.parallel(BH, LATENT):
            acc[h, d] = acc[h, d] * alpha[h]
        for h, n in fl.parallel(BH, BN):
            p_tile[h, n] = as_operand(s[h, n])
        T.gemm(p_tile, k_tile, acc, policy=T.GemmWarpPolicy.FullRow)

    @T.prim_func
    def sparse_attend(
        Q: row_strided((NT, H, LATENT), fl.bf16, "q"),
        KV: _cache_tensor(kv_fmt, KB, KBS, KPS),
        Indices: row_strided((NT, TOPK), "int32", "indices"),
        Swa: _cache_tensor(swa_fmt, SB, SBS, SPS),
        SwaIndices: row_strided((NW, W), "int32", "swa_indices"),  # by position: [0, window], W its width
        SwaTable: row_strided((NS, NP), "int32", "swa_block_table"),
        Positions: T.Tensor((NQ,), "int32"),
        SeqIds: T.Tensor((NQ,), "int32"),
        Lower: T.Tensor((NL,), "int32"),
        Rows: T.Tensor((NR, LATENT), fl.bf16),  # the shared window's decoded rows: [T, 512], else [1, 512]
        Sink: T.Tensor((H,), "float32"),
        Out: T.Tensor((NT, H, LATENT), fl.bf16),
        Lse: T.Tensor((NT, H), "float32"),
        PartialO: T.Tensor((SP, PT, H, LATENT), "float32"),
        PartialML: T.Tensor((SP, PT, H, 2), "float32"),
        scale: T.float32,
        blocks_per_split: T.int32,
        has_sink: T.int32,
        has_lower: T.int32,
    ):
        with T.Kernel(NT, T.ceildiv(H, BH), SP, threads=config["threads"]) as (t, head_group, split):
            q_tile = fl.shared((BH, LATENT), operand)
            k_tile = fl.shared((BN, LATENT), operand)
            p_tile = fl.shared((BH, BN), operand)
            rec = fl.shared((BN, max(kv_fmt.bytes, swa_fmt.bytes)), "uint8")
            o_partial = fl.shared((BH, LATENT), "float32")  # after the keys: shares the tiles' shared memory
            page = fl.shared((BN,), "int32")
            row = fl.shared((BN,), "int32")
            key = fl.shared((BN,), "int32")  # the window by position's key positions
            found_end = fl.shared((1,), "int32")  # the shared window: the window blocks to decode end here
            acc = fl.fragment((BH, LATENT), "float32")
            s = fl.fragment((BH, BN), "float32")
            m = fl.fragment((BH,), "float32")
            l = fl.fragment((BH,), "float32")
            m_new = fl.fragment((BH,), "float32")
            block_max = fl.fragment((BH,), "float32")  # then the shift
            sink = fl.fragment((BH,), "float32")
            block_sum = fl.fragment((BH,), "float32")
            alpha = fl.fragment((BH,), "float32")
            h0, first = head_group * BH, split * blocks_per_split

            load_q(Q, t, h0, q_tile)
            for h, d in fl.parallel(BH, LATENT):
                acc[h, d] = 0.0
            for h in fl.parallel(BH):
                m[h] = neg_inf()
                l[h] = 0.0
            # the split's key blocks [first, first + blocks_per_split): those of the main cache, then the window's
            for i in T.serial(T.max(T.min(first + blocks_per_split, kv_key_blocks) - first, 0)):
                load_keys(KV, listed(Indices, t, (first + i) * BN), kv_fmt, page, row, rec, k_tile)
                attend_keys(q_tile, k_tile, page, scale, s, p_tile, acc, m, l, m_new, block_max, block_sum, alpha)
            # the window's blocks [window_first, window_end): with the shared window, those after the last one with a
            # key no token of the call holds (found first, so that each loop holds one path) come from Rows
            window_first, window_end = T.max(first, kv_key_blocks), T.min(first + blocks_per_split, key_blocks)
            decode_end = window_end
            if shared:
                decode_end = T.alloc_var("int32", window_end)  # a scalar: a shared value bounds no GPU loop
                found_end[0] = window_first
                for i in T.serial(T.max(window_end - window_first, 0)):
                    find_decoded_end(Swa, SwaTable, Positions, SeqIds, Lower, has_lower, t, window_first + i,
                                     (window_first + i - kv_key_blocks) * BN, page, row, key, found_end)
                decode_end = found_end[0]
            for i in T.serial(T.max(decode_end - window_first, 0)):
                if window_by_position:
                    load_keys(Swa, by_position(SwaTable, Positions, SeqIds, Lower, has_lower, t,
                                               (window_first + i - kv_key_blocks) * BN, key),
                              swa_fmt, page, row, rec, k_tile)
                else:
                    load_keys(Swa, listed(SwaIndices, t, (window_first + i - kv_key_blocks) * BN),
                              swa_fmt, page, row, rec, k_tile)
                attend_keys(q_tile, k_tile, page, scale, s, p_tile, acc, m, l, m_new, block_max, block_sum, alpha)
            if shared:
                for i in T.serial(T.max(window_end - decode_end, 0)):
                    load_window_rows(Swa, SwaTable, Positions, SeqIds, Lower, has_lower, Rows, t,
                                     (decode_end + i - kv_key_blocks) * BN, page, row, key, k_tile)
                    attend_keys(q_tile, k_tile, page, scale, s, p_tile, acc, m, l, m_new, block_max, block_sum,
                                alpha)

            if SP == 1:  # out = acc f / d, lse = shift + log d (block_max: the shift; alpha: f / d)
                for h in fl.parallel(BH):
                    sink[h] = _sink(Sink, T.min(h0 + h, H - 1), has_sink)
                    m_new[h] = T.max(m[h], sink[h])
                    block_max[h] = _shift(m_new[h])
                    alpha[h] = _rescale(m[h], block_max[h])
                    block_sum[h] = l[h] * alpha[h] + T.exp(sink[h] - block_max[h])
                    if h0 + h < H:
                        Lse[t, h0 + h] = block_max[h] + T.log(block_sum[h])
                    alpha[h] = T.if_then_else(block_sum[h] > 0.0, alpha[h] / block_sum[h], T.float32(0))
                for h, d in fl.parallel(BH, LATENT):  # staged in q_tile (free now), then 16-byte stores
                    q_tile[h, d] = as_operand(acc[h, d] * alpha[h])
                for h, d in fl.parallel(BH, LATENT):
                    if h0 + h < H:
                        Out[t, h0 + h, d] = q_tile[h, d] if fl.on_gpu else fl.store_bf16(q_tile[h, d])
            else:
                for h, d in fl.parallel(BH, LATENT):  # staged in shared memory, then 16-byte stores
                    o_partial[h, d] = acc[h, d]
                for h, d in fl.parallel(BH, LATENT):
                    if h0 + h < H:
                        PartialO[split, t, h0 + h, d] = o_partial[h, d]
                for h in fl.parallel(BH):
                    if h0 + h < H:
                        PartialML[split, t, h0 + h, 0] = m[h]
                        PartialML[split, t, h0 + h, 1] = l[h]

    @T.prim_func
    def window_rows(
        Swa: _cache_tensor(swa_fmt, SB, SBS, SPS),
        SwaTable: row_strided((NS, NP), "int32", "swa_block_table"),
        Positions: T.Tensor((NT,), "int32"),
        SeqIds: T.Tensor((NT,), "int32"),
        Rows: T.Tensor((NT, LATENT), fl.bf16),
    ):
        """Stage 0 with the shared window: Rows[t] = token t's own window record decoded (zeros where none)."""
        with T.Kernel(T.ceildiv(NT, BN), threads=config["threads"]) as block:
            k_tile = fl.shared((BN, LATENT), operand)
            rec = fl.shared((BN, swa_fmt.bytes), "uint8")
            page = fl.shared((BN,), "int32")
            row = fl.shared((BN,), "int32")
            key = fl.shared((BN,), "int32")
            load_keys(Swa, own_records(SwaTable, Positions, SeqIds, block * BN, key), swa_fmt, page, row, rec,
                      k_tile)
            for n, d in fl.parallel(BN, LATENT):
                if block * BN + n < NT:
                    Rows[block * BN + n, d] = k_tile[n, d] if fl.on_gpu else fl.store_bf16(k_tile[n, d])

    return (window_rows, sparse_attend) if shared else sparse_attend


def combine_program(problem: AttentionProblem, config: dict, fl: Flavour):
    """Stage 2 (module docstring): merge the splits' partials [splits, T, H, ..], the sink joining. A block takes
    combine_heads heads x COMBINE_COLUMNS columns of a token (Triton's tile at 4 heads): the heads' split weights
    exp(shift(m_s) - shift) / d from two row reductions over the [heads, max_splits] tile of maxima and sums, into
    shared memory once; then each column sums its partials over the splits that ran (a loop over the run-time
    split count: a plan with few splits loads nothing for the rest)."""
    MS, CH, CD = config["max_splits"], config["combine_heads"], COMBINE_COLUMNS
    NT, H, SP = T.dynamic("T"), T.dynamic("heads"), T.dynamic("splits")

    def partial(PartialML, t, s, h, field, none):
        """Split s's max (field 0) or sum (1) for token t, head h; `none` for splits past SP and heads past H."""
        return T.if_then_else((s < SP) & (h < H), PartialML[T.min(s, SP - 1), t, T.min(h, H - 1), field], none)

    @T.prim_func
    def combine_splits(
        PartialO: T.Tensor((SP, NT, H, LATENT), "float32"),
        PartialML: T.Tensor((SP, NT, H, 2), "float32"),
        Sink: T.Tensor((H,), "float32"),
        Out: T.Tensor((NT, H, LATENT), fl.bf16),
        Lse: T.Tensor((NT, H), "float32"),
        has_sink: T.int32,
    ):
        with T.Kernel(NT, T.ceildiv(H, CH), LATENT // CD, threads=COMBINE_THREADS) as (t, head_block, column_block):
            m = fl.fragment((CH, MS), "float32")  # each split's max, then its term of d
            rescale = fl.fragment((CH, MS), "float32")
            shift = fl.fragment((CH,), "float32")
            total = fl.fragment((CH,), "float32")
            weight = fl.shared((CH, MS), "float32")
            acc = fl.fragment((CH, CD), "float32")
            h0, d0 = head_block * CH, column_block * CD
            for h, s in fl.parallel(CH, MS):
                m[h, s] = partial(PartialML, t, s, h0 + h, 0, neg_inf())
            T.reduce_max(m, shift, dim=1)
            for h in fl.parallel(CH):
                shift[h] = _shift(T.max(shift[h], _sink(Sink, T.min(h0 + h, H - 1), has_sink)))
            for h, s in fl.parallel(CH, MS):
                rescale[h, s] = _rescale(m[h, s], shift[h])
                m[h, s] = rescale[h, s] * partial(PartialML, t, s, h0 + h, 1, 0.0)
            T.reduce_sum(m, total, dim=1)
            for h in fl.parallel(CH):  # the sink joins d (0 without a sink)
                total[h] = total[h] + T.exp(_sink(Sink, T.min(h0 + h, H - 1), has_sink) - shift[h])
                if (column_block == 0) & (h0 + h < H):
                    Lse[t, h0 + h] = shift[h] + T.log(total[h])
            for h, s in fl.parallel(CH, MS):
                weight[h, s] = T.if_then_else(total[h] > 0.0, rescale[h, s] / total[h], 0.0)
            for h, d in fl.parallel(CH, CD):
                acc[h, d] = 0.0
            for s in T.serial(SP):
                for h, d in fl.parallel(CH, CD):
                    acc[h, d] = acc[h, d] + PartialO[s, t, T.min(h0 + h, H - 1), d0 + d] * weight[h, s]
            for h, d in fl.parallel(CH, CD):
                if h0 + h < H:
                    Out[t, h0 + h, d0 + d] = fl.store_bf16(acc[h, d])

    return combine_splits


def attention_program(problem: AttentionProblem, config: dict, fl: Flavour, aligned: bool):
    """([window rows,] attend, combine): the window rows with the shared window; the combine runs only when the
    split plan has more than one split."""
    attend = attend_program(problem, config, fl, aligned)
    return (*(attend if isinstance(attend, tuple) else (attend,)), combine_program(problem, config, fl))


def attention_layout(inputs: dict) -> bool:
    """Whether q's rows and the caches' pages start on 16-byte boundaries (data pointers and strides: metadata),
    so that the kernel may load them in 16-byte pieces."""
    q, caches = inputs["q"], [c for c in (inputs["kv_cache"], inputs["swa_cache"]) if c is not None]
    return (q.data_ptr() % 16 == 0 and q.stride(0) % BF16_PER_16_BYTES == 0 and q.stride(1) % BF16_PER_16_BYTES == 0
            and all(c.data_ptr() % 16 == 0 and c.stride(0) % 16 == 0 for c in caches))


def attention_args(problem: AttentionProblem, inputs: dict, config: dict, fl: Flavour, out):
    """The stages' arguments; absent inputs (window cache, sink) and, with one split, the partials are
    placeholders the kernels never read."""
    if problem.tokens == 0:
        return None
    plan = key_splits(problem, config["block_h"], config["block_n"], config["max_splits"])
    H, tokens, device = problem.heads, problem.tokens, inputs["q"].device
    if problem.swa:
        swa = cache_arg(inputs["swa_cache"])
    else:  # window 0: no key block reads it
        swa = placeholder((1, 1, FORMATS[problem.swa_format].bytes), torch.uint8, device)
    swa_indices = inputs["swa_indices"]
    if swa_indices is None:  # its width is the window's (0 without one); no rows: never read
        swa_indices = placeholder((0, problem.window), torch.int32, device)
    none = placeholder((1, 1), torch.int32, device)  # an int32 argument the kernel never reads
    table, positions, seq_ids, lower = (inputs.get(name) for name in WINDOW_BY_POSITION if name != "window")
    if not problem.window_by_position:
        table, positions, seq_ids = none, none[0], none[0]
    has_lower = int(lower is not None)
    lower = lower if has_lower else none[0]
    sink = inputs["sink"] if problem.sink else placeholder((H,), torch.float32, device)
    scale = LATENT**-0.5 if inputs["scale"] is None else float(inputs["scale"])
    partial_tokens = tokens if plan.splits > 1 else 1
    partial_o = torch.empty((plan.splits, partial_tokens, H, LATENT), dtype=torch.float32, device=device)
    partial_ml = torch.empty((plan.splits, partial_tokens, H, 2), dtype=torch.float32, device=device)
    out_bf16 = fl.bf16_arg(out.out)
    q, kv = inputs["q"], cache_arg(inputs["kv_cache"])
    shared = shares_window(problem, config)
    rows = fl.bf16_arg(torch.empty((tokens if shared else 1, LATENT), dtype=torch.bfloat16, device=device))
    attend = [fl.bf16_arg(q), kv, inputs["indices"], swa, swa_indices, table, positions, seq_ids, lower, rows, sink,
              out_bf16, out.lse, partial_o, partial_ml, scale, plan.blocks_per_split, int(problem.sink), has_lower]
    stages = ([swa, table, positions, seq_ids, rows],) if shared else ()
    return *stages, attend, (None if plan.splits == 1 else [partial_o, partial_ml, sink, out_bf16, out.lse,
                                                            int(problem.sink)])


# ---------------------------------------------------------------- tuning space

# sm_90a builds (nvcc --resource-usage; both formats' paths in every build, one load path: attention_layout),
# registers a thread at (block_h, threads, block_n): (64, 256, 32) 252 and (64, 256, 64) 255 (wgmma, no spills),
# (16, 128, 64) 230 (mma.sync: below 64 heads a tile no warpgroup MMA): the fp32 accumulator [block_h, 512] takes at
# most 128 registers a thread. 64 keys a block fit beside it once the record gather walks codes and scales apart (a
# power-of-two count of 16-byte pieces a row: 33 a row made int64 divisions whose results spilled). Shared memory
# peaks at 192 KiB (64 heads: q and k tiles in bf16, a 528-byte record tile, the fp32 partials' staging sharing
# their space after the keys), within the 227 KiB a CTA may take, so it is not modelled.
ATTENTION_SPACE = Space(
    params={"block_h": (16, 32, 64), "block_n": (16, 32, 64), "max_splits": (1, 2, 4, 8, 16, 32),
            "threads": (128, 256), "combine_heads": (4, 8, 16), "shared_window": (0, 1)},
    gpu_only=("threads",),
    constraints={"shared_window only by position": lambda p, c: p.window_by_position or not c["shared_window"]},
    limits={"block_h x 512 / threads <= 128 (registers: the fp32 output accumulator)":
            lambda p, c: c["block_h"] * LATENT // c["threads"] <= 128,
            "warps <= (block_h / 16) x (block_n / 8) (MMA pieces of the scores)":
            lambda p, c: c["threads"] // 32 <= c["block_h"] // 16 * (c["block_n"] // 8)},
)


def attention_default(problem: AttentionProblem) -> dict:
    """A token's heads in one tile (64: two warpgroups on wgmma; fewer heads: 16 or 32, four warps), 64-key blocks,
    once tokens x ceil(H / 64) >= 32, splitting the keys up to one wave below 132. Fewer tokens (decode): 16 heads
    a tile and up to 16 splits, so that more CTAs share the keys and the partials stay small. The performance
    model, 64 heads, with the combine: T = 1 / 8 (16-head tiles) 3.0 / 4.9 us, T = 64 (64-head tiles) 16.5 us;
    T = 4096: 616 us (32 keys a block: 875 us before the MXFP8 pairs). Not the shared window: the model cannot
    count it yet (docs/operators.md 8.4); benchmarks/designs.py times it on a GPU."""
    combine = {"combine_heads": combine_heads_for(problem), "shared_window": 0}
    if problem.tokens * -(-problem.heads // 64) < 32:
        return {"block_h": 16, "block_n": 64, "max_splits": 16, "threads": 128, **combine}
    block_h = next(b for b in (16, 32, 64) if b >= min(problem.heads, 64))
    return {"block_h": block_h, "block_n": 64, "max_splits": 16, "threads": 256 if block_h == 64 else 128, **combine}


def combine_heads_for(problem: AttentionProblem) -> int:
    """The combine's heads a block: the most (16, 8, 4) that still leave a block per SM, so a batch of tokens takes
    fewer, longer blocks (model, T = 64: 4096 blocks of 4 heads, latency-bound at 8.0 us -> 1024 of 16, 5.7 us on
    the partials' HBM traffic) and a single token keeps 64 (16 would leave 116 SMs idle: 1.0 -> 3.0 us)."""
    column_blocks = LATENT // COMBINE_COLUMNS
    return next((c for c in (16, 8) if problem.tokens * -(-problem.heads // c) * column_blocks >= SMS), 4)
