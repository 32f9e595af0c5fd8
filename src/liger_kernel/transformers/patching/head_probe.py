"""The head and loss of a model, proven equal to the one fused-loss forward before it is replaced.

A ``*ForCausalLM`` / ``*ForConditionalGeneration`` forward that takes a decoder's last hidden
states to its ``nn.Linear`` output embedding (``get_output_embeddings()``) - directly, through a
transform child (``self.decoder(self.lm_head(h))``), or inside the head child it calls (BERT's
``self.cls(h)``) - and computes a cross entropy of the logits (``self.loss_function`` or its
own) is a candidate; :func:`probe_head` runs it and the fused forward on a stand-in (a stub
decoder, a small random output embedding) and returns the
:class:`~liger_kernel.transformers.causal_lm.FusedLossSpec` (where the decoder and the head sit,
soft-cap, logit scale, label shift, MoE router loss, output class, extra parameters) when loss,
gradients and logits agree, else why not. A model whose forward hands its labels to a nested
language model (:func:`labelled_language_model`) gets that model's probe instead.
"""

from __future__ import annotations

import copy
import inspect
import re
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn

from liger_kernel.ops.module_attributes import set_attribute
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
    """Stands in for a model's decoder in the head probe: returns fixed outputs, whatever the
    inputs, and records the arguments of each call in ``calls``. Any other attribute the forward
    reads off the decoder (Idefics3's ``text_model``, Falcon-H1's ``lm_head_multiplier``) is the
    real decoder's."""

    def __init__(self, outputs: _StubOutput, vocab: int, hidden: int, real: nn.Module) -> None:
        super().__init__()
        self.outputs = outputs
        self.embed_tokens = nn.Embedding(vocab, hidden)
        # In __dict__, not _modules: the real decoder is no part of the stub's parameters.
        self.__dict__["_real"] = real
        self.__dict__["calls"] = []

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            real = self.__dict__.get("_real")
            if real is None or name.startswith("__"):
                raise
            return getattr(real, name)

    def get_input_embeddings(self) -> nn.Module:
        return self.embed_tokens

    def forward(self, *args: Any, **kwargs: Any) -> _StubOutput:
        self.calls.append((args, kwargs))
        return self.outputs


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_value(a[k], b[k]) for k in a)
    try:
        return a is b or bool(a == b)
    except Exception:  # values that do not compare are taken as different
        return False


def base_class(model: nn.Module) -> type[nn.Module]:
    """``type(model)`` without the per-instance subclasses of a patch."""
    from liger_kernel.transformers.patching.binding import is_instance_class

    cls = type(model)
    while is_instance_class(cls):
        # A per-instance subclass has one base, the module class it patches.
        cls = cast(type[nn.Module], cls.__bases__[0])
    return cls


_HEAD_PROBES: dict[tuple, Any] = {}


def probe_head(model: nn.Module) -> Any:
    """The :class:`~liger_kernel.transformers.causal_lm.FusedLossSpec` whose fused forward
    equals ``model``'s own forward (loss, gradients, logits), or why there is none.

    Structure first (:func:`_layout`): an ``nn.Linear`` output embedding
    (``get_output_embeddings()``) the forward reaches from the decoder's hidden states - called
    itself, after a transform child, or inside the child it calls - a decoder it calls, and a
    loss from ``self.loss_function`` or a cross entropy. Then a probe on a stand-in instance of
    the model's class whose decoder is a stub returning random hidden states and whose output
    embedding is a small random linear scaled so logits reach a soft-cap's range: the model's
    own forward and the fused one must give the same loss and the same gradients of the hidden
    states and the head weight (and the same router loss for MoE). What the source leaves open
    (a soft-cap applied by a module, whether the labels are shifted, whether
    ``num_items_in_batch`` counts) is settled by the probe: the first candidate spec that
    passes it is the one. Cached per class and configuration.
    """
    cls = base_class(model)
    config: Any = model.config  # an HF config, read by attribute
    key = (cls, config.to_json_string(use_diff=False) if hasattr(config, "to_json_string") else id(model))
    if key not in _HEAD_PROBES:
        _HEAD_PROBES[key] = _probe_head_uncached(model, cls)
    return _HEAD_PROBES[key]


def _source(fn: Callable) -> str:
    from liger_kernel.transformers.patching.binding import innermost

    try:
        return inspect.getsource(innermost(fn))
    except (OSError, TypeError):
        return ""


