"""The shared fused-loss causal-LM forward against Hugging Face's own forward.

Each test runs a patched instance and an unpatched deep copy of the same tiny fp32 model on
the same batch and compares loss, gradients and outputs: label shifting, ``ignore_index``,
``shift_labels``, ``num_items_in_batch`` (and the exact gradient accumulation it enables),
``logits_to_keep`` (every form the installed HF takes), ``return_dict=False``, ``skip_logits``,
Gemma 2's final-logit soft-cap, Mixtral's router auxiliary loss, ``cross_entropy=True``, the
signature the Trainer and ``generate()`` inspect, greedy generation and accelerate offload.
All-ignored labels are the one intended difference: loss 0 (the library's convention), where
HF gives NaN.

Tolerance: the fused kernel computes the same fp32 log-softmax as HF's upcast
``cross_entropy`` in a different summation order (chunks of rows, blocks of the vocabulary),
and the other kernels differ by a few ulps; 2e-5 absolute on O(1) losses and gradients is
~100 fp32 ulps, well above that noise and far below any semantic difference (a wrong shift,
mask or normaliser changes the loss by >1e-2).
"""

from __future__ import annotations

import copy
import inspect

import pytest
import torch

pytest.importorskip("transformers")

from liger_kernel.transformers import _apply_liger_kernel_to_instance, revert_liger_kernel
from liger_kernel.transformers.causal_lm import liger_causal_lm_loss
from liger_kernel.transformers.monkey_patch import _instance_patched
from tests.transformers.model_configs import VOCAB, build_model, random_batch
from tests.utils import DEVICE

TOL = {"atol": 2e-5, "rtol": 1e-4}


@pytest.fixture(autouse=True)
def _revert_class_patches():
    yield
    revert_liger_kernel()


def _pair(model_type: str = "llama", **liger_options):
    reference = build_model(model_type, seed=7)
    patched = copy.deepcopy(reference)
    _apply_liger_kernel_to_instance(patched, **liger_options)
    return reference, patched


def _run(model, train: bool = True, **inputs):
    model.train(train)
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    loss = out[0] if isinstance(out, tuple) else out.loss
    if loss is not None and loss.requires_grad:
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


def _assert_same_grads(grads, ref_grads):
    assert grads.keys() == ref_grads.keys()
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], **TOL, msg=name)


def test_signature_is_explicit_for_trainer_and_generate():
    _, patched = _pair()
    params = inspect.signature(patched.forward).parameters
    for name in ("input_ids", "attention_mask", "position_ids", "past_key_values", "labels", "use_cache",
                 "logits_to_keep", "skip_logits"):
        assert name in params, name
    assert any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    assert patched._supports_logits_to_keep()


def test_training_skips_logits_and_matches_hf():
    reference, patched = _pair()
    batch = random_batch(VOCAB, seed=1)
    ref_out, ref_grads = _run(reference, **batch)
    out, grads = _run(patched, **batch)
    assert out.logits is None
    torch.testing.assert_close(out.loss, ref_out.loss, **TOL)
    _assert_same_grads(grads, ref_grads)


def test_num_items_in_batch_and_exact_gradient_accumulation():
    reference, patched = _pair()
    batch = random_batch(VOCAB, batch=4, seed=2)
    batch["labels"][0, :5] = -100  # uneven counts per micro-batch
    micro = [{k: v[i:i + 2] for k, v in batch.items()} for i in (0, 2)]
    num_items = int((batch["labels"][:, 1:] != -100).sum())

    # Per micro-batch: sum / num_items_in_batch, equal to HF's, tensor or int.
    for items in (torch.tensor(num_items, device=DEVICE), num_items):
        ref_out, ref_grads = _run(reference, **micro[0], num_items_in_batch=items)
        out, grads = _run(patched, **micro[0], num_items_in_batch=items)
        torch.testing.assert_close(out.loss, ref_out.loss, **TOL)
        _assert_same_grads(grads, ref_grads)

    # Accumulating the two micro-batches reproduces the full-batch mean and its gradient.
    _, full_grads = _run(reference, **batch)
    full_loss = reference(**batch).loss.detach()
    patched.train()
    patched.zero_grad(set_to_none=True)
    total = 0.0
    for part in micro:
        loss = patched(**part, num_items_in_batch=torch.tensor(num_items, device=DEVICE)).loss
        loss.backward()
        total = total + loss.detach()
    torch.testing.assert_close(total, full_loss, **TOL)
    _assert_same_grads({n: p.grad for n, p in patched.named_parameters() if p.grad is not None}, full_grads)


