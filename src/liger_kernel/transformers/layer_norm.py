"""``LigerLayerNorm``: drop-in replacement for ``torch.nn.LayerNorm`` over the last dimension.

Matches ``torch.nn.functional.layer_norm`` forward and backward; the math is in
:mod:`liger_kernel.ops.layer_norm`. Needs only torch and triton.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from liger_kernel.ops.layer_norm import LigerLayerNormFunction, layer_norm_forward
from liger_kernel.transformers.recompute import recomputing, register_recomputable
from liger_kernel.transformers.rms_norm import norm_eps, norm_in_place, variance_epsilon_alias


def liger_layer_norm(X: torch.Tensor, W: torch.Tensor, B: torch.Tensor | None, eps: float = 1e-6,
                     in_place: bool = False) -> torch.Tensor:
    """LayerNorm of ``X`` (..., H) over its last dim: ``(x - mean) / sqrt(var + eps) * W + B``.

    ``in_place=True``: the backward writes dX over the incoming gradient's storage, the
    caller's promise that nothing else reads that gradient (see :mod:`liger_kernel.ops.layer_norm`).
    """
    return LigerLayerNormFunction.apply(X, W, B, eps, in_place)


def _recompute_layer_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, eps: float,
                          in_place: bool) -> torch.Tensor:
    """The forward's output again (bitwise): through the autograd Function under double backward."""
    if torch.is_grad_enabled():
        return LigerLayerNormFunction.apply(x, w, b, eps, in_place)
    return layer_norm_forward(x, w, b, float(eps))[0]


class LigerLayerNorm(nn.Module):
    """LayerNorm over the last dimension with a learnable ``weight`` (ones) and ``bias`` (zeros).

    Args:
        hidden_size: size H of the last dimension.
        eps: added to the variance; stored as ``variance_epsilon`` (alias ``eps``).
        bias: whether to learn a bias (``self.bias`` is None otherwise).
        in_place: the backward writes dX over the incoming gradient (no N x H buffer): a
            promise that nothing else reads that gradient (see :mod:`liger_kernel.ops.layer_norm`);
            kept only at calls where no hook of the module, nor a global module hook, is
            registered. Default False: the gradient stays intact.

    ``forward`` reads ``weight``, ``bias`` (default None) and the eps (``variance_epsilon``
    or ``eps``), so it can also be bound onto ``nn.LayerNorm`` instances with affine weights.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, bias: bool = True, *, in_place: bool = False,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.in_place = in_place
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        if bias:
            self.bias = nn.Parameter(torch.zeros(hidden_size, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)
        self.variance_epsilon = eps

    eps = variance_epsilon_alias()

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        args = (hidden_states, self.weight, getattr(self, "bias", None), norm_eps(self), norm_in_place(self))
        y = LigerLayerNormFunction.apply(*args)
        if recomputing():
            inputs = tuple(t for t in args[:3] if t is not None)
            register_recomputable(y, functools.partial(_recompute_layer_norm, *args), inputs)
        return y

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={norm_eps(self)}, bias={getattr(self, 'bias', None) is not None}"
