"""CPU smoke tests of ``benchmarks/e2e_training.py`` plus checks of its searches, presets and step floor.

The script runs as a subprocess on tiny presets (on CPU through the Triton interpreter):
the variants train, the CSV has one row per variant with every step's loss, the losses
agree, and the PNG is written. The searches for the longest sequence / largest batch that
fits are exercised in-process with a training step that raises CUDA's out-of-memory error
above a chosen size, which is the only way to reach their OOM branches without a GPU. The
full presets are built on the meta device and checked against the public models' shapes.
"""

import csv
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import e2e_training, step_floor

REPO = Path(__file__).resolve().parents[2]


def _run_script(tmp_path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "e2e_training.py"), *args, "--out", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _rows(path) -> dict[str, dict[str, str]]:
    with open(path) as handle:
        return {r["variant"]: r for r in csv.DictReader(handle)}


def test_e2e_tiny_runs_and_losses_match(tmp_path):
    proc = _run_script(tmp_path, "--config", "tiny", "--steps", "2", "--warmup", "1", "--batch", "2", "--seq", "24",
                       "--skip-max-seq")
    assert "match" in proc.stdout and "MISMATCH" not in proc.stdout
    assert (tmp_path / "e2e_tiny.png").stat().st_size > 0

    rows = _rows(tmp_path / "e2e_tiny.csv")
    assert set(rows) == {"hf", "liger"}
    losses = {v: [float(r[f"loss_{i}"]) for i in range(3)] for v, r in rows.items()}
    for row in rows.values():
        assert float(row["tokens_per_s"]) > 0
        assert row["config"] == "tiny" and row["batch"] == "2" and row["seq"] == "24"
        for key in ("gpu", "torch", "triton", "transformers", "liger_kernel", "date"):
            assert row[key], key
    # Same weights and data: the first step's loss is the initial model's loss on batch 0,
    # close to ln(vocab) for a small random init.
    assert abs(losses["hf"][0] - math.log(e2e_training.PRESETS["tiny"]["config"]["vocab_size"])) < 0.5
    tolerance = e2e_training.LOSS_RTOL * max(losses["hf"])
    assert max(abs(a - b) for a, b in zip(losses["hf"], losses["liger"])) <= tolerance


@pytest.mark.parametrize("objective", ["dpo", "grpo"])
def test_e2e_tiny_preference_and_rl_objectives_match(tmp_path, objective):
    """The DPO and GRPO steps: HF's materialised loss and liger's chunked one train the same curve."""
    proc = _run_script(tmp_path, "--config", "tiny", "--objective", objective, "--steps", "2", "--warmup", "1",
                       "--batch", "2", "--seq", "24", "--skip-max-seq")
    assert "match" in proc.stdout and "MISMATCH" not in proc.stdout, proc.stdout[-2000:]
    rows = _rows(tmp_path / f"e2e_tiny_{objective}.csv")
    assert set(rows) == {"hf", "liger"}
    losses = [float(rows["hf"][f"loss_{i}"]) for i in range(3)]
    assert all(math.isfinite(x) for x in losses) and abs(losses[0]) > 0.1


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


def _oom_above(monkeypatch, dim: int, limit: int) -> list[int]:
    """Training steps that run out of memory when ``input_ids.shape[dim] > limit``; returns the sizes tried."""
    tried = []

    def fake_step(model, optimizer, input_ids, objective=None):
        tried.append(input_ids.shape[dim])
        if input_ids.shape[dim] > limit:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate ...")

    monkeypatch.setattr(e2e_training, "train_step", fake_step)
    monkeypatch.setattr(e2e_training.torch, "randint", lambda low, high, size, device=None: torch.empty(size))
    return tried


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
    tried = _oom_above(monkeypatch, 1, limit)
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


