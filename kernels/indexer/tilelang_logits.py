"""Indexer scoring in TileLang: one source for CUDA and the CPU (C) target.

    logits[m, n] = sum_h w[m, h] * relu(q[m, h] . k[n]) * k_scale[n]      (masked to -inf outside a row's range)

Tile plan (every addressing mode): a block owns `rows` query rows x BN key slots.
  1. addressing (per mode): key_row[n] = the key read for slot n (a row of the flat key table,
     or page * bs + slot of the paged cache),
     key_pos[n] = its absolute position (-1: none), bounds[r] = [lo, hi) of row r.
       dense   slots are positions n0 + n of k [N, D]; bounds [ks, ke); `rows` = block_m rows; a block
               owns `tiles` key tiles, loads its queries once and streams the tiles that meet its rows'
               ranges through a pipelined T.copy (TMA on sm_90a; logits_program), -inf elsewhere
       paged   slots are positions of sequence b; cache block block_table[b, p // bs] (read only
               where some token sees p; an entry outside [0, cache blocks) gives key_pos -1 and
               key_row 0); bounds [0, context_lens[b] - next_n + j + 1) (computed in int64, clamped to
               [0, width]), or [0, context_lens[b, j]) for per-token (2-D) lengths; rows = next_n; a
               block owns `tiles` key tiles and copies each as pieces of gcd(BN, bs) keys, a cache block's
               (TMA on sm_90a; paged_program), -inf past what its tokens see
       sparse  slot c of row m is position blocks[m, c // block] * block + c % block (-1 for an id
               outside [0, ceil(N / block))); bounds [ks, ke) clamped to [0, N]; rows = 1
  2. if some row's range meets the tile: keys -> k_tile [CH * BN, DC] (gathered element by element:
     sparse; else copied), queries of the rows (heads
     padded to HP, a power of two >= 16) -> q_tile [CH * rows * HP, DC] (chunk c of D in the
     c-th row block), operands exact in e4m3 on GPU (e2m1 codes converted), decoded fp32 on CPU;
     scores acc [BN, rows * HP] = k_tile . q_tile^T (fp32 accumulate):
       fp8    one gemm over D (CH = 1); k_scale[n] times the head sum below (the reference's order)
       mxfp4  one gemm per 32-wide chunk c of D (CH = D / 32), each added with the weight
              2^(q_e - 127) * 2^(k_e - 127) (exact powers of two; a 0xFF byte is NaN)
     then relu (NaN kept: one max.NaN.f32 on the GPU), times w[m, h] (padded heads give 0), and a sum over the
     HP heads of each row
     (fp8: times k_scale[n]).
  3. store the [rows, BN] tile through a staging tile: the score where lo <= key_pos < hi, else -inf;
     fp32, or rounded to nearest-even bf16 (sparse: into the span's scores in shared memory, which the
     top-k stage's radix select then cuts to the span's best min(top_k, span); sparse_select_program).
q, q_scale, w, keys and their scales, block tables and candidate lists take run-time strides in
every dimension but the last (`row_strided`); 1-D tensors (a flat table's fp8 k_scale, ks, ke,
context lengths) and 2-D context lengths are contiguous.
The CPU flavour takes fp8 / packed fp4 data as uint8 and decodes it with the bit codecs; the
tiling, index math, masks and summation order are the same code for both targets, and fixed,
so repeated runs are bitwise identical.
Index values are never trusted: key_row is always a row of the key table (clamped, or 0 where nothing is found),
so any int32 in ks, ke, context lengths, block tables or candidate lists reads nothing outside a tensor, and
key_pos / bounds make what it points at -inf (reference/indexer.py).
"""

# No `from __future__ import annotations`: TileLang evaluates T.Tensor annotations against the closure.
import math

import torch

from flashkern.autotune.space import Space
from flashkern.kernels._tilelang import T, Flavour, codecs, placeholder, row_strided
from flashkern.kernels.indexer import tilelang_topk
from flashkern.kernels.indexer.problem import (LogitsProblem, PagedProblem, SparseProblem, kept_per_span, kept_width,
                                               span_slots)
from flashkern.kernels.tiles import SMS

MX_BLOCK = 32  # values per ue8m0 scale in the MXFP4 form
NO_POSITION = -1
LAST_POSITION = 2**31 - 1

# relu that keeps NaN in one instruction (PTX max.NaN.f32, sm_80+): TileLang's max of fp32 lowers to fmaxf, which
# drops NaN, so the CUDA flavour calls this and the C flavour selects.
RELU_KEEPING_NAN = """
__device__ __forceinline__ float fk_relu_keeping_nan(float x) {
  float y;
  asm("max.NaN.f32 %0, %1, 0f00000000;" : "=f"(y) : "f"(x));
  return y;
}
"""


def relu_keeping_nan(fl: Flavour, x):
    """max(x, 0), NaN kept (as torch.relu); a kernel that uses it calls import_relu_keeping_nan first."""
    return T.call_extern("float32", "fk_relu_keeping_nan", x) if fl.on_gpu else T.if_then_else(x < 0.0, 0.0, x)


def import_relu_keeping_nan(fl: Flavour):
    """On the GPU, RELU_KEEPING_NAN's source into the kernel (at the top of its body)."""
    if fl.on_gpu:
        T.import_source(RELU_KEEPING_NAN)


def _head_slots(heads: int) -> int:
    """Heads padded to a power of two (CUDA reductions) of at least 16 (MMA tile width)."""
    return max(16, 1 << (heads - 1).bit_length())


