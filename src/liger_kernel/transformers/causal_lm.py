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
  are computed, exactly as the installed HF forward does (:func:`_positions_to_keep`);
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
from typing import Any

import torch
import torch.nn.functional as F

from liger_kernel.transformers.distributed import (
    accelerate_hooked,
    call_with_full_parameters,
    forward_is_wrapped,
    unwrapped_class,
)
from liger_kernel.transformers.patching.binding import set_recipe
from liger_kernel.transformers.recompute import autocast_recasts, recompute_norm_outputs

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


def _divide_by_items(loss: torch.Tensor, num_items_in_batch: torch.Tensor | int) -> torch.Tensor:
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

    if shift_labels is None:
        shift_labels = shift_causal_labels(labels, ignore_index)
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = liger_cross_entropy(
        logits.reshape(-1, vocab_size),
        shift_labels.reshape(-1).to(logits.device),
        ignore_index=ignore_index,
        reduction=reduction,
        # The logits are also returned to the caller: the kernel must not overwrite them.
        in_place=False,
        loss_dtype=torch.float32,  # HF upcasts the logits, so its loss is float32
    )
    if num_items_in_batch is not None:
        loss = _divide_by_items(loss, num_items_in_batch)
    return loss


@functools.cache
def _cache_kwarg_name(base_model_class: type) -> str:
    # transformers 5.24 renamed the decoder's ``past_key_values`` argument to ``cache`` (5.17
    # still uses ``past_key_values``); pass it under whichever name the base model takes.
    params = inspect.signature(base_model_class.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _output_cache_field(output_class: type) -> str:
    # ``__dataclass_fields__`` rather than ``dataclasses.fields()``: Dynamo cannot trace the
    # latter on a class (a graph break under torch.compile), but reads a class attribute.
    return "cache" if "cache" in output_class.__dataclass_fields__ else "past_key_values"


# ``[transformers.modeling_utils.slice_logits_to_keep or None]`` once looked up. The lookup is
# an import, which Dynamo cannot trace (transformers is a lazy module: a graph break under
# torch.compile), so patching makes it before any forward can run compiled.
_HF_SLICE_LOGITS_TO_KEEP: list = []


def _hf_slice_logits_to_keep():
    # transformers 5.25 slices through ``modeling_utils.slice_logits_to_keep`` (which also
    # takes 2-D tensors); 5.17 has no such function and indexes ``hidden_states`` inline.
    if not _HF_SLICE_LOGITS_TO_KEEP:
        from transformers import modeling_utils

        _HF_SLICE_LOGITS_TO_KEEP.append(getattr(modeling_utils, "slice_logits_to_keep", None))
    return _HF_SLICE_LOGITS_TO_KEEP[0]


def _positions_to_keep(hidden_states: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    """(B, T, H) -> the hidden states whose logits are wanted, exactly as the installed HF
    ``*ForCausalLM.forward`` selects them.

    Every version takes an int ``k`` (the last ``k`` positions, 0 = all) and a 1-D tensor of
    positions, giving (B, kept, H). Where HF has ``slice_logits_to_keep`` it is used as is,
    which adds a 2-D integer tensor (B, kept) of positions per row, giving (B, kept, H), and
    a 2-D boolean mask (B, T), giving the (num_true, H) selected rows. Older HF documents
    only the int and 1-D forms (its inline ``hidden_states[:, t, :]`` turns a 2-D tensor into
    a cross-batch gather or an ``IndexError``), so a 2-D tensor raises ``ValueError`` there.
    """
    hf_slice = _hf_slice_logits_to_keep()
    if hf_slice is not None:
        return hf_slice(hidden_states, logits_to_keep)
    if isinstance(logits_to_keep, int):
        # 0 keeps everything: slice(-0, None) == slice(0, None).
        return hidden_states[:, -logits_to_keep:, :]
    if logits_to_keep.dim() > 1:
        import transformers

        raise ValueError(
            f"logits_to_keep of shape {tuple(logits_to_keep.shape)}: transformers {transformers.__version__} "
            "takes an int or a 1-D tensor of positions (2-D tensors need a version with "
            "transformers.modeling_utils.slice_logits_to_keep)"
        )
    return hidden_states[:, logits_to_keep, :]


def _zero_if_nothing_counted(
    loss: torch.Tensor, labels: torch.Tensor | None, shift_labels: torch.Tensor | None, ignore_index: int
) -> torch.Tensor:
    """``loss``, or 0 when no target is counted: the library's convention for a mean over
    all-ignored targets (the fused path's value), where HF's loss divides 0 by 0 (NaN).

    ``torch.where`` keeps the graph (the gradient is zero, no NaN: every row is ignored) and
    needs no device sync, so it also traces under ``torch.compile``.
    """
    targets = shift_labels if shift_labels is not None else shift_causal_labels(labels, ignore_index)
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
    lm_head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, **kwargs: Any
) -> torch.Tensor:
    """Fused linear cross entropy of ``hidden`` (N, H) through ``lm_head`` (``weight`` (V, H), ``bias``)."""
    from liger_kernel.transformers.fused_linear_cross_entropy import liger_fused_linear_cross_entropy

    return liger_fused_linear_cross_entropy(hidden, lm_head.weight, targets, bias=lm_head.bias, **kwargs)


def _model_or_config(model: torch.nn.Module, text_config: Any, name: str) -> Any:
    """``model.<name>``, else ``text_config.<name>`` (a forward reads a constant off either)."""
    value = getattr(model, name, None)
    return getattr(text_config, name) if value is None else value


def _input_embedding_weight(model: torch.nn.Module) -> torch.Tensor | None:
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
    """The body of every forward :func:`fused_loss_forward` builds (arguments documented there)."""
    from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

    config = self.config
    text_config = text_config_of(config)

    return_dict = kwargs.pop("return_dict", None)
    if return_dict is None:
        return_dict = getattr(config, "return_dict", True)
    num_items_in_batch = kwargs.pop("num_items_in_batch", None)
    if not spec.counts_items:
        num_items_in_batch = None
    shift_labels = kwargs.pop("shift_labels", None)
    ignore_index = kwargs.pop("ignore_index", IGNORE_INDEX)
    if shift_labels is None and labels is not None and not spec.shifts_labels:
        # The forward takes labels already aligned with the positions: they are the targets.
        shift_labels, labels = labels, None
    # 5.24's generate() passes the KV cache as ``cache``.
    cache = kwargs.pop("cache", None)
    if past_key_values is None:
        past_key_values = cache

    is_moe = spec.is_moe
    output_router_logits = kwargs.pop("output_router_logits", None)
    if is_moe:
        if output_router_logits is None:
            output_router_logits = spec.router_logits_default
        if output_router_logits is None:
            output_router_logits = getattr(config, "output_router_logits", None)
            if output_router_logits is None:
                output_router_logits = getattr(text_config, "output_router_logits", False)
        kwargs["output_router_logits"] = output_router_logits

    base_model = self.get_submodule(spec.decoder_attr or self.base_model_prefix)
    kwargs[_cache_kwarg_name(type(base_model))] = past_key_values
    recompute = spec.recompute_norm_outputs and torch.is_grad_enabled() and not torch.compiler.is_compiling()
    if recompute:
        # The residual stream's dtype is the embeddings'; its device the inputs' (offloaded
        # embedding weights sit on the meta device until their hook loads them).
        residual = inputs_embeds if inputs_embeds is not None else _input_embedding_weight(self)
        placed = inputs_embeds if inputs_embeds is not None else input_ids
        # Under autocast the projections save casts of the norm outputs: nothing to recompute.
        if isinstance(residual, torch.Tensor) and isinstance(placed, torch.Tensor):
            recompute = not autocast_recasts(placed.device.type, residual.dtype)
    with recompute_norm_outputs(recompute):
        outputs = base_model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            return_dict=True,
            **kwargs,
        )

    hidden_states = _positions_to_keep(outputs.last_hidden_state, logits_to_keep)
    lm_head = self.get_output_embeddings()
    # What gives the logits on the unfused path: the output embedding, or the head module
    # holding it while compiling (the stop hook of output_embedding_input cannot be traced).
    logits_head = lm_head
    if spec.head_transform_attr is not None:
        hidden_states = getattr(self, spec.head_transform_attr)(hidden_states)
    elif spec.head_call_attr is not None and torch.compiler.is_compiling():
        logits_head = getattr(self, spec.head_call_attr)
    elif spec.head_call_attr is not None:
        hidden_states = output_embedding_input(getattr(self, spec.head_call_attr), lm_head, hidden_states)
    has_targets = labels is not None or shift_labels is not None
    if skip_logits is None:
        skip_logits = self.training and has_targets
    if skip_logits and not has_targets:
        raise ValueError("skip_logits=True needs `labels` or `shift_labels` to compute the loss from.")

    softcap = getattr(text_config, spec.logit_softcap_attr, None) if spec.logit_softcap_attr else None
    scale = None
    if spec.logit_scale_attr is not None:
        scale = _model_or_config(self, text_config, spec.logit_scale_attr)
        scale = 1.0 / scale if spec.logit_scale_divides else scale
    # The fused kernel reads lm_head.weight/bias directly; a wrapped head (a PEFT LoRA or
    # modules_to_save wrapper, a quantised linear) computes something else, so it gets the
    # exact unfused path instead, and so does a head whose forward something other than
    # accelerate replaced on the instance. An accelerate hook (device_map dispatch, offload)
    # is kept: call_with_full_parameters runs the loss inside it, after its pre-forward has
    # moved the inputs and loaded the weights. (fully_shard turns an nn.Linear into an
    # FSDPLinear subclass: still fusable.)
    is_linear = unwrapped_class(lm_head) is torch.nn.Linear
    replaced = forward_is_wrapped(lm_head) and not accelerate_hooked(lm_head)
    fusable = is_linear and not replaced and logits_head is lm_head
    if skip_logits and not is_linear:
        _warn_once(f"lm_head is a {type(lm_head).__name__}, not an nn.Linear: computing the loss from logits.")
    elif skip_logits and replaced:
        _warn_once("lm_head's forward is replaced on the instance (not by an accelerate hook): "
                   "computing the loss from logits.")
    loss = None
    logits = None
    if skip_logits and fusable:
        if shift_labels is None:
            shift_labels = shift_causal_labels(labels, ignore_index)
        kept = hidden_states.shape[:-1]
        # (batch, positions) targets for (batch, positions) kept; a boolean logits_to_keep
        # mask keeps (num_true,) rows, matched like HF's loss does: by the flattened count.
        if shift_labels.shape != kept and not (len(kept) == 1 and shift_labels.numel() == kept[0]):
            raise ValueError(
                f"labels/shift_labels of shape {tuple(shift_labels.shape)} do not match the "
                f"{tuple(kept)} positions kept by logits_to_keep={logits_to_keep!r}"
            )
        # Under FSDP2 (lm_head sharded on its own), DeepSpeed ZeRO-3 or accelerate offload the
        # weight is only materialised inside lm_head's own call: run the fused loss as that call.
        scaled = hidden_states if scale is None else hidden_states * scale
        loss = call_with_full_parameters(
            lm_head,
            _fused_lm_head_loss,
            scaled.reshape(-1, scaled.shape[-1]),
            shift_labels.reshape(-1).to(hidden_states.device),
            ignore_index=ignore_index,
            reduction="sum" if num_items_in_batch is not None else "mean",
            softcap=softcap,
        )
        if num_items_in_batch is not None:
            loss = _divide_by_items(loss, num_items_in_batch)
    else:
        logits = logits_head(hidden_states)
        if scale is not None:
            logits = logits * scale
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        if has_targets:
            loss_kwargs = {"num_items_in_batch": num_items_in_batch, "ignore_index": ignore_index}
            if shift_labels is not None:
                loss_kwargs["shift_labels"] = shift_labels
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=text_config.vocab_size,
                                      **loss_kwargs)
            if num_items_in_batch is None:
                loss = _zero_if_nothing_counted(loss, labels, shift_labels, ignore_index)
        if skip_logits:
            logits = None

    fields: dict[str, Any] = {
        "loss": loss,
        "logits": logits,
        # Not every decoder has them (a state-space model's outputs have no attentions).
        "hidden_states": getattr(outputs, "hidden_states", None),
        "attentions": getattr(outputs, "attentions", None),
    }
    output_class = CausalLMOutputWithPast
    if is_moe:
        output_class = MoeCausalLMOutputWithPast
    if spec.output_class is not None:
        output_class = _qualified(spec.output_class)
    if is_moe:
        aux_loss = None
        if output_router_logits:
            aux_loss = _qualified(spec.router_aux_loss_fn)(
                outputs.router_logits, _model_or_config(self, text_config, spec.num_experts_attr),
                _model_or_config(self, text_config, "num_experts_per_tok"),
                attention_mask,
            )
            if loss is not None:
                coef = _model_or_config(self, text_config, spec.aux_loss_coef_attr)
                loss = loss + coef * aux_loss.to(loss.device)
        fields.update(loss=loss, aux_loss=aux_loss, router_logits=outputs.router_logits)
    fields[_output_cache_field(output_class)] = getattr(outputs, _output_cache_field(type(outputs)), None)
    if spec.output_class is not None:
        # The model's own output fields (image hidden states, rope deltas, ...) come from the decoder's.
        declared = output_class.__dataclass_fields__
        fields = {name: fields[name] if name in fields else getattr(outputs, name, None) for name in declared}

    output = output_class(**fields)
    return output if return_dict else output.to_tuple()


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
    _hf_slice_logits_to_keep()
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
    forward.__signature__ = inspect.Signature([parameters[0]] + parameters[2:])
    forward.__doc__ = fused_loss_forward.__doc__
    forward.__qualname__ = "liger_causal_lm_forward"
    if spec.extra_parameters:
        signature = inspect.signature(forward)
        parameters = list(signature.parameters.values())
        extra = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None)
                 for name in spec.extra_parameters if name not in signature.parameters]
        forward.__signature__ = signature.replace(parameters=parameters[:-1] + extra + parameters[-1:])
    return set_recipe(forward, fused_loss_forward, spec)


def is_fused_loss_forward(fn: Any) -> bool:
    """Whether ``fn`` is a forward :func:`fused_loss_forward` built."""
    recipe = getattr(fn, "_liger_recipe", None)
    return isinstance(recipe, tuple) and bool(recipe) and recipe[0] is fused_loss_forward
