"""LigerGEGLUMLP as a drop-in for HF ``GemmaMLP`` and ``Gemma2MLP``.

Same method and tolerances as test_swiglu.py: the Liger module loads the HF module's state
dict and output, input gradient and weight gradients are compared with the HF module in
float64 (fp32: norm-wise <= 1e-5; bf16: no further from the truth than HF's bf16 module
by more than 25%).
"""

import pytest
import torch

from liger_kernel.transformers.functional import liger_geglu
from liger_kernel.transformers.geglu import LigerGEGLUMLP
from tests.transformers.test_swiglu import CASES, compare_with_hf, mlp_config
from tests.utils import DEVICE

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("hidden,intermediate,rows,dtype", CASES)
@pytest.mark.parametrize("in_place", [True, False])
def test_gemma_mlp(hidden, intermediate, rows, dtype, in_place):
    from transformers.models.gemma.modeling_gemma import GemmaMLP

    config = mlp_config("GemmaConfig", hidden, intermediate, hidden_act="gelu_pytorch_tanh")
    compare_with_hf(GemmaMLP(config).to(DEVICE), LigerGEGLUMLP(config, in_place=in_place).to(DEVICE), dtype, rows,
                    hidden)


@pytest.mark.parametrize("activation", ["gelu_pytorch_tanh", "gelu_new", "gelu_python_tanh"])
def test_gemma2_mlp(activation):
    from transformers.models.gemma2.modeling_gemma2 import Gemma2MLP

    config = mlp_config("Gemma2Config", 24, 77, hidden_activation=activation)
    compare_with_hf(Gemma2MLP(config).to(DEVICE), LigerGEGLUMLP(config).to(DEVICE), torch.float32, 5, 24)


def test_legacy_gemma_gelu_follows_the_config():
    # Newer transformers rewrite GemmaConfig(hidden_act="gelu") to "gelu_pytorch_tanh" (HF's
    # legacy fix-up) and GemmaMLP then computes the tanh GELU: we must match it. Older ones
    # keep "gelu", GemmaMLP computes the exact erf GELU, and LigerGEGLUMLP must refuse it.
    from transformers.models.gemma.modeling_gemma import GemmaMLP

    config = mlp_config("GemmaConfig", 16, 40, hidden_act="gelu")
    if config.hidden_act == "gelu":
        with pytest.raises(ValueError, match="hidden_act='gelu'"):
            LigerGEGLUMLP(config)
        return
    compare_with_hf(GemmaMLP(config).to(DEVICE), LigerGEGLUMLP(config).to(DEVICE), torch.float32, 3, 16)


def test_rejects_other_activations():
    with pytest.raises(ValueError, match="hidden_activation='gelu'"):
        LigerGEGLUMLP(mlp_config("Gemma2Config", 8, 16, hidden_activation="gelu"))
    with pytest.raises(ValueError, match="hidden_act='silu'"):
        LigerGEGLUMLP(mlp_config("LlamaConfig", 8, 16, hidden_act="silu"))


def test_functional_alias():
    a = torch.randn(4, 9, device=DEVICE)
    b = torch.randn(4, 9, device=DEVICE)
    expected = torch.nn.functional.gelu(a, approximate="tanh") * b
    torch.testing.assert_close(liger_geglu(a, b), expected, rtol=1e-5, atol=1e-6)
