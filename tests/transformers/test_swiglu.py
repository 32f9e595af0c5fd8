"""LigerSwiGLUMLP / LigerPhi3SwiGLUMLP as drop-ins for HF ``LlamaMLP`` / ``Phi3MLP``.

Each Liger module loads the HF module's state dict (same parameter names and shapes), and
forward output, input gradient and every weight gradient are compared with the HF module
evaluated in float64 (the truth). fp32: norm-wise error <= 1e-5 of the norm of the sum,
over rows, of each row's absolute contribution (fp32 matmul accumulation plus one rounding of
the gating, relative to the terms summed). For the output and dx that sum is the exact result
itself; a weight or bias gradient sums over rows, and in the tiny 6-row case a bias gradient
is one sum of 6 terms that can cancel to far below its terms (1-3 in 1000 random draws failed a
bound relative to the exact sum alone, HF's own fp32 module as well as ours). Computing the
per-row contributions costs one float64 backward per row, so the larger cases (hundreds to
thousands of rows, where no single cancelling element dominates the norm) use the exact result
as the scale. bf16: the matmuls are HF's own, only the
gating differs (one rounding instead of HF's two), so our norm-wise distance to the truth
may not exceed HF's bf16 module's by more than 25% - or, where both are tiny, one bf16 unit
roundoff (2**-8), since then which of the two lands closer is luck.
"""

import copy

import pytest
import torch

from liger_kernel.transformers.functional import liger_swiglu
from liger_kernel.transformers.swiglu import LigerPhi3SwiGLUMLP, LigerSwiGLUMLP
from tests.utils import DEVICE, rel_error, shapes

transformers = pytest.importorskip("transformers")

# (hidden, intermediate, rows): odd sizes; the full set adds a Llama-like width.
# Norm-wise error any bf16 result may have whatever HF's happens to be: one unit roundoff.
BF16_UNIT_ROUNDOFF = 2.0**-8
BIG_SIZES = shapes(small=[(33, 123, 10)], full=[(256, 4231, 1007), (512, 14336, 64)])
# Cases with the low-precision comparison: (hidden, intermediate, rows, dtype). The tiny
# (8, 1, 3) case runs in fp32 only: its weight gradients are sums of 6 products with
# cancellation, where a 1-ulp difference in the gating is amplified at random for either side.
CASES = [(*size, dtype) for size in BIG_SIZES for dtype in (torch.float32, torch.bfloat16)]
CASES += [(8, 1, 3, torch.float32)]


def run_mlp(module, x, dy):
    """(output, dx, {name: dW}) of ``module`` at ``x`` with upstream gradient ``dy``."""
    module.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    y = module(x)
    y.backward(dy)
    return y.detach(), x.grad, {name: p.grad for name, p in module.named_parameters()}


# Up to this many rows the fp32 check scales by the per-row absolute contributions.
MAX_ROWS_FOR_ROW_SCALE = 64


def row_absolute_scale(truth, x, dy, dw_exact):
    """{name: sum over rows of |that row's contribution to the gradient|} in float64."""
    flat_dy = dy.reshape(-1, dy.shape[-1])
    scale = {name: torch.zeros_like(g) for name, g in dw_exact.items()}
    for row in range(flat_dy.shape[0]):
        one_row = torch.zeros_like(flat_dy)
        one_row[row] = flat_dy[row]
        _, _, dw_row = run_mlp(truth, x, one_row.view_as(dy))
        for name, g in dw_row.items():
            scale[name] += g.abs()
    return scale


def compare_with_hf(hf_mlp, liger_mlp, dtype, rows, hidden):
    liger_mlp.load_state_dict(hf_mlp.state_dict())
    truth = copy.deepcopy(hf_mlp).double()
    hf_mlp, liger_mlp = hf_mlp.to(dtype), liger_mlp.to(dtype)
    x = torch.randn(2, rows, hidden, device=DEVICE).to(dtype)
    dy = torch.randn(2, rows, hidden, device=DEVICE).to(dtype)
    y_t, dx_t, dw_t = run_mlp(truth, x.double(), dy.double())
    y_l, dx_l, dw_l = run_mlp(liger_mlp, x, dy)
    y_h, dx_h, dw_h = run_mlp(hf_mlp, x, dy)
    assert set(dw_l) == set(dw_t)
    pairs = [("output", y_l, y_h, y_t, y_t), ("dx", dx_l, dx_h, dx_t, dx_t)]
    dw_scale = dw_t
    if dtype == torch.float32 and 2 * rows <= MAX_ROWS_FOR_ROW_SCALE:
        dw_scale = row_absolute_scale(truth, x.double(), dy.double(), dw_t)
    pairs += [(f"d{name}", dw_l[name], dw_h[name], dw_t[name], dw_scale[name]) for name in dw_t]
    for name, ours, hf, exact, scale in pairs:
        assert ours.dtype == dtype and ours.shape == exact.shape, name
        if dtype == torch.float32:
            error = (ours.double() - exact).norm() / scale.norm().clamp_min(1e-300)
            assert error <= 1e-5, f"{name}: {error:.2e} of the row-summed magnitude"
        else:
            assert rel_error(ours, exact) <= max(1.25 * rel_error(hf, exact), BF16_UNIT_ROUNDOFF), (
                f"{name}: ours {rel_error(ours, exact):.2e} vs HF {rel_error(hf, exact):.2e}")


