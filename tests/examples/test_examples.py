"""Smoke tests of the examples and of the main job (``scripts/demo.py``) at tiny settings.

Each script runs as a subprocess, as a user would run it (on CPU through the Triton
interpreter: ``tests/conftest.py`` sets ``TRITON_INTERPRET=1`` and the child inherits it),
and the test checks its exit status, what it reports and the files it writes. The Lightning
decoder and the Medusa loss are also checked in-process against plain-PyTorch references.
"""

import copy
import csv
import importlib.util
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.utils import DEVICE, rel_error

REPO = Path(__file__).resolve().parents[2]
SCRIPT_TIMEOUT_S = 600


def run_script(relative_path: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1", TQDM_DISABLE="1")
    proc = subprocess.run([sys.executable, str(REPO / relative_path), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=SCRIPT_TIMEOUT_S)
    if proc.returncode != 0:
        print(proc.stdout[-5000:])
        print(proc.stderr[-5000:], file=sys.stderr)
    return proc


def load_module(relative_path: str, name: str):
    path = REPO / relative_path
    sys.path.insert(0, str(path.parent))  # examples import their siblings by plain name
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
    return module


def small_text_file(tmp_path: Path) -> Path:
    # Real text (this repository's sources) of a known, small size.
    data = b"".join(p.read_bytes() for p in sorted((REPO / "examples").rglob("*.py")))
    path = tmp_path / "corpus.txt"
    path.write_bytes(data[:40_000])
    return path


# ----------------------------------------------------------------------------------------
# The main job
# ----------------------------------------------------------------------------------------
def test_demo_tiny(tmp_path):
    out = tmp_path / "out"
    proc = run_script("scripts/demo.py", "--model-size", "tiny", "--steps", "3", "--seq-len", "32",
                      "--batch-size", "2", "--max-data-mb", "0.25", "--control", "--out", str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "liger vs plain: AGREE (exactness ok, gradients ok" in proc.stdout
    assert re.search(r"exactness, first 3 steps: .*: ok", proc.stdout)
    for group in ("loss", "attention", "embedding", "mlp", "norms"):
        assert re.search(rf"^  {group} +HF .* liger .* allowed .*: ok$", proc.stdout, re.M), group
    assert re.search(r"drift, all 3 steps \(context, not a criterion\)", proc.stdout)
    assert "peak memory is" in proc.stdout
    for name in ("demo.png", "demo_losses.csv", "demo_summary.csv"):
        assert (out / name).stat().st_size > 0, name

    with open(out / "demo_losses.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert [int(r["step"]) for r in rows] == [1, 2, 3]
    for r in rows:
        plain, liger, control = float(r["loss_plain"]), float(r["loss_liger"]), float(r["loss_control"])
        assert math.isfinite(plain) and math.isfinite(liger) and math.isfinite(control)
        # fp32 on CPU (GPU: bf16 mixed precision); the script's own verdict over the first
        # steps is this LOSS_RTOL check, repeated here.
        assert abs(plain - liger) <= (1e-4 if DEVICE == "cpu" else 2**-8) * abs(plain)
        assert float(r["abs_diff"]) == pytest.approx(abs(plain - liger), rel=1e-3, abs=1e-6)
    with open(out / "demo_summary.csv") as handle:
        summary = {r["run"]: r for r in csv.DictReader(handle)}
    assert set(summary) == {"plain", "liger", "control"}
    for r in summary.values():
        assert float(r["tokens_per_s"]) > 0 and float(r["peak_gib"]) > 0


def tiny_llama_and_batch(demo, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**demo.MODEL_SIZES["tiny"], vocab_size=demo.VOCAB_SIZE, max_position_embeddings=64,
                         tie_word_embeddings=True, attn_implementation="sdpa", use_cache=False,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    with torch.device(DEVICE):
        model = LlamaForCausalLM(config)
    # Weights away from their initial values (norm weights of 1 hide a wrong weight term).
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1 * p.std().nan_to_num(1.0).clamp_min(0.1))
    input_ids = torch.randint(0, demo.VOCAB_SIZE, (2, 32), device=DEVICE)
    return model, input_ids


def test_demo_gradient_check_passes_the_library_and_leaves_the_model_alone():
    demo = load_module("scripts/demo.py", "liger_demo_under_test")
    model, input_ids = tiny_llama_and_batch(demo)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    check = demo.gradient_check(model, input_ids, "fp32")
    assert set(check.errors) == {"loss", "attention", "embedding", "mlp", "norms"}
    assert check.ok, check.errors
    for hf_error, liger_error in check.errors.values():
        assert 0 <= hf_error < 1e-5 and 0 <= liger_error < 1e-5
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert all(p.grad is None for p in model.parameters())
    assert not demo.count_liger_patched_modules(model)


@pytest.mark.parametrize("group, factor", [("norms", 1 + 1e-3), ("mlp", 1 + 1e-4), ("embedding", 1 - 1e-4)])
def test_demo_gradient_check_catches_a_slightly_wrong_gradient(monkeypatch, group, factor):
    """The check the demo's verdict rests on past the first steps finds a gradient off by 1e-4."""
    import liger_kernel.transformers as liger_transformers

    demo = load_module("scripts/demo.py", "liger_demo_under_test")
    patch = liger_transformers._apply_liger_kernel_to_instance

    def patch_with_a_wrong_gradient(model, **options):
        patch(model=model, **options)
        for name, p in model.named_parameters():
            if demo.parameter_group(name) == group:
                p.register_hook(lambda g: g * factor)

    monkeypatch.setattr(liger_transformers, "_apply_liger_kernel_to_instance", patch_with_a_wrong_gradient)
    model, input_ids = tiny_llama_and_batch(demo, seed=1)
    check = demo.gradient_check(model, input_ids, "fp32")
    assert not check.ok
    failed = {k for k, (_, liger_error) in check.errors.items() if liger_error > check.allowed[k]}
    assert failed == {group}, check.errors


def test_demo_data_from_a_file(tmp_path):
    demo = load_module("scripts/demo.py", "liger_demo_under_test")
    text = small_text_file(tmp_path)
    files = demo.text_files(str(text))
    tokens = demo.byte_tokens(files, max_bytes=10_000)
    assert tokens.numel() == 10_000 + 1  # the bytes read plus one file separator
    assert int(tokens.max()) < demo.VOCAB_SIZE
    assert bytes(tokens[:-1].to(torch.uint8).tolist()) == text.read_bytes()[:10_000]
    blocks = demo.TokenBlocks(tokens, seq_len=64)
    assert len(blocks) == tokens.numel() // 64
    item = blocks[3]
    assert torch.equal(item["input_ids"], tokens[3 * 64: 4 * 64]) and torch.equal(item["labels"], item["input_ids"])
    # The default corpus: standard-library sources, in a fixed order.
    stdlib = demo.stdlib_source_files()
    assert len(stdlib) > 100 and stdlib == demo.stdlib_source_files()
    assert not any("site-packages" in p for p in stdlib)
    with pytest.raises(ValueError, match="--data-path"):
        demo.text_files(str(tmp_path / "missing"))


@pytest.mark.parametrize("total_gib, expected", [(80, "large"), (141, "large"), (56, "large"), (40, "base"),
                                                  (24, "base")])
def test_demo_gpu_default_model_fits_the_gpu(monkeypatch, total_gib, expected):
    """On a GPU the demo picks the large model (its control run peaks at ~44 GiB) only where it fits."""
    from types import SimpleNamespace

    demo = load_module("scripts/demo.py", "liger_demo_under_test")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: SimpleNamespace(total_memory=total_gib * 2**30))
    assert demo.gpu_default_model_size() == expected


@pytest.mark.parametrize("size", ["large", "xl"])
def test_demo_model_sizes_are_valid_llama_configs(size):
    demo = load_module("scripts/demo.py", "liger_demo_under_test")
    spec = demo.MODEL_SIZES[size]
    assert spec["hidden_size"] % spec["num_attention_heads"] == 0
    assert spec["num_attention_heads"] % spec["num_key_value_heads"] == 0


# ----------------------------------------------------------------------------------------
# examples/huggingface
# ----------------------------------------------------------------------------------------
def test_huggingface_example(tmp_path):
    args = ["--model_config", "tiny", "--max_steps", "3", "--seq_len", "32", "--per_device_train_batch_size", "2",
            "--data_file", str(small_text_file(tmp_path)), "--output_dir", str(tmp_path / "hf_out"),
            "--disable_tqdm", "True"]
    if DEVICE == "cpu":
        args += ["--use_cpu", "True"]
    proc = run_script("examples/huggingface/train.py", *args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "use_liger_kernel=True" in proc.stdout
    line = next(x for x in proc.stdout.splitlines() if x.startswith("train_loss"))
    loss = float(line.split()[1])
    assert math.isfinite(loss) and 0 < loss < 10
    patched = int(line.split(";")[1].split()[0])
    assert patched > 0, line  # the Trainer did patch the model


# ----------------------------------------------------------------------------------------
# examples/lightning
# ----------------------------------------------------------------------------------------
def _lightning_installed() -> bool:
    return any(importlib.util.find_spec(name) is not None for name in ("lightning", "pytorch_lightning"))


def test_lightning_example(tmp_path):
    proc = run_script("examples/lightning/train.py", "--steps", "2", "--seq-len", "32", "--batch-size", "2",
                      "--data", str(small_text_file(tmp_path)), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    if _lightning_installed():
        assert "final train_loss" in proc.stdout
    else:
        assert "skipped" in proc.stdout and "pip install lightning" in proc.stdout
        assert "Traceback" not in proc.stderr


def test_lightning_decoder_matches_reference():
    """The Liger-composed decoder's loss and gradients equal a float64 plain-PyTorch run."""
    decoder = load_module("examples/lightning/liger_decoder.py", "liger_decoder_under_test")
    # Odd sizes: vocab 257, head_dim 12, sequence 23, grouped-query attention.
    config = decoder.DecoderConfig(vocab_size=257, hidden_size=48, intermediate_size=100, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    model = decoder.LigerDecoder(config).to(DEVICE)
    # Random norm weights, so a norm that ignored its weight would show.
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__ == "LigerRMSNorm":
                module.weight.uniform_(0.5, 1.5)
    reference = copy.deepcopy(model).double()
    reference.use_liger = False
    input_ids = torch.randint(0, config.vocab_size, (3, 24), device=DEVICE)

    loss = model(input_ids)
    loss.backward()
    expected = reference(input_ids)
    expected.backward()

    assert loss.dtype == torch.float32
    # fp32 against float64 through two layers: relative errors of a few 1e-7 are expected.
    assert abs(loss.item() - expected.item()) <= 1e-5 * expected.item()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert p.grad is not None, name
        assert rel_error(p.grad, q.grad) < 1e-4, name


def test_lightning_decoder_rejects_bad_input():
    decoder = load_module("examples/lightning/liger_decoder.py", "liger_decoder_under_test")
    model = decoder.LigerDecoder(decoder.DecoderConfig()).to(DEVICE)
    with pytest.raises(ValueError, match="input_ids"):
        model(torch.zeros(5, dtype=torch.long, device=DEVICE))
    with pytest.raises(ValueError, match="num_attention_heads"):
        decoder.DecoderConfig(hidden_size=64, num_attention_heads=3)


# ----------------------------------------------------------------------------------------
# examples/medusa
# ----------------------------------------------------------------------------------------
def test_medusa_example(tmp_path):
    proc = run_script("examples/medusa/train.py", "--steps", "2", "--seq-len", "24", "--batch-size", "2",
                      "--heads", "2", "--data", str(small_text_file(tmp_path)), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "the fused loss keeps none" in proc.stdout
    if DEVICE == "cpu":
        assert "largest relative difference" in proc.stdout
        assert "head 2 (predicts t+3)" in proc.stdout
    else:
        assert "memory saved by the fused loss" in proc.stdout


def test_medusa_loss_matches_materialized():
    medusa = load_module("examples/medusa/train.py", "medusa_under_test")
    hidden_size, vocab = 40, 131
    heads = torch.nn.ModuleList(medusa.MedusaHead(hidden_size, vocab) for _ in range(3)).to(DEVICE)
    with torch.no_grad():
        for head in heads:  # non-zero residual blocks, so their gradients are exercised too
            head.block.weight.normal_(std=0.1)
    hidden = torch.randn(2, 17, hidden_size, device=DEVICE)
    input_ids = torch.randint(0, vocab, (2, 17), device=DEVICE)

    results = {}
    for fused in (False, True):
        heads.zero_grad(set_to_none=True)
        total, per_head = medusa.medusa_loss(heads, hidden, input_ids, fused=fused, decay=0.8)
        total.backward()
        results[fused] = (total.detach(), [x.detach() for x in per_head], [p.grad.clone() for p in heads.parameters()])
    assert len(results[True][1]) == 3
    assert rel_error(results[True][0], results[False][0]) < 1e-5
    for a, b in zip(results[True][1], results[False][1]):
        assert rel_error(a, b) < 1e-5
    for a, b in zip(results[True][2], results[False][2]):
        assert rel_error(a, b) < 1e-4

    # Head k's loss uses positions t < T - k - 1 against token t + k + 1.
    head = heads[1]
    logits = head.lm_head(head.features(hidden[:, :-3])).reshape(-1, vocab)
    expected = torch.nn.functional.cross_entropy(logits, input_ids[:, 3:].reshape(-1))
    assert rel_error(results[True][1][1], expected.detach()) < 1e-5


def test_medusa_logits_bytes():
    medusa = load_module("examples/medusa/train.py", "medusa_under_test")
    # rows = 2 * (8 + 7 + 6) = 42; fp32 logits (4) plus the fp32 copy (4) per element.
    assert medusa.materialized_logits_bytes(batch=2, seq=10, n_heads=3, vocab=100, dtype=torch.float32) == 42 * 100 * 8
    assert medusa.materialized_logits_bytes(batch=1, seq=10, n_heads=1, vocab=7, dtype=torch.bfloat16) == 8 * 7 * 6
