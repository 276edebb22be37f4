"""flashkern.compat.deep_gemm on DeepGEMM's own test recipes (tests/test_attention.py: test_mqa_logits,
test_paged_mqa_logits), restated here in our code and scaled for CPU, on every backend.

The peer's recipes: bf16 q / kv and fp32 weights from randn; FP8 casts (q straight to e4m3; kv per key with
sf = amax.clamp(1e-4) / 448); FP4 casts (per 32 values sf = ceil_to_ue8m0(amax.clamp_min(1e-4) / 6), exponent byte
clamped to [1, 254], e2m1 codes with ties to the lower magnitude, even element in the low nibble, the scale bytes
packed four per int32); prefill ks = 0, ke = arange(M) + N - M, or the context-parallel ks / ke; paged context
lengths uniform in [0.7, 1.3) x avg, block tables from a randperm, 2-D lengths ((ctx + 1) * rand).int() with the
last column = ctx, fused FP8 / FP4 pages (data rows, then scale words). The peer's checks: identical -inf masks, then
calc_diff < 1e-3 (FP8) / 0.02 (FP4) against fp32 math on the original bf16 values, < 5e-6 (3e-5 with bf16 logits)
against the same math on the dequantized values rounded to bf16 ("simulated"), and repeated calls bitwise equal
(20 upstream, 3 here). Our kernels always write -inf where a row may not see, so the paged -inf masks are compared
exactly too (DeepGEMM compares them only when it cleans).
"""

import pytest
import torch

from _device import DEVICE
from flashkern.compat import deep_gemm

BACKENDS = ("reference", "triton", "tilelang")
E2M1_BOUNDARIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


# ---------------------------------------------------------------- the peer's casts and references, restated


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double(), y.double()
    denominator = (x * x + y * y).sum()
    return 0.0 if denominator == 0 else float(1 - 2 * (x * y).sum() / denominator)


def cast_kv_to_fp8(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """per_custom_dims_cast_to_fp8(kv, (0,), False): one fp32 scale per row of [..., D]."""
    sf = kv.float().abs().amax(dim=-1).clamp(1e-4) / 448.0
    return (kv.float() * (1.0 / sf)[..., None]).to(torch.float8_e4m3fn), sf


def ceil_to_ue8m0(x: torch.Tensor) -> torch.Tensor:
    bits = x.view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).int()
    return (exponent.clamp(1, 254) << 23).view(torch.float32)


def fp4_codes(x: torch.Tensor) -> torch.Tensor:
    """_quantize_to_fp4_e2m1: the number of boundaries strictly below |x| (ties to the lower magnitude, saturating,
    NaN -> 0); the sign only on a nonzero code."""
    magnitude = x.abs()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for boundary in E2M1_BOUNDARIES:
        code += (magnitude > boundary).to(torch.uint8)
    return code | (((x < 0) & (code != 0)).to(torch.uint8) << 3)


