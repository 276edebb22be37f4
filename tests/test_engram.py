"""Engram: the reference (reference/engram.py) against the model's published constants, an independent per-token
hash in Python integers, the lookup's dequantization and the gate in float64; then every implementation of
engram_hash, engram_lookup and engram_gate against the reference on the operators' drawn cases
(flashkern.kernels.engram.cases), sampled configs and the GPU's configs; the documented results of ids outside
the token map, the history and the table (outside checked mode) and their refusal in checked mode; the host table
(transparent huge pages), the multi-threaded CPU gather and prefetch with reused buffers."""

import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st

import flashkern
from _budget import fraction_of_examples
from _device import DEVICE, on_device
from flashkern import checks, registry
from flashkern.kernels.engram import GateProblem, HashProblem, LookupProblem, host, make_table, model_params
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
    """Per token, in Python integers: the tokens before it in its run of equal sequence ids, then its sequence's
    history (where there is one), then the pad id; ids outside the map as the pad id; XOR of products, remainder,
    offset."""
    token_map = params.token_map.tolist()
    mult = params.multipliers.tolist()
    cid = lambda x: token_map[x] if 0 <= x < len(token_map) else params.pad_id  # noqa: E731
    tokens, seqs = token_ids.tolist(), seq_ids.tolist()
    out = []
    for t in range(len(tokens)):
        start = t
        while start > 0 and seqs[start - 1] == seqs[t]:
            start -= 1
        known = history is not None and 0 <= seqs[t] < history.shape[0]
        before = [cid(x) for x in history[seqs[t]].tolist()] if known else []  # -1, outside the map: the pad id
        ids = before + [cid(x) for x in tokens[start: t + 1]]
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
    """Runs of 0-12 tokens of up to 4 sequences (a sequence may come back in a later run, which continues from its
    history again); ids drawn with the extremes (0, the largest, a token mapping to the pad id, ids outside the
    map), each sequence with a history (some of it missing, some of it outside the map) or none; sequence ids
    outside the history's rows."""
    token_map = ref.synthetic_token_map(VOCABULARY, SMALL.compressed_vocab, seed=draw(st.integers(0, 3)))
    pad_token = int((token_map == SMALL.pad_id).nonzero()[0])
    token = st.one_of(st.integers(0, VOCABULARY - 1), st.sampled_from([0, VOCABULARY - 1, pad_token]),
                      st.sampled_from([-5, -1, VOCABULARY, 2**31 - 1]))
    runs = draw(st.lists(st.tuples(st.integers(-1, 4), st.integers(0, 12)), min_size=1, max_size=4))
    seq_ids = torch.tensor([s for s, n in runs for _ in range(n)], dtype=torch.int64)
    token_ids = torch.tensor(draw(st.lists(token, min_size=len(seq_ids), max_size=len(seq_ids))), dtype=torch.int64)
    history = None
    if draw(st.booleans()):  # per sequence 0-3 known ids before the call, -1 before them (where it starts)
        known = [draw(st.integers(0, 3)) for _ in range(draw(st.integers(0, 4)))]
        history = torch.tensor([[-1] * (3 - n) + draw(st.lists(token, min_size=n, max_size=n)) for n in known],
                               dtype=torch.int64).view(-1, 3)
    params = ref.engram_params(draw(st.sampled_from(SMALL.layer_ids)), token_map, SMALL)
    return token_ids, seq_ids, params, history


@given(hash_cases())
def test_hash_equals_a_per_token_computation(case):
    token_ids, seq_ids, params, history = case
    rows = ref.engram_hash(token_ids, seq_ids, **params.hash_inputs(), history=history)
    assert torch.equal(rows, _expected_rows(token_ids, seq_ids, params, history))
    first = params.offsets.flatten()
    assert ((rows >= first) & (rows < first + params.primes.flatten())).all()  # each head inside its own table


def test_hashing_in_chunks_with_history_equals_one_call():
    """A prefill split into a chunk and decode steps, each given the last three ids before it: the same rows."""
    params = ref.engram_params(14, ref.synthetic_token_map(VOCABULARY, SMALL.compressed_vocab), SMALL)
    tokens = torch.randint(0, VOCABULARY, (11,), generator=torch.Generator().manual_seed(1))
    whole = ref.engram_hash(tokens, torch.zeros(11, dtype=torch.int64), **params.hash_inputs())
    pieces, done = [], 0
    for size in (6, 1, 1, 3):
        history = torch.full((1, 3), -1, dtype=torch.int64)
        kept = tokens[max(done - 3, 0): done]
        history[0, 3 - kept.numel():] = kept
        pieces.append(ref.engram_hash(tokens[done: done + size], torch.zeros(size, dtype=torch.int64),
                                      **params.hash_inputs(), history=history))
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


