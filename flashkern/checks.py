"""Argument checks for operator entry points: each error names the argument and what was expected.

They run before any kernel is launched (or compiled). Two kinds:
  metadata checks (dtype, shape, device, strides, Python arguments): always, without reading tensor data;
  value checks (index ranges, ks <= ke, block table entries): only in checked mode, because reading a
    tensor's values on the host is a device synchronization (tens of microseconds per call on a GPU) and
    breaks CUDA-graph capture. Without them every kernel stays memory-safe: an out-of-range index counts
    as padding (each operator's docstring says what it yields).
Checked mode is off by default; FLASHKERN_CHECKED=1 in the environment turns it on for the process (the
test suite does), `with flashkern.checked():` for a block (`checked(False)` turns it off).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import os
from typing import Sequence

import torch

_CHECKED = contextvars.ContextVar("flashkern_checked",
                                  default=os.environ.get("FLASHKERN_CHECKED", "0") not in ("", "0"))


def checked_mode() -> bool:
    """True when value checks run (see the module docstring)."""
    return _CHECKED.get()


@contextlib.contextmanager
def checked(enabled: bool = True):
    """Run value checks (index ranges, table entries) on every call inside the block, or not (enabled=False)."""
    token = _CHECKED.set(enabled)
    try:
        yield
    finally:
        _CHECKED.reset(token)


def tensor(name: str, value, *, dtype: torch.dtype | Sequence[torch.dtype], shape: Sequence[int | None],
           device: torch.device | None = None, strided: bool = False) -> torch.Tensor:
    """A tensor of the given dtype(s) and shape (None = any size), on `device`, in a layout the kernels honour.

    Layouts: contiguous by default; `strided=True` for an input whose kernels take the strides of every
    dimension but the last, which must have unit stride: row-padded (a column slice of a wider buffer),
    sliced, permuted leading dimensions, offset (storage_offset > 0) and expanded (stride 0) views.
    """
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    dtypes = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype)
    if value.dtype not in dtypes:
        wanted = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must be {wanted}, got {str(value.dtype).replace('torch.', '')}")
    sizes = value.shape
    if len(sizes) != len(shape) or not all(want is None or got == want for got, want in zip(sizes, shape)):
        wanted = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise ValueError(f"{name} must have shape {wanted}, got {list(sizes)}")
    if device is not None and value.device != device:
        raise ValueError(f"{name} is on {value.device}, but the other inputs are on {device}")
    if not strided and not value.is_contiguous():
        raise ValueError(f"{name} must be contiguous (strides {list(value.stride())}); pass {name}.contiguous()")
    if strided and sizes and sizes[-1] > 1 and value.stride(-1) != 1:
        raise ValueError(f"{name} must have unit stride along its last dimension (strides {list(value.stride())}); "
                         f"pass {name}.contiguous()")
    return value


def optional_tensor(name: str, value, **expected) -> torch.Tensor | None:
    return None if value is None else tensor(name, value, **expected)


def integer(name: str, value, *, low: int | None = None, high: int | None = None, why=None) -> int:
    """An int in [low, high]; `why` (a string, or a callable giving one) explains the bound in the error.
    A symbolic size (torch.SymInt, while torch.compile traces with dynamic shapes) counts as an int."""
    if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"at least {low}" if high is None else f"at most {high}" if low is None else f"in [{low}, {high}]"
        why = why() if callable(why) else why
        raise ValueError(f"{name}={value} must be {bounds}{' (' + why + ')' if why else ''}")
    return value


def real(name: str, value, *, positive: bool = False) -> float:
    """A finite Python number (positive when asked)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if positive and value <= 0:
        raise ValueError(f"{name} must be positive, got {value!r}")
    return float(value)


def choice(name: str, value, options: Sequence) -> object:
    if value not in options:
        raise ValueError(f"{name} must be one of {tuple(options)}, got {value!r}")
    return value


def flag(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def values_in(name: str, value: torch.Tensor, low, high, *, why: str, allow=None) -> torch.Tensor:
    """Every element of an integer tensor in [low, high] (bounds: ints or tensors broadcasting with it),
    or equal to `allow`; the error names the first offender. Reads the data (a sync on GPU)."""
    bad = (value < low) | (value > high)
    if allow is not None:
        bad &= value != allow
    if bool(bad.any()):
        at = tuple(int(i) for i in torch.nonzero(bad)[0])
        shown = ", ".join(map(str, at))
        bound = lambda b: b if isinstance(b, int) else int(b.broadcast_to(value.shape)[at])  # noqa: E731
        also = f" or {allow}" if allow is not None else ""
        raise ValueError(f"{name}[{shown}] = {int(value[at])} is out of range: must be in "
                         f"[{bound(low)}, {bound(high)}]{also} ({why})")
    return value