def test_shift_labels_and_ignore_index():
    reference, patched = _pair()
    batch = random_batch(VOCAB, seed=3)
    shift_labels = torch.randint(3, VOCAB, batch["labels"].shape, device=DEVICE)
    shift_labels[:, ::3] = -100
    ref_out, ref_grads = _run(reference, **batch, shift_labels=shift_labels)
    out, grads = _run(patched, **batch, shift_labels=shift_labels)
    torch.testing.assert_close(out.loss, ref_out.loss, **TOL)
    _assert_same_grads(grads, ref_grads)
    unshifted = _run(patched, **batch)[0].loss
    assert not torch.allclose(unshifted, out.loss)  # the given targets were used, not a shift


@pytest.mark.parametrize("logits_to_keep", [2, 5, "tensor"])
def test_logits_to_keep(logits_to_keep):
    reference, patched = _pair()
    batch = random_batch(VOCAB, seed=4)
    seq = batch["input_ids"].shape[1]
    if logits_to_keep == "tensor":
        logits_to_keep = torch.tensor([0, 3, seq - 1], device=DEVICE)
        kept = 3
    else:
        kept = logits_to_keep
    ref_out, _ = _run(reference, train=False, input_ids=batch["input_ids"], logits_to_keep=logits_to_keep)
    out, _ = _run(patched, train=False, input_ids=batch["input_ids"], logits_to_keep=logits_to_keep)
    assert out.logits.shape == (2, kept, VOCAB)
    torch.testing.assert_close(out.logits, ref_out.logits, **TOL)

    # Training on the kept positions only: labels aligned with them, as HF requires.
    if isinstance(logits_to_keep, int):
        labels = batch["labels"][:, -kept:]
        ref_out, ref_grads = _run(reference, input_ids=batch["input_ids"], labels=labels, logits_to_keep=kept)
        out, grads = _run(patched, input_ids=batch["input_ids"], labels=labels, logits_to_keep=kept)
        torch.testing.assert_close(out.loss, ref_out.loss, **TOL)
        _assert_same_grads(grads, ref_grads)
        with pytest.raises(ValueError, match="logits_to_keep"):
            patched(input_ids=batch["input_ids"], labels=batch["labels"], logits_to_keep=kept)


def _two_dim_logits_to_keep(form: str, batch: int, seq: int) -> torch.Tensor:
    if form == "positions":  # (B, k) integer positions, one row each
        return torch.tensor([[0, 5, seq - 1], [seq - 2, 1, 7]], device=DEVICE)[:batch]
    mask = torch.zeros(batch, seq, dtype=torch.bool, device=DEVICE)  # a different count per row
    mask[0, [1, 4, seq - 1]] = True
    mask[1, [0, 9]] = True
    return mask


def _targets_kept(shift_labels: torch.Tensor, logits_to_keep: torch.Tensor) -> torch.Tensor:
    """``shift_labels`` (B, T) at the positions ``logits_to_keep`` keeps, shaped like the kept logits' rows."""
    if logits_to_keep.dtype == torch.bool:
        return shift_labels[logits_to_keep]
    return torch.take_along_dim(shift_labels, logits_to_keep, dim=1)


