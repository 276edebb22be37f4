"""The performance model (flashkern.model) against public kernels whose authors publish Hopper timings.

TileLang's own examples are built and modelled exactly as flashkern's TileLang kernels are: lowered for sm_90a,
built with nvcc (resources, PTX census, SASS issue: kernels/sass), their traffic counted from the lowered
program (kernels/_tilelang/traffic), then `model.predict` with the authors' own FLOP count. Their code is read
from a TileLang checkout you name (never copied here); the figures quoted below are the authors'. Where an
example computes the same operator as ours, both are modelled in the same run and the ratio printed (item 6 of
issue 24: the gap as a ratio of predicted times).

Run (about 15 minutes on 2 cores), from the repository root, with a checkout of tile-ai/tilelang:
    python benchmarks/model_calibration.py --tilelang PATH --markdown docs/model-calibration.md \\
        --json docs/model-calibration.json
PATH holds `examples/` and `benchmark/` (the figures below were checked against commit a35008a4).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.machinery
import importlib.util
import json
import math
import sys
import time
import types
from dataclasses import dataclass, field
from pathlib import Path

import flashkern  # noqa: F401  (Triton's mode before any kernel module)
import torch

from flashkern import model
from flashkern.kernels import build
from flashkern.registry import Cost


@dataclass(frozen=True)
class Kernel:
    """One launch of a public example: its file, the @tilelang.jit object, and the arguments at the figure's shape
    (tensors as (shape, dtype) pairs; the walk needs only their shapes)."""

    file: str
    factory: str
    args: tuple
    kwargs: dict = field(default_factory=dict)
    outputs: tuple = ()  # (shape, dtype) of the output parameters that follow the inputs


@dataclass(frozen=True)
class Case:
    name: str
    kernels: tuple[Kernel, ...]
    device: str  # the model's device for the GPU the figure was measured on (H800 = H100's memory and math)
    flops: float  # the authors' FLOP count at this shape
    min_bytes: float
    published_tflops: float | None
    source: str  # where the figure is published, and on which GPU
    ours: tuple = ()  # (operator, problem, FLOPs of ours at that problem) for the side-by-side ratio
    note: str = ""
    shape: str = ""


def _t(*shape, dtype="bfloat16"):
    return (shape, dtype)


def _bytes(*tensors) -> float:
    return float(sum(math.prod(shape) * torch.empty(0, dtype=getattr(torch, dtype)).element_size()
                     for shape, dtype in tensors))


def _sparse_mla_fwd(file, kwargs, published, source, B=1, S=4096, SKV=8192, H=128, DQK=576, DV=512, topk=2048):
    inputs = (_t(B, S, H, DQK), _t(B, SKV, 1, DQK), _t(B, S, 1, topk, dtype="int32"))
    outputs = (_t(B, S, H, DV), _t(B, S, H, dtype="float32"))
    pipelined = file.endswith("pipelined.py")
    args = (*inputs, *((_t(1, dtype="int32"),) if pipelined else ()), H, DV, DQK - DV, topk,
            *((1,) if pipelined else ()), 1, None, True, *((False,) if pipelined else ()))
    flops = B * S * (DQK + DV) * topk * 2 * H
    from flashkern.kernels.kv_cache.problem import AttentionProblem

    ours = AttentionProblem(S, 512, 128, 64, swa=True, sink=True)  # V4.1: 64 heads, top-512 + window 128
    return Case(Path(file).stem, (Kernel(file, "sparse_mla_fwd", args, kwargs, outputs),), "h100", flops,
                _bytes(*inputs, *outputs), published, source,
                shape=f"B {B}, S {S}, SKV {SKV}, H {H}, DQK {DQK}, DV {DV}, topk {topk}, bf16",
                ours=("sparse_decode_attention", ours, S * 64 * (512 + 128) * 2 * (512 + 512)),
                note="ours: FP4 top-512 + MXFP8 window 128, 64 heads, 512-wide latent (K = V)")


def _sparse_mla_bwd(device, published, source, B=1, S=4096, SKV=8192, H=64, DQKV=576, DV=512, topk=2048):
    file = "examples/deepseek_v32/sparse_mla_bwd.py"
    q, kv, do = _t(B, S, H, DQKV), _t(B, SKV, 1, DQKV), _t(B, S, H, DV)
    indices, lse = _t(B, S, 1, topk, dtype="int32"), _t(B, S, H, dtype="float32")
    dkv = _t(B, SKV, 1, DQKV, dtype="float32")
    kernels = (Kernel(file, "preprocess", (do, do), outputs=(lse,)),
               Kernel(file, "bwd", (q, kv, do, indices, lse, lse, dkv, H, DV, DQKV - DV, topk, 1, None, True),
                      outputs=(q,)),
               Kernel(file, "postprocess", (dkv, DV, DQKV - DV, 1), outputs=(kv,)))
    flops = 2 * (2 * H * DV * topk + 3 * H * DQKV * topk) * S
    return Case(f"sparse_mla_bwd ({device})", kernels, device, flops, _bytes(q, kv, do, do, indices, q, kv),
                published, source, shape=f"B {B}, S {S}, SKV {SKV}, H {H}, DQKV {DQKV}, DV {DV}, topk {topk}, bf16; "
                "preprocess + bwd + postprocess", note="bwd accumulates dKV with fp32 atomics")


def _mla_decode(batch, kv_ctx, published, H=128, dim=512, pe=64):
    file = "examples/deepseek_mla/example_mla_decode.py"
    args = (batch, H, 1, kv_ctx, dim, pe, 64, 64, 1, (dim + pe) ** -0.5)
    flops = 2 * batch * H * kv_ctx * (dim + pe) + 2 * batch * H * kv_ctx * dim
    tensors = (_t(batch, H, dim, dtype="float16"), _t(batch, H, pe, dtype="float16"),
               _t(batch, kv_ctx, 1, dim, dtype="float16"), _t(batch, kv_ctx, 1, pe, dtype="float16"),
               _t(batch, H, dim, dtype="float16"))
    return Case(f"mla_decode b{batch} kv{kv_ctx}", (Kernel(file, "flashattn", args),), "h100", flops,
                _bytes(*tensors), published, "examples/deepseek_mla figures bs64/bs128_float16.png (H100), read off "
                "the plot (+-5 TFLOPS)", shape=f"batch {batch}, heads {H}, kv {kv_ctx}, dim {dim} + {pe}, fp16, "
                "no split")


def _matmul(folder, dtype, K, published, M=8192, N=8192):
    config = dict(block_M=128, block_N=256, block_K=64 if dtype == "float16" else 128, num_stages=3, thread_num=256,
                  enable_rasteration=True)
    file = f"benchmark/{folder}/benchmark_matmul.py"
    element = 2 if dtype == "float16" else 1
    return Case(f"{folder} {M}x{N}x{K}", (Kernel(file, "matmul", (M, N, K, False), {**config, "policy": "square"}),),
                "h100", 2 * M * N * K, float(element * (M * K + N * K) + 2 * M * N), published,
                f"benchmark/{folder}/README.md (H800 SXM)", shape=f"M {M}, N {N}, K {K}, {dtype}, B transposed",
                note="the autotuned winner is not published: 128x256 tiles, 3 stages, 256 threads assumed")


def _mamba2_chunk_scan(seq_len, published, batch=8, heads=80, groups=1, chunk=256, dim=64, dstate=128):
    file = "benchmark/mamba2/benchmark_mamba_chunk_scan.py"
    chunks = seq_len // chunk
    tensors = (_t(batch, chunks, groups, chunk, chunk, dtype="float16"),
               _t(batch, seq_len, heads, dim, dtype="float16"),
               _t(batch, heads, chunks, chunk, dtype="float16"), _t(batch, heads, chunks, chunk, dtype="float16"),
               _t(batch, seq_len, groups, dstate, dtype="float16"),
               _t(batch, chunks, heads, dim, dstate, dtype="float16"), _t(heads, dtype="float16"),
               _t(batch, seq_len, heads, dim, dtype="float16"))
    flops = 2 * batch * seq_len * chunk * heads * dim * 0.5 + 2 * batch * seq_len * heads * dim * dstate
    return Case(f"mamba2_chunk_scan L{seq_len}", (Kernel(file, "chunk_scan_fwd",
                                                         (batch, seq_len, chunk, groups, heads, dim, dstate)),),
                "h100", flops, _bytes(*tensors), published, "benchmark/mamba2/README.md (H800 SXM)",
                shape=f"batch {batch}, seqlen {seq_len}, heads {heads}, groups {groups}, chunk {chunk}, dim {dim}, "
                f"dstate {dstate}, fp16", note="the autotuned winner is not published: the factory's defaults "
                "(64x64x64 tiles, 2 stages, 128 threads) assumed")


def cases() -> list[Case]:
    from flashkern.kernels.indexer.problem import Indexer, LogitsProblem, TopkProblem

    readme = "examples/deepseek_v32/README.md"
    found = [
        _sparse_mla_fwd("examples/deepseek_v32/sparse_mla_fwd_pipelined.py", {}, 600.0, f"{readme} (H800 SXM)"),
        _sparse_mla_fwd("examples/deepseek_v32/sparse_mla_fwd.py", dict(block_I=64, num_stages=2, threads=256), None,
                        "no figure published"),
        _sparse_mla_bwd("h100", 100.0, f"{readme} (H800 SXM)"),
        _sparse_mla_bwd("h200", 115.0, f"{readme} (H200 SXM)"),
        _mla_decode(64, 1024, 322.0), _mla_decode(64, 8192, 455.0), _mla_decode(128, 4096, 445.0),
        _mla_decode(128, 32768, 445.0),
        _matmul("matmul", "float16", 1024, 628.0), _matmul("matmul", "float16", 8192, 758.0),
        _matmul("matmul_fp8", "float8_e4m3fn", 1024, 1129.0), _matmul("matmul_fp8", "float8_e4m3fn", 8192, 1507.0),
        _mamba2_chunk_scan(1024, 126.477), _mamba2_chunk_scan(8192, 134.362), _mamba2_chunk_scan(32768, 135.379),
    ]
    S, SKV, H, D = 4096, 8192, 32, 64
    indexer_inputs = (_t(S * H, D, dtype="float8_e4m3fn"), _t(SKV, D, dtype="float8_e4m3fn"),
                      _t(SKV, dtype="float32"), _t(S, H, dtype="float32"), _t(S, dtype="int32"), _t(S, dtype="int32"))
    found.append(Case("fp8_lighting_indexer", (Kernel("examples/deepseek_v32/fp8_lighting_indexer.py",
                                                      "mqa_attn_return_logits", indexer_inputs,
                                                      outputs=(_t(S, SKV, dtype="float32"),)),),
                      "h200", 2 * S * SKV * H * D, _bytes(*indexer_inputs, _t(S, SKV, dtype="float32")), None,
                      "no figure published (FLOPs: every (q, kv) pair valid)",
                      ours=("mqa_logits", LogitsProblem(S, SKV, Indexer(H, 128)), 2 * S * SKV * H * 128),
                      shape=f"S {S}, SKV {SKV}, H {H}, D {D}, fp8",
                      note="ours at D = 128 (V4.1's indexer), the anchor at its default D = 64; the ratio is per FLOP"))
    rows, positions, k = 64, 32768, 2048
    topk_inputs = (_t(rows, positions, dtype="float32"), _t(rows, k, dtype="int32"), _t(rows, dtype="int32"),
                   _t(rows, dtype="int32"))
    found.append(Case("topk_selector", (Kernel("examples/deepseek_v32/topk_selector.py", "tl_topk_impl", topk_inputs),),
                      "h200", 0.0, _bytes(*topk_inputs), None, "no figure published",
                      shape=f"{rows} rows x {positions}, k {k}, fp32",
                      ours=("topk_indices", TopkProblem(rows, positions, k), 0.0)))
    return found


# ---------------------------------------------------------------- building and modelling a public kernel

def _import(root: Path, file: str):
    path = root / file
    name = "calibration_" + "_".join(Path(file).with_suffix("").parts)
    if name in sys.modules:
        return sys.modules[name]
    sys.path.insert(0, str(path.parent))  # the examples import their siblings (utils.py)
    for module, names in _BASELINE_IMPORTS.items():
        _stub(module, names)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]  # a failed import is reported once per case, not half-imported for the next
        raise
    return module


# What the examples import for their torch references and baselines, which their TileLang kernels do not use: stood
# in for by empty modules where not installed.
_BASELINE_IMPORTS = {"einops": ("rearrange", "repeat", "einsum"),
                     "mamba_ssm.ops.triton.ssd_chunk_scan": ("_chunk_scan_fwd",),
                     "helion._testing": ("run_example",), "helion.language": ()}


def _stub(module: str, names: tuple):
    """An empty `module` (and its parents) with `names` set to None, unless the real one is importable."""
    found = importlib.util.find_spec(module.partition(".")[0])
    if found is not None and found.loader is not None:  # installed (a stub has no loader)
        return
    parent = None
    for depth in range(1, module.count(".") + 2):
        name = ".".join(module.split(".")[:depth])
        stub = sys.modules.get(name)
        if stub is None:
            stub = sys.modules[name] = types.ModuleType(name)
            stub.__spec__ = importlib.machinery.ModuleSpec(name, None)
        if parent is not None:
            setattr(parent, name.rpartition(".")[2], stub)
        parent = stub
    for attribute in names:
        setattr(parent, attribute, None)


def _is_tensor(value) -> bool:
    """A (shape, dtype name) pair from `_t`."""
    return isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], tuple) and isinstance(value[1], str)


def _argument(value, device):
    return torch.empty(value[0], dtype=getattr(torch, value[1]), device=device) if _is_tensor(value) else value


_TORCH_DTYPES = {"float8_e4m3": torch.float8_e4m3fn}  # TileLang's buffer dtype names where torch's differ


def model_kernel(root: Path, kernel: Kernel):
    """(build report with the issue profile, traffic) of one public kernel at its shape."""
    import tilelang.language as T
    from tilelang import tvm

    from flashkern.kernels._tilelang import build_sm90, traffic

    factory = getattr(_import(root, kernel.file), kernel.factory)
    factory = getattr(factory, "jit_impl", factory)  # under @autotune
    kwargs = {k: (T.GemmWarpPolicy.Square if v == "square" else v) for k, v in kernel.kwargs.items()}
    with tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}):
        func = factory.get_tir(*(_argument(a, "meta") for a in kernel.args), **kwargs)
    pass_configs = dict(factory.pass_configs or {})
    with build.profiling_issue():
        report = build_sm90(func, pass_configs)
    tensors = [_argument(a, "cpu") for a in (*kernel.args, *kernel.outputs) if _is_tensor(a)]
    params = [p for p in func.params if p in func.buffer_map]
    if len(tensors) != len(params):  # lazy factories (sizes as ints) allocate every buffer from its static shape
        dtypes = [str(func.buffer_map[p].dtype) for p in params]
        tensors = [torch.empty([int(d) for d in func.buffer_map[p].shape],
                               dtype=_TORCH_DTYPES.get(dtype) or getattr(torch, dtype)) for p, dtype in zip(params, dtypes)]
    return report, traffic.measure(func, tensors, pass_configs)


def run(root: Path, names=None, log=print) -> list[dict]:
    results = []
    for case in cases():
        if names and not any(n in case.name for n in names):
            continue
        start = time.perf_counter()
        device = model.DEVICES[case.device]
        try:
            stages = [model_kernel(root, kernel) for kernel in case.kernels]
            p = model.predict(Cost(flops=case.flops, bytes=case.min_bytes, math="bf16"), stages, device)
            row = dict(case=case.name, device=device.name, source=case.source, note=case.note, shape=case.shape,
                       published_tflops=case.published_tflops, flops=case.flops,
                       kernel_seconds=p.kernel_seconds, bound=p.bound,
                       terms=[{k: v for k, v in s.terms.items()} for s in p.stages],
                       ctas=[s.traffic.ctas for s in p.stages], threads=[s.report.threads for s in p.stages],
                       registers=[s.report.registers for s in p.stages], exact=all(s.traffic.exact for s in p.stages),
                       traced=all(s.issue is not None and s.issue.traced for s in p.stages))
            if case.flops:
                row["model_tflops"] = case.flops / p.kernel_seconds / 1e12
            if case.published_tflops:
                row["published_seconds"] = case.flops / case.published_tflops / 1e12
                row["model_over_published"] = p.kernel_seconds / row["published_seconds"]
            if case.ours:
                row.update(_ours(case, device, p.kernel_seconds))
        except Exception as exc:  # a case that cannot be modelled is reported, the others still are
            row = dict(case=case.name, device=device.name, source=case.source, error=f"{type(exc).__name__}: {exc}")
        row["wall_seconds"] = time.perf_counter() - start
        log(json.dumps({k: v for k, v in row.items() if k not in ("terms", "source", "note")}, default=str))
        results.append(row)
    return results


def _ours(case: Case, device, anchor_seconds: float) -> dict:
    op_name, problem, our_flops = case.ours
    rows = model.evaluate_problems([(op_name, problem)], device, workers=1)
    found = {}
    for r in rows:
        if r.default and r.prediction is not None:
            p = r.prediction
            found[r.impl] = dict(kernel_seconds=p.kernel_seconds, bound=p.bound,
                                 ratio=p.kernel_seconds / anchor_seconds,
                                 per_flop_ratio=(p.kernel_seconds / our_flops) / (anchor_seconds / case.flops)
                                 if our_flops and case.flops else None)
        elif r.default:
            found[r.impl] = dict(error=r.error)
    return dict(ours_op=op_name, ours_problem=problem.key, ours=found)


MARKER = "<!-- generated by benchmarks/model_calibration.py: everything below is replaced on each run -->"


def markdown(results: list[dict], command: str) -> str:
    lines = [MARKER, "", f"Generated by `{command}`. Predictions of `flashkern.model` (kernel time, no launch); "
             "published figures are the authors'. A traffic count marked `bound` is an upper bound (data-dependent "
             "loops or guards taken at their size bound).", "",
             "| kernel | shape | GPU (model) | published TFLOPS | published µs | model µs | model TFLOPS | "
             "model / published | bound | traffic | CTAs x threads |", "|---|---|---|---:|---:|---:|---:|---:|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['case']} | | {r['device']} | | | not modelled: {r['error'][:100]} | | | | | |")
            continue
        published = r.get("published_tflops")
        figures = (f"{published:.0f} | {r['published_seconds'] * 1e6:.0f}" if published else "— | —")
        ratio = f"{r['model_over_published']:.2f}" if published else "—"
        tflops = f"{r['model_tflops']:.0f}" if "model_tflops" in r else "—"
        lines.append(f"| {r['case']} | {r['shape']} | {r['device']} | {figures} | {r['kernel_seconds'] * 1e6:.0f} | "
                     f"{tflops} | {ratio} | {r['bound']} | {'exact' if r['exact'] else 'bound'} | "
                     f"{' + '.join(f'{c} x {t}' for c, t in zip(r['ctas'], r['threads']))} |")
    ranked = [r for r in results if r.get("published_tflops") and "model_tflops" in r]
    if ranked:
        by = lambda key: [r["case"] for r in sorted(ranked, key=lambda r: -r[key])]  # noqa: E731
        lines += ["", f"Published order (TFLOPS, highest first): {', '.join(by('published_tflops'))}.",
                  f"Model order: {', '.join(by('model_tflops'))}."]
    lines += ["", "Terms per launch (µs), and the model's time from them (`model.composed`: the memory and compute "
              "sides overlapping partly, no less than latency):", "",
              "| kernel | launch | HBM | L2 | tensor | issue | latency | composed |",
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        for i, terms in enumerate(r.get("terms", [])):
            lines.append(f"| {r['case']} | {i} | " + " | ".join(f"{terms.get(k, 0) * 1e6:.1f}" for k in
                                                                 ("HBM", "L2", "tensor", "issue", "latency"))
                         + f" | {model.composed(terms) * 1e6:.1f} |")
    lines += fit_table(results)
    side = [r for r in results if r.get("ours")]
    if side:
        lines += ["", "Ours beside the anchor computing the same operator (predicted kernel times, one run):", "",
                  "| anchor | anchor µs | ours | ours µs (triton / tilelang) | ours / anchor | per FLOP | note |",
                  "|---|---:|---|---:|---:|---:|---|"]
        for r in side:
            ours = r["ours"]
            times = " / ".join(f"{ours[i]['kernel_seconds'] * 1e6:.0f}" if "kernel_seconds" in ours.get(i, {})
                               else "—" for i in ("triton", "tilelang"))
            ratios = " / ".join(f"{ours[i]['ratio']:.2f}" if "ratio" in ours.get(i, {}) else "—"
                                for i in ("triton", "tilelang"))
            per_flop = " / ".join(f"{ours[i]['per_flop_ratio']:.2f}" if ours.get(i, {}).get("per_flop_ratio")
                                  else "—" for i in ("triton", "tilelang"))
            lines.append(f"| {r['case']} | {r['kernel_seconds'] * 1e6:.0f} | {r['ours_op']} {r['ours_problem']} | "
                         f"{times} | {ratios} | {per_flop} | {r.get('note', '')} |")
    notes = [r for r in results if r.get("note") and not r.get("ours")]
    if notes:
        lines += ["", "Notes:", ""] + [f"- {r['case']}: {r['note']}." for r in notes]
    return "\n".join(lines) + "\n"


FIT_EXPONENTS = (1.5, 1.75, 2.0, 2.5, 3.0, 4.0, math.inf)
FIT_L2_PER_CLOCK = (27.5, 36.0, 42.0, 50.0)  # B/clk/SM: Chips and Cheese's read test ... the fit's upper edge


def fitted_seconds(result: dict, exponent: float, l2_per_clock: float) -> float:
    """A result's kernel time had the model used this overlap exponent and L2 bandwidth (its L2 term rescaled)."""
    return sum(model.composed(dict(terms, L2=terms.get("L2", 0.0) * model.L2_BYTES_PER_CLOCK_PER_SM / l2_per_clock),
                              exponent) for terms in result["terms"])