def _module_at(model: nn.Module, path: str) -> nn.Module | None:
    """The submodule at dotted ``path`` through ``_modules`` only (no method or buffer), or None."""
    module: nn.Module | None = model
    for part in path.split("."):
        module = module._modules.get(part) if isinstance(module, nn.Module) else None
        if module is None:
            return None
    return module


def _found_module_at(model: nn.Module, path: str) -> nn.Module:
    """:func:`_module_at` for a ``path`` :func:`_layout` found there."""
    module = _module_at(model, path)
    if module is None:
        raise LookupError(f"{type(model).__name__} has no submodule {path!r}")
    return module


def _head_at(model: nn.Module, path: str) -> nn.Linear:
    """The output embedding at ``path``, which :func:`_layout` accepted as an ``nn.Linear``."""
    head = _found_module_at(model, path)
    if not isinstance(head, nn.Linear):
        raise TypeError(f"the output embedding {path!r} is a {type(head).__name__}, not an nn.Linear")
    return head


def _output_embedding(model: nn.Module) -> nn.Module | None:
    """``model.get_output_embeddings()``, or None for a model without that method."""
    get_output_embeddings = getattr(model, "get_output_embeddings", None)
    return get_output_embeddings() if get_output_embeddings is not None else None


def _called_modules(source: str, model: nn.Module) -> list[str]:
    """Dotted paths of the submodules ``source`` calls as ``self.<path>(``, in order, once each."""
    paths = dict.fromkeys(re.findall(r"\bself\.((?:\w+\.)*\w+)\(", source))
    return [path for path in paths if _module_at(model, path) is not None]


_CROSS_ENTROPY_CALLS = ("self.loss_function(", "CrossEntropyLoss(", "cross_entropy(")


def _layout(model: nn.Module, source: str) -> dict[str, Any] | str:
    """Where the forward's head sits: ``head_path`` (the output embedding's dotted path),
    ``head_transform_attr`` / ``head_call_attr`` (see ``FusedLossSpec``) and ``decoder_attr``;
    or why the fused forward cannot reproduce it."""
    from liger_kernel.transformers.distributed import unwrapped_class

    head = _output_embedding(model)
    if head is None:
        return "it has no output embedding (get_output_embeddings() gives None)"
    head_path = next((name for name, module in model.named_modules() if module is head), None)
    if head_path is None:
        return "its output embedding is not one of its modules"
    if unwrapped_class(head) is not nn.Linear:
        return f"its output embedding is a {type(head).__name__}, not an nn.Linear"
    if not any(call in source for call in _CROSS_ENTROPY_CALLS):
        return "its forward computes no cross entropy (self.loss_function, CrossEntropyLoss, cross_entropy)"
    called = _called_modules(source, model)
    layout: dict[str, Any] = {"head_path": head_path, "head_transform_attr": None, "head_call_attr": None}
    top = head_path.split(".")[0]
    if head_path in called:
        transform = re.search(rf"\bself\.{re.escape(head_path)}\(\s*self\.(\w+)\(", source)
        if transform is not None and transform.group(1) in model._modules:
            layout["head_transform_attr"] = transform.group(1)
    elif top in called and top != head_path:
        layout["head_call_attr"] = top
    else:
        return f"its forward does not call its output embedding {head_path} or a module holding it"
    head_parts = {head_path, top, layout["head_transform_attr"]}
    decoders = [path for path in called if path not in head_parts and not head_path.startswith(path + ".")]
    prefix = decoders[0] if len(decoders) == 1 else getattr(model, "base_model_prefix", "")
    if not decoders and layout["head_call_attr"] and hasattr(_module_at(model, top), "get_output_embeddings"):
        return (f"it takes its logits from its nested language model {top}, which computes them itself "
                "(no decoder whose hidden states the fused loss could take)")
    if not prefix or _module_at(model, prefix) is None:
        return f"no decoder among its children (base_model_prefix {getattr(model, 'base_model_prefix', '')!r})"
    layout["decoder_attr"] = prefix
    return layout


