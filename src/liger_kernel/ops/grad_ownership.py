"""Whether a backward may write into the gradient it received: nobody else can see that memory.

A backward that overwrites ``grad_output`` with ``grad_input`` saves a buffer the size of the
activation, but only where autograd made that gradient for this backward alone; a gradient the
caller passed in, or that a hook keeps (also as a detached alias), must survive.
"""

from __future__ import annotations

import sys

import torch

from liger_kernel.ops.autograd import once_differentiable


def _references_to_argument(argument: object) -> int:
    return sys.getrefcount(argument)


def python_call_references() -> int:
    """References a Python function sees on an argument that its Python caller holds once.

    Every reference count below includes the references of the Python calls that lead to it,
    and how many those are depends on how the interpreter calls Python functions: a
    frame-evaluation hook (PEP 523: Dynamo can leave one installed after a trace fails, some
    debuggers install one) turns the inlined calls into full ones, one reference more an
    argument. The limits are measured at import, so they hold only while this count is what
    it was then (:func:`counts_comparable_with_import`)."""
    return _references_to_argument(object())


_CALL_REFERENCES_AT_IMPORT = python_call_references()


def counts_comparable_with_import() -> bool:
    """Whether the interpreter calls Python functions as it did when the limits were measured;
    where not, nothing is written in place (a count shifted either way could let a held
    tensor pass as private)."""
    return python_call_references() == _CALL_REFERENCES_AT_IMPORT


def backward_writes_into_grad(in_place: bool, grad_output: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether a norm's in-place backward may write dx over ``grad_output``.

    Only where asked for (``in_place``) and grad_output is a buffer that autograd made for
    this backward and nobody reads afterwards:

    * contiguous, of x's dtype and without a zero stride: the backward of ``y.sum()`` hands
      over one scalar expanded to y's shape, one element behind all of them;
    * not part of a graph (``create_graph=True``), which may have saved it;
    * not the caller's tensor: autograd passes the very tensor given to ``y.backward(g)`` or
      ``torch.autograd.grad(y, x, g)`` into the backward (also through ops that pass a
      gradient on unchanged, such as an addition, or as a view of it through view ops), and
      the caller may read ``g`` again. No API tells autograd's own buffers from others;
      :func:`_grad_owned_by_autograd` tells them by their Python references and by the
      tensors sharing their storage.

    Never under torch.compile, where the backward must not mutate its input (it may be a
    view the traced graph created without grad; Inductor plans the buffers itself).

    Memory: where the write is refused the backward allocates dx, one more (N, H) buffer
    while it runs. In a model the norm's gradient comes from the projections it feeds, a
    fresh tensor that autograd owns, so training keeps the saving; a gradient passed in by
    the caller, or held by a hook (also as a detached alias), costs the buffer instead of
    being overwritten.
    """
    return (in_place and not torch.compiler.is_compiling() and grad_output.dtype == x.dtype
            and grad_output.is_contiguous() and 0 not in grad_output.stride() and not grad_output.requires_grad
            and _grad_owned_by_autograd(grad_output))


# What _grad_owned_by_autograd counts for a gradient that autograd made itself, when a norm's
# backward asks backward_writes_into_grad: Python references to the gradient, to the tensor it
# is a view of (if any), and users of its storage, without and with such a base. None: unknown,
# so nothing is written in place. Measured at import by _calibrate_owned_grad_references.
_OWNED_GRAD_REFERENCES: tuple[int, int, int, int] | None = None
# Set while calibrating: _grad_owned_by_autograd records its counts here instead of deciding.
_CALIBRATION_COUNTS: list[tuple[int, int, int]] | None = None


def _storage_users(tensor: torch.Tensor) -> int:
    """How many tensors (and storage handles) share ``tensor``'s storage, as c10 counts them."""
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)


