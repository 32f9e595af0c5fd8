"""The patching mechanism: generated apply functions, class-level patch and revert, instance
patching (every norm / MLP / attention, other instances untouched; user subclasses), kwargs
filtering, weight initialisation, pickling of patched models, and forward/backward equality
with the unpatched HF model for every family.

Models are the tiny configs of :mod:`tests.transformers.model_configs` in fp32; the Liger
kernels differ from HF's PyTorch ops only by rounding (a few fp32 ulps per op), so one
forward/backward agrees to ~1e-5 absolute on O(1) losses, logits and gradients.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import logging
import os

import pytest
import torch

pytest.importorskip("transformers")

from liger_kernel.transformers import (
    MODEL_TYPE_TO_APPLY_LIGER_FN,
    _apply_liger_kernel,
    _apply_liger_kernel_to_instance,
    liger_kernel_patched,
    revert_liger_kernel,
)
from liger_kernel.transformers.families import FAMILIES
from liger_kernel.transformers.monkey_patch import (
    _instance_patched,
    with_global_overrides,
)
from liger_kernel.transformers.rms_norm import LigerRMSNorm
from tests.transformers.model_configs import (
    MODEL_TYPES,
    VOCAB,
    build_model,
    loss_and_grads,
    random_batch,
    tiny_config,
)
from tests.utils import DEVICE

# fp32 forward/backward of a 2-layer model: a few ulps per kernel, accumulated over layers.
FP32_TOL = {"atol": 2e-5, "rtol": 1e-4}


@pytest.fixture(autouse=True)
def _revert_class_patches():
    yield
    revert_liger_kernel()


def _modeling(model_type: str):
    return importlib.import_module(FAMILIES[model_type].modeling_module)


def _bound_in_instance(module, name: str = "forward") -> bool:
    return _instance_patched(module, name)


def test_every_family_has_a_generated_apply_function():
    import liger_kernel.transformers as lt

    assert set(MODEL_TYPES) <= set(MODEL_TYPE_TO_APPLY_LIGER_FN)  # the table; discovery adds the rest
    for model_type in MODEL_TYPES:
        fn = getattr(lt, f"apply_liger_kernel_to_{model_type}")
        assert fn is MODEL_TYPE_TO_APPLY_LIGER_FN[model_type]
        activation = "geglu" if model_type.startswith("gemma") else "swiglu"
        params = inspect.signature(fn).parameters
        assert list(params) == ["rope", "cross_entropy", "fused_linear_cross_entropy", "rms_norm", activation, "model",
                                "recompute_norm_outputs", "in_place"]
        assert [p.default for p in params.values()] == [True, False, True, True, True, None, True, True]
        with pytest.raises(TypeError):
            fn(not_an_option=True)


@pytest.mark.parametrize("model_type", ["llama", "gemma"])
def test_cross_entropy_and_fused_linear_cross_entropy_are_exclusive(model_type):
    fn = MODEL_TYPE_TO_APPLY_LIGER_FN[model_type]
    with pytest.raises(ValueError, match="cross_entropy"):
        fn(cross_entropy=True, fused_linear_cross_entropy=True)
    with pytest.raises(ValueError, match="cross_entropy"):
        fn(cross_entropy=True, fused_linear_cross_entropy=True, model=build_model(model_type))


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_class_level_patch_and_revert(model_type):
    family = FAMILIES[model_type]
    modeling = _modeling(model_type)
    causal_lm = getattr(modeling, family.causal_lm_class)
    is_experts = family.mlp.kind == "experts"
    names = [family.norm.class_name, family.rotary_fn] + ([] if is_experts else [family.mlp.class_name])
    originals = {name: getattr(modeling, name) for name in names}
    original_forward = causal_lm.forward
    experts_class = getattr(modeling, family.mlp.class_name)
    original_experts_forward = experts_class.forward
    reference = build_model(model_type, seed=0)

    MODEL_TYPE_TO_APPLY_LIGER_FN[model_type]()
    for name in names:
        assert getattr(modeling, name) is not originals[name], name
    assert causal_lm.forward is not original_forward
    if is_experts:
        assert getattr(modeling, family.mlp.class_name) is experts_class
        assert experts_class.forward is not original_experts_forward
    model = build_model(model_type, seed=0)
    norms = [m for m in model.modules() if isinstance(m, LigerRMSNorm)]
    assert len(norms) == 1 + len(family.norm.layer_attrs) * model.config.num_hidden_layers
    assert all(n.offset == family.norm.offset and n.casting_mode == family.norm.casting_mode for n in norms)
    assert all("RMSNorm" in type(n).__name__ for n in norms)  # HF _init_weights finds norms by name

    # A class-patched model computes what HF computes, and survives deepcopy.
    for m in (model, reference):
        m.train()
    batch = random_batch(VOCAB, seed=6)
    ref_loss, ref_grads = loss_and_grads(reference, batch)
    loss, grads = loss_and_grads(copy.deepcopy(model), batch)
    torch.testing.assert_close(loss, ref_loss, **FP32_TOL)
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], **FP32_TOL, msg=name)

    revert_liger_kernel(model_type)
    for name in names:
        assert getattr(modeling, name) is originals[name], name
    assert causal_lm.forward is original_forward
    assert experts_class.forward is original_experts_forward
    fresh = build_model(model_type)
    assert not any(isinstance(m, LigerRMSNorm) for m in fresh.modules())


def test_context_manager_restores_including_an_enclosing_patch():
    modeling = _modeling("llama")
    original_norm, original_rope = modeling.LlamaRMSNorm, modeling.apply_rotary_pos_emb
    with liger_kernel_patched("llama", rope=False):
        assert modeling.LlamaRMSNorm is not original_norm
        assert modeling.apply_rotary_pos_emb is original_rope
        assert isinstance(build_model("llama").model.norm, LigerRMSNorm)
    assert modeling.LlamaRMSNorm is original_norm

    _apply_liger_kernel("llama", rope=False)
    patched_norm = modeling.LlamaRMSNorm
    with liger_kernel_patched("llama"):
        assert modeling.apply_rotary_pos_emb is not original_rope
    assert modeling.LlamaRMSNorm is patched_norm  # the outer patch survives the block
    assert modeling.apply_rotary_pos_emb is original_rope
    revert_liger_kernel("llama")
    assert modeling.LlamaRMSNorm is original_norm


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_class_patched_init_matches_unpatched(model_type):
    # HF's _init_weights recognises norms by class name (Gemma re-initialises them to zeros):
    # the patched classes must give bit-identical initial weights for the same seed, both
    # from the constructor (post_init) and from an explicit model.apply(model._init_weights).
    reference = build_model(model_type, seed=3)
    with liger_kernel_patched(model_type):
        patched = build_model(model_type, seed=3)
        assert isinstance(patched.model.norm, LigerRMSNorm)
        for model in (reference, patched):
            for p in model.parameters():
                p.data.uniform_()  # scramble, so _init_weights has to do the work
            torch.manual_seed(11)
            model.apply(model._init_weights)
    ref_state, patched_state = reference.state_dict(), patched.state_dict()
    assert list(ref_state) == list(patched_state)
    for name, value in ref_state.items():
        torch.testing.assert_close(patched_state[name], value, atol=0, rtol=0, msg=name)
    expected = 0.0 if FAMILIES[model_type].norm.init_fn == "zeros" else 1.0
    assert torch.all(patched.model.norm.weight == expected)
    fresh_ref, fresh_patched = build_model(model_type, seed=5), None
    with liger_kernel_patched(model_type):
        fresh_patched = build_model(model_type, seed=5)
    for name, value in fresh_ref.state_dict().items():
        torch.testing.assert_close(fresh_patched.state_dict()[name], value, atol=0, rtol=0, msg=name)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_instance_patching_matches_hf_and_leaves_others_alone(model_type):
    family = FAMILIES[model_type]
    reference = build_model(model_type, seed=1)
    model = copy.deepcopy(reference)
    bystander = copy.deepcopy(reference)
    _apply_liger_kernel_to_instance(model)

    norms = [m for m in model.modules() if type(m).__name__ == family.norm.class_name]
    assert len(norms) == 1 + len(family.norm.layer_attrs) * model.config.num_hidden_layers
    assert all(_bound_in_instance(n) for n in norms)
    for layer in model.model.layers:
        mlp = layer.mlp
        target = getattr(mlp, family.mlp.experts_attr) if family.mlp.kind == "experts" else mlp
        assert _bound_in_instance(target)
        assert _bound_in_instance(layer.self_attn)  # rotary rebound for this instance only
    assert _bound_in_instance(model)
    # The class, the module and the other instance are untouched.
    assert not any(_bound_in_instance(m) for m in bystander.modules())
    modeling = _modeling(model_type)
    assert getattr(modeling, family.rotary_fn).__module__ == modeling.__name__

    batch = random_batch(VOCAB, seed=5)
    model.train()
    reference.train()
    ref_loss, ref_grads = loss_and_grads(reference, batch)
    loss, grads = loss_and_grads(model, batch)
    torch.testing.assert_close(loss, ref_loss, **FP32_TOL)
    assert grads.keys() == ref_grads.keys()
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], **FP32_TOL, msg=name)

    # deepcopy keeps the patch, bound to the copy.
    clone = copy.deepcopy(model)
    assert clone.forward.__self__ is clone
    assert clone.model.norm.forward.__self__ is clone.model.norm
    torch.testing.assert_close(clone(**batch).loss, loss, **FP32_TOL)


def test_instance_rope_uses_the_liger_kernel_only_for_that_instance(monkeypatch):
    from liger_kernel.transformers import rope as liger_rope_module

    calls = []
    real = liger_rope_module.liger_rotary_pos_emb

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(liger_rope_module, "liger_rotary_pos_emb", counting)
    patched = build_model("llama")
    other = build_model("llama")
    _apply_liger_kernel_to_instance(patched, rms_norm=False, swiglu=False, fused_linear_cross_entropy=False)
    batch = random_batch(VOCAB, seed=2)
    other(**batch)
    assert calls == []
    patched(**batch)
    assert len(calls) == patched.config.num_hidden_layers


def test_with_global_overrides_rebuilds_decorator_chains():
    import functools

    def decorator(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            return ("wrapped", fn(*args, **kwargs))

        return wrapper

    @decorator
    def uses_global(x):
        return inspect.isfunction(x)

    rebound = with_global_overrides(uses_global, {"inspect": type("Fake", (), {"isfunction": staticmethod(str)})})
    assert uses_global(1) == ("wrapped", False)
    assert rebound(1) == ("wrapped", "1")
    assert rebound.__wrapped__ is not uses_global.__wrapped__
    assert with_global_overrides(uses_global, {"inspect": rebound.__wrapped__.__globals__["inspect"]}) is rebound


def test_kwargs_filtering_drops_and_logs(caplog):
    model = build_model("gemma")
    with caplog.at_level(logging.WARNING, logger="liger_kernel"):
        _apply_liger_kernel_to_instance(model, swiglu=True, rope=False)
    assert "swiglu" in caplog.text
    assert _bound_in_instance(model.model.norm)
    assert not _bound_in_instance(model.model.layers[0].self_attn)  # rope=False was honoured

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="liger_kernel"):
        _apply_liger_kernel("llama", geglu=True, rope=False)
    assert "geglu" in caplog.text
    assert isinstance(build_model("llama").model.norm, LigerRMSNorm)

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="liger_kernel"):
        _apply_liger_kernel("not_a_model")
    assert "not_a_model" in caplog.text


@pytest.mark.parametrize("entry", ["class", "unsupported"])
def test_unknown_option_is_a_type_error(entry):
    """A keyword that is no patch option (a typo) raises instead of patching with defaults."""
    with pytest.raises(TypeError, match="rms_nrom"):
        if entry == "class":
            _apply_liger_kernel("llama", rms_nrom=False)
        else:
            _apply_liger_kernel("not_a_model", rms_nrom=False)


@pytest.mark.parametrize("model_type", ["llama", "olmo2"])
def test_instance_patch_drops_unknown_keywords_with_a_warning(model_type, caplog):
    """``_apply_liger_kernel_to_instance`` filters the keywords by the apply function's signature,
    as upstream Liger does (callers pass one set for every model type), and names what it
    dropped; the keywords it keeps are honoured. olmo2 is patched by discovery."""
    from liger_kernel.transformers import liger_patched_modules
    from tests.transformers.census.tiny_configs import tiny_model

    model = build_model(model_type) if model_type in FAMILIES else tiny_model(model_type)[0]
    with caplog.at_level(logging.WARNING, logger="liger_kernel"):
        report = _apply_liger_kernel_to_instance(model, rms_nrom=False, geglu=True, rope=False, rms_norm=False)
    assert "rms_nrom" in caplog.text and "geglu" in caplog.text
    assert report is not None and "rms_norm" not in report.patched and "rope" not in report.patched
    assert "" in liger_patched_modules(model)  # the fused loss, still on by default


def _axolotl_activation_kwargs(apply_fn, glu_activation: bool) -> dict:
    """axolotl 0.19's choice (plugin.py): ``geglu=`` when the signature lists it, else ``swiglu=``."""
    parameters = inspect.signature(apply_fn).parameters
    if "geglu" in parameters:
        return {"geglu": glu_activation}
    if "swiglu" in parameters:
        return {"swiglu": glu_activation}
    return {}


