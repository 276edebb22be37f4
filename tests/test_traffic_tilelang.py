"""TileLang traffic counting (kernels/_tilelang/traffic.py) against hand-computed bytes of tiny kernels.

Every kernel is lowered for sm_90a and walked, nothing is launched: CPU tensors stand in for the arguments and
only their shapes (and scalar values) matter. Sizes are dynamic (T.dynamic) and bound from those shapes.
"""

# No `from __future__ import annotations`: TileLang evaluates T.Tensor annotations against the closure.
import pytest
import tilelang.language as T
import torch

from flashkern import registry
from flashkern.kernels._tilelang import GPU, TileLangKernel, traffic
from flashkern.kernels._tilelang.traffic import lower_for_traffic, measure
from flashkern.kernels.build import LaunchTraffic, TensorTraffic

TILE = 128  # elements per CTA in the 1-D kernels, one per thread
F32 = 4  # bytes


def _traffic(ctas, read, written, exact=True) -> LaunchTraffic:
    return LaunchTraffic(ctas=ctas, bytes_read=read, bytes_written=written, sampled=ctas, exact=exact)


def _tiled_copy():
    """B = A through shared memory, a tile per CTA."""
    N = T.dynamic("N")

    @T.prim_func
    def tiled_copy(A: T.Tensor((N,), "float32"), B: T.Tensor((N,), "float32")):
        with T.Kernel(T.ceildiv(N, TILE), threads=TILE) as bx:
            tile = T.alloc_shared((TILE,), "float32")
            T.copy(A[bx * TILE], tile)
            T.copy(tile, B[bx * TILE])

    return tiled_copy


@pytest.mark.parametrize("n", [8 * TILE, 8 * TILE - 24], ids=["whole tiles", "tail"])
def test_tiled_copy_moves_each_element_once(n):
    """The last CTA of a tail masks its lanes past N off: they move nothing, and the count says so exactly. The
    model's context comes along: the tensors' footprint and the sizes (for loop bounds)."""
    counted = measure(_tiled_copy(), [torch.zeros(n), torch.zeros(n)])
    assert counted == _traffic(8, n * F32, n * F32)
    assert counted.footprint == 2 * n * F32 and counted.sizes == (("N", n), ("blockIdx.x", 8))
    assert sorted(counted.tensors) == [TensorTraffic(n * F32, n * F32)] * 2  # each tensor moved once: no re-read


def test_ctas_that_read_the_same_tile_record_their_launch_gap():
    """Grid (heads, tiles), heads fastest: the heads of one tile read its X block and its indices together (every CTA
    but a tile's first finds them read 1 launch before), the same head of the next tile reads W's row again (a gap
    of `heads`), and a gathered read shares nothing (its address is data)."""
    N, heads = T.dynamic("N"), 4

    @T.prim_func
    def shared_tiles(X: T.Tensor((N,), "float32"), W: T.Tensor((heads, TILE), "float32"),
                     Idx: T.Tensor((N,), "int32"), Y: T.Tensor((heads, N), "float32")):
        with T.Kernel(heads, T.ceildiv(N, TILE), threads=TILE) as (head, tile):
            x_shared = T.alloc_shared((TILE,), "float32")
            w_shared = T.alloc_shared((TILE,), "float32")
            y = T.alloc_fragment((TILE,), "float32")
            T.copy(X[tile * TILE], x_shared)
            T.copy(W[head, 0], w_shared)
            for i in T.Parallel(TILE):
                y[i] = x_shared[i] * w_shared[i] + X[Idx[tile * TILE + i]]
            T.copy(y, Y[head, tile * TILE])

    tiles = 8
    n, ctas, block = tiles * TILE, heads * tiles, TILE * F32
    args = [torch.zeros(n), torch.zeros(heads, TILE), torch.zeros(n, dtype=torch.int32), torch.zeros(heads, n)]
    x, w, idx, y = measure(shared_tiles, args).tensors
    assert x == TensorTraffic(2 * ctas * block, n * F32, ((1, 0.75 * ctas * block),))  # the block, not the gather
    assert w == TensorTraffic(ctas * block, heads * block, ((heads, (tiles - 1) / tiles * ctas * block),))
    assert idx == TensorTraffic(ctas * block, n * F32, ((1, 0.75 * ctas * block),))
    assert y == TensorTraffic(ctas * block, heads * n * F32)  # stores share nothing



