#!/usr/bin/env bash
# Session-3 GPU call 3: serial huge-tensor + FLCE tests, CE tune, quick benchmarks, sanitizer.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src:$PWD
pip install --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1
start=$SECONDS
t() { echo "[$((SECONDS - start)) s] $*"; }
t serial
LIGER_TEST_SHAPES=full timeout -s INT 200 python -m pytest -q -p no:cacheprovider tests/ops/test_huge_tensors.py \
  tests/ops/test_fused_linear_cross_entropy.py > "$OUT/serial.log" 2>&1
tail -2 "$OUT/serial.log"
t tune
timeout 100 python -m benchmarks.tune --out "$OUT/tune_ce" --only cross_entropy > "$OUT/tune_ce.log" 2>&1
t bench
timeout -s INT $((520 - (SECONDS - start))) python -m benchmarks --quick --out "$OUT/bench" > "$OUT/bench.log" 2>&1
t sanitizer
timeout $((585 - (SECONDS - start))) bash scripts/sanitizer_check.sh "$OUT/sanitizer" > /dev/null 2>&1
cat "$OUT/sanitizer/sanitizer.txt" 2>/dev/null
t done
