"""CPU smoke test of ``benchmarks/e2e_training.py`` plus checks of its longest-sequence search.

The script runs as a subprocess with ``--config tiny`` (on CPU through the Triton
interpreter): both variants train, the CSV has one row per variant with every step's loss,
the losses agree, and the PNG is written. The search for the longest sequence that fits is
exercised in-process with a training step that raises CUDA's out-of-memory error above a
chosen length, which is the only way to reach its OOM branches without a GPU.
"""

import csv
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import e2e_training

REPO = Path(__file__).resolve().parents[2]


def test_e2e_tiny_runs_and_losses_match(tmp_path):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "e2e_training.py"), "--config", "tiny", "--steps", "2",
         "--warmup", "1", "--batch", "2", "--seq", "24", "--skip-max-seq", "--out", str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "match" in proc.stdout and "MISMATCH" not in proc.stdout
    assert (tmp_path / "e2e.png").stat().st_size > 0

    with open(tmp_path / "e2e.csv") as handle:
        rows = {r["variant"]: r for r in csv.DictReader(handle)}
    assert set(rows) == {"hf", "liger"}
    losses = {v: [float(r[f"loss_{i}"]) for i in range(3)] for v, r in rows.items()}
    for row in rows.values():
        assert float(row["tokens_per_s"]) > 0
        assert row["config"] == "tiny" and row["batch"] == "2" and row["seq"] == "24"
        for key in ("gpu", "torch", "triton", "transformers", "liger_kernel", "date"):
            assert row[key], key
    # Same weights and data: the first step's loss is the initial model's loss on batch 0,
    # close to ln(vocab) for a small random init.
    assert abs(losses["hf"][0] - math.log(e2e_training.CONFIGS["tiny"]["vocab_size"])) < 0.5
    tolerance = e2e_training.LOSS_RTOL * max(losses["hf"])
    assert max(abs(a - b) for a, b in zip(losses["hf"], losses["liger"])) <= tolerance


def test_token_batches_are_fixed_by_the_seed():
    a = e2e_training.token_batches(3, 2, 8, 50, seed=1, device=torch.device("cpu"))
    b = e2e_training.token_batches(3, 2, 8, 50, seed=1, device=torch.device("cpu"))
    c = e2e_training.token_batches(3, 2, 8, 50, seed=2, device=torch.device("cpu"))
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[0], c[0]) and not torch.equal(a[0], a[1])
    assert all(x.shape == (2, 8) and int(x.max()) < 50 for x in a)


class _OptimizerStub:
    def zero_grad(self, set_to_none=True):
        pass


@pytest.mark.parametrize(
    "limit, expected",
    [
        (13000, (12288, 16384)),  # 4096, 8192 fit; 16384 fails; the bisection 12288 fits
        (12000, (8192, 12288)),  # ... and the bisection step fails
        (3000, (2048, 3072)),  # the first candidate fails; bisection between 2048 and 4096
        (10**9, (32768, None)),  # everything fits up to the cap
    ],
)
def test_max_seq_search(monkeypatch, limit, expected):
    tried = []

    def fake_step(model, optimizer, input_ids):
        tried.append(input_ids.shape[1])
        if input_ids.shape[1] > limit:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate ...")

    monkeypatch.setattr(e2e_training, "train_step", fake_step)
    monkeypatch.setattr(e2e_training.torch, "randint", lambda low, high, size, device=None: torch.empty(size))
    fits, fails, notes = e2e_training.find_max_seq(None, _OptimizerStub(), batch=4, start_seq=2048, vocab=10,
                                                   device=torch.device("cpu"), budget_s=60.0)
    assert (fits, fails) == expected
    assert tried == sorted(set(tried), key=tried.index)  # no length tried twice
    if fails is None:
        assert any("cap" in n for n in notes)


def test_max_seq_search_budget_and_other_errors(monkeypatch):
    monkeypatch.setattr(e2e_training.torch, "randint", lambda low, high, size, device=None: torch.empty(size))
    monkeypatch.setattr(e2e_training, "train_step", lambda *a: None)
    fits, fails, notes = e2e_training.find_max_seq(None, _OptimizerStub(), 4, 2048, 10, torch.device("cpu"),
                                                   budget_s=0.0)
    assert (fits, fails) == (2048, None) and "time budget" in notes[0]

    def broken_step(*a):
        raise RuntimeError("an unrelated failure")

    monkeypatch.setattr(e2e_training, "train_step", broken_step)
    with pytest.raises(RuntimeError, match="unrelated"):
        e2e_training.find_max_seq(None, _OptimizerStub(), 4, 2048, 10, torch.device("cpu"), budget_s=60.0)


def test_out_of_memory_detection():
    assert e2e_training.is_out_of_memory(torch.cuda.OutOfMemoryError("CUDA out of memory"))
    assert e2e_training.is_out_of_memory(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling ..."))
    assert not e2e_training.is_out_of_memory(RuntimeError("shape mismatch"))
    assert not e2e_training.is_out_of_memory(ValueError("out of memory"))
