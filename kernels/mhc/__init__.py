"""mHC, manifold-constrained hyper-connections (docs/operators.md section 4): operator records.

  sinkhorn      logits [..., n, n] fp32 -> near doubly-stochastic matrices (the spec's iteration order)
  mhc_pre       residual streams [T, n, D] bf16 and fn -> PreOutputs(layer_input, pre, post, comb):
                in one launch: a split-K GEMM + sum of squares whose last split runs the gates, Sinkhorn and
                the layer input
  mhc_post      out_j = post_j * y + sum_i comb[i, j] * residual_i -> [T, n, D] bf16
  mhc_post_pre  the V4.1 chain: post of one sublayer, then pre of the next
                -> ChainOutputs(residual, layer_input, pre, post, comb)
mhc_pre and mhc_post_pre collapse the layer input with the pre computed now, a carried pre-mix (V4.1's
delayed pre) or residual stream 0 itself (V4.1 at model entry), as pre_mix and delayed select.
The math is in flashkern.reference.mhc; the strategies the tests and `flashkern check` draw inputs from
(Operator.cases) in flashkern.kernels.mhc.cases.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import Tensor

from flashkern import checks
from flashkern.dispatch import call
from flashkern.kernels._tilelang import TileLangKernel
from flashkern.kernels._triton import TritonKernel
from flashkern.kernels.compare import assert_within
from flashkern.kernels.mhc import tilelang_mhc, triton_mhc
from flashkern.kernels.mhc.cases import mhc_cases, sinkhorn_cases
from flashkern.kernels.mhc.problem import (MODEL_HIDDEN, MhcProblem, SinkhornProblem, empty_chain_outputs,
                                       empty_pre_outputs, empty_residual, empty_sinkhorn_output)
from flashkern.reference import mhc as ref
from flashkern.reference.mhc import ChainOutputs, PreOutputs
from flashkern.registry import Cost, Implementation, Operator

__all__ = ["MhcProblem", "SinkhornProblem", "OPERATORS", "PRE_TOLERANCES", "compare_outputs"]

MAX_STREAMS = 8  # n: 4 in the model; the kernels pad n to a power of two up to 8

# ---------------------------------------------------------------- argument checks


def _scalars(inputs: dict, names: tuple[str, ...]) -> None:
    for name in names:
        if name == "iters":
            checks.integer("iters", inputs["iters"], low=1, high=1000)
        elif name in ("pre_eps", "post_mult"):
            checks.real(name, inputs[name])
        elif checks.real(name, inputs[name]) < 0:
            raise ValueError(f"{name} must be >= 0, got {inputs[name]!r}")


def check_sinkhorn(inputs: dict) -> SinkhornProblem:
    x = inputs["x"]
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        raise ValueError(f"x must be a tensor of n x n matrices [..., n, n], got {getattr(x, 'shape', type(x))}")
    n = x.shape[-1]
    checks.tensor("x", x, dtype=torch.float32, shape=(*x.shape[:-2], n, n))
    checks.integer("n (x.shape[-1])", n, low=1, high=MAX_STREAMS)
    _scalars(inputs, ("iters", "eps"))
    return SinkhornProblem(matrices=x.numel() // (n * n), n=n)


def _check_streams(inputs: dict) -> tuple[int, int, int, torch.device]:
    residual = checks.tensor("residual", inputs["residual"], dtype=torch.bfloat16, shape=(None, None, None))
    tokens, n, hidden = residual.shape
    checks.integer("n (residual.shape[1])", n, low=1, high=MAX_STREAMS)
    checks.integer("D (residual.shape[2])", hidden, low=1)
    return tokens, n, hidden, residual.device


def _check_mixing(inputs: dict, tokens: int, n: int, device) -> None:
    """post [T, n] and comb [T, n, n], fp32 (the gates of the finished sublayer)."""
    checks.tensor("post", inputs["post"], dtype=torch.float32, shape=(tokens, n), device=device)
    checks.tensor("comb", inputs["comb"], dtype=torch.float32, shape=(tokens, n, n), device=device)


def _check_projection(inputs: dict, n: int, hidden: int, device) -> bool:
    """fn, hc_scale, hc_base, the scalars and the optional norm weight of a pre block; returns has_norm."""
    m = ref.mix_width(n)
    checks.tensor("fn", inputs["fn"], dtype=torch.float32, shape=(m, n * hidden), device=device)
    checks.tensor("hc_scale", inputs["hc_scale"], dtype=torch.float32, shape=(ref.HC_SCALES,), device=device)
    checks.tensor("hc_base", inputs["hc_base"], dtype=torch.float32, shape=(m,), device=device)
    _scalars(inputs, ("rms_eps", "pre_eps", "sinkhorn_eps", "post_mult", "iters", "norm_eps"))
    norm = checks.optional_tensor("norm_weight", inputs["norm_weight"], dtype=torch.bfloat16, shape=(hidden,),
                                  device=device)
    return norm is not None


def _check_collapse(inputs: dict, tokens: int, n: int, device) -> str:
    """pre_mix [T, n] fp32 or None and delayed (a bool or None); returns the layer input's collapse."""
    pre_mix = checks.optional_tensor("pre_mix", inputs["pre_mix"], dtype=torch.float32, shape=(tokens, n),
                                     device=device)
    if inputs["delayed"] is not None:
        checks.flag("delayed", inputs["delayed"])
    return ref.collapse_kind(pre_mix, inputs["delayed"])