def cast_to_fp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """per_token_cast_to_fp4(x, use_ue8m0=True, gran_k=32, use_packed_ue8m0=True) over the last dim D:
    (int8 [..., D/2], int32 [...]: the D/32 scale bytes of a row, padded with 1.0 (0x7F) to 4)."""
    lead, d = x.shape[:-1], x.shape[-1]
    blocks = x.float().reshape(-1, d // 32, 32)
    sf = ceil_to_ue8m0(blocks.abs().amax(dim=-1).clamp_min(1e-4) / 6.0)
    code = fp4_codes(blocks * (1.0 / sf)[..., None]).flatten(1)
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).view(torch.int8)
    scale_bytes = (sf.view(torch.int32) >> 23).to(torch.uint8)
    scale_bytes = torch.nn.functional.pad(scale_bytes, (0, 4 - d // 32), value=0x7F)
    return packed.view(*lead, d // 2), scale_bytes.view(torch.int32).view(lead)


def cast_back_from_fp4(packed: torch.Tensor, sf: torch.Tensor, d: int) -> torch.Tensor:
    """The peer's dequantizer: even element from the low nibble; code 8 (-0) is 0."""
    lead = packed.shape[:-1]
    nibbles = packed.view(torch.uint8).reshape(-1, d // 2)
    codes = torch.stack((nibbles & 0xF, nibbles >> 4), dim=-1).flatten(1)
    magnitude = torch.tensor(E2M1_VALUES, device=packed.device)[(codes & 7).long()]
    value = torch.where((codes & 8) != 0, -magnitude, magnitude)
    scale = (sf.reshape(-1, 1).view(torch.uint8)[:, : d // 32].int() << 23).view(torch.float32)
    return (value.view(-1, d // 32, 32) * scale[..., None]).reshape(*lead, d)


def ref_scores(q: torch.Tensor, kv: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """fp32 sum_h relu(q[m, h] . kv[n]) * weights[m, h]: q [M, H, D], kv [N, D] -> [M, N]."""
    dots = torch.einsum("mhd,nd->hmn", q.float(), kv.float())
    return (dots.relu() * weights.float().t()[:, :, None]).sum(dim=0)


def cast_q(fp4: bool, q: torch.Tensor):
    """DeepGEMM's q argument (values, sf or None) for bf16 q [.., H, D], and its "simulated" bf16 values."""
    if fp4:
        packed, sf = cast_to_fp4(q)
        return (packed, sf), cast_back_from_fp4(packed, sf, q.shape[-1]).bfloat16()
    q_fp8 = q.to(torch.float8_e4m3fn)
    return (q_fp8, None), q_fp8.bfloat16()


def cast_kv(fp4: bool, kv: torch.Tensor):
    """DeepGEMM's kv argument (values, sf) for bf16 kv [N, D], and its "simulated" bf16 values."""
    if fp4:
        packed, sf = cast_to_fp4(kv)
        return (packed, sf), cast_back_from_fp4(packed, sf, kv.shape[-1]).bfloat16()
    kv_fp8, sf = cast_kv_to_fp8(kv)
    return (kv_fp8, sf), (kv_fp8.float() * sf[..., None]).bfloat16()


def assert_matches_peer(logits, ref, simulated, fp4: bool, logits_dtype) -> None:
    """The peer's checks: dtype, identical -inf masks, calc_diff against both references on the visible entries."""
    assert logits.dtype == logits_dtype
    logits = logits.float().cpu()
    mask = ref == -torch.inf
    assert torch.equal(logits == -torch.inf, mask), "the -inf masks differ"
    logits, ref, simulated = (x.masked_fill(mask, 0) for x in (logits, ref, simulated))
    assert calc_diff(logits, ref) < (0.02 if fp4 else 1e-3)
    assert calc_diff(logits, simulated) < (3e-5 if logits_dtype == torch.bfloat16 else 5e-6)


def assert_bitwise_repeatable(call, first: torch.Tensor, mask: torch.Tensor, repeats: int = 2) -> None:
    """assert_bitwise_equal on the valid region (entries where the CPU mask is set zeroed), for `repeats` more
    calls."""
    valid = lambda x: x.cpu().float().masked_fill(mask, 0).view(torch.int32)  # noqa: E731
    for _ in range(repeats):
        assert torch.equal(valid(call()), valid(first)), "repeated calls differ"


def device(*tensors):
    return tuple(None if t is None else t.to(DEVICE) for t in tensors)


# ---------------------------------------------------------------- prefill: fp8_mqa_logits, fp8_fp4_mqa_logits


def prefill_ranges(m: int, n: int, context_parallel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """ks = 0 and the causal ke = arange(M) + N - M, or the context-parallel ke of DeepGEMM's test."""
    ks = torch.zeros(m, dtype=torch.int32)
    if not context_parallel:
        return ks, (torch.arange(m) + n - m).int()
    assert n % m == 0 and m % 2 == 0
    chunk, cp_size = m // 2, n // m
    cp_id = cp_size // 3
    ke = torch.zeros(m, dtype=torch.int32)
    for i in range(chunk):
        ke[i] = cp_id * chunk + i
        ke[i + chunk] = (2 * cp_size - 1 - cp_id) * chunk + i
    return ks, ke


PREFILL_CASES = [  # fp4, M, N, H, D, context parallel, compressed, logits dtype
    (False, 64, 512, 32, 128, False, False, torch.float32),
    (False, 64, 512, 64, 128, True, True, torch.bfloat16),
    (True, 64, 256, 32, 128, False, True, torch.float32),
    (True, 96, 96, 32, 64, True, False, torch.bfloat16),  # N == M: cp_id 0, row 0 sees nothing
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fp4, m, n, h, d, context_parallel, compressed, logits_dtype", PREFILL_CASES)
def test_mqa_logits(backend, fp4, m, n, h, d, context_parallel, compressed, logits_dtype):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(m, h, d, generator=gen).bfloat16()
    kv = torch.randn(n, d, generator=gen).bfloat16()
    weights = torch.randn(m, h, generator=gen)
    ks, ke = prefill_ranges(m, n, context_parallel)
    (q_arg, q_simulated), (kv_arg, kv_simulated) = cast_q(fp4, q), cast_kv(fp4, kv)
    columns = torch.arange(n)
    mask = (columns < ks[:, None]) | (columns >= ke[:, None])
    ref = ref_scores(q, kv, weights).masked_fill(mask, -torch.inf)
    simulated = ref_scores(q_simulated, kv_simulated, weights).masked_fill(mask, -torch.inf)
    max_seqlen_k = int((ke - ks).max()) if compressed else 0

    (q_values, q_sf, kv_values, kv_sf, weights_d, ks_d, ke_d) = device(*q_arg, *kv_arg, weights, ks, ke)
    if not fp4 and logits_dtype == torch.float32:  # the legacy entry point
        call = lambda: deep_gemm.fp8_mqa_logits(q_values, (kv_values, kv_sf), weights_d, ks_d, ke_d,  # noqa: E731
                                                max_seqlen_k=max_seqlen_k, backend=backend)
    else:
        call = lambda: deep_gemm.fp8_fp4_mqa_logits(  # noqa: E731
            (q_values, q_sf), (kv_values, kv_sf), weights_d, ks_d, ke_d, clean_logits=not compressed,
            max_seqlen_k=max_seqlen_k, logits_dtype=logits_dtype, backend=backend)
    logits = call()
    if compressed:  # scattered back into an -inf [M, N] tensor at [ks, ke), as the peer's test does
        assert logits.shape == (m, max_seqlen_k)
        offset = torch.arange(max_seqlen_k)
        inside = offset < (ke - ks)[:, None]
        assert (logits.cpu()[~inside] == -torch.inf).all(), "compressed logits past ke - ks are not -inf"
        full = torch.full((m, n), -torch.inf, dtype=logits.dtype)
        rows = torch.arange(m)[:, None].expand(-1, max_seqlen_k)
        full[rows[inside], (ks[:, None] + offset)[inside]] = logits.cpu()[inside]
        first, logits = logits, full
    else:
        first = logits
    assert_matches_peer(logits, ref, simulated, fp4, logits_dtype)
    assert_bitwise_repeatable(call, first, ~inside if compressed else mask)


# ---------------------------------------------------------------- decode: fp8_paged_mqa_logits, fp8_fp4_paged_...


def fused_cache(kv: torch.Tensor, fp4: bool, page_padding: int = 0):
    """kv_cache_cast_to_fp8 / kv_cache_cast_to_fp4: kv [blocks, block_kv, 1, D] bf16 -> (fused uint8 pages
    [blocks, block_kv, 1, D + 4 or D/2 + 4] on DEVICE, optionally with padded page stride; simulated kv
    [blocks, block_kv, D])."""
    blocks, block_kv, _, d = kv.shape
    (data, sf), simulated = cast_kv(fp4, kv.view(blocks * block_kv, d))
    pages = torch.cat((data.view(torch.uint8).reshape(blocks, -1), sf.view(torch.uint8).reshape(blocks, -1)), dim=1)
    buffer = torch.full((blocks, pages.shape[1] + page_padding), 0xFF, dtype=torch.uint8, device=DEVICE)
    buffer[:, : pages.shape[1]] = pages.to(DEVICE)
    cache = buffer[:, : pages.shape[1]].view(blocks, block_kv, 1, -1)
    return cache, simulated.view(blocks, block_kv, d)


def paged_inputs(gen, batch: int, next_n: int, avg: int, block_kv: int, h: int, d: int):
    """context_lens, block table and bf16 q / kv cache / weights as the peer's test draws them."""
    context_lens = torch.randint(int(0.7 * avg), int(1.3 * avg), (batch,), generator=gen).int()
    blocks_per = (context_lens + block_kv - 1) // block_kv
    max_blocks = int(blocks_per.max())
    total = int(blocks_per.sum())
    order = torch.randperm(total, generator=gen).int()
    block_table = torch.zeros(batch, max_blocks, dtype=torch.int32)
    start = 0
    for b, count in enumerate(blocks_per.tolist()):
        block_table[b, :count] = order[start: start + count]
        start += count
    q = torch.randn(batch, next_n, h, d, generator=gen).bfloat16()
    kv = torch.randn(total, block_kv, 1, d, generator=gen).bfloat16()
    weights = torch.randn(batch * next_n, h, generator=gen)
    return context_lens, block_table, q, kv, weights


def ref_paged(q, cache, weights, context_lens, block_table, row_ends, width: int) -> torch.Tensor:
    """ref_paged_mqa_logits: per sequence, fp32 math against the keys its block table names; -inf at positions
    >= each row's end."""
    batch, next_n = q.shape[:2]
    out = torch.full((batch * next_n, width), -torch.inf)
    for b in range(batch):
        keys = cache[block_table[b].long()].reshape(-1, cache.shape[-1])[:width]
        rows = slice(b * next_n, (b + 1) * next_n)
        scores = ref_scores(q[b], keys, weights[rows])
        out[rows, : keys.shape[0]] = scores.masked_fill(torch.arange(keys.shape[0]) >= row_ends[rows, None], -torch.inf)
    return out


PAGED_CASES = [  # fp4, batch, next_n, avg context, block_kv, D, 2-D lengths, logits dtype, page padding, extra cols
    (False, 3, 1, 400, 64, 128, True, torch.float32, 0, 0),
    (False, 2, 2, 300, 64, 128, False, torch.float32, 0, 70),  # the legacy API: 1-D lengths, cleaned
    (True, 2, 6, 300, 32, 128, True, torch.bfloat16, 64, 0),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fp4, batch, next_n, avg, block_kv, d, lens_2d, logits_dtype, padding, extra",
                         PAGED_CASES)
def test_paged_mqa_logits(backend, fp4, batch, next_n, avg, block_kv, d, lens_2d, logits_dtype, padding, extra):
    gen = torch.Generator().manual_seed(100000)
    h = 32
    context_lens, block_table, q, kv, weights = paged_inputs(gen, batch, next_n, avg, block_kv, h, d)
    max_context_len = block_table.shape[1] * block_kv + extra
    if lens_2d:
        lens = ((context_lens[:, None] + 1) * torch.rand(batch, next_n, generator=gen)).int()
        lens[:, -1] = context_lens
        row_ends = lens.flatten()
    else:
        lens = context_lens
        row_ends = (context_lens[:, None] - next_n + 1 + torch.arange(next_n)).flatten()
    q_arg, q_simulated = cast_q(fp4, q)
    cache, kv_simulated = fused_cache(kv, fp4, padding)
    ref = ref_paged(q, kv.view(-1, block_kv, d), weights, lens, block_table, row_ends, max_context_len)
    simulated = ref_paged(q_simulated, kv_simulated, weights, lens, block_table, row_ends, max_context_len)

    q_values, q_sf, weights_d, lens_d, table_d = device(*q_arg, weights, lens, block_table)
    schedule = deep_gemm.get_paged_mqa_logits_metadata(lens_d, block_kv, 132)
    assert schedule.shape == (133, 2) and schedule.dtype == torch.int32
    if not fp4 and not lens_2d:  # the legacy entry point, with the legacy clean_logits=True
        call = lambda: deep_gemm.fp8_paged_mqa_logits(q_values, cache, weights_d, lens_d, table_d,  # noqa: E731
                                                      schedule, max_context_len, clean_logits=True, backend=backend)
    else:
        call = lambda: deep_gemm.fp8_fp4_paged_mqa_logits(  # noqa: E731
            (q_values, q_sf), cache, weights_d, lens_d, table_d, schedule, max_context_len, clean_logits=False,
            logits_dtype=logits_dtype, backend=backend)
    logits = call()
    assert logits.shape == (batch * next_n, max_context_len)
    assert_matches_peer(logits, ref, simulated, fp4, logits_dtype)
    assert_bitwise_repeatable(call, logits, ref == -torch.inf)


# ---------------------------------------------------------------- conventions of the compat layer


def test_peer_fp4_cast_is_our_quantizer_with_ties_down():
    """The restated peer cast agrees with ref.quantize_mxfp4(rounding="down") wherever the scale rules agree (block
    maxima of at least 1e-4): same codes and scale bytes, so our "down" encoder is bit-compatible with DeepGEMM's."""
    from flashkern.reference import indexer as ref

    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(64, 128, generator=gen) * torch.exp2(torch.randint(-8, 8, (64, 1), generator=gen))).bfloat16()
    x[0, :32] = torch.tensor([0.75, -1.75, 3.5, -5.0, 0.25, -0.0, 6.0, 2.5] * 4)  # exact ties (scale 1)
    packed, sf = cast_to_fp4(x)
    ours, scales = ref.quantize_mxfp4(x.float(), rounding="down")
    assert torch.equal(packed.view(torch.uint8), ours)
    assert torch.equal(sf.view(torch.uint8).view(64, 4), scales)


def test_unsupported_options_are_named():
    with pytest.raises(NotImplementedError, match="indices"):
        deep_gemm.get_paged_mqa_logits_metadata(torch.ones(2, 1, dtype=torch.int32), 64, 132,
                                                indices=torch.zeros(2, dtype=torch.int32))
    q = torch.zeros(1, 1, 32, 128, dtype=torch.float8_e4m3fn)
    cache = torch.zeros(1, 64, 1, 132, dtype=torch.uint8)
    with pytest.raises(NotImplementedError, match="indices"):
        deep_gemm.fp8_paged_mqa_logits(q, cache, torch.ones(1, 32), torch.ones(1, 1, dtype=torch.int32),
                                       torch.zeros(1, 1, dtype=torch.int32), None, 64,
                                       indices=torch.zeros(1, dtype=torch.int32))


@pytest.mark.parametrize("backend", BACKENDS)
def test_compressed_logits_are_key_offsets_from_ks(backend):
    """max_seqlen_k > 0: column j of row i is key ks[i] + j; -inf where j >= ke[i] - ks[i]; bf16 weights widened."""
    gen = torch.Generator().manual_seed(4)
    m, n, h, d = 5, 70, 32, 128
    q = torch.randn(m, h, d, generator=gen).to(torch.float8_e4m3fn)
    kv, sf = cast_kv_to_fp8(torch.randn(n, d, generator=gen))
    weights = torch.randn(m, h, generator=gen).bfloat16()
    ks = torch.tensor([0, 3, 10, 69, 20], dtype=torch.int32)
    ke = torch.tensor([5, 40, 10, 70, 90], dtype=torch.int32)  # ke past N is clamped, as DeepGEMM's kernel
    q_d, kv_d, sf_d, w_d, ks_d, ke_d = device(q, kv, sf, weights, ks, ke)
    full = deep_gemm.fp8_mqa_logits(q_d, (kv_d, sf_d), w_d, ks_d, ke_d, backend=backend).cpu()
    compressed = deep_gemm.fp8_mqa_logits(q_d, (kv_d, sf_d), w_d, ks_d, ke_d, clean_logits=False, max_seqlen_k=60,
                                          backend=backend).cpu()
    assert compressed.shape == (m, 60)
    for i in range(m):
        length = min(int(ke[i]), n) - int(ks[i])
        assert torch.equal(compressed[i, :length], full[i, int(ks[i]): int(ks[i]) + length])
        assert (compressed[i, length:] == -torch.inf).all()
