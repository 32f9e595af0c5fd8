"""ops.grad_ownership.backward_writes_into_grad, through the norms: their backward writes dx over
the incoming gradient only when autograd owns it."""

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
def test_norm_backward_reuses_the_gradient_of_a_projection(norm):
    """In a model the norm feeds a projection, whose backward hands over a view of a fresh
    (N, H) product: autograd owns it, so the backward writes dx into it."""
    assert norm_into_projection(norm) == {True: True, False: False}


@pytest.mark.parametrize("how", ["backward", "autograd_grad", "through_view", "through_add"])
@pytest.mark.parametrize("norm", sorted(NORMS))
def test_norm_backward_leaves_the_callers_grad_alone(norm, how):
    """autograd hands the very tensor given to ``backward(g)`` / ``autograd.grad(.., g)`` to the
    norm's backward (also through an addition, or as a view of it through view ops): with
    ``in_place=True`` it must still keep its values, and the grads be the out-of-place ones."""
    x, params = norm_inputs(norm, (6, 123))
    g = torch.randn(6, 123, device=DEVICE)
    kept = g.clone()
    reference = leaves_of(x, *params)
    NORMS[norm](reference[0], reference[1:], False).backward(g)
    leaves = leaves_of(x, *params)
    y = NORMS[norm](leaves[0], leaves[1:], True)
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
    activation-gradient cache) holds no Python reference to ``g`` itself, only a second tensor
    on its storage: with ``in_place=True`` the cached values must still be dy, not dx."""
    x, params = norm_inputs(norm, (2, 3, 123))
    proj = torch.nn.Linear(123, 17).to(DEVICE)
    results = {}
    for in_place in (True, False):
        kept = []
        leaves = leaves_of(x, *params)
        y = NORMS[norm](leaves[0], leaves[1:], in_place)
        y.register_hook(lambda g, kept=kept: kept.append(g.detach() if alias == "detach" else g.data))
        proj(y).sum().backward()
        results[in_place] = [kept[0], *(leaf.grad for leaf in leaves)]
    for with_write, without in zip(results[True], results[False]):
        assert torch.equal(with_write, without)


@pytest.mark.parametrize("norm", sorted(NORMS))
def test_norm_backward_leaves_a_module_hook_kept_grad_input_alone(norm):
    """A full backward hook on the norm's consumer that keeps a detached ``grad_input`` (the
    norm output's gradient, as activation-statistics tools do) must keep dy."""
    x, params = norm_inputs(norm, (2, 3, 123))
    results = {}
    for in_place in (True, False):
        kept = []
        proj = torch.nn.Linear(123, 17).to(DEVICE)
        torch.nn.init.ones_(proj.weight)
        proj.register_full_backward_hook(lambda m, gi, go, kept=kept: kept.append(gi[0].detach()))
        leaves = leaves_of(x, *params)
        proj(NORMS[norm](leaves[0], leaves[1:], in_place)).sum().backward()
        results[in_place] = [kept[0], *(leaf.grad for leaf in leaves)]
    for with_write, without in zip(results[True], results[False]):
        assert torch.equal(with_write, without)


@pytest.mark.parametrize("norm", sorted(NORMS))
def test_norm_backward_with_its_output_added_to_a_residual_stream(norm):
    """``norm(x) + r`` hands the one gradient tensor autograd made for the sum to both inputs:
    r's gradient must not become the norm's dx."""
    x, params = norm_inputs(norm, (2, 3, 123))
    r = torch.randn(2, 3, 123, device=DEVICE)
    proj = torch.nn.Linear(123, 17).to(DEVICE)
    results = {}
    for in_place in (True, False):
        leaves = leaves_of(x, *params, r)
        proj(NORMS[norm](leaves[0], leaves[1:-1], in_place) + leaves[-1]).sum().backward()
        results[in_place] = [leaf.grad for leaf in leaves]
    for with_write, without in zip(results[True], results[False]):
        assert torch.equal(with_write, without)


@pytest.mark.parametrize("norm", sorted(NORMS))
def test_norm_backward_without_storage_use_count_writes_nothing_in_place(norm, monkeypatch):
    """A torch without ``torch._C._storage_Use_Count`` cannot tell a detached alias apart:
    calibration gives up, and the in-place backward then allocates dx instead of failing."""
    import liger_kernel.ops.grad_ownership as grad_ownership

    monkeypatch.delattr(torch._C, "_storage_Use_Count")
    assert grad_ownership._calibrate_owned_grad_references() is None
    monkeypatch.setattr(grad_ownership, "_OWNED_GRAD_REFERENCES", None)
    assert norm_into_projection(norm) == {True: False, False: False}


def test_no_in_place_write_once_python_calls_count_differently():
    """Every count includes the references of the Python calls leading to it, and a
    frame-evaluation hook (Dynamo leaves one installed after a trace fails inside a Function)
    adds one an argument. In a child process, after such a failure: the interpreter reports the
    change, and the norm's backward, which wrote dx over dy before, no longer does (its counts
    are no longer those measured at import), with the same gradients."""
    import subprocess
    import sys
    from pathlib import Path

    code = """
import tests.conftest
import torch
from liger_kernel.ops import grad_ownership
from tests.ops.test_compiled_function_outputs import check_compiled_matches_eager
from tests.ops.test_grad_ownership import norm_into_projection
assert grad_ownership.counts_comparable_with_import()
assert norm_into_projection("rms_norm") == {True: True, False: False}
try:
    check_compiled_matches_eager("fused_linear_logprobs")
except Exception:
    pass
assert not grad_ownership.counts_comparable_with_import(), "the trace failure changed nothing"
assert norm_into_projection("rms_norm") == {True: False, False: False}
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


@pytest.mark.parametrize("norm", sorted(NORMS))
def test_no_in_place_write_when_calls_counted_differently_at_import(norm, monkeypatch):
    """The other direction, which no public switch produces: limits measured while a hook made
    every call a full one, counts taken after it was removed, would let a held gradient pass as
    private by one reference. Whatever the direction, the backward then writes nothing in place."""
    from liger_kernel.ops import grad_ownership

    monkeypatch.setattr(grad_ownership, "_CALL_REFERENCES_AT_IMPORT", grad_ownership.python_call_references() + 1)
    assert norm_into_projection(norm) == {True: False, False: False}
