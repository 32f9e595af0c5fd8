"""The Hub-kernel layers (liger_kernel.hub.layers) as the ``kernels`` package loads them from a build.

Each test builds the kernel repository from this checkout (scripts/build_hub_kernel.py), loads
it through ``kernels`` (``LocalLayerRepository`` + ``kernelize``, or transformers'
``from_pretrained(use_kernels=True)`` routes) and compares one training step of a tiny random
model with HF's own: the loss and every parameter gradient, with the patching tests' tolerance.
``kernels`` validates each layer against the class it replaces when it loads it. On a GPU the
same tests kernelize with ``device="cuda"`` (the build's cuda variant).

Where transformers does not accept the installed ``kernels`` (transformers 5.17 beside kernels
0.19), its hub decorators are no-ops: the tests that drive ``kernels.kernelize`` apply the ones its
modeling source declares (tests/hub/declared_hub_names.py), and the tests of transformers' own
routes skip. No test reaches the Hub: huggingface_hub is in offline mode, and the from_pretrained
routes run without transformers' default mapping.
"""

from __future__ import annotations

import copy
import importlib

import pytest
import torch
from torch import nn

kernels = pytest.importorskip("kernels")
transformers = pytest.importorskip("transformers")

from kernels import CUDAProperties, Device, LocalLayerRepository, Mode, kernelize, use_kernel_mapping  # noqa: E402

from tests.hub.declared_hub_names import apply_declared_hub_names, declared_decorators  # noqa: E402
from tests.hub.repository import (  # noqa: E402
    build_repository,
    offline_hub,  # noqa: F401 (an autouse fixture)
)
from tests.transformers.model_configs import VOCAB, loss_and_grads, random_batch, tiny_config  # noqa: E402
from tests.utils import DEVICE, assert_close  # noqa: E402

# As the patching tests (tests/transformers/test_monkey_patch.py): fp32 forward/backward of a
# 2-layer model, a few ulps per kernel accumulated over the layers.
FP32_TOL = {"atol": 2e-5, "rtol": 1e-4}

# The name ``LOCAL_KERNELS`` maps to the built repository for the routes that take a Hub id.
HUB_ID = "liger-local/liger-kernel"

# Hub name (or a layout's kernel name) -> the layer of the build that replaces it.
LAYERS = {
    "RMSNorm": "LigerRMSNorm",
    "rotary_pos_emb": "LigerRotaryPosEmb",
    "LigerSwiGLUMLP": "LigerSwiGLUMLP",
    "LigerFusedSwiGLUMLP": "LigerFusedSwiGLUMLP",
    "LigerGEGLUMLP": "LigerGEGLUMLP",
    "LigerGemmaRMSNorm": "LigerGemmaRMSNorm",
    "LigerSwiGLUExperts": "LigerSwiGLUExperts",
}

# HF class -> the layout the ``{Kernel}Layout`` route puts in its place.
LAYOUTS = {
    "llama": {"LlamaMLP": "LigerSwiGLUMLPLayout"},
    "qwen3": {"Qwen3MLP": "LigerSwiGLUMLPLayout"},
    "gemma3": {"Gemma3MLP": "LigerGEGLUMLPLayout", "Gemma3RMSNorm": "LigerGemmaRMSNormLayout"},
    "mixtral": {"MixtralExperts": "LigerSwiGLUExpertsLayout"},
    "phi3": {"Phi3MLP": "LigerFusedSwiGLUMLPLayout"},
}

# The names each model must run through the build.
EXPECTED = {
    "llama": {"RMSNorm", "rotary_pos_emb", "LigerSwiGLUMLP"},
    "qwen3": {"RMSNorm", "rotary_pos_emb", "LigerSwiGLUMLP"},
    "gemma3": {"rotary_pos_emb", "LigerGEGLUMLP", "LigerGemmaRMSNorm"},
    "mixtral": {"RMSNorm", "rotary_pos_emb", "LigerSwiGLUExperts"},
    "phi3": {"RMSNorm", "LigerFusedSwiGLUMLP"},  # Phi-3's rotary function has no hub name
}