def _grad_owned_by_autograd(grad: torch.Tensor) -> bool:
    """Whether nothing but the backward that received ``grad`` can see its memory: then
    autograd made it for that backward alone.

    Two counts, each compared with the same count for a gradient autograd made, measured at
    import through the same call chain (an autograd Function whose decorated backward calls
    backward_writes_into_grad as the norms' do):

    * Python references (CPython's ``sys.getrefcount``) to ``grad`` and to the tensor it is a
      view of. A gradient computed inside autograd's engine reaches a Python backward with only
      the references of the call chain; one the caller passed to ``backward()`` or
      ``autograd.grad``, or that a hook keeps, has the caller's too, and a view of it (through
      view ops of the graph) has it as ``_base``.
    * Users of its storage (c10's use count): every tensor sharing the memory holds one, so a
      hook that keeps ``grad.detach()`` or ``grad.data`` (activation-gradient caches), or a
      module backward hook that keeps a detached alias of the norm consumer's ``grad_input``,
      shows as one user more - something Python references cannot see.

    Without CPython reference counts (another interpreter, a free-threaded build) or without
    torch's storage use count, nothing counts as owned. A gradient autograd hands to two
    branches of the graph as one tensor (the norm's output added to a residual stream) is seen
    on torch 2.11 (CUDA) and 2.13 (CPU), whose engines keep the Python object referenced
    meanwhile (``tests/ops/test_grad_ownership.py``); other versions were not checked, so there that case
    stays the caller's to avoid with ``in_place=False`` as the norms' docstrings say.
    """
    limits = _OWNED_GRAD_REFERENCES
    if limits is None and _CALIBRATION_COUNTS is None:
        return False  # unknown (or not countable in this torch): never written in place
    base = grad._base
    counts = (sys.getrefcount(grad), 0 if base is None else sys.getrefcount(base), _storage_users(grad))
    if _CALIBRATION_COUNTS is not None:
        _CALIBRATION_COUNTS.append(counts)
        return False
    if not counts_comparable_with_import():
        return False
    max_refs, max_base_refs, max_users, max_users_of_a_view = limits
    return (counts[0] <= max_refs and counts[1] <= max_base_refs
            and counts[2] <= (max_users if base is None else max_users_of_a_view))


class _GradOwnershipProbe(torch.autograd.Function):
    """Calibration of _OWNED_GRAD_REFERENCES: ``y = 2x`` whose backward reaches
    backward_writes_into_grad exactly as the norms' backward does."""

    @staticmethod
    def forward(ctx, X: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(X)
        ctx.in_place = True
        return X * 2.0

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output: torch.Tensor):
        (X,) = ctx.saved_tensors
        write_into_grad = backward_writes_into_grad(ctx.in_place, grad_output, X)
        return grad_output * 2.0 if not write_into_grad else grad_output


def _calibrate_owned_grad_references(device: str = "cpu") -> tuple[int, int, int, int] | None:
    """Counts of :func:`_grad_owned_by_autograd` for gradients autograd made: one plain, one a
    view of another (None where they cannot be measured)."""
    global _CALIBRATION_COUNTS
    if sys.implementation.name != "cpython" or not getattr(sys, "_is_gil_enabled", lambda: True)():
        return None
    _CALIBRATION_COUNTS = []
    try:
        with torch.inference_mode(False), torch.enable_grad():
            x = torch.ones(2, 4, device=device, requires_grad=True)
            (_GradOwnershipProbe.apply(x) * 2.0).sum().backward()  # a fresh (2, 4) gradient
            (_GradOwnershipProbe.apply(x).view(-1) * 2.0).sum().backward()  # a (2, 4) view of a fresh (8,)
        (plain, plain_base, plain_users), (viewed, base, viewed_users) = _CALIBRATION_COUNTS
    except Exception:  # any surprise here (no storage use count in this torch) only means: never write in place
        return None
    finally:
        _CALIBRATION_COUNTS = None
    if plain_base != 0 or base == 0 or viewed_users <= plain_users:
        return None  # the probes did not see the gradients they were built for
    return min(plain, viewed), base, plain_users, viewed_users


_OWNED_GRAD_REFERENCES = _calibrate_owned_grad_references()


# ---- Saved activations: whether a backward may write its input gradients over them ----
#
# The gated activations' in-place backward writes da over the saved gate activation a and db
# over the saved up activation b. That is only invisible where nothing but the autograd graph
# still refers to their memory: a forward hook on ``gate_proj`` that kept its output (or
# ``out.detach()``, ``out.data``) would otherwise find gradient values in it after backward.
# Same two counts as for gradients above, for the tensors unpacked from ``ctx.saved_tensors``:
# Python references to each tensor and to the tensor it views, and users of each storage beyond
# the tensors of the pair itself (a fused ``gate_up`` output and its two halves are three).

