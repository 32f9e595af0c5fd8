"""Convergence: a Liger-patched model trains exactly like the unpatched one, for every family.

For each family a mini config (``tests.transformers.model_configs``: 2 layers, hidden 32,
4 query heads over 2 KV heads, vocab 1024, eager attention) starts from identical weights
and is trained for 32 AdamW steps on fixed data, patched (instance-level, all kernels,
fused linear cross entropy) versus unpatched. Compared: the loss of every step, the top-k
log-probabilities of an evaluation batch after training, and every parameter after training.

Tolerances (fp32). One forward/backward differs from HF by a few fp32 ulps per op (the
kernels reorder the same fp32 reductions). Training amplifies that: AdamW divides each
gradient by its running RMS, so relative gradient noise of ~1e-7 becomes update noise of
~1e-7 * lr per step and compounds over 32 steps through the changed weights. Measured on the
CPU sizes (transformers 5.17 and 5.24, lr 1e-3, losses falling from ~7.0 to ~5.2): worst
loss difference 1.4e-6, worst top-k log-prob difference 1.4e-6, worst parameter difference
5.1e-6 (Gemma). We allow 2e-5 absolute (+1e-5 relative): 4x the worst parameter drift, and
three orders of magnitude below what a wrong shift, mask, soft-cap or norm offset does (it
moves the first loss by > 1e-2). The GPU sizes (4 layers, 256 tokens, vocab 4096) train
more tokens through more layers, so the drift budget there is 1e-4; on the H200 (2026-12-03)
fp32 losses drifted up to 7e-4 after 32 steps for some families, which HF's own fp32 run
shows against float64 too. So at those sizes the unpatched model is also trained in float64
and a result passes if it is within the tolerance of HF's, or no further from the float64
run than 2x HF's own distance (plus the tolerance), HF's distance being the worst of its
run and of three HF runs from initial weights moved by one ulp: Gemma 2 at these sizes sits
near a bifurcation where HF itself, one ulp off, ends 3.4e-3 from float64 in the embedding
while its unperturbed run stays at 9e-5 (H200, 2026-12-03; the patched model, with only the
RoPE or only the RMSNorm kernel swapped in, lands on that same other branch, 3.4e-3).

bf16 (GPU only: the interpreter has no fast bf16 path): both models run in bf16, where one
op already rounds at 2**-8 = 3.9e-3 relative and the two paths round at different points
(HF casts between ops, the kernels keep fp32 inside), so trajectories drift apart at the
1e-2 level over 32 steps; we check losses to 5e-2 absolute / 2e-2 relative, log-probs to
1e-1, and parameters to 2e-2 - still far below the O(1) effect of a semantic error.

Mixture of experts: top-2 routing is discontinuous, so at the GPU sizes HF fp32 and HF
float64 alone diverge by routing flips within ~10 steps (1e-2 in the loss); the training
config there routes to all experts (``convergence_config``), and ``test_one_step_matches_float64``
checks every family, Mixtral with top-2 routing, one step at a time against float64 (no
trajectory, so no chaos). The float64 yardstick runs HF's eager expert loop (its grouped
matmul has no float64 kernel).

CPU cost: the Triton interpreter runs every launch program by program; batch 2 x 16 tokens
keeps one patched step well under a second, so the eight families fit in a few minutes.
On GPU (``FULL_SHAPES``) the models are wider (hidden 128, 4 layers, vocab 4096).
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from liger_kernel.transformers import _apply_liger_kernel_to_instance
from liger_kernel.transformers.monkey_patch import _instance_patched
from tests.transformers.model_configs import (
    MODEL_TYPES,
    build_model,
    convergence_config,
    loss_and_grads,
    random_batch,
)
from tests.utils import DEVICE, FULL_SHAPES

STEPS = 32
BATCH, SEQ = (4, 64) if FULL_SHAPES else (2, 16)
TOP_K = 10
LR = 1e-3

_FP32 = (1e-4, 1e-5) if FULL_SHAPES else (2e-5, 1e-5)
TOLERANCES = {
    torch.float32: {"loss": _FP32, "logprobs": _FP32, "params": _FP32},
    torch.bfloat16: {"loss": (5e-2, 2e-2), "logprobs": (1e-1, 2e-2), "params": (2e-2, 2e-2)},
}


def _train(model, batches, steps: int):
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    model.train()
    losses = []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = model(**batches[step % len(batches)]).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.detach().float())
    return torch.stack(losses)


def _eval_logprobs(model, batch):
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return torch.log_softmax(logits.float(), dim=-1)


def _assert_close_or_no_worse_than_hf(ours, hf, truth, atol, rtol, label, perturbed=()):
    """``ours`` within (atol, rtol) of HF's result, or no further from the float64 truth than
    HF itself gets (x2, elementwise worst case), where HF's distance is the worst of its run
    and of the ``perturbed`` runs (HF from initial weights moved by one ulp): training chaos
    that HF's own rounding shows just as much is not a Liger error, while a semantic error
    is far from the truth too."""
    try:
        torch.testing.assert_close(ours, hf, atol=atol, rtol=rtol, msg=lambda m: f"{label}\n{m}")
        return
    except AssertionError:
        if truth is None:
            raise
    ours_err = float((ours.double() - truth).abs().max())
    hf_err = max(float((run.double() - truth).abs().max()) for run in (hf, *perturbed))
    assert ours_err <= 2 * hf_err + atol, (
        f"{label}: max error vs float64 truth {ours_err:.3g}, HF {hf.dtype} {hf_err:.3g} (worst of {1 + len(perturbed)} "
        f"runs; allowed 2x + {atol})")


def _one_ulp_perturbed(model, seed: int):
    """A copy of ``model`` with every weight multiplied by 1 +- eps (random signs): the same
    model up to one rounding of its initial weights."""
    perturbed = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in perturbed.parameters():
            signs = torch.randint(0, 2, param.shape, generator=generator).to(param.device, param.dtype) * 2 - 1
            param.mul_(1 + signs * torch.finfo(param.dtype).eps)
    return perturbed


PERTURBED_RUNS = 3


def _check(model_type: str, dtype: torch.dtype):
    config = convergence_config(model_type)
    reference = build_model(model_type, seed=0, config=config, dtype=dtype).to(DEVICE)
    patched = copy.deepcopy(reference)
    reference_start = copy.deepcopy(reference) if FULL_SHAPES else None
    truth_model = _float64_copy(reference) if FULL_SHAPES else None  # same start, float64
    _apply_liger_kernel_to_instance(patched)
    assert _instance_patched(patched)

    batches = [random_batch(config.vocab_size, BATCH, SEQ, seed=100 + i, device=DEVICE) for i in range(4)]
    eval_batch = random_batch(config.vocab_size, BATCH, SEQ, seed=999, device=DEVICE)
    tol = TOLERANCES[dtype]

    ref_losses = _train(reference, batches, STEPS)
    losses = _train(patched, batches, STEPS)
    assert torch.isfinite(losses).all()
    assert losses[-4:].mean() < losses[:4].mean()  # it actually learns
    # On the GPU sizes training drifts chaotically (AdamW normalises tiny gradient noise into
    # full-size updates; MoE routing flips), so the unpatched model is also trained in
    # float64 from the same weights as the yardstick of how much drift rounding alone causes.
    truth = None
    if truth_model is not None:
        try:
            truth = {"losses": _train(truth_model, batches, STEPS).double(), "model": truth_model}
        except RuntimeError as exc:  # an HF kernel without float64 support: strict check only
            print(f"float64 yardstick unavailable for {model_type}: {exc}")
    # Some configs sit near a bifurcation of the training dynamics: HF from weights moved by
    # one ulp ends 3e-3 away in some parameters while HF's own run stays at 1e-4 (Gemma 2 at
    # the GPU sizes, H200 2026-12-03). HF's own drift is therefore measured over a few such
    # runs, not one.
    perturbed = []
    if truth is not None:
        perturbed = [_one_ulp_perturbed(reference_start, seed) for seed in range(1, PERTURBED_RUNS + 1)]
    perturbed_losses = [_train(model, batches, STEPS) for model in perturbed]
    atol, rtol = tol["loss"]
    _assert_close_or_no_worse_than_hf(losses, ref_losses, truth and truth["losses"], atol, rtol, "losses",
                                      perturbed_losses)

    ref_logprobs = _eval_logprobs(reference, eval_batch)
    logprobs = _eval_logprobs(patched, eval_batch)
    ref_top, top_index = ref_logprobs.topk(TOP_K, dim=-1)
    atol, rtol = tol["logprobs"]
    # Gathered at the reference's top-k tokens: robust to ties swapping ranks.
    truth_top = _eval_logprobs(truth["model"], eval_batch).double().gather(-1, top_index) if truth else None
    perturbed_top = [_eval_logprobs(model, eval_batch).gather(-1, top_index) for model in perturbed]
    _assert_close_or_no_worse_than_hf(logprobs.gather(-1, top_index), ref_top, truth_top, atol, rtol, "logprobs",
                                      perturbed_top)

    atol, rtol = tol["params"]
    ref_params = dict(reference.named_parameters())
    truth_params = dict(truth["model"].named_parameters()) if truth else {}
    perturbed_params = [dict(model.named_parameters()) for model in perturbed]
    for name, param in patched.named_parameters():
        _assert_close_or_no_worse_than_hf(param.detach(), ref_params[name].detach(),
                                          truth_params[name].detach() if truth else None, atol, rtol, name,
                                          [p[name].detach() for p in perturbed_params])


def _float64_copy(model):
    truth = copy.deepcopy(model).double()
    if getattr(truth.config, "_experts_implementation", "eager") != "eager":
        # HF's grouped/batched expert matmuls (torch._grouped_mm) have no float64 kernel; the
        # eager expert loop computes the same function.
        truth.config._experts_implementation = "eager"
    return truth


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_one_step_matches_float64(model_type):
    """One training step from the same weights, no trajectory: the patched model's loss and
    every gradient are no further from HF's float64 result than HF fp32's own (x2, plus a
    floor of 1e-6 relative for the fp32 rounding of a tensor's norm). Unlike the 32-step
    comparison this is not chaotic, so it also covers Mixtral's top-2 routing at every size
    (the training config routes to all experts at the GPU sizes, see ``convergence_config``).
    """
    overrides = {"num_experts_per_tok": 2} if model_type == "mixtral" else {}
    config = convergence_config(model_type, **overrides)
    reference = build_model(model_type, seed=0, config=config)
    patched = copy.deepcopy(reference)
    _apply_liger_kernel_to_instance(patched)
    truth = _float64_copy(reference)
    batch = random_batch(config.vocab_size, BATCH, SEQ, seed=7, device=DEVICE)
    loss64, grads64 = loss_and_grads(truth, batch)
    ref_loss, ref_grads = loss_and_grads(reference, batch)
    loss, grads = loss_and_grads(patched, batch)
    assert set(grads) == set(grads64)
    assert abs(loss - loss64) <= 2 * abs(ref_loss - loss64) + 1e-6 * abs(loss64), (loss, ref_loss, loss64)
    for name, g64 in grads64.items():
        scale = g64.norm().clamp_min(1e-30)
        ours, hf = float((grads[name] - g64).norm() / scale), float((ref_grads[name] - g64).norm() / scale)
        assert ours <= 2 * hf + 1e-6, f"{name}: gradient error vs float64 {ours:.3g}, HF fp32 {hf:.3g}"


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_convergence_fp32(model_type):
    _check(model_type, torch.float32)


@pytest.mark.gpu_only
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_convergence_bf16(model_type):
    _check(model_type, torch.bfloat16)
