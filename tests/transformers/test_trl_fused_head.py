"""TRL's fused LM head call shape served by liger_kernel: against a float64 reference of TRL's
semantics always, and against TRL's own ``ChunkedLogProbFunction`` and ``add_fused_lm_head``
when a TRL >= 1.13 is importable (the project pins TRL < 1.13, so those tests skip unless one is
put on the path, e.g. ``PYTHONPATH=src:<unzipped TRL 1.16 wheel>``).
"""

from __future__ import annotations

import importlib
import types

import pytest
import torch

from liger_kernel.ops.fused_linear_logprobs import fused_linear_token_statistics
from liger_kernel.transformers.trl_fused_head import (
    LigerChunkedDivergenceFunction,
    LigerChunkedLogProbFunction,
    LigerFusedHeadInstallation,
    use_liger_fused_head,
)
from tests.ops.test_cross_entropy import assert_grad_close
from tests.ops.test_fused_linear_logprobs import reference_statistics
from tests.transformers.model_configs import build_model, random_batch
from tests.utils import DEVICE

ALL_OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
NAMES = ALL_OUTPUTS[1:]


def trl_attribute(module_name: str, name: str):
    """``module.name`` of the importable TRL, or None (TRL missing, or older than the name)."""
    try:
        return getattr(importlib.import_module(module_name), name, None)
    except ImportError:
        return None


@pytest.fixture(scope="module")
def trl_function():
    function = trl_attribute("trl.kernels.chunked_logprob", "ChunkedLogProbFunction")
    if function is None:
        pytest.skip("no TRL >= 1.13 importable (trl.kernels.chunked_logprob.ChunkedLogProbFunction); "
                    "the project pins TRL < 1.13")
    return function


@pytest.fixture(scope="module")
def trl_utils():
    try:
        utils = importlib.import_module("trl.trainer.utils")
    except ImportError as error:
        pytest.skip(f"trl.trainer.utils does not import: {error}")
    if not hasattr(utils, "add_fused_lm_head"):
        pytest.skip("no TRL >= 1.13 importable (trl.trainer.utils.add_fused_lm_head); the project pins TRL < 1.13")
    return utils


def random_head(n, hidden, vocab, with_bias, dtype=torch.float32):
    x = torch.randn(n, hidden, device=DEVICE).to(dtype)
    weight = (torch.randn(vocab, hidden, device=DEVICE) * 3 / hidden**0.5).to(dtype)
    bias = torch.randn(vocab, device=DEVICE).to(dtype) if with_bias else None
    return x, weight, bias, torch.randint(0, vocab, (n,), device=DEVICE)


def run(function, x, weight, bias, target, g, h, *args):
    """``function.apply``'s outputs and the gradients of ``sum g logp + h entropy`` in (x, weight, bias)."""
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in (x, weight, bias)]
    outputs = function.apply(leaves[0], leaves[1], leaves[2], target, *args)
    loss = (outputs[0] * g).sum() + ((outputs[1] * h).sum() if outputs[1] is not None else 0)
    loss.backward()
    return outputs, [leaf.grad if leaf is not None else None for leaf in leaves]