def check_pre(inputs: dict) -> MhcProblem:
    tokens, n, hidden, device = _check_streams(inputs)
    has_norm = _check_projection(inputs, n, hidden, device)
    return MhcProblem(tokens, hidden, n, has_norm=has_norm, collapse=_check_collapse(inputs, tokens, n, device))


def check_post(inputs: dict) -> MhcProblem:
    tokens, n, hidden, device = _check_streams(inputs)
    checks.tensor("y", inputs["y"], dtype=torch.bfloat16, shape=(tokens, hidden), device=device)
    _check_mixing(inputs, tokens, n, device)
    return MhcProblem(tokens, hidden, n)


def check_post_pre(inputs: dict) -> MhcProblem:
    problem = check_post(inputs)
    device = inputs["residual"].device
    has_norm = _check_projection(inputs, problem.streams, problem.hidden, device)
    collapse = _check_collapse(inputs, problem.tokens, problem.streams, device)
    return MhcProblem(problem.tokens, problem.hidden, problem.streams, has_norm=has_norm, collapse=collapse)


# ---------------------------------------------------------------- realistic inputs

DEFAULT_SCALARS = dict(rms_eps=1e-6, pre_eps=1e-6, sinkhorn_eps=1e-6, post_mult=2.0, iters=20, norm_eps=1e-6)


def _to(inputs: dict, device) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def make_sinkhorn_inputs(problem: SinkhornProblem, device="cpu", seed: int = 0) -> dict:
    """Logits ~ N(0, 2^2): what the gates' comb logits look like."""
    gen = torch.Generator().manual_seed(seed)
    x = 2.0 * torch.randn(problem.matrices, problem.n, problem.n, generator=gen)
    return _to(dict(x=x, iters=20, eps=1e-6), device)


