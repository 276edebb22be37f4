"""Tuning spaces: named parameters with candidate values, constraints and target limits.

A space is declared next to its kernel. Both kinds of rule take (problem, config) and say
whether the config may run that problem; each has a description, so a pruned config says why.
  constraints: hold on every target (shape rules);
  limits:      resource models of a GPU target (registers, shared memory), checked on CUDA
               only; the CPU paths (TileLang's C, Triton's interpreter) have no such limits.
gpu_only names parameters that change nothing on a CPU target (threads, pipeline stages);
a CPU sweep pins them. Configs are plain dicts.
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
    limits: dict[str, Callable[[Any, Config], bool]] = field(default_factory=dict)
    gpu_only: tuple[str, ...] = ()
    _valid: dict = field(default_factory=dict, compare=False, repr=False)  # (problem, target, pins) -> configs

    def violations(self, problem, config: Config, target: str = "cuda") -> list[str]:
        """Descriptions of the rules `config` breaks for `problem` on `target` ("cuda" or "cpu")."""
        rules = {**self.constraints, **(self.limits if target == "cuda" else {})}
        return [text for text, holds in rules.items() if not holds(problem, config)]

    def configs(self, problem, target: str = "cuda", pin: Config | None = None) -> list[Config]:
        """Every config of the space that may run `problem` on `target`; `pin` fixes the gpu_only parameters.

        Enumerated once per (problem, target, pinned values): spaces reach 10^5 points, each tested by every rule."""
        pins = {name: pin[name] for name in self.gpu_only} if pin is not None else {}
        key = (problem, target, tuple(sorted(pins.items())))
        if key not in self._valid:
            params = {name: (pins[name],) if name in pins else values for name, values in self.params.items()}
            every = (dict(zip(params, values)) for values in itertools.product(*params.values()))
            self._valid[key] = [c for c in every if not self.violations(problem, c, target)]
        return [dict(c) for c in self._valid[key]]

    @staticmethod
    def sample_from(configs: list[Config], count: int, seed: int = 0) -> list[Config]:
        """Up to `count` of `configs`, drawn reproducibly."""
        return random.Random(seed).sample(configs, min(count, len(configs)))

    def sample(self, problem, count: int, seed: int = 0, target: str = "cuda") -> list[Config]:
        """Up to `count` distinct valid configs, drawn reproducibly."""
        return self.sample_from(self.configs(problem, target), count, seed) if count > 0 else []

    def check(self, problem, config: Config, target: str = "cuda") -> None:
        """Raise ValueError naming `config` if it has unknown keys, off-space values or breaks a constraint."""
        self.check_points(config)
        broken = self.violations(problem, config, target)
        if broken:
            raise ValueError(f"config {config} does not fit this problem on {target}: {'; '.join(broken)}")

    def check_points(self, config: Config) -> None:
        """Raise TypeError / ValueError naming `config` if it is not a dict of this space's keys and values (what
        no problem changes)."""
        if not isinstance(config, dict):
            raise TypeError(f"config must be a dict of tuning parameters, got {type(config).__name__}")
        unknown = sorted(set(config) - set(self.params))
        missing = sorted(set(self.params) - set(config))
        if unknown or missing:
            raise ValueError(f"config: unknown keys {unknown}, missing keys {missing}; expected {sorted(self.params)}")
        for name, value in config.items():
            if value not in self.params[name]:
                raise ValueError(f"config[{name!r}] = {value!r} is not in the tuning space {self.params[name]}")
