"""Hypothesis profiles: `ci` (fast, the default), `thorough` (local runs), `deep` (exhaustive sweeps: hundreds of
examples from a random seed, run now and then), `gpu` (scripts/gpu_check.sh).

Select with FLASHKERN_HYPOTHESIS_PROFILE=thorough (or pytest --hypothesis-profile=thorough). `ci` and `gpu` are
narrow: the specializations (compiled programs) a case selects come from the operators' presets
(flashkern.kernels.cases); `thorough` and `deep` draw every combination.
The suite runs in checked mode (index values checked on every call; flashkern.checks) unless
FLASHKERN_CHECKED=0 is set; tests of the default mode turn it off where they need to.
"""

import os

os.environ.setdefault("FLASHKERN_CHECKED", "1")  # before flashkern is imported

import flashkern  # noqa: E402,F401  (before any test module imports triton: flashkern picks the interpreter, which
# Triton reads when its own library is decorated; a module importing triton first left tl.cdiv a plain JITFunction)
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "ci",
    max_examples=5,
    deadline=None,
    derandomize=True,  # CI failures reproduce exactly
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.register_profile(
    "thorough",
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.register_profile(  # FLASHKERN_HYPOTHESIS_PROFILE=deep python -m pytest -n auto tests/test_<family>.py
    "deep",
    max_examples=600,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.register_profile(  # scripts/gpu_check.sh: every drawn specialization is a CUDA JIT compile
    "gpu",
    max_examples=5,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.load_profile(os.environ.get("FLASHKERN_HYPOTHESIS_PROFILE", "ci"))