def test_qwen3_preset_compile_variants_and_step_floor(tmp_path):
    """hf, hf-compile and liger-compile of the tiny Qwen3 preset (q/k norms), one profiled step each."""
    proc = _run_script(tmp_path, "--model", "tiny-qwen3-0.6b", "--variants", "hf,hf-compile,liger-compile",
                       "--compile-backend", "aot_eager", "--steps", "1", "--warmup", "1", "--seq", "16",
                       "--skip-max-seq", "--floor", "on")
    assert "MISMATCH" not in proc.stdout and proc.stdout.count("floor / step") == 3
    # On CPU the floor classifies profiled CPU ops, and the script says that it means nothing
    # for a GPU; on CUDA it classifies the kernels, and says nothing of the kind.
    assert ("CPU op times" in proc.stdout) == (not torch.cuda.is_available())
    rows = _rows(tmp_path / "e2e_tiny-qwen3-0.6b.csv")
    assert list(rows) == ["hf", "hf-compile", "liger-compile"]
    assert rows["hf"]["patched_modules"] == rows["hf-compile"]["patched_modules"] == "0"
    # 2 layers x (input, post-attention, q, k norms) + the final norm
    assert "Qwen3RMSNorm x9" in rows["liger-compile"]["patched"]
    for row in rows.values():
        floor, step = float(row["floor_ms"]), float(row["median_step_ms"])
        parts = [float(row[k]) for k in ("gemm_ms", "head_gemm_ms", "attention_ms", "head_floor_ms")]
        # The CSV rounds the floor and its four parts to 3 decimals (half a unit each: 2.5e-3 in
        # all), the step to 2 and the ratio to 5 significant digits.
        assert floor == pytest.approx(parts[0] - parts[1] + parts[2] + parts[3], abs=2.5e-3 + 1e-9)
        assert parts[0] > 0 and parts[1] > 0 and parts[2] > 0 and parts[3] > 0
        assert float(row["floor_over_step"]) == pytest.approx(floor / step, rel=1e-4 + 5e-4 / floor + 5e-3 / step)


def test_max_batch_mode_with_grad_checkpointing(tmp_path):
    _run_script(tmp_path, "--model", "tiny-gemma3-1b", "--variants", "hf", "--max-batch", "--max-batch-limit", "4",
                "--grad-ckpt", "both", "--steps", "1", "--warmup", "1", "--seq", "16", "--skip-max-seq")
    rows = _rows(tmp_path / "e2e_tiny-gemma3-1b_max-batch.csv")
    assert list(rows) == ["hf", "hf+ckpt"]
    for row in rows.values():
        assert row["batch"] == "4" and row["max_batch_mode"] == "True"  # everything fits up to the limit
        assert "search cap" in row["notes"]
    assert rows["hf+ckpt"]["grad_ckpt"] == "True" and rows["hf"]["grad_ckpt"] == "False"


# Public model shapes: (model type, hidden, layers, vocab, parameters in billions).
FULL_PRESETS = {
    "llama-1b": ("llama", 2048, 16, 128256, 1.236),
    "llama3-8b-4l": ("llama", 4096, 4, 128256, 1.923),
    "qwen3-0.6b": ("qwen3", 1024, 28, 151936, 0.596),
    "gemma3-1b": ("gemma3_text", 1152, 26, 262144, 1.000),
    "qwen3-moe": ("qwen3_moe", 2048, 8, 151936, 3.190),
    "qwen2.5-vl-3b": ("qwen2_5_vl", 2048, 36, 151936, 3.088),
}


@pytest.mark.parametrize("name", sorted(FULL_PRESETS))
def test_full_presets_have_the_public_shapes(name):
    import transformers

    model_type, hidden, layers, vocab, billions = FULL_PRESETS[name]
    config = e2e_training.build_config(name)
    text = e2e_training.text_config(config)
    assert (config.model_type, text.hidden_size, text.num_hidden_layers, text.vocab_size) == (
        model_type, hidden, layers, vocab)
    with torch.device("meta"):
        model = getattr(transformers, e2e_training.MODEL_CLASSES[model_type])(config)
    assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(billions, abs=0.002)
    tiny = e2e_training.build_config(f"tiny-{name}")
    assert e2e_training.text_config(tiny).hidden_size == e2e_training.TINY_DIMS["hidden_size"]
    assert e2e_training.text_config(tiny).num_hidden_layers == 2