# The modeling modules of the models under test, whose hub names kernelize looks up.
MODELING = {model_type: f"transformers.models.{model_type}.modeling_{model_type}"
            for model_type in ("llama", "qwen3", "gemma3", "mixtral", "phi3")}


def kernels_range() -> str:
    from transformers.utils import import_utils

    low, high = (getattr(import_utils, f"KERNELS_{end}_VERSION", "?") for end in ("MIN", "MAX"))
    return f"{low} <= kernels < {high}"


# transformers checks the installed kernels version against its own range; outside it,
# use_kernels, KernelConfig and register_kernel_mapping_transformers refuse to run and its hub
# decorators are no-ops (transformers 5.17 accepts 0.16.x only; docs/ecosystem.md).
needs_use_kernels = pytest.mark.skipif(
    not transformers.utils.is_kernels_available(),
    reason=f"transformers {transformers.__version__} accepts {kernels_range()}, not the installed "
           f"kernels {kernels.__version__}: its use_kernels integration refuses to run",
)


@pytest.fixture(scope="module")
def repository(tmp_path_factory):
    return build_repository(tmp_path_factory.mktemp("hub") / "liger-kernel")


@pytest.fixture(scope="module")
def layers(repository):
    """The build's ``layers`` module, as ``kernels`` imports it."""
    return kernels.get_local_kernel(repository).layers


@pytest.fixture
def hub_names(monkeypatch):
    """The hub names the models' modeling code declares, on its classes and rotary functions
    (applied here where transformers does not accept the installed kernels: tests/hub/
    declared_hub_names.py)."""
    for module_name in MODELING.values():
        apply_declared_hub_names(monkeypatch, module_name)


@pytest.fixture
def no_default_hub_mapping(monkeypatch):
    """transformers' default mapping (Hub repositories for RMSNorm, rotary_pos_emb, activations, ...
    on CUDA) left out of the from_pretrained routes: the tests load only the local build."""
    from transformers.integrations import hub_kernels

    monkeypatch.setattr(hub_kernels, "_KERNEL_MAPPING_CACHE", {})


@pytest.fixture
def patch_mapping():
    """transformers' global class-patch registry, restored after the test (KernelConfig's layout
    route registers into it)."""
    monkey_patching = pytest.importorskip("transformers.monkey_patching")
    saved = dict(monkey_patching.get_patch_mapping())
    yield
    monkey_patching.clear_patch_mapping()
    if saved:
        monkey_patching.register_patch_mapping(saved)


def gemma3_config():
    return transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=8, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=128, rms_norm_eps=1e-6,
        initializer_range=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
        attn_implementation="eager", hidden_activation="gelu_pytorch_tanh",
    )


def causal_lm_class(model_type: str) -> type:
    names = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "gemma3": "Gemma3ForCausalLM",
             "mixtral": "MixtralForCausalLM", "phi3": "Phi3ForCausalLM"}
    return getattr(transformers, names[model_type])


