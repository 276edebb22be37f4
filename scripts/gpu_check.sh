#!/usr/bin/env bash
# The GPU session in one run, no network needed: the equivalence suite on CUDA, the sm_90a build
# table, smoke-preset tuning, dispatch tables (JSON), reports and plots, benchmarks and logs, all
# written into OUT_DIR, with a one-line-per-step summary in OUT_DIR/summary.txt. About 12 minutes on
# one H200 (an estimate: the indexer steps have not run on one yet); each step has its own time
# limit and a failed step does not stop the others.
#
# Usage: scripts/gpu_check.sh OUT_DIR      (PYTHON=... picks the interpreter; default python3)
# Through the device tool, whose $OUT takes at most 8 files, pack the folder:
#   scripts/gpu_check.sh /tmp/gpu && tar czf $OUT/gpu_check.tgz -C /tmp/gpu .
# flashkern must be importable there (pip install -e . --no-deps, tilelang from carried wheels).
# A dry run of the plumbing on a CPU machine: FLASHKERN_TEST_DEVICE=cpu scripts/gpu_check.sh /tmp/dry
set -uo pipefail
out=$(realpath -m "${1:?usage: scripts/gpu_check.sh OUT_DIR}")
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 FLASHKERN_TUNE_DB="$out/tuning.sqlite3" FLASHKERN_TEST_DEVICE=${FLASHKERN_TEST_DEVICE:-cuda} \
       FLASHKERN_HYPOTHESIS_PROFILE=gpu
py=${PYTHON:-python3}
status=0

step() {  # step NAME SECONDS COMMAND...: time-limited, logged to OUT_DIR/NAME.log
    local name=$1 limit=$2 start=$SECONDS rc
    shift 2
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    rc=$?
    printf '%-22s rc=%-4s %4ss\n' "$name" "$rc" "$((SECONDS - start))" | tee -a "$out/summary.txt"
    [ "$rc" -eq 0 ] || status=1
}

step env 60 bash -c "nvidia-smi; $py -c 'import torch, triton, tilelang, flashkern.device as d; \
print(torch.__version__, triton.__version__, tilelang.__version__); print(d.info())'"
step tests 240 "$py" -m pytest tests/test_moe_route.py tests/test_codecs.py tests/test_registry.py -q \
    -p no:cacheprovider --junitxml="$out/tests.xml"
step tests-indexer 180 "$py" -m pytest tests/test_indexer.py -q -p no:cacheprovider --junitxml="$out/tests-indexer.xml"
step compile-check 60 "$py" -m flashkern compile-check --sample 1 --json "$out/compile-check.json"
for op in moe_route moe_route_gate mqa_logits; do
    step "tune-$op" 75 "$py" -m flashkern tune "$op" --preset smoke --budget 0.1 --max-configs 8
    step "table-$op" 30 "$py" -m flashkern table "$op" --export "$out/table-$op.json"
    step "report-$op" 30 "$py" -m flashkern report "$op" --plot "$out/$op.png"
done
step bench 60 "$py" -m flashkern bench moe_route moe_route_gate --preset v41-flash --budget 0.2 --json "$out/bench.json"
step indexer-work 90 "$py" benchmarks/indexer_work.py --rows 16 --backends reference,triton,tilelang --budget 0.2 \
    --json "$out/indexer-work.json"
step dispatch-overhead 30 "$py" benchmarks/dispatch_overhead.py
exit $status
