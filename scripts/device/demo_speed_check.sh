#!/usr/bin/env bash
# Why did `make demo` measure x1.01 tokens/s in session 16 (call 1) where session 15 measured
# x1.30 on nearly the same code? One call, the demo alone (nothing else on the GPU), twice,
# with the GPU's clocks, power and throttle reasons sampled every 200 ms and the apps on the
# GPU listed before each run. Everything is packed into one tarball (few files come back).
#
# Usage: bash scripts/device/demo_speed_check.sh OUT_DIR   (about 4 minutes on an H100)
set -u
out=${1:?usage: demo_speed_check.sh OUT_DIR}
mkdir -p "$out/pack"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv > "$out/pack/smi.csv"
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active \
  --format=csv,noheader -lms 200 >> "$out/pack/smi.csv" &
smi=$!
for run in 1 2; do
  nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv > "$out/pack/gpu_apps_run$run.txt" 2>&1
  date -u '+run '$run' start %H:%M:%S' | tee -a "$out/pack/times.txt"
  timeout -s INT -k 10 "${DEMO_SECONDS:-130}" python -u scripts/demo.py --out "$out/pack/demo$run" \
    > "$out/pack/demo$run.log" 2>&1
  echo "run $run exit $?" | tee -a "$out/pack/times.txt"
  grep -A4 "=== results ===" "$out/pack/demo$run.log"; grep "liger / plain" "$out/pack/demo$run.log"
done
kill "$smi" 2>/dev/null
tar -C "$out" -czf "$out/all.tgz" pack && rm -rf "$out/pack"