@pytest.mark.parametrize("model_type, activation", [
    ("llama", "swiglu"), ("gemma", "geglu"), ("olmo2", "swiglu"), ("qwen3_moe", "swiglu"), ("gemma3_text", "geglu"),
])
def test_apply_functions_list_the_activation_keyword_of_the_model(model_type, activation):
    """Each apply function takes only the gated-MLP keyword of the activation its model type
    uses (the table's family, else the default config's ``hidden_act``/``hidden_activation``),
    so a caller that picks the keyword by signature, like axolotl, switches the right kernel."""
    parameters = inspect.signature(MODEL_TYPE_TO_APPLY_LIGER_FN[model_type]).parameters
    assert [name for name in ("swiglu", "geglu") if name in parameters] == [activation]


@pytest.mark.parametrize("model_type", ["llama", "olmo2"])
def test_apply_functions_pickle_and_copy_by_name(model_type):
    import pickle

    fn = MODEL_TYPE_TO_APPLY_LIGER_FN[model_type]
    assert pickle.loads(pickle.dumps(fn)) is fn and copy.deepcopy(fn) is fn
    assert fn.__name__ == f"apply_liger_kernel_to_{model_type}" and fn.__doc__


@pytest.mark.parametrize("model_type", ["llama", "gemma", "olmo2"])
def test_glu_activation_false_by_signature_leaves_the_mlp_alone(model_type):
    """axolotl's ``liger_glu_activation: false`` on a model type: no MLP (or experts) patched."""
    from liger_kernel.transformers import liger_patched_modules
    from tests.transformers.census.tiny_configs import tiny_model

    apply_fn = MODEL_TYPE_TO_APPLY_LIGER_FN[model_type]
    for glu in (False, True):
        model = build_model(model_type) if model_type in FAMILIES else tiny_model(model_type)[0]
        report = apply_fn(model=model, rope=False, **_axolotl_activation_kwargs(apply_fn, glu))
        mlp_patched = any(name.endswith(".mlp") for name in liger_patched_modules(model))
        assert mlp_patched == glu, (glu, report.patched)
        assert "" in liger_patched_modules(model)


