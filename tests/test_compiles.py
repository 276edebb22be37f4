"""One compile per config and backend, whatever the batch.

A serving engine calls every operator with a batch (tokens, rows, matrices) that changes each step. Triton's JIT
specializes integer arguments equal to 1 or divisible by 16 and compiles once per specialization; TileLang compiles
once per distinct program. Kernels mark their batch arguments `do_not_specialize` (Triton) or take them as dynamic
symbols (TileLang), and these tests count what would be compiled across batches 1..300 (the `ci` profile: a sample
that holds 1, multiples of 16 and their neighbours): one build per kernel, config and backend. The sizes along a
row (context length, positions) keep their specialization on purpose: divisibility by 16 is what lets masked loads
and stores along a row vectorize, and it bounds their builds to three (1, divisible by 16, other).
"""

import collections

import pytest
import torch
import triton
import triton.language as tl

import flashkern
from flashkern import registry
from flashkern.kernels._tilelang import GPU
from flashkern.kernels._triton import Launch, _stages, compile_key
from flashkern.kernels.cases import narrow

OPS = sorted(registry.operators())
SAMPLE = (1, 2, 3, 15, 16, 17, 32, 33, 100, 256, 300)


def batches():
    return SAMPLE if narrow() else range(1, 301)


def with_batch(problem, batch: int):
    """The problem with its batch (its first size: tokens, rows, batch or matrices) set to `batch`."""
    return problem.with_sizes((batch,) + problem.sizes[1:])


def configs(impl, problem) -> list[dict]:
    """The CPU and GPU defaults at `problem` and one config sampled from its space."""
    with flashkern.planning_for_gpu():
        gpu_default = impl.default_config(problem)
    found = [impl.default_config(problem), gpu_default, *impl.space.sample(problem, 1, seed=7)]
    return [dict(c) for c in dict.fromkeys(tuple(sorted(c.items())) for c in found)]


def triton_builds(op, impl, problem, config) -> dict[str, set]:
    """Per Triton kernel, the distinct builds its launches need across the batches (planned as for a GPU)."""
    builds = collections.defaultdict(set)
    for batch in batches():
        sized = with_batch(problem, batch)
        inputs = op.make_inputs(sized, "cpu", 0)
        with flashkern.planning_for_gpu():
            launches = _stages(impl.kernel.plan(sized, inputs, config, op.empty_outputs(sized, inputs)))
        for launch in launches:
            if all(n > 0 for n in launch.grid):
                builds[launch.kernel.fn.__qualname__].add(compile_key(launch))
    return builds


def specializations(op):
    """A smoke problem of each specialization, at batch 1."""
    first = {}
    for problem in op.presets["smoke"]:
        first.setdefault(problem.specialization(), with_batch(problem, 1))
    return list(first.values())


@pytest.mark.parametrize("op_name", OPS)
def test_one_triton_build_per_kernel_and_config_whatever_the_batch(op_name):
    op = registry.get(op_name)
    impl = op.implementation("triton")
    for problem in specializations(op):
        for config in configs(impl, problem):
            builds = triton_builds(op, impl, problem, config)
            assert builds, f"{problem.key} {config}: no launch planned"
            many = {kernel: len(keys) for kernel, keys in builds.items() if len(keys) > 1}
            assert not many, f"{op_name} {problem.key} {config}: builds per kernel across batches {many}"


@pytest.mark.parametrize("op_name", OPS)
def test_one_tilelang_program_per_config_whatever_the_batch(op_name):
    """TileLang compiles one kernel per distinct program source (and caches it per specialization, config and
    layout): the GPU flavour's programs must not depend on the batch."""
    op = registry.get(op_name)
    impl = op.implementation("tilelang")
    sample = (1, 17, 300) if narrow() else SAMPLE
    for problem in specializations(op):
        with flashkern.planning_for_gpu():
            config = impl.default_config(problem)
        sources = collections.defaultdict(list)
        for batch in sample:
            sized = with_batch(problem, batch)
            layout = impl.kernel.layout_of(op.make_inputs(sized, "cpu", 0))
            programs = impl.kernel.programs(sized, config, GPU, layout)
            sources[tuple(func.script() for func in programs)].append(batch)
        assert len(sources) == 1, f"{op_name} {problem.key} {config}: programs differ between batches " \
                                  f"{list(sources.values())}"


@triton.jit
def _scale_rows(x_ptr, rows, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offsets, tl.load(x_ptr + offsets, mask=offsets < rows) * 2, mask=offsets < rows)


_scale_rows_any_batch = triton.jit(_scale_rows.fn, do_not_specialize=["rows"])


@pytest.mark.parametrize("kernel, expected", [(_scale_rows, 3), (_scale_rows_any_batch, 1)])
def test_the_build_count_sees_the_jits_integer_specialization(kernel, expected):
    """The count can fail: a batch argument left to the JIT's specialization makes three builds (1, divisible by
    16, other) across batches; marked do_not_specialize, one."""
    x = torch.zeros(512)
    keys = {compile_key(Launch(kernel, grid=(1,), args=dict(x_ptr=x, rows=n, BLOCK=512))) for n in range(1, 301)}
    assert len(keys) == expected
