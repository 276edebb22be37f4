"""Bounded replay (flashkern.replay) and the window attention by position that runs it (docs/operators.md 8.4).

plan_replay is checked over every hit, window and new-token count in small ranges and by hypothesis beyond; the
kernel-level replay rebuilds the window rows [H - 128, H) of a window cache whose every row below H - 128 is a NaN
record, runs the chunk's attention with the bound, and compares with attention computed from the kept rows alone.
"""

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from _device import DEVICE, on_device
from flashkern import registry
from flashkern.kernels.kv_cache import WINDOW_BY_POSITION, window_indices
from flashkern.kernels.kv_cache.problem import paged, window_table
from flashkern.reference import kv_cache as ref
from flashkern.replay import plan_replay

BACKENDS = ("reference", "triton", "tilelang")
ATTENTION = registry.get("sparse_decode_attention")
INSERT = registry.get("kv_cache_insert")


def _check_plan(hit: int, new: int, window: int, enabled: bool) -> None:
    plan = plan_replay(hit, new, window, enabled)
    assert plan.adopted == (enabled and hit > window)
    start = hit - window if plan.adopted else 0
    assert plan.replay_start == plan.lower == start
    assert plan.recompute == range(start, hit + new) and plan.replayed == range(start, hit)
    assert len(plan.replayed) == (window if plan.adopted else hit)  # never more than the window is replayed


def test_replay_plans_for_every_small_hit_window_and_new_token_count():
    for hit, new, window, enabled in itertools.product(range(0, 140), (0, 1, 7), (1, 2, 5, 64, 128), (True, False)):
        _check_plan(hit, new, window, enabled)


@given(hit=st.integers(0, 2**40), new=st.integers(0, 2**20), window=st.integers(1, 2**16), enabled=st.booleans())
def test_replay_plans_for_any_sizes(hit, new, window, enabled):
    _check_plan(hit, new, window, enabled)


def test_replay_plan_at_the_window_edge():
    assert not plan_replay(128, 5).adopted and plan_replay(128, 5).recompute == range(0, 133)
    assert plan_replay(129, 5).recompute == range(1, 134) and plan_replay(129, 5).lower == 1
    assert plan_replay(100_000, 1, enabled=False).recompute == range(0, 100_001)


@pytest.mark.parametrize("args, message", [((-1, 0), "^hit=-1 must be at least 0"),
                                           ((5, -2), "^new_tokens=-2 must be at least 0"),
                                           ((5, 0, 0), "^window=0 must be at least 1")])
def test_bad_replay_arguments_are_named(args, message):
    with pytest.raises(ValueError, match=message):
        plan_replay(*args)


# ---------------------------------------------------------------- the window by position


def test_window_slots_follow_positions_pages_and_bounds():
    """Sequence 0 (pages 2, 0 of 4 slots), sequence 1 (page 1, then none): window 3."""
    table = torch.tensor([[2, 0], [1, -1]], dtype=torch.int32)
    positions = torch.tensor([0, 5, 4, 1, 3], dtype=torch.int32)
    seq_ids = torch.tensor([0, 0, 1, 1, 7], dtype=torch.int32)  # 7: no such sequence
    slots = ref.window_slots(positions, seq_ids, table, 4, 3, torch.tensor([0, 1], dtype=torch.int32))
    assert slots.tolist() == [[-1, -1, 8],  # the first position sees itself only
                              [11, 0, 1],  # across pages: positions 3 (page 2), 4, 5 (page 0)
                              [6, 7, -1],  # positions 2, 3 on page 1; 4 on sequence 1's missing page
                              [-1, -1, 5],  # position 0 is below sequence 1's bound
                              [-1, -1, -1]]


@pytest.mark.parametrize("backend", ("triton", "tilelang"))
@given(data=st.data())
def test_window_by_position_equals_its_index_list(backend, data):
    """The same keys by position and as the index list window_slots gives: the same kernel result, bit for bit."""
    inputs = data.draw(ATTENTION.cases().filter(lambda i: i["swa_block_table"] is not None).map(on_device))
    listed = {**inputs, "swa_indices": window_indices(inputs).int(),
              **dict.fromkeys(WINDOW_BY_POSITION)}
    by_position, by_list = (ATTENTION.entry(**i, backend=backend) for i in (inputs, listed))
    assert all(torch.equal(a, b) for a, b in zip(_bits(by_position), _bits(by_list)))  # bit for bit (NaN included)


def _bits(result) -> list[torch.Tensor]:
    return [t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32) for t in result]