@pytest.mark.parametrize("n, hidden, vocab, temperature, softcap, logit_scale, with_bias, outputs", [
    (13, 16, 37, 0.7, None, 1.0, True, ALL_OUTPUTS),
    (9, 8, 53, 1.3, 4.0, 0.6, False, ("log_probs", "entropy")),
    (6, 32, 101, 1.0, 30.0, 2.0, True, ("log_probs",)),
    (7, 16, 29, 0.9, 5.0, 1.0, True, ("is_top1", "log_probs", "mean_logits")),
])
def test_matches_float64_reference_of_trl_semantics(n, hidden, vocab, temperature, softcap, logit_scale, with_bias,
                                                    outputs):
    x, weight, bias, target = random_head(n, hidden, vocab, with_bias)
    g, h = torch.randn(n, device=DEVICE), torch.randn(n, device=DEVICE)
    got, grads = run(LigerChunkedLogProbFunction, x, weight, bias, target, g, h, temperature, 4096, softcap,
                     logit_scale, outputs)
    assert len(got) == 5
    for name, value in zip(NAMES, got[1:]):
        assert (value is None) == (name not in outputs), name

    leaves = [t.double().requires_grad_() if t is not None else None for t in (x, weight, bias)]
    logits = leaves[0] @ leaves[1].t() + (leaves[2] if with_bias else 0)
    *expected, gap = reference_statistics(logits, target, temperature, softcap, logit_scale)
    loss = (expected[0] * g).sum() + ((expected[1] * h).sum() if "entropy" in outputs else 0)
    expected_grads = torch.autograd.grad(loss, [t for t in leaves if t is not None])
    for name, value, reference in zip(ALL_OUTPUTS, got, expected):
        if value is None:
            continue
        if name == "is_top1":
            assert value.dtype == torch.bool
            assert torch.equal(value[gap > 1e-3], reference[gap > 1e-3])
            continue
        assert value.dtype == torch.float32 and value.shape == (n,)
        torch.testing.assert_close(value.double(), reference.detach(), atol=1e-5, rtol=1e-5, msg=name)
    for name, grad, reference in zip(("hidden", "weight", "bias"), [t for t in grads if t is not None],
                                     expected_grads):
        assert_grad_close(grad, reference, torch.float32, name, tol_scale=10)


def test_autocast_runs_the_head_in_the_autocast_dtype():
    """TRL multiplies in the autocast dtype when autocast is on (its ``compute_dtype``): the same
    as our functional on operands cast to bf16, gradients returned in the operands' float32."""
    x, weight, bias, target = random_head(11, 16, 41, True)
    g, h = torch.randn(11, device=DEVICE), torch.randn(11, device=DEVICE)
    with torch.autocast(device_type=torch.device(DEVICE).type, dtype=torch.bfloat16):
        got, grads = run(LigerChunkedLogProbFunction, x, weight, bias, target, g, h, 0.8, 512, 3.0, 1.5, ALL_OUTPUTS)
    leaves = [t.detach().clone().requires_grad_() for t in (x, weight, bias)]
    expected = fused_linear_token_statistics(*(t.to(torch.bfloat16) for t in leaves[:2]), target,
                                             leaves[2].to(torch.bfloat16), temperature=0.8, softcap=3.0,
                                             logit_scale=1.5, outputs=NAMES, accum_dtype=torch.float32)
    ((expected.logprobs * g).sum() + (expected.entropy * h).sum()).backward()
    for value, reference in zip(got, expected):
        assert torch.equal(value, reference)
    for grad, leaf in zip(grads, leaves):
        assert grad.dtype == torch.float32 and torch.equal(grad, leaf.grad)


def test_bad_arguments_raise():
    x, weight, _, target = random_head(4, 8, 7, False)
    with pytest.raises(NotImplementedError, match="sampling_mask"):
        LigerChunkedLogProbFunction.apply(x, weight, None, target, 1.0, 4096, None, 1.0, ALL_OUTPUTS,
                                          torch.ones(4, 7, dtype=torch.bool))
    with pytest.raises(ValueError, match="chunk_size"):
        LigerChunkedLogProbFunction.apply(x, weight, None, target, 1.0, 0)
    with pytest.raises(ValueError, match="2-D"):
        LigerChunkedLogProbFunction.apply(x.view(2, 2, 8), weight, None, target.view(2, 2), 1.0, 4096)
    with pytest.raises(ValueError, match="unknown output 'logits'"):
        LigerChunkedLogProbFunction.apply(x, weight, None, target, 1.0, 4096, None, 1.0, ("log_probs", "logits"))
    with pytest.raises(ValueError, match="target"):
        LigerChunkedLogProbFunction.apply(x, weight, None, torch.full((4,), 7, device=DEVICE), 1.0, 4096)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature, softcap, logit_scale, with_bias", [(0.7, None, 1.0, True),
                                                                          (1.2, 4.0, 0.5, False)])
