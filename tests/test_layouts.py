"""Layouts and memory safety, for every operator and every backend.

An argument check accepts a layout only if the kernels honour it (README, "Layouts"):
- the arguments in STRIDED take the strides of every dimension but the last, which must have unit
  stride: row-padded views (a column slice of a wider buffer), slices, permuted leading dimensions,
  offset and expanded (stride 0) views all give the reference's result on the same view;
- every other tensor argument must be contiguous (any storage offset); other layouts are refused
  before any kernel runs, with an error naming the argument and the fix.
Memory outside a view holds garbage (NaN, 0xFF bytes, zero indices), so a kernel that ignores a
stride reads it and fails the comparison. The guard-band test checks the other direction: kernels
write nothing outside the buffers they allocate.
"""

import math

import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st

from _budget import fraction_of_examples
from _device import DEVICE
from flashkern import registry
from flashkern.kernels.engram import GateProblem, HashProblem, LookupProblem
from flashkern.kernels.indexer import Indexer, CandidateProblem, LogitsProblem, PagedProblem, SparseProblem, TopkProblem
from flashkern.kernels.kv_cache import AttentionProblem, CodecProblem
from flashkern.kernels.mhc import MhcProblem, SinkhornProblem
from flashkern.kernels.moe_route import V3, V41_FLASH, RouteProblem

KERNELS = ("triton", "tilelang")
FP4 = Indexer(32, 128, "mxfp4")

# Problems with every optional tensor present, odd sizes and more than one row (so that a row stride matters).
CASES = {
    "moe_route": (RouteProblem(37, V3, has_valid=True),),
    "moe_route_gate": (RouteProblem(7, V41_FLASH, has_valid=True, hidden=72, has_norm=True),),
    "mqa_logits": (LogitsProblem(5, 300), LogitsProblem(3, 200, FP4)),
    "paged_mqa_logits": (PagedProblem(2, 5, 2, 64), PagedProblem(3, 3, 1, 64, FP4)),
    "topk_indices": (TopkProblem(4, 3000, 512, has_starts=True),),
    "candidate_blocks": (CandidateProblem(3, 2000, 64, 8),),
    "sparse_mqa_logits": (SparseProblem(3, 1000, 32, 8, 64), SparseProblem(2, 700, 16, 8, 32, FP4)),
    "sinkhorn": (SinkhornProblem(37, 4),),
    "mhc_pre": (MhcProblem(5, 37, has_norm=True, collapse="carried"),),
    "mhc_post": (MhcProblem(5, 37),),
    "mhc_post_pre": (MhcProblem(5, 37, has_norm=True, collapse="carried"),),
    "quantize_kv": (CodecProblem(5, "fp4"), CodecProblem(3, "mxfp8")),
    "dequantize_kv": (CodecProblem(5, "fp4"), CodecProblem(3, "mxfp8")),
    "kv_cache_insert": (CodecProblem(5, "fp4"), CodecProblem(3, "mxfp8")),
    "sparse_decode_attention": (AttentionProblem(3, 37, 5, 4, swa=True, sink=True),
                                AttentionProblem(2, 20, 3, 3, "mxfp8", "fp4", swa=True)),
    "engram_hash": (HashProblem(37, history=True), HashProblem(5, 3, 3)),
    "engram_lookup": (LookupProblem(5, 7),),
    "engram_gate": (GateProblem(5, 37),),
}

# The arguments whose kernels take strides (every dimension but the last); all others must be contiguous.
STRIDED = {
    "moe_route": ("logits",),
    "moe_route_gate": ("hidden",),
    "mqa_logits": ("q", "k", "k_scale", "w", "q_scale"),
    "paged_mqa_logits": ("q", "k_cache", "k_scale", "w", "block_table", "q_scale"),
    "topk_indices": ("logits",),
    "candidate_blocks": ("logits",),
    "sparse_mqa_logits": ("q", "k", "k_scale", "w", "blocks", "q_scale"),
    "quantize_kv": ("latent",),
    "dequantize_kv": ("records",),
    "kv_cache_insert": ("latent",),
    "sparse_decode_attention": ("q", "indices", "swa_indices"),
    "engram_lookup": ("table",),
}