@pytest.mark.parametrize("form", ["positions", "mask"])
def test_logits_to_keep_two_dimensional(form):
    from liger_kernel.transformers.hf_versions import hf_slice_logits_to_keep

    reference, patched = _pair()
    batch = random_batch(VOCAB, seed=14)
    input_ids = batch["input_ids"]
    logits_to_keep = _two_dim_logits_to_keep(form, *input_ids.shape)
    if hf_slice_logits_to_keep() is None:
        # transformers without slice_logits_to_keep (5.17) supports int / 1-D only.
        with pytest.raises(ValueError, match="logits_to_keep"):
            _run(patched, train=False, input_ids=input_ids, logits_to_keep=logits_to_keep)
        return
    ref_out, _ = _run(reference, train=False, input_ids=input_ids, logits_to_keep=logits_to_keep)
    out, _ = _run(patched, train=False, input_ids=input_ids, logits_to_keep=logits_to_keep)
    assert out.logits.shape == ref_out.logits.shape
    assert out.logits.shape == ((5, VOCAB) if form == "mask" else (2, 3, VOCAB))
    torch.testing.assert_close(out.logits, ref_out.logits, **TOL)

    # Training through the fused kernel on the kept positions: HF takes aligned shift_labels
    # (its loss only runs with labels, which shift_labels then overrides).
    shift_labels = torch.randint(3, VOCAB, input_ids.shape, device=DEVICE)
    shift_labels[0, 4] = -100
    inputs = dict(input_ids=input_ids, labels=batch["labels"], logits_to_keep=logits_to_keep,
                  shift_labels=_targets_kept(shift_labels, logits_to_keep))
    ref_out, ref_grads = _run(reference, **inputs)
    out, grads = _run(patched, **inputs)
    assert out.logits is None  # the fused path ran
    torch.testing.assert_close(out.loss, ref_out.loss, **TOL)
    _assert_same_grads(grads, ref_grads)
    with pytest.raises(ValueError, match="logits_to_keep"):  # targets for every position
        patched(input_ids=input_ids, labels=batch["labels"], logits_to_keep=logits_to_keep)


@pytest.mark.parametrize("level", ["instance", "class", "unpickled"])
def test_hf_slice_lookup_is_made_when_the_forward_is_installed(level, monkeypatch):
    """The patched forward must not import ``transformers.modeling_utils`` itself: torch 2.11's
    Dynamo cannot trace that import (a graph break in every compiled patched model; CPU torch
    2.13 traces it, so only this test guards it here). Patching, and unpickling a patched
    instance, make the lookup first."""
    import pickle

    from liger_kernel.transformers import hf_versions, liger_kernel_patched

    monkeypatch.setattr(hf_versions, "_HF_SLICE_LOGITS_TO_KEEP", [])
    if level == "class":
        with liger_kernel_patched("llama"):
            assert hf_versions._HF_SLICE_LOGITS_TO_KEEP
        return
    _, patched = _pair()
    if level == "unpickled":
        data = pickle.dumps(patched)
        monkeypatch.setattr(hf_versions, "_HF_SLICE_LOGITS_TO_KEEP", [])
        pickle.loads(data)
    assert hf_versions._HF_SLICE_LOGITS_TO_KEEP


def test_logits_to_keep_without_hf_slice_function(monkeypatch):
    # transformers 5.17 indexes hidden_states[:, logits_to_keep, :] itself and documents int
    # and 1-D forms only: those must still match, a 2-D tensor must raise a clear error.
    from liger_kernel.transformers import hf_versions

    monkeypatch.setattr(hf_versions, "hf_slice_logits_to_keep", lambda: None)
    reference, patched = _pair()
    input_ids = random_batch(VOCAB, seed=15)["input_ids"]
    seq = input_ids.shape[1]
    for logits_to_keep in (0, 3, torch.tensor([2, seq - 1], device=DEVICE)):
        ref_out, _ = _run(reference, train=False, input_ids=input_ids, logits_to_keep=logits_to_keep)
        out, _ = _run(patched, train=False, input_ids=input_ids, logits_to_keep=logits_to_keep)
        torch.testing.assert_close(out.logits, ref_out.logits, **TOL)
    for form in ("positions", "mask"):
        with pytest.raises(ValueError, match="logits_to_keep of shape"):
            patched(input_ids=input_ids, logits_to_keep=_two_dim_logits_to_keep(form, *input_ids.shape))


