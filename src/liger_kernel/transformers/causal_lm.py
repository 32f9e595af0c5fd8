"""One fused-loss ``*ForCausalLM.forward`` shared by every patched model family.

In training with labels the language-model head and the cross entropy run as one fused
kernel (:func:`liger_fused_linear_cross_entropy`): the ``(tokens, vocab)`` logits are never
materialised, which is most of the activation memory of a small-to-medium LLM step.

Semantics equal Hugging Face's ``ForCausalLMLoss`` (``transformers/loss/loss_utils.py``):

* labels are shifted left by one and padded with ``ignore_index`` (-100) unless
  ``shift_labels`` is given, which is used as is (already aligned with the positions);
* positions whose label is ``ignore_index`` do not count;
* with ``num_items_in_batch`` the loss is the *sum* over counted tokens divided by it (so
  gradient accumulation over micro-batches reproduces the full-batch mean exactly), without
  it the mean over counted tokens:
  ``loss = sum_t CE(W h_t, y_t) / (num_items_in_batch or #{t : y_t != ignore_index})``;
* ``logits_to_keep`` (int ``k``: the last ``k`` positions, 0 = all; a 1-D tensor of positions;
  with transformers versions that have ``slice_logits_to_keep``, also a 2-D (B, k) tensor of
  positions per row or a (B, T) boolean mask) selects the positions whose logits (and loss)
  are computed, exactly as the installed HF forward does
  (:func:`~liger_kernel.transformers.hf_versions.positions_to_keep`);
* a batch whose targets are all ``ignore_index`` gives loss 0 with zero gradients, on the
  fused and on the logits path alike (the library's convention for a mean over no targets;
  HF's loss gives NaN there);
* a family's final-logit soft-cap (Gemma 2: ``logits = c * tanh(logits / c)``) is applied
  inside the fused loss, and to returned logits;
* a mixture-of-experts family adds ``router_aux_loss_coef * aux`` where ``aux`` is the
  modeling module's load-balancing loss of the router logits (``output_router_logits``).

Where the model's own forward differs, :class:`FusedLossSpec` says how (its head probe proved
it): labels taken unshifted and ``num_items_in_batch`` ignored (BART-style decoders calling
``CrossEntropyLoss``), logits scaled by a constant, a decoder at a nested path, a transform or
head module run before the output embedding (BERT's ``cls``, ModernBERT's ``lm_head``).

The forward is built per :class:`FusedLossSpec` (:func:`fused_loss_forward`): the family's
soft-cap attribute and router loss, and whether the norm outputs are recomputed. With
``recompute_norm_outputs`` the decoder runs inside
:func:`liger_kernel.transformers.recompute.recompute_norm_outputs`: the norm outputs the
projections save are recomputed in backward instead of kept (same values, less memory); the
patch installs the consumer hooks this needs
(:func:`~liger_kernel.transformers.recompute.hook_norm_consumers`) when it patches. Under
autocast that casts the residual stream's dtype (the HF Trainer's ``bf16=True`` over fp32
weights) the projections save their own casts instead, so the context is not entered there:
it would only spend host time on its hooks.

Logits are returned when asked (``skip_logits=False``) and by default whenever the model is
not training or has no labels - evaluation, ``generate()``. The loss then comes from the
model's own ``self.loss_function`` on those logits, exactly as the unpatched forward does
(except that a mean over all-ignored targets is 0, not NaN, as above).

This module imports ``transformers`` only lazily.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import logging
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F

from liger_kernel.ops.head_epilogue import transform_logits
from liger_kernel.transformers.distributed import (
    accelerate_hooked,
    call_with_full_parameters,
    forward_is_wrapped,
    unwrapped_class,
)
from liger_kernel.transformers.hf_versions import (
    cache_kwarg_name,
    hf_slice_logits_to_keep,
    output_cache_field,
    positions_to_keep,
)
from liger_kernel.transformers.patching.binding import set_recipe
from liger_kernel.transformers.recompute import autocast_recasts, recompute_norm_outputs

if TYPE_CHECKING:
    from transformers import PreTrainedModel

IGNORE_INDEX = -100

logger = logging.getLogger(__name__)
_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        logger.warning(message)


def shift_causal_labels(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """``labels`` (B, T) -> (B, T) targets for next-token prediction: ``out[:, t] = labels[:, t + 1]``,
    the last position ``ignore_index`` (HF pads before shifting)."""
    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:]


def causal_targets(labels: torch.Tensor | None, shift_labels: torch.Tensor | None, ignore_index: int) -> torch.Tensor:
    """The (B, T) targets of the positions: ``shift_labels`` as given, else ``labels`` shifted."""
    if shift_labels is not None:
        return shift_labels
    if labels is None:
        raise ValueError("the loss needs `labels` or `shift_labels`")
    return shift_causal_labels(labels, ignore_index)


def divide_by_items(loss: torch.Tensor, num_items_in_batch: torch.Tensor | int) -> torch.Tensor:
    """``loss / num_items_in_batch`` (a tensor count moved to the loss's device first)."""
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


def liger_causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor | None,
    vocab_size: int,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = IGNORE_INDEX,
    shift_labels: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """HF's ``ForCausalLMLoss`` on materialised logits, with the Liger cross-entropy kernel.

    ``logits`` (B, T, V) in any float dtype (the kernel accumulates in fp32, as HF's upcast
    does), ``labels`` (B, T) int. Installed as the model's ``loss_function`` by
    ``cross_entropy=True``; extra keyword arguments are accepted and ignored like HF's.
    """
    from liger_kernel.transformers.cross_entropy import liger_cross_entropy

    targets = causal_targets(labels, shift_labels, ignore_index)
    reduction = "sum" if num_items_in_batch is not None else "mean"
    # No z-loss or accuracy asked for: the loss alone, a tensor.
    loss = cast(torch.Tensor, liger_cross_entropy(
        logits.reshape(-1, vocab_size),
        targets.reshape(-1).to(logits.device),
        ignore_index=ignore_index,
        reduction=reduction,
        # The logits are also returned to the caller: the kernel must not overwrite them.
        in_place=False,
        loss_dtype=torch.float32,  # HF upcasts the logits, so its loss is float32
    ))
    if num_items_in_batch is not None:
        loss = divide_by_items(loss, num_items_in_batch)
    return loss


def _zero_if_nothing_counted(loss: torch.Tensor, targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """``loss``, or 0 when none of the (B, T) ``targets`` is counted: the library's convention
    for a mean over all-ignored targets (the fused path's value), where HF's loss divides 0 by 0 (NaN).

    ``torch.where`` keeps the graph (the gradient is zero, no NaN: every row is ignored) and
    needs no device sync, so it also traces under ``torch.compile``.
    """
    counted = (targets != ignore_index).any().to(loss.device)
    return torch.where(counted, loss, torch.zeros_like(loss))


@dataclasses.dataclass(frozen=True)
class FusedLossSpec:
    """What the fused-loss forward of one model needs beyond the model itself.

    Attributes:
        logit_softcap_attr: config attribute of a final-logit tanh soft-cap
            (``logits = c * tanh(logits / c)``; Gemma 2's ``final_logit_softcapping``), None if none.
        router_aux_loss_fn: ``"module:function"`` of the router load-balancing loss a
            mixture-of-experts model adds (``router_aux_loss_coef * aux``) when router logits
            are asked; None for a dense model.
        num_experts_attr: attribute holding the number of experts that loss takes.
        recompute_norm_outputs: run the decoder inside the norm-output recompute context.
        output_class: ``"module:Class"`` of the model's own output (e.g. a vision-language
            model's, with its image hidden states); its fields not computed here are taken from
            the decoder's outputs by name. None: ``CausalLMOutputWithPast`` (``Moe...`` for MoE).
        logit_scale_attr: a constant the logits are multiplied by (Cohere's ``logit_scale``) or,
            with ``logit_scale_divides``, divided by (Granite's ``logits_scaling``): read off the
            model, else its text config. The fused loss scales the hidden states instead
            (``(s h) W^T = s (h W^T)``; only for a head without bias).
        decoder_attr: the (dotted) path of the decoder the forward calls (``model``, OPT's
            ``model.decoder``); None: the model's ``base_model_prefix``.
        head_transform_attr: a child the forward applies to the decoder's hidden states before the
            output embedding (ModernBERT's ``self.decoder(self.lm_head(h))``); None if none.
        head_call_attr: the child the forward calls on the hidden states when the output embedding
            sits inside it (BERT's ``cls`` holding ``cls.predictions.decoder`` after a transform):
            the fused loss runs it up to the output embedding and takes that embedding's input.
        shifts_labels: whether the forward shifts the labels (HF's causal-LM loss); False when
            ``labels[:, t]`` is already the target of position ``t`` (BART-style decoders).
        counts_items: whether ``num_items_in_batch`` divides the summed loss (False: the forward's
            loss is always the mean over counted targets).
        aux_loss_coef_attr: the attribute (of the model, else its text config) holding the router
            loss coefficient.
        router_logits_default: what a call that gives no ``output_router_logits`` does, where the
            forward's signature fixes it (JetMoE's ``False`` in some transformers releases); None:
            the config's ``output_router_logits`` decides, as in most MoE forwards.
        extra_parameters: names the model's own forward takes besides the standard ones
            (``pixel_values``, ``image_sizes``, ...): listed in the fused forward's signature
            (the Trainer keeps only dataset columns a forward names) and passed to the decoder.

    Config attributes are read from the text config (``config.get_text_config()``, the config
    itself for a causal LM); the logit scale, the expert count, the experts per token and the
    router loss coefficient from the model first where it holds them (DBRX's ``num_experts``).
    """

    logit_softcap_attr: str | None = None
    router_aux_loss_fn: str | None = None
    num_experts_attr: str = "num_local_experts"
    recompute_norm_outputs: bool = False
    output_class: str | None = None
    extra_parameters: tuple[str, ...] = ()
    decoder_attr: str | None = None
    logit_scale_attr: str | None = None
    logit_scale_divides: bool = False
    head_transform_attr: str | None = None
    head_call_attr: str | None = None
    shifts_labels: bool = True
    counts_items: bool = True
    aux_loss_coef_attr: str = "router_aux_loss_coef"
    router_logits_default: bool | None = None

    @property
    def is_moe(self) -> bool:
        return self.router_aux_loss_fn is not None


# ``"module:attribute"`` -> the object, imported once: :func:`fused_loss_forward` resolves a
# spec's names when it builds the forward, so the forward itself only reads this dict (an
# import is a graph break under torch.compile).
_QUALIFIED: dict[str, Any] = {}


def _qualified(name: str):
    """The object ``"module:attribute"`` names."""
    if name not in _QUALIFIED:
        module, attribute = name.split(":")
        value = importlib.import_module(module)
        for part in attribute.split("."):
            value = getattr(value, part)
        _QUALIFIED[name] = value
    return _QUALIFIED[name]


def text_config_of(config):
    """The text (decoder) config of ``config``: itself for a causal LM, ``text_config`` for most
    vision-language models."""
    get_text_config = getattr(config, "get_text_config", None)
    return get_text_config() if callable(get_text_config) else config


def _fused_lm_head_loss(
    lm_head: torch.nn.Linear, hidden: torch.Tensor, targets: torch.Tensor, **kwargs: Any
) -> torch.Tensor:
    """Fused linear cross entropy of ``hidden`` (N, H) through ``lm_head`` (``weight`` (V, H), ``bias``)."""
    from liger_kernel.transformers.fused_linear_cross_entropy import liger_fused_linear_cross_entropy

    # No z-loss or accuracy asked for: the loss alone, a tensor.
    return cast(torch.Tensor,
                liger_fused_linear_cross_entropy(hidden, lm_head.weight, targets, bias=lm_head.bias, **kwargs))


def _model_or_config(model: PreTrainedModel, text_config: Any, name: str) -> Any:
    """``model.<name>``, else ``text_config.<name>`` (a forward reads a constant off either)."""
    value = getattr(model, name, None)
    return getattr(text_config, name) if value is None else value


def _input_embedding_weight(model: PreTrainedModel) -> torch.Tensor | None:
    """The input embedding's weight, or None where HF cannot name the input embedding (a
    composite model that does not override ``get_input_embeddings``)."""
    try:
        return getattr(model.get_input_embeddings(), "weight", None)
    except NotImplementedError:
        return None


class _OutputEmbeddingReached(Exception):
    """Raised by the pre-hook of :func:`output_embedding_input` with the embedding's input."""

    def __init__(self, features: torch.Tensor) -> None:
        super().__init__()
        self.features = features


def output_embedding_input(head: torch.nn.Module, output_embedding: torch.nn.Module,
                           hidden_states: torch.Tensor) -> torch.Tensor:
    """What ``head(hidden_states)`` passes to ``output_embedding``, a module inside ``head``
    (BERT's ``cls`` runs a dense/activation/norm transform, then ``cls.predictions.decoder``).

    The run stops at the embedding's call, before its logits are computed: a forward pre-hook
    raises with the embedding's input, which keeps its autograd graph through the transform.
    The hook runs before any other (``prepend``): an FSDP or accelerate pre-forward does not
    gather a weight the aborted call never uses.
    """
    def stop(module: torch.nn.Module, args: tuple) -> None:
        raise _OutputEmbeddingReached(args[0])

    handle = output_embedding.register_forward_pre_hook(stop, prepend=True)
    try:
        head(hidden_states)
    except _OutputEmbeddingReached as reached:
        return reached.features
    finally:
        handle.remove()
    raise ValueError(f"{type(head).__name__} never called its output embedding {type(output_embedding).__name__}")


@dataclasses.dataclass
class ForwardInputs:
    """The loss-only arguments of one forward call, normalised (what the decoder is not given).

    ``labels`` (B, T) are shifted by the loss; ``shift_labels`` (B, T) are the targets as
    they are (a forward whose spec does not shift labels gets its labels here).
    ``num_items_in_batch`` divides the summed loss (None: the mean over counted targets).
    """

    labels: torch.Tensor | None
    shift_labels: torch.Tensor | None
    num_items_in_batch: torch.Tensor | int | None
    ignore_index: int
    return_dict: bool
    past_key_values: Any

    @property
    def has_targets(self) -> bool:
        return self.labels is not None or self.shift_labels is not None


def forward_inputs(config: Any, spec: FusedLossSpec, labels: torch.Tensor | None, past_key_values: Any,
                   kwargs: dict[str, Any]) -> ForwardInputs:
    """Step 1: take the loss-only keywords out of ``kwargs`` (what stays goes to the decoder).

    ``return_dict`` defaults to the config's; ``num_items_in_batch`` is dropped for a forward
    that does not count items; 5.24's ``generate()`` passes the KV cache as ``cache``.
    """
    return_dict = kwargs.pop("return_dict", None)
    num_items_in_batch = kwargs.pop("num_items_in_batch", None)
    shift_labels = kwargs.pop("shift_labels", None)
    ignore_index = kwargs.pop("ignore_index", IGNORE_INDEX)
    cache = kwargs.pop("cache", None)
    if shift_labels is None and labels is not None and not spec.shifts_labels:
        # The forward takes labels already aligned with the positions: they are the targets.
        shift_labels, labels = labels, None
    return ForwardInputs(
        labels=labels,
        shift_labels=shift_labels,
        num_items_in_batch=num_items_in_batch if spec.counts_items else None,
        ignore_index=ignore_index,
        return_dict=getattr(config, "return_dict", True) if return_dict is None else return_dict,
        past_key_values=cache if past_key_values is None else past_key_values,
    )


def router_logits_wanted(spec: FusedLossSpec, config: Any, requested: bool | None) -> bool:
    """Whether a mixture-of-experts decoder returns router logits: as the call asks, else the
    forward's own default where its signature fixes one, else the config's (or its text config's)."""
    if requested is None:
        requested = spec.router_logits_default
    if requested is None:
        requested = getattr(config, "output_router_logits", None)
    if requested is None:
        requested = getattr(text_config_of(config), "output_router_logits", False)
    return bool(requested)


def _recompute_wanted(model: PreTrainedModel, spec: FusedLossSpec, input_ids: torch.Tensor | None,
                      inputs_embeds: torch.Tensor | None) -> bool:
    """Whether the decoder runs inside the norm-output recompute context: asked for, with
    gradients, not compiling, and not under autocast that casts the residual stream (the
    projections then save casts of the norm outputs: nothing to recompute)."""
    if not (spec.recompute_norm_outputs and torch.is_grad_enabled() and not torch.compiler.is_compiling()):
        return False
    # The residual stream's dtype is the embeddings'; its device the inputs' (offloaded
    # embedding weights sit on the meta device until their hook loads them).
    residual = inputs_embeds if inputs_embeds is not None else _input_embedding_weight(model)
    placed = inputs_embeds if inputs_embeds is not None else input_ids
    if isinstance(residual, torch.Tensor) and isinstance(placed, torch.Tensor):
        return not autocast_recasts(placed.device.type, residual.dtype)
    return True


def decoder_outputs(model: PreTrainedModel, spec: FusedLossSpec, past_key_values: Any, **inputs: Any) -> Any:
    """Step 2: the decoder's outputs (``return_dict=True``) for ``inputs`` (``input_ids``,
    ``attention_mask``, ``position_ids``, ``inputs_embeds``, ``use_cache`` and whatever else
    the caller passed), the KV cache under the name the installed decoder takes."""
    base_model = model.get_submodule(spec.decoder_attr or model.base_model_prefix)
    inputs[cache_kwarg_name(type(base_model))] = past_key_values
    recompute = _recompute_wanted(model, spec, inputs.get("input_ids"), inputs.get("inputs_embeds"))
    with recompute_norm_outputs(recompute):
        return base_model(return_dict=True, **inputs)


def head_features(model: PreTrainedModel, spec: FusedLossSpec, last_hidden_state: torch.Tensor,
                  logits_to_keep: int | torch.Tensor) -> tuple[torch.Tensor, torch.nn.Module, Any]:
    """Step 3: ``(features, lm_head, logits_head)``: the input of the output embedding ``lm_head``
    at the kept positions, and what gives the logits on the unfused path (the output embedding,
    or, while compiling, the head module holding it: the stop hook of
    :func:`output_embedding_input` cannot be traced)."""
    features = positions_to_keep(last_hidden_state, logits_to_keep)
    lm_head = model.get_output_embeddings()
    logits_head = lm_head
    if spec.head_transform_attr is not None:
        features = getattr(model, spec.head_transform_attr)(features)
    elif spec.head_call_attr is not None and torch.compiler.is_compiling():
        logits_head = getattr(model, spec.head_call_attr)
    elif spec.head_call_attr is not None:
        features = output_embedding_input(getattr(model, spec.head_call_attr), lm_head, features)
    return features, lm_head, logits_head


def may_fuse(lm_head: torch.nn.Module, logits_head: Any, skip_logits: bool) -> bool:
    """Whether the fused kernel computes what ``logits_head`` would: it reads ``lm_head.weight``
    and ``bias`` directly, so a wrapped head (a PEFT LoRA or ``modules_to_save`` wrapper, a
    quantised linear) or one whose forward something other than accelerate replaced on the
    instance gets the exact unfused path (with a warning once, when logits were to be skipped).
    An accelerate hook is kept (the loss runs inside it); ``fully_shard``'s FSDPLinear is a
    linear."""
    is_linear = unwrapped_class(lm_head) is torch.nn.Linear
    replaced = forward_is_wrapped(lm_head) and not accelerate_hooked(lm_head)
    if skip_logits and not is_linear:
        _warn_once(f"lm_head is a {type(lm_head).__name__}, not an nn.Linear: computing the loss from logits.")
    elif skip_logits and replaced:
        _warn_once("lm_head's forward is replaced on the instance (not by an accelerate hook): "
                   "computing the loss from logits.")
    return is_linear and not replaced and logits_head is lm_head


@dataclasses.dataclass(frozen=True)
class LogitTransform:
    """What the model does to ``features @ W^T`` before its loss: multiply by ``scale``, then
    soft-cap (``c * tanh(z / c)``); None: not at all."""

    scale: float | None = None
    softcap: float | None = None

    @classmethod
    def of(cls, model: PreTrainedModel, spec: FusedLossSpec) -> LogitTransform:
        text_config = text_config_of(model.config)
        softcap = getattr(text_config, spec.logit_softcap_attr, None) if spec.logit_softcap_attr else None
        scale = None
        if spec.logit_scale_attr is not None:
            scale = _model_or_config(model, text_config, spec.logit_scale_attr)
            scale = 1.0 / scale if spec.logit_scale_divides else scale
        return cls(scale, softcap)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        return transform_logits(logits, 1.0 if self.scale is None else self.scale, self.softcap, 1.0)


def fused_loss(lm_head: torch.nn.Module, features: torch.Tensor, inputs: ForwardInputs,
               transform: LogitTransform, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    """Step 4, fused: the loss of ``features`` (B, kept, H) (or (num_true, H) for a boolean
    ``logits_to_keep``) through ``lm_head`` without materialising the logits. Raises
    ``ValueError`` when the targets do not match the kept positions."""
    shift_labels = causal_targets(inputs.labels, inputs.shift_labels, inputs.ignore_index)
    kept = features.shape[:-1]
    # (batch, positions) targets for (batch, positions) kept; a boolean logits_to_keep
    # mask keeps (num_true,) rows, matched like HF's loss does: by the flattened count.
    if shift_labels.shape != kept and not (len(kept) == 1 and shift_labels.numel() == kept[0]):
        raise ValueError(
            f"labels/shift_labels of shape {tuple(shift_labels.shape)} do not match the "
            f"{tuple(kept)} positions kept by logits_to_keep={logits_to_keep!r}"
        )
    # Under FSDP2 (lm_head sharded on its own), DeepSpeed ZeRO-3 or accelerate offload the
    # weight is only materialised inside lm_head's own call: run the fused loss as that call.
    # The scale is applied to the features instead of the logits: (s h) W^T = s (h W^T).
    scaled = features if transform.scale is None else features * transform.scale
    loss = call_with_full_parameters(
        lm_head,
        _fused_lm_head_loss,
        scaled.reshape(-1, scaled.shape[-1]),
        shift_labels.reshape(-1).to(features.device),
        ignore_index=inputs.ignore_index,
        reduction="sum" if inputs.num_items_in_batch is not None else "mean",
        softcap=transform.softcap,
    )
    if inputs.num_items_in_batch is not None:
        loss = divide_by_items(loss, inputs.num_items_in_batch)
    return loss


def loss_from_logits(model: PreTrainedModel, logits: torch.Tensor, inputs: ForwardInputs) -> torch.Tensor:
    """Step 4, unfused: the model's own ``loss_function`` on ``logits`` (0 for a mean over no
    counted target, as on the fused path).

    The targets are shifted once, here, and given to the loss as ``shift_labels`` (which HF's
    ``ForCausalLMLoss`` uses as they are); ``labels`` go along for a loss that takes only them.
    """
    # contiguous: HF's loss flattens shift_labels with .view(-1).
    targets = causal_targets(inputs.labels, inputs.shift_labels, inputs.ignore_index).contiguous()
    loss = model.loss_function(logits=logits, labels=inputs.labels, vocab_size=text_config_of(model.config).vocab_size,
                               num_items_in_batch=inputs.num_items_in_batch, ignore_index=inputs.ignore_index,
                               shift_labels=targets)
    if inputs.num_items_in_batch is None:
        loss = _zero_if_nothing_counted(loss, targets, inputs.ignore_index)
    return loss


def model_output(model: PreTrainedModel, spec: FusedLossSpec, outputs: Any, loss: torch.Tensor | None,
                 logits: torch.Tensor | None, router_logits: bool, attention_mask: torch.Tensor | None) -> Any:
    """Step 5: the model's output object from the loss, the logits and the decoder's outputs:
    ``CausalLMOutputWithPast`` (``Moe...`` with the router loss added for a mixture of experts),
    or the spec's own output class with its other fields taken from the decoder's outputs."""
    from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

    fields: dict[str, Any] = {
        "loss": loss,
        "logits": logits,
        # Not every decoder has them (a state-space model's outputs have no attentions).
        "hidden_states": getattr(outputs, "hidden_states", None),
        "attentions": getattr(outputs, "attentions", None),
    }
    output_class = MoeCausalLMOutputWithPast if spec.is_moe else CausalLMOutputWithPast
    if spec.output_class is not None:
        output_class = _qualified(spec.output_class)
    if spec.is_moe:
        fields.update(_router_loss_fields(model, spec, outputs, loss, router_logits, attention_mask))
    fields[output_cache_field(output_class)] = getattr(outputs, output_cache_field(type(outputs)), None)
    if spec.output_class is not None:
        # The model's own output fields (image hidden states, rope deltas, ...) come from the decoder's.
        declared = output_class.__dataclass_fields__
        fields = {name: fields[name] if name in fields else getattr(outputs, name, None) for name in declared}
    return output_class(**fields)


def _router_loss_fields(model: PreTrainedModel, spec: FusedLossSpec, outputs: Any, loss: torch.Tensor | None,
                        router_logits: bool, attention_mask: torch.Tensor | None) -> dict[str, Any]:
    """``loss`` (plus ``router_aux_loss_coef * aux`` when router logits were asked), ``aux_loss``
    and ``router_logits`` of a mixture-of-experts output."""
    aux_loss = None
    if router_logits and spec.router_aux_loss_fn is not None:  # a mixture of experts names its loss
        text_config = text_config_of(model.config)
        aux_loss = _qualified(spec.router_aux_loss_fn)(
            outputs.router_logits, _model_or_config(model, text_config, spec.num_experts_attr),
            _model_or_config(model, text_config, "num_experts_per_tok"),
            attention_mask,
        )
        if loss is not None:
            coef = _model_or_config(model, text_config, spec.aux_loss_coef_attr)
            loss = loss + coef * aux_loss.to(loss.device)
    return {"loss": loss, "aux_loss": aux_loss, "router_logits": outputs.router_logits}


def _fused_loss_forward(
    self,
    spec: FusedLossSpec,
    input_ids: torch.LongTensor | None = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.LongTensor | None = None,
    past_key_values=None,
    inputs_embeds: torch.Tensor | None = None,
    labels: torch.LongTensor | None = None,
    use_cache: bool | None = None,
    logits_to_keep: int | torch.Tensor = 0,
    skip_logits: bool | None = None,
    **kwargs: Any,
):
    """The body of every forward :func:`fused_loss_forward` builds (arguments documented there):
    the five steps, each a function of this module."""
    inputs = forward_inputs(self.config, spec, labels, past_key_values, kwargs)
    router_logits = False
    requested_router_logits = kwargs.pop("output_router_logits", None)
    if spec.is_moe:
        router_logits = kwargs["output_router_logits"] = router_logits_wanted(spec, self.config,
                                                                              requested_router_logits)
    outputs = decoder_outputs(self, spec, inputs.past_key_values, input_ids=input_ids, attention_mask=attention_mask,
                              position_ids=position_ids, inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
    features, lm_head, logits_head = head_features(self, spec, outputs.last_hidden_state, logits_to_keep)
    if skip_logits is None:
        skip_logits = self.training and inputs.has_targets
    if skip_logits and not inputs.has_targets:
        raise ValueError("skip_logits=True needs `labels` or `shift_labels` to compute the loss from.")
    transform = LogitTransform.of(self, spec)
    loss = logits = None
    if skip_logits and may_fuse(lm_head, logits_head, skip_logits):
        loss = fused_loss(lm_head, features, inputs, transform, logits_to_keep)
    else:
        logits = transform(logits_head(features))
        if inputs.has_targets:
            loss = loss_from_logits(self, logits, inputs)
        if skip_logits:
            logits = None
    output = model_output(self, spec, outputs, loss, logits, router_logits, attention_mask)
    return output if inputs.return_dict else output.to_tuple()


def fused_loss_forward(spec: FusedLossSpec = FusedLossSpec()):
    """The fused-loss ``*ForCausalLM.forward`` for ``spec`` (one function per spec, cached).

    Arguments are those of the HF forward (``input_ids`` (B, T), ``labels`` (B, T), ...) plus
    ``skip_logits``: True computes only the loss with the fused kernel (needs labels or
    ``shift_labels``), False always returns logits; None (default) skips them exactly when
    training with labels. Loss-only keyword arguments: ``num_items_in_batch``,
    ``shift_labels`` (B, T), ``ignore_index``; ``return_dict=False`` returns a tuple; MoE
    models take ``output_router_logits``. Everything else goes to the decoder.

    The explicit signature matters: the Trainer keeps dataset columns named in it and passes
    ``num_items_in_batch`` only to a forward with ``**kwargs``; ``generate()`` looks for
    ``logits_to_keep``, ``attention_mask`` and ``position_ids`` in it.
    """
    # Looked up now (patching or unpickling), not in the forward: torch.compile cannot trace it there.
    hf_slice_logits_to_keep()
    for name in (spec.output_class, spec.router_aux_loss_fn):
        if name is not None:
            _qualified(name)
    return _build_fused_loss_forward(spec)


@functools.cache
def _build_fused_loss_forward(spec: FusedLossSpec):
    def forward(self, *args: Any, **kwargs: Any):
        return _fused_loss_forward(self, spec, *args, **kwargs)

    # The body's named parameters (less ``spec``), which the Trainer and generate() read.
    parameters = list(inspect.signature(_fused_loss_forward).parameters.values())
    forward.__signature__ = inspect.Signature([parameters[0]] + parameters[2:])  # type: ignore[attr-defined]
    forward.__doc__ = fused_loss_forward.__doc__
    forward.__qualname__ = "liger_causal_lm_forward"
    if spec.extra_parameters:
        signature = inspect.signature(forward)
        parameters = list(signature.parameters.values())
        extra = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None)
                 for name in spec.extra_parameters if name not in signature.parameters]
        forward.__signature__ = signature.replace(  # type: ignore[attr-defined]
            parameters=parameters[:-1] + extra + parameters[-1:])
    return set_recipe(forward, fused_loss_forward, spec)


def is_fused_loss_forward(fn: Any) -> bool:
    """Whether ``fn`` is a forward :func:`fused_loss_forward` built."""
    recipe = getattr(fn, "_liger_recipe", None)
    return isinstance(recipe, tuple) and bool(recipe) and recipe[0] is fused_loss_forward
