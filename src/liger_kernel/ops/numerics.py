"""Numeric helpers shared by the kernels (Triton device functions)."""

import triton
import triton.language as tl


@triton.jit
def round_to_dtype(x, dtype: tl.constexpr, BY_HAND: tl.constexpr):
    """fp32 ``x`` rounded to ``dtype`` (nearest even) and returned as fp32.

    Triton's interpreter converts fp32 -> bf16 by truncation, unlike the GPU; with BY_HAND
    (set only under the interpreter) the bf16 rounding is done on the bit pattern so CPU
    runs round exactly as the GPU does. Values rounded this way store exactly.
    """
    if BY_HAND and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = ((bits + (0x7FFF + ((bits >> 16) & 1))) >> 16) << 16
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(dtype).to(tl.float32)


@triton.jit
def tanh_and_sech2(x):
    """``(tanh(x), 1 - tanh(x)**2)`` to float32 accuracy, with plain ``tl`` ops only.

    From ``e = exp(-2|x|)`` (never overflows; -inf gives e = 0): ``tanh = (1 - e) / (1 + e)``
    and ``sech**2 = 4e / (1 + e)**2``, the latter free of the cancellation in ``1 - t*t``
    where the cap saturates. Below |x| = 1/4, where ``1 - e`` would cancel, the Taylor
    series to x**9 (truncation < 1e-8 relative) gives tanh instead.
    """
    a = tl.abs(x)
    e = tl.exp(-2.0 * a)
    one_plus_e = 1.0 + e
    a2 = a * a
    series = a * (1.0 + a2 * (-1.0 / 3.0 + a2 * (2.0 / 15.0 + a2 * (-17.0 / 315.0 + a2 * (62.0 / 2835.0)))))
    t = tl.where(a < 0.25, series, (1.0 - e) / one_plus_e)
    t = tl.where(x < 0.0, -t, t)
    return t, 4.0 * e / (one_plus_e * one_plus_e)
