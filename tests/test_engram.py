"""Engram's reference (reference/engram.py): the hash against the model's published constants and an independent
per-token computation in Python integers, the lookup's dequantization, the gate against a float64 formula."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from flashkern.reference import engram as ref

CONFIG = ref.EngramConfig()
SMALL = ref.EngramConfig(layer_ids=(1, 14), max_ngram=4, heads=8, vocab_size=1000, compressed_vocab=50, pad_id=2)
VOCABULARY = 300  # tokens of the synthetic map (SMALL: 50 compressed ids)


def test_the_models_tables_and_multipliers():
    """V4.1-Flash's config: engram_num_embeddings [384006168, 384016682], and the multipliers that DeepSeek's
    engram.py draws for a compressed vocabulary of 99,092 (published with the model's serving ports)."""
    token_map = torch.zeros(1, dtype=torch.int64)
    first, second = (ref.engram_params(layer, token_map) for layer in CONFIG.layer_ids)
    assert (first.rows, second.rows) == (384_006_168, 384_016_682)
    assert first.multipliers.tolist() == [76632096046245, 4839876093313, 35959672319349, 73987337458391]
    assert second.multipliers.tolist() == [67716810739261, 51510806800915, 30921347202721, 82619226485591]
    primes = torch.cat((first.primes.flatten(), second.primes.flatten())).tolist()
    assert primes == sorted(set(primes)) and primes[0] > CONFIG.vocab_size - 1  # distinct, ascending, from 16M
    assert all(ref.is_prime(p) for p in primes)
    assert not any(ref.is_prime(n) for n in range(CONFIG.vocab_size - 1, primes[-1]) if n not in primes)  # the next
    for params in (first, second):  # each layer's tables end to end
        assert params.offsets.flatten().tolist() == [0, *np.cumsum(params.primes.flatten().tolist())[:-1].tolist()]
    assert (first.multipliers % 2 == 1).all()


def test_primality():
    small = [n for n in range(2, 200) if all(n % d for d in range(2, n))]
    assert [n for n in range(200) if ref.is_prime(n)] == small
    assert ref.is_prime(2**61 - 1) and not ref.is_prime(2**61 + 1) and not ref.is_prime(3215031751)  # a pseudoprime


def test_a_layer_outside_the_config_is_refused():
    with pytest.raises(ValueError, match="layer 2 is not an Engram layer"):
        ref.engram_params(2, torch.zeros(1, dtype=torch.int64))


def _expected_rows(token_ids, seq_ids, params, history):
    """Per token, in Python integers: the previous tokens of its sequence in the call, then its history, then the
    pad id; XOR of products, remainder, offset."""
    token_map = params.token_map.tolist()
    mult = params.multipliers.tolist()
    out = []
    for t, (token, seq) in enumerate(zip(token_ids.tolist(), seq_ids.tolist())):
        earlier = [token_map[x] for x, s in zip(token_ids[:t].tolist(), seq_ids[:t].tolist()) if s == seq]
        before = [] if history is None else [token_map[x] for x in history[seq].tolist() if x >= 0]
        ids = before + earlier + [token_map[token]]
        row, h = [], 0
        for k in range(params.max_ngram):
            h ^= (ids[-1 - k] if k < len(ids) else params.pad_id) * mult[k]
            assert 0 <= h < 2**63  # never wraps: each product is below INT64_MAX
            if k >= 1:
                row += [h % p + o for p, o in zip(params.primes[k - 1].tolist(), params.offsets[k - 1].tolist())]
        out.append(row)
    return torch.tensor(out, dtype=torch.int64).view(-1, params.primes.numel())


@st.composite
def hash_cases(draw):
    """Up to 3 interleaved sequences of 0-12 tokens: ids drawn with the extremes (0, the largest, a token mapping to
    the pad id), each sequence with a history (some of it missing) or none."""
    token_map = ref.synthetic_token_map(VOCABULARY, SMALL.compressed_vocab, seed=draw(st.integers(0, 3)))
    pad_token = int((token_map == SMALL.pad_id).nonzero()[0])
    token = st.one_of(st.integers(0, VOCABULARY - 1), st.sampled_from([0, VOCABULARY - 1, pad_token]))
    lengths = draw(st.lists(st.integers(0, 12), min_size=1, max_size=3))
    order = draw(st.permutations([s for s, n in enumerate(lengths) for _ in range(n)]))
    token_ids = torch.tensor(draw(st.lists(token, min_size=len(order), max_size=len(order))), dtype=torch.int64)
    history = None
    if draw(st.booleans()):  # per sequence 0-3 known ids before the call, -1 before them (where it starts)
        known = [draw(st.integers(0, 3)) for _ in lengths]
        history = torch.tensor([[-1] * (3 - n) + draw(st.lists(token, min_size=n, max_size=n)) for n in known],
                               dtype=torch.int64)
    params = ref.engram_params(draw(st.sampled_from(SMALL.layer_ids)), token_map, SMALL)
    return token_ids, torch.tensor(order, dtype=torch.int64).view(-1), params, history


@given(hash_cases())
def test_hash_equals_a_per_token_computation(case):
    token_ids, seq_ids, params, history = case
    rows = ref.engram_hash(token_ids, seq_ids, params, history)
    assert torch.equal(rows, _expected_rows(token_ids, seq_ids, params, history))
    first = params.offsets.flatten()
    assert ((rows >= first) & (rows < first + params.primes.flatten())).all()  # each head inside its own table


def test_hashing_in_chunks_with_history_equals_one_call():
    """A prefill split into a chunk and decode steps, each given the last three ids before it: the same rows."""
    params = ref.engram_params(14, ref.synthetic_token_map(VOCABULARY, SMALL.compressed_vocab), SMALL)
    tokens = torch.randint(0, VOCABULARY, (11,), generator=torch.Generator().manual_seed(1))
    whole = ref.engram_hash(tokens, torch.zeros(11, dtype=torch.int64), params)
    pieces, done = [], 0
    for size in (6, 1, 1, 3):
        history = torch.full((1, 3), -1, dtype=torch.int64)
        kept = tokens[max(done - 3, 0): done]
        history[0, 3 - kept.numel():] = kept
        pieces.append(ref.engram_hash(tokens[done: done + size], torch.zeros(size, dtype=torch.int64), params,
                                      history))
        done += size
    assert torch.equal(torch.cat(pieces), whole)


def _table(rows: int, gen: torch.Generator) -> torch.Tensor:
    table = torch.randint(0, 256, (rows, ref.ROW_BYTES), dtype=torch.uint8, generator=gen)
    table[:, ref.ROW_VALUES:] = torch.randint(100, 150, (rows, ref.ROW_BYTES - ref.ROW_VALUES), generator=gen)
    return table


def test_lookup_dequantizes_exactly_and_reads_nothing_outside_the_table():
    gen = torch.Generator().manual_seed(2)
    table = _table(40, gen)
    table[0, ref.ROW_VALUES] = 0xFF  # a NaN scale: its 32 values are NaN
    rows = torch.tensor([[0, 39, 7], [-1, 40, 2**62]])
    got = ref.engram_lookup(table, rows)
    assert got.shape == (2, 3, 256) and got.dtype == torch.bfloat16
    for (i, j), row in np.ndenumerate(rows.numpy()):
        if not 0 <= row < 40:
            assert (got[i, j] == 0).all()
            continue
        codes = table[row, :256].view(torch.float8_e4m3fn).double()
        scales = 2.0 ** (table[row, 256:].double() - 127)
        expected = torch.where(table[row, 256:].repeat_interleave(32) == 0xFF, torch.nan,
                               codes * scales.repeat_interleave(32))
        torch.testing.assert_close(got[i, j].double(), expected, rtol=0, atol=0, equal_nan=True)


def _gate_f64(h, k, v, q_w, k_w, eps):
    h, k, v, q_w, k_w = (x.double() for x in (h, k, v, q_w, k_w))
    norm = lambda x: x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)  # noqa: E731
    dot = (norm(h) * q_w * norm(k) * k_w).sum(-1) / h.shape[-1] ** 0.5
    gate = torch.sigmoid(torch.sign(dot) * torch.sqrt(torch.clamp(dot.abs(), min=1e-6)))
    return h + gate[..., None] * v[:, None, :], gate


