"""The head and loss of a model, proven equal to the one fused-loss forward before it is replaced.

A ``*ForCausalLM`` / ``*ForConditionalGeneration`` forward that computes logits with its output
embedding from the decoder's last hidden states and calls ``self.loss_function`` is a
candidate; :func:`probe_head` runs it and the fused forward on a stand-in (a stub decoder, a
small random head) and returns the :class:`~liger_kernel.transformers.causal_lm.FusedLossSpec`
(soft-cap, MoE router loss, output class, decoder, extra parameters read from the forward and
the config) when loss, gradients and logits agree, else why not.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from liger_kernel.transformers.causal_lm import text_config_of
from liger_kernel.transformers.patching.discovery import close_enough, kernel_device

_MODULE_INTERNALS = frozenset(vars(nn.Module())) | {"forward"}
_EXPERT_COUNT_ATTRS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
_SOFTCAP_ATTR = "final_logit_softcapping"


class _StubOutput(dict):
    """What the stub decoder returns: fields by name (missing ones are None), ``[i]`` over the
    fields that are set, like ``ModelOutput``."""

    __dataclass_fields__: dict = {}

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return self.get(name)

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, (int, slice)):
            return [value for value in self.values() if value is not None][key]
        return dict.__getitem__(self, key)

    def to_tuple(self) -> tuple:
        return tuple(value for value in self.values() if value is not None)


class _StubDecoder(nn.Module):
    """Stands in for a model's decoder in the head probe: returns fixed outputs, whatever the inputs."""

    def __init__(self, outputs: _StubOutput, vocab: int, hidden: int) -> None:
        super().__init__()
        self.outputs = outputs
        self.embed_tokens = nn.Embedding(vocab, hidden)

    def get_input_embeddings(self) -> nn.Module:
        return self.embed_tokens

    def forward(self, *args: Any, **kwargs: Any) -> _StubOutput:
        return self.outputs


def base_class(model: nn.Module) -> type:
    """``type(model)`` without the per-instance subclasses of a patch."""
    from liger_kernel.transformers.patching.binding import is_instance_class

    cls = type(model)
    while is_instance_class(cls):
        cls = cls.__bases__[0]
    return cls


def _head_name(model: nn.Module) -> str | None:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        return None
    return next((name for name, child in model.named_children() if child is head), None)


_HEAD_PROBES: dict[tuple, Any] = {}


def probe_head(model: nn.Module) -> Any:
    """The :class:`~liger_kernel.transformers.causal_lm.FusedLossSpec` whose fused forward
    equals ``model``'s own forward (loss, gradients, logits), or why there is none.

    Structure first: an ``nn.Linear`` output embedding that is a direct child, a decoder under
    ``base_model_prefix``, and a forward that calls the head and ``self.loss_function``. Then a
    probe on a stand-in instance of the model's class whose decoder is a stub returning random
    hidden states and whose head is a small random linear scaled so logits reach a soft-cap's
    range: the model's own forward and the fused one must give the same loss and the same
    gradients of the hidden states and the head weight (and the same router loss for MoE).
    Cached per class and configuration.
    """
    cls = base_class(model)
    key = (cls, model.config.to_json_string(use_diff=False) if hasattr(model.config, "to_json_string") else id(model))
    if key not in _HEAD_PROBES:
        _HEAD_PROBES[key] = _probe_head_uncached(model, cls)
    return _HEAD_PROBES[key]


def _source(fn: Callable) -> str:
    from liger_kernel.transformers.patching.binding import innermost

    try:
        return inspect.getsource(innermost(fn))
    except (OSError, TypeError):
        return ""


def _probe_head_uncached(model: nn.Module, cls: type) -> Any:
    from liger_kernel.transformers.causal_lm import FusedLossSpec
    from liger_kernel.transformers.distributed import unwrapped_class

    head_name = _head_name(model)
    if head_name is None:
        return "no output embedding among its direct children"
    head = getattr(model, head_name)
    if unwrapped_class(head) is not nn.Linear:
        return f"its output embedding is a {type(head).__name__}, not an nn.Linear"
    source = _source(cls.forward)
    if "self.loss_function(" not in source or f"self.{head_name}(" not in source:
        return "its forward does not compute logits with its head and call self.loss_function"
    # The decoder: the one other child the forward calls (``self.model(...)``), else the
    # model's base_model_prefix.
    called = [name for name in model._modules if name != head_name and f"self.{name}(" in source]
    prefix = called[0] if len(called) == 1 else getattr(model, "base_model_prefix", "")
    if prefix not in model._modules:
        return f"no decoder among its children (base_model_prefix {getattr(model, 'base_model_prefix', '')!r})"
    text_config = text_config_of(model.config)
    softcap = _SOFTCAP_ATTR if (_SOFTCAP_ATTR in source and getattr(text_config, _SOFTCAP_ATTR, None)) else None
    aux = None
    experts_attr = "num_local_experts"
    if "load_balancing_loss_func" in source:
        aux = f"{cls.__module__}:load_balancing_loss_func"
        count = getattr(model, "num_experts", None)
        present = [name for name in _EXPERT_COUNT_ATTRS if isinstance(getattr(text_config, name, None), int)]
        matching = [name for name in present if getattr(text_config, name) == count]
        if not (matching or present):
            return "a router loss whose expert count is not in the config"
        experts_attr = (matching or present)[0]
    scale_attr, divides = _logit_scale(source, model, text_config)
    if scale_attr is not None and head.bias is not None:
        return f"its logits are scaled by {scale_attr} and its head has a bias"
    spec = FusedLossSpec(logit_softcap_attr=softcap, router_aux_loss_fn=aux, num_experts_attr=experts_attr,
                         decoder_attr=prefix, logit_scale_attr=scale_attr, logit_scale_divides=divides)
    try:
        output_class, error = _compare_heads(model, cls, head_name, prefix, spec, text_config)
    except Exception as failure:  # noqa: BLE001 - a forward we cannot run on the probe stays HF's
        return f"its forward failed on the head probe: {type(failure).__name__}: {str(failure)[:120]}"
    if error is not None:
        return error
    import dataclasses

    return dataclasses.replace(spec, output_class=f"{output_class.__module__}:{output_class.__qualname__}",
                               extra_parameters=_extra_parameters(cls))


