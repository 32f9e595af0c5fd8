"""Smoke test of ``examples/post_training/dpo_tiny.py``: a few DPO steps on a tiny model on CPU
(through Triton's interpreter), its first step checked against materialised float64 logits."""

import re

from tests.examples.test_examples import run_script


def test_dpo_tiny_learns_the_preference(tmp_path):
    proc = run_script("examples/post_training/dpo_tiny.py", "--steps", "4", "--check", "--device", "cpu",
                      cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"^check: .*: OK$", proc.stdout, re.M), proc.stdout
    first, last = map(float, re.search(r"loss ([0-9.]+) -> ([0-9.]+)", proc.stdout).groups())
    assert abs(first - 0.6931) < 1e-3  # policy = reference at the start: log 2
    assert last < first - 0.1