@pytest.mark.parametrize("path", ["fused", "logits_train", "logits_eval"])
def test_all_ignored_labels_give_zero_loss_and_zero_grads(path):
    # The library's convention (liger_cross_entropy): a mean over no counted target is 0
    # with zero gradients, never NaN - on the fused path and on the logits path alike.
    _, patched = _pair()
    batch = random_batch(VOCAB, seed=16)
    batch["labels"] = torch.full_like(batch["labels"], -100)
    options = {"fused": dict(train=True), "logits_train": dict(train=True, skip_logits=False),
               "logits_eval": dict(train=False)}[path]
    out, grads = _run(patched, **batch, **options)
    assert (out.logits is None) == (path == "fused")
    assert out.loss.item() == 0.0
    if path != "logits_eval":
        assert grads and all(torch.count_nonzero(g) == 0 for g in grads.values())
    # Shifted targets that are all ignored (the last position of every row is ignored anyway).
    shift_labels = torch.full_like(batch["labels"], -100)
    out, _ = _run(patched, input_ids=batch["input_ids"], shift_labels=shift_labels, **options)
    assert out.loss.item() == 0.0


@pytest.mark.parametrize("order", ["patch_then_offload", "offload_then_patch"])
def test_accelerate_cpu_offload_matches_unpatched(order):
    # accelerate's offload keeps the weights on the meta device until each module's hook
    # loads them: the fused lm-head loss runs inside lm_head's hook, and the fused down
    # projection calls such a module instead of reading its weight.
    accelerate = pytest.importorskip("accelerate")

    reference = build_model("llama", seed=7)
    patched = copy.deepcopy(reference)
    if order == "patch_then_offload":
        _apply_liger_kernel_to_instance(patched)
    accelerate.cpu_offload(patched, execution_device=torch.device(DEVICE))
    if order == "offload_then_patch":
        _apply_liger_kernel_to_instance(patched)
    assert _instance_patched(patched) and _instance_patched(patched.model.layers[0].mlp)
    assert patched.lm_head.weight.device.type == "meta"
    assert patched.model.layers[0].mlp.down_proj.weight.device.type == "meta"
    batch = random_batch(VOCAB, seed=17)
    for train in (True, False):
        reference.train(train)
        patched.train(train)
        ref_out, out = reference(**batch), patched(**batch)
        torch.testing.assert_close(out.loss, ref_out.loss, **TOL)
        if not train:
            torch.testing.assert_close(out.logits, ref_out.logits, **TOL)


def test_accelerate_dispatch_without_offload_keeps_the_fused_loss(monkeypatch):
    # device_map dispatch (several GPUs, or force_hooks) puts a hook on lm_head with its
    # weights in place: the loss stays fused (run inside the hook), no (B, T, V) logits.
    accelerate = pytest.importorskip("accelerate")
    import liger_kernel.transformers.fused_linear_cross_entropy as flce

    fused_calls = []
    original = flce.liger_fused_linear_cross_entropy
    monkeypatch.setattr(flce, "liger_fused_linear_cross_entropy",
                        lambda *args, **kwargs: fused_calls.append(1) or original(*args, **kwargs))
    reference = build_model("llama", seed=7)
    patched = copy.deepcopy(reference)
    _apply_liger_kernel_to_instance(patched)
    accelerate.dispatch_model(patched, device_map={"": DEVICE}, force_hooks=True)
    assert getattr(patched.lm_head, "_hf_hook", None) is not None
    head_outputs = []
    patched.lm_head.register_forward_hook(lambda module, args, output: head_outputs.append(output.shape))
    batch = random_batch(VOCAB, seed=17)
    reference.train()
    patched.train()
    ref_out, out = reference(**batch), patched(**batch)
    torch.testing.assert_close(out.loss, ref_out.loss, **TOL)
    assert fused_calls and all(shape[-1:] != (VOCAB,) for shape in head_outputs)
    ref_out.loss.backward()
    out.loss.backward()
    for (name, ref_param), param in zip(reference.named_parameters(), patched.parameters()):
        torch.testing.assert_close(param.grad, ref_param.grad, **TOL, msg=name)


