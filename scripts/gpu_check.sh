#!/usr/bin/env bash
# The one GPU check: the test suite with full shapes, the kernel benchmarks and the end-to-end
# training benchmark, in one call, leaving few files in OUT_DIR:
#   env.txt    nvidia-smi, versions, how liger_kernel was made importable
#   tests.log  junit.xml   the whole test suite with the full (GPU) shape set
#   bench.csv  bench.png   python -m benchmarks (every op, provider and mode)
#   bench.log              its table and targets, then benchmarks/e2e_training.py's output
#   (e2e_training.py writes its own CSV/PNG into OUT_DIR when it exists)
# A failing stage is recorded and the next one still runs; a summary is printed last.
#
# Usage: scripts/gpu_check.sh [OUT_DIR]   (default: $OUT)
# Environment:
#   GPU_CHECK_TESTS=0|1 (1)   GPU_CHECK_BENCH=0|1 (1)   GPU_CHECK_E2E=0|1 (1)   GPU_CHECK_CENSUS=0|1 (0)
#   GPU_CHECK_TUNE=0|1 (0)  python -m benchmarks.tune after the benchmarks (tune.csv; its log into bench.log),
#                 TUNE_ONLY its --only list (default head_chunks,head_epilogue: every head-bound loss under
#                 each chunk budget, the epilogue kernels' tiles)
#   Test-only wheels: .whl/tests/*.whl (kernels and tomlkit, for tests/hub) are installed offline into
#                 $TMPDIR/liger_test_site and put on the tests' PYTHONPATH whenever that folder travels.
#   GPU_CHECK_CENSUS=1 runs the full model census last (census.log, and the generated table as
#                 models.md: copy it to docs/models.md); GPU_CHECK_CENSUS_JOBS (4) worker processes
#   PYTEST_ARGS   extra pytest arguments, e.g. "-x" or "-k rms_norm"
#   GPU_CHECK_WORKERS (6)  xdist workers for all but the memory-hungry tests
#   GPU_CHECK_HEAVY_WORKERS (3)  xdist workers for the fused linear CE tests (float64 references of
#                 a full-size head, ~10 GB each); the two >2**31-element tests run alone before them
#   BENCH_ARGS    extra arguments for python -m benchmarks, e.g. "--quick --ops rope"
#   E2E_ARGS      extra arguments for benchmarks/e2e_training.py
#   E2E_RUNS      several e2e runs in one call, argument sets separated by ';' (replaces E2E_ARGS), e.g.
#                 "--model qwen3-0.6b --variants all --skip-max-seq; --model gemma3-1b --variants all --skip-max-seq"
#                 (each run writes e2e_<preset>.csv/.png; see benchmarks/e2e_training.py --help)
#   GPU_CHECK_PEERS=0|1 (0)  peers in the same run (benchmarks/peers.py): install the wheels of
#                 GPU_CHECK_WHEELS (default .whl/, an ignored folder: pass it in the device tool's carry)
#                 offline: *.whl with pip --no-index --no-deps --target $TMPDIR/liger_peers (appended to
#                 the benchmark stages' PYTHONPATH, after this checkout's src; the tests never see it), upstream/*.whl (the upstream liger-kernel release)
#                 into $TMPDIR/liger_upstream (its own directory, never on this process's path; children
#                 import it from LIGER_UPSTREAM_PATH); then the benchmarks get --peers all and the e2e
#                 runs may name the liger-upstream variant. A peer that is missing is reported as skipped.
#                 The wheels: cut-cross-entropy; trl (1.16, for trl.kernels) with datasets, dill and
#                 multiprocess (its trainer utilities import them); upstream/liger_kernel-0.8.5.
#                 quack: quack-kernels 0.6.5, nvidia-cutlass-dsl 4.8.1 with its libs-base, libs-core and
#                 libs-cu13 (92 MB: two parts, so two calls), apache-tvm-ffi, torch-c-dlpack-ext (the
#                 image has cuda-bindings, einops and protobuf).
#                 Wheels too large for one transfer travel split: see join_wheel_parts below.
#   Examples, one device call each (wheels: run `scripts/gpu_check.sh` with .whl in the carry list):
#     GPU_CHECK_TESTS=0 GPU_CHECK_E2E=0 GPU_CHECK_PEERS=1 BENCH_ARGS=--quick       kernels vs every peer
#     GPU_CHECK_TESTS=0 GPU_CHECK_BENCH=0 E2E_ARGS="--variants all --skip-max-seq"  llama-1b, 4 variants + floor
#     GPU_CHECK_TESTS=0 GPU_CHECK_BENCH=0 E2E_ARGS="--model qwen3-0.6b --variants all --skip-max-seq"
#     GPU_CHECK_TESTS=0 GPU_CHECK_BENCH=0 E2E_RUNS="--model qwen3-moe --skip-max-seq; --model qwen2.5-vl-3b --skip-max-seq"
#     GPU_CHECK_TESTS=0 GPU_CHECK_BENCH=0 E2E_ARGS="--seq 16384 --max-batch --variants hf,hf-compile,liger --skip-max-seq --steps 3 --warmup 1"
#     GPU_CHECK_TESTS=0 GPU_CHECK_BENCH=0 E2E_ARGS="--variants hf,liger --grad-ckpt both --max-seq-limit 131072 --max-seq-budget 360 --steps 2 --warmup 1"
#     GPU_CHECK_TESTS=0 GPU_CHECK_BENCH=0 GPU_CHECK_PEERS=1 E2E_ARGS="--variants hf,liger,liger-upstream --skip-max-seq"
#   GPU_CHECK_INSTALL=0|1 (1)  pip install --no-deps --no-build-isolation -e . first (so
#                 transformers' is_liger_kernel_available() sees the package); PYTHONPATH=src
#                 is set either way, and is all there is when the install fails
#   GPU_CHECK_BUDGET_S (570)  wall-clock seconds for the whole script: every stage runs
#                 under `timeout` so the script ends (and prints its summary) in time;
#                 the benchmarks get --max-seconds so they stop starting cases and still
#                 write their table. With all stages on, later stages get a reserve
#                 (bench 330 s, e2e 150 s); run stages in separate calls for more room.
set -u
out=${1:-${OUT:?usage: scripts/gpu_check.sh OUT_DIR (or set OUT)}}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.." || exit 2
root=$(pwd)
PY=${PY:-python3}
run_tests=${GPU_CHECK_TESTS:-1}
run_bench=${GPU_CHECK_BENCH:-1}
run_e2e=${GPU_CHECK_E2E:-1}
run_census=${GPU_CHECK_CENSUS:-0}
run_tune=${GPU_CHECK_TUNE:-0}
budget=${GPU_CHECK_BUDGET_S:-570}
e2e_script=benchmarks/e2e_training.py
[ -f "$e2e_script" ] || run_e2e=0
started=$SECONDS
if [ "$run_tests" = 1 ] && [ "$run_bench" = 1 ]; then
  echo "note: the full suite and the benchmarks rarely fit one ${budget}s call; the tests get what the" \
    "later stages' reserves leave. For full runs: GPU_CHECK_BENCH=0 GPU_CHECK_E2E=0 first, then GPU_CHECK_TESTS=0." >&2
