"""The head probe (``liger_kernel.transformers.patching.head_probe``): where a model's forward
reaches its output embedding and how it computes its loss, proven by running the fused-loss
forward next to the model's own; a head it cannot reproduce stays HF's with the reason."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from transformers.models.jetmoe.modeling_jetmoe import load_balancing_loss_func

from liger_kernel.transformers.causal_lm import output_embedding_input
from tests.transformers.census.test_census import run_case
from tests.transformers.census.tiny_configs import CAUSAL_LM, IMAGE_TEXT, tiny_model
from tests.utils import DEVICE

# One model type per layout of the head and loss the probe recognises.
HEAD_LAYOUTS = [
    pytest.param(CAUSAL_LM, "opt", id="decoder-at-a-dotted-path"),  # self.model.decoder(...)
    pytest.param(CAUSAL_LM, "bart", id="unshifted-labels-mean-cross-entropy"),  # CrossEntropyLoss, no shift
    pytest.param(CAUSAL_LM, "bert", id="output-embedding-inside-the-head-child"),  # self.cls -> predictions.decoder
    pytest.param(CAUSAL_LM, "modernbert-decoder", id="transform-child-before-the-output-embedding"),
    pytest.param(CAUSAL_LM, "jetmoe", id="router-loss-coefficient-under-another-name"),  # self.aux_loss_coef
    pytest.param(CAUSAL_LM, "inkling2_text", id="soft-cap-applied-by-a-module"),  # self.logit_softcap(logits)
    pytest.param(CAUSAL_LM, "falcon_h1", id="logit-multiplier-read-off-the-decoder"),  # * self.model.lm_head_multiplier
    pytest.param(IMAGE_TEXT, "idefics3", id="forward-reads-the-decoders-submodules"),  # self.model.text_model
    pytest.param(CAUSAL_LM, "reformer", id="head-taking-twice-the-hidden-width"),  # both streams concatenated
    pytest.param(CAUSAL_LM, "dbrx", id="expert-count-read-off-the-model"),  # self.num_experts, not in the config
    pytest.param(CAUSAL_LM, "recurrent_gemma", id="soft-cap-under-another-name"),  # config.logits_soft_cap
    pytest.param(IMAGE_TEXT, "aya_vision", id="logit-scale-in-the-text-config"),  # config.text_config.logit_scale
    pytest.param(IMAGE_TEXT, "kosmos-2.5", id="nested-language-model-given-the-labels"),  # self.text_model(labels=...)
    pytest.param(CAUSAL_LM, "minicpm3", id="hidden-states-scaled-before-the-head"),  # hidden_states / logits_scaling
    pytest.param(IMAGE_TEXT, "gemma3", id="decoder-given-the-labels-it-ignores"),  # self.model(labels=labels)
]


def test_decoder_fed_from_the_labels_keeps_its_forward():
    """An encoder-decoder whose decoder inputs are shifted from the labels (Florence-2): the fused
    forward gives its decoder no labels, so the head stays HF's, with the reason."""
    result = run_case(IMAGE_TEXT, "florence2")
    assert result.status == "equal", (result.status, result.detail)
    assert "fused_linear_cross_entropy" not in result.patched
    assert any("depend on the labels" in why for _, why in result.left_alone), result.left_alone


@pytest.mark.parametrize("task, model_type", HEAD_LAYOUTS)
def test_head_layout_gets_the_fused_loss_and_trains_like_hf(task, model_type):
    """The patch fuses the loss of each layout, and one training step (loss and every gradient)
    equals the unpatched model's."""
    _skip_unless_built(model_type, task)
    result = run_case(task, model_type)
    assert result.status == "equal", (result.status, result.detail, result.reason)
    assert "fused_linear_cross_entropy" in result.patched, result.left_alone


def _patch_head_only(model: nn.Module):
    from liger_kernel.transformers.patching.generic import patch_head
    from liger_kernel.transformers.patching.options import PatchOptions
    from liger_kernel.transformers.patching.report import PatchReport

    report = PatchReport(model.config.model_type, PatchOptions())
    patch_head(model, PatchOptions(), report)
    return report


class _TransformHead(nn.Module):
    """A BERT-style head: a transform, then the output embedding ``decoder``, whose logits are
    multiplied by ``factor`` (2: something the fused loss, which stops at the embedding,
    cannot reproduce)."""

    def __init__(self, hidden: int, vocab: int, factor: float) -> None:
        super().__init__()
        self.transform = nn.Linear(hidden, hidden)
        self.decoder = nn.Linear(hidden, vocab)
        self.factor = factor

    def forward(self, hidden_states):
        logits = self.decoder(torch.tanh(self.transform(hidden_states)))
        return logits if self.factor == 1.0 else self.factor * logits


