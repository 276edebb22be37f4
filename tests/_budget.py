"""Example budgets for expensive property tests, scaled from the active hypothesis profile.

Each drawn TileLang config is a C compile (about 15 s on CI's cores): tests that draw configs
take a fraction of the profile's examples (a quarter, at least 2: 2 of `ci`'s 5, 50 of `thorough`'s 200).
"""

from hypothesis import settings


def fraction_of_examples(fraction: float) -> settings:
    return settings(max_examples=max(2, round(settings().max_examples * fraction)))