fi

remaining() { echo $((budget - (SECONDS - started))); }

# Seconds a stage may take: what is left, minus the reserve of the stages after it.
stage_seconds() {
  local reserve=0
  case "$1" in
    tests) [ "$run_bench" = 1 ] && reserve=$((reserve + 330)); [ "$run_e2e" = 1 ] && reserve=$((reserve + 150))
      [ "$run_tune" = 1 ] && reserve=$((reserve + 120)) ;;
    bench) [ "$run_e2e" = 1 ] && reserve=$((reserve + 150)); [ "$run_tune" = 1 ] && reserve=$((reserve + 120)) ;;
    tune) [ "$run_e2e" = 1 ] && reserve=$((reserve + 150)) ;;
  esac
  [ "$1" != census ] && [ "$run_census" = 1 ] && reserve=$((reserve + 150))
  local s=$(($(remaining) - reserve - 10))
  [ "$s" -lt 30 ] && s=30
  echo "$s"
}

# `timeout -s INT` lets pytest and python finish their reports on the way out.
with_timeout() {
  local seconds=$1
  shift
  if command -v timeout >/dev/null 2>&1; then
    timeout -s INT -k 20 "$seconds" "$@"
  else
    "$@"
  fi
}

# ---------------------------------------------------------------- environment, install
{
  echo "# gpu_check $(date -u '+%Y-%m-%d %H:%M:%S UTC') on $(hostname)"
  echo "# checkout: $root ($(git rev-parse --short HEAD 2>/dev/null || echo 'no git'))"
  uname -a
  echo
  nvidia-smi 2>&1 || echo "nvidia-smi not available"
  echo
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem,power.limit \
    --format=csv 2>&1 || true
  echo
  "$PY" --version 2>&1
  "$PY" -m pip list 2>/dev/null | grep -i -E '^(torch|triton|transformers|accelerate|peft|pytest|hypothesis|matplotlib|numpy|setuptools) ' || true
  "$PY" - <<'EOF' 2>&1
import importlib.metadata as m
import platform

import torch


def dist(name):
    try:
        return m.version(name)
    except m.PackageNotFoundError:
        return "not installed"


print(f"versions: python {platform.python_version()}, torch {torch.__version__} (cuda {torch.version.cuda}), "
      f"triton {dist('triton')}, transformers {dist('transformers')}")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"device 0: {p.name}, {p.total_memory / 2**30:.1f} GiB, {p.multi_processor_count} SMs, cc {p.major}.{p.minor}")