def mlp_config(config_class, hidden, intermediate, **kwargs):
    """A config of ``config_class`` with the given MLP sizes (one head of dim 2, so any hidden size passes HF validation)."""
    return getattr(transformers, config_class)(hidden_size=hidden, intermediate_size=intermediate,
                                               num_attention_heads=1, num_key_value_heads=1, head_dim=2,
                                               **kwargs)


def llama_config(hidden, intermediate, **kwargs):
    return mlp_config("LlamaConfig", hidden, intermediate, hidden_act="silu", **kwargs)


@pytest.mark.parametrize("hidden,intermediate,rows,dtype", CASES)
@pytest.mark.parametrize("mlp_bias", [False, True])
@pytest.mark.parametrize("in_place", [True, False])
def test_llama_mlp(hidden, intermediate, rows, dtype, mlp_bias, in_place):
    from transformers.models.llama.modeling_llama import LlamaMLP

    config = llama_config(hidden, intermediate, mlp_bias=mlp_bias)
    hf = LlamaMLP(config).to(DEVICE)
    liger = LigerSwiGLUMLP(config, in_place=in_place).to(DEVICE)
    assert (liger.hidden_size, liger.intermediate_size, liger.config) == (hidden, intermediate, config)
    assert (liger.gate_proj.bias is not None) == mlp_bias
    compare_with_hf(hf, liger, dtype, rows, hidden)


@pytest.mark.parametrize("hidden,intermediate,rows,dtype", CASES)
def test_phi3_mlp(hidden, intermediate, rows, dtype):
    from transformers.models.phi3.modeling_phi3 import Phi3MLP

    config = mlp_config("Phi3Config", hidden, intermediate, hidden_act="silu")
    hf = Phi3MLP(config).to(DEVICE)
    liger = LigerPhi3SwiGLUMLP(config).to(DEVICE)
    assert liger.gate_up_proj.weight.shape == (2 * intermediate, hidden)
    compare_with_hf(hf, liger, dtype, rows, hidden)


def test_forward_bound_onto_an_hf_instance():
    # The instance patch binds LigerSwiGLUMLP.forward onto HF modules, which lack ``in_place``.
    from transformers.models.llama.modeling_llama import LlamaMLP

    config = llama_config(16, 40)
    hf = LlamaMLP(config).to(DEVICE)
    x = torch.randn(3, 16, device=DEVICE)
    expected = hf(x)
    bound = LigerSwiGLUMLP.forward.__get__(hf)
    torch.testing.assert_close(bound(x), expected, rtol=1e-5, atol=1e-6)


def test_rejects_other_activations():
    with pytest.raises(ValueError, match="hidden_act='gelu'"):
        LigerSwiGLUMLP(mlp_config("LlamaConfig", 8, 16, hidden_act="gelu"))
    with pytest.raises(ValueError, match="hidden_act='relu'"):
        LigerPhi3SwiGLUMLP(mlp_config("Phi3Config", 8, 16, hidden_act="relu"))
    LigerSwiGLUMLP(mlp_config("LlamaConfig", 8, 16, hidden_act="swish"))


def test_functional_alias():
    a = torch.randn(4, 9, device=DEVICE)
    b = torch.randn(4, 9, device=DEVICE)
    torch.testing.assert_close(liger_swiglu(a, b), torch.nn.functional.silu(a) * b, rtol=1e-5, atol=1e-6)


def test_offloaded_down_proj_is_called_through_its_hook():
    # accelerate's offload keeps each weight on the meta device until the hook of the module
    # it belongs to loads it; the fused down projection reads down_proj.weight directly, so it
    # must call such a module instead (a meta weight would raise, or compute garbage).
    accelerate = pytest.importorskip("accelerate")
    from transformers.models.llama.modeling_llama import LlamaMLP

    from liger_kernel.transformers.swiglu import _fusable_linear

    config = llama_config(16, 40)
    hf = LlamaMLP(config).to(DEVICE)
    liger = LigerSwiGLUMLP(config).to(DEVICE)
    liger.load_state_dict(hf.state_dict())
    assert _fusable_linear(liger.down_proj)
    accelerate.cpu_offload(liger, execution_device=torch.device(DEVICE))
    assert liger.down_proj.weight.device.type == "meta"
    assert not _fusable_linear(liger.down_proj)
    x = torch.randn(3, 16, device=DEVICE)
    torch.testing.assert_close(liger(x), hf(x), rtol=1e-5, atol=1e-6)
    x_hf, x_liger = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    hf(x_hf).sum().backward()
    liger(x_liger).sum().backward()
    torch.testing.assert_close(x_liger.grad, x_hf.grad, rtol=1e-5, atol=1e-6)