def test_vlm_data_stays_below_the_multimodal_ids():
    config = e2e_training.build_config("qwen2.5-vl-3b")
    assert e2e_training.data_vocab(config) == config.vision_start_token_id < config.image_token_id
    assert e2e_training.data_vocab(e2e_training.build_config("qwen3-0.6b")) == 151936


def test_seq_candidates_past_32768():
    assert e2e_training.seq_candidates(32768) == e2e_training.MAX_SEQ_CANDIDATES
    assert e2e_training.seq_candidates(131072)[-3:] == (32768, 65536, 131072)
    assert e2e_training.seq_candidates(8192) == (4096, 8192)


@pytest.mark.parametrize("limit, expected", [(37, (36, 40)), (1, (1, 2)), (600, (512, None)), (0, (0, 1))])
def test_max_batch_search(monkeypatch, limit, expected):
    tried = _oom_above(monkeypatch, 0, limit)
    fits, fails, notes = e2e_training.find_max_batch(None, _OptimizerStub(), seq=128, vocab=10,
                                                     device=torch.device("cpu"), budget_s=60.0)
    assert (fits, fails) == expected
    assert len(tried) == len(set(tried))


def test_compare_losses():
    def result(name, losses):
        return e2e_training.VariantResult(name, 1.0, math.nan, 1.0, losses)

    ok, lines = e2e_training.compare_losses([result("hf", [5.0, 4.0]), result("liger", [5.0, 4.01]),
                                             result("liger-upstream", [])])
    assert ok and any("not run" in line for line in lines)
    ok, _ = e2e_training.compare_losses([result("hf", [5.0, 4.0]), result("liger", [5.0, 4.1])])
    assert not ok
    ok, _ = e2e_training.compare_losses([result("hf", [5.0, 4.0]), result("liger", [5.0, math.nan])])
    assert not ok


def test_step_floor_classification_and_sum():
    records = [
        step_floor.KernelRecord("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128", 300.0, False),
        step_floor.KernelRecord("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTT", 200.0, True),  # LM head
        step_floor.KernelRecord("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64>>", 150.0, False),
        step_floor.KernelRecord("fmha_cutlassB_bf16_aligned_64x64_k64_sm80", 50.0, False),  # not a GEMM
        step_floor.KernelRecord("_rms_norm_forward_kernel", 80.0, False),
        step_floor.KernelRecord("void at::native::vectorized_elementwise_kernel", 20.0, True),
    ]
    f = step_floor.summarize(records, head_floor_ms=0.15)
    assert (f.gemm_ms, f.head_gemm_ms, f.attention_ms) == pytest.approx((0.5, 0.2, 0.2))
    assert f.kernel_ms == pytest.approx(0.8)
    assert f.floor_ms == pytest.approx(0.5 - 0.2 + 0.2 + 0.15)
    assert step_floor.kind_of("triton_poi_fused__scaled_dot_product_flash_attention_transpose_0") == "other"
    assert step_floor.kind_of("triton_tem_fused_mm_0") == "gemm"
    assert step_floor.kind_of("void cublasLt::splitKreduce_kernel<32, 16, int, float>") == "gemm"
    assert step_floor.kind_of("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3") == "attention"
    assert step_floor.kind_of("aten::mm", cpu=True) == "gemm"
    assert step_floor.kind_of("aten::linear", cpu=True) == "other"


def test_step_floor_profile_on_cpu_marks_the_head():
    vocab, hidden = 97, 24
    x = torch.randn(10, hidden, requires_grad=True)
    head = torch.randn(vocab, hidden, requires_grad=True)
    body = torch.randn(hidden, hidden, requires_grad=True)

    def step():
        logits = (x @ body) @ head.t()
        logits.logsumexp(-1).sum().backward()

    rate = step_floor.head_gemm_rate(10, hidden, vocab, torch.float32, torch.device("cpu"))
    f = step_floor.profile_step(step, torch.device("cpu"), vocab, head_floor_ms=6 * 10 * hidden * vocab / rate * 1e3)
    assert rate > 0 and f.head_floor_ms > 0
    assert 0 < f.head_gemm_ms < f.gemm_ms  # the body's matmuls are GEMMs but not the head's