def test_return_dict_false_gives_hf_tuples():
    reference, patched = _pair()
    batch = random_batch(VOCAB, seed=5)
    for train, kwargs in ((True, {}), (False, {}), (False, {"use_cache": False})):
        ref_out, _ = _run(reference, train=train, **batch, return_dict=False, **kwargs)
        out, _ = _run(patched, train=train, **batch, return_dict=False, **kwargs)
        assert isinstance(out, tuple)
        torch.testing.assert_close(out[0], ref_out[0], **TOL)
        if not train:
            assert len(out) == len(ref_out)
            torch.testing.assert_close(out[1], ref_out[1], **TOL)
        else:
            assert len(out) == len(ref_out) - 1  # no logits in training


def test_skip_logits():
    reference, patched = _pair()
    batch = random_batch(VOCAB, seed=6)
    ref_eval, _ = _run(reference, train=False, **batch)

    out, _ = _run(patched, train=False, **batch)  # eval: logits by default
    torch.testing.assert_close(out.logits, ref_eval.logits, **TOL)
    torch.testing.assert_close(out.loss, ref_eval.loss, **TOL)

    out, _ = _run(patched, train=False, **batch, skip_logits=True)  # the Trainer's prediction_loss_only
    assert out.logits is None
    torch.testing.assert_close(out.loss, ref_eval.loss, **TOL)

    ref_train, ref_grads = _run(reference, **batch)
    out, grads = _run(patched, **batch, skip_logits=False)
    torch.testing.assert_close(out.logits, ref_train.logits, **TOL)
    torch.testing.assert_close(out.loss, ref_train.loss, **TOL)
    _assert_same_grads(grads, ref_grads)

    out, _ = _run(patched, input_ids=batch["input_ids"])  # training without labels: logits
    assert out.loss is None and out.logits.shape == (2, batch["input_ids"].shape[1], VOCAB)
    with pytest.raises(ValueError, match="skip_logits"):
        patched(input_ids=batch["input_ids"], skip_logits=True)


def test_gemma2_final_logit_softcapping():
    reference, patched = _pair("gemma2")
    assert reference.config.final_logit_softcapping is not None
    batch = random_batch(VOCAB, seed=7)
    ref_out, ref_grads = _run(reference, **batch)
    out, grads = _run(patched, **batch)
    torch.testing.assert_close(out.loss, ref_out.loss, **TOL)
    _assert_same_grads(grads, ref_grads)
    ref_eval, _ = _run(reference, train=False, **batch)
    out_eval, _ = _run(patched, train=False, **batch)
    assert out_eval.logits.abs().max() <= reference.config.final_logit_softcapping
    torch.testing.assert_close(out_eval.logits, ref_eval.logits, **TOL)


def test_mixtral_router_aux_loss():
    from transformers.modeling_outputs import MoeCausalLMOutputWithPast

    reference, patched = _pair("mixtral")
    batch = random_batch(VOCAB, seed=8)
    ref_out, ref_grads = _run(reference, **batch, output_router_logits=True)
    out, grads = _run(patched, **batch, output_router_logits=True)
    assert isinstance(out, MoeCausalLMOutputWithPast)
    torch.testing.assert_close(out.aux_loss, ref_out.aux_loss, **TOL)
    torch.testing.assert_close(out.loss, ref_out.loss, **TOL)
    assert len(out.router_logits) == reference.config.num_hidden_layers
    _assert_same_grads(grads, ref_grads)
    out, _ = _run(patched, **batch)  # config default: no router logits
    assert out.aux_loss is None


def test_cross_entropy_option_uses_liger_loss_on_logits():
    reference, patched = _pair(cross_entropy=True, fused_linear_cross_entropy=False)
    assert patched.loss_function is liger_causal_lm_loss
    batch = random_batch(VOCAB, seed=9)
    for extra in ({}, {"num_items_in_batch": torch.tensor(17, device=DEVICE)}):
        ref_out, ref_grads = _run(reference, **batch, **extra)
        out, grads = _run(patched, **batch, **extra)
        torch.testing.assert_close(out.loss, ref_out.loss, **TOL)
        torch.testing.assert_close(out.logits, ref_out.logits, **TOL)  # not overwritten by the gradient
        _assert_same_grads(grads, ref_grads)


