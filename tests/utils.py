"""Shared test helpers: device, shape set, tolerances and comparison against references.

Tolerances: the reference is computed in float64 (or float32 where the op is defined by
a float32 reference such as HF's casting). For fp32 inputs we ask for agreement to a few
float32 ulps scaled by the reduction length. For bf16 (8 mantissa bits, unit roundoff
2**-8 = 3.9e-3) and fp16 (11 bits, 4.9e-4) results are rounded once on output, and the
reference is rounded the same way, so the bound is about one to two output ulps.
"""

from __future__ import annotations

import os

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_shapes = os.environ.get("LIGER_TEST_SHAPES", "full" if DEVICE == "cuda" else "small")
FULL_SHAPES = _shapes == "full"

# (atol, rtol) for outputs compared to a float64 reference rounded to the output dtype.
TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (2e-2, 1.6e-2),
    torch.float16: (2e-3, 2e-3),
}


def tolerance(dtype: torch.dtype, scale: float = 1.0) -> dict:
    atol, rtol = TOLERANCES[dtype]
    return {"atol": atol * scale, "rtol": rtol * scale}


def shapes(small: list, full: list) -> list:
    """The shape list for this run: ``small`` always, plus ``full`` on the full set."""
    return small + (full if FULL_SHAPES else [])


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None,
                 scale: float = 1.0, msg: str = "") -> None:
    dtype = dtype or actual.dtype
    torch.testing.assert_close(
        actual.double(), expected.double(), **tolerance(dtype, scale), msg=lambda m: f"{msg}\n{m}"
    )


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||a - e|| / ||e|| in float64."""
    a, e = actual.double(), expected.double()
    return float((a - e).norm() / e.norm().clamp_min(1e-300))