def test_matches_trls_own_function(trl_function, dtype, temperature, softcap, logit_scale, with_bias):
    x, weight, bias, target = random_head(19, 16, 67, with_bias, dtype)
    g, h = torch.randn(19, device=DEVICE), torch.randn(19, device=DEVICE)
    args = (temperature, 32, softcap, logit_scale, ALL_OUTPUTS)
    ours, our_grads = run(LigerChunkedLogProbFunction, x, weight, bias, target, g, h, *args)
    theirs, their_grads = run(trl_function, x, weight, bias, target, g, h, *args)
    logits = x.double() @ weight.double().t() + (bias.double() if with_bias else 0)
    gap = reference_statistics(logits, target, temperature, softcap, logit_scale)[-1]
    atol = 1e-5 if dtype == torch.float32 else 5e-2  # bf16: the two round the logits in different places
    for name, mine, trl_value in zip(ALL_OUTPUTS, ours, theirs):
        assert mine.dtype == trl_value.dtype and mine.shape == trl_value.shape, name
        if name == "is_top1":
            clear = gap > (1e-3 if dtype == torch.float32 else 0.2)
            assert torch.equal(mine[clear], trl_value[clear])
        else:
            torch.testing.assert_close(mine, trl_value, atol=atol, rtol=atol, msg=name)
    for name, mine, trl_grad in zip(("hidden", "weight", "bias"), our_grads, their_grads):
        if mine is None:
            assert trl_grad is None
            continue
        assert mine.dtype == trl_grad.dtype == dtype, name
        assert_grad_close(mine, trl_grad.double(), dtype, name, tol_scale=10 if dtype == torch.float32 else 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("beta, with_bias, student_cap, teacher_cap", [(0.0, True, None, 5.0), (0.3, False, 4.0, None),
                                                                      (1.0, True, None, None)])
def test_divergence_matches_trls_own_function(dtype, beta, with_bias, student_cap, teacher_cap):
    trl_divergence = trl_attribute("trl.kernels.chunked_divergence", "ChunkedDivergenceFunction")
    if trl_divergence is None:
        pytest.skip("no TRL >= 1.13 importable (trl.kernels.chunked_divergence); the project pins TRL < 1.13")
    x_s, w_s, b_s, _ = random_head(17, 16, 43, with_bias, dtype)
    x_t, w_t, b_t, _ = random_head(17, 24, 43, with_bias, dtype)
    g = torch.randn(17, device=DEVICE)
    results = []
    for function in (LigerChunkedDivergenceFunction, trl_divergence):
        leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in (x_s, w_s, b_s)]
        divergence, entropy = function.apply(*leaves, x_t, w_t, b_t, beta, 0.8, 1.3, student_cap, 0.7, teacher_cap)
        assert not entropy.requires_grad
        (divergence * g).sum().backward()
        results.append((divergence, entropy, *(t.grad for t in leaves if t is not None)))
    # bf16: TRL keeps the logits in float32, the engine rounds them to the GEMM's dtype.
    atol = 1e-5 if dtype == torch.float32 else 5e-2
    for ours, theirs in zip(results[0][:2], results[1][:2]):
        torch.testing.assert_close(ours, theirs, atol=atol, rtol=atol)
    for name, ours, theirs in zip(("hidden", "weight", "bias"), results[0][2:], results[1][2:]):
        assert ours.dtype == theirs.dtype == dtype
        assert_grad_close(ours, theirs.double(), dtype, name, tol_scale=10 if dtype == torch.float32 else 3)


