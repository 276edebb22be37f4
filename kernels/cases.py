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
"""

from __future__ import annotations

import torch
from hypothesis import settings
from hypothesis import strategies as st

NARROW_PROFILES = ("ci", "gpu")


def narrow() -> bool:
    """True when the active hypothesis profile draws specializations from the presets only."""
    return settings.get_current_profile_name() in NARROW_PROFILES


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