def _head_module_llama(factor: float) -> nn.Module:
    """A tiny Llama whose logits come from a :class:`_TransformHead` child ``cls``."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    from transformers import LlamaForCausalLM

    class HeadModuleLlama(LlamaForCausalLM):
        def __init__(self, config):
            super().__init__(config)
            del self.lm_head
            self.cls = _TransformHead(config.hidden_size, config.vocab_size, factor)
            self.loss_type = "ForCausalLM"  # HF warns (a graph break) when the class name gives none

        def get_output_embeddings(self):
            return self.cls.decoder

        def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
            hidden = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            logits = self.cls(hidden)
            loss = None
            if labels is not None:
                loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size)
            return CausalLMOutputWithPast(loss=loss, logits=logits)

    return HeadModuleLlama(tiny_model("llama")[0].config).to(DEVICE)


def test_head_computing_after_its_output_embedding_keeps_its_forward():
    report = _patch_head_only(_head_module_llama(factor=2.0))
    assert "fused_linear_cross_entropy" not in report.patched
    assert any("loss" in what and "differs" in why for what, why in report.left_alone), report.left_alone


def test_head_module_is_fused_eagerly_and_traced_whole_when_compiled():
    """The output embedding inside the head child: fused in eager mode (its input taken by a
    stop hook), and under ``torch.compile(fullgraph=True)`` the head module gives the logits
    (a hook cannot be traced), one graph with the eager loss and gradients."""
    import copy

    model = _head_module_llama(factor=1.0)
    batch = tiny_model("llama")[1]
    reference = copy.deepcopy(model)
    report = _patch_head_only(model)
    assert "fused_linear_cross_entropy" in report.patched, report.left_alone
    for run in ("eager", "compiled"):
        model.zero_grad()
        reference.zero_grad()
        graphs = []

        def capture(gm, example_inputs, graphs=graphs):
            graphs.append(gm)
            return gm.forward

        torch._dynamo.reset()
        try:
            forward = model if run == "eager" else torch.compile(model, backend=capture, fullgraph=True)
            loss = forward(**batch).loss
            loss.backward()
        finally:
            torch._dynamo.reset()
        expected = reference(**batch).loss
        expected.backward()
        assert len(graphs) == (run == "compiled")
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
        for (name, param), other in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(param.grad, other.grad, rtol=1e-4, atol=1e-4 * other.grad.abs().max().item(),
                                       msg=f"{run} {name}")


def test_shifted_cross_entropy_called_directly_is_recognised():
    """A forward calling ``F.cross_entropy`` on shifted logits itself, and honouring
    ``num_items_in_batch``: the probe finds the shift and the count, and the patched model's
    loss and gradients equal the original's with and without ``num_items_in_batch``."""
    import copy

    import torch.nn.functional as F
    from transformers.modeling_outputs import CausalLMOutputWithPast

    from transformers import LlamaForCausalLM

    class DirectLossLlama(LlamaForCausalLM):
        def forward(self, input_ids=None, attention_mask=None, labels=None, num_items_in_batch=None, **kwargs):
            hidden = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            logits = self.lm_head(hidden)
            loss = None
            if labels is not None:
                flat = logits[:, :-1].reshape(-1, logits.shape[-1])
                targets = labels[:, 1:].reshape(-1)
                if num_items_in_batch is None:
                    loss = F.cross_entropy(flat, targets, ignore_index=-100)
                else:
                    loss = F.cross_entropy(flat, targets, ignore_index=-100, reduction="sum") / num_items_in_batch
            return CausalLMOutputWithPast(loss=loss, logits=logits)

    model, batch = tiny_model("llama")
    model = DirectLossLlama(model.config).to(DEVICE)
    reference = copy.deepcopy(model)
    report = _patch_head_only(model)
    assert "fused_linear_cross_entropy" in report.patched, report.left_alone
    for extra in ({}, {"num_items_in_batch": torch.tensor(7, device=DEVICE)}):
        ours, theirs = model(**batch, **extra).loss, reference(**batch, **extra).loss
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
        ours.backward()
        theirs.backward()
        for (name, a), b in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-4 * b.grad.abs().max().item(), msg=name)
        model.zero_grad()
        reference.zero_grad()


def test_output_embedding_input_is_what_the_head_feeds_it():
    """(B, T, H) -> the (B, T, H') input the head passes its output embedding, with gradients
    flowing through the head's transform; a head that never calls the embedding is an error."""
    head = _TransformHead(8, 11, factor=1.0).to(DEVICE)
    hidden = torch.randn(2, 3, 8, device=DEVICE, requires_grad=True)
    features = output_embedding_input(head, head.decoder, hidden)
    expected = torch.tanh(head.transform(hidden))
    torch.testing.assert_close(features, expected)
    (grad,) = torch.autograd.grad(features.sum(), hidden)
    (expected_grad,) = torch.autograd.grad(expected.sum(), hidden)
    torch.testing.assert_close(grad, expected_grad)
    assert not head.decoder._forward_pre_hooks, "the stopping hook must be removed"
    with pytest.raises(ValueError, match="never called its output embedding"):
        output_embedding_input(head.transform, head.decoder, hidden)