def test_install_and_undo(trl_utils):
    original = trl_utils._ChunkedLogProbFunction
    distillation = importlib.import_module("trl.trainer.distillation_trainer")
    original_divergence = distillation.ChunkedDivergenceFunction
    handle = use_liger_fused_head()
    try:
        assert trl_utils._ChunkedLogProbFunction is LigerChunkedLogProbFunction and handle.active
        assert distillation.ChunkedDivergenceFunction is LigerChunkedDivergenceFunction
        assert handle.names == ["trl.trainer.utils._ChunkedLogProbFunction",
                                "trl.trainer.distillation_trainer.ChunkedDivergenceFunction"]
        with use_liger_fused_head() as nested:  # a second installation undoes to the first
            assert trl_utils._ChunkedLogProbFunction is LigerChunkedLogProbFunction
        assert not nested.active and trl_utils._ChunkedLogProbFunction is LigerChunkedLogProbFunction
    finally:
        handle.undo()
    assert trl_utils._ChunkedLogProbFunction is original and not handle.active
    assert distillation.ChunkedDivergenceFunction is original_divergence
    handle.undo()  # a second undo does nothing
    assert trl_utils._ChunkedLogProbFunction is original


def test_older_trl_is_refused_clearly():
    """TRL 1.12 has a ``trl.trainer.utils._ChunkedLogProbFunction`` of another call shape: left alone."""
    if trl_attribute("trl", "__version__") is None:
        with pytest.raises(ImportError, match="TRL >= 1.13"):
            use_liger_fused_head()
        return
    if trl_attribute("trl.kernels", "ChunkedLogProbFunction") is not None:
        pytest.skip("the importable TRL has a fused head (>= 1.13)")
    before = trl_attribute("trl.trainer.utils", "_ChunkedLogProbFunction")
    with pytest.raises(RuntimeError, match="1.13"):
        use_liger_fused_head()
    assert trl_attribute("trl.trainer.utils", "_ChunkedLogProbFunction") is before


def test_undo_refuses_when_replaced_again():
    module = types.ModuleType("fake.module")
    module._ChunkedLogProbFunction = LigerChunkedLogProbFunction
    handle = LigerFusedHeadInstallation([(module, "_ChunkedLogProbFunction", object, LigerChunkedLogProbFunction)])
    module._ChunkedLogProbFunction = None
    with pytest.raises(RuntimeError, match="replaced again"):
        handle.undo()