VIEWS = ("padded", "offset", "permuted", "expanded")


def _garbage(dtype: torch.dtype):
    """What memory outside a view holds: NaN for floats, 0xFF bytes, zeros (valid but wrong indices) for ints."""
    if dtype.is_floating_point:
        return float("nan")
    return 0xFF if dtype == torch.uint8 else True if dtype == torch.bool else 0


def _buffer(shape, dtype) -> torch.Tensor:
    return torch.full(shape, _garbage(dtype), dtype=torch.float32 if dtype.is_floating_point else dtype,
                      device=DEVICE).to(dtype)


def layout(x: torch.Tensor, view: str) -> torch.Tensor:
    """x (same values, except `expanded`) in the named layout.

    padded    a slice of a buffer larger in every dimension (offset, padded rows); 1-D: contiguous with an offset
    offset    contiguous, storage_offset 3
    permuted  leading dims 0 and 1 swapped in memory (unit last stride); 2-D: transposed in memory; 1-D: every
              second element
    expanded  row 0 broadcast over dim 0 (stride 0); 1-D: element 0 broadcast
    """
    if view == "padded":
        buffer = _buffer([d + 2 for d in x.shape[:-1]] + [x.shape[-1] + 5], x.dtype)
        out = buffer[tuple(slice(1, 1 + d) for d in x.shape)]
    elif view == "offset":
        out = _buffer([x.numel() + 3], x.dtype)[3:].view(x.shape)
    elif view == "permuted" and x.dim() >= 3:
        out = _buffer([x.shape[1], x.shape[0], *x.shape[2:]], x.dtype).transpose(0, 1)
    elif view == "permuted" and x.dim() == 2:
        out = _buffer(list(reversed(x.shape)), x.dtype).t()
    elif view == "permuted":
        out = _buffer([2 * x.shape[0]], x.dtype)[::2]
    else:
        return x[:1].expand(x.shape)
    out.copy_(x)
    return out


def accepted(name: str, op_name: str, x: torch.Tensor) -> bool:
    """Whether the argument checks must accept this layout of argument `name`."""
    if x.is_contiguous():
        return True
    return name in STRIDED.get(op_name, ()) and (x.shape[-1] <= 1 or x.stride(-1) == 1)


def _tensors(inputs: dict) -> list[str]:
    return [name for name, value in inputs.items() if isinstance(value, torch.Tensor)]


def _check_layouts(op, inputs: dict, views: dict, backend: str):
    """Run `op` on inputs with the named arguments in the given views; compare with the reference on the same views."""
    inputs = {**inputs, **{name: layout(inputs[name], view) for name, view in views.items()}}
    assert all(accepted(name, op.name, inputs[name]) for name in views)
    expected = op.reference(**inputs)  # before an operator that writes an input in place writes it
    op.compare(inputs, expected, op.result_of(inputs, backend=backend))


OPS = sorted(CASES)


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("name", OPS)
def test_strided_arguments_padded_and_the_rest_offset(name, backend):
    """Every STRIDED argument a slice of a larger buffer, every other tensor contiguous at an offset."""
    op = registry.get(name)
    for problem in CASES[name]:
        inputs = op.make_inputs(problem, DEVICE, seed=1)
        strided = STRIDED.get(name, ())
        _check_layouts(op, inputs, {arg: "padded" if arg in strided else "offset" for arg in _tensors(inputs)},
                       backend)


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("name", sorted(STRIDED))
@fraction_of_examples(1 / 4)
@given(data=st.data())
def test_drawn_accepted_layouts_match_the_reference(name, backend, data):
    """Each STRIDED argument in a drawn view (padded, offset, permuted or expanded, where its rank allows), each
    other tensor contiguous or at an offset."""
    op = registry.get(name)
    inputs = op.make_inputs(data.draw(st.sampled_from(CASES[name])), DEVICE, seed=data.draw(st.integers(0, 99)))
    views = {}
    for arg in _tensors(inputs):
        options = [v for v in VIEWS if accepted(arg, name, layout(inputs[arg], v))] + ["contiguous"]
        view = data.draw(st.sampled_from(options), label=arg)
        if view != "contiguous":
            views[arg] = view
    note(f"views={views}")
    _check_layouts(op, inputs, views, backend)