def labelled_language_model(model: nn.Module) -> str | None:
    """The child of ``model`` holding its output embedding that its forward calls with
    ``labels=labels`` (KOSMOS-2.5's ``text_model``): a language model computing the loss itself,
    whose own head probe decides its fused forward; None if there is none."""
    head = _output_embedding(model)
    if head is None:
        return None
    path = next((name for name, module in model.named_modules() if module is head), None)
    top = path.split(".")[0] if path and "." in path else None
    if top is None or not hasattr(model._modules[top], "get_output_embeddings"):
        return None
    source = _source(base_class(model).forward)
    call = re.search(rf"\bself\.{re.escape(top)}\(((?:[^()]|\((?:[^()]|\([^()]*\))*\))*)\)", source)
    return top if call is not None and re.search(r"\blabels\s*=\s*labels\b", call.group(1)) else None


def _probe_head_uncached(model: nn.Module, cls: type[nn.Module]) -> Any:
    import dataclasses
    import itertools

    from liger_kernel.transformers.causal_lm import FusedLossSpec

    source = _source(cls.forward)
    layout = _layout(model, source)
    if isinstance(layout, str):
        return layout
    head_path = layout.pop("head_path")
    head = _head_at(model, head_path)
    text_config = text_config_of(model.config)
    aux = None
    experts_attr = "num_local_experts"
    if "load_balancing_loss_func" in source:
        aux = f"{cls.__module__}:load_balancing_loss_func"
        count = getattr(model, "num_experts", None)
        present = [name for name in _EXPERT_COUNT_ATTRS if isinstance(getattr(text_config, name, None), int)]
        matching = [name for name in present if getattr(text_config, name) == count]
        if not (matching or present or isinstance(count, int)):
            return "a router loss whose expert count is not in the config"
        experts_attr = (matching or present or ["num_experts"])[0]
    coef = re.search(r"\bself(?:\.config)?\.(\w*aux_loss_coef)\b", source)
    base = FusedLossSpec(router_aux_loss_fn=aux, num_experts_attr=experts_attr,
                         aux_loss_coef_attr=coef.group(1) if coef else "router_aux_loss_coef",
                         router_logits_default=_router_logits_default(cls), **layout)
    # Candidates, the source's reading first: the soft-caps and logit scales it names (and the
    # config's final soft-cap, which a module may apply), shifted labels and counted items for
    # self.loss_function (unshifted, a mean, for a cross entropy called directly).
    scales: list[tuple[str | None, bool]] = [(None, False)]
    if head.bias is None:  # (s h) W^T = s (h W^T) only without a bias
        scales = _logit_scales(source, model, text_config) + scales
    hf_loss = [True, False] if "self.loss_function(" in source else [False, True]
    candidates = [dataclasses.replace(base, logit_softcap_attr=softcap, logit_scale_attr=scale, logit_scale_divides=divides,
                                      shifts_labels=shifts, counts_items=counts)
                  for softcap, (scale, divides), shifts, counts
                  in itertools.product(_softcaps(source, text_config), scales, hf_loss, hf_loss)]
    try:
        output_class, spec, error = _compare_heads(model, cls, head_path, candidates, text_config)
    except Exception as failure:  # a forward we cannot run on the probe stays HF's
        return f"its forward failed on the head probe: {type(failure).__name__}: {str(failure)[:120]}"
    if error is not None:
        return error
    return dataclasses.replace(spec, output_class=f"{output_class.__module__}:{output_class.__qualname__}",
                               extra_parameters=_extra_parameters(cls))


def _config_number(config: Any, name: str) -> float | None:
    value = getattr(config, name, None)
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _softcaps(source: str, text_config: Any) -> list[str | None]:
    """The soft-cap attributes to try, in order: those of the text config the forward names
    (``final_logit_softcapping``, ``logits_soft_cap``, ...), none, then the config's final
    soft-cap, which a module the forward calls may apply."""
    named = [name for name in dict.fromkeys(re.findall(r"\bself\.config(?:\.text_config)?\.(\w*soft_?cap\w*)", source))
             if _config_number(text_config, name)]
    after = [_SOFTCAP_ATTR] if _SOFTCAP_ATTR not in named and _config_number(text_config, _SOFTCAP_ATTR) else []
    return [*named, None, *after]


