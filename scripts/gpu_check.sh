#!/usr/bin/env bash
# The GPU session in one run, no network needed: the equivalence suite on CUDA (the sm_90a builds run in CI),
# the serving path (CUDA-graph capture and replay of every operator, no host reads, torch.compile),
# smoke-preset tuning, dispatch tables (JSON), reports and plots, benchmarks, the performance model's
# predictions against the measured times (docs/model-h200.json vs bench.json) and logs, all
# written into OUT_DIR, with a one-line-per-step summary in OUT_DIR/summary.txt. The step limits sum to
# 585 s, inside the project's per-command time budget of 600 s on the lent GPU machine; nothing here has
# run on an H200 yet. A failed step does not stop the others. Details: docs/gpu.md.
#
# Usage: scripts/gpu_check.sh OUT_DIR      (PYTHON=... picks the interpreter; default python3)
# To carry the results off the machine as one file, pack the folder:
#   scripts/gpu_check.sh /tmp/gpu && tar czf gpu_check.tgz -C /tmp/gpu .
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

step env 20 bash -c "nvidia-smi; $py -c 'import torch, triton, tilelang, flashkern.device as d; \
print(torch.__version__, triton.__version__, tilelang.__version__); print(d.info())'"
step tests 60 "$py" -m pytest tests/test_moe_route.py tests/test_codecs.py tests/test_registry.py -q \
    -p no:cacheprovider --junitxml="$out/tests.xml"
step tests-indexer 65 "$py" -m pytest tests/test_indexer.py -q -p no:cacheprovider --junitxml="$out/tests-indexer.xml"
step tests-mhc 65 "$py" -m pytest tests/test_mhc.py -q -p no:cacheprovider --junitxml="$out/tests-mhc.xml"
step tests-layouts-compat 65 "$py" -m pytest tests/test_layouts.py tests/test_vllm_routing.py tests/test_vllm_topk.py \
    tests/test_vllm_mhc.py tests/test_deep_gemm.py -q -p no:cacheprovider --junitxml="$out/tests-layouts-compat.xml"
step tests-kv-cache 45 "$py" -m pytest tests/test_kv_cache.py tests/test_replay.py -q -p no:cacheprovider \
    --junitxml="$out/tests-kv-cache.xml"
step tests-serving 50 "$py" -m pytest tests/test_serving.py -q -p no:cacheprovider --junitxml="$out/tests-serving.xml"
for op in mqa_logits; do
    step "tune-$op" 30 "$py" -m flashkern tune "$op" --preset smoke --budget 0.1 --max-configs 8
    step "table-$op" 10 "$py" -m flashkern table "$op" --export "$out/table-$op.json"
    step "report-$op" 10 "$py" -m flashkern report "$op" --plot "$out/$op.png"
done
step bench 25 "$py" -m flashkern bench moe_route moe_route_gate --preset v41-flash --budget 0.2 --json "$out/bench.json"
step indexer-work 30 "$py" benchmarks/indexer_work.py --rows 16 --backends reference,triton,tilelang --budget 0.2 \
    --json "$out/indexer-work.json"
step mhc-bandwidth 35 "$py" benchmarks/mhc_bandwidth.py --kernel-tokens 8192 --budget 0.2
step kv-cache-bytes 20 "$py" benchmarks/kv_cache_bytes.py --tokens 1,8,64 --kernel-tokens 64 --budget 0.2
step bounded-replay 30 "$py" benchmarks/bounded_replay.py --backend triton --full-width --rows 1024 \
    --hits 4096,16384,65536 --no-model --budget 0.1 --json "$out/bounded-replay.json"
step designs 40 "$py" benchmarks/designs.py --tokens 1,8,64,4096 --budget 0.2 --json "$out/designs.json"
step model-vs-measured 10 "$py" benchmarks/model_vs_measured.py docs/model-h200.json "$out/bench.json" \
    --json "$out/model-vs-measured.json"
step dispatch-overhead 10 "$py" benchmarks/dispatch_overhead.py --rounds 5 --number 200
exit $status