def _shared_window_case(gen: torch.Generator) -> dict:
    """A prefill-like call of 3 sequences whose tokens interleave: sequence 0 a chunk of 40 consecutive positions
    from 30 (its first window keys before the chunk), sequence 1 positions 5 .. 24 with a gap at 15 (tokens whose
    window misses a key in the call), sequence 2 one token; window 9, a lower bound on sequence 0; pages of 4 in any
    order, one missing."""
    positions = [list(range(30, 70)), [*range(5, 15), *range(16, 25)], [3]]
    order = torch.randperm(sum(map(len, positions)), generator=gen)
    seq_ids = torch.cat([torch.full((len(p),), s) for s, p in enumerate(positions)])[order].int()
    position = torch.cat([torch.tensor(p) for p in positions])[order].int()
    # tokens of one sequence keep their order (consecutive in the call except where another sequence interleaves)
    for s in range(3):
        at = (seq_ids == s).nonzero().flatten()
        position[at] = position[at].sort().values
    problem = ATTENTION.presets["smoke"][0]
    inputs = ATTENTION.make_inputs(type(problem)(position.numel(), 16, 9, 16, swa=True, sink=True,
                                                 window_by_position=True), "cpu", seed=3)
    table, blocks = window_table(gen, [0, 0, 0], [69, 24, 3], 4, spare=3)
    table[1, 2] = -1  # sequence 1 loses positions 8 .. 11
    cache = paged(ref.quantize_kv(torch.randn(blocks * 4, ref.LATENT, generator=gen).bfloat16(), "mxfp8"), 4)
    return {**inputs, "swa_cache": cache, "swa_block_table": table, "positions": position, "seq_ids": seq_ids,
            "window": 9, "swa_lower": torch.tensor([33, 0, 0], dtype=torch.int32)}


def test_shared_window_reads_the_same_keys_as_each_token_decoding_its_own():
    """TileLang's shared window (each token's own window record decoded once for the call, the held keys read from
    those rows) gives the per-token decode's result bit for bit: a directed call with interleaved sequences, a gap,
    keys before the chunk, a lower bound and a missing page; then drawn cases."""
    inputs = on_device(_shared_window_case(torch.Generator().manual_seed(0)))
    tilelang = ATTENTION.implementation("tilelang")
    problem = ATTENTION.check(dict(inputs))
    default = tilelang.default_config(problem)
    shared, each = (ATTENTION.result_of(inputs, backend="tilelang", config={**default, "shared_window": on})
                    for on in (1, 0))
    assert all(torch.equal(a, b) for a, b in zip(_bits(shared), _bits(each)))
    ATTENTION.compare(inputs, ATTENTION.reference(**inputs), shared)


@given(data=st.data())
def test_shared_window_equals_the_per_token_decode_on_drawn_cases(data):
    inputs = data.draw(ATTENTION.cases().filter(lambda i: i["swa_block_table"] is not None).map(on_device))
    problem = ATTENTION.check(dict(inputs))
    default = ATTENTION.implementation("tilelang").default_config(problem)
    shared, each = (ATTENTION.result_of(inputs, backend="tilelang", config={**default, "shared_window": on})
                    for on in (1, 0))
    assert all(torch.equal(a, b) for a, b in zip(_bits(shared), _bits(each)))


def _prefix(hit: int, new: int, heads: int, block_size: int, gen: torch.Generator) -> dict:
    """One sequence's state after a prefix-cache hit of `hit` tokens: latent rows of every position (what the model
    computes), its compressed FP4 cache (kept by the prefix cache for all `hit` positions and written for the new
    ones), a window cache whose every row holds a NaN record (nothing was kept), and each position's top-k."""
    total = hit + new
    latent = torch.randn(total, ref.LATENT, generator=gen).bfloat16()
    table, pages = window_table(gen, [0], [total - 1], block_size, spare=3)
    topk = torch.stack([torch.randint(0, p + 1, (12,), generator=gen) for p in range(total)]).int()
    q = torch.randn(total, heads, ref.LATENT, generator=gen).bfloat16()
    return dict(latent=latent, table=table, topk=topk, q=q,
                kv_cache=paged(ref.quantize_kv(latent, "fp4"), block_size),
                swa_cache=torch.full((pages, block_size, 528), 0xFF, dtype=torch.uint8))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("hit, new, block_size", [(129, 1, 64), (200, 40, 3)])  # the first hit adopted
