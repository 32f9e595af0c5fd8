"""Every autograd Function of ``ops`` under ``torch.compile(fullgraph=True)``: the traced forward
returns no tensor that another traced op also produced (see ``tests/function_graphs.py``: such an
output gets zero gradients on torch releases whose Dynamo returns the forward's intermediates
too), and outputs and input gradients match eager through AOTAutograd (eager itself is checked
against float64 in each op's own tests). The chunked head (``ops/chunked_head.py``) is not
here: Dynamo cannot trace its forward as one graph.

Each case builds fresh inputs (odd sizes) and a step returning the Function's differentiable
outputs; both runs backpropagate the same random upstream gradients (not 1, so that the
backward's scaling of a gradient computed in the forward does something).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from liger_kernel.ops.cross_entropy import CrossEntropyFunctionFromOptions, LigerCrossEntropyFunction
from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction
from liger_kernel.ops.fused_linear_logprobs import LigerFusedLinearLogProbsFunction
from liger_kernel.ops.geglu import LigerGELUMulFunction
from liger_kernel.ops.grpo_loss import LigerSelectiveLogSoftmaxFunction
from liger_kernel.ops.jsd import LigerJSDFunction
from liger_kernel.ops.kl_div import LigerKLDivLossFunction
from liger_kernel.ops.layer_norm import LigerLayerNormFunction
from liger_kernel.ops.loss_options import CrossEntropyOptions
from liger_kernel.ops.rms_norm import LigerRMSNormFunction
from liger_kernel.ops.rope import LigerRopeFunction
from liger_kernel.ops.swiglu import LigerGatedDownProjFunction, LigerSiLUMulFunction
from liger_kernel.ops.tvd import LigerTVDLossFunction
from tests.function_graphs import compile_checking_outputs
from tests.utils import DEVICE

REPO_ROOT = Path(__file__).resolve().parents[2]


def _randn(*shape):
    return torch.randn(*shape, device=DEVICE)


def _cross_entropy(reduction, dtype=torch.float32, loss_dtype=None):
    def case():
        n, v = 9, 257
        target = torch.randint(0, v, (n,), device=DEVICE)
        target[2] = -100
        weight = torch.rand(v, device=DEVICE) + 0.5
        options = CrossEntropyOptions(ignore_index=-100, label_smoothing=0.1, lse_square_scale=1e-3, softcap=10.0,
                                      reduction=reduction, return_token_accuracy=True)

        def step(x):
            loss, _, _ = CrossEntropyFunctionFromOptions.apply(x * 2.0, target, weight, options, True, loss_dtype)
            return (loss,)

        return step, [_randn(n, v).to(dtype)]

    return case


def _cross_entropy_apply():
    n, v = 7, 33
    target = torch.randint(0, v, (n,), device=DEVICE)
    return (lambda x: (LigerCrossEntropyFunction.apply(x * 2.0, target, None, -100, 1e-3)[0],),
            [_randn(n, v)])


def _fused_linear_cross_entropy(reduction):
    def case():
        n, d, v = 11, 16, 37
        target = torch.randint(0, v, (n,), device=DEVICE)
        target[0] = -100

        def step(x, w, b):
            loss, _, _ = LigerFusedLinearCrossEntropyFunction.apply(x, w, target, b, None, -100, 1e-3, 0.1,
                                                                    reduction, 8.0, True)
            return (loss,)

        return step, [_randn(n, d), _randn(v, d) * 0.3, _randn(v) * 0.1]

    return case


def _jsd():
    n, v = 6, 37
    teacher = _randn(n, v).log_softmax(-1)
    labels = torch.tensor([1, -100, 2, 3, -100, 4], device=DEVICE)
    return lambda x: (LigerJSDFunction.apply(x.log_softmax(-1), teacher, labels, 0.3),), [_randn(n, v)]


def _kl_div(reduction):
    def case():
        n, v = 5, 29
        target = _randn(n, v).log_softmax(-1)
        return (lambda x: (LigerKLDivLossFunction.apply(x.log_softmax(-1), target, reduction, True),),
                [_randn(n, v)])

    return case


def _tvd():
    n, v = 5, 29
    q = _randn(n, v).softmax(-1)
    labels = torch.tensor([1, -100, 2, 3, 4], device=DEVICE)
    return lambda x: (LigerTVDLossFunction.apply(x.softmax(-1), q, labels, "batchmean"),), [_randn(n, v)]


def _selective_log_softmax():
    b, length, v = 2, 5, 23
    ids = torch.randint(0, v, (b, length), device=DEVICE)
    mask = torch.ones(b, length, device=DEVICE)
    mask[1, -2:] = 0

    def step(logits):
        logp, entropy = LigerSelectiveLogSoftmaxFunction.apply(logits * 1.0, ids, 0.7, mask, True, True)
        return logp, entropy

    return step, [_randn(b, length + 1, v)]


def _fused_linear_logprobs():
    n, d, v = 9, 16, 31
    target = torch.randint(0, v, (n,), device=DEVICE)
    target[3] = -100

    def step(x, w, b):
        return LigerFusedLinearLogProbsFunction.apply(x, w, b, target, 0.8, -100)

    return step, [_randn(n, d), _randn(v, d) * 0.3, _randn(v) * 0.1]


def _rms_norm():
    return (lambda x, w: (LigerRMSNormFunction.apply(x * 1.0, w, 1e-6, 0.0, "llama", True),),
            [_randn(5, 3, 48), _randn(48)])


def _layer_norm():
    return (lambda x, w, b: (LigerLayerNormFunction.apply(x * 1.0, w, b, 1e-6, True),),
            [_randn(7, 40), _randn(40), _randn(40)])


def _rope():
    b, heads, kv_heads, length, dim = 2, 4, 2, 5, 8
    angles = _randn(b, length, dim // 2)
    cos = torch.cat([angles.cos(), angles.cos()], -1)
    sin = torch.cat([angles.sin(), angles.sin()], -1)
    return (lambda q, k: LigerRopeFunction.apply(q * 1.0, k * 1.0, cos, sin),
            [_randn(b, heads, length, dim), _randn(b, kv_heads, length, dim)])


def _gated(function):
    def case():
        return lambda a, b: (function.apply(a * 1.0, b * 1.0, True),), [_randn(3, 5, 24), _randn(3, 5, 24)]

    return case


def _gated_down_proj():
    return (lambda a, b, w, bias: (LigerGatedDownProjFunction.apply(a, b, w, bias),),
            [_randn(7, 24), _randn(7, 24), _randn(10, 24) * 0.3, _randn(10)])


CASES = {
    "cross_entropy_mean": _cross_entropy("mean"),
    "cross_entropy_none": _cross_entropy("none"),
    "cross_entropy_bf16": _cross_entropy("sum", torch.bfloat16),
    "cross_entropy_bf16_float32_loss": _cross_entropy("mean", torch.bfloat16, torch.float32),
    "cross_entropy_apply": _cross_entropy_apply,
    "fused_linear_cross_entropy_mean": _fused_linear_cross_entropy("mean"),
    "fused_linear_cross_entropy_none": _fused_linear_cross_entropy("none"),
    "jsd": _jsd,
    "kl_div_batchmean": _kl_div("batchmean"),
    "kl_div_none": _kl_div("none"),
    "tvd": _tvd,
    "selective_log_softmax": _selective_log_softmax,
    "fused_linear_logprobs": _fused_linear_logprobs,
    "rms_norm": _rms_norm,
    "layer_norm": _layer_norm,
    "rope": _rope,
    "swiglu": _gated(LigerSiLUMulFunction),
    "geglu": _gated(LigerGELUMulFunction),
    "gated_down_proj": _gated_down_proj,
}


def _run(step, inputs, upstream=None):
    """Outputs, upstream gradients and input gradients of one forward and backward."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    outputs = step(*leaves)
    if upstream is None:
        upstream = [torch.rand_like(out) + 0.5 for out in outputs]
    # Copies: a backward asked to work in place (the norms' in_place=True) may write into the
    # gradient it receives, and the same upstream serves the compiled run.
    torch.autograd.backward(outputs, [u.clone() for u in upstream])
    return [out.detach() for out in outputs], upstream, [leaf.grad for leaf in leaves]


