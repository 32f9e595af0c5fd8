"""A reduced GPU workload for NVIDIA compute-sanitizer: every kernel, forward and backward.

Run under ``compute-sanitizer --tool memcheck`` and ``--tool racecheck`` by
``scripts/sanitizer_check.sh``. Shapes are small and odd (non-powers of two, one row,
rows wider than one block) so masked tails and column loops are exercised; with
``PYTORCH_NO_CUDA_MEMORY_CACHING=1`` every tensor is its own allocation, so an
out-of-bounds access lands outside it and memcheck sees it.
"""

import torch
import torch.nn.functional as F

from liger_kernel.transformers.functional import (
    liger_cross_entropy,
    liger_fused_linear_cross_entropy,
    liger_geglu,
    liger_layer_norm,
    liger_rms_norm,
    liger_rotary_pos_emb,
    liger_swiglu,
)


def _grad(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape, device="cuda", dtype=dtype, requires_grad=True)


def run() -> None:
    torch.manual_seed(0)
    for rows, hidden in [(1, 1), (3, 123), (37, 4231), (5, 9000)]:
        x, w, b = _grad(rows, hidden), _grad(hidden), _grad(hidden)
        for mode in ("llama", "gemma", "none"):
            liger_rms_norm(x, w, 1e-6, 1.0 if mode == "gemma" else 0.0, mode, False).sum().backward()
        liger_layer_norm(x, w, b, 1e-5).sum().backward()
        a, g = _grad(rows, hidden), _grad(rows, hidden)
        liger_swiglu(a, g).sum().backward()
        liger_geglu(a, g).sum().backward()

    for batch, heads_q, heads_k, seq, dim in [(1, 4, 2, 1, 64), (2, 6, 2, 37, 128)]:
        q = torch.randn(batch, seq, heads_q, dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        k = torch.randn(batch, seq, heads_k, dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        q.requires_grad_(True)
        k.requires_grad_(True)
        angle = torch.randn(1, seq, dim, device="cuda")
        qe, ke = liger_rotary_pos_emb(q, k, angle.cos(), angle.sin())
        (qe.float().sum() + ke.float().sum()).backward()

    for n, v in [(1, 2), (7, 1007), (33, 40000)]:
        logits = _grad(n, v, dtype=torch.float32)
        target = torch.randint(0, v, (n,), device="cuda")
        target[0] = -100
        liger_cross_entropy(logits.clone(), target, label_smoothing=0.1).backward()
        liger_cross_entropy(logits, target, reduction="none", in_place=False).sum().backward()

    for n, d, v in [(5, 64, 1007), (130, 256, 5000)]:
        x, w, bias = _grad(n, d), _grad(v, d), _grad(v)
        target = torch.randint(0, v, (n,), device="cuda")
        liger_fused_linear_cross_entropy(x, w, target, bias=bias).backward()
        liger_fused_linear_cross_entropy(x, w, target, reduction="none").float().sum().backward()
    torch.cuda.synchronize()
    # sanity: the workload really ran kernels (F is used so the import is not dead)
    assert F.silu(torch.ones(1, device="cuda")).item() > 0
    print("sanitizer workload finished")


if __name__ == "__main__":
    run()
