"""``LigerRMSNorm``: drop-in replacement for Hugging Face RMSNorm layers (Llama, Gemma, ...).

``casting_mode="llama"`` (default) reproduces ``LlamaRMSNorm``;
``LigerRMSNorm(h, offset=1.0, casting_mode="gemma", init_fn="zeros")`` reproduces
``GemmaRMSNorm``. The math and the in-place backward are documented in
:mod:`liger_kernel.ops.rms_norm`. Needs only torch and triton.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from liger_kernel.ops.grad_ownership import hooks_may_see
from liger_kernel.ops.rms_norm import LigerRMSNormFunction, rms_norm_forward
from liger_kernel.transformers.recompute import recomputing, register_recomputable


def norm_eps(module: nn.Module) -> float:
    """The epsilon of a norm module: ``variance_epsilon`` (Llama style), else ``eps`` (Gemma style)."""
    eps = getattr(module, "variance_epsilon", None)
    if eps is None:
        eps = getattr(module, "eps", None)
    if eps is None:
        raise AttributeError(f"{type(module).__name__} has neither a 'variance_epsilon' nor an 'eps' attribute")
    return eps


def norm_in_place(module: nn.Module) -> bool:
    """Whether a norm module's backward may write dx over its output's gradient at this call:
    its ``in_place`` promise (default False), kept only while no hook can see the output or its
    gradient (a forward hook that keeps the output, or registers a tensor hook on it, a backward
    hook on the module; :func:`~liger_kernel.ops.grad_ownership.hooks_may_see`)."""
    return getattr(module, "in_place", False) and not hooks_may_see(module)


def variance_epsilon_alias() -> property:
    """An ``eps`` property reading and writing ``variance_epsilon``, so a norm module answers to
    both names HF norms use for it."""

    def get(self) -> float:
        return self.variance_epsilon

    def set_(self, value: float) -> None:
        self.variance_epsilon = value

    return property(get, set_)


def liger_rms_norm(X: torch.Tensor, W: torch.Tensor, eps: float = 1e-6, offset: float = 0.0,
                   casting_mode: str = "llama", in_place: bool = False) -> torch.Tensor:
    """RMSNorm of ``X`` (..., H) over its last dim, times ``W + offset`` (W of shape (H,)).

    See :mod:`liger_kernel.ops.rms_norm` for the casting modes and ``in_place`` (the caller's
    promise that nothing else reads the output's gradient).
    """
    return LigerRMSNormFunction.apply(X, W, eps, offset, casting_mode, in_place)


def _recompute_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, offset: float, casting_mode: str,
                        in_place: bool) -> torch.Tensor:
    """The forward's output again (bitwise): through the autograd Function under double backward."""
    if torch.is_grad_enabled():
        return LigerRMSNormFunction.apply(x, w, eps, offset, casting_mode, in_place)
    return rms_norm_forward(x, w, float(eps), float(offset), casting_mode)[0]


class LigerRMSNorm(nn.Module):
    """RMSNorm over the last dimension: ``y = x / sqrt(mean(x^2) + eps) * (weight + offset)``.

    Args:
        hidden_size: size H of the last dimension; ``weight`` has shape (H,).
        eps: added to the mean of squares; stored as ``variance_epsilon`` (alias ``eps``).
        offset: added to the weight (1.0 for Gemma, whose weights are stored as w - 1).
        casting_mode: ``"llama"``, ``"gemma"`` or ``"none"`` (see the ops module).
        init_fn: ``"ones"`` or ``"zeros"``, the initial weight.
        in_place: let backward overwrite the output gradient with the input gradient (saves
            one N x H buffer): a promise that nothing else reads that gradient (no residual add
            directly on the output, no caller's ``y.backward(g)``); kept only at calls where no
            hook of the module, nor a global module hook, is registered. Default False.

    ``forward`` reads ``weight``, the eps (``variance_epsilon`` or ``eps``) and, with
    defaults, ``offset``/``casting_mode``/``in_place`` from the instance, so it can also be
    bound onto an HF norm module that has those attributes.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, offset: float = 0.0, casting_mode: str = "llama",
                 init_fn: str = "ones", in_place: bool = False, *, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if init_fn not in ("ones", "zeros"):
            raise ValueError(f"init_fn must be 'ones' or 'zeros', got {init_fn!r}")
        if casting_mode not in ("llama", "gemma", "none"):
            raise ValueError(f"casting_mode must be one of 'gemma', 'llama', 'none', got {casting_mode!r}")
        init = torch.ones if init_fn == "ones" else torch.zeros
        self.weight = nn.Parameter(init(hidden_size, device=device, dtype=dtype))
        self.variance_epsilon = eps
        self.offset = offset
        self.casting_mode = casting_mode
        self.in_place = in_place

    eps = variance_epsilon_alias()

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        args = (hidden_states, self.weight, norm_eps(self), getattr(self, "offset", 0.0),
                getattr(self, "casting_mode", "llama"), norm_in_place(self))
        y = LigerRMSNormFunction.apply(*args)
        if recomputing():
            register_recomputable(y, functools.partial(_recompute_rms_norm, *args), (hidden_states, self.weight))
        return y

    def extra_repr(self) -> str:
        return (f"{tuple(self.weight.shape)}, eps={norm_eps(self)}, offset={getattr(self, 'offset', 0.0)}, "
                f"casting_mode={getattr(self, 'casting_mode', 'llama')!r}, in_place={getattr(self, 'in_place', False)}")


class LigerRMSNormForGemma2(LigerRMSNorm):
    """``Gemma2RMSNorm``: ``(x * rsqrt(mean(x^2) + eps)) * (1 + w)`` in fp32, weight initialised to
    zeros, and an out-of-place backward (Gemma 2's post-norms feed a residual add directly,
    whose branch shares the incoming gradient). The name axolotl imports."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, offset: float = 1.0, casting_mode: str = "gemma",
                 init_fn: str = "zeros", in_place: bool = False, **factory) -> None:
        super().__init__(hidden_size, eps, offset, casting_mode, init_fn, in_place, **factory)


