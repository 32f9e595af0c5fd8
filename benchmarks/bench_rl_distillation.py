"""RL and distillation losses on a fused head: per-token log-probs, GRPO and generalised-JSD distillation.

Log-probs: hidden states x (N, D), lm_head W (V, D), sampled tokens (N,); the loss an RL trainer
forms from the per-token log-probabilities and entropies, ``sum_n a_n logp_n + b_n H_n`` with
random per-token coefficients. Reference: materialised logits, ``log_softmax``, gather, entropy.
Liger: :func:`liger_kernel.ops.fused_linear_logprobs.fused_linear_logprobs`.

GRPO: hidden states x (B, T, D) of B completions, lm_head W (V, D), sampled tokens (B, T), a
loss mask, advantages (B,), old and reference per-token log-probabilities (B, T). Reference:
``logits = x @ W.T`` (bf16 matmul), upcast, ``log_softmax`` and gather, then TRL's DAPO loss
(token-level ratios clipped to [0.8, 1.28], beta 0.04 times the k3 KL to the reference, sum over
the masked tokens / their count). Liger: :class:`liger_kernel.chunked_loss.LigerFusedLinearGRPOLoss`
with the same options, chunk by chunk without the logits.

JSD: student x (N, D) and teacher x_t (N, D) hidden states with heads W, W_t (V, D) each, labels
(N,). Reference: both logits materialised (bf16 matmuls), upcast, generalised JSD with beta 0.5,
mean over tokens. Liger: :class:`liger_kernel.chunked_loss.LigerFusedLinearJSDLoss` (soft loss only).

Compute-bound floors at the matmul rate measured in the same run, with M = rows * D * V
multiply-adds per head: GRPO forward 2M, backward 4M (dX and dW), full 6M; JSD adds the
teacher's forward (2M) to each mode that runs a forward (forward 4M, backward 4M, full 8M).
Memory floor (backward, full): dX + dW, which must exist anyway (1066 MiB at 8192 rows,
D 4096, V 128256 in bf16); forward 0.
"""

from __future__ import annotations

import math

import torch

from benchmarks.bench_cross_entropy import _sweep
from benchmarks.harness import HEAD_TARGETS, Floor, Inputs, OpSpec, dtype_size

GRPO_TARGET = {"B": 8, "T": 1024, "D": 4096, "V": 128256}
JSD_TARGET = {"N": 8192, "D": 4096, "V": 128256}
GRPO_OPTIONS = dict(beta=0.04, epsilon_low=0.2, epsilon_high=0.28, loss_type="dapo", temperature=1.0)
JSD_BETA = 0.5


# --------------------------------------------------------------------------------------
# GRPO
# --------------------------------------------------------------------------------------


