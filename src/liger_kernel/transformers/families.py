"""The declarative table of Hugging Face model families: overrides of discovery, and documentation.

Any model is patched by discovery (:mod:`liger_kernel.transformers.patching.discovery`); a
model type named here is patched from its entry instead (the entry wins), which also gives its
``apply_liger_kernel_to_<model_type>`` the family's signature (``swiglu`` or ``geglu``) and
the class-level patch of its modeling module. Everything that differs between families lives
here as data; the patching code (:mod:`liger_kernel.transformers.patching`) and the fused-loss
forward (:mod:`liger_kernel.transformers.causal_lm`) contain no per-model branches. Adding a
family that follows an existing pattern is one new :class:`ModelFamily` entry.

Per family the table records

* where the modeling code lives (``transformers.models.<name>.modeling_<name>``) and the
  name of its ``*ForCausalLM`` class;
* its RMSNorm: the class name, how Liger must reproduce it (``offset`` added to the weight,
  ``casting_mode``, the weight initialisation, whether the backward may overwrite the incoming
  gradient in place), every attribute that holds one (per decoder layer, per attention
  block - Qwen3's ``q_norm``/``k_norm`` - and the final norm) and which modules besides
  ``nn.Linear`` save its outputs for their backward (Mixtral's router);
* its MLP: the class name, which gated activation it computes, the config attribute naming
  the activation and the values for which the Liger kernel is exact, and which Liger module
  replaces it. Mixtral's experts hold fused 3-D weights and are patched by swapping only the
  activation (``kind="experts"``);
* the module-level rotary function used by the attention forward;
* loss details: the config attribute of a final-logit tanh soft-cap (Gemma 2) and the module
  function computing a router auxiliary loss (Mixtral).

This module imports nothing from ``transformers`` or ``torch``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Activation names (values of ``config.hidden_act`` / ``hidden_activation``) for which each
# Liger gated activation reproduces the HF MLP exactly.
SILU_ACTIVATIONS = ("silu", "swish")
# All three are 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), HF just computes them differently.
GELU_TANH_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_python_tanh", "gelu_new")


@dataclass(frozen=True)
class NormSpec:
    """How a family's RMSNorm is computed and where its instances sit.

    ``offset``/``casting_mode``/``init_fn`` are passed to :class:`LigerRMSNorm`: Llama-style
    norms compute ``w * (x * rsqrt(mean(x^2) + eps)).to(dtype)`` (``offset=0``, ``"llama"``,
    weight initialised to ones); Gemma-style norms compute
    ``((x * rsqrt(mean(x^2) + eps)) * (1 + w)).to(dtype)`` in fp32 (``offset=1``, ``"gemma"``,
    zeros). ``eps_attr`` is the attribute the HF class stores epsilon in.

    ``in_place`` lets the backward write ``dx`` into the buffer of the incoming ``dy``. That is
    only safe when nothing else reads that gradient tensor; a norm whose output feeds a
    residual add directly (Gemma 2's post-attention / post-feedforward norms) shares ``dy``
    with the residual branch, so such families use ``in_place=False``. It is a promise about the
    decoder-layer norms only: the final norm's output is handed to the caller (the last hidden
    state), so the patch never lets it write in place.

    ``layer_attrs`` are attribute paths relative to each decoder layer (``model.layers[i]``),
    ``final_attr`` is relative to the base model; together they list every norm instance.

    ``consumer_classes`` names the module classes, besides ``nn.Linear``, that receive a norm
    output and save it for their backward (Mixtral's router calls ``F.linear`` itself); the
    norm-output recompute hooks those modules (:mod:`liger_kernel.transformers.recompute`).
    """

    class_name: str
    layer_attrs: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")
    final_attr: str = "norm"
    offset: float = 0.0
    casting_mode: str = "llama"
    init_fn: str = "ones"
    in_place: bool = True
    eps_attr: str = "variance_epsilon"
    consumer_classes: tuple[str, ...] = ()


@dataclass(frozen=True)
class MLPSpec:
    """A family's feed-forward block and its Liger replacement.

    ``kind`` is one of

    * ``"swiglu"``: ``down(silu(gate(x)) * up(x))`` with ``gate_proj``/``up_proj``/``down_proj``;
    * ``"phi3_swiglu"``: the same with one fused ``gate_up_proj`` (gate first);
    * ``"geglu"``: ``down(gelu_tanh(gate(x)) * up(x))``;
    * ``"experts"``: fused 3-D expert weights (``gate_up_proj`` (E, 2I, H), ``down_proj``
      (E, H, I)); only the activation ``act(gate) * up`` is replaced, the routing and the
      expert matmuls stay HF's.

    ``liger_module``/``liger_class`` name the Liger ``nn.Module`` that replaces
    ``class_name`` (unused for experts). ``activation_attr`` is the config attribute holding
    the activation name; the kernel is applied only when its value is in ``activations``.
    ``option`` is the keyword of the patch function that switches it (``swiglu`` or ``geglu``).
    ``layer_attr`` is the attribute of each decoder layer holding the block, and for experts
    ``experts_attr`` the attribute of that block holding the experts module.
    """

    class_name: str
    kind: str
    option: str
    activation_attr: str = "hidden_act"
    activations: tuple[str, ...] = SILU_ACTIVATIONS
    liger_module: str = ""
    liger_class: str = ""
    layer_attr: str = "mlp"
    experts_attr: str = ""


@dataclass(frozen=True)
class ModelFamily:
    """Everything the patching code needs to know about one ``config.model_type``
    (``modeling_module`` defaults to ``transformers.models.<model_type>.modeling_<model_type>``)."""

    model_type: str
    causal_lm_class: str
    norm: NormSpec
    mlp: MLPSpec
    modeling_module: str = ""
    rotary_fn: str = "apply_rotary_pos_emb"
    # Config attribute holding a tanh soft-cap applied to the final logits (None: no soft-cap).
    logit_softcap_attr: str | None = None
    # Module-level function of the modeling file computing the router auxiliary loss; the
    # forward adds ``config.router_aux_loss_coef * aux`` to the loss when router logits are asked.
    router_aux_loss_fn: str | None = None

    def __post_init__(self):
        if not self.modeling_module:
            object.__setattr__(self, "modeling_module", _modeling(self.model_type))

    @property
    def is_moe(self) -> bool:
        return self.router_aux_loss_fn is not None


def _modeling(name: str) -> str:
    return f"transformers.models.{name}.modeling_{name}"


_SWIGLU: dict[str, Any] = dict(kind="swiglu", option="swiglu", liger_module="swiglu", liger_class="LigerSwiGLUMLP")
_GEGLU: dict[str, Any] = dict(
    kind="geglu", option="geglu", activations=GELU_TANH_ACTIVATIONS, liger_module="geglu",
    liger_class="LigerGEGLUMLP",
)
_GEMMA_NORM: dict[str, Any] = dict(offset=1.0, casting_mode="gemma", init_fn="zeros", eps_attr="eps")

_GEMMA2_NORM_ATTRS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                      "post_feedforward_layernorm")
_QWEN3_NORM_ATTRS = ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm")

FAMILIES: dict[str, ModelFamily] = {
    family.model_type: family
    for family in (
        ModelFamily("llama", "LlamaForCausalLM", NormSpec("LlamaRMSNorm"), MLPSpec("LlamaMLP", **_SWIGLU)),
        ModelFamily("mistral", "MistralForCausalLM", NormSpec("MistralRMSNorm"), MLPSpec("MistralMLP", **_SWIGLU)),
        ModelFamily(
            "mixtral", "MixtralForCausalLM", NormSpec("MixtralRMSNorm", consumer_classes=("MixtralTopKRouter",)),
            MLPSpec("MixtralExperts", kind="experts", option="swiglu", experts_attr="experts"),
            router_aux_loss_fn="load_balancing_loss_func",
        ),
        ModelFamily("gemma", "GemmaForCausalLM", NormSpec("GemmaRMSNorm", **_GEMMA_NORM), MLPSpec("GemmaMLP", **_GEGLU)),
        ModelFamily(
            "gemma2", "Gemma2ForCausalLM",
            NormSpec("Gemma2RMSNorm", layer_attrs=_GEMMA2_NORM_ATTRS, in_place=False, **_GEMMA_NORM),
            MLPSpec("Gemma2MLP", activation_attr="hidden_activation", **_GEGLU),
            logit_softcap_attr="final_logit_softcapping",
        ),
        ModelFamily("qwen2", "Qwen2ForCausalLM", NormSpec("Qwen2RMSNorm"), MLPSpec("Qwen2MLP", **_SWIGLU)),
        ModelFamily("qwen3", "Qwen3ForCausalLM", NormSpec("Qwen3RMSNorm", layer_attrs=_QWEN3_NORM_ATTRS),
                    MLPSpec("Qwen3MLP", **_SWIGLU)),
        ModelFamily(
            "phi3", "Phi3ForCausalLM", NormSpec("Phi3RMSNorm"),
            MLPSpec("Phi3MLP", kind="phi3_swiglu", option="swiglu", liger_module="swiglu",
                    liger_class="LigerPhi3SwiGLUMLP"),
        ),
    )
}
