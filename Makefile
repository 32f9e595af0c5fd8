# The two commands: `make demo` (the main job) and `make test` (the CPU/GPU test suite).
PY ?= python3
PYTEST_WORKERS ?= 2

.PHONY: setup test test-pythons demo lint bench gpu-check hub-kernel compile-check

# The trl extra's range (pyproject.toml): later TRL versions no longer call the chunked losses.
TRL_IN_RANGE = from importlib.metadata import version; from packaging.version import Version as V; \
	assert V('1.0') <= V(version('trl')) < V('1.13')

# Idempotent install: CPU torch 2.13.0 only when no torch is importable (a GPU machine keeps its own).
setup:
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "torch==2.13.0"
	@$(PY) -c "import liger_kernel, transformers, pytest, xdist, hypothesis, matplotlib, kernels, requests, mypy; $(TRL_IN_RANGE)" \
		2>/dev/null || $(PY) -m pip install -q -e ".[dev,transformers,trl]"

test: setup
	OMP_NUM_THREADS=1 $(PY) -m pytest tests -q -n $(PYTEST_WORKERS) --timeout 900

# The ownership and patching tests on every Python of requires-python (3.10 to 3.13), one
# virtual environment each under .venvs/ (pyenv's interpreters; torch==2.13.0 in each):
# `make test-pythons`, or `make test-pythons PYTHONS="3.12 3.13"`.
PYTHONS ?= 3.10 3.11 3.12 3.13
test-pythons:
	bash scripts/test_pythons.sh $(PYTHONS)

# Every kernel launch the ops' CPU tests make, compiled for sm_90a (PTX, then ptxas) without a GPU.
compile-check: setup
	OMP_NUM_THREADS=1 $(PY) scripts/compile_check.py $(or $(ARGS),tests/ops)

demo: setup
	$(PY) scripts/demo.py $(ARGS)

lint: setup
	$(PY) -m ruff check src tests benchmarks examples scripts
	$(PY) -m mypy

bench: setup
	$(PY) -m benchmarks $(ARGS)

# On a GPU machine: the full suite plus every benchmark, logs and CSVs into OUT_DIR.
gpu-check:
	bash scripts/gpu_check.sh $(OUT_DIR)

# The Hub-kernel repository of the layers (kernels 0.19 layout) into OUT_DIR (default build/hub-kernel).
hub-kernel:
	$(PY) scripts/build_hub_kernel.py $(or $(OUT_DIR),build/hub-kernel) $(ARGS)
