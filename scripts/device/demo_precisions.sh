#!/usr/bin/env bash
# The main job on a GPU at each precision, each with the eager-attention rounding control, so the
# liger-vs-plain loss difference can be read against HF's own rounding noise. Usage: bash $0 OUT_DIR
set -uo pipefail
out=${1:?usage: demo_precisions.sh OUT_DIR}
mkdir -p "$out"
python -m pip install --no-deps --no-build-isolation -e . > "$out/install.log" 2>&1
nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv > "$out/gpu.txt"
python -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" >> "$out/gpu.txt"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}  # the editable install alone did not resolve (call 2)
# DEMO_RUNS: precision:seed pairs.
for run in ${DEMO_RUNS:-bf16:0 bf16-mixed:0 fp32:0}; do
  precision=${run%%:*} seed=${run##*:}
  python -u scripts/demo.py --precision "$precision" --seed "$seed" --control --out "$out/${precision}_seed$seed" \
    ${DEMO_ARGS:-} > "$out/demo_${precision}_seed$seed.log" 2>&1
  echo "$precision seed $seed exit $?" | tee -a "$out/exits.txt"
  grep -v "it/s\]\|s/it\]" "$out/demo_${precision}_seed$seed.log" | grep "^|plain\|^plain\|^liger \|^control"
done
# Few files come back per call: pack the per-run folders.
tar -C "$out" -czf "$out/runs.tgz" $(cd "$out" && ls -d */) && rm -rf "$out"/*/