def fused_head_step(model, batch, entropy_weight):
    """Per-token outputs of TRL's fused forward and the parameter gradients of a policy-style loss."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"],
                fused_lm_head=True)
    loss = out.loss + (entropy_weight * out.entropy).sum() if out.entropy is not None else out.loss
    loss.backward()
    values = {name: getattr(out, name) for name in ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits",
                                                    "is_top1", "label_mask")}
    return values, {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("overrides, temperature, outputs, dtype", [
    ({}, 1.0, ("log_probs",), torch.float32),
    ({"final_logit_softcapping": 4.0, "logit_scale": 0.7}, 0.8, ALL_OUTPUTS, torch.float32),
    ({}, 0.9, ("log_probs", "entropy"), torch.bfloat16),  # with cast_lm_head_to_fp32: a bf16 head, fp32 hidden
])
def test_tiny_llama_add_fused_lm_head_matches_trl(trl_utils, monkeypatch, overrides, temperature, outputs, dtype):
    """TRL's ``add_fused_lm_head`` on a tiny random Llama: per-token outputs and every parameter
    gradient with liger_kernel's head installed equal those of TRL's own kernel."""
    model = build_model("llama", dtype=dtype, **overrides)
    for name, value in overrides.items():  # read by add_fused_lm_head off the config
        assert getattr(model.config, name) == value
    calls = []
    ours_apply = LigerChunkedLogProbFunction.apply
    monkeypatch.setattr(LigerChunkedLogProbFunction, "apply",
                        staticmethod(lambda *args: calls.append(len(args)) or ours_apply(*args)))
    trl_utils.add_fused_lm_head(model, temperature=temperature, outputs=outputs,
                                cast_lm_head_to_fp32=dtype != torch.float32)
    model.train()
    batch = random_batch(model.config.vocab_size, batch=2, seq=12, seed=3)
    entropy_weight = torch.randn(batch["input_ids"].shape[0], batch["input_ids"].shape[1] - 1, device=DEVICE)
    theirs, their_grads = fused_head_step(model, batch, entropy_weight)
    assert not calls
    with use_liger_fused_head():
        ours, our_grads = fused_head_step(model, batch, entropy_weight)
    assert calls == [9]  # TRL 1.16's positional call shape
    assert trl_utils._ChunkedLogProbFunction is not LigerChunkedLogProbFunction
    for name, trl_value in theirs.items():
        mine = ours[name]
        if trl_value is None:
            assert mine is None, name
        elif trl_value.dtype == torch.bool:
            assert torch.equal(mine, trl_value), name
        else:
            torch.testing.assert_close(mine, trl_value, atol=1e-5, rtol=1e-5, msg=name)
    assert our_grads.keys() == their_grads.keys()
    for name, trl_grad in their_grads.items():
        # bf16: the float32 head gradients are rounded to bf16 once (and the backbone's after them).
        assert_grad_close(our_grads[name], trl_grad.double(), dtype, name, tol_scale=10 if dtype == torch.float32 else 1)


@pytest.mark.parametrize("beta, overrides", [(0.5, {}), (0.0, {"final_logit_softcapping": 4.0, "logit_scale": 0.7})])
def test_tiny_llama_distillation_loss_matches_trl(trl_utils, monkeypatch, beta, overrides):
    """TRL's distillation loss (``_chunked_divergence_loss``) between tiny random Llamas of different
    widths: loss, entropy and every student gradient with liger_kernel's divergence installed equal
    those of TRL's own kernel."""
    distillation = importlib.import_module("trl.trainer.distillation_trainer")
    student = build_model("llama", **overrides)
    teacher = build_model("llama", seed=1, hidden=48)
    batch = random_batch(student.config.vocab_size, batch=2, seq=10, seed=5)
    with torch.no_grad():
        teacher_hidden = teacher.model(input_ids=batch["input_ids"]).last_hidden_state
    cap, scale = overrides.get("final_logit_softcapping"), overrides.get("logit_scale", 1.0)

    def step():
        student.zero_grad(set_to_none=True)
        hidden = student.model(input_ids=batch["input_ids"]).last_hidden_state
        loss, entropy_sum, n_valid = distillation._chunked_divergence_loss(
            hidden, teacher_hidden, student.lm_head.weight, teacher.lm_head.weight, batch["attention_mask"], beta,
            student_logit_scale=scale, student_final_logit_softcapping=cap, temperature=0.9)
        loss.backward()
        grads = {name: p.grad.clone() for name, p in student.named_parameters() if p.grad is not None}
        return (loss.detach(), entropy_sum.detach(), n_valid), grads

    calls = []
    ours_apply = LigerChunkedDivergenceFunction.apply
    monkeypatch.setattr(LigerChunkedDivergenceFunction, "apply",
                        staticmethod(lambda *args: calls.append(len(args)) or ours_apply(*args)))
    theirs, their_grads = step()
    assert not calls
    with use_liger_fused_head() as handle:
        assert "trl.trainer.distillation_trainer.ChunkedDivergenceFunction" in handle.names
        ours, our_grads = step()
    assert calls == [12]  # TRL 1.16's positional call shape
    for mine, trl_value in zip(ours, theirs):
        torch.testing.assert_close(mine, trl_value, atol=1e-5, rtol=1e-5)
    assert our_grads.keys() == their_grads.keys()
    for name, trl_grad in their_grads.items():
        assert_grad_close(our_grads[name], trl_grad.double(), torch.float32, name, tol_scale=10)


def test_an_empty_batch_stays_connected():
    """TRL scores only labelled positions, so a microbatch with none passes 0 rows: outputs (0,),
    zero gradients, as TRL's."""
    x, weight, bias, target = random_head(0, 8, 11, True)
    g = torch.zeros(0, device=DEVICE)
    outputs, grads = run(LigerChunkedLogProbFunction, x, weight, bias, target, g, g, 1.0, 4096)
    assert all(value.shape == (0,) for value in outputs)
    assert grads[0].shape == (0, 8) and not grads[1].any() and not grads[2].any()
    divergence, entropy = LigerChunkedDivergenceFunction.apply(x.requires_grad_(), weight, bias, x, weight, bias, 0.5)
    assert divergence.shape == entropy.shape == (0,)