def reference_model(model_type: str) -> nn.Module:
    """HF's model with fresh weights; the norm weights moved off their init (ones or zeros), so
    that a wrong casting or offset shows."""
    config = gemma3_config() if model_type == "gemma3" else tiny_config(model_type)
    model = causal_lm_class(model_type)(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() == 1 and "norm" in name:
                parameter.add_(0.3 * torch.randn_like(parameter))
    return model.to(DEVICE)


def with_layouts(reference: nn.Module, model_type: str, layers) -> nn.Module:
    """A copy of the reference model with the build's layouts in place of HF's classes (what
    transformers' class patching does when a ``KernelConfig`` names a class), holding the
    reference's weights."""
    model = copy.deepcopy(reference)
    layouts = {hf_class: getattr(layers, layout) for hf_class, layout in LAYOUTS[model_type].items()}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            layout = layouts.get(type(child).__name__)
            if layout is None:
                continue
            if "RMSNorm" in layout.__name__:
                replacement = layout(child.weight.shape[0], eps=child.eps)
            else:
                replacement = layout(model.config)
            replacement.load_state_dict(child.state_dict())  # strict: the layouts keep HF's parameter names
            setattr(parent, name, replacement.to(DEVICE))
    assert {type(m).__name__ for m in model.modules()} >= set(LAYOUTS[model_type].values())
    return model


def repo(repository, name: str) -> LocalLayerRepository:
    return LocalLayerRepository(repository, layer_name=name)


def local_mapping(repository, device=DEVICE) -> dict:
    return {name: {device: repo(repository, layer)} for name, layer in LAYERS.items()}


def kernelized(model: nn.Module) -> dict[str, list[bool]]:
    """Per hub (or layout kernel) name in the model: whether each module of it runs a layer of a
    kernel (``kernels`` records the repository on the modules whose forward it replaced)."""
    found: dict[str, list[bool]] = {}
    for module in model.modules():
        name = getattr(type(module), "kernel_layer_name", None)
        if name is not None:
            found.setdefault(name, []).append("_kernel_repo" in module.__dict__)
        for function in getattr(module, "_kernel_funcs", {}).values():
            found.setdefault(function.kernel_layer_name, []).append("_kernel_repo" in function.__dict__)
    return found


def assert_kernelized(model: nn.Module, names: set[str]) -> None:
    found = kernelized(model)
    for name in names:
        assert found.get(name) and all(found[name]), f"{name}: {found.get(name)}"


def assert_same_step(model: nn.Module, reference: nn.Module) -> None:
    batch = random_batch(VOCAB, seed=5)
    ref_loss, ref_grads = loss_and_grads(reference, batch)
    loss, grads = loss_and_grads(model, batch)
    assert torch.isfinite(ref_loss)
    torch.testing.assert_close(loss, ref_loss, **FP32_TOL)
    assert grads.keys() == ref_grads.keys()
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], **FP32_TOL, msg=name)


def assert_probes_accepted(model: nn.Module, layers) -> None:
    """The hub-name layers ran the kernels: their probes accepted every class of the model."""
    classes = {type(m) for m in model.modules()}
    classes |= {type(f) for m in model.modules() for f in getattr(m, "_kernel_funcs", {}).values()}
    plans = {key: plan for key, plan in {**layers._NORM_PLANS, **layers._ROPE_PLANS}.items() if key[0] in classes}
    assert plans and all(plan is not None for plan in plans.values()), plans


