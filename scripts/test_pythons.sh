#!/usr/bin/env bash
# The ownership and patching tests on every Python the package declares (requires-python),
# each in its own virtual environment under VENVS (created once, reused after).
#
# Usage: scripts/test_pythons.sh [VERSION ...]        (default: 3.10 3.11 3.12 3.13)
# Environment:
#   VENVS        where the environments live (default: .venvs, ignored by git)
#   PYENV_ROOT   where pyenv keeps its interpreters (default: ~/.pyenv); an interpreter is
#                looked up there first (versions/<VERSION>.*), then as python<VERSION> on PATH
#   TORCH_SPEC   the torch requirement installed in each environment (default: torch==2.13.0;
#                pip takes a CPU build where one lies in its find-links for that Python, the
#                PyPI build otherwise)
#   SETUP_ONLY=1 create and fill the environments, run no tests
#   PYTEST_ARGS  extra pytest arguments
# Prints one line per version (passed / failed / no interpreter) and exits non-zero when any
# version failed or had no interpreter.
set -u

cd "$(dirname "$0")/.."
VENVS=${VENVS:-.venvs}
PYENV_ROOT=${PYENV_ROOT:-$HOME/.pyenv}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
VERSIONS=("$@")
[ ${#VERSIONS[@]} -eq 0 ] && VERSIONS=(3.10 3.11 3.12 3.13)

# The tests of in-place writes (who owns a buffer), of the norm-output recompute and of patching.
TESTS=(
    tests/ops/test_grad_ownership.py
    tests/ops/test_cross_entropy.py
    tests/ops/test_swiglu.py
    tests/transformers/test_patched_in_place.py
    tests/transformers/test_recompute.py
    tests/transformers/test_rms_norm.py
    tests/transformers/test_swiglu.py
    tests/transformers/test_monkey_patch.py
    tests/transformers/test_discovery.py
)

interpreter() {
    local version=$1 found
    found=$(ls -d "$PYENV_ROOT"/versions/"$version".* 2>/dev/null | sort -V | tail -n 1)
    if [ -n "$found" ] && [ -x "$found/bin/python" ]; then
        echo "$found/bin/python"
    elif command -v "python$version" >/dev/null; then
        command -v "python$version"
    fi
}

setup_env() {
    local python=$1 env=$2
    if [ ! -x "$env/bin/python" ]; then
        "$python" -m venv "$env" || return 1
    fi
    "$env/bin/python" -c "import torch" 2>/dev/null \
        || "$env/bin/python" -m pip install -q "$TORCH_SPEC" || return 1
    "$env/bin/python" -c "import liger_kernel, transformers, pytest, xdist, hypothesis, peft" 2>/dev/null \
        || "$env/bin/python" -m pip install -q -e ".[dev,transformers]" || return 1
}

declare -A RESULT
status=0
for version in "${VERSIONS[@]}"; do
    python=$(interpreter "$version")
    if [ -z "$python" ]; then
        RESULT[$version]="no interpreter"
        status=1
        continue
    fi
    env="$VENVS/py$version"
    echo "== Python $version: $("$python" --version 2>&1) -> $env"
    if ! setup_env "$python" "$env"; then
        RESULT[$version]="setup failed"
        status=1
        continue
    fi
    torch_version=$("$env/bin/python" -c "import torch; print(torch.__version__)")
    if [ "${SETUP_ONLY:-0}" = 1 ]; then
        RESULT[$version]="ready (torch $torch_version)"
        continue
    fi
    # PYTHONPATH: this checkout's src, whatever the environment's editable install points at.
    if PYTHONPATH="$PWD/src" OMP_NUM_THREADS=1 "$env/bin/python" -m pytest "${TESTS[@]}" -q -n 0 \
            --timeout 900 -p no:cacheprovider ${PYTEST_ARGS:-}; then
        RESULT[$version]="passed (torch $torch_version)"
    else
        RESULT[$version]="failed (torch $torch_version)"
        status=1
    fi
done

echo "== Summary"
for version in "${VERSIONS[@]}"; do
    echo "Python $version: ${RESULT[$version]}"
done
exit $status