# Its chunk loop switches cuBLAS's reduction precision (global state Dynamo refuses to see
# change), so it is a disabled region: Dynamo cannot trace the forward as one graph.
_UNTRACEABLE = {"fused_linear_logprobs"}


def check_compiled_matches_eager(name):
    torch._dynamo.reset()
    step, inputs = CASES[name]()
    eager_out, upstream, eager_grads = _run(step, inputs)
    shared: list[str] = []
    compiled_out, _, compiled_grads = _run(compile_checking_outputs(step, shared), inputs, upstream)
    assert not shared, f"traced forwards return tensors other ops also produced: {shared}"
    torch.testing.assert_close(compiled_out, eager_out)
    for i, (compiled, eager) in enumerate(zip(compiled_grads, eager_grads)):
        assert eager is not None and eager.abs().sum() > 0, f"input {i}: no eager gradient to compare"
        torch.testing.assert_close(compiled, eager, msg=lambda m, i=i: f"input {i}: {m}")


@pytest.mark.parametrize("name", [name for name in CASES if name not in _UNTRACEABLE])
def test_compiled_outputs_and_gradients_match_eager(name):
    check_compiled_matches_eager(name)


@pytest.mark.parametrize("name", sorted(_UNTRACEABLE))
def test_untraceable_cases_still_fail_to_trace(name):
    """In a child process: a trace that fails inside one of our Functions leaves this process's
    later autograd backwards seeing one Python reference more on saved tensors (torch 2.11 and
    2.13), which turns off the count-based in-place decisions other tests check. When the case
    becomes traceable, move it to the test above."""
    code = ("import tests.conftest, tests.ops.test_compiled_function_outputs as t; "
            f"t.check_compiled_matches_eager({name!r})")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0, f"{name} now traces as one graph: move it to the compiled-vs-eager test"
    assert "torch.compiler.disable" in proc.stderr, proc.stderr[-2000:]


