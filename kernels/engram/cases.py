"""Engram input strategies: what the equivalence tests (tests/test_engram.py) and `flashkern check` draw.

hash_cases: runs of 0-12 tokens (now and then 100-300) of sequence ids 0 .. 5 (a sequence may come back in a later
run), token ids with the extremes (0, the largest, one that maps to the pad id); a history of one row per sequence
(some ids missing: -1) or none; the hash of the
model's layer 1 or 14 (primes from 16M, multipliers near 2^63 / V') or of a small config (primes from 1000, 50
compressed ids); n-gram shapes max_ngram 2-5 x heads 1, 3, 8; int32 or int64 token and sequence ids.

lookup_cases: tables of 1-4099 rows with every e4m3 code (NaN codes too) and scale bytes in a drawn mode (the usual
100-149; the extremes 0, 1, 127, 254 and the NaN byte 255), row ids [T, L] (T 0-40, L 1-24) with the table's first
and last rows among them; int32 or int64 ids.
(Ids outside the token map, the history or the table are index errors in checked mode: tests/test_engram.py holds
the kernels to their documented results for them, outside checked mode.)

gate_cases: T 1-24 or 25-200 tokens, streams 1, 2, 4 or 8, D with odd tails (1, 7, 37, 100, 256, 576, 1000; now and
then 4096 or 7168 at a few tokens), in a value mode: normal; zero keys (dot = 0: the clamp, g = 1/2); tiny dots
(k orthogonal to h: the clamp's edge, either sign); huge magnitudes (squares near 1e30: their sums stay finite in
fp32); a large eps; a row holding NaN or inf, which must stay in its (token, stream).

Narrow runs (the `ci` profile, kernels/cases.py) draw the specializations from the presets and a short pool.
Tensors are on the CPU (callers move them); each case is described with hypothesis.note.
"""

from __future__ import annotations

import torch
from hypothesis import note
from hypothesis import strategies as st

from flashkern.kernels.cases import narrow, preset_pool, seeded, specialization
from flashkern.reference import engram as ref

SMALL = ref.EngramConfig(vocab_size=1000, compressed_vocab=50)
SMALL_VOCABULARY = 300
IDS = (torch.int32, torch.int64)


@st.composite
def hash_cases(draw):
    every = st.tuples(st.integers(2, 5), st.sampled_from([1, 3, 8]), st.booleans(), st.sampled_from(IDS),
                      st.sampled_from(IDS))
    max_ngram, heads, has_history, token_dtype, seq_dtype = specialization(draw, every, lambda: [
        *preset_pool("engram_hash", lambda p: (p.max_ngram, p.heads, p.history, torch.int64, torch.int64))(),
        (4, 8, True, torch.int32, torch.int32)])
    from flashkern.kernels.engram import model_params  # the records import this module

    if draw(st.booleans(), label="model's hash"):
        params = model_params(max_ngram, heads, layer=draw(st.sampled_from([1, 14])))
    else:
        config = ref.EngramConfig(max_ngram=max_ngram, heads=heads, vocab_size=SMALL.vocab_size,
                                  compressed_vocab=SMALL.compressed_vocab)
        token_map = ref.synthetic_token_map(SMALL_VOCABULARY, SMALL.compressed_vocab, seed=draw(st.integers(0, 3)))
        params = ref.engram_params(draw(st.sampled_from(config.layer_ids)), token_map, config)
    vocabulary = params.token_map.shape[0]
    pad_token = int((params.token_map == params.pad_id).nonzero()[0])
    token = st.one_of(st.integers(0, vocabulary - 1), st.sampled_from([0, vocabulary - 1, pad_token]))
    long_run = st.integers(100, 300) if not narrow() else st.integers(100, 140)
    runs = draw(st.lists(st.tuples(st.integers(0, 5), st.one_of(st.integers(0, 12), long_run)), min_size=1,
                         max_size=4))
    seq_ids = torch.tensor([s for s, n in runs for _ in range(n)], dtype=seq_dtype)
    token_ids = torch.tensor(draw(st.lists(token, min_size=len(seq_ids), max_size=len(seq_ids))), dtype=token_dtype)
    history = None
    if has_history:
        lookback = max_ngram - 1
        known = [draw(st.integers(0, lookback)) for _ in range(6)]
        history = torch.tensor([v for n in known for v in [-1] * (lookback - n) + draw(st.lists(token, min_size=n,
                                                                                                  max_size=n))],
                               dtype=torch.int64).view(-1, lookback)
    note(f"tokens={len(seq_ids)} runs={runs} max_ngram={max_ngram} heads={heads} layer={params.layer} "
         f"history={None if history is None else history.shape[0]} ids {token_dtype} / {seq_dtype}")
    return dict(token_ids=token_ids, seq_ids=seq_ids, **params.hash_inputs(), history=history)