def test_patch_options_are_one_frozen_validated_object():
    import dataclasses

    from liger_kernel.transformers.monkey_patch import PatchOptions

    options = PatchOptions.from_kwargs(rope=False, in_place=0)
    assert options.rope is False and options.in_place is False and options.rms_norm is True
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.rope = True
    with pytest.raises(TypeError, match="not_an_option"):
        PatchOptions.from_kwargs(not_an_option=True)
    with pytest.raises(ValueError, match="cross_entropy"):
        PatchOptions.from_kwargs(cross_entropy=True)  # the fused loss is on by default
    with pytest.raises(TypeError, match="rope"):
        PatchOptions(rope="yes")


@pytest.mark.parametrize("kind", ["mock", "autospec", "partial", "callable_object"])
def test_registered_apply_function_may_be_any_callable(kind, monkeypatch, caplog):
    """The model-type registry holds callables, not necessarily functions: a ``Mock``, a
    ``functools.partial`` or an object with ``__call__`` has no ``__name__``."""
    import functools
    from unittest import mock

    from liger_kernel.transformers import monkey_patch

    calls = []

    def record(rope=True, rms_norm=True, model=None):
        calls.append({"rope": rope, "rms_norm": rms_norm, "model": model})

    class Recorder:
        def __call__(self, rope=True, rms_norm=True, model=None):
            record(rope=rope, rms_norm=rms_norm, model=model)

    fn = {
        "mock": mock.Mock(side_effect=lambda **kw: calls.append(kw)),
        "autospec": mock.create_autospec(record, side_effect=record),
        "partial": functools.partial(record, rms_norm=True),
        "callable_object": Recorder(),
    }[kind]
    monkeypatch.setitem(monkey_patch.MODEL_TYPE_TO_APPLY_LIGER_FN, "llama", fn)
    model = build_model("llama")
    with caplog.at_level(logging.WARNING, logger="liger_kernel"):
        _apply_liger_kernel("llama", rope=False, swiglu=False)
        _apply_liger_kernel_to_instance(model, rope=False, swiglu=False)
    assert [call["rope"] for call in calls] == [False, False]
    assert calls[1]["model"] is model
    if kind == "mock":  # takes **kwargs: gets every option
        assert calls[0] == {"rope": False, "swiglu": False}
    else:
        assert "swiglu" in caplog.text
    assert not _bound_in_instance(model.model.norm)  # the registered callable ran, not the table's


