"""Backend selection and the checked call path shared by every operator entry point.

backend="reference" | "triton" | "tilelang" | "auto"; config= an explicit tuning config for
the chosen kernel (default: the implementation's default config for the problem).

backend="auto" runs, in this order:
  1. the tuned choice for the shape from this device's dispatch table (autotune.table: built
     once per process from the tuning store, current versions only; exact size bucket, else the
     nearest bucket of the same specialization);
  2. else the default rule: on CUDA the first implementation that can run here, Triton before
     TileLang, in its default config; on CPU the reference. Both kernel paths are correctness
     paths there: PyTorch's vectorized kernels beat TileLang's C and Triton's interpreter at
     most shapes (`flashkern bench`), and interpreted Triton is never chosen for speed;
  3. the reference when no implementation can run on the device.
The order of checks is: arguments (named in the error), backend name, device support, config;
nothing is launched before all of them pass. A tuned table's configs were checked when tuned.
"""

from __future__ import annotations

import warnings

import torch

from flashkern import device as devices
from flashkern.autotune import store as stores
from flashkern.autotune import table as tables
from flashkern.registry import Implementation, Operator

AUTO_ORDER = {"cuda": ("triton", "tilelang"), "cpu": ()}
_TABLES: dict[str, tables.Table] = {}  # device key -> dispatch table, built once per process


def _device_of(inputs: dict) -> torch.device:
    return next(v.device for v in inputs.values() if isinstance(v, torch.Tensor))


def rule_choice(op: Operator, device_info) -> Implementation | None:
    """The default rule for untuned shapes: the implementation to run, or None for the reference."""
    for name in AUTO_ORDER.get(device_info.kind, ()):
        impl = op.implementation(name)
        if impl.unavailable(device_info) is None:
            return impl
    return None


def table_for(device_info) -> tables.Table:
    """This device's dispatch table from the default store (empty if there is none or it is unreadable)."""
    table = _TABLES.get(device_info.key)
    if table is None:
        table = tables.Table()
        path = stores.default_path()
        if path.exists():
            try:
                with stores.Store(path) as store:
                    table = tables.from_store(store, device_info.key)
            except stores.StoreError as exc:
                warnings.warn(f"{exc} Until then backend='auto' uses its default rule.", RuntimeWarning, stacklevel=3)
        _TABLES[device_info.key] = table
    return table


def reload_tables() -> None:
    """Forget the loaded tables (after tuning in this process, or to pick up another store)."""
    _TABLES.clear()


def auto_choice(op: Operator, problem, device_info) -> tuple[Implementation | None, dict | None]:
    """What backend="auto" runs for `problem`: (implementation, config), or (None, None) for the reference."""
    entry = table_for(device_info).lookup(op.name, problem)
    if entry is not None:
        if entry.impl == "reference":
            return None, None
        impl = op.implementation(entry.impl)
        if impl.unavailable(device_info) is None:
            return impl, entry.config
    impl = rule_choice(op, device_info)
    return (impl, impl.default_config(problem)) if impl else (None, None)


def resolve(op: Operator, problem, device_info, backend: str, config) -> tuple[Implementation | None, dict | None]:
    """(implementation or None for the reference, checked config) for one call."""
    if backend not in (*op.backends, "auto"):
        raise ValueError(f"backend must be one of {(*op.backends, 'auto')}, got {backend!r}")
    if backend == "auto":
        if config is not None:
            raise ValueError("config needs an explicit backend; backend='auto' picks its own config")
        return auto_choice(op, problem, device_info)
    if backend == "reference":
        impl = None
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