def test_a_tail_too_large_to_enumerate_counts_whole_tiles(monkeypatch):
    """Past MAX_ENUMERATED grid points the tail's guard is taken as true: whole tiles, an upper bound."""
    monkeypatch.setattr(traffic, "MAX_ENUMERATED", TILE)  # the guard spans 8 CTAs x TILE threads
    n = 8 * TILE - 24
    assert measure(_tiled_copy(), [torch.zeros(n), torch.zeros(n)]) == _traffic(8, 8 * TILE * F32, 8 * TILE * F32,
                                                                                 exact=False)


def test_a_vectorized_block_copy_counts_every_lane():
    """fp16 rows in 64 x 256 blocks: T.copy becomes 8-lane vectorized loops; 200 rows leave a partial block."""
    M = T.dynamic("M")

    @T.prim_func
    def block_copy(A: T.Tensor((M, 256), "float16"), B: T.Tensor((M, 256), "float16")):
        with T.Kernel(T.ceildiv(M, 64), threads=128) as bx:
            block = T.alloc_shared((64, 256), "float16")
            T.copy(A[bx * 64, 0], block)
            T.copy(block, B[bx * 64, 0])

    rows = 200
    args = [torch.zeros(rows, 256, dtype=torch.float16), torch.zeros(rows, 256, dtype=torch.float16)]
    assert "T.vectorized" in lower_for_traffic(block_copy).script()
    assert measure(block_copy, args) == _traffic(4, rows * 256 * 2, rows * 256 * 2)


def test_reading_the_input_twice_counts_twice():
    N = T.dynamic("N")

    @T.prim_func
    def doubled(A: T.Tensor((N,), "float32"), B: T.Tensor((N,), "float32")):
        with T.Kernel(T.ceildiv(N, TILE), threads=TILE) as bx:
            first = T.alloc_shared((TILE,), "float32")
            second = T.alloc_shared((TILE,), "float32")
            T.copy(A[bx * TILE], first)
            T.copy(A[bx * TILE], second)
            for i in T.Parallel(TILE):
                B[bx * TILE + i] = first[i] + second[i]

    n = 4 * TILE
    counted = measure(doubled, [torch.zeros(n), torch.zeros(n)])
    assert counted == _traffic(4, 2 * n * F32, n * F32)
    # by tensor (the model's L2 sees A's re-reads only): A requested twice its size, B once
    assert counted.tensors == (TensorTraffic(2 * n * F32, n * F32), TensorTraffic(n * F32, n * F32))


def test_one_element_twice_in_one_expression_is_one_read():
    """A[i] * A[i] is one load once compiled (what a T.macro expanding its argument twice produces)."""
    N = T.dynamic("N")

    @T.prim_func
    def squared(A: T.Tensor((N,), "float32"), B: T.Tensor((N,), "float32")):
        with T.Kernel(T.ceildiv(N, TILE), threads=TILE) as bx:
            for i in T.Parallel(TILE):
                B[bx * TILE + i] = A[bx * TILE + i] * A[bx * TILE + i]

    n = 4 * TILE
    assert measure(squared, [torch.zeros(n), torch.zeros(n)]) == _traffic(4, n * F32, n * F32)


def test_the_same_element_of_two_tensors_is_two_reads():
    """A[i] * C[i]: two tensors of one shape at one index are two requests (the load's structure alone is the
    same for both)."""
    N = T.dynamic("N")

    @T.prim_func
    def product(A: T.Tensor((N,), "float32"), C: T.Tensor((N,), "float32"), B: T.Tensor((N,), "float32")):
        with T.Kernel(T.ceildiv(N, TILE), threads=TILE) as bx:
            for i in T.Parallel(TILE):
                B[bx * TILE + i] = A[bx * TILE + i] * C[bx * TILE + i]

    n = 4 * TILE
    assert measure(product, [torch.zeros(n), torch.zeros(n), torch.zeros(n)]) == _traffic(4, 2 * n * F32, n * F32)


