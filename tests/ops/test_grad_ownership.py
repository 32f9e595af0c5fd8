"""ops.grad_ownership.backward_writes_into_grad, through the norms: their backward writes dx over
the incoming gradient only when the caller asked for it (``in_place=True``, a promise that nobody
else reads that gradient); by default the incoming gradient is never written, whoever holds it."""

import pytest
import torch

from liger_kernel.ops.layer_norm import LigerLayerNormFunction
from liger_kernel.ops.rms_norm import LigerRMSNormFunction
from tests.utils import DEVICE

# Each norm as (x, params, in_place) -> y.
NORMS = {
    "rms_norm": lambda x, params, in_place: LigerRMSNormFunction.apply(x, params[0], 1e-6, 0.0, "llama", in_place),
    "layer_norm": lambda x, params, in_place: LigerLayerNormFunction.apply(x, params[0], params[1], 1e-6, in_place),
}


def norm_inputs(norm, shape):
    x = torch.randn(shape, device=DEVICE)
    params = [torch.randn(shape[-1], device=DEVICE) for _ in range(2 if norm == "layer_norm" else 1)]
    return x, params


def leaves_of(*tensors):
    return [t.detach().clone().requires_grad_(True) for t in tensors]


def norm_into_projection(norm):
    """The norm feeding a Linear, with ``in_place`` True and False on the same values:
    ``{in_place: whether dx was written over dy}`` after checking that both gave the same
    gradients."""
    x, params = norm_inputs(norm, (2, 3, 123))
    proj = torch.nn.Linear(123, 17).to(DEVICE)
    grads, written = {}, {}
    for in_place in (True, False):
        seen = {}
        xi, *ps = leaves_of(x, *params)
        xi.register_hook(lambda g, seen=seen: seen.update(dx=g.data_ptr()))
        y = NORMS[norm](xi, ps, in_place)
        y.register_hook(lambda g, seen=seen: seen.update(dy=g.data_ptr()))
        proj(y).sum().backward()
        written[in_place] = seen["dx"] == seen["dy"]
        grads[in_place] = [xi.grad, *(p.grad for p in ps)]
    for with_write, without in zip(grads[True], grads[False]):
        assert torch.equal(with_write, without)
    return written


@pytest.mark.parametrize("norm", sorted(NORMS))
def test_norm_backward_reuses_the_gradient_of_a_projection_when_asked(norm):
    """In a model the norm feeds a projection, whose backward hands over a view of a fresh
    (N, H) product: the caller that knows it (a patched decoder layer) passes ``in_place=True``
    and the backward writes dx into it, with the same gradients as without."""
    assert norm_into_projection(norm) == {True: True, False: False}


@pytest.mark.parametrize("norm", sorted(NORMS))
def test_norms_write_nothing_in_place_by_default(norm):
    """The Functions' default is ``in_place=False``: no promise, no write."""
    x, params = norm_inputs(norm, (2, 3, 123))
    leaves = leaves_of(x, *params)
    function = {"rms_norm": LigerRMSNormFunction, "layer_norm": LigerLayerNormFunction}[norm]
    seen = {}
    y = function.apply(leaves[0], *leaves[1:])
    leaves[0].register_hook(lambda g: seen.update(dx=g.data_ptr()))
    y.register_hook(lambda g: seen.update(dy=g.data_ptr()))
    torch.nn.Linear(123, 17).to(DEVICE)(y).sum().backward()
    assert seen["dx"] != seen["dy"]


@pytest.mark.parametrize("norm", sorted(NORMS))
def test_in_place_is_a_promise_not_a_guess(norm):
    """``in_place=True`` writes dx over the gradient it receives whoever else holds it: here the
    caller's own ``g`` of ``y.backward(g)``, which the caller then must not read. Nothing tries
    to tell held gradients apart (no reference counts); the gradients themselves are right."""
    x, params = norm_inputs(norm, (6, 123))
    g = torch.randn(6, 123, device=DEVICE)
    reference = leaves_of(x, *params)
    NORMS[norm](reference[0], reference[1:], False).backward(g.clone())
    leaves = leaves_of(x, *params)
    given = g.clone()
    NORMS[norm](leaves[0], leaves[1:], True).backward(given)
    assert torch.equal(given, reference[0].grad)  # dx now lives in the caller's buffer
    for leaf, want in zip(leaves, reference):
        assert torch.equal(leaf.grad, want.grad)