def test_bounded_replay_reads_no_window_row_below_its_bound(backend, hit, new, block_size):
    """Replay at kernel level: the window rows [hit - 128, hit + new) written by kv_cache_insert, then the chunk's
    attention by position with swa_lower = hit - 128. Every row below the bound holds a NaN record: the outputs are
    finite and equal attention over the kept rows only (a window cache holding just them, as an index list), and
    the replayed rows differ from a cold run (whose windows reach below the bound)."""
    gen = torch.Generator().manual_seed(hit)
    plan = plan_replay(hit, new)
    state = on_device(_prefix(hit, new, 8, block_size, gen))
    chunk = torch.arange(plan.recompute.start, plan.recompute.stop, device=DEVICE)
    table_row = state["table"][0].long()
    slots = (table_row[chunk // block_size] * block_size + chunk % block_size).int()
    INSERT.entry(state["swa_cache"], slots, state["latent"][chunk], "mxfp8", backend=backend)
    inputs = dict(q=state["q"][chunk], kv_cache=state["kv_cache"], indices=state["topk"][chunk],
                  swa_cache=state["swa_cache"], swa_block_table=state["table"], positions=chunk.int(),
                  seq_ids=torch.zeros_like(chunk).int(), swa_lower=torch.tensor([plan.lower], device=DEVICE).int(),
                  swa_indices=None, window=None, sink=None, scale=None, kv_format="fp4", swa_format="mxfp8")
    result = ATTENTION.entry(**inputs, backend=backend)
    assert torch.isfinite(result.out.float()).all() and torch.isfinite(result.lse).all()

    kept = paged(ref.quantize_kv(state["latent"][chunk], "mxfp8"), block_size)  # row i: position chunk[i]
    first = (chunk[:, None] - 127 + torch.arange(128, device=DEVICE)[None, :]) - plan.lower
    alone = {**inputs, "swa_cache": kept, "swa_indices": torch.where(first >= 0, first, -1).int(),
             **dict.fromkeys(WINDOW_BY_POSITION)}
    ATTENTION.compare(alone, ATTENTION.reference(**alone), result)

    cold_cache = state["swa_cache"].clone()
    everything = torch.arange(hit + new, device=DEVICE)
    INSERT.entry(cold_cache, (table_row[everything // block_size] * block_size + everything % block_size).int(),
                 state["latent"], "mxfp8", backend="reference")
    cold = ATTENTION.reference(**{**inputs, "swa_cache": cold_cache, "swa_lower": None})
    assert not torch.equal(cold.lse[0], result.lse[0])  # the first replayed row sees itself only


@pytest.mark.parametrize("backend", BACKENDS)
def test_window_by_position_is_close_to_unquantized_attention(backend):
    """Against attention on the unquantized bf16 latents, cosine similarity > 0.99 (FlashMLA's check), with the
    window by position: one sequence of 300 positions in shuffled pages of 16, tokens at the sequence's start,
    middle and end (5, 150 and 299: windows of 6, 128 and 128 keys)."""
    gen = torch.Generator().manual_seed(11)
    heads, topk, total = 16, 48, 300
    latent = torch.randn(total, ref.LATENT, generator=gen).bfloat16()
    positions = torch.tensor([5, 150, 299])
    picks = [torch.randperm(int(p) + 1, generator=gen)[:topk] for p in positions]  # the first token: 6, padded
    indices = torch.stack([torch.cat((pick, torch.full((topk - len(pick),), -1))) for pick in picks]).int()
    table, pages = window_table(gen, [0], [total - 1], 16, spare=2)
    rows = torch.zeros(pages * 16, ref.LATENT).bfloat16()
    everything = torch.arange(total)
    rows[table[0].long()[everything // 16] * 16 + everything % 16] = latent
    q = torch.randn(len(positions), heads, ref.LATENT, generator=gen).bfloat16()
    window = [torch.arange(max(int(p) - 127, 0), int(p) + 1) for p in positions]
    exact = torch.stack([torch.einsum("hn,nd->hd", torch.softmax(
        torch.einsum("hd,nd->hn", q[t].float(), keys.float()) * ref.LATENT**-0.5, dim=-1), keys.float())
        for t, keys in enumerate(torch.cat((latent[picks[t]], latent[window[t]])) for t in range(3))])
    inputs = on_device(dict(q=q, kv_cache=paged(ref.quantize_kv(latent, "fp4"), 16), indices=indices,
                            swa_cache=paged(ref.quantize_kv(rows, "mxfp8"), 16), swa_block_table=table,
                            positions=positions.int(), seq_ids=torch.zeros(3, dtype=torch.int32)))
    out = ATTENTION.entry(**inputs, backend=backend).out.cpu().float()
    cosine = torch.nn.functional.cosine_similarity(out.flatten(), exact.flatten(), dim=0)
    assert cosine > 0.99, cosine
