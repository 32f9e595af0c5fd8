"""Whether a norm's backward may write its input gradient over the gradient it received.

Writing ``dx`` over ``dy`` saves an (N, H) buffer while the backward runs, and destroys ``dy``.
Only the caller can know that nobody else reads ``dy``: autograd hands the very tensor given to
``y.backward(g)`` to the backward, passes one gradient tensor on unchanged to both inputs of an
addition (``norm(x) + residual``), and hooks may keep it. So the write happens only where the
caller asked for it (``in_place=True``: a contract, see ``docs/api.md``, "Memory ownership"),
never by guessing from reference counts; this module checks only what the kernel needs.
"""

from __future__ import annotations

import torch


def backward_writes_into_grad(in_place: bool, grad_output: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether a norm's backward writes dx over ``grad_output``.

    ``in_place`` is the caller's promise that ``grad_output`` is private to this backward:
    the norm's output feeds only ops whose backward makes a fresh gradient (projections),
    nothing passes its gradient on to another branch, and no hook keeps it. The patched
    models make that promise for the norms inside decoder layers (``families.NormSpec.in_place``);
    the public modules and functions make it only when their caller passes ``in_place=True``.

    Even then the write is skipped, and dx gets a fresh buffer, where the kernel cannot write
    into ``grad_output``: another dtype than x's, not contiguous, a zero stride (the backward
    of ``y.sum()`` hands over one scalar expanded to y's shape), part of a graph
    (``create_graph=True`` may have saved it), or under ``torch.compile`` (the traced backward
    must not mutate its input; Inductor plans the buffers itself).
    """
    return (in_place and not torch.compiler.is_compiling() and grad_output.dtype == x.dtype
            and grad_output.is_contiguous() and 0 not in grad_output.stride() and not grad_output.requires_grad)