@pytest.mark.parametrize("tokens, hidden", [(5, 576), (33, 7168), (1, 1024)])
def test_gate_against_float64(tokens, hidden):
    gen = torch.Generator().manual_seed(tokens)
    h, k = (torch.randn(tokens, 4, hidden, generator=gen).bfloat16() for _ in range(2))
    v = torch.randn(tokens, hidden, generator=gen).bfloat16()
    q_w, k_w = (1 + 0.1 * torch.randn(hidden, generator=gen) for _ in range(2))
    expected, _ = _gate_f64(h, k, v, q_w, k_w, 1e-6)
    got = ref.engram_gate(h, k, v, q_w, k_w, 1e-6)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), expected, rtol=2**-8, atol=1e-6)


def test_gate_clamps_the_dot_before_the_root():
    """dot = 0 (a zero weight): g = sigmoid(0) = 1/2 exactly; a tiny dot gives sigmoid(+-1e-3), the clamp's root;
    a negative dot a gate below 1/2."""
    hidden = 64
    h = torch.ones(3, 4, hidden).bfloat16()
    k = torch.ones(3, 4, hidden).bfloat16()
    k[1] = torch.linspace(-1, 1, hidden)  # <ones, odd ramp> ~ 0: tiny, either sign
    k[2] = -1.0
    v = torch.ones(3, hidden).bfloat16()
    q_w = torch.ones(hidden)
    zero = ref.engram_gate(h, k, v, torch.zeros(hidden), torch.ones(hidden), 1e-6)
    assert (zero.float() == 1.5).all()  # 1 + 0.5 x 1
    expected, gate = _gate_f64(h, k, v, q_w, torch.ones(hidden), 1e-6)
    assert (gate[2] < 0.5).all() and abs(float(gate[1, 0]) - 0.5) <= 1.01e-3 / 4
    torch.testing.assert_close(ref.engram_gate(h, k, v, q_w, torch.ones(hidden), 1e-6).double(), expected,
                               rtol=2**-8, atol=0)