# ---------------------------------------------------------------- the operators against the reference

KERNELS = ("triton", "tilelang")
OPS = {name: registry.get(name) for name in ("engram_hash", "engram_lookup", "engram_gate")}


def run_and_check(op, inputs, backend, config=None):
    expected = op.reference(**inputs)
    actual = op.entry(**inputs, backend=backend, config=config)
    op.compare(inputs, expected, actual)
    return actual


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("name", sorted(OPS))
@given(data=st.data())
def test_matches_reference(name, backend, data):
    run_and_check(OPS[name], data.draw(OPS[name].cases().map(on_device)), backend)


@pytest.mark.parametrize("backend", KERNELS)
@fraction_of_examples(1 / 2)
@given(data=st.data())
def test_sampled_configs_match_reference(backend, data):
    """Any config of each tuning space (the persistent lookups included), the operator drawn too."""
    op = OPS[data.draw(st.sampled_from(sorted(OPS)))]
    inputs = data.draw(op.cases().map(on_device))
    config = data.draw(st.sampled_from(op.implementation(backend).space.configs(op.check(inputs), DEVICE.type)))
    note(f"{op.name} config={config}")
    run_and_check(op, inputs, backend, config)


GPU_PROBLEMS = (HashProblem(300, history=True), HashProblem(1), LookupProblem(77), LookupProblem(1),
                LookupProblem(77, host=True), GateProblem(3, 7168), GateProblem(2, 1000))


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("problem", GPU_PROBLEMS, ids=lambda p: p.key)
def test_the_gpus_default_configs(backend, problem):
    """The configs a GPU runs by default (persistent lookups over SM-count grids, D in chunks, tiles of tokens),
    run here on the made inputs."""
    op = next(op for op in OPS.values() if isinstance(problem, type(op.presets["smoke"][0])))
    with flashkern.planning_for_gpu():
        config = op.implementation(backend).default_config(problem)
    run_and_check(op, op.make_inputs(problem, DEVICE, seed=3), backend, config)


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("tokens, hidden", [(1001, 576), (129, 7168)])
def test_gate_at_tilekernels_shapes(backend, tokens, hidden):
    """TileKernels' gate check (T 4001 / 8001, hc 4, hidden 576 .. 7168) scaled for a CPU (Triton's interpreter runs
    a program per token): a thousand tokens at 576, a hundred at 7168; a third of the keys zero (dot = 0: g = 1/2
    exactly), a third negated (g < 1/2)."""
    op = OPS["engram_gate"]
    inputs = op.make_inputs(GateProblem(tokens, hidden), "cpu", seed=tokens)
    inputs["k"][0::3] = 0
    inputs["k"][1::3] *= -1
    got = run_and_check(op, on_device(inputs), backend).cpu()
    zero = inputs["h"][0::3].float() + 0.5 * inputs["v"][0::3, None, :].float()
    assert torch.equal(got[0::3], zero.bfloat16())


def test_the_model_sizes_hash_equals_the_per_token_computation():
    """The model's hash (primes from 16M, multipliers near 2^63 / V') on a batch with history, every backend."""
    op = OPS["engram_hash"]
    inputs = op.make_inputs(HashProblem(64, history=True), "cpu", seed=5)
    params = model_params()
    expected = _expected_rows(inputs["token_ids"], inputs["seq_ids"], params, inputs["history"])
    for backend in ("reference", *KERNELS):
        got = op.entry(**on_device(inputs), backend=backend).cpu()
        assert torch.equal(got, expected), backend


# ---------------------------------------------------------------- ids outside the map, the history and the table


def _hostile_hash_inputs():
    """Token ids outside the map (-5, V, the int32 and int64 extremes), history ids outside it, sequence ids outside
    the history's rows (-1, S, int32 max), runs that come back."""
    params = ref.engram_params(1, ref.synthetic_token_map(VOCABULARY, SMALL.compressed_vocab), SMALL)
    tokens = [5, -5, VOCABULARY, 7, 2**31 - 1, -(2**31), 3, 9, 2**63 - 1, 4]
    seqs = [0, 0, 0, -1, -1, 3, 3, 0, 2**31 - 1, 1]
    history = torch.tensor([[-1, VOCABULARY, 4], [-7, 11, 2**62], [1, 2, 3]])
    return dict(token_ids=torch.tensor(tokens), seq_ids=torch.tensor(seqs), **params.hash_inputs(), history=history)


