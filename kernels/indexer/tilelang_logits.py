"""Indexer scoring in TileLang: one source for CUDA and the CPU (C) target.

    logits[m, n] = sum_h w[m, h] * relu(q[m, h] . k[n]) * k_scale[n]      (masked to -inf outside a row's range)

Tile plan (every addressing mode): a block owns `rows` query rows x BN key slots.
  1. addressing (per mode): key_row[n] = the row of the flat key table read for slot n,
     key_pos[n] = its absolute position (-1: none), bounds[r] = [lo, hi) of row r.
       dense   slots are positions n0 + n of k [N, D]; bounds [ks, ke); `rows` = block_m rows
       paged   slots are positions of sequence b; cache block block_table[b, p // bs] (read only
               where p < context_lens[b]); bounds [0, context_lens[b] - next_n + j + 1); rows = next_n
       sparse  slot c of row m is position blocks[m, c // block] * block + c % block; bounds
               [ks, ke); rows = 1
  2. if some row's range meets the tile: keys -> k_tile [CH * BN, DC], queries of the rows (heads
     padded to HP, a power of two >= 16) -> q_tile [CH * rows * HP, DC] (chunk c of D in the
     c-th row block), operands exact in e4m3 on GPU (e2m1 codes converted), decoded fp32 on CPU;
     scores acc [BN, rows * HP] = k_tile . q_tile^T (fp32 accumulate):
       fp8    one gemm over D (CH = 1); each score times k_scale[n] (before the relu, as the reference)
       mxfp4  one gemm per 32-wide chunk c of D (CH = D / 32), each added with the weight
              2^(q_e - 127) * 2^(k_e - 127) (exact powers of two)
     then relu, times w[m, h] (padded heads give 0), and a sum over the HP heads of each row.
  3. store the [rows, BN] tile through a staging tile: the score where lo <= key_pos < hi, else -inf.
The CPU flavour takes fp8 / packed fp4 data as uint8 and decodes it with the bit codecs; the
tiling, index math, masks and summation order are the same code for both targets, and fixed,
so repeated runs are bitwise identical.
"""

# No `from __future__ import annotations`: TileLang evaluates T.Tensor annotations against the closure.
import tilelang.language as T
import torch

from flashkern.autotune.space import Space
from flashkern.kernels._tilelang import Flavour, codecs
from flashkern.kernels.indexer.problem import LogitsProblem, PagedProblem, SparseProblem

MX_BLOCK = 32  # values per ue8m0 scale in the MXFP4 form
NO_POSITION = -1
LAST_POSITION = 2**31 - 1


def _head_slots(heads: int) -> int:
    """Heads padded to a power of two (CUDA reductions) of at least 16 (MMA tile width)."""
    return max(16, 1 << (heads - 1).bit_length())


def _ue8m0_to_f32(exponent):
    """fp32 value 2^(e - 127) of a ue8m0 scale byte, exact (e = 0: the subnormal 2^-127; e = 255: inf)."""
    e = T.Cast("uint32", exponent)
    return T.reinterpret(T.if_then_else(e == 0, T.uint32(0x00400000), T.shift_left(e, T.uint32(23))), "float32")


