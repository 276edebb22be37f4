"""flashkern.compat.vllm's top-k per row ops on vLLM's own test recipes (tests/kernels/test_top_k_per_row.py).

Restated here in our code and scaled for CPU: logits as vLLM's create_random_logits builds them ("random" normal
values, or "10LSBits": 1024 distinct values, so many ties; -inf past each row's end when clean, else data the op
must not read); prefill rows i of i + 1 positions; decode rows ending at seq_len - next_n + r % next_n + 1. The
checks are vLLM's: compare_top_k_results (the chosen sets equal, or the differing values equal within 1e-5) and the
stricter _assert_exact_topk (the valid count is min(length, k), then -1; no repeats; the chosen values sorted equal
torch.topk's bit for bit).
"""

import pytest
import torch

from _device import DEVICE
from flashkern.compat.vllm import top_k_per_row_decode, top_k_per_row_prefill

BACKENDS = ("reference", "triton", "tilelang")


def create_random_logits(row_starts, row_ends, seed: int, clean_logits: bool, data_generation: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    rows, width = len(row_ends), int(row_ends.max())
    if data_generation == "random":
        logits = torch.randn(rows, width, generator=gen)
    else:  # "10LSBits": 0x3F900000 | 10 random low bits
        bits = 0x3F900000 | torch.randint(0, 1024, (rows, width), generator=gen, dtype=torch.int32)
        logits = bits.view(torch.float32)
    if clean_logits:
        logits[torch.arange(width) >= row_ends[:, None]] = -torch.inf
    return logits


def expected_top_k(logits: torch.Tensor, row_starts, row_ends, top_k: int) -> list[torch.Tensor]:
    """vLLM's reference: per row, torch.topk over [start, end) (local indices, on the CPU)."""
    out = []
    for row, (start, end) in enumerate(zip(row_starts.tolist(), row_ends.tolist())):
        out.append(logits[row, start:end].topk(min(top_k, max(end - start, 0))).indices.cpu())
    return out


def compare_top_k_results(logits, indices, expected, row_starts, row_ends, top_k: int, tolerance=1e-5) -> None:
    """vLLM's compare_top_k_results and _assert_exact_topk on every row."""
    logits, indices = logits.cpu(), indices.cpu()
    for row, (start, end) in enumerate(zip(row_starts.tolist(), row_ends.tolist())):
        valid = min(top_k, max(end - start, 0))
        got = indices[row]
        assert (got[:valid] >= 0).all() and (got[valid:] == -1).all(), f"row {row}: not {valid} indices then -1"
        chosen = got[:valid].long()
        assert chosen.unique().numel() == valid, f"row {row}: repeated indices"
        want = expected[row]
        values = logits[row, start:end]
        if set(chosen.tolist()) != set(want.tolist()):
            extra = torch.tensor(sorted(set(chosen.tolist()) - set(want.tolist())), dtype=torch.long)
            missing = torch.tensor(sorted(set(want.tolist()) - set(chosen.tolist())), dtype=torch.long)
            assert len(extra) == len(missing), f"row {row}: chosen sets differ in size"
            torch.testing.assert_close(values[extra].sort().values, values[missing].sort().values, atol=tolerance,
                                       rtol=tolerance)
        assert torch.equal(values[chosen].sort(descending=True).values, values[want].sort(descending=True).values)


PREFILL_CASES = [  # (num_rows, top_k, clean_logits, data_generation); vLLM: rows 1/32/2050, k 2048/3000
    (1, 64, True, "random"),
    (32, 7, False, "random"),
    (300, 64, True, "10LSBits"),
    (300, 257, False, "random"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("num_rows, top_k, clean_logits, data_generation", PREFILL_CASES)
def test_top_k_per_row(backend, num_rows, top_k, clean_logits, data_generation):
    row_starts = torch.zeros(num_rows, dtype=torch.int32)
    row_ends = torch.arange(1, num_rows + 1, dtype=torch.int32)
    logits = create_random_logits(row_starts, row_ends, 42, clean_logits, data_generation)
    indices = torch.empty((num_rows, top_k), dtype=torch.int32, device=DEVICE)
    top_k_per_row_prefill(logits.to(DEVICE), row_starts.to(DEVICE), row_ends.to(DEVICE), indices, num_rows,
                          logits.stride(0), logits.stride(1), top_k, backend=backend)
    compare_top_k_results(logits, indices, expected_top_k(logits, row_starts, row_ends, top_k), row_starts, row_ends,
                          top_k)


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_indices_count_from_the_row_start(backend):
    """Rows with nonzero starts (vLLM's CUDA tests use 0; its AITER test pins the local-index contract)."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 500, generator=gen)
    row_starts = torch.tensor([0, 10, 100, 250, 499, 300], dtype=torch.int32)
    row_ends = torch.tensor([500, 90, 101, 500, 500, 300], dtype=torch.int32)
    indices = torch.empty((6, 40), dtype=torch.int32, device=DEVICE)
    top_k_per_row_prefill(logits.to(DEVICE), row_starts.to(DEVICE), row_ends.to(DEVICE), indices, 6, 500, 1, 40,
                          backend=backend)
    compare_top_k_results(logits, indices, expected_top_k(logits, row_starts, row_ends, 40), row_starts, row_ends, 40)


DECODE_CASES = [  # (top_k, batch, next_n, clean_logits, data_generation, vocab); vLLM: vocab 20000, batch up to 2048
    (64, 1, 1, True, "random", 3000),
    (300, 2, 8, False, "10LSBits", 3000),
    (512, 5, 1, False, "random", 3000),
    (2048, 2, 2, True, "random", 70000),  # past 64K positions (vLLM's large-vocab split path)
]


def decode_ends(seq_lens: torch.Tensor, next_n: int) -> torch.Tensor:
    """vLLM's test: row_ends[r] = seq_lens[r // next_n] - next_n + r % next_n + 1."""
    r = torch.arange(len(seq_lens) * next_n)
    return (seq_lens[r // next_n] - next_n + r % next_n + 1).int()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("top_k, batch, next_n, clean_logits, data_generation, vocab", DECODE_CASES)
def test_top_k_per_row_decode(backend, top_k, batch, next_n, clean_logits, data_generation, vocab):
    gen = torch.Generator().manual_seed(batch * 10 + next_n)
    seq_lens = torch.randint(next_n, vocab, (batch,), generator=gen, dtype=torch.int32)
    seq_lens[0] = vocab  # one full row
    num_rows = batch * next_n
    row_starts, row_ends = torch.zeros(num_rows, dtype=torch.int32), decode_ends(seq_lens, next_n)
    logits = create_random_logits(row_starts, torch.full((num_rows,), vocab), 42, False, data_generation)
    if clean_logits:
        logits[torch.arange(vocab) >= row_ends[:, None]] = -torch.inf
    indices = torch.empty((num_rows, top_k), dtype=torch.int32, device=DEVICE)
    top_k_per_row_decode(logits.to(DEVICE), next_n, seq_lens.to(DEVICE), indices, num_rows, logits.stride(0),
                         logits.stride(1), top_k, backend=backend)
    compare_top_k_results(logits, indices, expected_top_k(logits, row_starts, row_ends, top_k), row_starts, row_ends,
                          top_k)


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_short_seq_lens_clamp_at_zero(backend):
    """vLLM's test_sparse_indexer_decode_topk_short_seq_lens: seq_lens [2, 6], next_n 4 -> ends [0, 0, 1, 2, 3, 4, 5, 6],
    also given per token as 2-D [B, next_n] lengths."""
    logits = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    expected_ends = torch.tensor([0, 0, 1, 2, 3, 4, 5, 6], dtype=torch.int32)
    for seq_lens in (torch.tensor([2, 6], dtype=torch.int32), expected_ends.view(2, 4)):
        indices = torch.full((8, 4), 7, dtype=torch.int32, device=DEVICE)
        top_k_per_row_decode(logits.to(DEVICE), 4, seq_lens.to(DEVICE), indices, 8, 16, 1, 4, backend=backend)
        zeros = torch.zeros(8, dtype=torch.int32)
        compare_top_k_results(logits, indices, expected_top_k(logits, zeros, expected_ends, 4), zeros, expected_ends, 4)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["column_slice", "expanded_row"])
def test_strided_logits(backend, layout):
    """vLLM's gfx950 layouts: a column slice of a wider buffer (row stride width + 8, start offset by one) and one row
    expanded over every row (row stride 0); the strides are passed as vLLM passes them."""
    gen = torch.Generator().manual_seed(5)
    rows, width, top_k = 5, 1000, 100
    if layout == "column_slice":
        logits = torch.randn(rows, width + 8, generator=gen).to(DEVICE)[:, 1: width + 1]
    else:
        logits = torch.randn(1, width, generator=gen).to(DEVICE).expand(rows, -1)
    seq_lens = torch.tensor([1000, 999, 500, 101, 100], dtype=torch.int32)
    indices = torch.empty((rows, top_k), dtype=torch.int32, device=DEVICE)
    top_k_per_row_decode(logits, 1, seq_lens.to(DEVICE), indices, rows, logits.stride(0), logits.stride(1), top_k,
                         backend=backend)
    zeros = torch.zeros(rows, dtype=torch.int32)
    compare_top_k_results(logits, indices, expected_top_k(logits, zeros, seq_lens, top_k), zeros, seq_lens, top_k)


def test_a_column_stride_is_refused_by_name():
    logits = torch.randn(64, 4)
    indices = torch.empty((4, 2), dtype=torch.int32)
    with pytest.raises(ValueError, match="logits must have unit stride"):
        top_k_per_row_decode(logits.t(), 1, torch.full((4,), 64, dtype=torch.int32), indices, 4, 1, 4, 2)
