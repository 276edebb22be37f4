"""KV-cache records, the cache write and sparse decode attention: every implementation against the reference.

Hypothesis draws the inputs from the operators' strategies (flashkern.kernels.kv_cache.cases, shared with
`flashkern check`): odd row counts, rounding ties of both grids, extremes (inf, NaN, +-0, subnormals), garbage
caches with odd and strided pages, -1 slots; attention with tokens, heads, top-k and window sizes off every tile,
both formats in either cache, sinks, and the index patterns of docs/operators.md section 8 (all padding,
duplicates, the same slot in both caches, mostly padding), with every unselected slot decoding to NaN.
The codecs are compared bit for bit, also exhaustively over every bf16 input of the e2m1 and e4m3 roundings and
every scale; attention with the operator's comparison (FlashMLA's 1e-3 abs / 2/128 relative on out, plus the
error analysis of bf16 softmax weights; lse within 1e-5) and against unquantized attention (cosine > 0.99).
"""

import dataclasses
import math

import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st

from _budget import fraction_of_examples
from _calls import fresh
from _device import DEVICE, on_device
import flashkern
from flashkern import checks, registry
from flashkern.kernels.cases import staggered
from flashkern.kernels.kv_cache import AttentionProblem, CodecProblem
from flashkern.kernels.kv_cache.problem import paged
from flashkern.reference import kv_cache as ref
from flashkern.reference.formats import E4M3_MAX

BACKENDS = ("reference", "triton", "tilelang")
KERNELS = ("triton", "tilelang")
RECORD_OPS = ("quantize_kv", "dequantize_kv", "kv_cache_insert")
ATTENTION = registry.get("sparse_decode_attention")


def cases(name: str):
    return registry.get(name).cases().map(on_device)


def run_and_check(op, inputs: dict, backend: str, config=None):
    expected = op.reference(**fresh(op, inputs))
    actual = op.result_of(fresh(op, inputs), backend=backend, config=config)
    op.compare(inputs, expected, actual)
    return actual


# ---------------------------------------------------------------- records


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("name", RECORD_OPS)
@given(data=st.data())
def test_records_match_reference_bit_for_bit(name, backend, data):
    run_and_check(registry.get(name), data.draw(cases(name)), backend)


@pytest.mark.parametrize("backend", KERNELS)
@fraction_of_examples(1 / 4)
@given(data=st.data())
def test_sampled_record_configs_match_reference(backend, data):
    op = registry.get(data.draw(st.sampled_from(RECORD_OPS)))
    inputs = data.draw(cases(op.name))
    config = data.draw(st.sampled_from(op.implementation(backend).space.configs(op.check(dict(inputs)), DEVICE.type)))
    note(f"{op.name} config={config}")
    run_and_check(op, inputs, backend, config)