@pytest.mark.parametrize("model_type", ["llama", "gemma2", "mixtral", "phi3"])
def test_greedy_generate_matches_unpatched(model_type):
    reference, patched = _pair(model_type)
    prompt = random_batch(VOCAB, batch=2, seq=6, seed=10)
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    reference.eval()
    patched.eval()
    expected = reference.generate(prompt["input_ids"], attention_mask=prompt["attention_mask"], **kwargs)
    got = patched.generate(prompt["input_ids"], attention_mask=prompt["attention_mask"], **kwargs)
    torch.testing.assert_close(got, expected, atol=0, rtol=0)


def test_gradient_checkpointing():
    reference, patched = _pair()
    for model in (reference, patched):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    batch = random_batch(VOCAB, seed=11)
    ref_out, ref_grads = _run(reference, **batch)
    out, grads = _run(patched, **batch)
    torch.testing.assert_close(out.loss, ref_out.loss, **TOL)
    _assert_same_grads(grads, ref_grads)


def test_class_level_forward_matches_hf():
    from liger_kernel.transformers import liger_kernel_patched

    reference = build_model("qwen3", seed=12)
    batch = random_batch(VOCAB, seed=12)
    ref_out, ref_grads = _run(reference, **batch)
    with liger_kernel_patched("qwen3"):
        patched = build_model("qwen3", seed=12)
        out, grads = _run(patched, **batch)
    assert out.logits is None
    torch.testing.assert_close(out.loss, ref_out.loss, **TOL)
    _assert_same_grads(grads, ref_grads)


def test_wrapped_lm_head_falls_back_to_exact_logits_path():
    # A LoRA adapter on lm_head changes the head's output; the fused kernel, which reads
    # lm_head.weight, would silently drop it, so the forward must take the logits path.
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, target_modules=["lm_head", "q_proj"], lora_dropout=0.0)
    lora = peft.get_peft_model(build_model("llama", seed=13), config)
    with torch.no_grad():
        for name, param in lora.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.1)
    reference = copy.deepcopy(lora)
    _apply_liger_kernel_to_instance(lora)
    batch = random_batch(VOCAB, seed=13)
    ref_out, ref_grads = _run(reference, **batch)
    out, grads = _run(lora, **batch)
    assert out.logits is None
    torch.testing.assert_close(out.loss, ref_out.loss, **TOL)
    _assert_same_grads(grads, ref_grads)


# The fused forward's steps, each on its own.

def test_forward_inputs_takes_the_loss_only_keywords():
    from types import SimpleNamespace

    from liger_kernel.transformers.causal_lm import FusedLossSpec, forward_inputs

    labels = torch.randint(0, VOCAB, (2, 5))
    kwargs = {"num_items_in_batch": 7, "ignore_index": -1, "cache": "kv", "return_dict": False, "other": 1}
    inputs = forward_inputs(SimpleNamespace(return_dict=True), FusedLossSpec(), labels, None, kwargs)
    assert kwargs == {"other": 1}  # what stays goes to the decoder
    assert inputs.labels is labels and inputs.shift_labels is None and inputs.has_targets
    assert (inputs.num_items_in_batch, inputs.ignore_index, inputs.return_dict, inputs.past_key_values) == (
        7, -1, False, "kv")

    unshifted = FusedLossSpec(shifts_labels=False, counts_items=False)
    inputs = forward_inputs(SimpleNamespace(return_dict=True), unshifted, labels, "given", {"num_items_in_batch": 7})
    assert inputs.labels is None and inputs.shift_labels is labels  # already the targets
    assert inputs.num_items_in_batch is None and inputs.return_dict and inputs.past_key_values == "given"
    assert not forward_inputs(SimpleNamespace(), FusedLossSpec(), None, None, {}).has_targets


def test_router_logits_wanted_order():
    from types import SimpleNamespace

    from liger_kernel.transformers.causal_lm import FusedLossSpec, router_logits_wanted

    config = SimpleNamespace(output_router_logits=True)
    assert router_logits_wanted(FusedLossSpec(), config, None)
    assert not router_logits_wanted(FusedLossSpec(), config, False)  # the call wins
    assert not router_logits_wanted(FusedLossSpec(router_logits_default=False), config, None)  # then the signature
    assert not router_logits_wanted(FusedLossSpec(), SimpleNamespace(), None)  # nothing says: off


