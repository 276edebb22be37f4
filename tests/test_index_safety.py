"""Index arguments with any int32 value: memory safety and the documented out-of-range semantics.

Value checks run only in checked mode (flashkern.checks), so outside it any int32 reaches the kernels. Every
backend must then read nothing outside a tensor and treat what an out-of-range value points at as padding
(reference/indexer.py, "Out-of-range values"):
- the reference on drawn out-of-range arguments equals the reference on their in-range equivalents, built here from
  the documented rules (so the reference itself is held to them);
- each kernel equals the reference (op.compare; selections exactly), with the index-addressed tensors (keys, their
  scales, the key cache, logits, block tables) cut from larger buffers whose surroundings hold NaN / 0xFF / zero
  garbage (test_layouts.layout "padded"), so that a read outside a tensor changes the result;
- in checked mode every bad index argument is refused before any kernel runs, with a ValueError naming it.
"""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from _budget import fraction_of_examples
from _device import DEVICE, on_device
from flashkern import checks, registry
from flashkern.kernels.indexer import CandidateProblem, Indexer, LogitsProblem, PagedProblem, SparseProblem, TopkProblem
from flashkern.kernels.kv_cache import WINDOW_BY_POSITION, AttentionProblem, CodecProblem
from flashkern.reference import kv_cache as ref
from test_layouts import layout

BACKENDS = ("reference", "triton", "tilelang")
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
FP8, FP4 = Indexer(4, 64, "fp8"), Indexer(4, 64, "mxfp4")
ROWS, KEYS, POSITIONS = 6, 45, 70  # key counts and widths that are not multiples of a tile or a block


def outside(low: int, high: int):
    """int32 values outside [low, high]: just outside it, each int32 extreme (where offsets wrap), or any."""
    return st.one_of(st.integers(low - 3, low - 1), st.integers(high + 1, high + 3), st.just(INT32_MIN),
                     st.just(INT32_MAX), st.integers(INT32_MIN, INT32_MAX).filter(lambda v: not low <= v <= high))


def int32s(low: int, high: int):
    """Index values: in [low, high] or outside it."""
    return st.one_of(st.integers(low, high), outside(low, high))


def index_tensor(data, shape: tuple, low: int, high: int, label: str) -> torch.Tensor:
    """Drawn index values (int32s), both int32 extremes always among them, at drawn places."""
    drawn = data.draw(st.lists(int32s(low, high), min_size=math.prod(shape) - 2, max_size=math.prod(shape) - 2))
    values = data.draw(st.permutations([INT32_MIN, INT32_MAX, *drawn]), label=label)
    return torch.tensor(values, dtype=torch.int32).view(shape)


def clamp(x: torch.Tensor, low, high) -> torch.Tensor:
    """int32 x clamped to [low, high] (tensors or ints), computed in int64."""
    return torch.minimum(torch.maximum(x.long(), torch.as_tensor(low).long()), torch.as_tensor(high).long()).int()


# ---------------------------------------------------------------- drawn cases: (inputs, in-range equivalent, fixup)
# fixup(expected of the in-range equivalent) -> the expected result of the drawn inputs (paged: padding positions).


def _ragged(data, inputs: dict, keys: int) -> dict:
    """Drawn ks, ke, and their in-range equivalent: row m scores n iff max(ks, 0) <= n < min(ke, N)."""
    rows = len(inputs["ks"])
    ks, ke = index_tensor(data, (rows,), 0, keys, "ks"), index_tensor(data, (rows,), 0, keys, "ke")
    start = clamp(ks, 0, keys)
    return dict(ks=ks, ke=ke), dict(ks=start, ke=clamp(ke, start, keys))


def mqa_case(data):
    op = registry.get("mqa_logits")
    inputs = op.make_inputs(LogitsProblem(ROWS, KEYS, FP8), "cpu", data.draw(st.integers(0, 99), label="seed"))
    drawn, fixed = _ragged(data, inputs, KEYS)
    return {**inputs, **drawn}, {**inputs, **fixed}, None