def test_the_hub_is_out_of_reach():
    """A Hub request from these tests raises before it reaches the network."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import OfflineModeIsEnabled

    with pytest.raises(OfflineModeIsEnabled):
        HfApi().model_info("kernels-community/liger_kernels")


def test_declared_hub_names_are_the_ones_transformers_applies(monkeypatch):
    """The hub names read from the modeling source are the ones on transformers' classes and
    functions: applied by transformers where it accepts the installed kernels (nothing left to
    apply), else applied by the helper and removed again afterwards."""
    accepted = transformers.utils.is_kernels_available()
    for model_type, module_name in MODELING.items():
        applied = apply_declared_hub_names(monkeypatch, module_name)
        assert not applied if accepted else applied, (module_name, applied)
        module = importlib.import_module(module_name)
        hub_names, kernelized_funcs = declared_decorators(module_name)
        assert {name: getattr(module, name).kernel_layer_name for name in hub_names} == hub_names
        assert all(functions == ("apply_rotary_pos_emb",) for functions in kernelized_funcs.values())
        assert bool(kernelized_funcs) == (model_type != "phi3")  # Phi-3's rotary function has no hub name
    assert declared_decorators(MODELING["llama"]) == (
        {"LlamaRMSNorm": "RMSNorm", "apply_rotary_pos_emb": "rotary_pos_emb"},
        {"LlamaAttention": ("apply_rotary_pos_emb",)},
    )
    monkeypatch.undo()
    from transformers.models.llama import modeling_llama

    assert hasattr(modeling_llama.LlamaRMSNorm, "kernel_layer_name") == accepted
    assert hasattr(modeling_llama.apply_rotary_pos_emb, "kernel_layer_name") == accepted


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "gemma3", "mixtral", "phi3"])
def test_kernelize_matches_hf(model_type, repository, layers, hub_names):
    reference = reference_model(model_type)
    model = with_layouts(reference, model_type, layers)
    with use_kernel_mapping(local_mapping(repository)):
        kernelize(model, mode=Mode.TRAINING, device=DEVICE)
    assert_kernelized(model, EXPECTED[model_type])
    assert_same_step(model, reference)
    assert_probes_accepted(model, layers)
    if model_type == "llama":
        norm_plans = {key[0].__name__: plan for key, plan in layers._NORM_PLANS.items()}
        assert norm_plans["LlamaRMSNorm"].casting_mode == "llama"
        assert norm_plans["LlamaRMSNorm"].offset == 0.0


@needs_use_kernels
def test_global_mapping_route_through_from_pretrained(repository, layers, tmp_path, no_default_hub_mapping):
    """A mapping registered for the device, layouts patched in while the model is built, then
    ``from_pretrained(use_kernels=True)``: train() re-kernelizes with it in training mode."""
    reference = reference_model("llama")
    reference.save_pretrained(tmp_path)
    device = DEVICE
    if DEVICE == "cuda":
        # Registered for a narrower capability range than the default mapping's, as a user keeping
        # that mapping must (docs/ecosystem.md).
        device = Device(type="cuda", properties=CUDAProperties(min_capability=70, max_capability=1000))
    monkey_patching = pytest.importorskip("transformers.monkey_patching")
    # Not inheriting: a default mapping an earlier from_pretrained registered in this process would
    # send other layers (SiLU in inference) to the Hub.
    with use_kernel_mapping(local_mapping(repository, device), inherit_mapping=False):
        with monkey_patching.apply_patches({"LlamaMLP": layers.LigerSwiGLUMLPLayout}):
            model = transformers.LlamaForCausalLM.from_pretrained(tmp_path, use_kernels=True)
        model.to(DEVICE)
        model.train()
        assert_kernelized(model, EXPECTED["llama"])
        model.eval()
        model.train()  # a mode change re-kernelizes: still the build's layers
        assert_kernelized(model, EXPECTED["llama"])
        assert_same_step(model, reference)


@needs_use_kernels
def test_kernel_config_route_through_from_pretrained(repository, tmp_path, monkeypatch, patch_mapping,
                                                    no_default_hub_mapping):
    """``KernelConfig`` with hub names and a class-name key (the layout route), the Hub id served
    by ``LOCAL_KERNELS``. transformers 5.25 refuses device "cpu" in a KernelConfig and registers
    its mapping for the mode of the model at load (eval), so train() would drop the layers; the
    test applies the workarounds docs/ecosystem.md gives where they are needed."""
    from transformers.utils import kernel_config as kernel_config_module

    if DEVICE not in kernel_config_module.KERNELS_SUPPORTED_DEVICE_TYPES:
        monkeypatch.setattr(kernel_config_module, "KERNELS_SUPPORTED_DEVICE_TYPES",
                            [*kernel_config_module.KERNELS_SUPPORTED_DEVICE_TYPES, DEVICE])
    monkeypatch.setenv("LOCAL_KERNELS", f"{HUB_ID}={repository}")
    reference = reference_model("llama")
    reference.save_pretrained(tmp_path)

    def config(mlp_key: str) -> transformers.KernelConfig:
        mapping = {"RMSNorm": f"{HUB_ID}:LigerRMSNorm", "rotary_pos_emb": f"{HUB_ID}:LigerRotaryPosEmb",
                   mlp_key: f"{HUB_ID}:LigerSwiGLUMLP"}
        return transformers.KernelConfig(mapping, inherit_mapping=False)

    device_map = {"": DEVICE} if DEVICE == "cuda" else None
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path, use_kernels=True, kernel_config=config("LlamaMLP"),
                                                          device_map=device_map)
    assert type(model.model.layers[0].mlp).__name__ == "LigerSwiGLUMLPLayout"
    assert_kernelized(model, EXPECTED["llama"])  # in eval mode, as loaded
    model.train()
    if not all(all(found) for name, found in kernelized(model).items() if name in EXPECTED["llama"]):
        # The mapping was registered for inference only: register it again in training mode (the
        # layout already replaced LlamaMLP, so its key is now the kernel's name).
        model.set_use_kernels(True, config("LigerSwiGLUMLP"), mode=Mode.TRAINING)
    assert_kernelized(model, EXPECTED["llama"])
    assert_same_step(model, reference)


@needs_use_kernels
def test_a_narrower_cuda_range_wins_over_the_default_mapping(repository):
    """transformers registers its default mapping (RMSNorm -> kernels-community) again inside
    ``set_use_kernels``; between two repositories for the same capability range ``kernels`` picks by
    object id. A user mapping for a narrower range is picked for every GPU in it."""
    from kernels._internals.layer.globals import _KERNEL_MAPPING
    from transformers.integrations.hub_kernels import register_kernel_mapping_transformers

    ours = repo(repository, "LigerRMSNorm")
    narrow = Device(type="cuda", properties=CUDAProperties(min_capability=70, max_capability=1000))
    with use_kernel_mapping({"RMSNorm": {narrow: ours}, "rotary_pos_emb": {narrow: ours}}):
        register_kernel_mapping_transformers()
        for name in ("RMSNorm", "rotary_pos_emb"):
            for capability in (70, 90, 100, 120):
                chosen = _KERNEL_MAPPING.get()[name]["cuda"].repos_by_capability.find_smallest_interval(capability)
                assert chosen == {Mode.FALLBACK: ours}, (name, capability, chosen)


def test_norm_probe_keeps_a_class_of_other_math(repository):
    """A class under the hub name RMSNorm that is not an RMSNorm (it centres the row) keeps its
    own forward; one computing Gemma's (1 + w) runs the kernel with the offset."""

    @kernels.use_kernel_forward_from_hub("RMSNorm")
    class CentredNorm(nn.Module):
        def __init__(self, hidden: int) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(hidden))
            self.variance_epsilon = 1e-6

        def forward(self, hidden_states):
            x = hidden_states - hidden_states.mean(-1, keepdim=True)
            return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)

    @kernels.use_kernel_forward_from_hub("RMSNorm")
    class OffsetNorm(nn.Module):
        def __init__(self, hidden: int) -> None:
            super().__init__()
            self.weight = nn.Parameter(0.3 * torch.randn(hidden))
            self.eps = 1e-6

        def forward(self, hidden_states):
            x = hidden_states.float()
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
            return (x * (1.0 + self.weight.float())).type_as(hidden_states)

    layers = kernels.get_local_kernel(repository).layers
    for cls, expected in ((CentredNorm, None), (OffsetNorm, (1.0, "gemma"))):
        module = cls(24).to(DEVICE)
        x = torch.randn(3, 5, 24, device=DEVICE, requires_grad=True)
        own = cls.forward(module, x)
        with use_kernel_mapping({"RMSNorm": {DEVICE: repo(repository, "LigerRMSNorm")}}):
            kernelize(module, mode=Mode.TRAINING, device=DEVICE)
        assert "_kernel_repo" in module.__dict__
        torch.testing.assert_close(module(x), own, **FP32_TOL)
        plan = layers._NORM_PLANS[(cls, torch.float32, torch.float32, x.device.type, 24)]
        assert (plan if plan is None else (plan.offset, plan.casting_mode)) == expected