def test_head_features_applies_the_transform_and_keeps_positions():
    from liger_kernel.transformers.causal_lm import FusedLossSpec, head_features

    model = build_model("llama", seed=3)
    model.head_scale = torch.nn.Linear(model.config.hidden_size, model.config.hidden_size)
    hidden = torch.randn(2, 6, model.config.hidden_size, device=DEVICE)
    features, lm_head, logits_head = head_features(model, FusedLossSpec(), hidden, 2)
    assert lm_head is model.lm_head and logits_head is lm_head
    torch.testing.assert_close(features, hidden[:, -2:])
    features, _, _ = head_features(model.to(DEVICE), FusedLossSpec(head_transform_attr="head_scale"), hidden, 0)
    torch.testing.assert_close(features, model.head_scale(hidden))


def test_may_fuse_only_a_plain_linear_head(caplog):
    from liger_kernel.transformers.causal_lm import may_fuse

    linear = torch.nn.Linear(4, 8, bias=False)
    assert may_fuse(linear, linear, skip_logits=True)
    assert not may_fuse(linear, torch.nn.Sequential(linear), skip_logits=True)  # logits come from a head module
    embedding = torch.nn.Embedding(8, 4)
    with caplog.at_level("WARNING", logger="liger_kernel"):
        assert not may_fuse(embedding, embedding, skip_logits=True)
    assert "not an nn.Linear" in caplog.text


def test_fused_loss_matches_the_loss_from_logits():
    """The fused step and the unfused step give the same loss for the same features, with a
    scale and a soft-cap; targets that do not match the kept positions raise."""
    from liger_kernel.transformers.causal_lm import (
        FusedLossSpec,
        LogitTransform,
        forward_inputs,
        fused_loss,
        loss_from_logits,
    )

    model = build_model("llama", seed=5)
    features = torch.randn(2, 7, model.config.hidden_size, device=DEVICE)
    labels = torch.randint(0, VOCAB, (2, 7), device=DEVICE)
    labels[1, :3] = -100
    inputs = forward_inputs(model.config, FusedLossSpec(), labels, None, {"num_items_in_batch": 9})
    transform = LogitTransform(scale=3.0, softcap=2.0)
    fused = fused_loss(model.lm_head, features, inputs, transform, 0)
    reference = copy.deepcopy(model).to(torch.float64)  # the float64 reference of the unfused step
    unfused = loss_from_logits(reference, transform(reference.lm_head(features.double())), inputs)
    torch.testing.assert_close(fused, unfused.to(fused.dtype), **TOL)
    with pytest.raises(ValueError, match="logits_to_keep"):
        fused_loss(model.lm_head, features[:, -2:], inputs, transform, 2)


def test_model_output_tuple_and_moe_fields():
    from transformers.modeling_outputs import BaseModelOutputWithPast, MoeModelOutputWithPast

    from liger_kernel.transformers.causal_lm import FusedLossSpec, model_output

    model = build_model("llama", seed=2)
    loss, logits = torch.tensor(1.5), torch.zeros(1, 2, 3)
    outputs = BaseModelOutputWithPast(last_hidden_state=torch.zeros(1, 2, 4))
    output = model_output(model, FusedLossSpec(), outputs, loss, logits, False, None)
    assert type(output).__name__ == "CausalLMOutputWithPast"
    assert output.loss is loss and output.logits is logits and output.to_tuple()[:2] == (loss, logits)
    moe = FusedLossSpec(router_aux_loss_fn="transformers.models.mixtral.modeling_mixtral:load_balancing_loss_func")
    outputs = MoeModelOutputWithPast(last_hidden_state=torch.zeros(1, 2, 4), router_logits=(torch.randn(4, 3),))
    output = model_output(model, moe, outputs, loss, logits, False, None)
    assert type(output).__name__ == "MoeCausalLMOutputWithPast"
    assert output.aux_loss is None and output.loss is loss and output.router_logits is outputs.router_logits