class _Storage:
    """Tensor dtypes and element decoding of one indexer's storage format on one target."""

    def __init__(self, indexer, fl: Flavour):
        self.fl = fl
        self.fp8 = indexer.fmt == "fp8"
        self.heads, self.dim, self.packed = indexer.heads, indexer.dim, indexer.packed_dim
        self.chunks, self.chunk = (1, self.dim) if self.fp8 else (self.dim // MX_BLOCK, MX_BLOCK)
        self.data = "float8_e4m3fn" if self.fp8 and fl.on_gpu else "uint8"  # q and k tensors
        self.operand = "float8_e4m3fn" if fl.on_gpu else "float32"  # gemm tiles
        self.key_scales = 1 if self.fp8 else self.chunks  # per key

    def q_scale_shape(self, rows):
        return (1, 1, 1) if self.fp8 else (rows, self.heads, self.chunks)

    def k_scale_shape(self, keys):
        return (keys,) if self.fp8 else (keys, self.chunks)

    @property
    def k_scale_dtype(self) -> str:
        return "float32" if self.fp8 else "uint8"

    @property
    def per_byte(self) -> int:
        """Values per stored element: one e4m3, or two e2m1 codes."""
        return 1 if self.fp8 else 2

    def e4m3(self, stored):
        """A stored e4m3 value as a gemm operand."""
        return stored if self.fl.on_gpu else codecs.e4m3_to_f32(stored)

    def e2m1(self, byte, shift: int):
        """The e2m1 code at bit `shift` of a byte as a gemm operand (exact in e4m3)."""
        value = codecs.e2m1_to_f32(T.shift_right(T.Cast("uint32", byte), T.uint32(shift)))
        return T.Cast(self.operand, value) if self.fl.on_gpu else value

    def key_scale(self, Kscale, row, chunk):
        return Kscale[row] if self.fp8 else _ue8m0_to_f32(Kscale[row, chunk])


def _tile_macros(indexer, rows: int, block_n: int, fl: Flavour):
    """The mode-independent part of a block: score `rows` query rows against block_n key slots, store."""
    st = _Storage(indexer, fl)
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
    def score(Q, Qscale, W, K, Kscale, key_row, m0, n_rows, logits):
        """logits[n, r] = sum_h w * relu(q . k) of row m0 + r and slot n (rows past n_rows repeat the last)."""
        k_tile = fl.shared((CH * BN, DC), st.operand)  # chunk c of D in rows c * BN ..
        q_tile = fl.shared((CH * RH, DC), st.operand)
        k_scale = fl.shared((BN, st.key_scales), "float32")
        w_tile = fl.shared((RH,), "float32")
        acc = fl.fragment((BN, RH), "float32")
        for c, n, j in fl.parallel(CH, BN, DS):
            put(k_tile, c * BN + n, j, K[key_row[n], c * DS + j])
        for n, c in fl.parallel(BN, st.key_scales):
            k_scale[n, c] = st.key_scale(Kscale, key_row[n], c)
        for c, i, j in fl.parallel(CH, RH, DS):
            put(q_tile, c * RH + i, j, Q[T.min(m0 + i // HP, n_rows - 1), T.min(i % HP, H - 1), c * DS + j])
        for i in fl.parallel(RH):
            w_tile[i] = W[T.min(m0 + i // HP, n_rows - 1), T.min(i % HP, H - 1)]
        if st.fp8:
            T.gemm(k_tile, q_tile, acc, transpose_B=True, clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
            for n, i in fl.parallel(BN, RH):
                acc[n, i] = acc[n, i] * k_scale[n, 0]
        else:
            q_scale = fl.shared((RH, CH), "float32")
            part = fl.fragment((BN, RH), "float32")
            for i, c in fl.parallel(RH, CH):
                q_scale[i, c] = _ue8m0_to_f32(Qscale[T.min(m0 + i // HP, n_rows - 1), T.min(i % HP, H - 1), c])
            for n, i in fl.parallel(BN, RH):
                acc[n, i] = 0.0
            for c in T.serial(CH):
                T.gemm(k_tile[c * BN:(c + 1) * BN, :], q_tile[c * RH:(c + 1) * RH, :], part, transpose_B=True,
                       clear_accum=True, policy=T.GemmWarpPolicy.FullRow)
                for n, i in fl.parallel(BN, RH):
                    acc[n, i] = acc[n, i] + part[n, i] * (q_scale[i, c] * k_scale[n, c])
        per_head = T.reshape(acc, (BN, rows, HP))
        for n, r, h in fl.parallel(BN, rows, HP):
            per_head[n, r, h] = T.if_then_else(h < H, T.max(per_head[n, r, h], 0.0) * w_tile[r * HP + h], 0.0)
        T.reduce_sum(per_head, logits, dim=2)

    @T.macro
    def tile(Q, Qscale, W, K, Kscale, key_row, key_pos, bounds, m0, n_rows, first, last, n0, width, Out):
        """Score the block if some row's [lo, hi) meets positions [first, last]; store [rows, BN] at (m0, n0)."""
        logits = fl.fragment((BN, rows), "float32")
        staged = fl.shared((rows, BN), "float32")
        live = T.alloc_var("int32", init=0)
        for r in T.serial(rows):
            if (m0 + r < n_rows) & (bounds[r, 0] < bounds[r, 1]) & (bounds[r, 0] <= last) & (bounds[r, 1] > first):
                live = 1
        if live == 1:
            score(Q, Qscale, W, K, Kscale, key_row, m0, n_rows, logits)
        for n, r in fl.parallel(BN, rows):
            staged[r, n] = T.if_then_else((key_pos[n] >= bounds[r, 0]) & (key_pos[n] < bounds[r, 1]), logits[n, r],
                                          NEG_INF)
        for r, n in fl.parallel(rows, BN):
            if (m0 + r < n_rows) & (n0 + n < width):
                Out[m0 + r, n0 + n] = staged[r, n]

    return st, tile


def _addressing(fl: Flavour, rows: int, block_n: int):
    """Per-block index buffers: key_row [BN], key_pos [BN] (int32) and bounds [rows, 2] (lo, hi)."""
    return (fl.shared((block_n,), "int32"), fl.shared((block_n,), "int32"), fl.shared((rows, 2), "int32"))


# ---------------------------------------------------------------- mqa_logits (dense, ragged)


def logits_program(problem: LogitsProblem, config: dict, fl: Flavour):
    """logits [M, N] for q [M, H, D], k [N, D] with per-row key ranges [ks, ke)."""
    BM, BN = config["block_m"], config["block_n"]
    st, tile = _tile_macros(problem.indexer, BM, BN, fl)
    H, DP = st.heads, st.packed
    M, N = T.dynamic("M"), T.dynamic("N")

    @T.prim_func
    def mqa_logits(
        Q: T.Tensor((M, H, DP), st.data),
        Qscale: T.Tensor(st.q_scale_shape(M), "uint8"),
        K: T.Tensor((N, DP), st.data),
        Kscale: T.Tensor(st.k_scale_shape(N), st.k_scale_dtype),
        W: T.Tensor((M, H), "float32"),
        Ks: T.Tensor((M,), "int32"),
        Ke: T.Tensor((M,), "int32"),
        Out: T.Tensor((M, N), "float32"),
    ):
        with T.Kernel(T.ceildiv(N, BN), T.ceildiv(M, BM), threads=config["threads"]) as (bx, by):
            key_row, key_pos, bounds = _addressing(fl, BM, BN)
            for n in fl.parallel(BN):
                key_pos[n] = bx * BN + n
                key_row[n] = T.min(bx * BN + n, N - 1)
            for r in fl.parallel(BM):
                bounds[r, 0] = Ks[T.min(by * BM + r, M - 1)]
                bounds[r, 1] = Ke[T.min(by * BM + r, M - 1)]
            tile(Q, Qscale, W, K, Kscale, key_row, key_pos, bounds, by * BM, M, bx * BN, bx * BN + BN - 1,
                 bx * BN, N, Out)

    return mqa_logits


def _q_scale_arg(q_scale, device):
    """MXFP4 q scales, or a placeholder for fp8 (whose per-token q scale is folded into w)."""
    return torch.zeros((1, 1, 1), dtype=torch.uint8, device=device) if q_scale is None else q_scale


def _data_arg(tensor, st: _Storage):
    """q / k as the kernel takes them: e4m3 itself on GPU, its bytes on CPU; packed fp4 bytes as they are."""
    return tensor if st.data != "uint8" else tensor.view(torch.uint8)


def logits_args(problem: LogitsProblem, inputs: dict, config: dict, fl: Flavour):
    q, k = inputs["q"], inputs["k"]
    st = _Storage(problem.indexer, fl)
    rows, keys = q.shape[0], k.shape[0]
    logits = torch.empty((rows, keys), dtype=torch.float32, device=q.device)
    if rows == 0 or keys == 0:
        return None, logits
    return [_data_arg(q, st), _q_scale_arg(inputs["q_scale"], q.device), _data_arg(k, st), inputs["k_scale"],
            inputs["w"], inputs["ks"], inputs["ke"], logits], logits


# ---------------------------------------------------------------- paged_mqa_logits (decode)


def paged_program(problem: PagedProblem, config: dict, fl: Flavour):
    """logits [B * next_n, max_blocks * bs] over a paged cache viewed as a flat key table [blocks * bs, D]."""
    BN, NEXT, BS = config["block_n"], problem.next_n, problem.block_size
    st, tile = _tile_macros(problem.indexer, NEXT, BN, fl)
    H, DP = st.heads, st.packed
    B, MB = T.dynamic("B"), T.dynamic("max_blocks")
    R, WIDTH, KR = T.dynamic("rows"), T.dynamic("width"), T.dynamic("cache_rows")  # B * next_n, MB * bs, blocks * bs

    @T.prim_func
    def paged_mqa_logits(
        Q: T.Tensor((R, H, DP), st.data),
        Qscale: T.Tensor(st.q_scale_shape(R), "uint8"),
        K: T.Tensor((KR, DP), st.data),
        Kscale: T.Tensor(st.k_scale_shape(KR), st.k_scale_dtype),
        W: T.Tensor((R, H), "float32"),
        Table: T.Tensor((B, MB), "int32"),
        Lens: T.Tensor((B,), "int32"),
        Out: T.Tensor((R, WIDTH), "float32"),
    ):
        with T.Kernel(T.ceildiv(WIDTH, BN), B, threads=config["threads"]) as (bx, b):
            key_row, key_pos, bounds = _addressing(fl, NEXT, BN)
            for n in fl.parallel(BN):
                key_pos[n] = bx * BN + n
                key_row[n] = T.if_then_else(  # table entries past the context may be garbage: never follow them
                    bx * BN + n < Lens[b], Table[b, T.min((bx * BN + n) // BS, MB - 1)], 0) * BS + (bx * BN + n) % BS
            for j in fl.parallel(NEXT):
                bounds[j, 0] = 0
                bounds[j, 1] = Lens[b] - NEXT + j + 1
            tile(Q, Qscale, W, K, Kscale, key_row, key_pos, bounds, b * NEXT, R, bx * BN, bx * BN + BN - 1,
                 bx * BN, WIDTH, Out)

    return paged_mqa_logits


def paged_args(problem: PagedProblem, inputs: dict, config: dict, fl: Flavour):
    q, k_cache, table = inputs["q"], inputs["k_cache"], inputs["block_table"]
    st = _Storage(problem.indexer, fl)
    batch, next_n, bs = q.shape[0], q.shape[1], k_cache.shape[1]
    logits = torch.empty((batch * next_n, table.shape[1] * bs), dtype=torch.float32, device=q.device)
    if logits.numel() == 0 or k_cache.shape[0] == 0:  # no cache blocks: every context is empty
        return None, logits.fill_(-torch.inf)
    q_scale = None if inputs["q_scale"] is None else inputs["q_scale"].flatten(0, 1)
    return [_data_arg(q.flatten(0, 1), st), _q_scale_arg(q_scale, q.device), _data_arg(k_cache.flatten(0, 1), st),
            inputs["k_scale"].flatten(0, 1), inputs["w"], table, inputs["context_lens"], logits], logits


# ---------------------------------------------------------------- sparse scores (inside candidate blocks)


def sparse_scores_program(problem: SparseProblem, config: dict, fl: Flavour):
    """scores [M, n_blocks * block]: the logit of each candidate slot's position, -inf where it has none."""
    BN, BLK = config["block_n"], problem.block
    st, tile = _tile_macros(problem.indexer, 1, BN, fl)
    H, DP = st.heads, st.packed
    M, N, NB, WIDTH = T.dynamic("M"), T.dynamic("N"), T.dynamic("NB"), T.dynamic("width")  # WIDTH = NB * BLK

    @T.prim_func
    def sparse_scores(
        Q: T.Tensor((M, H, DP), st.data),
        Qscale: T.Tensor(st.q_scale_shape(M), "uint8"),
        K: T.Tensor((N, DP), st.data),
        Kscale: T.Tensor(st.k_scale_shape(N), st.k_scale_dtype),
        W: T.Tensor((M, H), "float32"),
        Ks: T.Tensor((M,), "int32"),
        Ke: T.Tensor((M,), "int32"),
        Blocks: T.Tensor((M, NB), "int32"),
        Out: T.Tensor((M, WIDTH), "float32"),
    ):
        with T.Kernel(T.ceildiv(WIDTH, BN), M, threads=config["threads"]) as (bx, m):
            key_row, key_pos, bounds = _addressing(fl, 1, BN)
            for n in fl.parallel(BN):
                key_pos[n] = T.if_then_else(
                    (bx * BN + n < WIDTH) & (Blocks[m, T.min((bx * BN + n) // BLK, NB - 1)] >= 0),
                    Blocks[m, T.min((bx * BN + n) // BLK, NB - 1)] * BLK + (bx * BN + n) % BLK, NO_POSITION)
                key_row[n] = T.max(T.min(key_pos[n], N - 1), 0)
            for r in fl.parallel(1):
                bounds[r, 0] = Ks[m]
                bounds[r, 1] = Ke[m]
            tile(Q, Qscale, W, K, Kscale, key_row, key_pos, bounds, m, M, 0, LAST_POSITION, bx * BN, WIDTH, Out)

    return sparse_scores


def sparse_scores_args(problem: SparseProblem, inputs: dict, fl: Flavour):
    q, k, blocks = inputs["q"], inputs["k"], inputs["blocks"]
    st = _Storage(problem.indexer, fl)
    scores = torch.empty((q.shape[0], problem.candidates), dtype=torch.float32, device=q.device)
    if scores.numel() == 0 or k.shape[0] == 0:  # no keys: no candidate position exists
        return None, scores.fill_(-torch.inf)
    return [_data_arg(q, st), _q_scale_arg(inputs["q_scale"], q.device), _data_arg(k, st), inputs["k_scale"],
            inputs["w"], inputs["ks"], inputs["ke"], blocks, scores], scores


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
    params={"block_m": (1, 2, 4), "block_n": (64, 128), "threads": (128, 256)},
    gpu_only=("threads",),
    limits={REGISTERS: lambda p, c: _accumulator_values(p.indexer, c["block_m"], c) <= 128},
)
PAGED_SPACE = Space(
    params={"block_n": (64, 128), "threads": (128, 256)},
    gpu_only=("threads",),
    limits={REGISTERS: lambda p, c: _accumulator_values(p.indexer, p.next_n, c) <= 128},
)
SPARSE_SPACE = Space(
    params={"block_n": (64, 128), "threads": (128, 256)},
    gpu_only=("threads",),
    limits={REGISTERS: lambda p, c: _accumulator_values(p.indexer, 1, c) <= 128},
)


def logits_default(problem: LogitsProblem) -> dict:
    """128 keys x 64 score columns (rows x padded heads): one 64-wide MMA per 64 keys, one warpgroup."""
    return {"block_m": max(1, 64 // _head_slots(problem.indexer.heads)), "block_n": 128, "threads": 128}


def paged_default(problem: PagedProblem) -> dict:
    """128 keys a block; two warpgroups when the next_n rows' scores would not fit in one's registers."""
    return next(c for c in ({"block_n": 128, "threads": 128}, {"block_n": 128, "threads": 256},
                            {"block_n": 64, "threads": 256}) if not PAGED_SPACE.violations(problem, c))


def sparse_default(problem: SparseProblem) -> dict:
    return {"block_n": 128, "threads": 128}
