"""Cross entropy over logits, and fused linear cross entropy (lm_head matmul + loss).

Cross entropy: logits (N, V), targets (N,) int64. HF's causal-LM loss upcasts the logits
to fp32 and calls ``F.cross_entropy`` (mean over tokens); that is the reference. The liger
loss computes the gradient in the forward pass. It writes it over the logits only where
nothing else can read them (a temporary passed straight in); the harness holds its logits
between calls, so here the gradient goes to a fresh (N, V) buffer, as for any caller that
keeps its logits. s = bytes/element, L = N*V*s.

    forward   read the logits                    L
    backward  read logits (or saved), write grad 2*L
    full      read once, write grad once         2*L   (0.98 ms at N 8192, V 128256, 4.27 TB/s)

A loss that does its gradient work in the forward can show backward "efficiency" > 1 and
forward efficiency <= 0.5; the target is on ``full``.

Fused linear cross entropy: x (N, D), lm_head weight W (V, D), targets (N,). Reference:
``logits = x @ W.T`` (bf16 matmul), upcast, ``F.cross_entropy``. Compute-bound floor at
the matmul rate measured in the same run: forward 2*N*D*V FLOPs, backward 4*N*D*V (dX and
dW), full 6*N*D*V (37.6 ms at N 8192, D 4096, V 128256 and 687 TFLOP/s). Memory floor:
dW + dX, which must exist anyway (1066 MiB at that shape).
"""

from __future__ import annotations

import itertools

import torch

from benchmarks.harness import HEAD_TARGETS, Floor, Inputs, OpSpec, Target, dtype_size

try:
    from liger_kernel.reference.losses import hf_causal_lm_cross_entropy, hf_linear_cross_entropy
except ImportError:
    # The child process that times the upstream release (benchmarks.peers) imports these specs
    # with that release as ``liger_kernel``; it has no ``reference`` module and runs no reference.
    def _reference_unavailable(*args, **kwargs):
        raise RuntimeError("liger_kernel.reference is not importable: the upstream release is on the path")

    hf_causal_lm_cross_entropy = hf_linear_cross_entropy = _reference_unavailable

CE_TARGET = {"N": 8192, "V": 128256}
FLCE_TARGET = {"N": 8192, "D": 4096, "V": 128256}
SWEEP_N = (2048, 8192, 32768)
SWEEP_V = (32000, 128256, 262144)
SWEEP_D = (2048, 4096)


def _sweep(target: dict[str, int], grid: dict[str, tuple[int, ...]]) -> list[dict[str, int]]:
    """The target shape first, then the rest of the grid from small to large."""
    keys = list(target)
    shapes = [dict(zip(keys, values)) for values in itertools.product(*(grid[k] for k in keys))]
    rest = sorted((s for s in shapes if s != target), key=lambda s: _product(s))
    return [dict(target)] + rest


def _product(shape: dict[str, int]) -> int:
    p = 1
    for v in shape.values():
        p *= v
    return p


# --------------------------------------------------------------------------------------
# Cross entropy
# --------------------------------------------------------------------------------------


def _liger_cross_entropy():
    from liger_kernel.transformers.cross_entropy import liger_cross_entropy

    # Defaults: ignore_index=-100, mean, as the reference.
    return lambda logits, target: _loss_only(liger_cross_entropy(logits, target))


def _loss_only(result):
    return result[0] if isinstance(result, tuple) else result


def ce_inputs(shape: dict[str, int], dtype: torch.dtype, device: torch.device) -> Inputs:
    n, v = shape["N"], shape["V"]
    logits = torch.randn(n, v, device=device, dtype=dtype, requires_grad=True)
    target = torch.randint(0, v, (n,), device=device)
    return Inputs(args=(logits, target), grad_args=(0,))


def ce_floor(shape: dict[str, int], dtype: torch.dtype, mode: str) -> Floor:
    logits = shape["N"] * shape["V"] * dtype_size(dtype)
    return Floor(bytes=logits if mode == "forward" else 2 * logits)


# --------------------------------------------------------------------------------------
# Fused linear cross entropy
# --------------------------------------------------------------------------------------


def _liger_fused_linear_cross_entropy():
    from liger_kernel.transformers.fused_linear_cross_entropy import liger_fused_linear_cross_entropy

    # Defaults: ignore_index=-100, mean reduction, as the reference.
    return lambda x, weight, target: _loss_only(liger_fused_linear_cross_entropy(x, weight, target))


def flce_inputs(shape: dict[str, int], dtype: torch.dtype, device: torch.device) -> Inputs:
    n, d, v = shape["N"], shape["D"], shape["V"]
    x = torch.randn(n, d, device=device, dtype=dtype, requires_grad=True)
    # std 0.02, as HF initialises lm_head: logits of std ~0.02*sqrt(D), a realistic spread.
    weight = (0.02 * torch.randn(v, d, device=device)).to(dtype).requires_grad_()
    target = torch.randint(0, v, (n,), device=device)
    return Inputs(args=(x, weight, target), grad_args=(0, 1))


def flce_floor(shape: dict[str, int], dtype: torch.dtype, mode: str) -> Floor:
    macs = shape["N"] * shape["D"] * shape["V"]
    return Floor(flops={"forward": 2 * macs, "backward": 4 * macs, "full": 6 * macs}[mode])


def flce_floor_peak(shape: dict[str, int], dtype: torch.dtype, mode: str) -> float:
    if mode == "forward":
        return 0.0  # only the loss must exist after a forward
    return (shape["N"] + shape["V"]) * shape["D"] * dtype_size(dtype)  # dX + dW


SPECS = [
    OpSpec(
        name="cross_entropy",
        shape_keys=("N", "V"),
        gpu_shapes=_sweep(CE_TARGET, {"N": SWEEP_N, "V": SWEEP_V}),
        tiny_shapes=[{"N": 16, "V": 300}, {"N": 32, "V": 1000}],
        make_inputs=ce_inputs,
        reference=hf_causal_lm_cross_entropy,
        liger=_liger_cross_entropy,
        floor=ce_floor,
        # Overwrite mode: the gradient lives in the logits' buffer; only O(N) must be new.
        floor_peak_bytes=lambda shape, dtype, mode: 0.0,
        size=lambda s: s["N"] * s["V"],
        size_label="N*V logits",
        targets=(Target("full", "efficiency", 0.85), Target("full", "peak_mib", 1.0)),
    ),
    OpSpec(
        name="fused_linear_cross_entropy",
        shape_keys=("N", "D", "V"),
        gpu_shapes=_sweep(FLCE_TARGET, {"N": SWEEP_N, "D": SWEEP_D, "V": SWEEP_V}),
        tiny_shapes=[{"N": 16, "D": 32, "V": 300}, {"N": 32, "D": 32, "V": 500}],
        make_inputs=flce_inputs,
        reference=hf_linear_cross_entropy,
        liger=_liger_fused_linear_cross_entropy,
        floor=flce_floor,
        floor_peak_bytes=flce_floor_peak,
        size=lambda s: s["N"] * s["D"] * s["V"],
        size_label="N*D*V (multiply-adds per matmul)",
        targets=HEAD_TARGETS,
    ),
]