def test_every_cta_reads_the_shared_vector():
    R = T.dynamic("R")

    @T.prim_func
    def scale_rows(V: T.Tensor((TILE,), "float32"), A: T.Tensor((R, TILE), "float32"),
                   B: T.Tensor((R, TILE), "float32")):
        with T.Kernel(R, threads=TILE) as row:
            v = T.alloc_shared((TILE,), "float32")
            T.copy(V, v)
            for i in T.Parallel(TILE):
                B[row, i] = A[row, i] * v[i]

    rows = 5
    got = measure(scale_rows, [torch.zeros(TILE), torch.zeros(rows, TILE), torch.zeros(rows, TILE)])
    assert got == _traffic(rows, rows * TILE * F32 + rows * TILE * F32, rows * TILE * F32)


def test_a_pipelined_copy_counts_its_cp_async_sources():
    """Row sums over K in 16 x 32 tiles through T.Pipelined: the loads become predicated cp.async copies."""
    R, K = T.dynamic("R"), T.dynamic("K")

    @T.prim_func
    def row_sums(A: T.Tensor((R, K), "float32"), B: T.Tensor((R,), "float32")):
        with T.Kernel(T.ceildiv(R, 16), threads=128) as by:
            a = T.alloc_shared((16, 32), "float32")
            acc = T.alloc_fragment((16, 32), "float32")
            sums = T.alloc_fragment((16,), "float32")
            T.clear(acc)
            for k in T.Pipelined(T.ceildiv(K, 32), num_stages=2):
                T.copy(A[by * 16, k * 32], a)
                for i, j in T.Parallel(16, 32):
                    acc[i, j] += a[i, j]
            T.reduce_sum(acc, sums, dim=1)
            T.copy(sums, B[by * 16])

    rows, cols = 60, 250  # partial tiles both ways
    assert "ptx_cp_async" in lower_for_traffic(row_sums).script()
    got = measure(row_sums, [torch.zeros(rows, cols), torch.zeros(rows)])
    assert got == _traffic(4, rows * cols * F32, rows * F32)


def test_an_atomic_add_reads_and_writes():
    N = T.dynamic("N")

    @T.prim_func
    def total(A: T.Tensor((N,), "float32"), Out: T.Tensor((1,), "float32")):
        with T.Kernel(T.ceildiv(N, TILE), threads=TILE) as bx:
            for i in T.Parallel(TILE):
                if bx * TILE + i < N:
                    T.atomic_add(Out[0], A[bx * TILE + i])

    n = 1000
    assert measure(total, [torch.zeros(n), torch.zeros(1)]) == _traffic(8, 2 * n * F32, n * F32)


def test_a_condition_on_data_is_taken_as_true():
    """Rows flagged off copy nothing at run time; the count cannot know which: an upper bound. Every thread
    reads its row's flag."""
    R = T.dynamic("R")

    @T.prim_func
    def flagged_copy(Flags: T.Tensor((R,), "int32"), A: T.Tensor((R, TILE), "float32"),
                     B: T.Tensor((R, TILE), "float32")):
        with T.Kernel(R, threads=TILE) as row:
            for i in T.Parallel(TILE):
                if Flags[row] != 0:
                    B[row, i] = A[row, i]

    rows = 5
    flags = torch.zeros(rows, dtype=torch.int32)
    got = measure(flagged_copy, [flags, torch.zeros(rows, TILE), torch.zeros(rows, TILE)])
    flag_reads = rows * 4  # int32: the CTA's threads all read Flags[row], one element per CTA
    assert got == _traffic(rows, flag_reads + rows * TILE * F32, rows * TILE * F32, exact=False)


def _data_bounded_copy(bounded: bool):
    """B[r, :count] = A[r, :count] for count = Count[0], capped at the row width 4 when `bounded`."""
    R = T.dynamic("R")

    @T.prim_func
    def prefix_copy(Count: T.Tensor((1,), "int32"), A: T.Tensor((R, 4), "float32"), B: T.Tensor((R, 4), "float32")):
        with T.Kernel(T.ceildiv(R, TILE), threads=TILE) as bx:
            for r in T.Parallel(TILE):
                for t in T.serial(T.min(Count[0], 4) if bounded else Count[0]):
                    B[bx * TILE + r, t] = A[bx * TILE + r, t]

    return prefix_copy


