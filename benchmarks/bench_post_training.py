"""Post-training losses fused with the head (DPO) against the same loss on materialised logits.

DPO (sigmoid, reference head): hidden states x (2P, T, D) of P chosen-then-rejected pairs,
the policy's head W (V, D), a frozen reference head (its hidden states and weight), targets
(2P, T) with the first quarter of each sequence (a prompt) labelled -100. Reference provider:
both heads' logits materialised in the input dtype, upcast to fp32, log-softmax, the targets'
log-probs summed per sequence, ``-log s(beta ((c - c_ref) - (r - r_ref)))`` averaged over the
pairs (TRL's DPO), eager and under torch.compile. Liger: ``LigerFusedLinearDPOLoss``.

Compute-bound floor at the measured matmul rate, with M = 2P*T rows: the policy's logits and
the reference's (2 M D V FLOPs each) in the forward, dX and dW (4 M D V) in the backward,
8 M D V in all (at P 8, T 1024, D 4096, V 128256: 68.9 TFLOP, 100 ms at 687 TFLOP/s). The
chunked loss computes the policy's logits twice when a pair's rows exceed its chunk (two
passes; see ``liger_kernel.ops.chunked_head``): 10 M D V. Memory floor: dX + dW.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from benchmarks.harness import HEAD_TARGETS, Floor, Inputs, OpSpec, dtype_size

IGNORE_INDEX = -100
BETA = 0.1

DPO_TARGET = {"P": 8, "T": 1024, "D": 4096, "V": 128256}
DPO_SWEEP = [{"P": 4, "T": 512, "D": 4096, "V": 128256}, {"P": 8, "T": 1024, "D": 4096, "V": 32000},
             {"P": 8, "T": 2048, "D": 4096, "V": 128256}]


def _sequence_logps(x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    logits = F.linear(x, weight).float()
    counted = target != IGNORE_INDEX
    picked = logits.log_softmax(-1).gather(-1, torch.where(counted, target, 0).unsqueeze(-1)).squeeze(-1)
    return (picked * counted).sum(-1)


def materialised_dpo(x, weight, target, ref_x, ref_weight):
    """TRL's sigmoid DPO loss on materialised logits (both heads)."""
    policy = _sequence_logps(x, weight, target)
    with torch.no_grad():
        ref = _sequence_logps(ref_x, ref_weight, target)
    half = target.shape[0] // 2
    margin = (policy[:half] - ref[:half]) - (policy[half:] - ref[half:])
    return -F.logsigmoid(BETA * margin).mean()


def _liger_dpo():
    from liger_kernel.chunked_loss import LigerFusedLinearDPOLoss

    loss_fn = LigerFusedLinearDPOLoss(beta=BETA, loss_type="sigmoid")
    return lambda x, weight, target, ref_x, ref_weight: loss_fn(weight, x, target, None, ref_x, ref_weight)[0]


def dpo_inputs(shape: dict[str, int], dtype: torch.dtype, device: torch.device) -> Inputs:
    n, t, d, v = 2 * shape["P"], shape["T"], shape["D"], shape["V"]
    x = torch.randn(n, t, d, device=device, dtype=dtype, requires_grad=True)
    weight = (0.02 * torch.randn(v, d, device=device)).to(dtype).requires_grad_()
    ref_x = (x.detach().float() + 0.1 * torch.randn(n, t, d, device=device)).to(dtype)
    ref_weight = (weight.detach().float() + 0.002 * torch.randn(v, d, device=device)).to(dtype)
    target = torch.randint(0, v, (n, t), device=device)
    target[:, : t // 4] = IGNORE_INDEX
    return Inputs(args=(x, weight, target, ref_x, ref_weight), grad_args=(0, 1))


def dpo_floor(shape: dict[str, int], dtype: torch.dtype, mode: str) -> Floor:
    macs = 2 * shape["P"] * shape["T"] * shape["D"] * shape["V"]
    return Floor(flops={"forward": 4 * macs, "backward": 4 * macs, "full": 8 * macs}[mode])


def dpo_floor_peak(shape: dict[str, int], dtype: torch.dtype, mode: str) -> float:
    if mode == "forward":
        return 0.0
    return (2 * shape["P"] * shape["T"] + shape["V"]) * shape["D"] * dtype_size(dtype)  # dX + dW


SPECS = [
    OpSpec(
        name="dpo",
        shape_keys=("P", "T", "D", "V"),
        gpu_shapes=[dict(DPO_TARGET)] + DPO_SWEEP,
        tiny_shapes=[{"P": 2, "T": 8, "D": 32, "V": 301}, {"P": 2, "T": 16, "D": 32, "V": 500}],
        make_inputs=dpo_inputs,
        reference=materialised_dpo,
        liger=_liger_dpo,
        floor=dpo_floor,
        floor_peak_bytes=dpo_floor_peak,
        size=lambda s: 2 * s["P"] * s["T"] * s["D"] * s["V"],
        size_label="2P*T*D*V (multiply-adds per matmul)",
        targets=HEAD_TARGETS,
    ),
]
