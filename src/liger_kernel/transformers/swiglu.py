"""SwiGLU MLPs: drop-ins for Hugging Face ``LlamaMLP`` (and Mistral/Qwen2/Qwen3) and ``Phi3MLP``.

Both compute ``down_proj(silu(gate) * up)`` with the gating in one Triton kernel
(:class:`liger_kernel.ops.swiglu.LigerSiLUMulFunction`): silu in fp32, rounded once to the
input dtype, where HF rounds ``silu(gate)`` and the product separately (at most about one
output ulp apart). The backward recomputes silu from the saved gate and up projections and,
with ``in_place=True`` (the default here), writes their gradients over those two temporaries
instead of allocating new ones: the module makes them itself and hands them to nobody, unless a
hook can see them (:func:`gated_in_place`), and then it allocates the gradients. With a plain
``nn.Linear`` down projection the gated product is not saved for the down projection's backward
either (:func:`gated_down_projection`).
Needs only torch and triton.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from liger_kernel.ops.grad_ownership import hooks_may_see
from liger_kernel.ops.swiglu import SILU, LigerGatedDownProjFunction, LigerSiLUMulFunction
from liger_kernel.transformers.distributed import accelerate_hooked, forward_is_wrapped, parameters_on_meta
from liger_kernel.transformers.families import SILU_ACTIVATIONS
from liger_kernel.transformers.recompute import RECOMPUTE_HOOKS, has_only_recompute_hooks


def liger_swiglu(a: torch.Tensor, b: torch.Tensor, in_place: bool = False) -> torch.Tensor:
    """``silu(a) * b`` for ``a``, ``b`` of one shape (..., I) and dtype.

    ``in_place=True`` lets the backward overwrite ``a`` and ``b`` with their gradients: the
    caller's promise that nothing else reads them afterwards (see :mod:`liger_kernel.ops.swiglu`).
    """
    return LigerSiLUMulFunction.apply(a, b, in_place)


def _fusable_linear(module: nn.Module) -> bool:
    """Whether ``module(x)`` is exactly ``F.linear(x, module.weight, module.bias)``: a plain
    ``nn.Linear`` with ordinary tensor parameters and no hooks but the norm-output recompute's
    (which only act on a norm output, never this activation). Anything else (a LoRA or
    quantised layer, a DTensor weight, a hook that gathers or rewrites the weight, another
    forward stored on the instance) keeps its own forward. An accelerate hook whose weights
    are in place (device_map dispatch without offload) only moves the input to the weights'
    device, which the caller checks (:func:`gated_down_projection`); with offload the weights
    are ``meta`` until the hook's pre-forward loads them, so the module is called."""
    if type(module) is not nn.Linear or not has_only_recompute_hooks(module):
        return False
    if forward_is_wrapped(module) and not (accelerate_hooked(module) and not parameters_on_meta(module)):
        return False
    if nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks:
        return False
    plain = (torch.Tensor, nn.Parameter)
    return type(module.weight) in plain and (module.bias is None or type(module.bias) in plain)


def gated_down_projection(down_proj: nn.Module, a: torch.Tensor, b: torch.Tensor, activation: int,
                          in_place: bool) -> torch.Tensor:
    """``down_proj(act(a) * b)`` for a gated MLP (``activation``: ``ops.swiglu.SILU`` or ``GELU_TANH``).

    When ``down_proj`` is a plain ``nn.Linear`` this runs as
    :class:`liger_kernel.ops.swiglu.LigerGatedDownProjFunction`, which does not keep
    ``act(a) * b`` for the backward (one (tokens, intermediate) tensor less per layer, the
    same results); otherwise the gating kernel and ``down_proj``'s own forward.
    """
    if _fusable_linear(down_proj) and down_proj.weight.device == a.device:
        return LigerGatedDownProjFunction.apply(a, b, down_proj.weight, down_proj.bias, activation, in_place)
    if activation == SILU:
        return down_proj(LigerSiLUMulFunction.apply(a, b, in_place))
    from liger_kernel.ops.geglu import LigerGELUMulFunction

    return down_proj(LigerGELUMulFunction.apply(a, b, in_place))