def test_a_loop_over_data_runs_the_bound_the_sizes_give():
    rows = 300
    args = [torch.zeros(1, dtype=torch.int32), torch.zeros(rows, 4), torch.zeros(rows, 4)]
    count_reads = 3 * 4  # the threads of each of the 3 CTAs read Count[0] for the loop's range: once per CTA
    assert measure(_data_bounded_copy(True), args) == _traffic(3, count_reads + rows * 4 * F32, rows * 4 * F32,
                                                               exact=False)
    with pytest.raises(ValueError, match="loop t: its range .* depends on data"):
        measure(_data_bounded_copy(False), args)


def _row_prefix_copy():
    """B[r, :Count[r]] = A[r, :Count[r]] (Count clamped to the row width 4), a CTA per row; the extent is a local."""
    R = T.dynamic("R")

    @T.prim_func
    def row_prefix_copy(Count: T.Tensor((R,), "int32"), A: T.Tensor((R, 4), "float32"),
                        B: T.Tensor((R, 4), "float32")):
        with T.Kernel(R, threads=32) as row:
            taken = T.alloc_var("int32", T.max(T.min(Count[row], 4), 0))
            for t in T.serial(taken):
                B[row, t] = A[row, t]

    return row_prefix_copy


def test_a_loop_over_data_runs_each_ctas_extent_from_the_values_it_starts_with():
    """Given the values the launch starts with, a loop whose extent reads data runs each CTA's own extent: the count
    is exact, and the local naming the extent is among the sizes at its largest (the heaviest CTA's trips)."""
    counts = torch.tensor([0, 3, 1, 9, -2], dtype=torch.int32)  # clamped to [0, 4]: 0 3 1 4 0
    args = [torch.zeros(5, dtype=torch.int32), torch.zeros(5, 4), torch.zeros(5, 4)]
    got = measure(_row_prefix_copy(), args, values=lambda: [counts, None, None])
    assert got == _traffic(5, 5 * 4 + 8 * F32, 8 * F32)
    assert dict(got.sizes)["taken"] == 4
    without = measure(_row_prefix_copy(), args)  # no values: the bound the sizes give, 4 per row
    assert without == _traffic(5, 5 * 4 + 20 * F32, 20 * F32, exact=False)


def test_values_are_asked_only_for_a_loop_over_data():
    def never():
        raise AssertionError("values asked for a launch with no loop over data")

    n = 8 * TILE
    assert measure(_tiled_copy(), [torch.zeros(n), torch.zeros(n)], values=never) == _traffic(8, n * F32, n * F32)


def test_a_buffer_the_launch_writes_is_not_read_as_data():
    """Values are what the arguments hold when the launch starts: a count the launch itself updates is unknown
    while it runs, and its loop keeps the sizes' bound."""
    R = T.dynamic("R")

    @T.prim_func
    def consume(Count: T.Tensor((R,), "int32"), A: T.Tensor((R, 4), "float32"), B: T.Tensor((R, 4), "float32")):
        with T.Kernel(R, threads=32) as row:
            taken = T.alloc_var("int32", T.max(T.min(Count[row], 4), 0))
            for t in T.serial(taken):
                B[row, t] = A[row, t]
            Count[row] = 0

    counts = torch.ones(5, dtype=torch.int32)
    got = measure(consume, [counts.clone(), torch.zeros(5, 4), torch.zeros(5, 4)], values=lambda: [counts, None, None])
    assert got == _traffic(5, 5 * 4 + 20 * F32, 20 * F32 + 5 * 4, exact=False)


def _count_then_copy(problem, config, fl):
    """Two stages: Count[r] = the number of positive A[r, :] (a CTA per row), then row_prefix_copy over them."""
    R = T.dynamic("R")

    @T.prim_func
    def count_positive(A: T.Tensor((R, 4), "float32"), Count: T.Tensor((R,), "int32")):
        with T.Kernel(R, threads=32) as row:
            found = T.alloc_var("int32", 0)
            for t in T.serial(4):
                if A[row, t] > 0:
                    found = found + 1
            Count[row] = found

    return count_positive, _row_prefix_copy()