def _streams(problem: MhcProblem, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(problem.tokens, problem.streams, problem.hidden, generator=gen).to(torch.bfloat16)


def _projection(problem: MhcProblem, gen: torch.Generator) -> dict:
    """fn ~ N(0, 1/(n D)) (mixes ~ N(0, 1) after the RMS scaling), scales in [0.5, 1.5], bias ~ N(0, 0.5^2)."""
    m, width = problem.mixes, problem.width
    return dict(
        fn=torch.randn(m, width, generator=gen) / width**0.5,
        hc_scale=0.5 + torch.rand(ref.HC_SCALES, generator=gen),
        hc_base=0.5 * torch.randn(m, generator=gen),
        norm_weight=(1 + 0.1 * torch.randn(problem.hidden, generator=gen)).to(torch.bfloat16)
        if problem.has_norm else None,
        **DEFAULT_SCALARS,
    )


def _mixing(problem: MhcProblem, gen: torch.Generator) -> dict:
    """The finished sublayer's output y ~ N(0, 1) and its gates (post in (0, 2), comb doubly stochastic)."""
    t, n = problem.tokens, problem.streams
    return dict(y=torch.randn(t, problem.hidden, generator=gen).to(torch.bfloat16),
                post=2 * torch.sigmoid(torch.randn(t, n, generator=gen)),
                comb=ref.sinkhorn(2 * torch.randn(t, n, n, generator=gen)))


def _collapse_inputs(problem: MhcProblem, gen: torch.Generator) -> dict:
    """pre_mix and delayed selecting the problem's collapse; a carried pre-mix is a previous pre gate, sigmoid + eps."""
    carried = torch.sigmoid(torch.randn(problem.tokens, problem.streams, generator=gen)) + 1e-6
    return dict(pre_mix=carried if problem.collapse == "carried" else None, delayed=problem.collapse != "fresh")


def make_pre_inputs(problem: MhcProblem, device="cpu", seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    inputs = dict(residual=_streams(problem, gen), **_projection(problem, gen))
    return _to(dict(inputs, **_collapse_inputs(problem, gen)), device)


def make_post_inputs(problem: MhcProblem, device="cpu", seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return _to(dict(residual=_streams(problem, gen), **_mixing(problem, gen)), device)


def make_post_pre_inputs(problem: MhcProblem, device="cpu", seed: int = 0) -> dict:
    """Those of mhc_post and mhc_pre."""
    gen = torch.Generator().manual_seed(seed)
    inputs = dict(residual=_streams(problem, gen), **_mixing(problem, gen), **_projection(problem, gen))
    return _to(dict(inputs, **_collapse_inputs(problem, gen)), device)


# ---------------------------------------------------------------- comparisons

# fp32 gates: the GEMM may run in tf32 on a GPU (as upstream's); bf16 outputs: the pre/post tolerances of
# docs/operators.md section 4
# (atol 5e-2, rtol 1e-2). atol is scaled by the RMS of each output row (at least 1): a layer input collapses n
# streams that may cancel, after a new residual that may differ by an ulp of the streams' size, so its error
# follows the streams' scale, not the result's.
PRE_TOLERANCES = dict(gates=dict(atol=1e-3, rtol=1e-3), bf16=dict(atol=5e-2, rtol=1e-2))


def _close(name: str, expected: torch.Tensor, actual: torch.Tensor, atol: float, rtol: float) -> None:
    """|actual - expected| <= atol * max(1, RMS of the row) + rtol * |expected|; NaN and inf where the reference has
    them, exactly."""
    e = expected.cpu().float()
    row_rms = torch.where(torch.isfinite(e), e, 0.0).square().mean(dim=-1, keepdim=True).sqrt().clamp(min=1.0)
    assert_within(name, expected, actual, atol * row_rms + rtol * e.abs())


def compare_sinkhorn(inputs: dict, expected, actual) -> None:
    """fp32 assert_close at its default tolerances (the upstream check)."""
    assert actual.dtype == torch.float32 and actual.shape == expected.shape, (actual.dtype, actual.shape)
    torch.testing.assert_close(actual.cpu(), expected.cpu(), equal_nan=True)


def compare_outputs(inputs: dict, expected, actual) -> None:
    """Every field of PreOutputs / ChainOutputs: bf16 outputs and fp32 gates at their tolerances."""
    for name in expected._fields:
        kind = "bf16" if getattr(expected, name).dtype == torch.bfloat16 else "gates"
        _close(name, getattr(expected, name), getattr(actual, name), **PRE_TOLERANCES[kind])


def compare_post(inputs: dict, expected, actual) -> None:
    _close("out", expected, actual, **PRE_TOLERANCES["bf16"])


# ---------------------------------------------------------------- cost

BF16, FP32 = 2, 4


def sinkhorn_cost(p: SinkhornProblem) -> Cost:
    """Read and write each matrix once; per entry: softmax (~4 ops) and 2 divides + 2 sum-adds per iteration."""
    entries = p.matrices * p.n * p.n
    return Cost(flops=entries * (4 + 4 * 20), bytes=2 * entries * FP32)


def _gate_bytes(p: MhcProblem) -> int:
    return p.tokens * (2 * p.streams + p.streams**2) * FP32


def post_cost(p: MhcProblem) -> Cost:
    """y, the residual and the gates in, the new residual out; 2(n + 1) ops per output element."""
    streams = p.tokens * p.streams * p.hidden
    return Cost(flops=streams * 2 * (p.streams + 1),
                bytes=p.tokens * p.hidden * BF16 + 2 * streams * BF16 + _gate_bytes(p))


def pre_cost(p: MhcProblem) -> Cost:
    """The residual read once, fn (and a carried pre-mix), the layer input and gates written; the GEMM (2 M ops per
    element), the sum of squares and the collapse (2 ops per element) dominate the arithmetic."""
    streams = p.tokens * p.width
    moved = streams * BF16 + p.mixes * p.width * FP32 + p.tokens * p.hidden * BF16 + _gate_bytes(p)
    moved += p.hidden * BF16 if p.has_norm else 0
    moved += p.tokens * p.streams * FP32 if p.collapse == "carried" else 0
    return Cost(flops=streams * (2 * p.mixes + 4), bytes=moved, math="tf32")  # bf16 x fp32 fn: tf32 MMA


def post_pre_cost(p: MhcProblem) -> Cost:
    """mhc_post + mhc_pre without the round trip of the new residual (written once, never read back)."""
    post, pre = post_cost(p), pre_cost(p)
    return Cost(flops=post.flops + pre.flops, bytes=post.bytes + pre.bytes - p.tokens * p.width * BF16, math=pre.math)


# ---------------------------------------------------------------- presets

MODEL_TOKENS = (1, 16, 128, 1024, 8192)


FLASH_HIDDEN = 5120  # V4.1-Flash's hidden size


def _model(tokens=MODEL_TOKENS, **flags) -> dict:
    """A preset per model width, and v41-flash: V4.1-Flash's width."""
    widths = {f"d{d}": tuple(MhcProblem(t, d, **flags) for t in tokens) for d in MODEL_HIDDEN}
    return {**widths, "v41-flash": widths[f"d{FLASH_HIDDEN}"]}


SINKHORN_PRESETS = {"smoke": (SinkhornProblem(1), SinkhornProblem(37)),
                    "v41-flash": tuple(SinkhornProblem(t) for t in MODEL_TOKENS)}
POST_PRESETS = {"smoke": (MhcProblem(1, 256), MhcProblem(37, 256)), **_model()}
# smoke: each collapse once (V4's pre; V4.1's model entry); the model widths: V4's pre
PRE_PRESETS = {"smoke": (MhcProblem(1, 256), MhcProblem(37, 256, collapse="stream0")), **_model()}
# the model's chain: delayed (carried pre-mix), with the RMSNorm of the next sublayer's input fused
POST_PRE_PRESETS = {"smoke": (MhcProblem(1, 256, collapse="carried"), MhcProblem(37, 256, collapse="carried")),
                    **_model(collapse="carried", has_norm=True)}


# ---------------------------------------------------------------- entry points and records


def sinkhorn(x: Tensor, iters: int = 20, eps: float = 1e-6, *, backend: str = "auto", config: dict | None = None,
             out: Tensor | None = None) -> Tensor:
    """Near doubly-stochastic projection of n x n logits (fp32).

    m = softmax(x, rows) + eps; m /= (column sums + eps); then iters - 1 times: m /= (row sums + eps),
    m /= (column sums + eps).

    Args:
        x: [..., n, n] fp32 logits (n <= 8). iters: >= 1. eps: >= 0.
    Returns:
        [..., n, n] fp32.
    """
    return call(SINKHORN, locals())


def mhc_pre(residual: Tensor, fn: Tensor, hc_scale: Tensor, hc_base: Tensor, *, pre_mix: Tensor | None = None,
            delayed: bool | None = None, rms_eps: float = 1e-6, pre_eps: float = 1e-6, sinkhorn_eps: float = 1e-6,
            post_mult: float = 2.0, iters: int = 20, norm_weight: Tensor | None = None, norm_eps: float = 1e-6,
            backend: str = "auto", config: dict | None = None, out: PreOutputs | None = None) -> PreOutputs:
    """The mHC pre block: gates from the RMS-scaled mixes of the residual streams, and the layer input.

    x = residual as [T, n*D] fp32; mix = (x @ fn^T) * rsqrt(mean(x^2) + rms_eps);
    pre = sigmoid(mix[:n] s0 + b[:n]) + pre_eps; post = post_mult * sigmoid(mix[n:2n] s1 + b[n:2n]);
    comb = sinkhorn(mix[2n:] as [n, n] * s2 + b[2n:], iters, sinkhorn_eps);
    layer_input, then RMSNorm with norm_weight when given:
      delayed=False (no pre_mix)      bf16(sum_i pre_i residual_i)       V4
      delayed=True with pre_mix       bf16(sum_i pre_mix_i residual_i)   V4.1's delayed pre (vLLM's mhc_pre_delayed)
      delayed=True without pre_mix    residual[:, 0] exactly              V4.1 at model entry (vLLM's pre_mix=None)
      delayed=None (default)          delayed iff pre_mix is given
    delayed=False with a pre_mix is an error. pre is always the one computed now (the next pre_mix to carry).

    Args:
        residual: [T, n, D] bf16 streams. fn: [(2+n)n, n*D] fp32. hc_scale: [3] fp32 (s0, s1, s2).
        hc_base: [(2+n)n] fp32 (b). pre_mix: [T, n] fp32 or None. delayed: bool or None.
        norm_weight: [D] bf16 or None.
    Returns:
        PreOutputs(layer_input [T, D] bf16, pre [T, n], post [T, n], comb [T, n, n]) (fp32 gates).
    """
    return call(MHC_PRE, locals())


def mhc_post(y: Tensor, residual: Tensor, post: Tensor, comb: Tensor, *, backend: str = "auto",
             config: dict | None = None, out: Tensor | None = None) -> Tensor:
    """The mHC post block: out_j = bf16(post_j * y + sum_i comb[i, j] * residual_i) (note the transpose).

    Args:
        y: [T, D] bf16 sublayer output. residual: [T, n, D] bf16. post: [T, n] fp32. comb: [T, n, n] fp32.
    Returns:
        [T, n, D] bf16 new residual streams.
    """
    return call(MHC_POST, locals())


def mhc_post_pre(y: Tensor, residual: Tensor, post: Tensor, comb: Tensor, fn: Tensor, hc_scale: Tensor, hc_base: Tensor,
                 *, pre_mix: Tensor | None = None, delayed: bool | None = None, rms_eps: float = 1e-6,
                 pre_eps: float = 1e-6, sinkhorn_eps: float = 1e-6, post_mult: float = 2.0, iters: int = 20,
                 norm_weight: Tensor | None = None, norm_eps: float = 1e-6, backend: str = "auto",
                 config: dict | None = None, out: ChainOutputs | None = None) -> ChainOutputs:
    """The V4.1 chain in one call: mhc_post of the finished sublayer, then mhc_pre of the next.

    new = mhc_post(y, residual, post, comb); then mhc_pre on `new`: the next gates, and the layer input
    collapsed as pre_mix and delayed select (mhc_pre): with the pre computed now (delayed=False), with the
    pre-mix carried from the previous sublayer (V4.1's delayed pre: delayed=True with pre_mix), or as new
    stream 0 itself (delayed=True without pre_mix); delayed=None (default) means delayed iff pre_mix is
    given. The new residual is rounded to bf16 before it feeds the next pre, exactly as the unfused
    composition.

    Args: those of mhc_post and mhc_pre; pre_mix: [T, n] fp32 or None; delayed: bool or None.
    Returns:
        ChainOutputs(residual [T, n, D] bf16, layer_input [T, D] bf16, pre [T, n] (computed now, to carry on),
        post [T, n], comb [T, n, n]).
    """
    return call(MHC_POST_PRE, locals())


def _implementations(triton_plan, tilelang_program, tilelang_args, stem: str) -> tuple[Implementation, ...]:
    """The Triton and TileLang implementations of one operator (spaces and defaults named after `stem`)."""
    space, default = f"{stem.upper()}_SPACE", f"{stem}_default"
    return (
        Implementation("triton", TritonKernel(triton_plan), getattr(triton_mhc, space), getattr(triton_mhc, default)),
        Implementation("tilelang", TileLangKernel(tilelang_program, tilelang_args), getattr(tilelang_mhc, space),
                       getattr(tilelang_mhc, default)),
    )


SINKHORN = Operator(
    name="sinkhorn", summary="Sinkhorn projection of n x n logits onto near doubly-stochastic matrices",
    entry=sinkhorn, reference=ref.sinkhorn,
    implementations=_implementations(triton_mhc.plan_sinkhorn, tilelang_mhc.sinkhorn_program,
                                     tilelang_mhc.sinkhorn_args, "sinkhorn"),
    check=check_sinkhorn, outputs=empty_sinkhorn_output, make_inputs=make_sinkhorn_inputs, compare=compare_sinkhorn,
    cost=sinkhorn_cost,
    presets=SINKHORN_PRESETS, cases=sinkhorn_cases,
)

MHC_PRE = Operator(
    name="mhc_pre", summary="mHC pre: GEMM + sum of squares, gates, Sinkhorn and layer input in one launch",
    entry=mhc_pre, reference=ref.mhc_pre,
    implementations=_implementations(triton_mhc.plan_pre, tilelang_mhc.pre_program, tilelang_mhc.pre_args, "pre"),
    check=check_pre, outputs=empty_pre_outputs, make_inputs=make_pre_inputs, compare=compare_outputs, cost=pre_cost,
    presets=PRE_PRESETS, cases=partial(mhc_cases, "mhc_pre"),
)

MHC_POST = Operator(
    name="mhc_post", summary="mHC post: new residual streams from the sublayer output and the gates",
    entry=mhc_post, reference=ref.mhc_post,
    implementations=_implementations(triton_mhc.plan_post, tilelang_mhc.post_program, tilelang_mhc.post_args,
                                     "post"),
    check=check_post, outputs=empty_residual, make_inputs=make_post_inputs, compare=compare_post, cost=post_cost,
    presets=POST_PRESETS, cases=partial(mhc_cases, "mhc_post"),
)

MHC_POST_PRE = Operator(
    name="mhc_post_pre", summary="mHC chain: post, then the next (V4 or V4.1 delayed) pre, in one call",
    entry=mhc_post_pre, reference=ref.mhc_post_pre,
    implementations=_implementations(triton_mhc.plan_post_pre, tilelang_mhc.post_pre_program,
                                     tilelang_mhc.post_pre_args, "pre"),
    check=check_post_pre, outputs=empty_chain_outputs, make_inputs=make_post_pre_inputs, compare=compare_outputs,
    cost=post_pre_cost,
    presets=POST_PRE_PRESETS, cases=partial(mhc_cases, "mhc_post_pre"),
)

OPERATORS = (SINKHORN, MHC_PRE, MHC_POST, MHC_POST_PRE)
