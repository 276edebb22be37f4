"""Backend selection and the checked call path shared by every operator entry point.

backend="reference" | "triton" | "tilelang" | "auto"; config= an explicit tuning config for
the chosen kernel (default: the implementation's default config for the problem).

The "auto" rule (until the autotuner's per-shape tables exist):
  - on CUDA: the first implementation that can run here, Triton before TileLang;
  - on CPU: the reference. Both kernel paths are correctness paths there: PyTorch's
    vectorized kernels beat TileLang's C and Triton's interpreter at most shapes
    (`flashkern bench`), and interpreted Triton is never chosen for speed;
  - the reference when no implementation can run on the device.
The order of checks is: arguments (named in the error), backend name, device support, config;
nothing is launched before all of them pass.
"""

from __future__ import annotations

import torch

from flashkern import device as devices
from flashkern.registry import Implementation, Operator

AUTO_ORDER = {"cuda": ("triton", "tilelang"), "cpu": ()}


def _device_of(inputs: dict) -> torch.device:
    return next(v.device for v in inputs.values() if isinstance(v, torch.Tensor))


def auto_choice(op: Operator, device_info) -> Implementation | None:
    """The implementation "auto" runs on this device, or None for the reference."""
    for name in AUTO_ORDER.get(device_info.kind, ()):
        impl = op.implementation(name)
        if impl.unavailable(device_info) is None:
            return impl
    return None


def resolve(op: Operator, problem, device_info, backend: str, config) -> tuple[Implementation | None, dict | None]:
    """(implementation or None for the reference, checked config) for one call."""
    if backend not in (*op.backends, "auto"):
        raise ValueError(f"backend must be one of {(*op.backends, 'auto')}, got {backend!r}")
    if backend == "reference":
        impl = None
    elif backend == "auto":
        impl = auto_choice(op, device_info)
    else:
        impl = op.implementation(backend)
        reason = impl.unavailable(device_info)
        if reason is not None:
            raise RuntimeError(f"backend={backend!r} cannot run on {device_info.describe()}: {reason}")
    if impl is None:
        if config is not None:
            raise ValueError(f"config is for a kernel, but backend={backend!r} runs the reference")
        return None, None
    if config is None:
        config = impl.default_config(problem)
    impl.space.check(problem, config, device_info.kind)
    return impl, config


def call(op: Operator, inputs: dict, backend: str = "auto", config: dict | None = None):
    """Check the arguments, pick the backend and run it."""
    problem = op.check(inputs)
    impl, config = resolve(op, problem, devices.info(_device_of(inputs)), backend, config)
    if impl is None:
        return op.reference(**inputs)
    return impl.run(problem, inputs, config)