def test_instance_patch_checks_the_model_type():
    with pytest.raises(ValueError, match="model_type"):
        MODEL_TYPE_TO_APPLY_LIGER_FN["mistral"](model=build_model("llama"))


@pytest.mark.parametrize("patch_level", ["class", "instance"])
def test_unsupported_activation_keeps_the_hf_mlp(patch_level, caplog):
    config = tiny_config("llama", hidden_act="gelu")
    with caplog.at_level(logging.WARNING, logger="liger_kernel"):
        if patch_level == "class":
            _apply_liger_kernel("llama")
            model = build_model("llama", config=config)
        else:
            model = build_model("llama", config=config)
            _apply_liger_kernel_to_instance(model)
    mlp = model.model.layers[0].mlp
    assert type(mlp).__name__ == "LlamaMLP"  # not LigerLlamaMLP
    assert not _bound_in_instance(mlp)
    assert "hidden_act" in caplog.text


@pytest.mark.parametrize("experts_implementation", ["eager", "grouped_mm"])
def test_mixtral_experts_match_hf(experts_implementation):
    config = tiny_config("mixtral", experts_implementation=experts_implementation)
    reference = build_model("mixtral", config=config)
    if reference.config._experts_implementation != experts_implementation:
        pytest.skip(f"{experts_implementation} experts are not available here")
    model = copy.deepcopy(reference)
    _apply_liger_kernel_to_instance(model, rope=False, rms_norm=False, fused_linear_cross_entropy=False)
    from liger_kernel.ops import swiglu as swiglu_ops

    calls = []
    real_apply = swiglu_ops.LigerSiLUMulFunction.apply

    def counting(*args):
        calls.append(1)
        return real_apply(*args)

    batch = random_batch(VOCAB, seed=4)
    ref_loss, ref_grads = loss_and_grads(reference, batch)
    try:
        swiglu_ops.LigerSiLUMulFunction.apply = counting
        loss, grads = loss_and_grads(model, batch)
    finally:
        swiglu_ops.LigerSiLUMulFunction.apply = real_apply
    assert calls, "the Liger SiLU-mul kernel was not used"
    torch.testing.assert_close(loss, ref_loss, **FP32_TOL)
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], **FP32_TOL, msg=name)


