"""Hypothesis strategies of KV-cache inputs, shared by tests/test_kv_cache.py and `flashkern check`.

Each strategy draws one input dict of CPU tensors (callers move them to their device) with the keyword arguments of
the entry point; tensors come from a drawn seed, so failures shrink to small shapes; note() describes each case.
  codec_cases(op)   quantize_kv / dequantize_kv / kv_cache_insert: the format, odd row counts (0 included) and
                    latent values (VALUE_MODES): normal at any scale, exact rounding ties of both grids, constant
                    blocks, extremes (+-inf, NaN, +-0, bf16 subnormals, the largest bf16); dequantize_kv also reads
                    arbitrary bytes (every code and scale byte, NaN scales included); kv_cache_insert writes into
                    a cache of garbage bytes with odd page sizes, -1 slots and some pages strided.
  attention_cases() sparse_decode_attention: tokens, heads, top-k and window sizes off every tile, both formats
                    in either cache, sink and scale or not (narrow runs, kernels/cases.py: heads, formats, window
                    and sink as the presets have them), index patterns (INDEX_MODES: random, all padding,
                    duplicates, the same slot in both caches, mostly padding), peaked or extreme scores, the
                    window by slots or by position (sequences of odd lengths, shuffled odd-sized pages, missing
                    pages, replay bounds); every slot no token selects holds a record that decodes to NaN, so a
                    read of an unused slot shows.
"""

from __future__ import annotations

import torch
from hypothesis import note
from hypothesis import strategies as st

from flashkern.kernels.cases import preset_pool, seeded, specialization
from flashkern.kernels.kv_cache.problem import paged, window_table
from flashkern.reference import kv_cache as ref
from flashkern.reference.formats import E2M1_GRID
from flashkern.reference.kv_cache import FORMATS, LATENT

VALUE_MODES = ("normal", "ties", "constant", "extreme")
INDEX_MODES = ("random", "all_padding", "duplicates", "same_slot", "mostly_padding")
E2M1_TIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)  # midpoints of the e2m1 grid (docs/operators.md 8.1)


def _ties(gen: torch.Generator, rows: int, fmt: str) -> torch.Tensor:
    """Blocks whose scale is an exact power of two and whose values land on rounding midpoints of the code grid."""
    group = FORMATS[fmt].group
    blocks = rows * LATENT // group
    power = torch.randint(-8, 8, (blocks, 1), generator=gen).float().exp2()
    sign = torch.where(torch.rand(blocks, group, generator=gen) < 0.5, -1.0, 1.0)
    if fmt == "fp4":  # amax = 6 * 2^k: sf = 2^k, so x / sf is an e2m1 midpoint (or a grid value)
        table = torch.tensor(E2M1_TIES + E2M1_GRID)
        values = table[torch.randint(0, len(table), (blocks, group), generator=gen)]
        values[:, 0] = 6.0
    else:  # amax = 448 * 2^k: scale 2^k; e4m3 midpoints m + 1/16 ulp steps of 8-bit bf16 values
        mantissa = torch.randint(0, 16, (blocks, group), generator=gen).float() / 16  # 4 bits: every 2nd a midpoint
        exponent = torch.randint(-9, 9, (blocks, group), generator=gen).float()
        values = ((1 + mantissa) * exponent.exp2()).clamp(max=448.0)
        values[:, 0] = 448.0
    return (values * sign * power).view(rows, LATENT)


def _extreme(gen: torch.Generator, rows: int) -> torch.Tensor:
    """Normal values with +-inf, NaN, +-0, bf16 subnormals, the largest bf16 and tiny normals sprinkled in."""
    x = torch.randn(rows, LATENT, generator=gen)
    specials = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 1e-40, -3e-39, 3.38e38,
                             -3.38e38, 2.0**-126])
    pick = torch.randint(0, 60, (rows, LATENT), generator=gen)
    return torch.where(pick < len(specials), specials[pick.clamp(max=len(specials) - 1)], x)


