"""mHC input strategies: what the equivalence tests (tests/test_mhc.py) and `flashkern check` draw (Operator.cases).

sinkhorn_cases: n from 1 to 8, no, one or two leading dimensions (up to 130 matrices), logits ~ N(0, spread^2)
at spread 0.1, 2 or 30, as they are, as ties (entries in {-1, 0, 1}: equal rows and equal entries) or with 30% of
them at +-1e4; iters from 1 to 50 and eps 0, 1e-6 or 0.1.

mhc_cases(op) for mhc_pre, mhc_post and mhc_post_pre: a problem with the stream count (4 mostly; 1, 2, 8), token
counts (1-24 or 25-300) and hidden sizes with odd tails (D = 1, 7, 37, 100, 256, 300, and now and then the model's
4096 / 5120 / 7168 at a few tokens), norm on and off and each collapse of the layer input (the fresh pre, a carried
pre-mix, stream 0) where the operator has a pre; its realistic inputs (Operator.make_inputs) in one of the value
modes: normal; large epsilons and few iterations, which make every epsilon and the iteration order visible; all-zero
token rows; huge magnitudes; a token row holding NaN or inf, which must stay in its row.

Narrow runs (the `ci` profile, kernels/cases.py): n from NARROW_N; hidden from NARROW_HIDDEN with the streams, norm
and collapse of the operator's presets, and no model widths (the model-chain tests run those).

Tensors are on the CPU (callers move them); each case is described with hypothesis.note.
"""

from __future__ import annotations

import torch
from hypothesis import note
from hypothesis import strategies as st

from flashkern import registry
from flashkern.kernels.cases import narrow, seeded, specialization
from flashkern.kernels.mhc.problem import MhcProblem
from flashkern.reference.mhc import COLLAPSES

ODD_HIDDEN = (1, 7, 37, 100, 256, 300)
NARROW_HIDDEN = (37, 256)  # narrow runs: a tail off every tile and the smoke presets' width
NARROW_N = (4, 7)  # narrow runs: the model's streams and an odd n
VALUE_MODES = ("normal", "large_eps", "zero_rows", "huge", "nonfinite_row")


@st.composite
def sinkhorn_cases(draw):
    n = specialization(draw, st.integers(1, 8), lambda: NARROW_N)
    lead = draw(st.sampled_from([(), (1,), (37,), (3, 5), (130,)]))
    spread = draw(st.sampled_from([0.1, 2.0, 30.0]))
    gen = seeded(draw)
    x = spread * torch.randn(*lead, n, n, generator=gen)
    mode = draw(st.sampled_from(["normal", "ties", "huge"]))
    if mode == "ties":  # equal rows and equal entries
        x = torch.randint(-1, 2, x.shape, generator=gen).float()
    elif mode == "huge":
        x = torch.where(torch.rand(x.shape, generator=gen) < 0.3, 1e4 * torch.sign(x), x)
    iters, eps = draw(st.sampled_from([1, 2, 3, 20, 50])), draw(st.sampled_from([1e-6, 0.0, 0.1]))
    note(f"shape={list(x.shape)} spread={spread} mode={mode} iters={iters} eps={eps}")
    return dict(x=x, iters=iters, eps=eps)


def apply_value_mode(gen: torch.Generator, inputs: dict, mode: str) -> dict:
    """Apply one of VALUE_MODES to made inputs (see the module docstring); returns `inputs`, updated in place."""
    residual = inputs["residual"].float()
    tokens = residual.shape[0]
    if mode == "large_eps":  # mhc_post has no scalars
        large = dict(rms_eps=0.5, pre_eps=0.25, sinkhorn_eps=0.1, post_mult=1.5, norm_eps=0.3,
                     iters=int(torch.randint(1, 4, (1,), generator=gen)))
        inputs.update({k: v for k, v in large.items() if k in inputs})
    elif mode == "zero_rows":
        residual[torch.rand(tokens, generator=gen) < 0.3] = 0
    elif mode == "huge":
        residual *= 3e3
    elif mode == "nonfinite_row":
        residual[int(torch.randint(0, tokens, (1,), generator=gen)), 0, 0] = float("nan" if tokens % 2 else "inf")
    inputs["residual"] = residual.to(torch.bfloat16)
    return inputs


@st.composite
def mhc_problems(draw, op: str):
    tokens = draw(st.integers(1, 24)) if draw(st.integers(0, 2)) else draw(st.integers(25, 300))
    has_pre = op != "mhc_post"
    every = st.tuples(st.sampled_from(ODD_HIDDEN), st.sampled_from([4, 4, 4, 2, 1, 8]),
                      st.booleans() if has_pre else st.just(False), st.sampled_from(COLLAPSES if has_pre else ["fresh"]))
    presets = registry.get(op).presets
    hidden, streams, has_norm, collapse = specialization(draw, every, lambda: [
        (hidden, p.streams, p.has_norm, p.collapse) for hidden in NARROW_HIDDEN for ps in presets.values() for p in ps])
    if not narrow() and draw(st.integers(0, 9)) == 0:  # now and then a model width at a few tokens
        tokens, hidden = draw(st.integers(1, 3)), draw(st.sampled_from([4096, 5120, 7168]))
    return MhcProblem(tokens, hidden, streams, has_norm=has_norm, collapse=collapse)


@st.composite
def mhc_cases(draw, op: str):
    """Inputs of mhc_pre, mhc_post or mhc_post_pre (op): made for a drawn problem, in a drawn value mode."""
    problem = draw(mhc_problems(op))
    gen = seeded(draw)
    inputs = registry.get(op).make_inputs(problem, "cpu", seed=int(torch.randint(0, 2**31, (1,), generator=gen)))
    mode = draw(st.sampled_from(VALUE_MODES))
    note(f"{problem.key} mode={mode}")
    return apply_value_mode(gen, inputs, mode)
