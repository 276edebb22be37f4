"""Engram in TileLang: one source for CUDA and the CPU (C) target (docs/operators.md section 9).

    hash    h = cid(t) mult[0] XOR_k id_k mult[k] (k = 1..L, L = max_ngram - 1), id_k = cid(token t - k) within the
            run, else cid(history[seq, L - k + depth]), else pad; row(k, j) = h mod prime[k, j] + offset[k, j]
    lookup  value[i] = e4m3(code[i]) 2^(scale[i // 32] - 127) as bf16; a row id outside the table: zeros
    gate    dot = sum(h q_w k k_w) rstd(h) rstd(k) / sqrt(D), rstd(x) = rsqrt(mean(x^2) + eps);
            out = bf16(h + sigmoid(sign(dot) sqrt(max(|dot|, 1e-6))) v)

Tile plan (GPU flavour):
  hash    grid: cdiv(T, block_t); thread: a token (the run's depth, the lookback ids, the XOR chain, L x heads
          int64 remainders).
  lookup  grid: cdiv(T x lookups, block_rows), or persistent min(tiles, SMS or SMS / 2) blocks looping over the tiles;
          1. the row ids, range-checked; 2. the records -> rec [block_rows, 264] (shared; 8-byte cp.async pieces where
          the table is 8-byte aligned, else bytes a row at a time; zeros for a row outside the table, which decode to
          +0); 3. thread: (row, 8 values), decoded in registers, one 16-byte store.
  gate    grid: (T, hc / S), S streams a block: 1 (stream_programs, decode: hc x T blocks) or hc (a block per token);
          1. over D in block_d steps, k, q_w, k_w tiles to registers, h tiles T.copy'd into the kept slice [S, D]
          (shared, up to 64 KiB; else registers), per-thread partial sums of h^2, k^2, h q_w k k_w [S, block_d];
          2. T.reduce_sum to [S], the gates (shared); 3. over D again, v tiles to registers, out = h + g v (h from the
          slice, else L2); q_w, k_w and v once a block (S times from L2 a token where S = 1).
Bound on an H200: hash by a warp's chain of int64 remainders (microseconds at 4096 tokens, launch latency at
decode); lookup by the table's reads, 6.3 KB a token (HBM, or PCIe Gen5 at 64 GB/s each way for a host table
read through UVA); gate by HBM, 3 reads and a write of hc x D bf16 a token.
"""

# No `from __future__ import annotations`: TileLang evaluates T.Tensor annotations against the closure.
import torch

from flashkern.autotune.space import Space
from flashkern.kernels._tilelang import T, Flavour, codecs, row_strided
from flashkern.kernels.engram import host
from flashkern.kernels.engram.problem import GateProblem, HashProblem, LookupProblem
from flashkern.kernels.tiles import SMS, next_power_of_2
from flashkern.reference.engram import DOT_FLOOR, ROW_BYTES, ROW_VALUES, SCALE_BLOCK

PIECE = 8  # values a decoding thread stores at once (16 bytes of bf16); bytes a table load moves where aligned