def test_peft_wrapper_is_unwrapped():
    peft = pytest.importorskip("peft")
    model = build_model("llama")
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    _apply_liger_kernel_to_instance(lora)
    assert _bound_in_instance(model.model.norm)
    assert _bound_in_instance(model)


def test_instance_patch_makes_no_reference_cycle():
    """A patched model is freed by ``del`` alone (reference counting), as an unpatched HF
    model is: no method stored on the instance points back at it. Otherwise its (GPU)
    memory would stay until the garbage collector's next full pass."""
    import gc
    import weakref

    model = build_model("llama")
    _apply_liger_kernel_to_instance(model)
    assert _bound_in_instance(model) and _bound_in_instance(model.model.norm)
    assert _bound_in_instance(model.model.layers[0].mlp) and _bound_in_instance(model.model.layers[0].self_attn)
    alive = weakref.ref(model)
    gc.disable()
    try:
        del model
        assert alive() is None
    finally:
        gc.enable()


def test_instance_patch_keeps_class_names_and_reuses_classes():
    first, second = build_model("llama"), build_model("llama")
    hf_norm_class = type(first.model.norm)
    for model in (first, second):
        _apply_liger_kernel_to_instance(model)
    assert type(first).__name__ == "LlamaForCausalLM" and isinstance(first, type(build_model("llama")))
    assert type(first.model.norm).__name__ == "LlamaRMSNorm" and isinstance(first.model.norm, hf_norm_class)
    assert type(first.model.norm) is type(second.model.norm)  # one cached subclass per patch
    assert type(first) is type(second)
    # Patching again neither nests subclasses nor changes the result.
    patched_class = type(first.model.norm)
    _apply_liger_kernel_to_instance(first)
    assert type(first.model.norm) is patched_class
    assert "forward" not in vars(first) and "forward" not in vars(first.model.norm)


