"""`flashkern check OP`: a kernel developer's inner loop. The property-based equivalence of one implementation (and
config) against the reference, drawn from the strategies the tests draw (Operator.cases); a failure is shrunk
by hypothesis and given back as a short Python snippet that reproduces it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import seed as seeded

INLINE_ELEMENTS = 256  # tensors up to this size are written into the snippet; larger inputs go to a .pt file


@dataclass(frozen=True)
class Failure:
    inputs: dict  # the shrunk case
    error: BaseException


def _to(device: torch.device):
    return lambda inputs: {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def run(op, backend: str, config: dict | None, examples: int, seed: int, device: torch.device,
        on_example=None) -> Failure | None:
    """Check `examples` cases drawn on `device`: None when all pass, else the shrunk failing case. Cases a given
    config does not apply to (its tuning space refuses it for their problem) are skipped."""
    last_failure: list[Failure] = []
    impl = None if backend == "reference" else op.implementation(backend)

    @settings(max_examples=examples, deadline=None, database=None, print_blob=False,
              suppress_health_check=list(HealthCheck))
    @seeded(seed)
    @given(op.cases().map(_to(device)))
    def equivalent(inputs):
        if config is not None:
            assume(not impl.space.violations(op.check(dict(inputs)), config, device.type))
        if on_example:
            on_example()
        try:
            op.compare(inputs, op.reference(**inputs), op.result_of(inputs, backend=backend, config=config))
        except Exception as exc:  # shrinking replays the smallest failing case last
            last_failure[:] = [Failure(inputs, exc)]
            raise

    try:
        equivalent()
    except Exception:
        if not last_failure:
            raise
        return last_failure[-1]
    return None


def _literal(t: torch.Tensor) -> str:
    """A tensor as a Python expression that rebuilds it exactly (narrow floats through their bytes)."""
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return f"torch.tensor({t.contiguous().view(torch.uint8).tolist()}, dtype=torch.uint8).view(torch.{t.dtype})"
    values = t.double().tolist() if t.dtype.is_floating_point else t.tolist()
    return f"torch.tensor({values}, dtype={t.dtype})"


def snippet(op, backend: str, config: dict | None, inputs: dict, save_dir: Path) -> str:
    """Python that reruns the case and raises the comparison's error. Small contiguous inputs inline; otherwise
    the inputs are saved (torch.save, strides kept) under save_dir and loaded."""
    tensors = [v for v in inputs.values() if isinstance(v, torch.Tensor)]
    inline = all(t.numel() <= INLINE_ELEMENTS and t.is_contiguous() for t in tensors)
    lines = ["import torch", "from flashkern import registry", "", f"op = registry.get({op.name!r})"]
    if inline:
        lines.append("nan, inf = float('nan'), float('inf')")
        lines.append("inputs = dict(")
        for name, value in inputs.items():
            shown = _literal(value.cpu()) if isinstance(value, torch.Tensor) else repr(value)
            lines.append(f"    {name}={shown},")
        lines.append(")")
    else:
        save_dir.mkdir(parents=True, exist_ok=True)
        path = save_dir / f"flashkern-check-{op.name}-{backend}.pt"
        torch.save({k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}, path)
        lines.append(f"inputs = torch.load({str(path)!r})  # {', '.join(_shape(k, v) for k, v in inputs.items())}")
    lines.append("expected = op.reference(**inputs)")
    lines.append(f"out = op.result_of(inputs, backend={backend!r}, config={config!r})")
    lines.append("op.compare(inputs, expected, out)  # raises as the check did")
    return "\n".join(lines)


def _shape(name: str, value) -> str:
    if isinstance(value, torch.Tensor):
        return f"{name} {str(value.dtype).replace('torch.', '')}{list(value.shape)}"
    return f"{name}={value!r}" if not isinstance(value, float) or math.isfinite(value) else f"{name}={value}"
