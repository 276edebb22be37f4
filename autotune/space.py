"""Tuning spaces: named parameters with candidate values, and named constraints.

A space is declared next to its kernel. Constraints take (problem, config) and say whether the
config can run that problem (register, shared-memory and shape limits); each has a description,
so a pruned config can say why. Configs are plain dicts.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field
from typing import Any, Callable

Config = dict[str, Any]


@dataclass(frozen=True)
class Space:
    params: dict[str, tuple]
    constraints: dict[str, Callable[[Any, Config], bool]] = field(default_factory=dict)

    def violations(self, problem, config: Config) -> list[str]:
        """Descriptions of the constraints `config` breaks for `problem` (empty when it fits)."""
        return [text for text, holds in self.constraints.items() if not holds(problem, config)]

    def configs(self, problem) -> list[Config]:
        """Every config of the space that satisfies the constraints for `problem`."""
        names = list(self.params)
        every = (dict(zip(names, values)) for values in itertools.product(*self.params.values()))
        return [c for c in every if not self.violations(problem, c)]

    def sample(self, problem, count: int, seed: int = 0) -> list[Config]:
        """Up to `count` distinct valid configs, drawn reproducibly."""
        valid = self.configs(problem)
        return random.Random(seed).sample(valid, min(count, len(valid)))

    def check(self, problem, config: Config) -> None:
        """Raise ValueError naming `config` if it has unknown keys, off-space values or breaks a constraint."""
        if not isinstance(config, dict):
            raise TypeError(f"config must be a dict of tuning parameters, got {type(config).__name__}")
        unknown = sorted(set(config) - set(self.params))
        missing = sorted(set(self.params) - set(config))
        if unknown or missing:
            raise ValueError(f"config: unknown keys {unknown}, missing keys {missing}; expected {sorted(self.params)}")
        for name, value in config.items():
            if value not in self.params[name]:
                raise ValueError(f"config[{name!r}] = {value!r} is not in the tuning space {self.params[name]}")
        broken = self.violations(problem, config)
        if broken:
            raise ValueError(f"config {config} does not fit this problem: {'; '.join(broken)}")
