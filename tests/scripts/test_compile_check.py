"""scripts/compile_check.py: the launches the CPU tests make, compiled for sm_90a without a GPU.

Positive case: our gated-activation kernels, recorded from a slice of their tests, compile (the
interpreter's ``ROUND_BY_HAND=True`` launches also with ``False``). Negative case: a kernel the
interpreter runs happily but Triton refuses to compile (it calls a helper that lacks
``@triton.jit``, which the interpreter simply calls as Python): the check must fail and name it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "compile_check.py"

BAD_KERNELS = '''
import triton
import triton.language as tl


def twice(x):  # a helper that lacks @triton.jit: the interpreter calls it as Python
    return x * 2


@triton.jit
def twice_kernel(x_ptr, y_ptr, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    tl.store(y_ptr + cols, twice(tl.load(x_ptr + cols)))
'''

BAD_TEST = '''
import torch

from compile_probe_kernels import twice_kernel


def test_twice_runs_under_the_interpreter():
    x = torch.randn(8)
    y = torch.empty(8)
    twice_kernel[(1,)](x, y, BLOCK=8)
    torch.testing.assert_close(y, 2 * x)
'''


# The check stands in for a GPU: where one is present, the suite runs the compiled kernels themselves
# (and recording under the interpreter would meet CUDA tensors).
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU-only check: the GPU suite compiles and runs "
                                "the kernels")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    env.update(extra)
    return env


def _skip_without_ptxas(proc: subprocess.CompletedProcess) -> None:
    if "ptxas" in proc.stdout + proc.stderr and "No such file" in proc.stdout + proc.stderr:
        pytest.skip("this Triton build ships no ptxas")


def test_our_gated_activation_launches_compile(tmp_path):
    launches = tmp_path / "launches.jsonl"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--launches", str(launches), "--jobs", "2",
                           "tests/ops/test_swiglu.py", "-k", "test_matches_float64"],
                          cwd=ROOT, capture_output=True, text=True, env=_env(), timeout=900)
    _skip_without_ptxas(proc)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    recorded = [json.loads(line) for line in launches.read_text().splitlines()]
    assert recorded and {r["kernel"] for r in recorded} >= {"gated_activation_forward_kernel"}
    assert all(r["module"] == "liger_kernel.ops.swiglu" for r in recorded)
    assert any(r["constexprs"].get("ROUND_BY_HAND") for r in recorded)
    assert "FAILED" not in proc.stdout and "compiled" in proc.stdout


def test_a_kernel_only_the_interpreter_accepts_fails_the_check(tmp_path):
    (tmp_path / "compile_probe_kernels.py").write_text(BAD_KERNELS)
    test_file = tmp_path / "test_probe.py"
    test_file.write_text(textwrap.dedent(BAD_TEST))
    env = _env(PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT / "src")]),
               LIGER_COMPILE_CHECK_MODULES="compile_probe_kernels")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--jobs", "1", str(test_file), "--rootdir", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    _skip_without_ptxas(proc)
    assert "1 passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]  # the interpreter ran it
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "FAILED compile_probe_kernels.twice_kernel {'BLOCK': 8}" in proc.stdout, proc.stdout[-3000:]


def test_compile_refuses_under_the_interpreter(tmp_path):
    launches = tmp_path / "none.jsonl"
    launches.write_text("")
    proc = subprocess.run([sys.executable, str(SCRIPT), "compile", str(launches)], cwd=ROOT, capture_output=True,
                          text=True, env=dict(os.environ, TRITON_INTERPRET="1"), timeout=120)
    assert proc.returncode == 2 and "TRITON_INTERPRET" in proc.stderr
