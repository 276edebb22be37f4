#!/usr/bin/env bash
# The oldest Triton we support, 3.6 (the H200 image we know has it): every Triton kernel's default config builds
# for sm_90a under it with no GPU hazard (the lint of kernels/gpu_lint.py; compile-check exits 1 on one), and the
# top-k replayed in the interpreter as 3.6 pairs its histograms (tests/test_gpu_pairing.py with 3.6 as the TTGIR
# builder: the first H200 run's outcomes reproduced for the old histograms, the shipped ones pass). Creates .venv-triton36 beside the project's .venv on first use (torch as in .ci/run, the
# project's dependencies, then triton==3.6.0 over the newer one), then runs compile-check on the Triton kernels at
# the smoke and v41-flash shapes, then the replay. Not in CI (a 190 MB wheel and the builds take minutes): run it before every
# stop that touches Triton code.
# Usage: scripts/triton36_check.sh [compile-check options, e.g. an operator name]
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv-triton36/bin/python ]; then
    python3 -m venv .venv-triton36
    .venv-triton36/bin/pip install -q torch==2.13.0
    .venv-triton36/bin/pip install -q -e ".[test]"
    .venv-triton36/bin/pip install -q triton==3.6.0
fi
.venv-triton36/bin/python -c "import triton; assert triton.__version__.startswith('3.6'), triton.__version__"
for preset in smoke v41-flash; do
    .venv-triton36/bin/python -m flashkern compile-check --impl triton --preset "$preset" --sample 0 "$@"
done
FLASHKERN_TRITON_BUILDER=.venv-triton36/bin/python .venv/bin/python -m pytest -q -n 2 tests/test_gpu_pairing.py
