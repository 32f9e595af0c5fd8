#!/usr/bin/env bash
# Session-3 GPU call 3: CE + convergence re-run, serial huge-tensor + FLCE tests, quick
# benchmarks, sanitizer. Logs under $OUT.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src:$PWD
pip install --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1
start=$SECONDS
t() { echo "[$((SECONDS - start)) s] $*"; }
t rerun
LIGER_TEST_SHAPES=full timeout -s INT 120 python -m pytest -q -p no:cacheprovider -n 4 tests/ops/test_cross_entropy.py \
  tests/transformers/test_convergence.py > "$OUT/rerun.log" 2>&1
tail -1 "$OUT/rerun.log"; grep -E "^FAILED" "$OUT/rerun.log" | cut -c1-160 | head
t serial
LIGER_TEST_SHAPES=full timeout -s INT 150 python -m pytest -q -p no:cacheprovider tests/ops/test_huge_tensors.py \
  tests/ops/test_fused_linear_cross_entropy.py > "$OUT/serial.log" 2>&1
tail -1 "$OUT/serial.log"; grep -E "^FAILED" "$OUT/serial.log" | cut -c1-160 | head
t bench
timeout -s INT $((400 - (SECONDS - start))) python -m benchmarks --quick --max-seconds $((370 - (SECONDS - start))) --out "$OUT/bench" > "$OUT/bench.log" 2>&1
tail -4 "$OUT/bench.log"
t sanitizer
timeout $((480 - (SECONDS - start))) bash scripts/sanitizer_check.sh "$OUT/sanitizer" > /dev/null 2>&1
cat "$OUT/sanitizer/sanitizer.txt" 2>/dev/null
t done
