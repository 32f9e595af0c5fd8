#!/usr/bin/env bash
# Session-3 GPU call 4: the CE target-gradient change on the GPU (CE, FLCE, convergence
# tests, CE/FLCE benchmark).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src:$PWD
pip install --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1
start=$SECONDS
t() { echo "[$((SECONDS - start)) s] $*"; }
t ce
LIGER_TEST_SHAPES=full timeout -s INT 130 python -m pytest -q -p no:cacheprovider -n 4 tests/ops/test_cross_entropy.py \
  tests/ops/test_determinism.py tests/transformers/test_convergence.py tests/transformers/test_cross_entropy.py \
  > "$OUT/ce.log" 2>&1
tail -1 "$OUT/ce.log"; grep -E "^FAILED" "$OUT/ce.log" | cut -c1-160 | head
t flce
LIGER_TEST_SHAPES=full timeout -s INT 130 python -m pytest -q -p no:cacheprovider tests/ops/test_fused_linear_cross_entropy.py \
  tests/ops/test_huge_tensors.py -k "cross_entropy or fused or flce" > "$OUT/flce.log" 2>&1
tail -1 "$OUT/flce.log"; grep -E "^FAILED" "$OUT/flce.log" | cut -c1-160 | head
t bench
timeout -s INT $((370 - (SECONDS - start))) python -m benchmarks --quick --ops cross_entropy,fused_linear_cross_entropy \
  --max-seconds $((340 - (SECONDS - start))) --out "$OUT/bench" > "$OUT/bench.log" 2>&1
tail -12 "$OUT/bench.log"
t done
