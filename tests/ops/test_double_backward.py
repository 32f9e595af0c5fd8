"""Every autograd Function of ``liger_kernel.ops`` is differentiable once only.

The backward passes run Triton kernels (or overwrite buffers) that autograd cannot see
through, so a second derivative through them would be wrong. Their backward is
``strictly_once_differentiable`` (``ops.autograd.strictly_once_differentiable``): under ``create_graph=True`` the
first-order gradients come out as usual, and differentiating them again raises instead of
silently returning a second derivative without the op's part. Checked with incoming
gradients that do not require grad (the gradient of a linear objective, where torch's own
decorator lets it through) and with ones that do. Where the Function saves its inputs, a
second derivative taken with ``torch.autograd.grad(.., inputs)`` (which only runs the
nodes on a path to ``inputs``) must raise as well; where it saves none, its backward warns
under ``create_graph`` that such a second derivative would lack its part.

Also here: activation checkpointing (both implementations) gives the gradients of the plain
run, since it runs each backward once, on recomputed tensors.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from liger_kernel.ops.cross_entropy import LigerCrossEntropyFunction
from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction
from liger_kernel.ops.geglu import LigerGELUMulFunction
from liger_kernel.ops.layer_norm import LigerLayerNormFunction
from liger_kernel.ops.rms_norm import LigerRMSNormFunction
from liger_kernel.ops.rope import LigerRopeFunction
from liger_kernel.ops.swiglu import SILU, LigerGatedDownProjFunction, LigerSiLUMulFunction
from tests.utils import DEVICE


def _randn(*shape):
    return torch.randn(*shape, device=DEVICE)


def _target(n_rows, n_cols):
    return torch.randint(0, n_cols, (n_rows,), device=DEVICE)


def _rope_tables():
    angles = _randn(1, 5, 4)
    return torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()


# name: (input values, forward(*leaves) -> outputs, whether the Function saves inputs that
# require grad, which anchors the node that raises).
def _cases():
    target, cos, sin = _target(6, 11), *_rope_tables()
    return {
        "rms_norm": ([_randn(5, 16), _randn(16)],
                     lambda x, w: (LigerRMSNormFunction.apply(x, w, 1e-6),), True),
        "layer_norm": ([_randn(5, 16), _randn(16), _randn(16)],
                       lambda x, w, b: (LigerLayerNormFunction.apply(x, w, b, 1e-5),), True),
        "swiglu": ([_randn(4, 9), _randn(4, 9)], lambda a, b: (LigerSiLUMulFunction.apply(a, b),), True),
        "geglu": ([_randn(4, 9), _randn(4, 9)], lambda a, b: (LigerGELUMulFunction.apply(a, b),), True),
        "gated_down_proj": ([_randn(4, 9), _randn(4, 9), _randn(3, 9)],
                            lambda a, b, w: (LigerGatedDownProjFunction.apply(a, b, w, None, SILU, False),), True),
        # RoPE's backward does not depend on q and k (the rotation is linear): nothing to anchor.
        "rope": ([_randn(2, 3, 5, 8), _randn(2, 1, 5, 8)],
                 lambda q, k: LigerRopeFunction.apply(q, k, cos, sin), False),
        # By default (in_place=False) the gradient goes to a fresh buffer: only gradients
        # computed in the forward are saved.
        "cross_entropy": ([_randn(6, 11)],
                          lambda x: LigerCrossEntropyFunction.apply(x, target)[:1], False),
        # Only gradients computed in the forward are saved (see the module docstring).
        "cross_entropy_out_of_place": (
            [_randn(6, 11)],
            lambda x: LigerCrossEntropyFunction.apply(x, target, None, -100, 0.0, 0.0, "mean", None, False,
                                                      False)[:1], False),
        "fused_linear_cross_entropy": ([_randn(6, 8), _randn(11, 8)],
                                       lambda x, w: LigerFusedLinearCrossEntropyFunction.apply(x, w, target)[:1],
                                       False),
        "fused_linear_cross_entropy_none": (
            [_randn(6, 8), _randn(11, 8)],
            lambda x, w: LigerFusedLinearCrossEntropyFunction.apply(x, w, target, None, None, -100, 0.0, 0.0,
                                                                    "none")[:1], True),
    }


CASES = list(_cases())


def _objective(outputs, coefficients, incoming):
    """A scalar of the outputs: linear (the op's incoming gradients are constants, which do
    not require grad) or quadratic (they are 2 * output, which do)."""
    if incoming == "constant":
        return sum((out * c).sum() for out, c in zip(outputs, coefficients))
    return sum((out * out).sum() for out in outputs)


def _run(forward, values, incoming, create_graph):
    """Fresh leaves, the forward and the first-order gradients (with or without a graph)."""
    leaves = [v.clone().requires_grad_(True) for v in values]
    outputs = forward(*leaves)
    coefficients = [(torch.arange(out.numel(), device=out.device) % 7 * 0.25 + 0.5).view(out.shape)
                    for out in outputs]
    grads = torch.autograd.grad(_objective(outputs, coefficients, incoming), leaves, create_graph=create_graph)
    return leaves, grads


@pytest.mark.parametrize("incoming", ["constant", "graph"])
@pytest.mark.parametrize("case", CASES)
def test_second_derivative_raises(case, incoming):
    values, forward, anchored = _cases()[case]
    if anchored:
        leaves, grads = _run(forward, values, incoming, create_graph=True)
    else:
        # Nothing to anchor: autograd.grad(.., inputs) below could not be made to raise, so
        # the backward says so when a graph is built.
        with pytest.warns(UserWarning, match="once-differentiable and keeps none of its inputs"):
            leaves, grads = _run(forward, values, incoming, create_graph=True)
    # First order is unchanged by create_graph ...
    _, plain = _run(forward, values, incoming, create_graph=False)
    for with_graph, without in zip(grads, plain):
        assert torch.equal(with_graph.detach(), without)
    # ... but differentiating it again raises, whatever the incoming gradients were.
    assert all(g.requires_grad for g in grads)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        sum((g * g).sum() for g in grads).backward()
    if anchored:
        # Also when only the nodes on a path to the inputs run, and another term reaches them.
        leaves, grads = _run(forward, values, incoming, create_graph=True)
        second = sum((g * g).sum() for g in grads) + sum(leaf.sum() for leaf in leaves)
        with pytest.raises(RuntimeError, match="differentiate twice"):
            torch.autograd.grad(second, leaves)


# name: (inputs, forward), for ops that run inside a decoder layer (checkpointed in training).
def _layer_ops():
    cos, sin = _rope_tables()
    return {
        "rms_norm": ([_randn(5, 16), _randn(16)], lambda x, w: LigerRMSNormFunction.apply(x * 1, w, 1e-6)),
        "layer_norm": ([_randn(5, 16), _randn(16), _randn(16)],
                       lambda x, w, b: LigerLayerNormFunction.apply(x * 1, w, b, 1e-5)),
        "swiglu": ([_randn(4, 18)], lambda x: LigerSiLUMulFunction.apply(*(x * 1).chunk(2, -1), True)),
        "geglu": ([_randn(4, 18)], lambda x: LigerGELUMulFunction.apply(*(x * 1).chunk(2, -1), True)),
        "gated_down_proj": ([_randn(4, 18), _randn(3, 9)],
                            lambda x, w: LigerGatedDownProjFunction.apply(*(x * 1).chunk(2, -1), w, None, SILU, True)),
        "rope": ([_randn(2, 3, 5, 8), _randn(2, 1, 5, 8)],
                 lambda q, k: torch.cat([t.flatten() for t in LigerRopeFunction.apply(q * 1, k * 1, cos, sin)])),
    }


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("name", list(_layer_ops()))
def test_activation_checkpointing_same_gradients(name, use_reentrant):
    values, forward = _layer_ops()[name]
    upstream = None
    results = []
    for checkpointed in (False, True):
        leaves = [v.clone().requires_grad_(True) for v in values]
        out = checkpoint(forward, *leaves, use_reentrant=use_reentrant) if checkpointed else forward(*leaves)
        if upstream is None:
            upstream = torch.randn_like(out)
        F.silu(out).backward(upstream)  # an op after it, as in a layer
        results.append([leaf.grad for leaf in leaves])
    for plain, checkpointed in zip(*results):
        assert torch.equal(plain, checkpointed)
