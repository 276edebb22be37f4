"""flashkern: kernels for DeepSeek-V4.1-Flash-class inference.

Every operator has a PyTorch reference (flashkern.reference), a Triton and a TileLang
implementation (flashkern.kernels.<family>), a tuning space and property tests.
Public entry points live in `flashkern.ops`; the registry in `flashkern.registry`.

Importing flashkern decides how Triton kernels run, before any kernel is defined:
natively on CUDA, or under Triton's interpreter where no GPU is present. An explicit
TRITON_INTERPRET in the environment always wins. It then registers every operator, so that
torch.ops.flashkern.<name> exists for an engine that calls it (or loads a compiled graph naming it)
without touching flashkern.ops; no kernel is compiled until a call needs it.
"""

import contextlib
import contextvars
import os

__version__ = "0.1.0"


def _choose_triton_mode() -> None:
    # Triton reads TRITON_INTERPRET when a kernel is decorated, so this must run first.
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton's current default, stated to silence its warning
    if "TRITON_INTERPRET" in os.environ:
        return
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


_choose_triton_mode()
_TRITON_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


_PLANNING_FOR_GPU = contextvars.ContextVar("flashkern_planning_for_gpu", default=False)


def triton_interpreted() -> bool:
    """True when this process's Triton kernels run under the interpreter (decided at import), unless inside
    `planning_for_gpu()`."""
    return _TRITON_INTERPRETED and not _PLANNING_FOR_GPU.get()


@contextlib.contextmanager
def planning_for_gpu():
    """Inside: configs and tile shapes are chosen as on a GPU, though the interpreter still runs launches (the
    performance model counts the GPU design's traffic this way; flashkern.model)."""
    token = _PLANNING_FOR_GPU.set(True)
    try:
        yield
    finally:
        _PLANNING_FOR_GPU.reset(token)


from flashkern.checks import checked, checked_mode  # noqa: E402  (after the Triton mode is decided)
from flashkern import registry  # noqa: E402

registry.operators()  # the custom ops: torch.ops.flashkern.<name> (flashkern.library)