def test_instance_patch_runs_inside_an_accelerate_hook():
    """A model dispatched by accelerate (its hooks wrap ``forward`` on the instance) gets the
    Liger forwards inside the hooks: the hook still runs, and so does the patched code."""
    hooks = pytest.importorskip("accelerate.hooks")

    calls = []

    class Recorder(hooks.ModelHook):
        def pre_forward(self, module, *args, **kwargs):
            calls.append(type(module).__name__)
            return args, kwargs

    reference = build_model("llama")
    model = copy.deepcopy(reference)
    hooks.add_hook_to_module(model, Recorder())
    hooks.add_hook_to_module(model.model.norm, Recorder())
    _apply_liger_kernel_to_instance(model)
    assert _bound_in_instance(model) and _bound_in_instance(model.model.norm)
    batch = random_batch(VOCAB, seed=7)
    ref_loss, ref_grads = loss_and_grads(reference, batch)
    loss, grads = loss_and_grads(model, batch)
    assert calls == ["LlamaForCausalLM", "LlamaRMSNorm"]  # both hooks ran, once each
    torch.testing.assert_close(loss, ref_loss, **FP32_TOL)
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], **FP32_TOL, msg=name)
    assert model._old_forward.__func__ is type(model).forward  # the hook calls the Liger forward


def test_liger_patched_modules_lists_instance_and_class_level_patches():
    from liger_kernel.transformers import liger_patched_modules

    model = build_model("llama")
    assert liger_patched_modules(model) == []
    _apply_liger_kernel_to_instance(model)
    names = set(liger_patched_modules(model))
    layers = model.config.num_hidden_layers
    assert {"", "model.norm", "model.layers.0.mlp", "model.layers.0.self_attn"} <= names
    assert len(names) == 1 + 1 + layers * 4  # model, final norm; per layer 2 norms, MLP, attention
    with liger_kernel_patched("llama"):
        built = build_model("llama")
        class_names = set(liger_patched_modules(built))
    assert {"", "model.norm", "model.layers.0.input_layernorm", "model.layers.0.mlp"} <= class_names
    assert "model.layers.0.self_attn" not in class_names  # class-level RoPE swaps a function, not a forward
    # Reverting restores the class's forward; the Liger modules built meanwhile stay.
    assert "" not in liger_patched_modules(built) and "model.norm" in liger_patched_modules(built)


def _pickle_round_trip(model):
    import pickle

    return pickle.loads(pickle.dumps(model))


def _torch_save_round_trip(model):
    import io

    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("patch_level", ["instance", "class"])
