#!/usr/bin/env bash
# Session-3 GPU call 2: gemma2 bisection, HF mixtral compile check, the parallel GPU suite.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src:$PWD
pip install --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1
start=$SECONDS
t() { echo "[$((SECONDS - start)) s] $*"; }
t bisect
timeout 100 python scripts/device/bisect_convergence.py gemma2 > "$OUT/bisect_gemma2.log" 2>&1
t hf_compile
timeout 80 python scripts/device/hf_mixtral_compile.py > "$OUT/hf_mixtral_compile.log" 2>&1
t suite
LIGER_TEST_SHAPES=full timeout -s INT $((580 - (SECONDS - start))) python -m pytest tests -q -p no:cacheprovider -n 4 \
  --ignore tests/ops/test_huge_tensors.py --ignore tests/ops/test_fused_linear_cross_entropy.py \
  --junitxml "$OUT/junit.xml" > "$OUT/suite.log" 2>&1
t done
tail -3 "$OUT/suite.log"; grep -E "^FAILED|^ERROR" "$OUT/suite.log" | cut -c1-200 | head -30
