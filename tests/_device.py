"""Where the equivalence tests run their kernels: CUDA when present, else the CPU paths.

FLASHKERN_TEST_DEVICE=cpu|cuda overrides (scripts/gpu_check.sh runs the suite on the GPU).
"""

import os

import torch

DEVICE = torch.device(os.environ.get("FLASHKERN_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu"))


def on_device(inputs: dict) -> dict:
    """The inputs with every tensor moved to DEVICE (meta tensors, used to test device errors, stay)."""
    return {k: v.to(DEVICE) if isinstance(v, torch.Tensor) and not v.is_meta else v for k, v in inputs.items()}
