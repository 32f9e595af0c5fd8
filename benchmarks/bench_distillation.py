"""Generalised JSD on materialised log-probabilities: liger against the eager torch math and
its torch.compile.

Shapes: student and teacher log-probabilities (N, V), the student's requiring grad; the
target shape is N 8192 (8 sequences x 1024 tokens), V 128256 (Llama 3). The reference is
TRL's ``generalized_jsd_loss`` math (beta 0.5) in fp32, averaged over the rows.
s = bytes per element, L = N*V*s.

Floors (minimum bytes moved):
    forward   read student and teacher             2*L
    backward  write the student's gradient          L   (liger computed it in the forward)
    full      read both, write the gradient        3*L
Peak-memory floor: the student's gradient (N, V), which must exist after a backward.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from benchmarks.harness import Floor, Inputs, OpSpec, Target, dtype_size

BETA = 0.5
JSD_TARGET = {"N": 8192, "V": 128256}
GPU_SHAPES = [JSD_TARGET, {"N": 2048, "V": 32000}, {"N": 4096, "V": 128256}, {"N": 4096, "V": 262144}]
TINY_SHAPES = [{"N": 16, "V": 300}, {"N": 32, "V": 1000}]


def torch_jsd(student_logp: torch.Tensor, teacher_logp: torch.Tensor) -> torch.Tensor:
    """TRL's generalised JSD (beta 0.5) on fp32 upcasts, mean over rows."""
    x, y = student_logp.float(), teacher_logp.float()
    mixture = torch.logsumexp(torch.stack([x + math.log(1.0 - BETA), y + math.log(BETA)]), dim=0)
    divergence = (BETA * F.kl_div(mixture, y, reduction="none", log_target=True)
                  + (1.0 - BETA) * F.kl_div(mixture, x, reduction="none", log_target=True))
    return divergence.sum() / x.shape[0]


def _liger_jsd():
    from liger_kernel.transformers.jsd import liger_jsd

    return lambda student_logp, teacher_logp: liger_jsd(student_logp, teacher_logp, None, BETA)


def jsd_inputs(shape: dict[str, int], dtype: torch.dtype, device: torch.device) -> Inputs:
    n, v = shape["N"], shape["V"]
    student = torch.randn(n, v, device=device).log_softmax(-1).to(dtype).requires_grad_()
    teacher = torch.randn(n, v, device=device).log_softmax(-1).to(dtype)
    return Inputs(args=(student, teacher), grad_args=(0,))


def jsd_floor(shape: dict[str, int], dtype: torch.dtype, mode: str) -> Floor:
    logits = shape["N"] * shape["V"] * dtype_size(dtype)
    return Floor(bytes={"forward": 2, "backward": 1, "full": 3}[mode] * logits)


SPECS = [
    OpSpec(
        name="jsd",
        shape_keys=("N", "V"),
        gpu_shapes=GPU_SHAPES,
        tiny_shapes=TINY_SHAPES,
        make_inputs=jsd_inputs,
        reference=torch_jsd,
        liger=_liger_jsd,
        floor=jsd_floor,
        floor_peak_bytes=lambda shape, dtype, mode: 0.0 if mode == "forward" else
        shape["N"] * shape["V"] * dtype_size(dtype),
        size=lambda s: s["N"] * s["V"],
        size_label="N*V log-probabilities",
        targets=(Target("full", "time_vs", "torch_compile"), Target("full", "peak_vs", "torch_compile")),
        notes="liger computes the gradient in the forward pass (one read of both inputs)",
    ),
]