def _candidate_row(data, n_blocks: int, ids: int, block: int) -> list:
    """Distinct block ids in [0, ids) (a repeated one is the caller's error) among -1 and out-of-range ids, some
    of which wrap into a valid position when multiplied by the block size in int32."""
    valid = data.draw(st.lists(st.integers(0, ids - 1), unique=True, max_size=n_blocks), label="valid blocks")
    wrapping = st.integers(0, ids - 1).flatmap(lambda i: st.sampled_from([i + 2**32 // block, i - 2**32 // block]))
    others = data.draw(st.lists(st.one_of(st.just(-1), outside(-1, ids - 1), wrapping),
                                min_size=n_blocks - len(valid), max_size=n_blocks - len(valid)), label="other blocks")
    return data.draw(st.permutations(valid + others), label="blocks")


def sparse_case(data):
    op = registry.get("sparse_mqa_logits")
    block, top_k = 8, data.draw(st.sampled_from([5, 64]), label="top_k")
    problem = SparseProblem(ROWS, KEYS, 6, block, top_k, FP8)
    inputs = op.make_inputs(problem, "cpu", data.draw(st.integers(0, 99), label="seed"))
    drawn, fixed = _ragged(data, inputs, KEYS)
    ids = -(-KEYS // block)
    blocks = torch.tensor([_candidate_row(data, problem.n_blocks, ids, block) for _ in range(ROWS)], dtype=torch.int32)
    fixed["blocks"] = torch.where((blocks >= 0) & (blocks < ids), blocks, -1)  # another id counts as -1
    return {**inputs, **drawn, "blocks": blocks}, {**inputs, **fixed}, None


def paged_case(data):
    op = registry.get("paged_mqa_logits")
    lens_2d = data.draw(st.booleans(), label="lens_2d")
    problem = PagedProblem(4, 4, 2, 16, FP4, lens_2d=lens_2d)
    inputs = op.make_inputs(problem, "cpu", data.draw(st.integers(0, 99), label="seed"))
    batch, next_n, width = problem.batch, problem.next_n, problem.width
    cache_blocks = inputs["k_cache"].shape[0]
    lens = index_tensor(data, inputs["context_lens"].shape, 0, width, "context_lens")
    table = index_tensor(data, (batch, problem.max_blocks), 0, cache_blocks - 1, "block_table")
    # in range: per-token ends clamped to [0, width] (2-D form), invalid entries replaced by a valid block ...
    ends = lens.long() if lens_2d else lens.long()[:, None] - next_n + 1 + torch.arange(next_n)
    found = (table >= 0) & (table < cache_blocks)
    fixed = dict(context_lens=clamp(ends, 0, width), block_table=torch.where(found, table, 0))
    # ... whose positions are then padding
    padding = (~found).repeat_interleave(problem.block_size, dim=1).repeat_interleave(next_n, dim=0)

    def fixup(expected):
        return expected.masked_fill(padding, -torch.inf)

    return {**inputs, "context_lens": lens, "block_table": table}, {**inputs, **fixed}, fixup


def topk_case(data):
    op = registry.get("topk_indices")
    has_starts = data.draw(st.booleans(), label="has_starts")
    k = data.draw(st.sampled_from([7, 2 * POSITIONS]), label="k")  # below and above the row: padding is taken
    problem = TopkProblem(ROWS, POSITIONS, k, has_starts, by_score=data.draw(st.booleans(), label="sorted"))
    inputs = op.make_inputs(problem, "cpu", data.draw(st.integers(0, 99), label="seed"))
    ends = index_tensor(data, (ROWS,), 0, POSITIONS, "ends")
    end = clamp(ends, 0, POSITIONS)
    drawn, fixed = dict(ends=ends), dict(ends=end)
    if has_starts:  # eligible n iff max(starts, 0) <= n < min(ends, N)
        drawn["starts"] = index_tensor(data, (ROWS,), 0, POSITIONS, "starts")
        fixed["starts"] = clamp(drawn["starts"], 0, end)
    return {**inputs, **drawn}, {**inputs, **fixed}, None


def candidate_case(data):
    op = registry.get("candidate_blocks")
    n_blocks = data.draw(st.sampled_from([1, 3, 16]), label="n_blocks")  # of 9: 1 keeps the newest block only
    inputs = op.make_inputs(CandidateProblem(ROWS, POSITIONS, n_blocks, 8), "cpu",
                            data.draw(st.integers(0, 99), label="seed"))
    row_end = index_tensor(data, (ROWS,), 0, POSITIONS, "row_end")
    return {**inputs, "row_end": row_end}, {**inputs, "row_end": clamp(row_end, 0, POSITIONS)}, None


def fenced(cache: torch.Tensor) -> torch.Tensor:
    """The same paged cache as a view of larger pages (a garbage tail per page) between two garbage pages: a read or
    write outside the cache's records meets 0xFF bytes (records that decode to NaN)."""
    blocks, block_size, record = cache.shape
    pages = torch.full((blocks + 2, block_size * record + 2 * record), 0xFF, dtype=torch.uint8)
    view = pages[1:-1, : block_size * record].view(blocks, block_size, record)
    view.copy_(cache)
    return view


def _slots_or_padding(drawn: torch.Tensor, slots: int) -> torch.Tensor:
    """The in-range equivalent of drawn slot values: an entry outside [0, slots) is padding (-1)."""
    return torch.where((drawn >= 0) & (drawn < slots), drawn, -1)


def attention_case(data):
    op = registry.get("sparse_decode_attention")
    problem = AttentionProblem(3, 9, 4, 4, swa=True, sink=data.draw(st.booleans(), label="sink"))
    inputs = op.make_inputs(problem, "cpu", data.draw(st.integers(0, 99), label="seed"))
    drawn, fixed = {}, {}
    for cache, index in (("kv_cache", "indices"), ("swa_cache", "swa_indices")):
        slots = inputs[cache].shape[0] * inputs[cache].shape[1]
        drawn[cache] = fixed[cache] = fenced(inputs[cache])
        drawn[index] = index_tensor(data, tuple(inputs[index].shape), -1, slots - 1, index)
        fixed[index] = _slots_or_padding(drawn[index], slots)
    return {**inputs, **drawn}, {**inputs, **fixed}, None


def window_case(data):
    """The window by position with drawn sequence ids, positions, block-table entries and lower bounds (any int32);
    its in-range equivalent: the same keys as an index list (reference.window_slots, out-of-cache slots padding)."""
    op = registry.get("sparse_decode_attention")
    problem = AttentionProblem(3, 9, 4, 4, swa=True, sink=True, window_by_position=True)
    inputs = op.make_inputs(problem, "cpu", data.draw(st.integers(0, 99), label="seed"))
    cache, table = fenced(inputs["swa_cache"]), inputs["swa_block_table"]
    pages, block_size = cache.shape[:2]
    drawn = dict(swa_cache=cache, seq_ids=index_tensor(data, (3,), 0, table.shape[0] - 1, "seq_ids"),
                 positions=index_tensor(data, (3,), 0, table.shape[1] * block_size - 1, "positions"),
                 swa_block_table=index_tensor(data, tuple(table.shape), -1, pages - 1, "swa_block_table"),
                 swa_lower=data.draw(st.none() | st.builds(lambda *v: torch.tensor(v, dtype=torch.int32),
                                                           *[int32s(0, 40)] * table.shape[0]), label="swa_lower"))
    slots = ref.window_slots(drawn["positions"], drawn["seq_ids"], drawn["swa_block_table"], block_size,
                             problem.window, drawn["swa_lower"])
    fixed = dict(swa_cache=cache, swa_indices=_slots_or_padding(slots, pages * block_size).int(),
                 **dict.fromkeys(WINDOW_BY_POSITION))
    return {**inputs, **drawn}, {**inputs, **fixed}, None


def insert_case(data):
    """Distinct valid slots (a repeated one is the caller's error) among -1 and out-of-range values."""
    op = registry.get("kv_cache_insert")
    inputs = op.make_inputs(CodecProblem(6, data.draw(st.sampled_from(["fp4", "mxfp8"]), label="format")), "cpu",
                            data.draw(st.integers(0, 99), label="seed"))
    slots = inputs["cache"].shape[0] * inputs["cache"].shape[1]
    valid = data.draw(st.lists(st.integers(0, slots - 1), unique=True, max_size=6), label="valid slots")
    others = data.draw(st.lists(st.one_of(st.just(-1), outside(-1, slots - 1)), min_size=6 - len(valid),
                                max_size=6 - len(valid)), label="other slots")
    drawn = torch.tensor(data.draw(st.permutations(valid + others), label="slots"), dtype=torch.int32)
    cache = fenced(inputs["cache"])
    return {**inputs, "cache": cache, "slots": drawn}, \
        {**inputs, "cache": cache.clone(), "slots": _slots_or_padding(drawn, slots)}, None


CASES = {"mqa_logits": mqa_case, "sparse_mqa_logits": sparse_case, "paged_mqa_logits": paged_case,
         "topk_indices": topk_case, "candidate_blocks": candidate_case, "sparse_decode_attention": attention_case,
         "sparse_decode_attention window": window_case, "kv_cache_insert": insert_case}
EXACT = ("topk_indices", "candidate_blocks")  # exact values: every backend follows the reference's tie rule
# index-addressed tensors: cut from garbage-filled buffers (0 in int tables: valid ids, wrong rows)
GUARDED = ("k", "k_scale", "k_cache", "logits", "block_table")


def _same_bits(a, b) -> bool:
    """Whether two results (tensors or tuples of them) have the same bit patterns (so that NaN equals NaN)."""
    if isinstance(a, tuple):
        return all(_same_bits(x, y) for x, y in zip(a, b, strict=True))
    return a.dtype == b.dtype and torch.equal(a.cpu().view(torch.uint8), b.cpu().view(torch.uint8))


def _guarded(inputs: dict) -> dict:
    return {name: layout(value, "padded") if name in GUARDED and isinstance(value, torch.Tensor) else value
            for name, value in inputs.items()}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(CASES))
@fraction_of_examples(1 / 2)
@given(data=st.data())
def test_out_of_range_indices_are_padding(name, backend, data):
    op = registry.get(name.split()[0])
    drawn, in_range, fixup = CASES[name](data)
    op.check_values(in_range, op.check(dict(in_range)))  # the equivalent is in range
    expected = op.reference(**in_range) if fixup is None else fixup(op.reference(**in_range))
    drawn = _guarded(on_device(drawn))
    with checks.checked(False):
        actual = op.result_of(drawn, backend=backend)
    if backend == "reference":
        assert _same_bits(actual, expected), "the reference breaks its out-of-range rules"
        return
    op.compare(drawn, expected if op.mutates else op.reference(**drawn), actual)
    if name in EXACT:
        assert torch.equal(actual.cpu(), expected), "a selection differs from the reference's tie rule"


# ---------------------------------------------------------------- checked mode names every bad index argument


def _bad(inputs: dict, name: str, at: tuple, value: int) -> dict:
    changed = inputs[name].clone()
    changed[at] = value
    return {**inputs, name: changed}


def _bad_index_arguments():
    """(operator, problem, argument, index, bad value): each one out of range by the checks' rules."""
    paged = PagedProblem(2, 3, 2, 16)  # width 48, 9 cache blocks; sequence 0 sees all 3 of its table entries
    by_position = AttentionProblem(2, 5, 3, 4, swa=True, window_by_position=True)
    return [
        ("mqa_logits", LogitsProblem(3, 40), "ks", (1,), -1),
        ("mqa_logits", LogitsProblem(3, 40), "ke", (1,), 41),
        ("mqa_logits", LogitsProblem(3, 40), "ke", (2,), INT32_MIN),  # below ks
        ("paged_mqa_logits", paged, "context_lens", (0,), 49),
        ("paged_mqa_logits", paged, "context_lens", (1,), -5),
        ("paged_mqa_logits", paged, "block_table", (0, 1), 9),
        ("paged_mqa_logits", paged, "block_table", (0, 2), -1),
        ("topk_indices", TopkProblem(3, 50, 8, has_starts=True), "ends", (0,), 51),
        ("topk_indices", TopkProblem(3, 50, 8, has_starts=True), "ends", (1,), INT32_MIN),
        ("topk_indices", TopkProblem(3, 50, 8, has_starts=True), "starts", (2,), -3),
        ("topk_indices", TopkProblem(3, 50, 8, has_starts=True), "starts", (0,), INT32_MAX),  # above ends
        ("candidate_blocks", CandidateProblem(3, 50, 4, 8), "row_end", (0,), 51),
        ("candidate_blocks", CandidateProblem(3, 50, 4, 8), "row_end", (1,), -1),
        ("sparse_mqa_logits", SparseProblem(3, 40, 4, 8, 8), "blocks", (2, 0), 5),  # ceil(40 / 8) = 5 blocks
        ("sparse_mqa_logits", SparseProblem(3, 40, 4, 8, 8), "blocks", (2, 1), -2),
        ("sparse_mqa_logits", SparseProblem(3, 40, 4, 8, 8), "ke", (0,), INT32_MAX),
        ("sparse_decode_attention", AttentionProblem(2, 5, 3, 4, swa=True), "indices", (1, 4), 2048),  # 2048 slots
        ("sparse_decode_attention", AttentionProblem(2, 5, 3, 4, swa=True), "swa_indices", (0, 2), -2),
        ("sparse_decode_attention", by_position, "seq_ids", (1,), 2),  # two sequences
        ("sparse_decode_attention", by_position, "positions", (0,), -1),
        ("sparse_decode_attention", by_position, "positions", (1,), 1 << 20),  # past the table's pages
        ("sparse_decode_attention", by_position, "swa_block_table", (0, 3), INT32_MAX),
        ("kv_cache_insert", CodecProblem(5), "slots", (3,), INT32_MIN),
    ]


@pytest.mark.parametrize("name, problem, arg, at, value", _bad_index_arguments(),
                         ids=[f"{n}-{a}={v}" for n, _, a, _, v in _bad_index_arguments()])
def test_checked_mode_names_bad_index_arguments(monkeypatch, name, problem, arg, at, value):
    """Checked mode refuses the value before any kernel runs, naming the argument and the entry; outside it the same
    call runs (the default path reads no tensor values)."""
    op = registry.get(name)
    inputs = _bad(op.make_inputs(problem, DEVICE, seed=0), arg, at, value)
    with checks.checked(False):
        op.entry(**inputs, backend="triton")
    for impl in op.implementations:
        monkeypatch.setattr(type(impl.kernel), "run", lambda *a: pytest.fail("a kernel ran despite a bad index"))
    with checks.checked(True), pytest.raises(ValueError, match=rf"^{arg}\[{', '.join(map(str, at))}\] = {value} "):
        op.entry(**inputs, backend="triton")