def _logit_scales(source: str, model: nn.Module, text_config: Any) -> list[tuple[str, bool]]:
    """(attribute, whether it divides) of each number the forward multiplies or divides its
    logits or the hidden states before the head by (``logits = ... * self.config.text_config.logit_scale``,
    MiniCPM3's ``hidden_states = hidden_states / self.config.logits_scaling``), a number the
    fused forward can read off the model or its text config; soft-caps are :func:`_softcaps`'."""
    found = []
    for line in re.findall(r"^\s*(?:logits|hidden_states)\s*[*/]?=(.*)$", source, flags=re.MULTILINE):
        for op, name in re.findall(r"([*/])\s*self(?:\.\w+)*\.(\w+)\b(?!\s*\()", line):
            if "cap" in name or (_config_number(model, name) is None and _config_number(text_config, name) is None):
                continue
            found.append((name, op == "/"))
    return list(dict.fromkeys(found))


def _extra_parameters(cls: type[nn.Module]) -> tuple[str, ...]:
    """The named parameters of ``cls.forward`` the fused forward does not name itself."""
    from liger_kernel.transformers.causal_lm import fused_loss_forward

    try:
        theirs = inspect.signature(cls.forward).parameters
    except (TypeError, ValueError):
        return ()
    ours = inspect.signature(fused_loss_forward()).parameters
    return tuple(name for name, p in theirs.items() if name not in ours and name != "self"
                 and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


def _replace_module(root: nn.Module, path: str, module: nn.Module) -> None:
    """Put ``module`` at dotted ``path`` under ``root`` (a stand-in sharing the model's
    children): every parent on the way is a shallow copy with its own children, so the
    model itself is untouched."""
    *parents, leaf = path.split(".")
    owner = root
    for name in parents:
        clone = copy.copy(_found_module_at(owner, name))
        clone._modules = dict(clone._modules)
        owner._modules[name] = clone
        owner = clone
    owner._modules[leaf] = module


def _stand_in(model: nn.Module, cls: type[nn.Module], vocab: int) -> nn.Module:
    """An instance of ``cls`` sharing ``model``'s attributes and children, with a copy of its
    config whose vocabulary is ``vocab``. Another vocabulary size of the config below the
    vocabulary (Inkling's ``unpadded_vocab_size``, a slice of the logits) stays below it."""
    stand_in = cls.__new__(cls)
    nn.Module.__init__(stand_in)
    for name, value in vars(model).items():
        if name not in _MODULE_INTERNALS:
            stand_in.__dict__[name] = value
    stand_in._modules = dict(model._modules)
    config = copy.deepcopy(model.config)
    for target in {id(config): config, id(text_config_of(config)): text_config_of(config)}.values():
        original = getattr(target, "vocab_size", None)
        if not isinstance(original, int):
            continue
        for name, value in list(vars(target).items()):
            if "vocab" in name and type(value) is int and 0 < value < original:
                setattr(target, name, vocab - 1)
        target.vocab_size = vocab
    stand_in.config = config
    if isinstance(getattr(stand_in, "vocab_size", None), int):
        set_attribute(stand_in, "vocab_size", vocab)
    return stand_in


def _compare_heads(model: nn.Module, cls: type[nn.Module], head_path: str, candidates: list, text_config: Any
                   ) -> tuple[type, Any, str | None]:
    """(the forward's output class, the first candidate spec whose fused forward equals the
    model's forward on the stand-in, None), or (..., None, why the first candidate differs)."""
    import dataclasses

    from liger_kernel.transformers.causal_lm import fused_loss_forward

    first = candidates[0]
    real_head = _head_at(model, head_path)
    batch, seq, vocab = 2, 6, 40
    # A transform before the output embedding (the model's own) takes the decoder's width and
    # gives the embedding's; without one any width will do.
    head_width, hidden = 16, 16
    transform = first.head_transform_attr or first.head_call_attr
    if transform:
        head_width = real_head.in_features
        # The width the transform takes: its first linear's (Reformer's head takes both
        # streams, twice the hidden size).
        first_linear = next((m for m in _found_module_at(model, transform).modules() if isinstance(m, nn.Linear)), None)
        hidden = first_linear.in_features if first_linear is not None else getattr(text_config, "hidden_size", head_width)
    generator = torch.Generator().manual_seed(4)
    stand_in = _stand_in(model, cls, vocab)
    softcap = max((_config_number(text_config, c.logit_softcap_attr) or 0.0 for c in candidates if c.logit_softcap_attr),
                  default=None)
    scale = 3.0 * (softcap or 10.0) / head_width ** 0.5
    device = kernel_device(real_head.weight.device)
    head = nn.Linear(head_width, vocab, bias=real_head.bias is not None)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, head_width, generator=generator) * scale / 3.0)
        if head.bias is not None:
            head.bias.copy_(torch.randn(vocab, generator=generator))
    _replace_module(stand_in, head_path, head.to(device))
    hidden_states = torch.randn(batch, seq, hidden, generator=generator).to(device).requires_grad_()
    fields = _StubOutput(last_hidden_state=hidden_states)
    if first.is_moe:
        experts = getattr(model, first.num_experts_attr, None) or getattr(text_config, first.num_experts_attr)
        fields["router_logits"] = tuple(torch.randn(batch * seq, experts, generator=generator).to(device)
                                        for _ in range(2))
    stub = _StubDecoder(fields, vocab, hidden, _found_module_at(model, first.decoder_attr)).to(device)
    _replace_module(stand_in, first.decoder_attr, stub)
    # Not .train(): that would recurse into the children the stand-in shares with the model.
    stand_in.training = True
    # Tokens below vocab - 1, the size a smaller vocabulary of the config gets (_stand_in).
    input_ids = torch.randint(0, vocab - 1, (batch, seq), generator=generator).to(device)
    labels = input_ids.clone()
    labels[0, :2] = -100
    common = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": labels}
    weights = [hidden_states, head.weight]
    references = []
    # 7 items: neither the 9 targets counted with shifted labels nor the 10 without, so a loss
    # that ignores num_items_in_batch is told apart from one dividing by it.
    extras: list[dict[str, Any]] = [{}, {"num_items_in_batch": torch.tensor(7, device=device)}]
    if first.is_moe:  # with the router loss, and as the forward does without the flag
        extras = [{**extra, "output_router_logits": True} for extra in extras] + [{}]
    for extra in extras:
        reference = cls.forward(stand_in, **{**common, **extra})
        references.append((extra, reference, torch.autograd.grad(reference.loss, weights)))
    # The fused forward gives its decoder no labels: a forward whose decoder sees them (an
    # encoder-decoder's decoder_input_ids, shifted from the labels) cannot be reproduced. Its
    # decoder is called alike for other labels, but for the labels themselves, which a
    # multimodal decoder takes and ignores (Gemma 3's).
    with torch.no_grad():
        calls = []
        for other in (labels, torch.randint(0, vocab - 1, labels.shape, generator=generator).to(device)):
            stub.calls.clear()
            cls.forward(stand_in, **{**common, "labels": other})
            calls.append([(args, {k: v for k, v in kwargs.items() if k != "labels"}) for args, kwargs in stub.calls])
    if not _same_value(*calls):
        return type(reference), None, "its decoder's inputs depend on the labels"
    first_error = None
    for spec in candidates:
        error = _compare_fused(stand_in, fused_loss_forward(dataclasses.replace(spec, output_class=None)),
                               common, references, weights)
        if error is None:
            return type(reference), spec, None
        first_error = first_error or error
    return type(reference), None, first_error