@pytest.mark.parametrize("how", ["backward", "autograd_grad", "through_view", "through_add"])
@pytest.mark.parametrize("norm", sorted(NORMS))
def test_norm_backward_leaves_the_callers_grad_alone(norm, how):
    """autograd hands the very tensor given to ``backward(g)`` / ``autograd.grad(.., g)`` to the
    norm's backward (also through an addition, or as a view of it through view ops): without
    ``in_place`` it keeps its values, and the grads are right."""
    x, params = norm_inputs(norm, (6, 123))
    g = torch.randn(6, 123, device=DEVICE)
    kept = g.clone()
    reference = leaves_of(x, *params)
    NORMS[norm](reference[0], reference[1:], False).backward(g.clone())
    leaves = leaves_of(x, *params)
    y = NORMS[norm](leaves[0], leaves[1:], False)
    if how == "backward":
        y.backward(g)
    elif how == "autograd_grad":
        for leaf, grad in zip(leaves, torch.autograd.grad(y, leaves, g)):
            leaf.grad = grad
    elif how == "through_view":
        y.view(-1).backward(g.view(-1))
    else:
        other = torch.randn(6, 123, device=DEVICE, requires_grad=True)
        (y + other).backward(g)
        assert torch.equal(other.grad, kept)
    assert torch.equal(g, kept)
    for leaf, want in zip(leaves, reference):
        assert torch.equal(leaf.grad, want.grad)


@pytest.mark.parametrize("alias", ["detach", "data"])
@pytest.mark.parametrize("norm", sorted(NORMS))
def test_norm_backward_leaves_a_hook_kept_detached_alias_alone(norm, alias):
    """A hook that keeps ``g.detach()`` / ``g.data`` of the norm output's gradient (an
    activation-gradient cache): without ``in_place`` the cached values are dy, as with a torch
    norm (checked against the plain ``x * 2`` whose backward never writes)."""
    x, params = norm_inputs(norm, (2, 3, 123))
    proj = torch.nn.Linear(123, 17).to(DEVICE)
    results = {}
    for in_place in (False, None):
        kept = []
        leaves = leaves_of(x, *params)
        y = NORMS[norm](leaves[0], leaves[1:], in_place) if in_place is not None else leaves[0] * 2.0
        y.register_hook(lambda g, kept=kept: kept.append(g.detach() if alias == "detach" else g.data))
        proj(y).sum().backward()
        results[in_place] = kept[0]
    assert torch.equal(results[False], results[None])


@pytest.mark.parametrize("norm", sorted(NORMS))
def test_norm_backward_leaves_a_module_hook_kept_grad_input_alone(norm):
    """A full backward hook on the norm's consumer that keeps a detached ``grad_input`` (the
    norm output's gradient, as activation-statistics tools do) keeps dy without ``in_place``
    (compared with the plain ``x * 2``, whose backward never writes)."""
    x, params = norm_inputs(norm, (2, 3, 123))
    results = {}
    for in_place in (False, None):
        kept = []
        proj = torch.nn.Linear(123, 17).to(DEVICE)
        torch.nn.init.ones_(proj.weight)
        proj.register_full_backward_hook(lambda m, gi, go, kept=kept: kept.append(gi[0].detach()))
        leaves = leaves_of(x, *params)
        y = NORMS[norm](leaves[0], leaves[1:], in_place) if in_place is not None else leaves[0] * 2.0
        proj(y).sum().backward()
        results[in_place] = kept[0]
    assert torch.equal(results[False], results[None])


@pytest.mark.parametrize("norm", sorted(NORMS))
def test_norm_backward_with_its_output_added_to_a_residual_stream(norm):
    """``norm(x) + r`` hands the one gradient tensor autograd made for the sum to both inputs:
    without ``in_place`` r's gradient stays dy (the sum's gradient, computed here on its own),
    never the norm's dx. (Which is why the patch never promises it for such norms.)"""
    x, params = norm_inputs(norm, (2, 3, 123))
    r = torch.randn(2, 3, 123, device=DEVICE)
    proj = torch.nn.Linear(123, 17).to(DEVICE)
    leaves = leaves_of(x, *params, r)
    proj(NORMS[norm](leaves[0], leaves[1:-1], False) + leaves[-1]).sum().backward()
    s = leaves_of(r)[0]
    proj(s).sum().backward()
    assert torch.equal(leaves[-1].grad, s.grad)


def test_no_reference_count_logic_in_the_package():
    """Who may write into a buffer is decided by who made it and by explicit keywords, never by
    counting references (CPython's counts change between versions and builds) or storage users."""
    from pathlib import Path

    import liger_kernel

    root = Path(liger_kernel.__file__).parent
    for path in root.rglob("*.py"):
        text = path.read_text()
        for pattern in ("getrefcount", "_storage_Use_Count", "use_count", "_use_count"):
            assert pattern not in text, f"{path.relative_to(root)} uses {pattern}"


def test_hooks_may_see():
    from liger_kernel.ops.grad_ownership import hooks_may_see

    module = torch.nn.Linear(3, 3).to(DEVICE)
    assert not hooks_may_see(module)

    def observe(*args):
        return None

    for register in (module.register_forward_hook, module.register_forward_pre_hook,
                     module.register_full_backward_hook, module.register_full_backward_pre_hook):
        handle = register(observe)
        assert hooks_may_see(module) and not hooks_may_see(module, ignored=(observe,))
        handle.remove()
    for register in (torch.nn.modules.module.register_module_forward_hook,
                     torch.nn.modules.module.register_module_full_backward_hook):
        handle = register(observe)
        assert hooks_may_see(module) and hooks_may_see(module, ignored=(observe,))  # global: never ignored
        handle.remove()
    assert not hooks_may_see(module)
