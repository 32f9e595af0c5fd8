"""``triton_grpo_loss`` and ``fused_selective_log_softmax`` as their callers import and call them."""

import torch

from liger_kernel.reference.distillation import grpo_loss_reference, selective_log_softmax_reference
from tests.utils import DEVICE, assert_close


def _inputs(n_batch=3, n_positions=5, vocab=29):
    logits = torch.randn(n_batch, n_positions + 1, vocab, device=DEVICE, requires_grad=True)
    ids = torch.randint(0, vocab, (n_batch, n_positions), device=DEVICE)
    old = torch.randn(n_batch, n_positions, device=DEVICE) * 0.3 - 3.0
    ref = torch.randn(n_batch, n_positions, device=DEVICE) * 0.3 - 3.0
    advantages = torch.randn(n_batch, device=DEVICE)
    mask = torch.ones(n_batch, n_positions, dtype=torch.long, device=DEVICE)
    mask[1, 3:] = 0
    return logits, old, ref, ids, advantages, mask


def test_axolotl_import_path_and_signature():
    from liger_kernel.ops import fused_selective_log_softmax as exported
    from liger_kernel.ops.grpo_loss import fused_selective_log_softmax

    assert exported is fused_selective_log_softmax
    logits, _, _, ids, _, mask = _inputs()
    out = fused_selective_log_softmax(logits, ids, temperature=1.0, mask=mask)
    ref, _ = selective_log_softmax_reference(logits.detach().double()[:, :-1], ids, 1.0, mask)
    assert_close(out, ref, torch.float32, scale=20)


def test_triton_grpo_loss_default_returns_per_token_tensors():
    from liger_kernel.transformers import triton_grpo_loss

    logits, old, ref, ids, advantages, mask = _inputs()
    per_token, kl, clipped = triton_grpo_loss(logits, old, ref, ids, advantages, mask)
    assert per_token.shape == kl.shape == clipped.shape == ids.shape
    loss = (per_token * mask).sum() / mask.sum()  # how the documented trainer patch reduces it
    loss.backward()
    ref_logits = logits.detach().double().requires_grad_()
    _, ref_per_token, ref_kl, _ = grpo_loss_reference(ref_logits, old.double(), ref.double(), ids,
                                                      advantages.double(), mask)
    ((ref_per_token * mask).sum() / mask.sum()).backward()
    assert_close(per_token, ref_per_token, torch.float32, scale=20)
    assert_close(kl, ref_kl, torch.float32, scale=20)
    assert_close(logits.grad, ref_logits.grad, torch.float32, scale=4)


def test_triton_grpo_loss_reduced_returns_loss_and_metrics():
    from liger_kernel.ops import GrpoLossFunction
    from liger_kernel.transformers import triton_grpo_loss

    logits, old, ref, ids, advantages, mask = _inputs()
    loss, metrics = triton_grpo_loss(logits, old, ref, ids, advantages, mask, loss_type="grpo", reduce=True)
    assert len(metrics) == 2 and loss.dim() == 0
    loss_no_kl, metrics_no_kl = triton_grpo_loss(logits, old, None, ids, advantages, mask, beta=0.0, reduce=True)
    assert len(metrics_no_kl) == 1
    direct = GrpoLossFunction.apply(logits, old, ref, ids, advantages, mask, 0.9, 0.04, 0.2, 0.4, True, "grpo")
    assert_close(direct[0], loss, torch.float32)
    ref_loss, _, _, _ = grpo_loss_reference(logits.detach().double(), old.double(), ref.double(), ids,
                                            advantages.double(), mask, loss_type="grpo")
    assert_close(loss, ref_loss, torch.float32, scale=20)


def test_traces_as_one_graph():
    from liger_kernel.ops.grpo_loss import selective_log_softmax
    from liger_kernel.transformers import triton_grpo_loss

    def step(logits, old, ref, ids, advantages, mask):
        per_token, _, _ = triton_grpo_loss(logits, old, ref, ids, advantages, mask)
        logp, entropy = selective_log_softmax(logits[:, 1:], ids, 0.7, mask, return_entropy=True)
        return (per_token * mask).sum() / mask.sum() + 0.1 * logp.sum() - 0.01 * entropy.sum()

    args = _inputs()
    logits = args[0]
    eager = step(*args)
    (eager_grad,) = torch.autograd.grad(eager, logits)
    traced = torch.compile(step, backend="aot_eager", fullgraph=True)(*args)
    (traced_grad,) = torch.autograd.grad(traced, logits)
    assert_close(traced, eager, torch.float32)
    assert_close(traced_grad, eager_grad, torch.float32)