def fit_table(results: list[dict]) -> list[str]:
    """The fit of OVERLAP_EXPONENT and the L2 bandwidth: the RMS of log(model / published) over the published
    anchors but the sparse MLA backward (whose fp32 atomics the model has no term for), per candidate pair."""
    fitted = [r for r in results if r.get("published_seconds") and "terms" in r and "bwd" not in r["case"]]
    if not fitted:
        return []

    def rms(exponent, l2):
        return math.sqrt(sum(math.log(fitted_seconds(r, exponent, l2) / r["published_seconds"]) ** 2
                             for r in fitted) / len(fitted))

    lines = ["", f"The fit (RMS of log(model / published) over {len(fitted)} published points, the backward left out; "
             f"MATH_EFFICIENCY {model.MATH_EFFICIENCY}; the model's constants: exponent "
             f"{model.OVERLAP_EXPONENT:g}, L2 {model.L2_BYTES_PER_CLOCK_PER_SM:g} B/clk/SM):", "",
             "| exponent \\ L2 B/clk/SM | " + " | ".join(f"{l2:g}" for l2 in FIT_L2_PER_CLOCK) + " |",
             "|---|" + "---:|" * len(FIT_L2_PER_CLOCK)]
    for exponent in FIT_EXPONENTS:
        lines.append(f"| {exponent:g} | " + " | ".join(f"{rms(exponent, l2):.3f}" for l2 in FIT_L2_PER_CLOCK) + " |")
    lines += ["", "Each kernel held out: the pair fitted on the others, and the held-out points' model / "
              "published:", "",
              "| held out | exponent, L2 fitted without it | model / published |", "|---|---|---|"]
    for kernel in sorted({r["case"].split(" ")[0] for r in fitted}):
        rest = [r for r in fitted if r["case"].split(" ")[0] != kernel]
        exponent, l2 = min(((e, l2) for e in FIT_EXPONENTS for l2 in FIT_L2_PER_CLOCK),
                           key=lambda pair: sum(math.log(fitted_seconds(r, *pair) / r["published_seconds"]) ** 2
                                                for r in rest))
        held = [f"{fitted_seconds(r, exponent, l2) / r['published_seconds']:.2f}" for r in fitted
                if r["case"].split(" ")[0] == kernel]
        lines.append(f"| {kernel} | {exponent:g}, {l2:g} | {', '.join(held)} |")
    return lines


def write(path: Path, text: str):
    """Replace what follows MARKER in `path` (the hand-written part above it stays), or write the file."""
    kept = path.read_text().split(MARKER)[0] if path.exists() and MARKER in path.read_text() else ""
    path.write_text(kept + text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tilelang", required=True, type=Path, help="a tile-ai/tilelang checkout")
    parser.add_argument("--only", nargs="*", help="cases whose name contains one of these")
    parser.add_argument("--markdown", help="write the tables here")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    with contextlib.redirect_stdout(sys.stderr):
        results = run(args.tilelang, args.only, log=lambda line: print(line, flush=True))
    command = "python benchmarks/model_calibration.py --tilelang PATH" + \
        (f" --markdown {args.markdown}" if args.markdown else "") + (f" --json {args.json}" if args.json else "")
    text = markdown(results, command)
    print(text)
    if args.markdown:
        write(Path(args.markdown), text)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