# ---- The in-place backward and activations a forward hook keeps ----

KEEPERS = {"tensor": lambda t: t, "detach": lambda t: t.detach(), "data": lambda t: t.data}


def mlp_modules(kind):
    """(HF module, Liger module with HF's weights, the projection whose output a hook may keep)."""
    if kind == "phi3":
        from transformers.models.phi3.modeling_phi3 import Phi3MLP

        config = mlp_config("Phi3Config", 16, 40, hidden_act="silu")
        hf, liger = Phi3MLP(config), LigerPhi3SwiGLUMLP(config)
    elif kind == "gemma":
        from transformers.models.gemma.modeling_gemma import GemmaMLP

        from liger_kernel.transformers.geglu import LigerGEGLUMLP

        config = mlp_config("GemmaConfig", 16, 40, hidden_act="gelu_pytorch_tanh")
        hf, liger = GemmaMLP(config), LigerGEGLUMLP(config)
    else:
        from transformers.models.llama.modeling_llama import LlamaMLP

        config = llama_config(16, 40)
        hf, liger = LlamaMLP(config), LigerSwiGLUMLP(config)
    liger.load_state_dict(hf.state_dict())
    return hf.to(DEVICE), liger.to(DEVICE)


def hook_projection(module, kind, keep, store):
    """A forward hook on the gate (Phi-3: the fused gate/up) projection that stores ``keep(output)``."""
    projection = module.gate_up_proj if kind == "phi3" else module.gate_proj
    return projection.register_forward_hook(lambda m, args, out: store.append(KEEPERS[keep](out)))


@pytest.mark.parametrize("kind", ["llama", "phi3", "gemma"])
@pytest.mark.parametrize("keep", list(KEEPERS))
def test_activation_kept_by_a_hook_keeps_its_values(kind, keep):
    """With ``in_place=True`` (the modules' default) a hook that kept the gate activation (or
    the fused gate/up output), itself or a detached alias, still holds HF's values after
    backward, and every gradient equals the HF module's."""
    hf, liger = mlp_modules(kind)
    x = torch.randn(2, 3, 16, device=DEVICE)
    dy = torch.randn(2, 3, 16, device=DEVICE)
    kept_hf, kept_liger = [], []
    hook_projection(hf, kind, keep, kept_hf)
    hook_projection(liger, kind, keep, kept_liger)
    for module in (hf, liger):
        module(x.clone().requires_grad_(True)).backward(dy)
    torch.testing.assert_close(kept_liger[0], kept_hf[0])
    for (name, p_hf), p_liger in zip(hf.named_parameters(), liger.parameters()):
        torch.testing.assert_close(p_liger.grad, p_hf.grad, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("kind", ["llama", "gemma"])
def test_without_hooks_the_backward_writes_into_the_activations(kind):
    """The memory saving stays: the gradient reaching the gate and up projections lives in
    their outputs, written over them rather than in fresh buffers. (Phi-3's halves are
    joined by the chunk's backward into a new buffer, so its write is checked on the chunk's
    node in tests/ops/test_swiglu.py.)"""
    _, liger = mlp_modules(kind)
    records = []

    def record(out):  # keeps only integers, never the tensor
        record_, index = {"ptr": out.data_ptr()}, out.output_nr
        out.grad_fn.register_prehook(lambda grads: record_.__setitem__("grad_ptr", grads[index].data_ptr()))
        records.append(record_)

    def recording(forward):
        # Wrapped on the instance, not a module hook: a hook could see the activation, and the
        # module then (rightly) leaves it alone.
        return lambda x: (out := forward(x), record(out))[0]

    projections = [liger.gate_proj, liger.up_proj]
    for projection in projections:
        projection.forward = recording(projection.forward)
    liger(torch.randn(2, 3, 16, device=DEVICE, requires_grad=True)).sum().backward()
    assert [r["grad_ptr"] == r["ptr"] for r in records] == [True] * len(projections)


@pytest.mark.parametrize("kind", ["llama", "phi3", "gemma"])
def test_meta_module_gives_meta_outputs(kind):
    """A module on the ``meta`` device (shape inference, meta-device init) maps meta inputs to
    meta outputs of the right shape and dtype, forward and backward, as HF's does."""
    _, liger = mlp_modules(kind)
    liger = liger.to("meta")
    x = torch.empty(2, 3, 16, device="meta", requires_grad=True)
    y = liger(x)
    assert y.is_meta and y.shape == x.shape and y.dtype == x.dtype
    y.sum().backward()
    assert x.grad.is_meta and x.grad.shape == x.shape