def test_patched_model_pickles_saves_and_deepcopies(patch_level):
    """Pickle stores a class by module and qualified name: the cached same-named subclasses of
    instance patching and the type()-built Liger classes of class patching must still load,
    patched, and compute what the original computes."""
    from liger_kernel.transformers import liger_patched_modules, monkey_patch

    if patch_level == "instance":
        model = build_model("llama", seed=2)
        _apply_liger_kernel_to_instance(model)
    else:
        with liger_kernel_patched("llama"):
            model = build_model("llama", seed=2)
        assert type(model.model.norm).__name__ == "LigerLlamaRMSNorm"
    batch = random_batch(VOCAB, seed=9)
    loss_and_grads(model, batch)
    model.eval()
    expected = model(**batch).logits
    patched_names = liger_patched_modules(model)
    for round_trip in (_pickle_round_trip, _torch_save_round_trip, copy.deepcopy):
        clone = round_trip(model)
        for (name, module), (_, original) in zip(clone.named_modules(), model.named_modules()):
            assert type(module) is type(original), (round_trip.__name__, name)
        assert liger_patched_modules(clone) == patched_names
        torch.testing.assert_close(clone(**batch).logits, expected, atol=0, rtol=0)
    assert not hasattr(monkey_patch, "LigerNotAClass")  # the module's __getattr__ knows its names only


def test_pickled_patched_model_loads_in_a_fresh_process(tmp_path):
    # A process that has patched nothing has none of the dynamic classes yet: loading must
    # build them (the class-level ones through the module's __getattr__, the instance-level
    # ones through their reduction).
    import subprocess
    import sys

    # Saved on CPU. The child runs the kernels on the test device: the GPU where there is one,
    # else the Triton interpreter on CPU (on a GPU machine the image's interpreter may not run
    # at all, see tests.utils.cpu_interpreter_problem). The expected logits come from the
    # unpatched model, which runs anywhere.
    reference = build_model("llama", seed=3).cpu().eval()
    instance = copy.deepcopy(reference)
    _apply_liger_kernel_to_instance(instance)
    with liger_kernel_patched("llama"):
        class_level = build_model("llama", seed=3).cpu().eval()  # HF init: the reference's weights
    batch = random_batch(VOCAB, seed=10, device="cpu")
    path = tmp_path / "models.pt"
    torch.save({"models": [instance, class_level], "batch": batch, "logits": reference(**batch).logits}, path)
    script = (
        "import sys, torch\n"
        "from liger_kernel.transformers import liger_patched_modules\n"
        f"device = {DEVICE!r}\n"
        "saved = torch.load(sys.argv[1], weights_only=False)\n"
        "batch = {k: v.to(device) for k, v in saved['batch'].items()}\n"
        "for model in saved['models']:\n"
        "    assert liger_patched_modules(model), type(model)\n"
        "    logits = model.to(device)(**batch).logits.cpu()\n"
        f"    torch.testing.assert_close(logits, saved['logits'], **{FP32_TOL!r})\n"
        "print('loaded', [type(m.model.norm).__name__ for m in saved['models']])\n"
    )
    env = dict(os.environ)
    if DEVICE == "cpu":
        env["TRITON_INTERPRET"] = "1"
    result = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True,
                            env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "loaded ['LlamaRMSNorm', 'LigerLlamaRMSNorm']" in result.stdout


def test_subclass_of_the_causal_lm_is_patched(caplog):
    modeling = _modeling("llama")

    class MyLlama(modeling.LlamaForCausalLM):
        pass

    class MyLlamaWithForward(modeling.LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    config = tiny_config("llama")
    reference = build_model("llama", seed=4)
    batch = random_batch(VOCAB, seed=11)
    ref_loss, ref_grads = loss_and_grads(reference, batch)

    model = MyLlama(config).to(reference.device)
    model.load_state_dict(reference.state_dict())
    _apply_liger_kernel_to_instance(model)
    assert _bound_in_instance(model) and type(model).__name__ == "MyLlama" and isinstance(model, MyLlama)
    model.train()
    assert model(**batch).logits is None  # the fused-loss forward
    loss, grads = loss_and_grads(model, batch)
    torch.testing.assert_close(loss, ref_loss, **FP32_TOL)
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], **FP32_TOL, msg=name)

    # A subclass with its own forward keeps it (the rest of the model is still patched).
    own = MyLlamaWithForward(config).to(reference.device)
    with caplog.at_level(logging.WARNING, logger="liger_kernel"):
        _apply_liger_kernel_to_instance(own)
    assert "MyLlamaWithForward" in caplog.text
    assert not _bound_in_instance(own) and _bound_in_instance(own.model.norm)
    assert own.forward.__func__ is MyLlamaWithForward.forward
