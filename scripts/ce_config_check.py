"""Check the cross-entropy kernel's launch settings for correctness and speed on a GPU.

For each CrossEntropyConfig setting (column block, programs per SM, lane width): per-row loss and the gradient against float64
``F.cross_entropy`` at fp32 and bf16, then the median time of the in-place forward (which
computes the gradient) at N 8192, V 128256 bf16. A setting whose results are wrong must never
become a default, however fast it is. Last, the default kernel captured in a CUDA graph and
replayed must give the eager result.

Usage (GPU): PYTHONPATH=src python3 scripts/ce_config_check.py
"""

import statistics

import torch
import torch.nn.functional as F

from liger_kernel.ops.config import override_launch_config
from liger_kernel.ops.cross_entropy import CrossEntropyConfig, LigerCrossEntropyFunction


def worst_errors(n, v, dtype):
    logits = (torch.randn(n, v, device="cuda") * 4).to(dtype)
    target = torch.randint(0, v, (n,), device="cuda")
    ref = logits.double().requires_grad_()
    ref_rows = F.cross_entropy(ref, target, reduction="none")
    ref_rows.sum().backward()
    ours = logits.clone().requires_grad_()
    rows = LigerCrossEntropyFunction.apply(ours, target, None, -100, 0.0, 0.0, "none", None, False, True)[0]
    rows.sum().backward()
    # Relative: the loss has the logits' dtype (one rounding of the float32 result).
    loss_err = float(((rows.double() - ref_rows.detach()).abs() / ref_rows.detach().abs().clamp_min(1.0)).max())
    grad_err = float((ours.grad.double() - ref.grad).abs().max())
    return loss_err, grad_err


def time_ms(n=8192, v=128256):
    pristine = torch.randn(n, v, device="cuda", dtype=torch.bfloat16)
    target = torch.randint(0, v, (n,), device="cuda")
    times = []
    for i in range(12):
        # Popped from the list inside the call: a temporary, so the gradient overwrites it.
        pending = [pristine.clone().requires_grad_()]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        LigerCrossEntropyFunction.apply(pending.pop(), target)
        end.record()
        torch.cuda.synchronize()
        if i >= 2:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


SETTINGS = [
    *({"max_block": b, "programs_per_sm": p} for b in (16384, 32768) for p in (1, 2, 4)),
    {"max_block": 32768, "programs_per_sm": 4, "lane_width": 32768},  # per-block statistics
]


def graph_replay_matches(n=1024, v=128256):
    """The default kernel inside a CUDA graph: replay on fresh logits equals an eager call."""
    logits = torch.randn(n, v, device="cuda", dtype=torch.bfloat16)
    target = torch.randint(0, v, (n,), device="cuda")
    static = logits.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        LigerCrossEntropyFunction.apply(static.clone(), target, None, -100, 0.0, 0.0, "none")
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rows = LigerCrossEntropyFunction.apply(static, target, None, -100, 0.0, 0.0, "none")[0]
    fresh = torch.randn_like(logits)
    static.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    eager = LigerCrossEntropyFunction.apply(fresh.clone(), target, None, -100, 0.0, 0.0, "none")[0]
    return torch.equal(rows, eager)


def main():
    for setting in SETTINGS:
        with override_launch_config(CrossEntropyConfig, **setting):
            errors = [worst_errors(4099, 32003, torch.float32), worst_errors(1024, 128256, torch.float32),
                      worst_errors(4099, 32003, torch.bfloat16)]
            ok = (errors[0][0] < 1e-3 and errors[1][0] < 1e-3 and errors[2][0] < 1e-2
                  and all(e[1] < 1e-2 for e in errors))
            print(f"{setting}: max |loss err| fp32 {errors[0][0]:.2e} / {errors[1][0]:.2e}, bf16 {errors[2][0]:.2e}; "
                  f"max |grad err| {max(e[1] for e in errors):.2e} -> {'OK' if ok else 'WRONG'}; "
                  f"time {time_ms():.3f} ms", flush=True)
    print(f"CUDA graph replay of the default kernel equals eager: {graph_replay_matches()}", flush=True)


if __name__ == "__main__":
    main()
