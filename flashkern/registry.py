"""The operator registry.

One record per operator ties together everything the CLI, the tests, the tuner and the
dispatcher need, so none of them names an operator in code:

  Operator: name, public entry point, reference, implementations, argument check (inputs ->
            problem: metadata only), value check (checked mode only), output allocation, input maker,
            comparison, cost model, shape presets.
  Implementation: a Triton or TileLang kernel with its tuning space and default config; it writes
            into outputs its caller allocated (Operator.outputs, or a user's out= buffers).

A *problem* is a frozen dataclass describing one call's shapes and static options
(tokens, experts, ...). It has `key` (a readable shape key), `sizes` (the sizes that vary per
call and are dynamic in the kernels, e.g. the token count), `with_sizes(sizes)`, and
`specialization()` (what a compiled kernel depends on: the problem without its sizes).

Adding an operator family: a reference module, a kernels/<family>/ folder whose __init__
defines OPERATORS, a test module, and one line in FAMILIES below.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import torch

from flashkern.autotune.space import Config, Space

FAMILIES = (
    "moe_route",
    "indexer",
    "mhc",
    "kv_cache",
    "engram",
)


class SizedProblem:
    """Mixin for frozen problem dataclasses: `SIZES` names the per-call sizes (dynamic in the kernels).

    The key lists every field (a field with its own `key`, e.g. a model description, by that key;
    flags by name when set), so tuning tables and reports read the same.
    """

    SIZES: ClassVar[tuple[str, ...]]

    @property
    def key(self) -> str:
        parts = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if hasattr(value, "key"):
                parts.append(value.key)
            elif isinstance(value, bool):
                parts += [f.name] if value else []
            else:
                parts.append(f"{f.name}={value}")
        return " ".join(parts)

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(getattr(self, name) for name in self.SIZES)

    def with_sizes(self, sizes):
        return dataclasses.replace(self, **dict(zip(self.SIZES, sizes)))

    def specialization(self):
        """Everything a compiled kernel depends on: the problem without its sizes."""
        return self.with_sizes((0,) * len(self.SIZES))


@dataclass(frozen=True)
class Cost:
    """Work per call: arithmetic operations, the bytes the operator must move (inputs + outputs once), and the
    fastest arithmetic its inputs allow (fp8, bf16 or tf32 tensor cores, or fp32: CUDA cores), which sets the
    operator's compute roof in the performance model (flashkern.model); host_bytes: those of the bytes that cross
    the host link (PCIe, or NVLink-C2C) rather than come from the GPU's memory."""

    flops: float
    bytes: float
    math: str = "fp32"
    host_bytes: float = 0.0  # of `bytes`, those read from host memory over the host link (a pinned table, UVA)


@dataclass(frozen=True)
class Implementation:
    name: str  # "triton" or "tilelang"
    kernel: Any  # TritonKernel or TileLangKernel: run / build_sm90 / build_stages_sm90 / traffic / unavailable / cpu_mode
    space: Space
    default_config: Callable[[Any], Config]

    def unavailable(self, device) -> str | None:
        return self.kernel.unavailable(device)

    def run(self, problem, inputs: dict, config: Config, out):
        """Launch the kernel(s) writing every element of `out`; returns `out`."""
        return self.kernel.run(problem, inputs, config, out)

    def build_sm90(self, problem, inputs: dict, config: Config, out):
        return self.kernel.build_sm90(problem, inputs, config, out)

    def build_stages_sm90(self, problem, inputs: dict, config: Config, out):
        return self.kernel.build_stages_sm90(problem, inputs, config, out)

    def traffic(self, problem, inputs: dict, config: Config, out):
        return self.kernel.traffic(problem, inputs, config, out)


@dataclass(frozen=True)
class Operator:
    name: str
    summary: str
    entry: Callable  # the public function, flashkern.ops.<name>
    reference: Callable  # called with the inputs dict as keyword arguments
    implementations: tuple[Implementation, ...]
    check: Callable[[dict], Any]  # inputs -> problem from metadata only; raises naming the bad argument
    outputs: Callable[[Any, dict, Any], Any]  # (problem, inputs, device) -> uninitialized outputs (tensor or tuple)
    make_inputs: Callable[[Any, Any, int], dict]  # (problem, device, seed) -> inputs
    compare: Callable[[dict, Any, Any], None]  # (inputs, expected, actual); raises AssertionError
    cost: Callable[[Any], Cost]
    presets: dict[str, tuple]  # name -> problems
    check_values: Callable[[dict, Any], None] | None = None  # (inputs, problem): index ranges, in checked mode
    cases: Callable[[], Any] | None = None  # () -> hypothesis strategy of input dicts (CPU tensors): the property
    # tests' draws (odd sizes, tails, extreme values, padding, NaN/Inf), also behind `flashkern check`
    prepare: Callable[[dict], None] | None = None  # zero-copy kernel views of accepted forms, from metadata only
    # (check applies it too; a cached plan records whether it changes anything for its call signature)
    mutates: str | None = None  # the input the operator writes in place (its outputs, then), e.g. a cache; the
    # entry takes no out= and returns None, the schema marks the argument Tensor(a!), the reference returns what
    # the argument holds after the call

    def __post_init__(self):
        from flashkern import library

        library.register(self)

    def implementation(self, name: str) -> Implementation:
        for impl in self.implementations:
            if impl.name == name:
                return impl
        raise KeyError(name)

    def result_of(self, inputs: dict, **kwargs):
        """Call the entry point on `inputs` (with backend=, config=, ...): what it returns or, for an operator that
        writes one of its inputs in place (mutates), that input after the call."""
        returned = self.entry(**inputs, **kwargs)
        return inputs[self.mutates] if self.mutates else returned

    def empty_outputs(self, problem, inputs: dict):
        """Uninitialized outputs for one call, on the inputs' device (device_of)."""
        return self.outputs(problem, inputs, device_of(inputs))

    @property
    def backends(self) -> tuple[str, ...]:
        return ("reference", *(impl.name for impl in self.implementations))


def device_of(inputs: dict) -> torch.device:
    """Where a call runs: its first GPU tensor's device, else its first tensor's. (A CPU tensor beside GPU ones can
    only be one the operator's check lets a GPU kernel read: pinned host memory.)"""
    tensors = [v for v in inputs.values() if isinstance(v, torch.Tensor)]
    return next((t.device for t in tensors if t.device.type != "cpu"), tensors[0].device)


@functools.cache
def operators() -> dict[str, Operator]:
    """Every registered operator by name (imports the kernel families on first use)."""
    found: dict[str, Operator] = {}
    for family in FAMILIES:
        module = importlib.import_module(f"flashkern.kernels.{family}")
        for op in module.OPERATORS:
            found[op.name] = op
    return found


def get(name: str) -> Operator:
    ops = operators()
    if name not in ops:
        raise KeyError(f"unknown operator {name!r}; known: {', '.join(sorted(ops))}")
    return ops[name]