def attention_calling(function) -> nn.Module:
    """A module whose forward calls the hub-decorated ``function`` (as HF's attention classes do)."""

    @kernels.use_kernelized_func(function)
    class Attention(nn.Module):
        def forward(self, q, k, cos, sin):
            return function(q, k, cos, sin)

    return Attention()


def test_rope_probe_finds_interleaved_pairs_and_keeps_another_function(repository):
    """A GPT-J style rotary function (pairs (2i, 2i + 1)) runs the kernel in that layout; a
    function that is no rotation keeps its own code."""

    def rotate_pairs(x):
        return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)

    @kernels.use_kernel_forward_from_hub("rotary_pos_emb")
    def interleaved(q, k, cos, sin, unsqueeze_dim=1):
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        return q * cos + rotate_pairs(q) * sin, k * cos + rotate_pairs(k) * sin

    @kernels.use_kernel_forward_from_hub("rotary_pos_emb")
    def not_a_rotation(q, k, cos, sin, unsqueeze_dim=1):
        return 2 * q * cos.unsqueeze(unsqueeze_dim), k

    layers = kernels.get_local_kernel(repository).layers
    for function, interleaved_layout in ((interleaved, True), (not_a_rotation, None)):

        module = attention_calling(function)
        q, k = torch.randn(2, 4, 6, 8, device=DEVICE), torch.randn(2, 2, 6, 8, device=DEVICE)
        angles = torch.randn(1, 6, 4, device=DEVICE).repeat_interleave(2, dim=-1)
        cos, sin = angles.cos(), angles.sin()
        own = function(q, k, cos, sin)
        with use_kernel_mapping({"rotary_pos_emb": {DEVICE: repo(repository, "LigerRotaryPosEmb")}}):
            kernelize(module, mode=Mode.TRAINING, device=DEVICE)
        wrapper = module._kernel_funcs["rotary_pos_emb"]
        assert "_kernel_repo" in wrapper.__dict__
        for ours, theirs in zip(module(q, k, cos, sin), own):
            torch.testing.assert_close(ours, theirs, **FP32_TOL)
        plan = next(plan for key, plan in layers._ROPE_PLANS.items() if key[0] is type(wrapper))
        assert (plan if plan is None else plan.interleaved) == interleaved_layout


