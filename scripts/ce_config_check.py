"""Check the cross-entropy kernel's launch settings for correctness and speed on a GPU.

For each (CE_MAX_BLOCK, CE_PREFETCH, CE_PROGRAMS_PER_SM) setting: per-row loss and the
gradient against float64 ``F.cross_entropy`` at fp32 and bf16, then the median time of the
in-place forward (which computes the gradient) at N 8192, V 128256 bf16. A setting whose
results are wrong must never become a default, however fast it is.

Usage (GPU): PYTHONPATH=src python3 scripts/ce_config_check.py
"""

import itertools
import statistics

import torch
import torch.nn.functional as F

import liger_kernel.ops.cross_entropy as ce_ops
from liger_kernel.ops.cross_entropy import LigerCrossEntropyFunction


def worst_errors(n, v, dtype):
    logits = (torch.randn(n, v, device="cuda") * 4).to(dtype)
    target = torch.randint(0, v, (n,), device="cuda")
    ref = logits.double().requires_grad_()
    ref_rows = F.cross_entropy(ref, target, reduction="none")
    ref_rows.sum().backward()
    ours = logits.clone().requires_grad_()
    rows = LigerCrossEntropyFunction.apply(ours, target, None, -100, 0.0, 0.0, "none", None, False, True)[0]
    rows.sum().backward()
    loss_err = float((rows.double() - ref_rows.detach()).abs().max())
    grad_err = float((ours.grad.double() - ref.grad).abs().max())
    return loss_err, grad_err


def time_ms(n=8192, v=128256):
    pristine = torch.randn(n, v, device="cuda", dtype=torch.bfloat16)
    logits = pristine.clone().requires_grad_()
    target = torch.randint(0, v, (n,), device="cuda")
    times = []
    for i in range(12):
        with torch.no_grad():
            logits.copy_(pristine)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        LigerCrossEntropyFunction.apply(logits, target)
        end.record()
        torch.cuda.synchronize()
        if i >= 2:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def main():
    for block, prefetch, programs in itertools.product((8192, 16384, 32768), (True, False), (2, 4)):
        ce_ops.CE_MAX_BLOCK, ce_ops.CE_PREFETCH, ce_ops.CE_PROGRAMS_PER_SM = block, prefetch, programs
        errors = [worst_errors(4099, 32003, torch.float32), worst_errors(1024, 128256, torch.float32),
                  worst_errors(4099, 32003, torch.bfloat16)]
        ok = errors[0][0] < 1e-3 and errors[1][0] < 1e-3 and errors[2][0] < 1e-2 and all(e[1] < 1e-2 for e in errors)
        print(f"block {block} prefetch {prefetch} programs/SM {programs}: "
              f"max |loss err| fp32 {errors[0][0]:.2e} / {errors[1][0]:.2e}, bf16 {errors[2][0]:.2e}; "
              f"max |grad err| {max(e[1] for e in errors):.2e} -> {'OK' if ok else 'WRONG'}; "
              f"time {time_ms():.3f} ms", flush=True)


if __name__ == "__main__":
    main()