def latent_values(gen: torch.Generator, rows: int, fmt: str, mode: str) -> torch.Tensor:
    if mode == "ties":
        x = _ties(gen, rows, fmt)
    elif mode == "constant":
        x = torch.randn(rows, LATENT // 16, 1, generator=gen).expand(-1, -1, 16).reshape(rows, LATENT)
    elif mode == "extreme":
        x = _extreme(gen, rows)
    else:
        scale = torch.randint(-20, 20, (rows, 1), generator=gen).float().exp2()
        x = torch.randn(rows, LATENT, generator=gen) * scale
    return x.to(torch.bfloat16)


def _maybe_strided(draw, x: torch.Tensor, label: str) -> torch.Tensor:
    """x, or the same values as a column slice of a wider buffer (a row stride past the row's end)."""
    if not draw(st.booleans(), label=f"{label} strided"):
        return x
    wide = torch.zeros(x.shape[0], x.shape[1] + 16, dtype=x.dtype)
    wide[:, 8: 8 + x.shape[1]] = x
    return wide[:, 8: 8 + x.shape[1]]


def garbage_cache(gen: torch.Generator, slots: int, block_size: int, fmt: str, strided: bool) -> torch.Tensor:
    """A paged cache of random bytes, holding at least `slots` slots; with a page stride past the page's end if
    asked (a slice of larger pages)."""
    blocks, record = -(-max(slots, 1) // block_size), FORMATS[fmt].bytes
    pad = 3 * record if strided else 0
    pages = torch.randint(0, 256, (blocks, block_size * record + pad), generator=gen, dtype=torch.uint8)
    return pages[:, : block_size * record].view(blocks, block_size, record)


@st.composite
def codec_cases(draw, op_name: str) -> dict:
    fmt = draw(st.sampled_from(tuple(FORMATS)), label="format")
    rows = draw(st.sampled_from([0, 1, 2, 5, 17, 33]), label="rows")
    mode = draw(st.sampled_from(VALUE_MODES), label="values")
    gen = seeded(draw, 2**16)
    latent = latent_values(gen, rows, fmt, mode)
    note(f"{op_name}: {rows} rows, {fmt}, {mode} values")
    if op_name == "quantize_kv":
        return dict(latent=_maybe_strided(draw, latent, "latent"), format=fmt)
    if op_name == "dequantize_kv":
        records = ref.quantize_kv(latent, fmt)
        if draw(st.booleans(), label="random bytes"):  # every code and scale byte, NaN scales included
            records = torch.randint(0, 256, records.shape, generator=gen, dtype=torch.uint8)
        return dict(records=_maybe_strided(draw, records, "records"), format=fmt)
    block_size = draw(st.sampled_from([1, 3, 16, 64]), label="block_size")
    cache = garbage_cache(gen, 2 * rows + 3, block_size, fmt, draw(st.booleans(), label="strided pages"))
    capacity = cache.shape[0] * block_size
    slots = torch.randperm(capacity, generator=gen)[:rows].int()
    slots[torch.rand(rows, generator=gen) < 0.2] = -1
    note(f"cache {list(cache.shape)} (page stride {cache.stride(0)}), slots {slots.tolist()}")
    return dict(cache=cache, slots=slots, latent=_maybe_strided(draw, latent, "latent"), format=fmt)


def _indices(gen: torch.Generator, tokens: int, width: int, slots: int, mode: str) -> torch.Tensor:
    """[tokens, width] int32 slots of a cache with `slots` slots, drawn per INDEX_MODES (-1 padding)."""
    if mode == "all_padding" or slots == 0:
        return torch.full((tokens, width), -1, dtype=torch.int32)
    if mode == "duplicates":  # few distinct slots, each listed several times
        values = torch.randint(0, min(slots, 3), (tokens, width), generator=gen)
    else:
        values = torch.rand(tokens, max(slots, width), generator=gen).argsort(dim=1)[:, :width] % slots
    padding = torch.rand(tokens, width, generator=gen) < (0.8 if mode == "mostly_padding" else 0.1)
    return torch.where(padding, -1, values).int()


def _poison_unused(cache: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Every slot no index selects holds 0xFF bytes (NaN scales: a NaN row if it were read)."""
    rows = cache.reshape(-1, cache.shape[-1]).clone()
    used = torch.zeros(rows.shape[0], dtype=torch.bool)
    used[indices[indices >= 0].long()] = True
    rows[~used] = 0xFF
    return rows.view(cache.shape)


def _window_by_position(draw, gen: torch.Generator, tokens: int, window: int | None, fmt: str) -> dict:
    """The window by position: 1-3 sequences of drawn lengths (some shorter than the window), each token at a
    random position of a random sequence, the window cache's pages shuffled (odd page sizes: windows cross pages),
    some table entries -1 if drawn, per-sequence lower bounds inside, below or above the windows if drawn; every
    slot no window reaches decodes to NaN."""
    keys = ref.WINDOW if window is None else window
    block_size = draw(st.sampled_from([1, 3, 16, 64]), label="window block_size")
    lengths = [draw(st.integers(1, 2 * keys + 40), label="sequence length") for _ in
               range(draw(st.integers(1, 3), label="sequences"))]
    seq_ids = torch.randint(0, len(lengths), (tokens,), generator=gen)
    positions = (torch.rand(tokens, generator=gen) * torch.tensor(lengths)[seq_ids]).long()
    table, pages = window_table(gen, [0] * len(lengths), [n - 1 for n in lengths], block_size, spare=2)
    if draw(st.booleans(), label="missing pages"):
        table[torch.rand(table.shape, generator=gen) < 0.2] = -1
    lower = None
    if draw(st.booleans(), label="lower bounds"):
        lower = torch.tensor([draw(st.integers(-3, n + 2), label="lower") for n in lengths], dtype=torch.int32)
    cache = paged(ref.quantize_kv(latent_values(gen, pages * block_size, fmt, "normal"), fmt), block_size)
    inputs = dict(swa_block_table=table, positions=positions.int(), seq_ids=seq_ids.int(), window=window,
                  swa_lower=lower)
    slots = ref.window_slots(inputs["positions"], inputs["seq_ids"], table, block_size, keys, lower)
    note(f"window by position: lengths {lengths}, block {block_size}, seq_ids {seq_ids.tolist()}, positions "
         f"{positions.tolist()}, lower {None if lower is None else lower.tolist()}")
    return {**inputs, "swa_cache": _poison_unused(cache, slots)}


@st.composite
def attention_cases(draw) -> dict:
    heads, kv_format, swa_format, swa, sink, by_position = specialization(
        draw, st.tuples(st.sampled_from([1, 3, 8, 16, 64]), st.sampled_from(tuple(FORMATS)),
                        st.sampled_from(tuple(FORMATS)), st.booleans(), st.booleans(), st.booleans()),
        preset_pool("sparse_decode_attention",
                    lambda p: (p.heads, p.kv_format, p.swa_format, p.swa, p.sink, p.window_by_position)))
    tokens = draw(st.sampled_from([1, 1, 2] + ([] if heads == 64 else [3, 5])), label="tokens")  # 64 heads: CPU time
    topk = draw(st.sampled_from([1, 7, 16, 37, 64, 80]), label="topk")
    by_position &= swa
    if by_position:
        window = draw(st.sampled_from([1, 5, 16, 23, None]), label="window")  # None: the default, 128
    else:
        window = draw(st.sampled_from([0, 1, 5, 16, 23]), label="window") if swa else None
    mode = draw(st.sampled_from(INDEX_MODES), label="indices")
    values = draw(st.sampled_from(["normal", "peaked", "extreme"]), label="values")
    block_size = draw(st.sampled_from([1, 16, 64]), label="block_size")
    gen = seeded(draw, 2**16)

    kv_slots = draw(st.sampled_from([topk, topk + 9, 3 * topk]), label="kv slots")
    latent = latent_values(gen, kv_slots, kv_format, "extreme" if values == "extreme" else "normal")
    kv_cache = paged(ref.quantize_kv(latent, kv_format), block_size, fill=0xFF)
    indices = _indices(gen, tokens, topk, kv_slots, mode)
    q = torch.randn(tokens, heads, LATENT, generator=gen) * (30.0 if values == "peaked" else 1.0)
    inputs = dict(q=q.to(torch.bfloat16), kv_cache=_poison_unused(kv_cache, indices), indices=indices,
                  swa_cache=None, swa_indices=None, swa_block_table=None, positions=None, seq_ids=None, window=None,
                  swa_lower=None, kv_format=kv_format, swa_format=swa_format,
                  sink=torch.randn(heads, generator=gen) * 2 if sink else None,
                  scale=draw(st.sampled_from([None, 0.01, 0.125]), label="scale"))
    if by_position:
        inputs.update(_window_by_position(draw, gen, tokens, window, swa_format))
    elif window is not None:
        swa_slots = max(kv_slots if mode == "same_slot" else window + tokens, 1)
        swa_latent = latent_values(gen, swa_slots, swa_format, "normal")
        swa_indices = indices[:, :window].clone() if mode == "same_slot" and window <= topk else \
            _indices(gen, tokens, window, swa_slots, mode)
        inputs["swa_cache"] = _poison_unused(paged(ref.quantize_kv(swa_latent, swa_format), block_size), swa_indices)
        inputs["swa_indices"] = swa_indices
    note(f"T={tokens} H={heads} topk={topk} window={window} {kv_format}/{swa_format} {mode} indices, {values} values, "
         f"block {block_size}, sink {inputs['sink'] is not None}, scale {inputs['scale']}")
    return inputs