def _router_logits_default(cls: type[nn.Module]) -> bool | None:
    """The default of ``cls.forward``'s ``output_router_logits``: a bool fixes what a call without
    it does (the config is then not consulted); None lets the config decide."""
    parameter = inspect.signature(cls.forward).parameters.get("output_router_logits")
    default = None if parameter is None else parameter.default
    return default if isinstance(default, bool) else None


def _compare_fused(stand_in: nn.Module, fused: Callable, common: dict, references: list, weights: list
                   ) -> str | None:
    """Why ``fused`` on ``stand_in`` differs from the references (loss, gradients, logits), or None."""
    for extra, reference, reference_grads in references:
        for skip_logits in (True, False):
            ours = fused(stand_in, **{**common, **extra}, skip_logits=skip_logits)
            equal, error = close_enough(ours.loss, reference.loss)
            if not equal:
                return f"the fused loss differs from its forward's (relative error {error:.1e})"
            for grad, reference_grad, name in zip(torch.autograd.grad(ours.loss, weights), reference_grads,
                                                  ("hidden states", "head weight")):
                equal, error = close_enough(grad, reference_grad)
                if not equal:
                    return f"the fused loss's {name} gradient differs (relative error {error:.1e})"
            if not skip_logits:
                equal, error = close_enough(ours.logits, reference.logits)
                if not equal:
                    return f"its logits differ from lm_head's (relative error {error:.1e})"
    return None
