"""Gated activations of the MLP, SwiGLU ``silu(a) * b`` and GeGLU ``gelu_tanh(a) * b``.

a (the gate projection) and b (the up projection) are (N, H); the target shape is N 16384,
H 14336 (Llama-3-8B intermediate size). Only the elementwise op is benchmarked: the three
matmuls around it are the same for every provider. s = bytes/element, X = N*H*s.

Floors (minimum bytes moved; the activation is recomputed in the backward, not stored):
    forward   read a, b, write h                  3*X
    backward  read dh, a, b, write da, db         5*X
    full      both                                8*X
The issue's table: SwiGLU full floor 0.88 ms at 4.27 TB/s.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from benchmarks.harness import Floor, Inputs, OpSpec, Target, dtype_size

GPU_SHAPES = [{"N": 16384, "H": 14336}, {"N": 4096, "H": 14336}, {"N": 32768, "H": 14336}]
TINY_SHAPES = [{"N": 16, "H": 96}, {"N": 48, "H": 96}]


def hf_swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``act_fn(gate_proj(x)) * up_proj(x)`` of ``LlamaMLP`` with ``hidden_act="silu"``."""
    return F.silu(a) * b


def hf_geglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``GemmaMLP`` with ``hidden_act="gelu_pytorch_tanh"``."""
    return F.gelu(a, approximate="tanh") * b


def _liger_swiglu():
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction

    return LigerSiLUMulFunction.apply


def _liger_geglu():
    from liger_kernel.ops.geglu import LigerGELUMulFunction

    return LigerGELUMulFunction.apply


def make_inputs(shape: dict[str, int], dtype: torch.dtype, device: torch.device) -> Inputs:
    n, h = shape["N"], shape["H"]
    a = torch.randn(n, h, device=device, dtype=dtype, requires_grad=True)
    b = torch.randn(n, h, device=device, dtype=dtype, requires_grad=True)
    dh = torch.randn(n, h, device=device, dtype=dtype)
    return Inputs(args=(a, b), grad_args=(0, 1), grad_output=dh)


def floor(shape: dict[str, int], dtype: torch.dtype, mode: str) -> Floor:
    x = shape["N"] * shape["H"] * dtype_size(dtype)
    return Floor(bytes={"forward": 3 * x, "backward": 5 * x, "full": 8 * x}[mode])


def floor_peak(shape: dict[str, int], dtype: torch.dtype, mode: str) -> float:
    x = shape["N"] * shape["H"] * dtype_size(dtype)
    return x if mode == "forward" else 2 * x  # h, or da and db


def _spec(name: str, reference, liger) -> OpSpec:
    return OpSpec(
        name=name,
        shape_keys=("N", "H"),
        gpu_shapes=GPU_SHAPES,
        tiny_shapes=TINY_SHAPES,
        make_inputs=make_inputs,
        reference=reference,
        liger=liger,
        floor=floor,
        floor_peak_bytes=floor_peak,
        size=lambda s: s["N"] * s["H"],
        size_label="N*H elements",
        targets=(Target("full", "efficiency", 0.90),),
    )


SPECS = [_spec("swiglu", hf_swiglu, _liger_swiglu), _spec("geglu", hf_geglu, _liger_geglu)]
