#!/usr/bin/env bash
# Session 18's second call: the RMSNorm fp32 dx bound (cancellation term) and the demo's new
# verdict (gradients at the trained weights against float64) on the GPU.
#   1. tests/ops/test_rms_norm.py's fp32 test three times with fresh draws (full shapes), and the
#      demo tests of tests/examples (the gradient check's own tests run on the GPU there).
#   2. `python -u scripts/demo.py` with the GPU defaults, then once at --model-size base if the call has room.
# Everything is packed into one tarball; summaries are printed as each stage ends.
set -u
out=${1:?usage: session18.sh OUT_DIR}
mkdir -p "$out/pack"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/pack/gpu.txt" 2>&1
cat "$out/pack/gpu.txt"
for i in 1 2 3; do
  timeout -s INT -k 10 60 python -m pytest -q -p no:cacheprovider tests/ops/test_rms_norm.py -k fp32_matches_float64 \
    > "$out/pack/rms_fp32_$i.log" 2>&1
  echo "rms fp32 round $i exit $? $(tail -1 "$out/pack/rms_fp32_$i.log")"
done
timeout -s INT -k 10 150 python -m pytest -q -p no:cacheprovider tests/examples/test_examples.py -k demo \
  > "$out/pack/demo_tests.log" 2>&1
echo "demo tests exit $? $(tail -1 "$out/pack/demo_tests.log")"
for size in default base; do
  args=(); [ "$size" = base ] && args=(--model-size base)
  # The base run only where the call has room left (the device budget is short).
  [ "$size" = base ] && [ "$SECONDS" -gt "${BASE_DEMO_AFTER_S:-260}" ] && { echo "demo base skipped at ${SECONDS}s"; continue; }
  nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv > "$out/pack/gpu_apps_$size.txt" 2>&1
  timeout -s INT -k 10 "${DEMO_SECONDS:-170}" python -u scripts/demo.py "${args[@]}" --out "$out/pack/demo_$size" \
    > "$out/pack/demo_$size.log" 2>&1
  echo "demo $size exit $?"
  grep -v "it/s\]\|s/it\]" "$out/pack/demo_$size.log" | grep -A30 "=== results ===" | grep -v "^wrote"
done
tar -C "$out" -czf "$out/all.tgz" pack && rm -rf "$out/pack"
