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