_PROJECTIONS = ("gate_proj", "up_proj", "gate_up_proj")


class ModuleWithChildren(Protocol):
    """A module, or a stand-in for one, as :func:`gated_in_place` reads it: its registered children."""

    _modules: dict[str, nn.Module | None]


def gated_in_place(mlp: ModuleWithChildren) -> bool:
    """Whether a gated MLP's backward may write the gate/up gradients over the gate/up
    activations at this call: its ``in_place`` setting (default True: the activations are
    outputs of its own projections, handed to nobody) while no hook can see them, i.e. no hook
    on a projection but the norm-output recompute's (which never touch them) and no global
    module hook (:func:`~liger_kernel.ops.grad_ownership.hooks_may_see`)."""
    if not getattr(mlp, "in_place", True):
        return False
    for name in _PROJECTIONS:
        projection = mlp._modules.get(name)
        if projection is not None and hooks_may_see(projection, RECOMPUTE_HOOKS):
            return False
    return True


def _check_activation(config: Any, accepted: tuple[str, ...], cls_name: str, attr: str = "hidden_act") -> str:
    activation = getattr(config, attr, None)
    if activation not in accepted:
        raise ValueError(f"{cls_name} computes silu(gate) * up; config.{attr}={activation!r} is not one of {accepted}")
    return activation


def set_mlp_sizes(module: nn.Module, config: Any) -> None:
    """The attributes HF's MLPs keep from their config: ``config``, ``hidden_size`` and
    ``intermediate_size``."""
    module.config = config
    module.hidden_size = config.hidden_size
    module.intermediate_size = config.intermediate_size


class LigerSwiGLUMLP(nn.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))``, a drop-in for HF's ``LlamaMLP``.

    Args:
        config: any config with ``hidden_size``, ``intermediate_size`` and ``hidden_act`` in
            ("silu", "swish"); ``mlp_bias`` (default False) adds biases to the three projections.
        in_place: let the backward write the gate/up gradients over the gate/up activations
            (at calls where no hook can see them, :func:`gated_in_place`).

    Attributes match ``LlamaMLP`` (``config``, ``hidden_size``, ``intermediate_size``,
    ``gate_proj``, ``up_proj``, ``down_proj``), so HF state dicts load unchanged. Raises
    ``ValueError`` for any other activation.
    """

    # Set from the config by set_mlp_sizes, as HF's MLPs keep them.
    hidden_size: int
    intermediate_size: int

    def __init__(self, config: Any, in_place: bool = True) -> None:
        super().__init__()
        _check_activation(config, SILU_ACTIVATIONS, type(self).__name__)
        set_mlp_sizes(self, config)
        bias = bool(getattr(config, "mlp_bias", False))
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=bias)
        self.in_place = in_place

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Attributes are read off ``self`` only, so this forward can be bound onto an HF MLP.
        return gated_down_projection(self.down_proj, self.gate_proj(x), self.up_proj(x), SILU,
                                     gated_in_place(self))


class LigerPhi3SwiGLUMLP(nn.Module):
    """Phi-3's MLP with one fused projection: ``gate, up = gate_up_proj(x).chunk(2, -1)`` (gate first).

    ``down_proj(silu(gate) * up)``. The two halves are passed to the kernel as strided views
    of the fused output, without copying. Attributes: ``config``, ``hidden_size``,
    ``intermediate_size``, ``gate_up_proj`` (hidden -> 2 * intermediate, no bias) and
    ``down_proj`` (no bias), as ``Phi3MLP``. Raises ``ValueError`` unless
    ``config.hidden_act`` is "silu" or "swish".
    """

    # Set from the config by set_mlp_sizes, as HF's MLPs keep them.
    hidden_size: int
    intermediate_size: int

    def __init__(self, config: Any, in_place: bool = True) -> None:
        super().__init__()
        _check_activation(config, SILU_ACTIVATIONS, type(self).__name__)
        set_mlp_sizes(self, config)
        self.gate_up_proj = nn.Linear(self.hidden_size, 2 * self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=False)
        self.in_place = in_place

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(hidden_states).chunk(2, dim=-1)
        return gated_down_projection(self.down_proj, gate, up, SILU, gated_in_place(self))