@pytest.mark.parametrize("backend", KERNELS)
def test_ids_outside_the_map_and_the_history_hash_as_documented(backend):
    """Outside checked mode: an id outside the map hashes as the pad id, a sequence id outside the history's rows
    has none; the kernels equal the reference, which equals the per-token computation of those rules."""
    inputs = _hostile_hash_inputs()
    expected = _expected_rows(inputs["token_ids"], inputs["seq_ids"], params_of(inputs), inputs["history"])
    assert torch.equal(ref.engram_hash(**inputs), expected)
    with checks.checked(False):
        got = OPS["engram_hash"].entry(**on_device(inputs), backend=backend).cpu()
    assert torch.equal(got, expected)


def params_of(inputs):
    return ref.EngramParams(1, inputs["token_map"], inputs["multipliers"], inputs["primes"], inputs["offsets"],
                            inputs["pad_id"])


@pytest.mark.parametrize("aligned", (False, True), ids=("unaligned", "aligned"))
@pytest.mark.parametrize("backend", KERNELS)
def test_rows_outside_the_table_give_zeros_and_read_nothing(backend, aligned):
    """Row ids -1, R, the int32 and int64 extremes: zeros; the table is cut from a buffer whose other bytes are NaN
    codes with NaN scales, so a read outside it shows. Rows at 8-byte boundaries (start and stride) or not: on a
    GPU, TileLang gathers an aligned table in 8-byte cp.async pieces and an unaligned one a byte at a time, two
    branches (docs/gpu.md, "Branches only a GPU takes")."""
    gen = torch.Generator().manual_seed(4)
    buffer = torch.full((60, 304 if aligned else 300), 0xFF, dtype=torch.uint8)
    table = buffer[8:48, 16: 16 + ref.ROW_BYTES] if aligned else buffer[10:50, 20: 20 + ref.ROW_BYTES]
    assert (table.data_ptr() % 8 == 0 and table.stride(0) % 8 == 0) == aligned
    table.copy_(make_table(40, gen))
    rows = torch.tensor([[0, 39, -1, 40], [2**31 - 1, -(2**31), 2**63 - 1, -(2**63)], [5, 41, 60, 39]])
    expected = ref.engram_lookup(table, rows)
    assert (expected[rows < 0] == 0).all() and (expected[rows >= 40] == 0).all()
    with checks.checked(False):
        for ids in (rows, rows.clamp(-(2**31), 2**31 - 1).int()):
            got = OPS["engram_lookup"].entry(**on_device(dict(table=table, rows=ids)), backend=backend)
            OPS["engram_lookup"].compare({}, ref.engram_lookup(table, ids), got)


@pytest.mark.parametrize("name, argument, value, message", [
    ("engram_hash", "token_ids", 300, r"token_ids\[1\] = 300 is out of range"),
    ("engram_hash", "history", -2, r"history\[0, 0\] = -2 is out of range"),
    ("engram_hash", "seq_ids", 7, r"seq_ids\[1\] = 7 is out of range"),
    ("engram_lookup", "rows", -1, r"rows\[0, 1\] = -1 is out of range"),
])
def test_checked_mode_names_ids_outside_their_tensors(name, argument, value, message):
    op = OPS[name]
    if name == "engram_hash":
        params = ref.engram_params(1, ref.synthetic_token_map(VOCABULARY, SMALL.compressed_vocab), SMALL)
        inputs = dict(token_ids=torch.tensor([1, 2]), seq_ids=torch.tensor([0, 0]), **params.hash_inputs(),
                      history=torch.zeros(1, 3, dtype=torch.int64))
        inputs[argument] = inputs[argument].clone()
        inputs[argument].view(-1)[1 if argument != "history" else 0] = value
    else:
        inputs = dict(table=make_table(10, torch.Generator()), rows=torch.tensor([[0, value]]))
    for backend in KERNELS:
        with checks.checked(True), pytest.raises(ValueError, match=message):
            op.entry(**on_device(inputs), backend=backend)


# ---------------------------------------------------------------- the host table, the CPU gather and prefetch


def test_host_table_asks_for_huge_pages_and_says_what_it_got():
    """madvise(MADV_HUGEPAGE) where the kernel allows it (its mode "always" or "madvise"): once written, huge pages
    back the table; MADV_NOHUGEPAGE keeps them off; where the mode is "never" or absent, a warning says so."""
    mode = host.transparent_huge_pages()
    rows = (16 << 20) // ref.ROW_BYTES  # 16 MiB
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        table = host.HostTable(rows)
    plain = host.HostTable(rows, huge_pages=False)
    try:
        for t in (table, plain):
            t.tensor.fill_(1)
            assert t.tensor.shape == (rows, ref.ROW_BYTES) and t.tensor.data_ptr() % host.HUGE_PAGE == 0
        assert plain.huge_page_bytes() == 0 and plain.huge_pages_state.startswith("off")
        if mode in ("always", "madvise"):
            assert table.huge_pages_state == "asked (madvise)" and not caught
            assert table.huge_page_bytes() >= 4 * host.HUGE_PAGE  # most of 16 MiB (the kernel may leave the ends)
        else:
            assert "no transparent huge pages" in str(caught[0].message)
    finally:
        table.close()
        plain.close()


