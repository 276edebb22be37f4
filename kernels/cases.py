"""What the input strategies of every family (kernels/<family>/cases.py) share: drawn seeds, and how widely a run
draws specializations.

A specialization (problem.specialization(): formats, head counts, k, flags; never sizes) selects a compiled
program, and each new one costs a compile (a TileLang C program 2-15 s on CI's two cores, about half of the CI
suite's time). Sizes, values, index patterns and layouts are dynamic and cost nothing. So:

  narrow runs (the `ci` and `gpu` hypothesis profiles): a strategy draws its specialization from those of the
      operator's presets (every preset, model sizes included: the formats, flags and heads the model runs, and the
      smoke set chosen to cover the code paths; `preset_pool`) or, where presets do not fit the strategy, from a
      short pool of its own (moe_route's NARROW_GATES, mhc's NARROW_N and NARROW_HIDDEN), and draws everything
      else as usual;
  wide runs (`thorough`, `deep`, and `flashkern check`): every combination.

Parametrized tests narrow the same way: `covering` runs all pairs of a product's values in a narrow run (every
combination in a wide one), `narrowed` the first of a list of variants.
"""

from __future__ import annotations

import itertools

import torch
from hypothesis import settings
from hypothesis import strategies as st

NARROW_PROFILES = ("ci", "gpu")


def narrow() -> bool:
    """True when the active hypothesis profile draws specializations from the presets only."""
    return settings.get_current_profile_name() in NARROW_PROFILES


def covering(**axes) -> tuple[str, list[tuple]]:
    """Arguments of pytest.mark.parametrize over the product of `axes` (argument name -> values): every combination
    in a wide run; in a narrow run an all-pairs set (allpairspy; deterministic, so every xdist worker collects the
    same tests): each value of an axis meets each value of every other axis in some case, in a fraction of the
    product (24 cases of 3 x 2 x 2 x 2 in 7)."""
    values = [list(v) for v in axes.values()]
    if narrow() and len(values) > 2:  # with two axes, all pairs is the product
        from allpairspy import AllPairs  # a test dependency: only parametrized tests call this

        cases = [tuple(case) for case in AllPairs(values)]
    else:
        cases = list(itertools.product(*values))
    return ",".join(axes), cases


def narrowed(variants: list, keep: int = 1) -> list:
    """The first `keep` of a list of parametrize variants in a narrow run (the model's, listed first), all of them
    in a wide run."""
    return variants[:keep] if narrow() else variants


def staggered(rows: list, variants: list) -> list[tuple]:
    """(row, variant) pairs: every pair in a wide run; in a narrow run row i meets variant i mod len(variants), so
    each row runs once and each variant at least once where there are as many rows as variants."""
    if not narrow():
        return list(itertools.product(rows, variants))
    return [(row, variants[i % len(variants)]) for i, row in enumerate(rows)]


def seeded(draw, high: int = 2**31 - 1) -> torch.Generator:
    """A torch generator from a drawn seed (failures shrink to seed 0)."""
    return torch.Generator().manual_seed(draw(st.integers(0, high), label="seed"))


def specialization(draw, every: st.SearchStrategy, pool):
    """Draw the specializing choices of a case: from `every` (all combinations) in a wide run; in a narrow run from
    `pool()`, a short list of combinations (preset_pool, or the strategy's own where presets do not fit)."""
    if not narrow():
        return draw(every)
    return draw(st.sampled_from(list(dict.fromkeys(pool()))), label="narrow specialization")


def preset_pool(op_name: str, of):
    """A pool for `specialization`: of(problem) for every preset problem of the operator, in preset order."""
    from flashkern import registry

    return lambda: [of(problem) for problems in registry.get(op_name).presets.values() for problem in problems]
