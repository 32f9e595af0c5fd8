#!/usr/bin/env bash
# Session 15's one full call: the whole GPU suite (full shapes), then the main job with its GPU
# defaults (bf16 mixed precision, control run), then pure bf16 on a second seed (the first
# seed's pure-bf16 run drifted 2.2x HF's own rounding noise: chance or bias?).
set -u
out=${1:?usage: session15_final.sh OUT_DIR}
mkdir -p "$out"
GPU_CHECK_BENCH=0 GPU_CHECK_E2E=0 GPU_CHECK_BUDGET_S=${SUITE_BUDGET_S:-330} bash scripts/gpu_check.sh "$out/r" > "$out/suite.txt" 2>&1
tail -8 "$out/suite.txt"  # also kept whole, beside the tarball
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
python -u scripts/demo.py --out "$out/demo" > "$out/demo.log" 2>&1
echo "make-demo-equivalent exit $?" | tee -a "$out/exits.txt"
grep -v "it/s\]\|s/it\]" "$out/demo.log" | tail -16
DEMO_RUNS="${EXTRA_RUNS:-bf16:1}" bash scripts/device/demo_precisions.sh "$out/extra" 2>&1 | tail -6
# Few files come back per call (call 10 lost the suite's logs to that limit): pack them all.
tar -C "$out" -czf "$out/all.tgz" r demo extra && rm -rf "$out/r" "$out/demo" "$out/extra"