def _blocks_of(values: torch.Tensor, lead: float, group: int) -> torch.Tensor:
    """Latent rows whose blocks of `group` each start with `lead` (fixing the block's scale) followed by `values`
    (padded with zeros to whole rows)."""
    per_block = group - 1
    blocks = -(-values.numel() // per_block)
    body = torch.zeros(blocks * per_block)
    body[: values.numel()] = values
    rows = torch.cat((torch.full((blocks, 1), lead), body.view(blocks, per_block)), dim=1).flatten()
    padded = torch.zeros(-(-rows.numel() // ref.LATENT) * ref.LATENT)
    padded[: rows.numel()] = rows
    return padded.view(-1, ref.LATENT).to(torch.bfloat16)


def _bf16_up_to(bound: float) -> torch.Tensor:
    """Every bf16 value (both signs, zeros and subnormals) with magnitude at most `bound`, as fp32."""
    bits = torch.arange(0, 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    positive = bits[bits <= bound]
    return torch.cat((positive, -positive))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", ["fp4", "mxfp8"])
def test_every_bf16_value_rounds_onto_the_grid_as_the_reference(fmt, backend):
    """Blocks led by the format's largest code value have scale 1 (fp4: 6 / 6 = 1; mxfp8: 448 / 448 = 2^0), so the
    other values meet the e2m1 / e4m3 rounding unscaled: every bf16 value up to that bound, each sign."""
    group, lead = (16, 6.0) if fmt == "fp4" else (32, E4M3_MAX)
    latent = on_device(dict(x=_blocks_of(_bf16_up_to(lead), lead, group)))["x"]
    op = registry.get("quantize_kv")
    op.compare({}, op.reference(latent, fmt), op.entry(latent, fmt, backend=backend))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", ["fp4", "mxfp8"])
def test_every_block_scale_is_the_references(fmt, backend):
    """One block per positive bf16 value as its amax (zero, subnormals, inf and NaN included): every scale code the
    encoder can produce."""
    group = ref.FORMATS[fmt].group
    amax = torch.arange(0, 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    blocks = torch.zeros(amax.numel(), group)
    blocks[:, 0] = amax
    blocks[:, 1] = -amax / 3
    blocks = torch.cat((blocks, torch.zeros((-blocks.numel()) % ref.LATENT // group, group)))
    latent = on_device(dict(x=blocks.view(-1, ref.LATENT).to(torch.bfloat16)))["x"]
    op = registry.get("quantize_kv")
    op.compare({}, op.reference(latent, fmt), op.entry(latent, fmt, backend=backend))


def test_e2m1_ties_follow_the_spec_table():
    """The tie table of docs/operators.md 8.1 (round half to even on the e2m1 grid), at the scale 1."""
    table = {0.25: 0.0, 0.75: 1.0, 1.25: 1.0, 1.75: 2.0, 2.5: 2.0, 3.5: 4.0, 5.0: 4.0}
    ties = torch.tensor(list(table))
    records = ref.quantize_kv(_blocks_of(torch.cat((ties, -ties)), 6.0, 16), "fp4")
    values = ref.dequantize_kv(records, "fp4").flatten()[1: 1 + 2 * len(table)]
    expected = torch.tensor(list(table.values()))
    assert torch.equal(values, torch.cat((expected, -expected)))
    for backend in KERNELS:
        latent = on_device(dict(x=_blocks_of(torch.cat((ties, -ties)), 6.0, 16)))["x"]
        assert torch.equal(registry.get("quantize_kv").entry(latent, "fp4", backend=backend).cpu(), records)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dequantize_reads_every_byte_value(backend):
    """Records whose every code byte and scale byte takes each of the 256 values (NaN scales and codes included)."""
    op = registry.get("dequantize_kv")
    for fmt, spec in ref.FORMATS.items():
        rows = torch.arange(256, dtype=torch.int32)[:, None] + torch.arange(spec.bytes)[None, :]
        records = on_device(dict(r=(rows % 256).to(torch.uint8)))["r"]
        op.compare({}, op.reference(records, fmt), op.entry(records, fmt, backend=backend))


def test_special_values_follow_the_documented_rules():
    """Zero blocks, inf saturation and NaN blocks, as reference/kv_cache.py states them."""
    x = torch.zeros(1, ref.LATENT)
    x[0, 16], x[0, 17] = float("inf"), 1.0  # fp4 block 1; mxfp8 block 0
    x[0, 64] = float("nan")  # fp4 block 4; mxfp8 block 2
    x[0, 96] = -0.0
    fp4 = ref.dequantize_kv(ref.quantize_kv(x.bfloat16(), "fp4"), "fp4")[0]
    assert fp4[16] == 2688.0 and fp4[:16].eq(0).all() and fp4[64:80].isnan().all() and not fp4[80:].isnan().any()
    assert torch.signbit(fp4[96])
    mxfp8 = ref.dequantize_kv(ref.quantize_kv(x.bfloat16(), "mxfp8"), "mxfp8")[0]
    assert mxfp8[16] == math.inf and mxfp8[17] == 0 and mxfp8[64:96].isnan().all() and not mxfp8[96:].isnan().any()


def test_record_sizes():
    """288 B (fp4) vs 528 B (mxfp8): 45% smaller, as the model reports."""
    assert (ref.FORMATS["fp4"].bytes, ref.FORMATS["mxfp8"].bytes) == (288, 528)
    assert round(1 - 288 / 528, 2) == 0.45


# ---------------------------------------------------------------- the cache write

GUARD = 4096  # sentinel bytes on each side of the cache


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", ["fp4", "mxfp8"])
def test_insert_writes_only_its_slots(fmt, backend):
    """A cache of strided pages inside a sentinel buffer; slots -1, out of range (unchecked mode: skipped) and the
    int32 extremes among valid ones: the valid slots get their records, no other byte of the buffer changes."""
    record, block_size, blocks = ref.FORMATS[fmt].bytes, 5, 4
    page = block_size * record + 7
    buffer = torch.full((2 * GUARD + blocks * page,), 0x5A, dtype=torch.uint8, device=DEVICE)
    cache = buffer[GUARD: GUARD + blocks * page].view(blocks, page)[:, : block_size * record].view(
        blocks, block_size, record)
    latent = torch.randn(8, ref.LATENT).to(torch.bfloat16).to(DEVICE)
    slots = torch.tensor([3, -1, 19, 2**31 - 1, -(2**31), 20, 0, -2], dtype=torch.int32, device=DEVICE)
    before = buffer.clone()
    with checks.checked(False):
        registry.get("kv_cache_insert").entry(cache, slots, latent, fmt, backend=backend)
    written = torch.zeros_like(buffer, dtype=torch.bool)
    rows = [(s // block_size, s % block_size) for s in (3, 19, 0)]
    for block, row in rows:
        start = GUARD + block * page + row * record
        written[start: start + record] = True
    assert torch.equal(buffer[~written], before[~written]), "a byte outside the written records changed"
    expected = ref.quantize_kv(latent[[0, 2, 6]].cpu(), fmt)
    for (block, row), want in zip(rows, expected):
        assert torch.equal(cache[block, row].cpu(), want)


def test_insert_checked_mode_refuses_bad_and_repeated_slots():
    op = registry.get("kv_cache_insert")
    inputs = op.make_inputs(CodecProblem(4, "fp4"), DEVICE, 0)
    capacity = inputs["cache"].shape[0] * inputs["cache"].shape[1]
    with checks.checked(True):
        bad = inputs["slots"].clone()
        bad[1] = capacity
        with pytest.raises(ValueError, match=rf"^slots\[1\] = {capacity} is out of range"):
            op.entry(**{**inputs, "slots": bad})
        bad[1] = bad[2] = 7
        with pytest.raises(ValueError, match="^slots repeats a slot"):
            op.entry(**{**inputs, "slots": bad})


def test_insert_is_a_mutating_custom_op():
    """The schema marks the cache as written (Tensor(a!)) and returns nothing; the custom op writes the cache."""
    op = registry.get("kv_cache_insert")
    overload = torch.ops.flashkern.kv_cache_insert.default
    assert overload._schema.arguments[0].alias_info.is_write and not overload._schema.returns
    inputs = op.make_inputs(CodecProblem(5, "mxfp8"), DEVICE, 1)
    expected = op.reference(**inputs)
    assert op.entry(**fresh(op, inputs)) is None
    overload(inputs["cache"], inputs["slots"], inputs["latent"], "mxfp8")
    op.compare(inputs, expected, inputs["cache"])


# ---------------------------------------------------------------- attention


def attention_cases():
    return ATTENTION.cases().map(on_device)


@pytest.mark.parametrize("backend", KERNELS)
@given(data=st.data())
def test_attention_matches_reference(backend, data):
    run_and_check(ATTENTION, data.draw(attention_cases()), backend)


@pytest.mark.parametrize("backend", KERNELS)
@fraction_of_examples(1 / 4)
@given(data=st.data())
def test_sampled_attention_configs_match_reference(backend, data):
    inputs = data.draw(attention_cases())
    impl = ATTENTION.implementation(backend)
    config = data.draw(st.sampled_from(impl.space.configs(ATTENTION.check(dict(inputs)), DEVICE.type)))
    note(f"config={config}")
    run_and_check(ATTENTION, inputs, backend, config)


def test_attention_comparison_can_fail():
    inputs = ATTENTION.make_inputs(ATTENTION.presets["smoke"][0], DEVICE, 0)
    expected = ATTENTION.reference(**inputs)
    out = expected.out.clone()
    out[0, 3, 100] += 0.05 + 0.02 * out[0, 3, 100].abs()
    with pytest.raises(AssertionError, match="^out: 1 of"):
        ATTENTION.compare(inputs, expected, expected._replace(out=out))
    with pytest.raises(AssertionError, match="^lse: 1 of"):
        ATTENTION.compare(inputs, expected, expected._replace(lse=expected.lse + torch.eye(*expected.lse.shape,
                                                                                            device=DEVICE) * 1e-3))


@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_is_close_to_unquantized_attention(backend):
    """Against attention on the original bf16 latents (no quantization), the cosine similarity of the whole output
    > 0.99: the upstream check of the FP4 cache's accuracy (FlashMLA's cal_diff over the tensor)."""
    gen = torch.Generator().manual_seed(5)
    tokens, heads, topk, window = 3, 16, 48, 16
    latent, window_latent = torch.randn(200, ref.LATENT, generator=gen), torch.randn(40, ref.LATENT, generator=gen)
    latent, window_latent = latent.bfloat16(), window_latent.bfloat16()
    indices = torch.rand(tokens, 200, generator=gen).argsort(dim=1)[:, :topk].int()
    swa_indices = torch.randint(0, 40, (tokens, window), generator=gen).int()
    q = torch.randn(tokens, heads, ref.LATENT, generator=gen).bfloat16()
    keys = torch.cat((latent[indices.long()], window_latent[swa_indices.long()]), dim=1).float()
    p = torch.softmax(torch.einsum("thd,tnd->thn", q.float(), keys) * ref.LATENT**-0.5, dim=-1)
    exact = torch.einsum("thn,tnd->thd", p, keys)
    inputs = on_device(dict(q=q, kv_cache=paged(ref.quantize_kv(latent, "fp4"), 16), indices=indices,
                            swa_cache=paged(ref.quantize_kv(window_latent, "mxfp8"), 16), swa_indices=swa_indices))
    out = ATTENTION.entry(**inputs, backend=backend).out.cpu().float()
    cosine = torch.nn.functional.cosine_similarity(out.flatten(), exact.flatten(), dim=0)
    assert cosine > 0.99, cosine


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_token_without_keys_gives_zero_and_the_sink(backend):
    problem = AttentionProblem(2, 20, 4, 8, swa=True, sink=True)
    inputs = ATTENTION.make_inputs(problem, DEVICE, 3)
    inputs["indices"][1], inputs["swa_indices"][1] = -1, -1
    result = ATTENTION.entry(**inputs, backend=backend)
    assert result.out[1].eq(0).all() and torch.equal(result.lse[1], inputs["sink"])
    no_sink = ATTENTION.entry(**{**inputs, "sink": None}, backend=backend)
    assert no_sink.out[1].eq(0).all() and no_sink.lse[1].eq(-math.inf).all()
    assert torch.isfinite(result.lse[0]).all()


@pytest.mark.parametrize("problem", ATTENTION.presets["smoke"] + (AttentionProblem(0, 5, 3, 4, swa=True),
                                                                  AttentionProblem(2, 0, 0, 4)))
@pytest.mark.parametrize("backend", KERNELS)
def test_attention_presets_and_empty_sizes(problem, backend):
    run_and_check(ATTENTION, ATTENTION.make_inputs(problem, DEVICE, 1), backend)


def _column(inputs):
    """An int32 [T] tensor (contiguous) for the window by position's arguments."""
    return inputs["indices"][:, 0].contiguous()


def _attention_inputs():
    return ATTENTION.make_inputs(AttentionProblem(2, 9, 3, 4, swa=True, sink=True), DEVICE, 0)


@pytest.mark.parametrize("change, error, message", [
    (lambda i: {"q": i["q"].float()}, TypeError, "^q must be bfloat16"),
    (lambda i: {"q": i["q"][..., :256]}, ValueError, r"^q must have shape \[\*, \*, 512\]"),
    (lambda i: {"q": torch.zeros(1, 129, 512, dtype=torch.bfloat16)}, ValueError, r"^H \(q.shape\[1\]\)=129"),
    (lambda i: {"kv_format": "fp8"}, ValueError, "^kv_format must be one of"),
    (lambda i: {"kv_cache": i["swa_cache"]}, ValueError, r"^kv_cache must have shape \[\*, \*, 288\]"),
    (lambda i: {"indices": i["indices"].long()}, TypeError, "^indices must be int32"),
    (lambda i: {"indices": i["indices"][:1]}, ValueError, r"^indices must have shape \[2, \*\]"),
    (lambda i: {"swa_indices": None}, ValueError, r"^swa_cache needs swa_indices or swa_block_table"),
    (lambda i: {"swa_cache": None}, ValueError, "^swa_indices needs swa_cache"),
    (lambda i: {"swa_block_table": i["indices"]}, ValueError, "^pass swa_indices or swa_block_table"),
    (lambda i: {"positions": _column(i)}, ValueError, "^positions belongs to the window by position"),
    (lambda i: {"window": 4}, ValueError, "^window belongs to the window by position"),
    (lambda i: {"swa_indices": None, "swa_block_table": i["indices"]}, ValueError,
     "^the window by position .swa_block_table. needs positions"),
    (lambda i: {"swa_indices": None, "swa_block_table": i["indices"], "positions": _column(i),
                "seq_ids": _column(i).long()}, TypeError, "^seq_ids must be int32"),
    (lambda i: {"swa_indices": None, "swa_block_table": i["indices"], "positions": _column(i),
                "seq_ids": _column(i), "window": 0}, ValueError, r"^window=0 must be in \[1, 65536\]"),
    (lambda i: {"swa_indices": None, "swa_block_table": i["indices"], "positions": _column(i),
                "seq_ids": _column(i), "swa_lower": i["indices"][0]}, ValueError,
     r"^swa_lower must have shape \[2\]"),
    (lambda i: {"sink": i["sink"][:2]}, ValueError, r"^sink must have shape \[4\]"),
    (lambda i: {"scale": -1.0}, ValueError, "^scale must be positive"),
    (lambda i: {"kv_cache": i["kv_cache"].transpose(0, 1)}, ValueError, "^kv_cache must hold its records packed"),
])
def test_bad_attention_arguments_are_named(change, error, message):
    inputs = _attention_inputs()
    with pytest.raises(error, match=message):
        ATTENTION.entry(**{**inputs, **change(inputs)})


def test_checked_mode_names_out_of_range_attention_indices():
    inputs = _attention_inputs()
    slots = inputs["kv_cache"].shape[0] * inputs["kv_cache"].shape[1]
    inputs["indices"][1, 2] = slots
    with checks.checked(True), pytest.raises(ValueError, match=rf"^indices\[1, 2\] = {slots} is out of range"):
        ATTENTION.entry(**inputs)


# ---------------------------------------------------------------- FlashMLA's V4.1 sparse-decode recipe, restated
# Their generator (tests/lib.py, generate_testcase_for_decode): q ~ randn clamped to [-1, 1]; keys ~ randn / 10 clamped
# to [-1, 1] through the caches (an FP8 main cache, an optional FP4 extra one: our window cache); scale 512^-0.55;
# sinks ~ randn, +inf where a second draw is > 0.5 and -inf where it is < -0.5; odd page sizes; all-invalid index rows;
# index rows cut short by a top-k length. Their comparator (tests/kernelkit, restated in our code below): every
# element within abs or rel of the reference, inf / -inf / NaN at the same places, and the cosine difference
# 1 - 2 sum(xy) / sum(x^2 + y^2) small.


def flashmla_mismatch(name, actual, expected, abs_tol, rel_tol, cos_diff_tol=None) -> str | None:
    """Why `actual` fails FlashMLA's comparison with `expected`, or None."""
    actual, expected = actual.float().clone(), expected.float().clone()
    for special in (math.inf, -math.inf, math.nan):
        at_actual = actual.isnan() if math.isnan(special) else actual == special
        at_expected = expected.isnan() if math.isnan(special) else expected == special
        if not torch.equal(at_actual, at_expected):
            return f"{name}: {special} at {int(at_actual.sum())} places, the reference {int(at_expected.sum())}"
        actual[at_actual], expected[at_expected] = 0.0, 0.0
    error = (actual - expected).abs()
    relative = error / (expected.abs() + 1e-6)
    bad = (error >= abs_tol) & (relative >= rel_tol)
    if bad.any():
        worst = int(error.masked_fill(~bad, 0).argmax())
        return (f"{name}: {int(bad.sum())} of {bad.numel()} elements off, worst {actual.flatten()[worst]} vs "
                f"{expected.flatten()[worst]}")
    x, y = actual.double(), expected.double()
    denominator = float((x * x + y * y).sum())
    cos_diff = 0.0 if denominator == 0 else 1 - 2 * float((x * y).sum()) / denominator
    if cos_diff_tol is not None and abs(cos_diff) > cos_diff_tol:
        return f"{name}: cosine difference {cos_diff:.3g} > {cos_diff_tol}"
    return None


def flashmla_recipe_cases():
    """(tokens, heads, topk, window, page, window page, sink, all-invalid rows, top-k length): their page sizes and
    top-k lengths, at sizes the interpreter runs in seconds."""
    return [(3, 64, 64, 0, 5, 0, False, False, False), (4, 64, 64, 64, 69, 5, True, False, True),
            (2, 128, 64, 0, 2, 0, True, False, False), (3, 64, 576, 64, 61, 123, True, True, False),
            (1, 64, 64, 64, 1, 1, True, False, True), (5, 16, 40, 8, 64, 7, True, False, False),
            (3, 64, 64, 64, 61, 53, True, True, True), (2, 128, 576, 0, 53, 0, True, True, False),
            (3, 32, 72, 40, 3, 53, False, True, True), (4, 64, 16, 16, 17, 2, True, True, False),
            (2, 64, 128, 0, 64, 0, True, False, True), (1, 128, 8, 8, 9, 9, True, True, False)]


def flashmla_recipe_inputs(tokens, heads, topk, window, page, window_page, sink, all_invalid, topk_length, seed):
    gen = torch.Generator().manual_seed(seed)

    def cache(rows, fmt, block_size):
        latent = (torch.randn(rows, ref.LATENT, generator=gen) / 10).clamp(-1, 1).bfloat16()
        return paged(ref.quantize_kv(latent, fmt), block_size, fill=0xFF)  # slots past the rows decode to NaN

    def index_rows(count, rows):
        chosen = torch.stack([torch.randperm(rows, generator=gen)[:count] for _ in range(tokens)]).int()
        if topk_length:  # entries past each row's length are padding
            chosen[torch.arange(count)[None, :] >= torch.randint(0, count + 1, (tokens, 1), generator=gen)] = -1
        if all_invalid:
            chosen[0] = -1
        return chosen

    slots = 2 * topk + 11
    inputs = dict(q=torch.randn(tokens, heads, ref.LATENT, generator=gen).clamp(-1, 1).bfloat16(),
                  kv_cache=cache(slots, "mxfp8", page), indices=index_rows(topk, slots), swa_cache=None,
                  swa_indices=None, sink=None, scale=ref.LATENT**-0.55, kv_format="mxfp8", swa_format="fp4")
    if window:
        inputs |= dict(swa_cache=cache(window + 5, "fp4", window_page), swa_indices=index_rows(window, window + 5))
    if sink:
        logits, draw = torch.randn(heads, generator=gen), torch.randn(heads, generator=gen)
        inputs["sink"] = logits.masked_fill(draw > 0.5, math.inf).masked_fill(draw < -0.5, -math.inf)
    return on_device(inputs)


def gpu_default(backend: str, inputs: dict, tokens: int | None = None) -> dict:
    """The config the GPU would run `inputs` with (split keys and a combine where the CPU default has one split), or
    with `tokens` query tokens of the same heads and caches (4096: the prefill tile, 64 heads and 32 keys a block)."""
    problem = ATTENTION.check(dict(inputs))
    if tokens is not None:
        problem = dataclasses.replace(problem, tokens=tokens)
    with flashkern.planning_for_gpu():
        return ATTENTION.implementation(backend).default_config(problem)


# the configs the recipe runs in, per backend: the decode batch's default differs from T's only in TileLang
RECIPE_CONFIGS = {"triton": ("default", "gpu default", "gpu prefill default"),
                  "tilelang": ("default", "gpu default", "gpu batch default", "gpu prefill default")}


@pytest.mark.parametrize(("backend", "case", "config"), [
    (backend, case, config) for backend in KERNELS
    for case, config in staggered(range(len(flashmla_recipe_cases())), RECIPE_CONFIGS[backend])])
def test_flashmla_sparse_decode_recipe(case, backend, config):
    """FlashMLA's V4.1 sparse-decode test (tests/test-sparse-decode.py), restated: out within 1e-3 abs or 2.01/128
    rel with a cosine difference under 5e-6, lse within 1e-6 abs or 8.01/65536 rel, specials identical; in this
    device's default config and in the GPU's, at these tokens, at a decode batch's (64) and at prefill's. A narrow
    run gives each case one config (kernels.cases.staggered), every config three cases."""
    inputs = flashmla_recipe_inputs(*flashmla_recipe_cases()[case], seed=case)
    expected = ATTENTION.reference(**fresh(ATTENTION, inputs))
    chosen = {"default": None, "gpu default": gpu_default(backend, inputs),
              "gpu batch default": gpu_default(backend, inputs, tokens=64),  # TileLang: 16-head combine blocks
              "gpu prefill default": gpu_default(backend, inputs, tokens=4096)}[config]
    actual = ATTENTION.result_of(fresh(ATTENTION, inputs), backend=backend, config=chosen)
    failures = [flashmla_mismatch("out", actual.out, expected.out, 1e-3, 2.01 / 128, 5e-6),
                flashmla_mismatch("lse", actual.lse, expected.lse, 1e-6, 8.01 / 65536)]
    assert not any(failures), failures


def test_the_flashmla_comparison_can_fail():
    x = torch.linspace(-2, 2, 1000)
    assert flashmla_mismatch("x", x, x, 1e-3, 0.01, 5e-6) is None
    assert "1 of 1000" in flashmla_mismatch("x", x + torch.eye(1, 1000)[0] * 0.1, x, 1e-3, 0.01)
    assert "inf at 3 places" in flashmla_mismatch("x", torch.where(x > 1.99, math.inf, x), x, 1e-3, 0.01)
    assert "nan at 0 places" in flashmla_mismatch("x", x, torch.where(x > 1.99, math.nan, x), 1e-3, 0.01)
    assert "-inf at 0 places" in flashmla_mismatch("x", x, torch.where(x < -1.99, -math.inf, x), 1e-3, 0.01)
    assert "cosine" in flashmla_mismatch("x", x * (1 + 0.005 * torch.sign(x)), x, 1e-3, 0.01, 5e-6)


@pytest.mark.parametrize("backend", KERNELS)
def test_softmax_weights_are_rounded_to_the_nearest_bf16(backend):
    """One-hot keys (key j is 1 at column j, which mxfp8 stores exactly) make out[h, j] = bf16(bf16(p_j) / d): the
    weight rounded to the nearest bf16 (ties to even) before the PV product, d the sum of the unrounded weights
    (docs/operators.md section 8). Truncating the weights instead changes about a quarter of the outputs; 1% may
    differ (a GPU's exp is not torch's in the last bits)."""
    heads, keys = 64, 16
    latent = torch.zeros(keys, ref.LATENT)
    latent[torch.arange(keys), torch.arange(keys)] = 1.0
    q = torch.zeros(1, heads, ref.LATENT)
    q[0, :, :keys] = torch.rand(heads, keys, generator=torch.Generator().manual_seed(0)) * 6 - 3
    q = q.bfloat16()
    inputs = dict(q=q, kv_cache=paged(ref.quantize_kv(latent.bfloat16(), "mxfp8"), 16),
                  indices=torch.arange(keys, dtype=torch.int32)[None], swa_cache=None, swa_indices=None, sink=None,
                  scale=1.0, kv_format="mxfp8", swa_format="mxfp8")
    s = q[0, :, :keys].float()
    p = torch.exp(s - s.max(dim=1, keepdim=True).values)
    d = p.sum(dim=1, keepdim=True)
    nearest = (p.bfloat16().float() / d).bfloat16()
    truncated = ((p.view(torch.int32) & -65536).view(torch.float32) / d).bfloat16()
    assert (truncated != nearest).float().mean() > 0.2  # the two roundings are told apart
    out = ATTENTION.entry(**on_device(inputs), backend=backend).out[0, :, :keys].cpu()
    assert (out != nearest).float().mean() < 0.01