def test_a_stage_over_what_an_earlier_stage_wrote_counts_it_from_the_c_flavours_run():
    """Through a TileLangKernel, a later stage's loop over a count an earlier stage wrote (the split top-k's
    candidates) is counted with the count the C flavour of the earlier stage computes."""
    kernel = TileLangKernel(_count_then_copy, lambda problem, inputs, config, fl, out: (
        [inputs["a"], out[0]], [out[0], inputs["a"], out[1]]))
    a = torch.tensor([[1.0, 1, 1, 0], [0, 0, 0, 0], [1, -1, 1, 1]])  # counts 3 0 3
    out = (torch.empty(3, dtype=torch.int32), torch.empty(3, 4))
    counting, copy = kernel.traffic(None, {"a": a}, {}, out)
    assert counting == _traffic(3, 3 * 4 * F32, 3 * 4)
    assert copy == _traffic(3, 3 * 4 + 6 * F32, 6 * F32)
    assert dict(copy.sizes)["taken"] == 3


def test_sinkhorn_reads_and_writes_each_matrix_once():
    """The real kernel: a thread per matrix, block_b matrices per CTA; its design moves the minimum."""
    op = registry.get("sinkhorn")
    impl = op.implementation("tilelang")
    smoke = op.presets["smoke"][0]
    for problem in (smoke, smoke.with_sizes((300,))):  # 300: a partial last CTA
        inputs = op.make_inputs(problem, "cpu", 0)
        problem = op.check(inputs)
        out = op.empty_outputs(problem, inputs)
        config = impl.default_config(problem)
        args = impl.kernel.arguments(problem, inputs, config, GPU, out)
        got = measure(impl.kernel.program(problem, config, GPU), args, impl.kernel.gpu_pass_configs)
        input_bytes = inputs["x"].numel() * inputs["x"].element_size()
        output_bytes = out.numel() * out.element_size()
        assert got.bytes_read >= input_bytes and got.bytes_written >= output_bytes
        blocks = -(-problem.matrices // config["block_b"])
        assert got == _traffic(blocks, input_bytes, output_bytes)
        assert got.bytes == op.cost(problem).bytes


def test_a_ticket_runs_the_last_arrivals_branch_once_per_group():
    """Split-K with a ticket: each of the 4 splits of a row writes its part, then one thread draws a ticket from
    the row's counter; the split that draws 3 sums the parts. The ticket is the CTA's rank among the row's
    splits, so the sum's reads count once per row, exactly; a counter the rule does not know stays data."""
    N, S = T.dynamic("N"), 4

    def program(counter_of_row: bool):
        @T.prim_func
        def split_sum(X: T.Tensor((N, S), "float32"), Parts: T.Tensor((S, N), "float32"),
                      Count: T.Tensor((N,), "int32"), Out: T.Tensor((N,), "float32")):
            with T.Kernel(S, N, threads=32) as (s, row):
                ticket = T.alloc_shared((1,), "int32")
                total = T.alloc_var("float32", 0.0)
                Parts[s, row] = X[row, s] * 2.0
                T.sync_threads()
                if T.get_thread_binding() == 0:
                    ticket[0] = T.atomic_add(Count[row if counter_of_row else 0], 1, memory_order="acq_rel",
                                             return_prev=True)
                T.sync_threads()
                if ticket[0] == S - 1:
                    for k in T.serial(S):
                        total = total + Parts[k, row]
                    Out[row] = total

        return split_sum

    rows = 5
    args = [torch.zeros(rows, S), torch.zeros(S, rows), torch.zeros(rows, dtype=torch.int32), torch.zeros(rows)]
    ticket_rmw = rows * S * 4  # one thread per CTA: a read and a write
    exact = measure(program(True), args)
    assert exact == _traffic(rows * S, rows * S * F32 + ticket_rmw + rows * S * F32,
                             rows * S * F32 + ticket_rmw + rows * F32)
    assert not measure(program(False), args).exact