class LigerRMSNormForGemma4(LigerRMSNorm):
    """``Gemma4RMSNorm``: ``(x * rsqrt(mean(x^2) + eps)) * w`` in fp32 (no ``1 +`` offset), weight
    initialised to ones, out-of-place backward. The name axolotl imports.

    ``with_scale=False`` is Gemma 4's scale-free norm (its attention ``v_norm``): no ``weight``
    parameter (and none in the state dict), ``dim`` may be None, and the kernel runs with a unit
    scale of the input's width.
    """

    def __init__(self, dim: int | None, eps: float = 1e-6, offset: float = 0.0, casting_mode: str = "gemma",
                 init_fn: str = "ones", in_place: bool = False, with_scale: bool = True, **factory) -> None:
        if with_scale and dim is None:
            raise ValueError("LigerRMSNormForGemma4 needs dim when with_scale=True")
        super().__init__(dim if with_scale and dim is not None else 0, eps, offset, casting_mode, init_fn, in_place,
                         **factory)
        self.with_scale = with_scale
        if not with_scale:
            del self.weight

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.with_scale:
            return super().forward(hidden_states)
        # offset 0 and a unit weight: the fp32 product by 1 is exact, so this is the plain norm.
        unit = torch.ones(hidden_states.shape[-1], device=hidden_states.device, dtype=torch.float32)
        return LigerRMSNormFunction.apply(hidden_states, unit, norm_eps(self), self.offset, self.casting_mode,
                                          norm_in_place(self))

    def extra_repr(self) -> str:
        if self.with_scale:
            return super().extra_repr()
        return f"with_scale=False, eps={norm_eps(self)}, casting_mode={self.casting_mode!r}"