# The layer names of each published interface version (the Hub branch v<N>): changing
# ``__all__`` or a forward's parameters needs a new ``LAYERS_VERSION`` and an entry here.
PUBLISHED = {
    1: {
        "LigerRMSNorm": ["self", "hidden_states"],
        "LigerRotaryPosEmb": ["self", "q", "k", "cos", "sin", "unsqueeze_dim"],
        "LigerSwiGLUMLP": ["self", "x"],
        "LigerSwiGLUMLPLayout": ["self", "x"],
        "LigerFusedSwiGLUMLP": ["self", "x"],
        "LigerFusedSwiGLUMLPLayout": ["self", "x"],
        "LigerGEGLUMLP": ["self", "x"],
        "LigerGEGLUMLPLayout": ["self", "x"],
        "LigerGemmaRMSNorm": ["self", "x"],
        "LigerGemmaRMSNormLayout": ["self", "x"],
        "LigerSwiGLUExperts": ["self", "hidden_states", "top_k_index", "top_k_weights"],
        "LigerSwiGLUExpertsLayout": ["self", "hidden_states", "top_k_index", "top_k_weights"],
    },
}


def test_layers_version_pins_the_interface():
    import inspect

    from liger_kernel.hub import layers as source

    interface = {name: list(inspect.signature(getattr(source, name).forward).parameters) for name in source.__all__}
    assert interface == PUBLISHED[source.LAYERS_VERSION]


