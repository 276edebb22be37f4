"""What the operators' comparisons (Operator.compare) share: an elementwise bound with NaN and inf held exactly."""

from __future__ import annotations

import torch


def assert_within(name: str, expected: torch.Tensor, actual: torch.Tensor, allowed: torch.Tensor | float) -> None:
    """|actual - expected| <= allowed wherever the reference is finite; NaN and inf exactly where the reference has
    them. The error names the output, how many elements are off and the first one."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, (
        f"{name}: got {actual.dtype} {list(actual.shape)}, expected {expected.dtype} {list(expected.shape)}")
    e, a = expected.cpu().float(), actual.cpu().float()
    allowed = torch.as_tensor(allowed, dtype=torch.float32).cpu().broadcast_to(e.shape)
    same_special = (torch.isnan(e) & torch.isnan(a)) | (e == a)
    special = ~(torch.isfinite(e) & torch.isfinite(a)) & ~same_special
    assert not special.any(), f"{name}: NaN/inf differ at {torch.nonzero(special)[0].tolist()}"
    off = torch.isfinite(e) & ((a - e).abs() > allowed)
    if off.any():
        at = tuple(torch.nonzero(off)[0].tolist())
        raise AssertionError(f"{name}: {int(off.sum())} of {e.numel()} elements off; first at {list(at)}: "
                             f"{a[at].item()} vs {e[at].item()} (allowed +-{allowed[at].item():.3g})")