_LOGIT_SCALE_ATTRS = ("logit_scale", "logits_scaling")


def _logit_scale(source: str, model: nn.Module, text_config: Any) -> tuple[str | None, bool]:
    """(the attribute a forward scales its logits by, whether it divides by it), from its source;
    the probe then checks the fused forward does the same."""
    for name in _LOGIT_SCALE_ATTRS:
        for owner in ("self", "self.config"):
            if f"{owner}.{name}" in source and (getattr(model, name, None) is not None
                                                 or getattr(text_config, name, None) is not None):
                return name, f"/ {owner}.{name}" in source
    return None, False


def _extra_parameters(cls: type) -> tuple[str, ...]:
    """The named parameters of ``cls.forward`` the fused forward does not name itself."""
    from liger_kernel.transformers.causal_lm import fused_loss_forward

    try:
        theirs = inspect.signature(cls.forward).parameters
    except (TypeError, ValueError):
        return ()
    ours = inspect.signature(fused_loss_forward()).parameters
    return tuple(name for name, p in theirs.items() if name not in ours and name != "self"
                 and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


def _compare_heads(model: nn.Module, cls: type, head_name: str, prefix: str, spec: Any,
                   text_config: Any) -> tuple[type, str | None]:
    import dataclasses

    from liger_kernel.transformers.causal_lm import fused_loss_forward

    batch, seq, hidden, vocab = 2, 6, 16, 40
    generator = torch.Generator().manual_seed(4)
    stand_in = cls.__new__(cls)
    nn.Module.__init__(stand_in)
    for name, value in vars(model).items():
        if name not in _MODULE_INTERNALS:
            stand_in.__dict__[name] = value
    config = copy.deepcopy(model.config)
    for target in {id(config): config, id(text_config_of(config)): text_config_of(config)}.values():
        if hasattr(target, "vocab_size"):
            target.vocab_size = vocab
    stand_in.config = config
    if isinstance(getattr(stand_in, "vocab_size", None), int):
        stand_in.vocab_size = vocab
    softcap = getattr(text_config_of(config), spec.logit_softcap_attr, None) if spec.logit_softcap_attr else None
    scale = 3.0 * (softcap or 10.0) / hidden ** 0.5
    device = kernel_device(getattr(model, head_name).weight.device)
    head = nn.Linear(hidden, vocab, bias=getattr(model, head_name).bias is not None)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, hidden, generator=generator) * scale / 3.0)
        if head.bias is not None:
            head.bias.copy_(torch.randn(vocab, generator=generator))
    head.to(device)
    stand_in._modules[head_name] = head
    hidden_states = torch.randn(batch, seq, hidden, generator=generator).to(device).requires_grad_()
    fields = _StubOutput(last_hidden_state=hidden_states)
    if spec.is_moe:
        experts = getattr(text_config_of(config), spec.num_experts_attr)
        fields["router_logits"] = tuple(torch.randn(batch * seq, experts, generator=generator).to(device)
                                        for _ in range(2))
    stand_in._modules[prefix] = _StubDecoder(fields, vocab, hidden).to(device)
    stand_in.train()
    input_ids = torch.randint(0, vocab, (batch, seq), generator=generator).to(device)
    labels = input_ids.clone()
    labels[0, :2] = -100
    common = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": labels}
    if spec.is_moe:
        common["output_router_logits"] = True
    fused = fused_loss_forward(dataclasses.replace(spec, output_class=None))
    weights = [hidden_states, head.weight]
    for extra in ({}, {"num_items_in_batch": torch.tensor(9, device=device)}):
        reference = cls.forward(stand_in, **common, **extra)
        reference_grads = torch.autograd.grad(reference.loss, weights)
        for skip_logits in (True, False):
            ours = fused(stand_in, **common, **extra, skip_logits=skip_logits)
            equal, error = close_enough(ours.loss, reference.loss)
            if not equal:
                return type(reference), f"the fused loss differs from its forward's (relative error {error:.1e})"
            for grad, reference_grad, name in zip(torch.autograd.grad(ours.loss, weights), reference_grads,
                                                  ("hidden states", "head weight")):
                equal, error = close_enough(grad, reference_grad)
                if not equal:
                    return type(reference), f"the fused loss's {name} gradient differs (relative error {error:.1e})"
            if not skip_logits:
                equal, error = close_enough(ours.logits, reference.logits)
                if not equal:
                    return type(reference), f"its logits differ from lm_head's (relative error {error:.1e})"
    return type(reference), None