else:
    print("CUDA not available")
EOF
  echo
  echo "# install: pip install --no-deps --no-build-isolation -e . (so transformers sees liger_kernel installed)"
} >"$out/env.txt" 2>&1

if [ "${GPU_CHECK_INSTALL:-1}" != 1 ]; then
  install="not installed (GPU_CHECK_INSTALL=0); using PYTHONPATH=src"
elif "$PY" -m pip install --no-deps --no-build-isolation -e . >>"$out/env.txt" 2>&1; then
  install="editable install"
else
  install="editable install failed; using PYTHONPATH=src only"
fi
# src first either way, so this checkout's code is what runs.
export PYTHONPATH="$root/src:$root${PYTHONPATH:+:$PYTHONPATH}"
{
  echo "# $install"
  "$PY" -c "import liger_kernel, importlib.metadata as m
print('liger_kernel', liger_kernel.__version__, 'from', liger_kernel.__file__)
try:
    print('distribution liger-kernel', m.version('liger-kernel'))
except m.PackageNotFoundError:
    print('distribution liger-kernel not installed (transformers will not see it)')" 2>&1
} >>"$out/env.txt"

# A wheel over one call's transfer limit travels split (`split -n 2 -d X.whl X.whl.part-`, parts
# named X.whl.part-00, X.whl.part-01, ...; the last part also as X.whl.parts-N, an empty file that
# says how many there are) over calls on the same warm machine: parts found in the wheel folder are
# kept in GPU_CHECK_WHEEL_STASH, and a wheel is joined back into the wheel folder once all its parts
# have arrived.
join_wheel_parts() {
  local wheels=$1 stash=${GPU_CHECK_WHEEL_STASH:-/var/tmp/liger_wheel_parts} count whole n
  mkdir -p "$stash"
  cp "$wheels"/*.whl.part-* "$wheels"/*.whl.parts-* "$stash"/ 2>/dev/null || true
  for count in "$stash"/*.whl.parts-*; do
    [ -e "$count" ] || continue
    whole=${count%.parts-*}
    n=${count##*.parts-}
    if [ "$(compgen -G "$whole.part-*" | wc -l)" -eq "$n" ]; then
      cat "$whole".part-* >"$wheels/$(basename "$whole")" && echo "joined $(basename "$whole") from $n parts"
    else
      echo "$(basename "$whole"): $(compgen -G "$whole.part-*" | wc -l) of $n parts so far"
    fi
  done
}

if [ "${GPU_CHECK_PEERS:-0}" = 1 ]; then
  wheels=${GPU_CHECK_WHEELS:-$root/.whl}
  peer_site=${TMPDIR:-/tmp}/liger_peers
  upstream_site=${TMPDIR:-/tmp}/liger_upstream
  {
    echo "# peers: wheels from $wheels"
    ls -la "$wheels" "$wheels/upstream" 2>&1
    join_wheel_parts "$wheels"
    if compgen -G "$wheels/*.whl" >/dev/null; then
      "$PY" -m pip install --no-index --no-deps --upgrade --target "$peer_site" "$wheels"/*.whl 2>&1 | tail -2
      # Only the benchmark stages see the peers (the tests run against this checkout alone).
      bench_path="$PYTHONPATH:$peer_site"
    fi
    if compgen -G "$wheels/upstream/*.whl" >/dev/null; then
      "$PY" -m pip install --no-index --no-deps --upgrade --target "$upstream_site" "$wheels"/upstream/*.whl 2>&1 | tail -2
      export LIGER_UPSTREAM_PATH="$upstream_site"
    fi
  } >>"$out/env.txt" 2>&1
  BENCH_ARGS="--peers all ${BENCH_ARGS:-}"
fi

test_wheels=${GPU_CHECK_WHEELS:-$root/.whl}/tests
if compgen -G "$test_wheels/*.whl" >/dev/null; then
  test_site=${TMPDIR:-/tmp}/liger_test_site
  {
    echo "# test-only wheels from $test_wheels"
    "$PY" -m pip install --no-index --no-deps --upgrade --target "$test_site" "$test_wheels"/*.whl 2>&1 | tail -2
  } >>"$out/env.txt" 2>&1
fi

status=0
tests_rc=skipped bench_rc=skipped e2e_rc=skipped census_rc=skipped tune_rc=skipped

# ---------------------------------------------------------------- tests
if [ "$run_tests" = 1 ]; then
  echo "== tests (full shapes, up to $(stage_seconds tests)s for both stages) ==" >&2
  # The memory-hungry tests run first: the two >2**31-element tests alone, then fused linear CE
  # (float64 references of (1024, 128256) logits and a (128256, 4096) dW) on
  # GPU_CHECK_HEAVY_WORKERS (3) workers; the rest, small, on GPU_CHECK_WORKERS (6) xdist workers
  # sharing the GPU. All share the tests' budget.
  secs=$(stage_seconds tests)
  # shellcheck disable=SC2086  # PYTEST_ARGS is a list of words
  tests_path="$PYTHONPATH${test_site:+:$test_site}"
  PYTHONPATH="$tests_path" LIGER_TEST_SHAPES=full with_timeout $((secs < 300 ? secs : 300)) "$PY" -m pytest tests/ops/test_huge_tensors.py \
    -q -ra -p no:cacheprovider ${PYTEST_ARGS:-} >"$out/tests_serial.log" 2>&1
  huge_rc=$?
  secs=$(stage_seconds tests)
  # shellcheck disable=SC2086
  PYTHONPATH="$tests_path" LIGER_TEST_SHAPES=full with_timeout $((secs < 300 ? secs : 300)) "$PY" -m pytest \
    tests/ops/test_fused_linear_cross_entropy.py -q -ra -p no:cacheprovider -n "${GPU_CHECK_HEAVY_WORKERS:-3}" \
    ${PYTEST_ARGS:-} >>"$out/tests_serial.log" 2>&1
  heavy_rc=$?
  [ "$heavy_rc" = 0 ] || huge_rc=$heavy_rc
  secs=$(stage_seconds tests)  # what the memory-hungry tests left
  # shellcheck disable=SC2086
  PYTHONPATH="$tests_path" LIGER_TEST_SHAPES=full with_timeout "$secs" "$PY" -m pytest tests -q -ra -p no:cacheprovider \
    -n "${GPU_CHECK_WORKERS:-6}" \
    --ignore tests/ops/test_huge_tensors.py --ignore tests/ops/test_fused_linear_cross_entropy.py \
    --junitxml="$out/junit.xml" ${PYTEST_ARGS:-} >"$out/tests.log" 2>&1
  tests_rc=$?
  [ "$huge_rc" = 0 ] || tests_rc=$huge_rc
  [ "$tests_rc" = 0 ] || status=1
fi

# ---------------------------------------------------------------- kernel benchmarks
if [ "$run_bench" = 1 ]; then
  secs=$(stage_seconds bench)
  echo "== benchmarks (up to ${secs}s) ==" >&2
  # shellcheck disable=SC2086
  PYTHONPATH="${bench_path:-$PYTHONPATH}" with_timeout "$secs" "$PY" -m benchmarks --out "$out" --max-seconds $((secs - 60 > 30 ? secs - 60 : 30)) \
    ${BENCH_ARGS:-} >"$out/bench.log" 2>&1
  bench_rc=$?
  [ "$bench_rc" = 0 ] || status=1
fi

# A stage that appends to bench.log: its name on stderr, a section header in the log.
begin_logged_stage() {
  echo "== $1 (up to $2s) ==" >&2
  printf '\n=== %s ===\n' "$3" >>"$out/bench.log"
}

# ---------------------------------------------------------------- launch-parameter sweeps
if [ "$run_tune" = 1 ]; then
  secs=$(stage_seconds tune)
  begin_logged_stage "benchmarks.tune ${TUNE_ONLY:-head_chunks,head_epilogue}" "$secs" \
    "python -m benchmarks.tune --only ${TUNE_ONLY:-head_chunks,head_epilogue}"
  with_timeout "$secs" "$PY" -m benchmarks.tune --only "${TUNE_ONLY:-head_chunks,head_epilogue}" --out "$out" \
    --max-seconds $((secs - 30 > 30 ? secs - 30 : 30)) >>"$out/bench.log" 2>&1
  tune_rc=$?
  [ "$tune_rc" = 0 ] || status=1
fi

# ---------------------------------------------------------------- end-to-end training
if [ "$run_e2e" = 1 ]; then
  secs=$(stage_seconds e2e)
  begin_logged_stage "e2e training" "$secs" "$e2e_script"
  e2e_rc=0
  IFS=';' read -r -a e2e_runs <<<"${E2E_RUNS:-${E2E_ARGS:-}}"
  [ "${#e2e_runs[@]}" -gt 0 ] || e2e_runs=("")
  for e2e_args in "${e2e_runs[@]}"; do
    secs=$(stage_seconds e2e)
    echo "--- e2e_training.py $e2e_args (up to ${secs}s)" >>"$out/bench.log"
    # shellcheck disable=SC2086
    PYTHONPATH="${bench_path:-$PYTHONPATH}" with_timeout "$secs" "$PY" "$e2e_script" --out "$out" $e2e_args >>"$out/bench.log" 2>&1
    rc=$?
    [ "$rc" = 0 ] || e2e_rc=$rc
  done
  [ "$e2e_rc" = 0 ] || status=1
fi

# ---------------------------------------------------------------- model census
if [ "$run_census" = 1 ]; then
  secs=$(stage_seconds census)
  echo "== model census (up to ${secs}s) ==" >&2
  with_timeout "$secs" "$PY" -m tests.transformers.census.test_census --jobs "${GPU_CHECK_CENSUS_JOBS:-4}" \
    --write-docs "$out/models.md" >"$out/census.log" 2>&1
  census_rc=$?
  [ "$census_rc" = 0 ] || status=1
fi

# ---------------------------------------------------------------- summary
echo
echo "================ gpu_check summary ($((SECONDS - started)) s) ================"
grep -m1 -E '^device 0:' "$out/env.txt" || echo "no CUDA device"
grep -m1 -E '^versions: ' "$out/env.txt"
echo "liger_kernel: $install"
echo "tests: exit $tests_rc"
if [ -f "$out/junit.xml" ]; then
  "$PY" - "$out/junit.xml" <<'EOF'
import sys
import xml.etree.ElementTree as ET

root = ET.parse(sys.argv[1]).getroot()
suites = [root] if root.tag == "testsuite" else list(root)
total = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
seconds = sum(float(s.get("time", 0)) for s in suites)
print(f"  {total['tests']} tests, {total['failures']} failed, {total['errors']} errors, "
      f"{total['skipped']} skipped, {seconds:.0f} s")
bad = [c for s in suites for c in s.iter("testcase") if c.find("failure") is not None or c.find("error") is not None]
for c in bad[:15]:
    print(f"  FAILED {c.get('classname')}::{c.get('name')}")
if len(bad) > 15:
    print(f"  ... and {len(bad) - 15} more (tests.log)")
EOF
elif [ "$run_tests" = 1 ]; then
  tail -5 "$out/tests.log"
fi
echo "benchmarks: exit $bench_rc"
if [ "$run_bench" = 1 ]; then
  if grep -q '^=== targets' "$out/bench.log"; then
    grep -E 'TB/s' "$out/bench.log" | tail -1
    sed -n '/^=== targets/,/^targets met:/p' "$out/bench.log"
    grep -E '^  ERROR ' "$out/bench.log" | head -5
  else
    echo "  no targets table (crashed or timed out); last lines of bench.log:"
    tail -15 "$out/bench.log"
  fi
fi
echo "tune: exit $tune_rc"
[ "$run_tune" = 1 ] && [ -f "$out/tune.csv" ] && column -s, -t <"$out/tune.csv" | head -40
echo "e2e: exit $e2e_rc"
if [ "$run_e2e" = 1 ]; then
  if [ -n "${E2E_RUNS:-}" ]; then
    # Several runs: each run's header, per-variant figures and loss verdicts.
    awk -v mark="=== $e2e_script ===" 'seen || $0 == mark { seen = 1; print }' "$out/bench.log" |
      grep -E '^--- e2e|tokens/s,|floor .* ms =|match|ERROR|Traceback|Error' | tail -80
  else
    awk -v mark="=== $e2e_script ===" 'seen || $0 == mark { seen = 1; print }' "$out/bench.log" | tail -15
  fi
fi
echo "census: exit $census_rc"
if [ "$run_census" = 1 ]; then
  sed -n '/^== /,$p' "$out/census.log" | head -40
  grep -E ': MISMATCH ' "$out/census.log" | head -10
fi
n_files=$(find "$out" -type f | wc -l)
echo "files in $out ($n_files): $(find "$out" -type f -printf '%P ')"
[ "$n_files" -le 8 ] || echo "WARNING: more than 8 files; the device tool returns at most 8"
exit $status