def test_logits_sliced_to_a_smaller_vocabulary_keep_their_forward():
    """Inkling slices its logits to ``unpadded_vocab_size`` when that is below the head's rows:
    the fused loss, over every row, differs, and the probe sees it although it shrinks the
    vocabulary."""
    from liger_kernel.transformers.patching import head_probe

    model, _ = tiny_model("inkling_text")
    assert not isinstance(head_probe.probe_head(model), str)  # no slicing: fused
    model.config.unpadded_vocab_size = model.config.vocab_size - 3
    why = head_probe.probe_head(model)
    assert isinstance(why, str) and "differs" in why, why


@pytest.mark.parametrize("model_type", ["opt", "modernbert-decoder"])
def test_probed_fused_forward_traces_as_one_graph(model_type):
    """The fused forward a probe built (its output class named in the spec, a head transform)
    traces under ``torch.compile(fullgraph=True)`` without a graph break, and the traced step
    gives the eager loss."""
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    model, batch = tiny_model(model_type)
    # explain, not a fullgraph trace: a failed fullgraph trace leaves Dynamo's frame hook in
    # place for the rest of the process.
    torch._dynamo.reset()
    breaks = torch._dynamo.explain(model)(**batch).graph_break_count
    torch._dynamo.reset()
    if breaks:
        pytest.skip(f"HF's own {model_type} forward does not trace as one graph in this transformers version")
    report = _apply_liger_kernel_to_instance(model=model)
    assert "fused_linear_cross_entropy" in report.patched, report.left_alone
    eager = model(**batch).loss
    graphs, traced = _graphs_traced(model, batch)
    assert len(graphs) == 1
    torch.testing.assert_close(traced, eager, rtol=1e-5, atol=1e-6)


def _graphs_traced(model: nn.Module, batch: dict):
    """``(graphs, loss)`` of ``model`` under ``torch.compile(fullgraph=True)``."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    try:
        return graphs, torch.compile(model, backend=capture, fullgraph=True)(**batch).loss
    finally:
        torch._dynamo.reset()


def _skip_unless_built(model_type: str, task: str) -> None:
    """Skip a model type this transformers version lacks, or whose default config it cannot build."""
    from transformers import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"{model_type} is not in this transformers version")
    try:
        tiny_model(model_type, task)
    except Exception as failure:  # HF's own defaults fail to build it here
        pytest.skip(f"HF's defaults do not build {model_type} in this transformers version: {failure}")


def _jetmoe_with_router_default(default: bool | None) -> type:
    """A JetMoE causal LM whose forward's ``output_router_logits`` defaults to ``default``; a
    ``False`` default ignores the config (JetMoE's forward in some transformers releases)."""
    from transformers.modeling_outputs import MoeCausalLMOutputWithPast

    from transformers import JetMoeForCausalLM

    class RouterDefaultJetMoe(JetMoeForCausalLM):
        def forward(self, input_ids=None, attention_mask=None, labels=None,
                    output_router_logits: bool | None = default, **kwargs):
            if output_router_logits is None:
                output_router_logits = self.config.output_router_logits
            outputs = self.model(input_ids=input_ids, attention_mask=attention_mask,
                                 output_router_logits=output_router_logits)
            logits = self.lm_head(outputs.last_hidden_state)
            loss = None if labels is None else self.loss_function(logits, labels, self.vocab_size, **kwargs)
            aux_loss = None
            if output_router_logits:
                aux_loss = load_balancing_loss_func(outputs.router_logits, self.num_experts, self.num_experts_per_tok,
                                                    attention_mask)
                if loss is not None:
                    loss = loss + self.aux_loss_coef * aux_loss
            return MoeCausalLMOutputWithPast(loss=loss, aux_loss=aux_loss, logits=logits,
                                             router_logits=outputs.router_logits)

    return RouterDefaultJetMoe


@pytest.mark.parametrize("signature_default", [False, None])
def test_router_logits_default_follows_the_forwards_signature(signature_default):
    """The fused forward adds the router loss exactly when HF's forward does for a call without
    ``output_router_logits``: never where the signature defaults it to False, as the config says
    where it defaults to None (the config here says True)."""
    import copy

    from liger_kernel.transformers.patching.head_probe import _router_logits_default

    cls = _jetmoe_with_router_default(signature_default)
    assert _router_logits_default(cls) is signature_default
    model, batch = tiny_model("jetmoe")
    model.config.output_router_logits = True
    hf = cls(model.config).to(DEVICE)
    hf.load_state_dict(model.state_dict())
    patched = copy.deepcopy(hf)
    report = _patch_head_only(patched)
    assert "fused_linear_cross_entropy" in report.patched, report.left_alone
    expected, ours = hf(**batch), patched(**batch)
    assert (expected.aux_loss is None) == (signature_default is False)
    assert (ours.aux_loss is None) == (signature_default is False)
    torch.testing.assert_close(ours.loss, expected.loss, rtol=1e-5, atol=1e-6)