def test_kernels_validates_each_layer_against_the_classes_it_replaces(layers, hub_names):
    from kernels._internals.layer.layer import _validate_layer
    from transformers.models.gemma3 import modeling_gemma3
    from transformers.models.llama import modeling_llama
    from transformers.models.mixtral import modeling_mixtral
    from transformers.models.qwen3 import modeling_qwen3

    pairs = [(layers.LigerRMSNorm, norm) for norm in (modeling_llama.LlamaRMSNorm, modeling_qwen3.Qwen3RMSNorm,
                                                       modeling_mixtral.MixtralRMSNorm)]
    pairs += [(layers.LigerRotaryPosEmb, type(module.apply_rotary_pos_emb))
              for module in (modeling_llama, modeling_gemma3, modeling_mixtral)]
    pairs += [(getattr(layers, name), getattr(layers, f"{name}Layout"))
              for name in ("LigerSwiGLUMLP", "LigerFusedSwiGLUMLP", "LigerGEGLUMLP", "LigerGemmaRMSNorm",
                           "LigerSwiGLUExperts")]
    pairs.append((layers.LigerSwiGLUExperts, modeling_mixtral.MixtralExperts))
    for layer, replaced in pairs:
        _validate_layer(check_cls=replaced, cls=layer, repo=f"{layer.__name__} for {replaced.__name__}")
        assert layer.has_backward and not layer.can_torch_compile
    # The check is real: a layer with state is refused.
    stateful = type("Stateful", (layers.LigerRMSNorm,), {"cache": {}})
    with pytest.raises(TypeError):
        _validate_layer(check_cls=modeling_llama.LlamaRMSNorm, cls=stateful, repo="stateful")


def test_probe_tolerances_and_activation_names_are_the_patchings():
    from liger_kernel.hub import layers as source
    from liger_kernel.transformers.families import GELU_TANH_ACTIVATIONS, SILU_ACTIVATIONS
    from liger_kernel.transformers.patching.discovery import _PROBE_RTOL

    assert source.PROBE_RTOL == _PROBE_RTOL
    assert source.SILU_ACTIVATIONS == SILU_ACTIVATIONS
    assert source.GELU_TANH_ACTIVATIONS == GELU_TANH_ACTIVATIONS


def test_layouts_refuse_an_activation_the_kernel_does_not_compute(layers):
    config = tiny_config("llama", hidden_act="gelu")
    for layout in (layers.LigerSwiGLUMLPLayout, layers.LigerFusedSwiGLUMLPLayout, layers.LigerSwiGLUExpertsLayout):
        with pytest.raises(ValueError, match="hidden_act='gelu'"):
            layout(tiny_config("mixtral", hidden_act="gelu") if "Experts" in layout.__name__ else config)
    with pytest.raises(ValueError, match="hidden_act='silu'"):
        layers.LigerGEGLUMLPLayout(tiny_config("llama"))


def test_bf16_model_runs_the_kernels_within_bf16_of_a_float64_reference(repository, layers, hub_names):
    """In bf16 (how models train) the probes still accept Llama's norm and rotary function, and the
    loss stays within the bf16 tolerance of the float64 model's."""
    reference = reference_model("llama")
    batch = random_batch(VOCAB, seed=7)
    with torch.no_grad():
        exact = copy.deepcopy(reference).double()(**batch).loss
    model = with_layouts(reference, "llama", layers).to(torch.bfloat16)
    with use_kernel_mapping(local_mapping(repository)):
        kernelize(model, mode=Mode.TRAINING, device=DEVICE)
    assert_kernelized(model, EXPECTED["llama"])
    model.train()
    loss = model(**batch).loss
    loss.backward()
    assert_probes_accepted(model, layers)
    assert any(key[1] == torch.bfloat16 for key in layers._NORM_PLANS)
    assert_close(loss.detach(), exact, dtype=torch.bfloat16)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_gated_mlp_leaves_an_activation_a_hook_kept(repository, layers):
    """The gated MLP layers write the gate/up gradients over the activations only while no hook
    can see them: a forward hook on ``gate_proj`` that keeps its output still holds HF's values
    after backward, and the step is HF's."""
    reference = reference_model("llama")
    model = with_layouts(reference, "llama", layers)
    with use_kernel_mapping(local_mapping(repository)):
        kernelize(model, mode=Mode.TRAINING, device=DEVICE)
    assert_kernelized(model, {"LigerSwiGLUMLP"})
    kept = {}
    for name, net in (("hf", reference), ("kernel", model)):
        net.model.layers[0].mlp.gate_proj.register_forward_hook(
            lambda m, args, out, name=name: kept.__setitem__(name, out.detach()))
    assert_same_step(model, reference)
    torch.testing.assert_close(kept["kernel"], kept["hf"], **FP32_TOL)