class _Storage:
    """Tensor dtypes, addressing and element decoding of one indexer's storage format on one target.

    Query rows are rows of q [M, H, ...], or (paged, next_n given) rows b * next_n + j of q [B, next_n, H, ...];
    keys are rows of a flat table [N, ...], or (paged, block_size given) keys page * block_size + slot of a cache
    [blocks, block_size, ...]. Every tensor but the 1-D ones may have any strides (unit last stride).
    """

    def __init__(self, indexer, fl: Flavour, next_n: int | None = None, block_size: int | None = None,
                 bf16_logits: bool = False):
        self.fl = fl
        self.fp8 = indexer.fmt == "fp8"
        self.heads, self.dim, self.packed = indexer.heads, indexer.dim, indexer.packed_dim
        self.chunks, self.chunk = (1, self.dim) if self.fp8 else (self.dim // MX_BLOCK, MX_BLOCK)
        self.data = "float8_e4m3fn" if self.fp8 and fl.on_gpu else "uint8"  # q and k tensors
        self.operand = "float8_e4m3fn" if fl.on_gpu else "float32"  # gemm tiles
        self.next_n, self.block_size = next_n, block_size
        self.bf16_logits = bf16_logits

    def _q_lead(self, row) -> tuple:
        return (row,) if self.next_n is None else (row // self.next_n, row % self.next_n)

    def _k_lead(self, key) -> tuple:
        return (key,) if self.block_size is None else (key // self.block_size, key % self.block_size)

    def q_tensor(self, lead: tuple):
        return row_strided((*lead, self.heads, self.packed), self.data, "q")

    def q_scale_tensor(self, lead: tuple):
        """MXFP4 q scales; for fp8 a placeholder (its per-token q scale is folded into w)."""
        shape = (1,) * (len(lead) + 2) if self.fp8 else (*lead, self.heads, self.chunks)
        return row_strided(shape, "uint8", "q_scale")

    def k_tensor(self, lead: tuple):
        return row_strided((*lead, self.packed), self.data, "k")

    def k_scale_tensor(self, lead: tuple):
        """fp32 per key (a flat table's is 1-D, contiguous), or ue8m0 bytes per 32 values."""
        if self.fp8 and len(lead) == 1:
            return T.Tensor(lead, "float32")
        return row_strided(lead if self.fp8 else (*lead, self.chunks), "float32" if self.fp8 else "uint8", "k_scale")

    def out_tensor(self, shape: tuple):
        return T.Tensor(shape, self.fl.bf16 if self.bf16_logits else "float32")

    @property
    def per_byte(self) -> int:
        """Values per stored element: one e4m3, or two e2m1 codes."""
        return 1 if self.fp8 else 2

    def q_at(self, Q, row, head, element):
        return Q[(*self._q_lead(row), head, element)]

    def q_scale_at(self, Qscale, row, head, chunk):
        return codecs.ue8m0_to_f32(Qscale[(*self._q_lead(row), head, chunk)])

    def k_at(self, K, key, element):
        return K[(*self._k_lead(key), element)]

    def key_scale(self, Kscale, key, chunk):
        """The stored scale: fp32 (fp8), or a ue8m0 byte (MXFP4)."""
        return Kscale[self._k_lead(key) if self.fp8 else (*self._k_lead(key), chunk)]

    def e4m3(self, stored):
        """A stored e4m3 value as a gemm operand."""
        return stored if self.fl.on_gpu else codecs.e4m3_to_f32(stored)

    def e2m1(self, byte, shift: int):
        """The e2m1 code at bit `shift` of a byte as a gemm operand (exact in e4m3)."""
        value = codecs.e2m1_to_f32(T.shift_right(T.Cast("uint32", byte), T.uint32(shift)))
        return T.Cast(self.operand, value) if self.fl.on_gpu else value

    def logit(self, value):
        """An fp32 logit as stored: itself, or rounded to nearest-even bf16."""
        return self.fl.store_bf16(value) if self.bf16_logits else value


class _TileMacros:
    """The mode-independent parts of a block that scores `rows` query rows against block_n key slots: buffers,
    the query load (once per block), the key load (gathered through key_row, or copied from a contiguous run of
    keys), the MMA and relu-weighted head sum, and the masked store. `aligned` (`sparse_layout`): FP8 key rows
    start on 16-byte boundaries, so the GPU gathers them in 16-byte cp.async pieces, not a byte at a time."""

    def __init__(self, st: _Storage, rows: int, block_n: int, aligned: bool = False):
        self.st, self.rows, self.block_n, self.aligned = st, rows, block_n, aligned
        fl = st.fl
        H, HP, CH, DC = st.heads, _head_slots(st.heads), st.chunks, st.chunk
        BN, RH = block_n, rows * _head_slots(st.heads)
        DS = DC // st.per_byte  # stored elements per chunk
        NEG_INF = -T.infinity("float32")

        @T.macro
        def put(tile, row, j, stored):
            """Decode stored element j of a chunk into tile[row, ...] (e2m1 pairs: even value in the low nibble)."""
            if st.fp8:
                tile[row, j] = st.e4m3(stored)
            else:
                tile[row, 2 * j] = st.e2m1(stored, 0)
                tile[row, 2 * j + 1] = st.e2m1(stored, 4)

        @T.macro
        def queries(Q, Qscale, W, m0, n_rows, q_tile, w_tile, q_scale):
            """q_tile, w_tile (and the MXFP4 q scales) of rows m0 + r (rows past n_rows repeat the last)."""
            if self.copies_operand and H == HP and st.next_n is None:  # e4m3 rows as they are: a copy a row
                for r in T.serial(rows):
                    T.copy(Q[T.min(m0 + r, n_rows - 1), 0:H, 0:DC], q_tile[r * HP:(r + 1) * HP, 0:DC])
            else:
                for c, i, j in fl.parallel(CH, RH, DS):
                    put(q_tile, c * RH + i, j,
                        st.q_at(Q, T.min(m0 + i // HP, n_rows - 1), T.min(i % HP, H - 1), c * DS + j))
            for i in fl.parallel(RH):
                w_tile[i] = W[T.min(m0 + i // HP, n_rows - 1), T.min(i % HP, H - 1)]
            if not st.fp8:
                for i, c in fl.parallel(RH, CH):
                    q_scale[i, c] = st.q_scale_at(Qscale, T.min(m0 + i // HP, n_rows - 1), T.min(i % HP, H - 1), c)

        @T.macro
        def gathered_keys(K, Kscale, key_row, k_tile, k_scale):
            """Slot n's key: row key_row[n] of the key table, element by element."""
            if fl.on_gpu and st.fp8 and self.aligned:  # 16-byte pieces of each key row, by cp.async
                T.assume(K.strides[0] % KEY_PIECE == 0)
                for n, j in T.Parallel(BN, DS, coalesced_width=T.int32(KEY_PIECE), prefer_async=True):
                    k_tile[n, j] = st.k_at(K, key_row[n], j)
            else:
                for c, n, j in fl.parallel(CH, BN, DS):
                    put(k_tile, c * BN + n, j, st.k_at(K, key_row[n], c * DS + j))
            if st.fp8:
                for n in fl.parallel(BN):
                    k_scale[n] = st.key_scale(Kscale, key_row[n], 0)
            else:
                for n, c in fl.parallel(BN, CH):
                    k_scale[n, c] = st.key_scale(Kscale, key_row[n], c)

        @T.macro
        def copied_piece(K, Kscale, lead, start, piece, at, k_raw, k_scale):
            """Keys [start, start + piece) of K[lead] (a flat table: lead is empty, or a cache block) into slots
            [at, at + piece) of the staging tile, as a tile copy (past the table: zeros, never stored)."""
            T.copy(K[(*lead, slice(start, start + piece), slice(0, st.packed))], k_raw[at:at + piece, 0:st.packed])
            if st.fp8:
                T.copy(Kscale[(*lead, slice(start, start + piece))], k_scale[at:at + piece])
            else:
                T.copy(Kscale[(*lead, slice(start, start + piece), slice(0, CH))], k_scale[at:at + piece, 0:CH])

        @T.macro
        def decoded_keys(k_raw, k_tile):
            """The staged stored keys as MMA operands (nothing to do where they were copied straight in)."""
            if not self.copies_operand:
                for c, n, j in fl.parallel(CH, BN, DS):
                    put(k_tile, c * BN + n, j, k_raw[n, c * DS + j])

        @T.macro
        def mma(k_tile, k_scale, q_tile, w_tile, q_scale, logits):
            """logits[n, r] = sum_h w[r, h] relu(q[r, h] . k[n]) x k_scale[n] (fp8; MXFP4: the block scales inside the
            dot products; padded heads give 0)."""
            acc = fl.fragment((BN, RH), "float32")
            if st.fp8:
                T.gemm(k_tile, q_tile, acc, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
            else:
                part = fl.fragment((BN, RH), "float32")
                for n, i in fl.parallel(BN, RH):
                    acc[n, i] = 0.0
                for c in T.serial(CH):
                    T.gemm(k_tile[c * BN:(c + 1) * BN, :], q_tile[c * RH:(c + 1) * RH, :], part, transpose_B=True,
                           clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                    for n, i in fl.parallel(BN, RH):
                        acc[n, i] = acc[n, i] + part[n, i] * (q_scale[i, c] * codecs.ue8m0_to_f32(k_scale[n, c]))
            per_head = T.reshape(acc, (BN, rows, HP))
            for n, r, h in fl.parallel(BN, rows, HP):  # relu keeps NaN (a 0xFF scale), as the reference's
                per_head[n, r, h] = T.if_then_else(h < H, relu_keeping_nan(fl, per_head[n, r, h]) * w_tile[r * HP + h],
                                                   0.0)
            T.reduce_sum(per_head, logits, dim=2)
            if st.fp8:  # the key's scale times the head sum (a multiply a key and row, not a key and head)
                for n, r in fl.parallel(BN, rows):
                    logits[n, r] = logits[n, r] * k_scale[n]

        @T.macro
        def store(logits, key_pos, bounds, n_rows, m0, out_m0, n0, width, Out):
            """Out[out_m0 + r, n0 + n] = logits[n, r] where lo_r <= key_pos[n] < hi_r, else -inf (rows m0 + r <
            n_rows, columns < width)."""
            staged = fl.shared((rows, BN), "float32")
            for n, r in fl.parallel(BN, rows):
                staged[r, n] = T.if_then_else((key_pos[n] >= bounds[r, 0]) & (key_pos[n] < bounds[r, 1]),
                                              logits[n, r], NEG_INF)
            for r, n in fl.parallel(rows, BN):
                if (m0 + r < n_rows) & (n0 + n < width):
                    Out[out_m0 + r, n0 + n] = st.logit(staged[r, n])

        @T.macro
        def fill_unseen(unseen, tile, m0, n_rows, width, Out):
            """Out[m0 + r, tile * BN + n] = -inf where `unseen` (a tile no row of the block sees; rows m0 + r <
            n_rows, columns < width)."""
            if unseen:
                for r, n in fl.parallel(rows, BN):
                    if (m0 + r < n_rows) & (tile * BN + n < width):
                        Out[m0 + r, tile * BN + n] = st.logit(NEG_INF)

        @T.macro
        def tile(Q, Qscale, W, K, Kscale, key_row, key_pos, bounds, m0, n_rows, first, last, out_m0, n0, width,
                 Out):
            """Score gathered keys if some row's [lo, hi) meets positions [first, last]; store [rows, BN] at
            (out_m0, n0)."""
            k_tile, k_scale, q_tile, w_tile, q_scale = self.buffers()
            logits = fl.fragment((BN, rows), "float32")
            live = T.alloc_var("int32", init=0)
            for r in T.serial(rows):
                if (m0 + r < n_rows) & (bounds[r, 0] < bounds[r, 1]) & (bounds[r, 0] <= last) & (bounds[r, 1] > first):
                    live = 1
            if live == 1:
                queries(Q, Qscale, W, m0, n_rows, q_tile, w_tile, q_scale)
                gathered_keys(K, Kscale, key_row, k_tile, k_scale)
                mma(k_tile, k_scale, q_tile, w_tile, q_scale, logits)
            store(logits, key_pos, bounds, n_rows, m0, out_m0, n0, width, Out)

        self.queries, self.mma, self.store, self.fill_unseen, self.tile = queries, mma, store, fill_unseen, tile
        self.copied_piece, self.decoded_keys = copied_piece, decoded_keys

    @property
    def copies_operand(self) -> bool:
        """Stored keys are the MMA operand itself (e4m3 on GPU): copied straight into it."""
        return self.st.fp8 and self.st.fl.on_gpu

    def buffers(self):
        """(k_tile [CH x BN, DC] (chunk c of D in rows c x BN ..), k_scale (fp8: [BN] fp32; MXFP4: [BN, CH] ue8m0
        bytes), q_tile [CH x rows x HP, DC], w_tile [rows x HP], q_scale [rows x HP, CH] (MXFP4; else unused))."""
        st, fl, BN = self.st, self.st.fl, self.block_n
        RH = self.rows * _head_slots(st.heads)
        k_scale = fl.shared((BN,), "float32") if st.fp8 else fl.shared((BN, st.chunks), "uint8")
        return (fl.shared((st.chunks * BN, st.chunk), st.operand), k_scale,
                fl.shared((st.chunks * RH, st.chunk), st.operand), fl.shared((RH,), "float32"),
                fl.shared((RH, st.chunks), "float32"))

    def key_staging(self, k_tile):
        """Where copied keys land: the operand itself, or a tile of stored bytes to decode."""
        if self.copies_operand:
            return k_tile
        return self.st.fl.shared((self.block_n, self.st.packed), self.st.data)


def _addressing(fl: Flavour, rows: int, block_n: int):
    """Per-block index buffers: key_row [BN], key_pos [BN] (int32) and bounds [rows, 2] (lo, hi)."""
    return (fl.shared((block_n,), "int32"), fl.shared((block_n,), "int32"), fl.shared((rows, 2), "int32"))


def _q_scale_arg(q_scale, lead_dims: int, device):
    """MXFP4 q scales, or a placeholder for fp8 (whose per-token q scale is folded into w)."""
    return placeholder((1,) * (lead_dims + 2), torch.uint8, device) if q_scale is None else q_scale


def _data_arg(tensor, st: _Storage):
    """q / k as the kernel takes them: e4m3 itself on GPU, its bytes on CPU; packed fp4 bytes as they are."""
    return tensor if st.data != "uint8" else tensor.view(torch.uint8)


def _out_arg(logits, fl: Flavour):
    """The logits as the kernel takes them (bf16 travels as its uint16 bits on CPU)."""
    return fl.bf16_arg(logits) if logits.dtype == torch.bfloat16 else logits


# ---------------------------------------------------------------- mqa_logits (dense, ragged)


def logits_program(problem: LogitsProblem, config: dict, fl: Flavour):
    """logits [M, N] for q [M, H, D], k [N, D] with per-row key ranges [ks, ke).

    DeepGEMM's structure: a block owns block_m rows and `tiles` consecutive key tiles; it loads the rows' queries
    once, then streams the tiles that meet some row's range through a pipelined T.copy (TMA on sm_90a, the keys
    as the M side of the MMA) while the previous tile's relu-weighted head sum runs; tiles no row sees get -inf."""
    BM, BN, TILES = config["block_m"], config["block_n"], config["tiles"]
    st = _Storage(problem.indexer, fl, bf16_logits=problem.bf16_logits)
    tm = _TileMacros(st, BM, BN)
    H = st.heads
    M, N = T.dynamic("M"), T.dynamic("N")

    @T.prim_func
    def mqa_logits(
        Q: st.q_tensor((M,)),
        Qscale: st.q_scale_tensor((M,)),
        K: st.k_tensor((N,)),
        Kscale: st.k_scale_tensor((N,)),
        W: row_strided((M, H), "float32", "w"),
        Ks: T.Tensor((M,), "int32"),
        Ke: T.Tensor((M,), "int32"),
        Out: st.out_tensor((M, N)),
    ):
        with T.Kernel(T.ceildiv(N, BN * TILES), T.ceildiv(M, BM), threads=config["threads"]) as (bx, by):
            import_relu_keeping_nan(fl)
            _, key_pos, bounds = _addressing(fl, BM, BN)
            k_tile, k_scale, q_tile, w_tile, q_scale = tm.buffers()
            k_raw = tm.key_staging(k_tile)
            logits = fl.fragment((BN, BM), "float32")
            lo = T.alloc_var("int32", init=N)  # the union of the rows' ranges, clamped to [0, N]
            hi = T.alloc_var("int32", init=0)
            for r in fl.parallel(BM):
                bounds[r, 0] = Ks[T.min(by * BM + r, M - 1)]
                bounds[r, 1] = Ke[T.min(by * BM + r, M - 1)]
            for r in T.serial(BM):
                if (by * BM + r < M) & (bounds[r, 0] < bounds[r, 1]):
                    lo = T.min(lo, T.max(bounds[r, 0], 0))
                    hi = T.max(hi, T.min(bounds[r, 1], N))
            first = T.max(bx * TILES, lo // BN)  # the block's tiles that meet the union: [first, first + count)
            count = T.min(T.max(T.min(bx * TILES + TILES, T.ceildiv(hi, BN)) - first, 0), TILES)
            tm.queries(Q, Qscale, W, by * BM, M, q_tile, w_tile, q_scale)
            for i in T.Pipelined(count, num_stages=2):
                tm.copied_piece(K, Kscale, (), (first + i) * BN, BN, 0, k_raw, k_scale)
                tm.decoded_keys(k_raw, k_tile)
                tm.mma(k_tile, k_scale, q_tile, w_tile, q_scale, logits)
                for n in fl.parallel(BN):
                    key_pos[n] = (first + i) * BN + n
                tm.store(logits, key_pos, bounds, M, by * BM, by * BM, (first + i) * BN, N, Out)
            for t in T.serial(TILES):
                tm.fill_unseen((bx * TILES + t < first) | (bx * TILES + t >= first + count), bx * TILES + t, by * BM,
                               M, N, Out)

    return mqa_logits


def logits_args(problem: LogitsProblem, inputs: dict, config: dict, fl: Flavour, out):
    q, k = inputs["q"], inputs["k"]
    st = _Storage(problem.indexer, fl)
    if out.numel() == 0:
        return None
    return [fl.tma_arg(_data_arg(q, st)), _q_scale_arg(inputs["q_scale"], 1, q.device), fl.tma_arg(_data_arg(k, st)),
            fl.tma_arg(inputs["k_scale"]), inputs["w"], inputs["ks"], inputs["ke"], _out_arg(out, fl)]


# ---------------------------------------------------------------- paged_mqa_logits (decode)


def paged_rows(problem: PagedProblem, config: dict) -> int:
    """Query tokens of a sequence per block: config["block_rows"], at most next_n."""
    return min(config["block_rows"], problem.next_n)


def paged_program(problem: PagedProblem, config: dict, fl: Flavour):
    """logits [B * next_n, max_blocks * bs] over a paged cache [blocks, bs, D]; a block scores `block_rows` tokens of
    a sequence (token chunk `chunk` of ceil(next_n / block_rows)) against `tiles` key tiles: it loads the tokens'
    queries once and streams the tiles some token sees through a pipelined T.copy of cache-block pieces (TMA on
    sm_90a, each piece's block from the table), -inf elsewhere; decode splits the context over the blocks."""
    BN, NEXT, BS, RW, TILES = (config["block_n"], problem.next_n, problem.block_size, paged_rows(problem, config),
                               config["tiles"])
    CHUNKS = -(-NEXT // RW)
    PIECE = math.gcd(BN, BS)  # keys a copy moves: contiguous in one cache block
    st = _Storage(problem.indexer, fl, next_n=NEXT, block_size=BS, bf16_logits=problem.bf16_logits)
    tm = _TileMacros(st, RW, BN)
    H = st.heads
    B, MB, NB = T.dynamic("B"), T.dynamic("max_blocks"), T.dynamic("cache_blocks")
    R, WIDTH = T.dynamic("rows"), T.dynamic("width")  # B * next_n, MB * bs

    def table_entry(Table, b, at, seen):
        """The cache block holding position `at` of sequence b, or -1 past what the block's tokens see."""
        return T.if_then_else(at < seen, Table[b, T.min(at // BS, MB - 1)], -1)

    def cache_block(Table, b, at, seen):
        """The block a piece at `at` is copied from: its table entry where that is a cache block, else block 0 (its
        positions get no key); clamped, so that the copy is provably inside the cache (no (named) let: the macro
        expands once a piece)."""
        return T.max(T.min(T.if_then_else((table_entry(Table, b, at, seen) >= 0)
                                          & (table_entry(Table, b, at, seen) < NB), table_entry(Table, b, at, seen), 0),
                           NB - 1), 0)

    def pieces(count: int):
        """A macro copying the first `count` pieces of a tile (unrolled here: a copy inside a loop is no TMA)."""

        @T.macro
        def copy_pieces(K, Kscale, Table, b, tile_start, seen, k_raw, k_scale):
            if count > 1:
                pieces(count - 1)(K, Kscale, Table, b, tile_start, seen, k_raw, k_scale)
            # table entries past the context may be garbage: never followed, nor any outside [0, NB)
            tm.copied_piece(K, Kscale, (cache_block(Table, b, tile_start + (count - 1) * PIECE, seen),),
                            (tile_start + (count - 1) * PIECE) % BS, PIECE, (count - 1) * PIECE, k_raw, k_scale)

        return copy_pieces

    @T.prim_func
    def paged_mqa_logits(
        Q: st.q_tensor((B, NEXT)),
        Qscale: st.q_scale_tensor((B, NEXT)),
        K: st.k_tensor((NB, BS)),
        Kscale: st.k_scale_tensor((NB, BS)),
        W: row_strided((R, H), "float32", "w"),
        Table: row_strided((B, MB), "int32", "block_table"),
        Lens: T.Tensor((B, NEXT) if problem.lens_2d else (B,), "int32"),
        Out: st.out_tensor((R, WIDTH)),
    ):
        with T.Kernel(T.ceildiv(WIDTH, BN * TILES), B * CHUNKS, threads=config["threads"]) as (bx, by):
            import_relu_keeping_nan(fl)
            T.assume(NB > 0)  # (paged_args launches nothing for an empty cache)
            b, chunk = by // CHUNKS, by % CHUNKS
            m0 = b * NEXT + chunk * RW
            _, key_pos, bounds = _addressing(fl, RW, BN)
            k_tile, k_scale, q_tile, w_tile, q_scale = tm.buffers()
            k_raw = tm.key_staging(k_tile)
            logits = fl.fragment((BN, RW), "float32")
            for j in fl.parallel(RW):  # token chunk * RW + j of sequence b (none past next_n: an empty range)
                bounds[j, 0] = 0
                if problem.lens_2d:  # per token: row b * next_n + j sees [0, context_lens[b, j])
                    bounds[j, 1] = T.if_then_else(chunk * RW + j < NEXT, Lens[b, T.min(chunk * RW + j, NEXT - 1)], 0)
                else:  # per sequence: token j sees [0, context_lens[b] - next_n + j + 1), in int64: no wrap
                    end = T.Cast("int64", Lens[b]) - NEXT + chunk * RW + j + 1
                    bounds[j, 1] = T.if_then_else(
                        chunk * RW + j < NEXT, T.Cast("int32", T.max(T.min(end, T.Cast("int64", WIDTH)), 0)), 0)
            seen = T.alloc_var("int32", init=0)  # positions some token of the block sees, at most WIDTH
            for j in T.serial(RW):
                seen = T.max(seen, T.min(bounds[j, 1], WIDTH))
            count = T.min(T.max(T.min(bx * TILES + TILES, T.ceildiv(seen, BN)) - bx * TILES, 0), TILES)
            tm.queries(Q, Qscale, W, m0, b * NEXT + NEXT, q_tile, w_tile, q_scale)
            for i in T.Pipelined(count, num_stages=2):
                if fl.on_gpu:
                    pieces(BN // PIECE)(K, Kscale, Table, b, (bx * TILES + i) * BN, seen, k_raw, k_scale)
                else:  # the same copies in a loop (the C target has no TMA to keep; it compiles 2.5-6x faster)
                    for piece in T.serial(BN // PIECE):
                        at = (bx * TILES + i) * BN + piece * PIECE
                        tm.copied_piece(K, Kscale, (cache_block(Table, b, at, seen),), at % BS, PIECE, piece * PIECE,
                                        k_raw, k_scale)
                for n in fl.parallel(BN):
                    at = (bx * TILES + i) * BN + n
                    page = table_entry(Table, b, at, seen)
                    key_pos[n] = T.if_then_else((page >= 0) & (page < NB), at, NO_POSITION)
                tm.decoded_keys(k_raw, k_tile)
                tm.mma(k_tile, k_scale, q_tile, w_tile, q_scale, logits)
                tm.store(logits, key_pos, bounds, b * NEXT + NEXT, m0, m0, (bx * TILES + i) * BN, WIDTH, Out)
            for t in T.serial(TILES):  # tiles no token of the block sees
                tm.fill_unseen(t >= count, bx * TILES + t, m0, b * NEXT + NEXT, WIDTH, Out)

    return paged_mqa_logits


def paged_args(problem: PagedProblem, inputs: dict, config: dict, fl: Flavour, out):
    q, k_cache = inputs["q"], inputs["k_cache"]
    st = _Storage(problem.indexer, fl)
    if out.numel() == 0 or k_cache.shape[0] == 0:  # no cache blocks: no key, every position -inf
        out.fill_(-torch.inf)
        return None
    return [_data_arg(q, st), _q_scale_arg(inputs["q_scale"], 2, q.device), _data_arg(k_cache, st),
            inputs["k_scale"], inputs["w"], inputs["block_table"], inputs["context_lens"], _out_arg(out, fl)]


# ---------------------------------------------------------------- sparse: scored and selected per span


KEY_PIECE = 16  # bytes of an aligned key gather: e4m3 values


def sparse_layout(inputs: dict) -> bool:
    """Whether k's rows start on 16-byte boundaries (its data pointer and row stride: metadata only), so that the
    span stage may gather FP8 keys in 16-byte pieces."""
    k = inputs["k"]
    return k.data_ptr() % KEY_PIECE == 0 and k.stride(0) * k.element_size() % KEY_PIECE == 0


def sparse_select_program(problem: SparseProblem, config: dict, fl: Flavour, aligned: bool):
    """Per row m and span s of candidate slots, the span's best KEEP = kept_per_span: scores Kept [M, spans x KEEP]
    (then -inf) and absolute positions KeptPos, in candidate order (a span that keeps all its slots keeps them in
    place, column = slot, and no positions); KeptEnd [M] (zeroed by the caller) rises by an atomic max to the end of
    the row's last span with an eligible candidate (with a candidate block, when the span keeps all).
    Tile plan: a block scores its span's tiles (those holding a candidate block) into shared memory (the gather of
    candidate keys rules out T.copy: FP8 keys come in 16-byte cp.async pieces where `aligned`), then runs the top-k
    stage's radix select there."""
    BN, BLK, THREADS = config["block_n"], problem.block, config["threads"]
    SPAN, KEEP = span_slots(config), kept_per_span(problem, config)
    st = _Storage(problem.indexer, fl)
    tile = _TileMacros(st, 1, BN, aligned).tile
    select, gather = tilelang_topk.selection_macros(
        fl, THREADS, max(1, SPAN // THREADS), lambda scores, m, n: T.reinterpret(scores[m, n], "int32"),
        tilelang_topk.dropping(True), tilelang_topk.mapping(0))
    H = st.heads
    M, N, NB = T.dynamic("M"), T.dynamic("N"), T.dynamic("NB")
    KW = T.dynamic("kept_width")  # spans x KEEP

    @T.prim_func
    def sparse_select(
        Q: st.q_tensor((M,)),
        Qscale: st.q_scale_tensor((M,)),
        K: st.k_tensor((N,)),
        Kscale: st.k_scale_tensor((N,)),
        W: row_strided((M, H), "float32", "w"),
        Ks: T.Tensor((M,), "int32"),
        Ke: T.Tensor((M,), "int32"),
        Blocks: row_strided((M, NB), "int32", "blocks"),
        Kept: T.Tensor((M, KW), "float32"),
        KeptPos: T.Tensor((M, KW) if KEEP < SPAN else (1, 1), "int32"),  # (else the merge maps through Blocks)
        KeptEnd: T.Tensor((M,), "int32"),
    ):
        with T.Kernel(T.ceildiv(NB * BLK, SPAN), M, threads=THREADS) as (bx, m):
            import_relu_keeping_nan(fl)
            key_row, key_pos, bounds = _addressing(fl, 1, BN)
            span_scores = fl.shared((1, SPAN), "float32")
            chosen = fl.shared((1, KEEP), "int32")  # span slots taken, ascending
            listed = fl.shared((2,), "int32")  # some slot of the tile, of the span, has a candidate block
            state = T.alloc_local((3,), "int32")  # the select's thr, budget, valid
            keys = fl.fragment((THREADS, max(1, SPAN // THREADS)), "int32")  # the span's keys
            for r in fl.parallel(1):  # clamped to [0, N]: NO_POSITION and positions past the keys are never visible
                bounds[r, 0] = T.max(Ks[m], 0)
                bounds[r, 1] = T.min(Ke[m], N)
            listed[1] = 0
            for t in T.serial(SPAN // BN):
                listed[0] = 0
                for n in fl.parallel(BN):
                    # the candidate block id; one outside [0, ceil(N / BLK)) (-1 included) is no candidate
                    slot = bx * SPAN + t * BN + n
                    key_row[n] = T.if_then_else(slot < NB * BLK, Blocks[m, T.min(slot // BLK, NB - 1)], -1)
                    key_pos[n] = T.if_then_else((key_row[n] >= 0) & (key_row[n] < T.ceildiv(N, BLK)),
                                                key_row[n] * BLK + slot % BLK, NO_POSITION)
                    key_row[n] = T.max(T.min(key_pos[n], N - 1), 0)
                    if key_pos[n] >= 0:
                        listed[0] = 1
                if listed[0] == 1:  # (candidate lists are -1 padded: the tiles past a row's last are not scored)
                    listed[1] = 1
                    tile(Q, Qscale, W, K, Kscale, key_row, key_pos, bounds, m, M, 0, LAST_POSITION, 0, t * BN, SPAN,
                         span_scores)
                else:
                    for n in fl.parallel(BN):
                        span_scores[0, t * BN + n] = -T.infinity("float32")
            if KEEP < SPAN:
                select(span_scores, 0, 0, SPAN, KEEP, state, keys)
                gather(span_scores, 0, 0, SPAN, KEEP, state, Blocks, chosen, 0, keys)
            else:  # the span keeps every eligible slot where it is (the merge drops -inf and NaN)
                state[2] = KEEP * listed[1]
                for i in fl.parallel(KEEP):
                    chosen[0, i] = i
            for i in fl.parallel(KEEP):
                slot = bx * SPAN + chosen[0, i]
                if i < state[2]:
                    Kept[m, bx * KEEP + i] = span_scores[0, chosen[0, i]]
                    if KEEP < SPAN:
                        KeptPos[m, bx * KEEP + i] = Blocks[m, T.min(slot // BLK, NB - 1)] * BLK + slot % BLK
                else:
                    Kept[m, bx * KEEP + i] = -T.infinity("float32")
            if state[2] > 0:
                T.atomic_max(KeptEnd[m], (bx + 1) * KEEP)

    return sparse_select


def sparse_select_args(problem: SparseProblem, inputs: dict, config: dict, fl: Flavour):
    """(arguments of the span stage, or None when it has nothing to launch, and the kept scores, positions (None
    when spans keep all their slots in place) and ends it fills)."""
    q, k, blocks = inputs["q"], inputs["k"], inputs["blocks"]
    st = _Storage(problem.indexer, fl)
    kept = torch.empty((q.shape[0], kept_width(problem, config)), dtype=torch.float32, device=q.device)
    selects = kept_per_span(problem, config) < span_slots(config)
    positions = torch.empty(kept.shape if selects else (1, 1), dtype=torch.int32, device=q.device)  # (placeholder)
    ends = torch.zeros(q.shape[0], dtype=torch.int32, device=q.device)
    outputs = kept, positions if selects else None, ends
    if kept.numel() == 0 or k.shape[0] == 0:  # no keys: no candidate position exists (ends 0: nothing to merge)
        return None, outputs
    return [_data_arg(q, st), _q_scale_arg(inputs["q_scale"], 1, q.device), _data_arg(k, st), inputs["k_scale"],
            inputs["w"], inputs["ks"], inputs["ke"], blocks, kept, positions, ends], outputs


# ---------------------------------------------------------------- tuning spaces


def _accumulator_values(indexer, rows: int, config: dict) -> int:
    """fp32 accumulator values per thread: the [block_n, rows x HP] scores (mxfp4: and its per-chunk partial)."""
    accumulators = 1 if indexer.fmt == "fp8" else 2
    return accumulators * config["block_n"] * rows * _head_slots(indexer.heads) // config["threads"]


# Register model, from nvcc --resource-usage at D = 128 (registers per thread, no spills unless said):
#   accumulator values 16 -> 34, 32 -> 58, 64 -> 90 (fp8 and mxfp4), 128 -> 157..163, 256 -> 255 (fp8, at the
#   cap) or 255 + 180 B of spills (mxfp4). So at most 128 values. Shared memory peaks at 52 KiB in these spaces
#   (block_m 4 x 64 heads x block_n 128, fp8): far from the limit, so it is not modelled.
REGISTERS = "accumulators x block_n x rows x padded heads / threads <= 128 (registers)"
LOGITS_SPACE = Space(
    params={"block_m": (1, 2, 4, 8), "block_n": (64, 128), "tiles": (1, 2, 4, 8, 16), "threads": (128, 256)},
    gpu_only=("threads",),
    limits={REGISTERS: lambda p, c: _accumulator_values(p.indexer, c["block_m"], c) <= 128},
)
PAGED_SPACE = Space(
    params={"block_n": (64, 128), "block_rows": (1, 2, 4, 8), "tiles": (1, 2, 4, 8, 16), "threads": (128, 256)},
    constraints={"block_rows < 2 x next_n (more would repeat a smaller config)":
                 lambda p, c: c["block_rows"] < 2 * p.next_n},
    gpu_only=("threads",),
    limits={REGISTERS: lambda p, c: _accumulator_values(p.indexer, paged_rows(p, c), c) <= 128},
)
SPARSE_SPACE = Space(
    params={"block_n": (64, 128), "tiles": (1, 2, 4, 8, 16), "threads": (128, 256)},
    gpu_only=("threads",),
    limits={REGISTERS: lambda p, c: _accumulator_values(p.indexer, 1, c) <= 128},
)


def _tiles_a_block(key_tiles: int, other_blocks: int) -> int:
    """Key tiles a block streams (its queries loaded once for them): the fewest that fit the blocks in one wave at a
    block an SM (the registers leave room for no second), up to 16. Each wave pays the fixed per-block costs (the
    queries, the table, the pipeline's fill) again: 8 sequences x 8K positions at 4 tiles a block (128 blocks)
    model at 3.5 us, at 2 (256 blocks, two waves) 6.0 us."""
    return next((t for t in (1, 2, 4, 8) if -(-key_tiles // t) * other_blocks <= SMS), 16)


def logits_default(problem: LogitsProblem) -> dict:
    """128 keys a tile against up to 256 score columns (rows x padded heads; 128 a warpgroup, so a row block reads
    each key once for as many rows as the registers allow: at most the space's 8 and 128 accumulator values a
    thread), `_tiles_a_block` tiles a block. 16 rows of 512K keys: 8
    rows a block model at 51 us before the head sum's issue is counted, 4 at 59 (HBM: each key read 4 times), 2 at
    99 (L2)."""
    head_slots = _head_slots(problem.indexer.heads)
    block_m = max(1, min(1 << (problem.rows - 1).bit_length(), 256 // head_slots, max(LOGITS_SPACE.params["block_m"])))
    while True:  # mxfp4 keeps two accumulators: half the rows (sm_90a, 3 x 200 keys: 4 rows on 128 threads spill
        # 404 B, on 256 268 B; 2 rows on 128 threads take 189 registers)
        config = {"block_m": block_m, "block_n": 128, "threads": 256 if block_m * head_slots > 128 else 128}
        if block_m == 1 or _accumulator_values(problem.indexer, block_m, config) <= 128:
            break
        block_m //= 2
    return {**config, "tiles": _tiles_a_block(-(-problem.keys // 128), -(-problem.rows // block_m))}


def paged_default(problem: PagedProblem) -> dict:
    """128 keys a tile; one warpgroup, else two, else 64-key tiles on two, for a sequence's next_n tokens in one
    block, or for a power of two fewer where all would not fit in the registers (MTP with 64 heads); `_tiles_a_block`
    tiles a block. 8 sequences of 64K positions: 16 tiles a block model at 19.2 us (HBM, 78% of the roof), 4 at
    20.0, 1 at 56.0 (latency: each block's queries, table and pipeline filled again)."""
    block_rows = min(8, 1 << (problem.next_n - 1).bit_length())  # next_n rounded up to a power of two
    while True:
        for tile in ({"block_n": 128, "threads": 128}, {"block_n": 128, "threads": 256}, {"block_n": 64, "threads": 256}):
            sequence_blocks = problem.batch * -(-problem.next_n // block_rows)
            tiles = _tiles_a_block(-(-problem.width // tile["block_n"]), sequence_blocks)
            config = {**tile, "block_rows": block_rows, "tiles": tiles}
            if block_rows == 1 or not PAGED_SPACE.violations(problem, config):
                return config
        block_rows //= 2


def sparse_default(problem: SparseProblem) -> dict:
    """128 keys a tile on one warpgroup, a tile per span. Spans of 8 tiles (top_k 512 keeping half of 1024) model
    slower, 27.7 against 13.6 us at one row of 16384 candidates and 41.5 against 40.4 at 16: the scalar gather of
    the scoring bounds this kernel (issue, LSU), and the top-k stage's fixed costs its merge, not the width."""
    return {"block_n": 128, "tiles": 1, "threads": 128}
