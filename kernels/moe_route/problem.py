"""Problem description of MoE routing: the routing rule, the per-call problem, output allocation."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from flashkern.kernels.tiles import next_power_of_2
from flashkern.reference.moe_route import group_form

# log(1 + u) for u in [0, 1] as u + u^2 P(u), P = sum_i LOG1P_UNIT[i] u^i a degree-7 Chebyshev fit: within 4 ulp in
# 9 FMAs (libdevice's logf and Goldberg's correction take about 45 instructions). Both DSLs' sqrtsoftplus use it.
LOG1P_UNIT = (-0.49999502, 0.3331927, -0.2484437, 0.1911143, -0.1367477, 0.07836167, -0.029588507, 0.005253458)


@dataclass(frozen=True)
class Routing:
    """The routing rule of a model (static per model)."""

    experts: int
    top_k: int
    score: str = "sqrtsoftplus"
    n_group: int = 1
    topk_group: int = 1
    group_score: str = "auto"  # "auto" | "max" | "top2" (reference/moe_route.py)
    renormalize: bool = True
    scaling_factor: float = 1.0

    def kwargs(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "experts"}


V41_FLASH = Routing(experts=384, top_k=6, score="sqrtsoftplus", scaling_factor=1.5)
V3 = Routing(experts=256, top_k=8, score="sigmoid", n_group=8, topk_group=4, scaling_factor=2.5)


@dataclass(frozen=True)
class RouteProblem:
    tokens: int
    routing: Routing
    has_bias: bool = True
    has_valid: bool = False
    hidden: int = 0  # fused-gate form: hidden size D; 0 for the logits form
    has_norm: bool = False
    norm_eps: float = 1e-6

    @property
    def group_form(self) -> str:
        """The group score the kernels compute: "max" or "top2" (group_score="auto" resolved by the bias)."""
        return group_form(self.routing.group_score, self.has_bias)

    @property
    def key(self) -> str:
        r = self.routing
        parts = [f"T={self.tokens}", f"E={r.experts}", f"k={r.top_k}", r.score]
        if r.n_group > 1:
            parts.append(f"groups={r.topk_group}/{r.n_group} by {self.group_form}")
        if self.hidden:
            parts.append(f"D={self.hidden}" + (" rmsnorm" if self.has_norm else ""))
        parts += [name for name, on in (("bias", self.has_bias), ("valid", self.has_valid)) if on]
        return " ".join(parts)

    @property
    def sizes(self) -> tuple[int, ...]:
        """The sizes that vary per call (kernels take them at run time); tuning tables bucket on them."""
        return (self.tokens,)

    def with_sizes(self, sizes) -> RouteProblem:
        (tokens,) = sizes  # built directly: dataclasses.replace costs microseconds on the dispatch path
        return RouteProblem(tokens, self.routing, self.has_bias, self.has_valid, self.hidden, self.has_norm,
                            self.norm_eps)

    def specialization(self) -> RouteProblem:
        """Everything a compiled kernel depends on: the problem without its sizes."""
        return self.with_sizes((0,))


def empty_outputs(problem: RouteProblem, inputs: dict, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialized (weights [T, k] fp32, ids [T, k] int32)."""
    shape = (problem.tokens, problem.routing.top_k)
    return torch.empty(shape, dtype=torch.float32, device=device), torch.empty(shape, dtype=torch.int32, device=device)


@dataclass(frozen=True)
class SlotLayout:
    """Experts laid out as power-of-two slots: slot g * group_width + j holds expert g * EG + j.

    Both DSLs tile rows as [rows, slots]; padding slots (j >= EG or g >= G) are masked out.
    Power-of-two widths keep every row and group reduction a clean butterfly on the GPU.
    """

    groups: int  # G padded to a power of two
    group_width: int  # EG = E / G padded to a power of two

    @property
    def slots(self) -> int:
        return self.groups * self.group_width


def slot_layout(routing: Routing) -> SlotLayout:
    return SlotLayout(next_power_of_2(routing.n_group), next_power_of_2(routing.experts // routing.n_group))