def materialised_grpo(x, weight, ids, mask, advantages, old_logps, ref_logps):
    """The DAPO loss on materialised logits (see the module docstring)."""
    logits = torch.matmul(x, weight.t()).float() / GRPO_OPTIONS["temperature"]
    logp = logits.log_softmax(-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    ratio = torch.exp(logp - old_logps)
    adv = advantages.unsqueeze(1)
    clipped = ratio.clamp(1 - GRPO_OPTIONS["epsilon_low"], 1 + GRPO_OPTIONS["epsilon_high"])
    per_token = -torch.minimum(ratio * adv, clipped * adv)
    gap = ref_logps - logp
    per_token = per_token + GRPO_OPTIONS["beta"] * (gap.exp() - gap - 1)
    return (per_token * mask).sum() / mask.sum().clamp(min=1)


def _liger_grpo():
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    loss_fn = LigerFusedLinearGRPOLoss(**GRPO_OPTIONS)
    return lambda x, weight, ids, mask, adv, old, ref: loss_fn(x, weight, ids, mask, adv, None, ref, old)[0]


def grpo_inputs(shape: dict[str, int], dtype: torch.dtype, device: torch.device) -> Inputs:
    b, t, d, v = shape["B"], shape["T"], shape["D"], shape["V"]
    x = torch.randn(b, t, d, device=device, dtype=dtype, requires_grad=True)
    weight = (0.02 * torch.randn(v, d, device=device)).to(dtype).requires_grad_()
    ids = torch.randint(0, v, (b, t), device=device)
    lengths = torch.randint(t // 2, t + 1, (b,), device=device)
    mask = (torch.arange(t, device=device)[None, :] < lengths[:, None]).float()
    adv = torch.randn(b, device=device)
    # Log-probabilities near those of a 0.02-initialised head (about -log V), scattered per token.
    base = -torch.log(torch.tensor(float(v)))
    old = base + 0.3 * torch.randn(b, t, device=device)  # ratios spread past both clip bounds
    ref = base + 0.1 * torch.randn(b, t, device=device)
    return Inputs(args=(x, weight, ids, mask, adv, old, ref), grad_args=(0, 1))


def head_flops(rows: int, shape: dict[str, int]) -> int:
    return rows * shape["D"] * shape["V"]


def grpo_floor(shape: dict[str, int], dtype: torch.dtype, mode: str) -> Floor:
    macs = head_flops(shape["B"] * shape["T"], shape)
    return Floor(flops={"forward": 2 * macs, "backward": 4 * macs, "full": 6 * macs}[mode])


def grad_floor_peak(rows_key):
    def peak(shape: dict[str, int], dtype: torch.dtype, mode: str) -> float:
        if mode == "forward":
            return 0.0
        rows = shape["B"] * shape["T"] if rows_key == "BT" else shape["N"]
        return (rows + shape["V"]) * shape["D"] * dtype_size(dtype)  # dX + dW

    return peak


# --------------------------------------------------------------------------------------
# Generalised JSD distillation
# --------------------------------------------------------------------------------------


def materialised_jsd(x, weight, teacher_x, teacher_weight, labels):
    """Generalised JSD (beta 0.5) of materialised student and teacher logits, mean over tokens."""
    log_p = torch.matmul(x, weight.t()).float().log_softmax(-1)
    with torch.no_grad():
        log_q = torch.matmul(teacher_x, teacher_weight.t()).float().log_softmax(-1)
    log_m = torch.logaddexp(log_p + math.log(1 - JSD_BETA), log_q + math.log(JSD_BETA))
    rows = JSD_BETA * (log_q.exp() * (log_q - log_m)).sum(-1) + (1 - JSD_BETA) * (log_p.exp() * (log_p - log_m)).sum(-1)
    return rows.mean()


def _liger_jsd():
    from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss

    loss_fn = LigerFusedLinearJSDLoss(weight_hard_loss=0.0, weight_soft_loss=1.0, beta=JSD_BETA, compiled=False)
    return lambda x, weight, teacher_x, teacher_weight, labels: loss_fn(x, weight, teacher_x, teacher_weight, labels)


def jsd_inputs(shape: dict[str, int], dtype: torch.dtype, device: torch.device) -> Inputs:
    n, d, v = shape["N"], shape["D"], shape["V"]
    x = torch.randn(n, d, device=device, dtype=dtype, requires_grad=True)
    weight = (0.02 * torch.randn(v, d, device=device)).to(dtype).requires_grad_()
    teacher_x = torch.randn(n, d, device=device, dtype=dtype)
    teacher_weight = (0.02 * torch.randn(v, d, device=device)).to(dtype)
    labels = torch.randint(0, v, (n,), device=device)
    return Inputs(args=(x, weight, teacher_x, teacher_weight, labels), grad_args=(0, 1))


def jsd_floor(shape: dict[str, int], dtype: torch.dtype, mode: str) -> Floor:
    macs = head_flops(shape["N"], shape)
    return Floor(flops={"forward": 4 * macs, "backward": 4 * macs, "full": 8 * macs}[mode])


# --------------------------------------------------------------------------------------
# Per-token log-probabilities and entropies (what RL trainers compute their losses from)
# --------------------------------------------------------------------------------------


def materialised_logprobs(x, weight, ids, logp_grad, entropy_grad):
    """``sum_n a_n logp_n + b_n H_n`` on materialised logits: an RL loss's use of the per-token
    log-probabilities and entropies, with per-token coefficients fixed by the inputs."""
    logp_all = torch.matmul(x, weight.t()).float().log_softmax(-1)
    logp = logp_all.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return (logp * logp_grad + entropy * entropy_grad).sum()


def _liger_logprobs():
    from liger_kernel.ops.fused_linear_logprobs import fused_linear_logprobs

    def fn(x, weight, ids, logp_grad, entropy_grad):
        logp, entropy = fused_linear_logprobs(x, weight, ids)
        return (logp * logp_grad + entropy * entropy_grad).sum()

    return fn


def logprobs_inputs(shape: dict[str, int], dtype: torch.dtype, device: torch.device) -> Inputs:
    n, d, v = shape["N"], shape["D"], shape["V"]
    x = torch.randn(n, d, device=device, dtype=dtype, requires_grad=True)
    weight = (0.02 * torch.randn(v, d, device=device)).to(dtype).requires_grad_()
    ids = torch.randint(0, v, (n,), device=device)
    return Inputs(args=(x, weight, ids, torch.randn(n, device=device) / n, torch.randn(n, device=device) / n),
                  grad_args=(0, 1))


def logprobs_floor(shape: dict[str, int], dtype: torch.dtype, mode: str) -> Floor:
    macs = head_flops(shape["N"], shape)
    return Floor(flops={"forward": 2 * macs, "backward": 4 * macs, "full": 6 * macs}[mode])


POST_TRAINING_TARGETS = HEAD_TARGETS


def token_rows_spec(name, make_inputs, reference, liger, floor, notes="") -> OpSpec:
    """An op over N token rows of hidden size D through a V-row head (its target shape first)."""
    return OpSpec(
        name=name,
        shape_keys=("N", "D", "V"),
        gpu_shapes=_sweep(JSD_TARGET, {"N": (4096, 8192), "D": (4096,), "V": (32000, 128256)}),
        tiny_shapes=[{"N": 16, "D": 32, "V": 300}, {"N": 24, "D": 32, "V": 500}],
        make_inputs=make_inputs,
        reference=reference,
        liger=liger,
        floor=floor,
        floor_peak_bytes=grad_floor_peak("N"),
        size=lambda s: s["N"] * s["D"] * s["V"],
        size_label="N*D*V (multiply-adds per head matmul)",
        targets=POST_TRAINING_TARGETS,
        notes=notes,
    )


SPECS = [
    token_rows_spec("fused_linear_logprobs", logprobs_inputs, materialised_logprobs, _liger_logprobs, logprobs_floor,
                    notes="per-token outputs: the upstream gradient is known only in backward, which recomputes "
                          "the logits (8NDV of work against the 6NDV floor)"),
    OpSpec(
        name="grpo",
        shape_keys=("B", "T", "D", "V"),
        gpu_shapes=_sweep(GRPO_TARGET, {"B": (8,), "T": (512, 1024), "D": (4096,), "V": (32000, 128256)}),
        tiny_shapes=[{"B": 2, "T": 8, "D": 32, "V": 300}, {"B": 4, "T": 16, "D": 32, "V": 500}],
        make_inputs=grpo_inputs,
        reference=materialised_grpo,
        liger=_liger_grpo,
        floor=grpo_floor,
        floor_peak_bytes=grad_floor_peak("BT"),
        size=lambda s: s["B"] * s["T"] * s["D"] * s["V"],
        size_label="B*T*D*V (multiply-adds per head matmul)",
        targets=POST_TRAINING_TARGETS,
    ),
    token_rows_spec("fused_linear_jsd", jsd_inputs, materialised_jsd, _liger_jsd, jsd_floor),
]