def _dpo_loss():
    from liger_kernel.chunked_loss import LigerFusedLinearDPOLoss

    pairs, length, d, v = 2, 5, 16, 29
    target = torch.randint(0, v, (2 * pairs, length), device=DEVICE)
    target[1, :2] = -100
    loss_fn = LigerFusedLinearDPOLoss(beta=0.1, use_ref_model=False)

    def step(x, w):
        loss, _ = loss_fn(w, x * 1.0, target)
        return (loss,)

    return step, [_randn(2 * pairs, length, d), _randn(v, d) * 0.3]


@pytest.mark.parametrize("case", [_fused_linear_logprobs, _dpo_loss], ids=["fused_linear_logprobs", "dpo_loss"])
def test_untraceable_functions_run_eagerly_under_compile(case):
    """``torch.compile`` without ``fullgraph``: the chunked Functions (which switch cuBLAS's
    reduction precision inside their forward, something Dynamo refuses to trace) become a graph
    break and give eager's outputs and gradients, and the traced remainder still compiles."""
    torch._dynamo.reset()
    step, inputs = case()
    eager_out, upstream, eager_grads = _run(step, inputs)
    compiled_out, _, compiled_grads = _run(torch.compile(step, backend="aot_eager"), inputs, upstream)
    torch.testing.assert_close(compiled_out, eager_out)
    for i, (compiled, eager) in enumerate(zip(compiled_grads, eager_grads)):
        torch.testing.assert_close(compiled, eager, msg=lambda m, i=i: f"input {i}: {m}")
