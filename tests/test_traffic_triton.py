"""Triton traffic counting (kernels/_triton/traffic.py) against hand-computed bytes of tiny kernels."""

import flashkern  # noqa: I001  (first: sets TRITON_INTERPRET=1 before Triton defines anything)
import dataclasses

import pytest
import torch
import triton
import triton.language as tl

from flashkern import registry
from flashkern.kernels._triton import Launch
from flashkern.kernels._triton.traffic import _ACCESSES, measure


@triton.jit
def _split_sum_last_arrival(x, parts, tickets, out, SPLITS: tl.constexpr):
    """Split program_id(0) of row program_id(1) writes its part; the row's last split to arrive sums the parts."""
    split, row = tl.program_id(0), tl.program_id(1)
    tl.store(parts + row * SPLITS + split, tl.load(x + row * SPLITS + split) * 2.0)
    if tl.atomic_add(tickets + row, 1) == SPLITS - 1:
        tl.store(out + row, tl.sum(tl.load(parts + row * SPLITS + tl.arange(0, SPLITS))))


@triton.jit
def _convert_copy(src, dst, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tail = offsets < n
    tl.store(dst + offsets, tl.load(src + offsets, mask=tail).to(tl.float32), mask=tail)


@triton.jit
def _read_twice(src, dst, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    first = tl.load(src + offsets)
    tl.store(dst + offsets, first + tl.load(src + offsets))


@triton.jit
def _scaled_shared_vector_dot(vector, rows, scale, out, LENGTH: tl.constexpr):
    row = tl.program_id(0)
    lanes = tl.arange(0, LENGTH)
    total = tl.sum(tl.load(vector + lanes) * tl.load(rows + row * LENGTH + lanes))
    tl.store(out + row, total * tl.load(scale))  # a scalar load and a scalar store: one element each


@triton.jit
def _histogram_and_flag(values, bins, flags, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tail = offsets < n
    tl.atomic_add(bins + tl.load(values + offsets, mask=tail, other=0), 1, mask=tail)
    tl.atomic_cas(flags + tl.program_id(0), 0, 1)


@triton.jit
def _descriptor_copy(src, dst, M, N, BM: tl.constexpr, BN: tl.constexpr):
    source = tl.make_tensor_descriptor(src, shape=[M, N], strides=[N, 1], block_shape=[BM, BN])
    target = tl.make_tensor_descriptor(dst, shape=[M, N], strides=[N, 1], block_shape=[BM, BN])
    target.store([tl.program_id(0) * BM, 0], source.load([tl.program_id(0) * BM, 0]))


@triton.jit
def _write_flat_program_id(out):
    nx = tl.num_programs(0)
    ny = tl.num_programs(1)
    flat = tl.program_id(0) + nx * (tl.program_id(1) + ny * tl.program_id(2))
    tl.store(out + flat, flat)


@triton.jit
def _failing(src, BLOCK: tl.constexpr):
    tl.load(src + tl.arange(0, BLOCK))  # counted, then the kernel fails
    tl.static_assert(BLOCK < 0, "deliberate failure")


def test_masked_tail_counts_elements_not_blocks_with_each_pointee_size():
    n = 1000  # 8 blocks of 128, the last one 104 elements
    src, dst = torch.arange(n, dtype=torch.int16), torch.zeros(n)
    traffic = measure(Launch(_convert_copy, (triton.cdiv(n, 128),), dict(src=src, dst=dst, n=n, BLOCK=128)))
    assert torch.equal(dst, src.float())
    assert (traffic.ctas, traffic.sampled, traffic.exact) == (8, 8, True)
    assert (traffic.bytes_read, traffic.bytes_written) == (n * 2, n * 4)
    assert traffic.bytes == n * 6


def test_each_read_counts_even_when_repeated():
    n = 256
    src, dst = torch.ones(n), torch.zeros(n)
    traffic = measure(Launch(_read_twice, (n // 64,), dict(src=src, dst=dst, BLOCK=64)))
    assert (traffic.bytes_read, traffic.bytes_written) == (2 * n * 4, n * 4)


def test_vector_shared_by_every_cta_counts_once_per_cta():
    rows, length = 12, 16
    vector, matrix, scale, out = torch.ones(length), torch.ones(rows, length), torch.full((1,), 2.0), torch.zeros(rows)
    args = dict(vector=vector, rows=matrix, scale=scale, out=out, LENGTH=length)
    traffic = measure(Launch(_scaled_shared_vector_dot, (rows,), args))
    assert traffic.bytes_read == rows * (length * 4 + length * 4 + 4)  # per CTA: the vector, its own row, the scale
    assert traffic.bytes_written == rows * 4
    assert torch.equal(out, torch.full((rows,), 2.0 * length))


def test_atomics_count_read_and_write_of_active_lanes():
    n, block = 100, 64  # 2 CTAs, 28 lanes masked off
    values = torch.arange(n, dtype=torch.int32) % 4
    bins, flags = torch.zeros(4, dtype=torch.int32), torch.zeros(2, dtype=torch.int32)
    traffic = measure(Launch(_histogram_and_flag, (2,), dict(values=values, bins=bins, flags=flags, n=n, BLOCK=block)))
    assert bins.tolist() == [25, 25, 25, 25] and flags.tolist() == [1, 1]
    atomics = n * 4 + 2 * 4  # atomic_add lanes + one compare-and-swap per CTA
    assert traffic.bytes_read == n * 4 + atomics
    assert traffic.bytes_written == atomics


def test_descriptor_accesses_count_in_bounds_rows_once():
    m, n = 10, 8  # 3 boxes of 4 rows, the last one half outside
    src = torch.arange(m * n, dtype=torch.float32).reshape(m, n)
    dst = torch.zeros_like(src)
    traffic = measure(Launch(_descriptor_copy, (3,), dict(src=src, dst=dst, M=m, N=n, BM=4, BN=8)))
    assert torch.equal(dst, src)
    assert (traffic.bytes_read, traffic.bytes_written) == (m * n * 4, m * n * 4)


def test_full_walk_sees_every_program_id_of_a_3d_grid():
    grid = (5, 4, 3)
    out = torch.full((60,), -1, dtype=torch.int32)
    traffic = measure(Launch(_write_flat_program_id, grid, dict(out=out)))
    assert out.tolist() == list(range(60))
    assert (traffic.ctas, traffic.sampled, traffic.bytes_written) == (60, 60, 60 * 4)


def test_sample_keeps_program_ids_and_grid_and_includes_first_and_last():
    out = torch.full((60,), -1, dtype=torch.int32)
    traffic = measure(Launch(_write_flat_program_id, (5, 4, 3), dict(out=out)), max_ctas=7)
    written = [i for i, value in enumerate(out.tolist()) if value != -1]
    assert written == [0, 9, 19, 29, 39, 49, 59]  # evenly spaced; each CTA wrote its own flat id
    assert all(out[i] == i for i in written)
    assert (traffic.ctas, traffic.sampled, traffic.bytes_written) == (60, 7, 60 * 4)


def test_sampled_walk_of_a_uniform_kernel_matches_the_full_walk():
    n, block = 200 * 32, 32
    args = dict(src=torch.ones(n), dst=torch.zeros(n), BLOCK=block)
    full = measure(Launch(_read_twice, (n // block,), args), max_ctas=n // block)
    sampled = measure(Launch(_read_twice, (n // block,), args), max_ctas=16)
    assert (full.sampled, sampled.sampled, sampled.ctas) == (200, 16, 200)
    assert (sampled.bytes_read, sampled.bytes_written) == (full.bytes_read, full.bytes_written) == (2 * n * 4, n * 4)


def test_empty_grid_and_bad_sample_size():
    launch = Launch(_read_twice, (0,), dict(src=torch.ones(4), dst=torch.zeros(4), BLOCK=4))
    assert measure(launch) == measure(launch, max_ctas=2)
    assert (measure(launch).ctas, measure(launch).bytes) == (0, 0)
    with pytest.raises(ValueError):
        measure(launch, max_ctas=1)


def test_builder_restored_after_a_failing_kernel():
    from triton.runtime.interpreter import interpreter_builder

    instrumented = [*_ACCESSES, "set_grid_dim", "set_grid_idx"]
    with pytest.raises(Exception, match="deliberate failure"):
        measure(Launch(_failing, (3,), dict(src=torch.ones(8), BLOCK=8)))
    assert not set(instrumented) & set(vars(interpreter_builder))
    # and counting starts from zero again
    args = dict(src=torch.ones(64), dst=torch.zeros(64), BLOCK=64)
    assert measure(Launch(_read_twice, (1,), args)).bytes == 3 * 64 * 4


@pytest.mark.parametrize("problem_index", [0, 1])
def test_real_launch_moves_at_least_its_operands(problem_index):
    op = registry.get("sinkhorn")
    inputs = op.make_inputs(op.presets["smoke"][problem_index], "cpu", 0)
    problem = op.check(inputs)
    impl = op.implementation("triton")
    out = op.empty_outputs(problem, inputs)
    launches = impl.kernel.plan(problem, inputs, impl.default_config(problem), out)
    traffic = [measure(launch) for launch in (launches if isinstance(launches, tuple) else (launches,))]
    bytes_read, bytes_written = sum(t.bytes_read for t in traffic), sum(t.bytes_written for t in traffic)
    assert bytes_read >= inputs["x"].numel() * inputs["x"].element_size()
    assert bytes_written >= out.numel() * out.element_size()
    assert bytes_read + bytes_written >= op.cost(problem).bytes


def test_cooperating_ctas_are_sampled_in_whole_groups():
    """Rows of 4 splits whose last arrival sums them: sampled a CTA at a time, no row would finish; sampled in
    groups (Launch.cooperating), every sampled row runs its last step, and the scaled count is the full walk's."""
    rows, splits = 40, 4
    x = torch.randn(rows * splits)

    def launch():
        args = dict(x=x, parts=torch.zeros(rows * splits), tickets=torch.zeros(rows, dtype=torch.int32),
                    out=torch.zeros(rows), SPLITS=splits)
        return Launch(_split_sum_last_arrival, (splits, rows), args, cooperating=splits), args

    full_launch, full_args = launch()
    full = measure(full_launch, max_ctas=rows * splits)
    torch.testing.assert_close(full_args["out"], 2 * x.view(rows, splits).sum(1))
    sampled_launch, sampled_args = launch()
    sampled = measure(sampled_launch, max_ctas=16)
    assert (sampled.ctas, sampled.sampled) == (rows * splits, 16)
    finished = (sampled_args["out"] != 0).nonzero().flatten().tolist()
    assert finished == [0, 13, 26, 39]  # four whole rows, first and last included
    assert (sampled.bytes_read, sampled.bytes_written) == (full.bytes_read, full.bytes_written)
    # the traced CTAs' lines, each CTA's own: the sum's line ran in the last arrival of each traced row only
    summed = [dict(lines) for lines in sampled.cta_lines]
    sum_line = max(line for cta in summed for line in cta if line[0].endswith("test_traffic_triton.py"))
    assert len(summed) == 8 and [sum_line in cta for cta in summed] == [False, False, False, True] * 2
    with pytest.raises(ValueError, match="groups of 3"):
        measure(dataclasses.replace(sampled_launch, cooperating=3))
