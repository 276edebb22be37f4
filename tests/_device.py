"""Where the equivalence tests run their kernels: CUDA when present, else the CPU paths.

FLASHKERN_TEST_DEVICE=cpu|cuda overrides (scripts/gpu_check.sh runs the suite on the GPU).
"""

import os

import torch

DEVICE = torch.device(os.environ.get("FLASHKERN_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu"))


def to_device(t: torch.Tensor) -> torch.Tensor:
    """t on DEVICE with its layout kept (strides, storage offset, the storage around it): `.to()` makes a view
    with gaps contiguous, so a layout under test would silently become a valid one on the GPU."""
    if t.device == DEVICE or t.is_contiguous():
        return t.to(DEVICE)
    storage = t.untyped_storage()
    whole = torch.empty(0, dtype=t.dtype).set_(storage, 0, (storage.nbytes() // t.element_size(),))
    return whole.to(DEVICE).as_strided(t.shape, t.stride(), t.storage_offset())


def on_device(inputs: dict) -> dict:
    """The inputs with every tensor moved to DEVICE, layouts kept (meta tensors, used to test device errors,
    stay)."""
    return {k: to_device(v) if isinstance(v, torch.Tensor) and not v.is_meta else v for k, v in inputs.items()}