def _dtype(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


# ---------------------------------------------------------------- engram_hash


def hash_layout(inputs: dict) -> tuple[str, str]:
    """The dtypes of the token ids and the sequence ids (int32 or int64)."""
    return _dtype(inputs["token_ids"]), _dtype(inputs["seq_ids"])


def hash_program(problem: HashProblem, config: dict, fl: Flavour, layout: tuple[str, str]):
    """Out [T, L * heads] int64: the row ids of the tokens (module docstring)."""
    L, heads, BT = problem.max_ngram - 1, problem.heads, config["block_t"]
    token_dtype, seq_dtype = layout
    tokens, vocabulary, sequences = T.dynamic("tokens"), T.dynamic("vocabulary"), T.dynamic("sequences")

    def compressed(TokenMap, x, pad_id):
        """cid of the int64 id x: the map is read only for an x inside it (at a clamped index)."""
        inside = (x >= 0) & (x < T.Cast("int64", vocabulary))
        return T.if_then_else(inside, TokenMap[T.min(T.max(x, 0), vocabulary - 1)], pad_id)

    @T.macro
    def hash_token(TokenIds, SeqIds, TokenMap, Multipliers, Primes, Offsets, History, Out, pad_id, t):
        seq = T.alloc_var("int64", init=T.Cast("int64", SeqIds[t]))
        depth = T.alloc_var("int32", init=0)  # the run's earlier tokens, up to L: t - 1, t - 2, ... while seq holds
        for k in T.unroll(L):
            if (depth == k) & (t > k):
                if T.Cast("int64", SeqIds[T.max(t - k - 1, 0)]) == seq:
                    depth = k + 1
        h = T.alloc_var("int64", init=compressed(TokenMap, T.Cast("int64", TokenIds[t]), pad_id) * Multipliers[0])
        for k in T.unroll(1, L + 1):
            before = T.alloc_var("int64", init=T.Cast("int64", TokenIds[T.max(t - k, 0)]))  # token t - k, or
            if depth < k:
                before = -1  # nothing: the pad id
                if (seq >= 0) & (seq < T.Cast("int64", sequences)):  # its history's (k - depth)-th id from the end
                    before = History[T.min(T.max(seq, 0), sequences - 1), T.max(L - k + depth, 0)]
            h = h ^ (compressed(TokenMap, before, pad_id) * Multipliers[k])
            for j in T.unroll(heads):
                Out[t, (k - 1) * heads + j] = h % Primes[k - 1, j] + Offsets[k - 1, j]

    @T.prim_func
    def engram_hash(
        TokenIds: T.Tensor((tokens,), token_dtype),
        SeqIds: T.Tensor((tokens,), seq_dtype),
        TokenMap: T.Tensor((vocabulary,), "int64"),
        Multipliers: T.Tensor((L + 1,), "int64"),
        Primes: T.Tensor((L, heads), "int64"),
        Offsets: T.Tensor((L, heads), "int64"),
        History: T.Tensor((sequences, L), "int64"),
        Out: T.Tensor((tokens, L * heads), "int64"),
        pad_id: T.int64,
    ):
        with T.Kernel(T.ceildiv(tokens, BT), threads=BT) as bx:
            for i in fl.parallel(BT):
                if bx * BT + i < tokens:
                    hash_token(TokenIds, SeqIds, TokenMap, Multipliers, Primes, Offsets, History, Out, pad_id,
                               bx * BT + i)

    return engram_hash


_NO_HISTORY: dict = {}  # (device, lookback) -> a history row of -1 (none), for calls without one


def no_history(device: torch.device, lookback: int) -> torch.Tensor:
    """One history row of -1: with it, sequence 0 hashes as with no history and every other id is outside it."""
    key = (device, lookback)
    if key not in _NO_HISTORY:
        _NO_HISTORY[key] = torch.full((1, lookback), -1, dtype=torch.int64, device=device)
    return _NO_HISTORY[key]


def hash_args(problem: HashProblem, inputs: dict, config: dict, fl: Flavour, out):
    if problem.tokens == 0:
        return None
    history = inputs["history"] if problem.history else no_history(out.device, problem.max_ngram - 1)
    return [inputs["token_ids"], inputs["seq_ids"], inputs["token_map"], inputs["multipliers"], inputs["primes"],
            inputs["offsets"], history, out, int(inputs["pad_id"])]


# ---------------------------------------------------------------- engram_lookup


def lookup_layout(inputs: dict) -> tuple[str, bool]:
    """The row ids' dtype (int32 or int64), and whether the table's rows start on 8-byte boundaries (its data pointer
    and row stride: metadata), so that the GPU flavour may load them in 8-byte pieces."""
    table = inputs["table"]
    return _dtype(inputs["rows"]), table.data_ptr() % PIECE == 0 and table.stride(0) % PIECE == 0


def lookup_program(problem: LookupProblem, config: dict, fl: Flavour, layout: tuple[str, bool]):
    """Out [N, 256] bf16: the table rows Rows [N] dequantized (N = tokens x lookups; module docstring)."""
    ids_dtype, aligned = layout
    BR, persistent = config["block_rows"], config["persistent"]
    N, R = T.dynamic("rows"), T.dynamic("table_rows")
    tiles = T.ceildiv(N, BR)
    grid = tiles if persistent == 0 else T.min(tiles, SMS if persistent == 1 else SMS // 2)

    @T.macro
    def gather(Table, Rows, Out, tile, row, rec):
        # 1. row[r] = the id of gathered row tile * BR + r, or -1 (outside the table, or past N)
        for r in fl.parallel(BR):
            row[r] = T.if_then_else(tile * BR + r < N, T.Cast("int64", Rows[T.min(tile * BR + r, N - 1)]), -1)
            row[r] = T.if_then_else((row[r] >= 0) & (row[r] < T.Cast("int64", R)), row[r], -1)
        # 2. the records (int64 addresses: the table holds up to 10^11 bytes); zeros for none
        if fl.on_gpu and aligned:
            T.assume(Table.strides[0] % PIECE == 0)
            for r, b in T.Parallel(BR, ROW_BYTES, coalesced_width=T.int32(PIECE), prefer_async=True):
                rec[r, b] = T.if_then_else(row[r] >= 0, Table[T.max(row[r], 0), b], T.uint8(0))
        elif fl.on_gpu:  # byte loads a row at a time (a whole tile's at once spill from 16 rows of 64 threads)
            for r in T.serial(BR):
                for b in T.Parallel(ROW_BYTES):
                    rec[r, b] = T.if_then_else(row[r] >= 0, Table[T.max(row[r], 0), b], T.uint8(0))
        else:
            for r, b in T.grid(BR, ROW_BYTES):
                rec[r, b] = T.if_then_else(row[r] >= 0, Table[T.max(row[r], 0), b], T.uint8(0))
        # 3. value = e4m3(code) 2^(scale - 127), a thread per 8 values, stored in one 16-byte piece
        for r, p in fl.parallel(BR, ROW_VALUES // PIECE):
            values = T.alloc_local((PIECE,), fl.bf16)
            scale = codecs.ue8m0_to_f32(rec[r, ROW_VALUES + p * PIECE // SCALE_BLOCK])
            for e in T.unroll(PIECE):
                value = T.alloc_var("float32", init=codecs.e4m3_to_f32(rec[r, p * PIECE + e]) * scale)
                values[e] = fl.store_bf16(value)
            if tile * BR + r < N:
                for e in T.vectorized(PIECE):
                    Out[tile * BR + r, p * PIECE + e] = values[e]

    @T.prim_func
    def engram_lookup(
        Table: row_strided((R, ROW_BYTES), "uint8", "table"),
        Rows: T.Tensor((N,), ids_dtype),
        Out: T.Tensor((N, ROW_VALUES), fl.bf16),
    ):
        with T.Kernel(grid, threads=config["threads"]) as bx:
            row = fl.shared((BR,), "int64")
            rec = fl.shared((BR, ROW_BYTES), "uint8")
            if persistent == 0:
                gather(Table, Rows, Out, bx, row, rec)
            else:
                for step in T.serial(T.ceildiv(tiles - bx, grid)):
                    gather(Table, Rows, Out, bx + step * grid, row, rec)

    return engram_lookup


def lookup_args(problem: LookupProblem, inputs: dict, config: dict, fl: Flavour, out):
    """A pinned host table (for CUDA rows) goes in as a CUDA view of its memory: TileLang's launcher refuses CPU
    tensors for a CUDA kernel, which reads the memory through UVA."""
    if problem.rows == 0:
        return None
    table = inputs["table"]
    table = host.cuda_view(table, out.device) if table.device != out.device else table
    return [table, inputs["rows"].reshape(-1), fl.bf16_arg(out).view(-1, ROW_VALUES)]


# ---------------------------------------------------------------- engram_gate


KEPT_H_BYTES = 64 << 10  # a block keeps its h slice in shared memory up to this size; pass 2 reads it there


def gate_streams(problem: GateProblem, config: dict) -> int:
    """The streams a block handles: 1 with stream_programs (a block per token and stream), else all hc."""
    return 1 if config["stream_programs"] else problem.streams


def gate_kept_width(problem: GateProblem, config: dict) -> int:
    """The columns of the shared h slice [S, cdiv(hidden, block_d) block_d] a block keeps from pass 1 for pass 2, or
    0 where S x that x 2 bytes is over KEPT_H_BYTES (pass 2 then reads h from global memory again)."""
    width = -(-problem.hidden // config["block_d"]) * config["block_d"]
    return width if gate_streams(problem, config) * width * 2 <= KEPT_H_BYTES else 0


def gate_program(problem: GateProblem, config: dict, fl: Flavour):
    """Out [T, hc, D] bf16 (module docstring): a block per token and group of S streams (S = 1 or hc)."""
    hc, BD = problem.streams, config["block_d"]
    S = gate_streams(problem, config)
    kept = gate_kept_width(problem, config)  # h in shared memory from pass 1 (0: re-read in pass 2)
    tokens, D = T.dynamic("tokens"), T.dynamic("hidden")

    levels = BD.bit_length() - 1  # block_d is a power of two

    @T.macro
    def lane_sum(parts, total):
        """total[s] = the sum of parts[s, :]: T.reduce_sum (a tree over the threads) on the GPU; on the CPU a pairwise
        tree in place, as its reduce_sum adds the lanes one after another (an fp32 error growing with block_d, which
        a near-zero dot's root amplifies past compare_gate's bound)."""
        if fl.on_gpu:
            T.reduce_sum(parts, total, dim=1)
        else:
            for level in T.serial(levels):
                half = T.shift_right(BD, level + 1)
                for s, d in T.grid(S, half):
                    parts[s, d] = parts[s, d] + parts[s, d + half]
            for s in T.serial(S):
                total[s] = parts[s, 0]

    def h_of(H, h_tile, t, g, s, c, d):
        """h[t, g S + s, c BD + d] after pass 1's loads: from the kept slice, else from global memory (L2)."""
        return h_tile[s, c * BD + d] if kept else H[t, g * S + s, c * BD + d]

    @T.prim_func
    def engram_gate(
        H: T.Tensor((tokens, hc, D), fl.bf16),
        K: T.Tensor((tokens, hc, D), fl.bf16),
        V: T.Tensor((tokens, D), fl.bf16),
        Qw: T.Tensor((D,), fl.bf16),
        Kw: T.Tensor((D,), fl.bf16),
        Out: T.Tensor((tokens, hc, D), fl.bf16),
        eps: T.float32,
    ):
        with T.Kernel(tokens, hc // S, threads=config["threads"]) as (t, g):
            if problem.hidden % PIECE == 0:  # rows of 16-byte multiples: 16-byte loads and stores
                T.assume(D % PIECE == 0)
            if kept:  # the specialization's width: the kept slice holds every column
                T.assume(D == problem.hidden)
            h_squares = fl.fragment((S, BD), "float32")
            k_squares = fl.fragment((S, BD), "float32")
            products = fl.fragment((S, BD), "float32")
            h_tile = fl.shared((S, kept), fl.bf16) if kept else fl.fragment((S, BD), fl.bf16)
            k_tile = fl.fragment((S, BD), fl.bf16)
            q_tile = fl.fragment((BD,), fl.bf16)  # q_w, k_w and v: loaded once a block, for its S streams
            kw_tile = fl.fragment((BD,), fl.bf16)
            v_tile = fl.fragment((BD,), fl.bf16)
            h_sum = fl.fragment((S,), "float32")
            k_sum = fl.fragment((S,), "float32")
            dot = fl.fragment((S,), "float32")
            gate = fl.shared((S,), "float32")
            T.clear(h_squares)
            T.clear(k_squares)
            T.clear(products)
            # 1. per-thread partial sums over D (each element loaded once: k, q_w, k_w through registers, h into
            #    the kept slice or registers)
            for c in T.serial(T.ceildiv(D, BD)):
                if kept:  # columns past D are not read (nor used)
                    T.copy(H[t, g * S:g * S + S, c * BD:c * BD + BD], h_tile[0:S, c * BD:c * BD + BD],
                           disable_tma=True)
                else:
                    for s, d in fl.parallel(S, BD):
                        h_tile[s, d] = T.if_then_else(c * BD + d < D, H[t, g * S + s, c * BD + d],
                                                      T.Cast(fl.bf16, 0))
                for s, d in fl.parallel(S, BD):
                    k_tile[s, d] = T.if_then_else(c * BD + d < D, K[t, g * S + s, c * BD + d], T.Cast(fl.bf16, 0))
                for d in fl.parallel(BD):
                    q_tile[d] = T.if_then_else(c * BD + d < D, Qw[c * BD + d], T.Cast(fl.bf16, 0))
                    kw_tile[d] = T.if_then_else(c * BD + d < D, Kw[c * BD + d], T.Cast(fl.bf16, 0))
                for s, d in fl.parallel(S, BD):
                    if c * BD + d < D:
                        x = fl.load_bf16(h_tile[s, c * BD + d] if kept else h_tile[s, d])
                        y = fl.load_bf16(k_tile[s, d])
                        h_squares[s, d] = h_squares[s, d] + x * x
                        k_squares[s, d] = k_squares[s, d] + y * y
                        products[s, d] = products[s, d] + x * fl.load_bf16(q_tile[d]) * y * fl.load_bf16(kw_tile[d])
            # 2. the sums, the gates
            lane_sum(h_squares, h_sum)
            lane_sum(k_squares, k_sum)
            lane_sum(products, dot)
            for s in fl.parallel(S):
                rstd = T.rsqrt(h_sum[s] / T.Cast("float32", D) + eps) * T.rsqrt(k_sum[s] / T.Cast("float32", D) + eps)
                scaled = dot[s] * rstd / T.sqrt(T.Cast("float32", D))
                # sign(dot) sqrt(max(|dot|, floor)); a NaN dot is its own sign (max drops a NaN)
                sign = T.if_then_else(scaled > 0, T.float32(1), T.if_then_else(scaled < 0, T.float32(-1), scaled))
                logit = sign * T.sqrt(T.max(T.max(scaled, -scaled), DOT_FLOOR))
                gate[s] = 1.0 / (1.0 + T.exp(-logit))
            # 3. out = h + g v (h kept, or from L2)
            for c in T.serial(T.ceildiv(D, BD)):
                for d in fl.parallel(BD):
                    v_tile[d] = T.if_then_else(c * BD + d < D, V[t, c * BD + d], T.Cast(fl.bf16, 0))
                for s, d in fl.parallel(S, BD):
                    if c * BD + d < D:
                        Out[t, g * S + s, c * BD + d] = fl.store_bf16(fl.load_bf16(h_of(H, h_tile, t, g, s, c, d))
                                                                      + gate[s] * fl.load_bf16(v_tile[d]))

    return engram_gate


def gate_args(problem: GateProblem, inputs: dict, config: dict, fl: Flavour, out):
    if problem.tokens == 0:
        return None
    return [*(fl.bf16_arg(inputs[name]) for name in ("h", "k", "v", "q_w", "k_w")), fl.bf16_arg(out),
            float(inputs["eps"])]


# ---------------------------------------------------------------- tuning spaces

# sm_90a builds (build_sm90, nvcc --resource-usage), no spills anywhere below:
#   hash    32..38 registers, no shared memory (a thread's int64 chain);
#   lookup  24..118 registers over the whole space, aligned or not (64 at the default), shared memory 264 B + 8 B a
#           row (8.5 KiB at 32 rows);
#   gate    the partial sums [S, block_d] live in registers (S = 1 or hc): up to 96 a thread (3 x S x block_d /
#           threads) take 28..197 registers over the space (hc 1..16, D 576..7168), 192 spill (hc = 4, block_d 2048,
#           128 threads: 160 B); the kept h slice takes up to 64 KiB of shared memory. Defaults (D 4096..7168): 70..71
#           registers and 8.5..14.5 KiB a stream's block, 96 and 33..57 KiB a token's 4 streams (256 threads).
HASH_SPACE = Space(params={"block_t": (32, 64, 128, 256)})


def hash_default(problem: HashProblem) -> dict:
    """64 tokens a block (a thread each): 4096 tokens spread over 64 SMs; a warp's chain of remainders, not the
    block count, sets the time."""
    return {"block_t": 64}


LOOKUP_SPACE = Space(params={"block_rows": (1, 2, 4, 8, 16, 32), "threads": (64, 128, 256), "persistent": (0, 1, 2)},
                     gpu_only=("threads",))


def lookup_default(problem: LookupProblem) -> dict:
    """16 rows a tile (4.2 KB of records), 128 threads: 4 pieces of 8 values a thread; a block per tile for a table
    in HBM (resident blocks hide the loads' latency), a persistent grid of SMS blocks for a host table (vLLM's
    gather over UVA)."""
    return {"block_rows": 16, "threads": 128, "persistent": 1 if problem.host else 0}


GATE_SPACE = Space(
    params={"block_d": (256, 512, 1024, 2048, 4096), "threads": (128, 256), "stream_programs": (0, 1)},
    gpu_only=("threads",),
    limits={"3 x S x block_d / threads <= 96, S = 1 or streams (partial sums in registers)":
            lambda p, c: 3 * gate_streams(p, c) * c["block_d"] <= 96 * c["threads"]},
)


def gate_default(problem: GateProblem) -> dict:
    """A block per (token, stream) below SMS tokens (where a block per token leaves SMs idle), with one stream, or
    where a token's streams' h is over the shared memory a block may keep; else a block per token. block_d 1024, or
    D's next power of two (at least 256) where D is smaller; 128 threads a stream, 256 all streams; with more streams
    than fit the registers at that width, the widest that fits (then 256 threads).
    The model (H200, D 5120, hc 4; before -> after): T = 1 4.9 -> 1.3 us (4 blocks: HBM over a 4/132 fill), T = 64
    4.9 -> 2.4 us (roof 1.8; L2, each stream's block reading q_w, k_w and v), T = 4096 205.6 -> 146.4 us (roof 113.6;
    h read once, from the kept slice; HBM at 80% of peak). From 132 tokens a block per token is ahead (132, 200,
    250 tokens: 4.6, 6.9, 8.7 us against 4.9, 7.4, 17.1 a stream, the last over a second wave; 4096: 146.4 against
    153.9); hc 8 at D 5120 keeps no slice a token: 307.8 us a stream against 357.6 a token."""
    widest = min(1024, max(256, next_power_of_2(max(problem.hidden, 1))))
    per_token_keeps_h = gate_kept_width(problem, {"block_d": widest, "stream_programs": 0}) > 0
    stream_programs = int(problem.tokens < SMS or problem.streams == 1 or not per_token_keeps_h)
    threads = 128 if stream_programs else 256
    candidates = [{"block_d": block_d, "threads": threads, "stream_programs": stream_programs}
                  for block_d in (1024, 512, 256) if block_d <= widest]
    candidates.append({"block_d": 256, "threads": 256, "stream_programs": stream_programs})
    return next((c for c in candidates if not GATE_SPACE.violations(problem, c)), candidates[-1])