@pytest.mark.parametrize("name", OPS)
def test_refused_layouts_are_named_before_launch(monkeypatch, name):
    """Every layout the checks must refuse (per argument, per view) raises a ValueError naming the argument and
    the fix, before any kernel runs; the ones they must accept are accepted by the checks."""
    op = registry.get(name)
    for impl in op.implementations:
        monkeypatch.setattr(type(impl.kernel), "run", lambda *a: pytest.fail("a kernel ran despite a refused layout"))
    refused = 0
    for problem in CASES[name]:
        inputs = op.make_inputs(problem, DEVICE, seed=2)
        for arg in _tensors(inputs):
            for view in VIEWS:
                changed = {**inputs, arg: layout(inputs[arg], view)}
                if accepted(arg, name, changed[arg]):
                    op.check(changed)
                    continue
                refused += 1
                with pytest.raises(ValueError, match=rf"^{arg} must .*{arg}\.contiguous\(\)"):
                    op.entry(**changed, backend="triton")
    assert refused > 0


# ---------------------------------------------------------------- guard bands

GUARD = 256  # sentinel elements on each side of every buffer a kernel path allocates


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("name", OPS)
def test_kernels_write_nothing_outside_their_outputs(monkeypatch, name, backend):
    """Every torch.empty / empty_like of the call (outputs, partials, scores between stages), and the input an operator
    writes in place, is carved from a larger buffer filled with a sentinel byte; after the run the margins must be untouched (odd sizes: tails, padded
    heads and streams). TileLang's C writes through raw pointers, as GPU kernels do; Triton's interpreter writes
    into its own copy of each tensor, so there this guards the GPU runs (scripts/gpu_check.sh) only."""
    op = registry.get(name)
    buffers, real_empty = [], torch.empty

    def guarded_empty(*size, dtype=None, device=None, **_):
        shape = tuple(size[0]) if len(size) == 1 and not isinstance(size[0], int) else size
        buffer = real_empty(math.prod(shape) + 2 * GUARD, dtype=dtype or torch.float32, device=device)
        buffer.view(torch.uint8).fill_(0x5A)
        buffers.append(buffer)
        return buffer[GUARD: GUARD + math.prod(shape)].view(shape)

    for problem in CASES[name]:
        inputs = op.make_inputs(problem, DEVICE, seed=9)
        expected = op.reference(**inputs)
        if op.mutates:  # the input it writes in place is guarded too
            inputs[op.mutates] = guarded_empty(inputs[op.mutates].shape, dtype=inputs[op.mutates].dtype,
                                               device=DEVICE).copy_(inputs[op.mutates])
        monkeypatch.setattr(torch, "empty", guarded_empty)
        monkeypatch.setattr(torch, "empty_like", lambda x, **_: guarded_empty(x.shape, dtype=x.dtype, device=x.device))
        actual = op.result_of(inputs, backend=backend)
        monkeypatch.undo()
        assert buffers, "the kernel path allocated nothing through torch.empty"
        for buffer in buffers:
            margins = torch.cat([buffer[:GUARD].view(torch.uint8), buffer[-GUARD:].view(torch.uint8)])
            assert (margins == 0x5A).all(), f"a write outside a {buffer.dtype} buffer of {buffer.numel() - 2 * GUARD}"
        op.compare(inputs, expected, actual)
