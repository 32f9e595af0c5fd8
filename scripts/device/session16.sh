#!/usr/bin/env bash
# Session 16's one call: the whole GPU suite (full shapes; it now includes the model-level check
# that every in_place norm writes dx over dy), the main job with its GPU defaults (its peak
# memory shows whether the norms still write in place inside the Trainer), and the norm
# benchmarks once more (their liger backward now allocates dx: the harness's dY must survive).
# Every stage runs under a timeout so the call ends, and packs its output, inside ~560 s.
set -u
out=${1:?usage: session16.sh OUT_DIR}
mkdir -p "$out/pack"
GPU_CHECK_BENCH=0 GPU_CHECK_E2E=0 GPU_CHECK_BUDGET_S=${SUITE_BUDGET_S:-400} \
  bash scripts/gpu_check.sh "$out/pack/r" > "$out/suite.txt" 2>&1
tail -8 "$out/suite.txt"
# Few files come back per call: each stage packs its own as soon as it ends.
tar -C "$out/pack" -czf "$out/suite.tgz" r && rm -rf "$out/pack/r"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
# Anything the suite left running would share the GPU with the demo's timed runs.
nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv 2>&1 | tee "$out/gpu_apps_before_demo.txt"
timeout -s INT -k 10 "${DEMO_SECONDS:-140}" python -u scripts/demo.py --out "$out/pack/demo" > "$out/demo.log" 2>&1
echo "make-demo-equivalent exit $?" | tee -a "$out/exits.txt"
grep -v "it/s\]\|s/it\]" "$out/demo.log" | tail -16
[ -d "$out/pack/demo" ] && tar -C "$out/pack" -czf "$out/demo.tgz" demo && rm -rf "$out/pack/demo"
[ "${BENCH_SECONDS:-90}" = 0 ] || timeout -s INT -k 10 "${BENCH_SECONDS:-90}" python -m benchmarks --quick --ops rms_norm,layer_norm --no-plots \
  --max-seconds $(( ${BENCH_SECONDS:-90} - 25 )) --out "$out/pack/bench" > "$out/pack/bench.log" 2>&1
echo "norm benchmarks exit $?" | tee -a "$out/exits.txt"
grep -i "rms_norm\|layer_norm" "$out/pack/bench.log" | tail -12
[ -d "$out/pack/bench" ] && tar -C "$out/pack" -czf "$out/bench.tgz" bench bench.log && rm -rf "$out/pack"