# (references to a saved tensor, references to the base of a saved view, storage users beyond
# the pair's own tensors) for activations nobody else holds; None: never written in place.
_PRIVATE_SAVED_COUNTS: tuple[int, int, int] | None = None
_SAVED_CALIBRATION_COUNTS: list[tuple[tuple[int, int, int], ...]] | None = None


def _saved_pair_counts(a: torch.Tensor, b: torch.Tensor) -> tuple[tuple[int, int, int], ...]:
    """Per tensor of the pair: (references to it, references to its base or 0, storage users
    beyond the distinct tensors of the pair and their bases on that storage)."""
    counts = []
    for x in (a, b):
        base = x._base
        storage = x.untyped_storage()._cdata
        own = {id(t): t for t in (a, b, a._base, b._base)
               if t is not None and t.untyped_storage()._cdata == storage}
        counts.append((sys.getrefcount(x) - 1, 0 if base is None else sys.getrefcount(base) - 1,
                       torch._C._storage_Use_Count(storage) - len(own)))
    return tuple(counts)


def unpack_private_activations(ctx) -> tuple[tuple[torch.Tensor, ...], bool]:
    """``(ctx.saved_tensors, private)``: private says whether a backward may overwrite the first
    two saved tensors (a gate and an up activation). Use it instead of ``ctx.saved_tensors``
    (which may be unpacked only once under activation checkpointing); it unpacks them itself,
    so that the references it counts do not depend on the caller.

    True only where each has no more Python references than an activation nobody kept, the
    tensor each views (a fused projection's output) none either, and each storage no user
    beyond the pair's tensors and their bases: a hook that kept the activation shows as one
    reference more, one that kept ``.detach()`` or ``.data`` as one storage user more. The
    limits are measured at import by :func:`_calibrate_private_saved_counts` through the same
    call (a Function whose backward asks this function about two saved activations); where
    they cannot be measured nothing is written in place.

    Memory: where refused, the backward allocates da and db, two buffers of the activations'
    size, while it runs.
    """
    saved = ctx.saved_tensors
    a, b = saved[0], saved[1]
    if _SAVED_CALIBRATION_COUNTS is not None:
        _SAVED_CALIBRATION_COUNTS.append(_saved_pair_counts(a, b))
        return saved, False
    limits = _PRIVATE_SAVED_COUNTS
    if limits is None or a.is_meta or b.is_meta or not counts_comparable_with_import():
        return saved, False
    max_refs, max_base_refs, max_extra_users = limits
    return saved, all(refs <= max_refs and base_refs <= max_base_refs and users <= max_extra_users
                      for refs, base_refs, users in _saved_pair_counts(a, b))


class _SavedActivationProbe(torch.autograd.Function):
    """Calibration of _PRIVATE_SAVED_COUNTS: ``y = a * b`` whose backward unpacks ``a`` and ``b``
    and asks unpack_private_activations exactly as the gated activations' backward does."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        return a * b

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output: torch.Tensor):
        (a, b), _ = unpack_private_activations(ctx)
        return grad_output * b, grad_output * a


def _calibrate_private_saved_counts(device: str = "cpu") -> tuple[int, int, int] | None:
    """Counts of :func:`unpack_private_activations` for two fresh activations and for the two
    halves of one (None where they cannot be measured or disagree with the tensors built)."""
    global _SAVED_CALIBRATION_COUNTS
    if sys.implementation.name != "cpython" or not getattr(sys, "_is_gil_enabled", lambda: True)():
        return None
    _SAVED_CALIBRATION_COUNTS = []
    try:
        with torch.inference_mode(False), torch.enable_grad():
            x = torch.ones(2, 4, device=device, requires_grad=True)
            _SavedActivationProbe.apply(x * 2.0, x * 3.0).sum().backward()  # two projections' outputs
            _SavedActivationProbe.apply(*(x * 2.0).chunk(2, dim=-1)).sum().backward()  # halves of a fused one
        (plain_a, plain_b), (half_a, half_b) = _SAVED_CALIBRATION_COUNTS
    except Exception:  # no storage use count in this torch: never write in place
        return None
    finally:
        _SAVED_CALIBRATION_COUNTS = None
    if (plain_a != plain_b or half_a != half_b or plain_a[1] != 0 or half_a[1] == 0
            or plain_a[0] != half_a[0] or plain_a[2] != half_a[2]):
        return None  # the probes did not see the activations they were built for
    return plain_a[0], half_a[1], plain_a[2]


_PRIVATE_SAVED_COUNTS = _calibrate_private_saved_counts()