@pytest.mark.parametrize("workers", [1, 2, 3])
@pytest.mark.parametrize("backend", ("reference", "tilelang"))
def test_the_threaded_cpu_gather_equals_the_reference(workers, backend):
    table = host.HostTable(5000)
    try:
        make_table(5000, torch.Generator().manual_seed(1), out=table.tensor)
        rows = torch.randint(0, 5000, (37, 24), generator=torch.Generator().manual_seed(2))
        out = host.gather(table.tensor, rows, workers=workers, backend=backend)
        OPS["engram_lookup"].compare({}, ref.engram_lookup(table.tensor, rows), out)
    finally:
        table.close()


def test_prefetch_overlaps_compute_and_reuses_its_buffers():
    """Three decode-like steps into the same out and rows buffers, each started before a stand-in compute step
    and waited on after it: each step's values are its own tokens' (a later prefetch into the buffers waits for
    the earlier one; a stale or mixed result fails)."""
    params = ref.engram_params(14, ref.synthetic_token_map(VOCABULARY, SMALL.compressed_vocab), SMALL)
    hash_inputs = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in params.hash_inputs().items()}
    table = make_table(params.rows, torch.Generator().manual_seed(6)).to(DEVICE)  # every hashed row inside it
    out = torch.empty(9, 24, ref.ROW_VALUES, dtype=torch.bfloat16, device=DEVICE)
    rows = torch.empty(9, 24, dtype=torch.int64, device=DEVICE)
    real_hash = ref.engram_hash
    gen = torch.Generator().manual_seed(7)
    steps = [torch.randint(0, VOCABULARY, (9,), generator=gen) for _ in range(3)]
    seq_ids = torch.arange(9, device=DEVICE)
    for backend in ("reference", "tilelang"):
        for token_ids in steps:
            token_ids = token_ids.to(DEVICE)
            expected = ref.engram_lookup(table, real_hash(token_ids, seq_ids, **hash_inputs).cpu())
            started = host.engram_prefetch(table, token_ids, seq_ids, hash_inputs, out, rows=rows, backend=backend)
            torch.randn(256, 256) @ torch.randn(256, 256)  # the layers before Engram's
            got = started.wait()
            assert got is out
            OPS["engram_lookup"].compare({}, expected.to(DEVICE), got)
        again = [host.engram_prefetch(table, steps[i].to(DEVICE), seq_ids, hash_inputs, out, backend=backend)
                 for i in range(3)]  # issued back to back: each waits for the one before
        again[-1].wait()
        expected = ref.engram_lookup(table, real_hash(steps[2].to(DEVICE), seq_ids, **hash_inputs).cpu())
        OPS["engram_lookup"].compare({}, expected.to(DEVICE), out)


def test_the_dlpack_record_cuda_view_rewrites_is_where_it_is_expected():
    """cuda_view rewrites the device of a tensor's DLPack record at a fixed offset: a CPU tensor's record holds
    kDLCPU (1) and index 0 there, and a record rewritten to the same values gives back the same memory."""
    table = torch.arange(264 * 3, dtype=torch.uint8).view(3, 264)[1:]
    capsule = torch.utils.dlpack.to_dlpack(table)
    kind, index = host.dlpack_device(capsule)
    assert (kind.value, index.value) == (1, 0)
    again = torch.utils.dlpack.from_dlpack(capsule)
    assert again.data_ptr() == table.data_ptr() and again.shape == table.shape and torch.equal(again, table)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="reads pinned host memory from a GPU kernel (UVA)")
@pytest.mark.parametrize("backend", KERNELS)
def test_a_pinned_host_table_is_read_by_the_gpu_kernels(backend):
    table = host.HostTable(100_003, pin=True)
    try:
        make_table(100_003, torch.Generator().manual_seed(8), out=table.tensor)
        rows = torch.randint(0, 100_003, (64, 24), generator=torch.Generator().manual_seed(9)).cuda()
        got = OPS["engram_lookup"].entry(table.tensor, rows, backend=backend)
        assert got.is_cuda and OPS["engram_lookup"].check(dict(table=table.tensor, rows=rows)).host
        OPS["engram_lookup"].compare({}, ref.engram_lookup(table.tensor, rows), got)
    finally:
        table.close()
