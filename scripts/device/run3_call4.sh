#!/usr/bin/env bash
# Session-3 GPU call 4 (short: little device time left): the CE target-gradient change on the
# GPU - CE and FLCE tests, CE benchmark.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src:$PWD
start=$SECONDS
t() { echo "[$((SECONDS - start)) s] $*"; }
t ce
LIGER_TEST_SHAPES=full timeout -s INT 75 python -m pytest -q -p no:cacheprovider -n 4 tests/ops/test_cross_entropy.py \
  tests/ops/test_determinism.py > "$OUT/ce.log" 2>&1
tail -1 "$OUT/ce.log"; grep -E "^FAILED" "$OUT/ce.log" | cut -c1-160 | head
t flce
LIGER_TEST_SHAPES=full timeout -s INT 90 python -m pytest -q -p no:cacheprovider -n 2 tests/ops/test_fused_linear_cross_entropy.py \
  > "$OUT/flce.log" 2>&1
tail -1 "$OUT/flce.log"; grep -E "^FAILED" "$OUT/flce.log" | cut -c1-160 | head
t bench
timeout -s INT 60 python -m benchmarks --quick --ops cross_entropy --max-seconds 45 --out "$OUT/bench" > "$OUT/bench.log" 2>&1
grep -E "cross_entropy +full" "$OUT/bench.log" | head -3
t done
