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


_INTERPRETER_PROBE = """
import torch, triton, triton.language as tl

@triton.jit
def probe(X, n):
    for i in tl.range(tl.program_id(0), n, tl.num_programs(0)):
        tl.store(X + i, 1.0)

x = torch.zeros(4)
probe[(2,)](x, 4)
assert bool((x == 1).all())
"""


def cpu_interpreter_problem() -> str | None:
    """Why the Triton interpreter cannot run our kernels in a subprocess here, or None.

    On a GPU machine some tests (the CLI's ``--cpu-tiny`` mode, the gloo distributed runs)
    still use the interpreter on CPU. Triton 3.6's interpreter fails with current NumPy 2
    releases on a loop over program ids (it converts a 1-element array with ``int()``);
    CI's newer Triton does not. Probed once, in a subprocess with ``TRITON_INTERPRET=1``.
    """
    global _INTERPRETER_STATUS
    if _INTERPRETER_STATUS is None:
        import subprocess
        import sys

        proc = subprocess.run([sys.executable, "-c", _INTERPRETER_PROBE], capture_output=True, text=True,
                              env=dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES=""), timeout=300)
        tail = (proc.stderr.strip().splitlines() or [""])[-1]
        _INTERPRETER_STATUS = "" if proc.returncode == 0 else f"the Triton CPU interpreter fails here: {tail[:200]}"
    return _INTERPRETER_STATUS or None


_INTERPRETER_STATUS: str | None = None


def target_onehot_coefficients(target, class_weight, upstream, reduction, ignore_index=-100, label_smoothing=0.0):
    """``(safe_target, c)``: each row's target (0 where ignored) and the cross entropy's one-hot
    coefficient ``c_i = |dL/dloss_i| (1 - eps) w_y / D`` (0 for ignored rows; ``D`` the sum of
    counted target weights for the mean, else 1), float64. The fp32 cancellation allowances
    of the cross-entropy tests are multiples of it."""
    counted = target != ignore_index
    safe = torch.where(counted, target, 0)
    w_y = class_weight[safe].double() if class_weight is not None else torch.ones_like(target, dtype=torch.float64)
    w_y = w_y * counted
    coef = upstream.detach().double().abs().expand(target.shape) * (1.0 - label_smoothing) * w_y
    if reduction == "mean":
        coef = coef / (w_y.sum() if counted.any() else 1.0)
    return safe, coef


class ReplayedDropout:
    """An in-place dropout whose mask is drawn once and replayed: the first call runs
    ``F.dropout(y, p, training=True, inplace=True)`` on ``y`` (the op under test's output)
    and records which elements it kept; later calls (on the reference's output) zero the
    same elements and scale the rest by ``1 / (1 - p)`` in place.

    Reseeding before each call does not give the same mask on CUDA: its in-place dropout
    draws the mask with ``bernoulli_`` on a tensor of the edited tensor's dtype, and
    Philox is consumed differently for float32 and float64. The mask is read off the first
    output, so its elements must all be nonzero (else a dropped and a kept zero would look
    alike); random inputs give that, and the check says so if not.
    """

    def __init__(self, p: float = 0.5) -> None:
        self.p = p
        self.kept: torch.Tensor | None = None

    def __call__(self, y: torch.Tensor) -> torch.Tensor:
        if self.kept is None:
            assert bool((y != 0).all()), "the output to drop out has exact zeros: the mask cannot be read off it"
            torch.nn.functional.dropout(y, p=self.p, training=True, inplace=True)
            self.kept = y.detach() != 0
            assert 0 < int(self.kept.sum()) < self.kept.numel(), "the dropout kept all or nothing"
            return y
        return y.mul_(self.kept.to(y.dtype) / (1.0 - self.p))


def forward_backward_with_output_edit(module: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor, edit: str,
                                      steer: torch.Tensor, dropout: ReplayedDropout | None = None
                                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, dx)`` of ``module(x)`` whose output is edited in place before the backward (with
    ``dy``): ``edit`` "hook" adds ``steer`` in a forward hook (activation steering), "dropout"
    applies ``dropout`` in place (one :class:`ReplayedDropout` for the modules compared: the
    same mask for each; the module under test first)."""
    handle = module.register_forward_hook(lambda m, args, out: out.add_(steer)) if edit == "hook" else None
    try:
        x = x.clone().requires_grad_(True)
        y = module(x)
    finally:
        if handle is not None:
            handle.remove()
    if edit == "dropout":
        dropout(y)
    (y * 1).backward(dy)
    return y.detach(), x.grad