SCALE_MODES = ("usual", "extremes")


@st.composite
def lookup_cases(draw):
    dtype = specialization(draw, st.sampled_from(IDS), lambda: [torch.int64, torch.int32])
    gen = seeded(draw)
    table_rows = draw(st.sampled_from([1, 2, 37, 300, 4099]))
    table = torch.randint(0, 256, (table_rows, ref.ROW_BYTES), dtype=torch.uint8, generator=gen)
    mode = draw(st.sampled_from(SCALE_MODES))
    scales = torch.randint(100, 150, (table_rows, ref.ROW_BYTES - ref.ROW_VALUES), dtype=torch.uint8, generator=gen)
    if mode == "extremes":
        extremes = torch.tensor([0, 1, 127, 254, 255], dtype=torch.uint8)
        scales = extremes[torch.randint(0, 5, scales.shape, generator=gen)]
    table[:, ref.ROW_VALUES:] = scales
    tokens, lookups = draw(st.integers(0, 40)), draw(st.sampled_from([1, 5, 24]))
    rows = torch.randint(0, table_rows, (tokens, lookups), generator=gen)
    ends = torch.rand(tokens, lookups, generator=gen) < 0.1
    rows = torch.where(ends, (table_rows - 1) * torch.randint(0, 2, rows.shape, generator=gen), rows)
    note(f"table rows={table_rows} scales={mode} rows [{tokens}, {lookups}] {dtype}")
    return dict(table=table, rows=rows.to(dtype))


ODD_HIDDEN = (1, 7, 37, 100, 256, 576, 1000)
GATE_MODES = ("normal", "zero_keys", "tiny_dots", "huge", "large_eps", "nonfinite_row")


@st.composite
def gate_cases(draw):
    streams = specialization(draw, st.sampled_from([1, 2, 4, 8]),
                             lambda: [*preset_pool("engram_gate", lambda p: p.streams)(), 1])
    tokens = draw(st.integers(1, 24)) if draw(st.integers(0, 2)) else draw(st.integers(25, 200))
    hidden = draw(st.sampled_from(ODD_HIDDEN))
    if draw(st.integers(0, 9)) == 0:  # now and then a model width at a few tokens
        tokens, hidden = draw(st.integers(1, 3)), draw(st.sampled_from([4096, 7168]))
    gen = seeded(draw)
    h, k = (torch.randn(tokens, streams, hidden, generator=gen) for _ in range(2))
    v = torch.randn(tokens, hidden, generator=gen)
    q_w, k_w = (1 + 0.1 * torch.randn(hidden, generator=gen) for _ in range(2))
    eps, mode = 1e-6, draw(st.sampled_from(GATE_MODES))
    if mode == "zero_keys":
        k[torch.rand(tokens, streams, generator=gen) < 0.5] = 0
    elif mode == "tiny_dots":  # k = h's weighted direction removed from a random key: dots of rounding size
        hq = h * q_w * k_w
        k -= (k * hq).sum(-1, keepdim=True) / (hq * hq).sum(-1, keepdim=True).clamp(min=1e-30) * hq
    elif mode == "huge":  # squares and products near 1e30, their sums of D terms still finite in fp32
        h, k, v = h * 1e15, k * 1e15, v * 3e3
    elif mode == "large_eps":
        eps = 0.5
    elif mode == "nonfinite_row":
        h[int(torch.randint(0, tokens, (1,), generator=gen)), 0, 0] = float("nan" if tokens % 2 else "inf")
    note(f"tokens={tokens} streams={streams} hidden={hidden} mode={mode}")
    return dict(h=h.bfloat16(), k=k.bfloat16(), v=v.bfloat16(), q_w=q_w.bfloat16(), k_w=k_w.bfloat16(), eps=eps)
