"""GeGLU gating ``h = gelu_tanh(a) * b`` on the shared gated-activation kernels.

The kernels, launch geometry and in-place backward live in :mod:`liger_kernel.ops.swiglu`
(one kernel pair for every gated activation, switched by the ``ACTIVATION`` constexpr);
this module registers them with ``ACTIVATION=GELU_TANH`` as the custom ops
``liger::geglu_forward`` / ``liger::geglu_backward`` / ``liger::geglu_backward_inplace``.

Math (fp32, one rounding of each output to the input dtype), with torch's
``F.gelu(x, approximate="tanh")`` = HF ``gelu_pytorch_tanh``::

    gelu(a)  = 0.5 * a * (1 + tanh(u)),  u = sqrt(2/pi) * (a + 0.044715 * a^3)
             = a * s,                    s = sigmoid(2u)
    h        = gelu(a) * b

    gelu'(a) = s + 2 a s (1 - s) * sqrt(2/pi) * (1 + 3 * 0.044715 * a^2)
    da       = dh * b * gelu'(a)
    db       = dh * gelu(a)

The backward recomputes ``gelu(a)`` from the saved ``a`` and ``b``. HF computes the
activation and the product in the input dtype (two roundings); the kernel rounds once.
"""

from liger_kernel.ops.swiglu import (
    GATED_OPS,
    GELU_TANH,
    gated_mul_function,
    make_gated_ops,
)

GEGLU_OPS = make_gated_ops("geglu", GELU_TANH)
GATED_OPS[GELU_TANH] = GEGLU_OPS


class LigerGELUMulFunction(gated_mul_function(GEGLU_OPS)):  # type: ignore[misc]  # a base built per ops
    """``h = gelu_tanh(a) * b`` (GeGLU's gating).

    ``apply(a, b, in_place=False)``: ``a`` (gate) and ``b`` (up) of one shape (..., I) and
    dtype, any unit-last-stride layout; returns ``h`` of that shape and dtype. With
    ``in_place=True`` (the caller's promise that nothing else reads a and b) the backward
    writes da/db over a/b where their layout allows (see :mod:`liger_kernel.ops.swiglu`).
    """
