"""Does the memory layout of q and k change the speed of ``scaled_dot_product_attention``? (GPU diagnostic)

Run 9's steady-state profiles show the same cuDNN flash-attention kernels ~8% (forward) and
~4% (backward) slower in the patched e2e step than in the unpatched one. One difference
between the two: HF's ``apply_rotary_pos_emb`` returns q and k as fresh (B, H, T, D)-contiguous
tensors, while the library's RoPE keeps its input's layout, so q and k reach the attention as
(B, T, H, D)-strided views of the projections (v is such a view in both). This script times
the attention alone, with the e2e model's shapes (B 4, T 2048, Hq 32, Hk 8, D 64, causal,
``enable_gqa``, bf16, default backend selection), for each layout of q/k and v, forward and
forward + backward, rounds alternating.

Usage: ``python scripts/device/sdpa_layout.py [--out CSV] [--rounds 3]``
"""

from __future__ import annotations

import argparse
import csv
import datetime

import torch
import torch.nn.functional as F
import triton

B, T, HQ, HK, D = 4, 2048, 32, 8, 64


def make(heads: int, layout: str) -> torch.Tensor:
    """(B, heads, T, D) bf16 that requires grad, stored as ``layout`` ("bhsd" or "bshd")."""
    if layout == "bhsd":
        x = torch.randn(B, heads, T, D, device="cuda", dtype=torch.bfloat16)
    else:
        x = torch.randn(B, T, heads, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    return x.requires_grad_()


def fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def fwd_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: torch.Tensor) -> None:
    torch.autograd.grad(fwd(q, k, v), (q, k, v), grad)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    cases = {"qk bhsd, v bshd (HF)": ("bhsd", "bshd"), "qk bshd, v bshd (liger)": ("bshd", "bshd"),
             "qk bhsd, v bhsd": ("bhsd", "bhsd")}
    times: dict[str, dict[str, list[float]]] = {c: {"fwd": [], "fwd+bwd": []} for c in cases}
    tensors = {}
    for name, (qk, v) in cases.items():
        q, k, vv = make(HQ, qk), make(HK, qk), make(HK, v)
        grad = torch.randn(B, T, HQ, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        tensors[name] = (q, k, vv, grad)

    for _ in range(args.rounds):
        for name, (q, k, v, grad) in tensors.items():
            with torch.no_grad():
                times[name]["fwd"].append(triton.testing.do_bench(lambda q=q, k=k, v=v: fwd(q, k, v), warmup=25, rep=200))
            times[name]["fwd+bwd"].append(
                triton.testing.do_bench(lambda q=q, k=k, v=v, g=grad: fwd_bwd(q, k, v, g), warmup=25, rep=200))
    with torch.no_grad():
        out = fwd(*tensors["qk bshd, v bshd (liger)"][:3])
    print(f"output strides {out.stride()}; cudnn sdp enabled {torch.backends.cuda.cudnn_sdp_enabled()}")
    gpu, date = torch.cuda.get_device_name(), datetime.date.today().isoformat()
    rows = []
    for name, by_pass in times.items():
        for pass_name, ts in by_pass.items():
            print(f"{name:28s} {pass_name:8s} " + " ".join(f"{t:.4f}" for t in ts) + " ms")
            rows.append({"gpu": gpu, "torch": torch.__version__, "date": date, "layouts": name, "pass": pass_name,
                         "median_ms_per_round": " ".join(f"{t:.5f}" for t in ts)})
    if args.out:
        with open(args.out, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)


if __name__ == "__main__":
    main()
