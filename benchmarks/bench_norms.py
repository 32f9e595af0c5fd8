"""RMSNorm and LayerNorm: liger against the Hugging Face eager math and its torch.compile.

Shapes: X (N, H), W (H,), B (H,) (LayerNorm); the target shape is N 16384, H 4096 (a
Llama-3-8B layer at batch x sequence 16384). s = bytes per element.

Floors (minimum bytes moved; the reductions over H cost nothing extra):
    forward   read X, write Y                      2*N*H*s  (+ W, B)
    backward  read dY, X, write dX                 3*N*H*s  (+ W read, dW, dB written)
    full      forward + backward                   5*N*H*s  (+ the small terms)
At 4.27 TB/s (H200) the RMSNorm floors are 0.157 ms (full) and 0.063 ms (forward).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from benchmarks.harness import Floor, Inputs, OpSpec, Target, dtype_size

EPS = 1e-6

# The second is the llama-1b end-to-end benchmark (batch 4 x 2048 tokens, hidden 2048).
GPU_SHAPES = [{"N": 16384, "H": 4096}, {"N": 8192, "H": 2048}, {"N": 4096, "H": 4096}, {"N": 65536, "H": 4096}]
TINY_SHAPES = [{"N": 16, "H": 64}, {"N": 48, "H": 64}]


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``LlamaRMSNorm.forward``: normalise in fp32, cast back, then scale."""
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + EPS)
    return weight * h.to(input_dtype)


def hf_layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``nn.LayerNorm.forward`` as HF models call it."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, EPS)


def _liger_rms_norm():
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    # in_place=False: dY is the harness's own tensor, which must survive, so dX is a new
    # buffer. (In a patched model the decoder-layer norms write dX over dY, which nobody else reads.)
    return lambda x, w: LigerRMSNormFunction.apply(x, w, EPS, 0.0, "llama", False)


def _liger_layer_norm():
    from liger_kernel.ops.layer_norm import LigerLayerNormFunction

    # in_place=False, as for RMSNorm: dY is the harness's own tensor.
    return lambda x, w, b: LigerLayerNormFunction.apply(x, w, b, EPS, False)


def _inputs(with_bias: bool):
    def make(shape: dict[str, int], dtype: torch.dtype, device: torch.device) -> Inputs:
        n, h = shape["N"], shape["H"]
        x = torch.randn(n, h, device=device, dtype=dtype, requires_grad=True)
        w = (1.0 + 0.1 * torch.randn(h, device=device)).to(dtype).requires_grad_()
        args = (x, w)
        if with_bias:
            args += ((0.1 * torch.randn(h, device=device)).to(dtype).requires_grad_(),)
        dy = torch.randn(n, h, device=device, dtype=dtype)
        return Inputs(args=args, grad_args=tuple(range(len(args))), grad_output=dy)

    return make


def _floor(n_vectors: int):
    """``n_vectors`` = 1 (W) for RMSNorm, 2 (W, B) for LayerNorm."""

    def floor(shape: dict[str, int], dtype: torch.dtype, mode: str) -> Floor:
        s, rows = dtype_size(dtype), shape["N"] * shape["H"] * dtype_size(dtype)
        vec = shape["H"] * s
        fwd = 2 * rows + n_vectors * vec
        bwd = 3 * rows + vec + n_vectors * vec
        return Floor(bytes={"forward": fwd, "backward": bwd, "full": fwd + bwd}[mode])

    return floor


def _floor_peak(n_vectors: int):
    def floor_peak(shape: dict[str, int], dtype: torch.dtype, mode: str) -> float:
        s = dtype_size(dtype)
        y_or_dx = shape["N"] * shape["H"] * s
        return y_or_dx + (0 if mode == "forward" else n_vectors * shape["H"] * s)

    return floor_peak


def _targets() -> tuple[Target, ...]:
    return (Target("full", "efficiency", 0.85), Target("forward", "efficiency", 0.90))


SPECS = [
    OpSpec(
        name="rms_norm",
        shape_keys=("N", "H"),
        gpu_shapes=GPU_SHAPES,
        tiny_shapes=TINY_SHAPES,
        make_inputs=_inputs(with_bias=False),
        reference=hf_rms_norm,
        liger=_liger_rms_norm,
        floor=_floor(1),
        floor_peak_bytes=_floor_peak(1),
        size=lambda s: s["N"] * s["H"],
        size_label="N*H elements",
        targets=_targets(),
    ),
    OpSpec(
        name="layer_norm",
        shape_keys=("N", "H"),
        gpu_shapes=GPU_SHAPES,
        tiny_shapes=TINY_SHAPES,
        make_inputs=_inputs(with_bias=True),
        reference=hf_layer_norm,
        liger=_liger_layer_norm,
        floor=_floor(2),
        floor_peak_bytes=_floor_peak(2),
        size=lambda s: s["N"] * s["H"],
        size_label="N*H elements",
        targets=_targets(),
    ),
]
