"""The floor of one training step, from a profile of that step.

A training step cannot be faster than the matrix multiplications and the attention it must
do. From a ``torch.profiler`` trace of one step (``record_shapes=True``):

* ``gemm_ms``: every GPU kernel whose name says it is a GEMM (cuBLAS / cuBLASLt / CUTLASS:
  ``gemm``, ``gemv``, ``nvjet``, ``xmma``, ``cutlass``, ``wgmma``, split-K reductions;
  Inductor's GEMM templates ``triton_tem_*``; no other ``triton_*`` Inductor kernel);
* ``attention_ms``: every kernel whose name says attention (flash, memory-efficient
  ``fmha``, cuDNN ``sdpa``), matched before the GEMM names;
* ``head_gemm_ms``: the GEMM kernels launched by an op one of whose inputs has the
  vocabulary size as a dimension: the LM head and the loss's matmuls. They are replaced
  by the head floor, so a fused loss that does its matmuls inside Triton kernels and a
  materialised head are held to the same bound;
* the head floor: the three GEMMs of the LM head (logits ``X W^T``, ``dX = G W``,
  ``dW = G^T X``, ``6 N D V`` FLOPs for ``N`` tokens, hidden ``D``, vocabulary ``V``) at
  the cuBLAS rate measured on exactly those GEMMs in the same run.

    floor = (gemm_ms - head_gemm_ms) + attention_ms + 6 N D V / head_rate

The ratio floor / step time says how much of the step is beyond the unavoidable matmul
and attention work (elementwise kernels, launch gaps, the optimizer, memory traffic).

On CPU there are no kernels: the same classification runs on the profiled CPU ops
(``aten::mm``/``addmm``/``bmm`` as GEMMs, the SDPA ops as attention) so the code path is
exercised; those figures say nothing about a GPU.
"""

from __future__ import annotations

import re
import statistics
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch

ATTENTION_NAMES = re.compile(r"flash|fmha|attention|sdpa|attn_fwd|attn_bwd", re.IGNORECASE)
# cuBLAS split-K GEMMs finish in a separate reduction kernel, part of the GEMM.
GEMM_NAMES = re.compile(r"gemm|gemv|nvjet|xmma|cutlass|wgmma|cublas|splitkreduce|_grouped_mm", re.IGNORECASE)
# Inductor's generated kernels are named after the ops they fuse: a pointwise kernel that
# lays out SDPA's inputs carries "scaled_dot_product" in its name without being attention.
# Only its GEMM templates (triton_tem_*) are matmuls.
INDUCTOR_PREFIX = "triton_"
INDUCTOR_GEMM_PREFIX = "triton_tem_"
CPU_GEMM_OPS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_grouped_mm"})


@dataclass
class KernelRecord:
    """One kernel (GPU) or op (CPU) of the profiled step."""

    name: str
    us: float
    head: bool  # launched by an op with an input of the vocabulary dimension


@dataclass
class StepFloor:
    kernel_ms: float  # all kernels of the profiled step (GPU busy time, or CPU op time)
    gemm_ms: float
    attention_ms: float
    head_gemm_ms: float
    head_floor_ms: float

    @property
    def floor_ms(self) -> float:
        return self.gemm_ms - self.head_gemm_ms + self.attention_ms + self.head_floor_ms


def kind_of(name: str, cpu: bool = False) -> str:
    """``"attention"``, ``"gemm"`` or ``"other"`` for a kernel (or, with ``cpu``, an op) name."""
    if cpu:
        if "scaled_dot_product" in name or "flash_attention" in name:
            return "attention"
        return "gemm" if name in CPU_GEMM_OPS else "other"
    if name.startswith(INDUCTOR_PREFIX):
        return "gemm" if name.startswith(INDUCTOR_GEMM_PREFIX) else "other"
    if ATTENTION_NAMES.search(name):
        return "attention"
    return "gemm" if GEMM_NAMES.search(name) else "other"


def summarize(records: Iterable[KernelRecord], head_floor_ms: float, cpu: bool = False) -> StepFloor:
    totals = {"gemm": 0.0, "attention": 0.0, "other": 0.0}
    head_gemm = 0.0
    for r in records:
        kind = kind_of(r.name, cpu)
        totals[kind] += r.us
        if kind == "gemm" and r.head:
            head_gemm += r.us
    return StepFloor(kernel_ms=sum(totals.values()) / 1e3, gemm_ms=totals["gemm"] / 1e3,
                     attention_ms=totals["attention"] / 1e3, head_gemm_ms=head_gemm / 1e3,
                     head_floor_ms=head_floor_ms)


def _has_dim(shapes, size: int) -> bool:
    return any(isinstance(s, (list, tuple)) and size in s for s in shapes or ())


def records_from_profile(prof, vocab: int, device: torch.device) -> list[KernelRecord]:
    """Kernels (CUDA) or GEMM/attention-relevant ops (CPU) of a finished ``torch.profiler.profile``.

    CUDA: each device kernel is tied to the op that launched it through the profiler's
    correlation ids; ``head`` when that op has an input with a dimension of size ``vocab``.
    CPU: every op's own duration (nested GEMM ops such as ``aten::mm`` under
    ``aten::linear`` are listed by exact name, so nothing is counted twice).
    """
    from torch.autograd import DeviceType

    events = list(prof.profiler.kineto_results.events())
    if device.type == "cuda":
        ops = {e.correlation_id(): e for e in events
               if e.device_type() == DeviceType.CPU and e.linked_correlation_id() == 0}
        out = []
        for e in events:
            if e.device_type() != DeviceType.CUDA or e.duration_ns() <= 0:
                continue
            op = ops.get(e.linked_correlation_id())
            out.append(KernelRecord(e.name(), e.duration_ns() / 1e3, op is not None and _has_dim(op.shapes(), vocab)))
        return out
    return [KernelRecord(e.name(), e.duration_ns() / 1e3, _has_dim(e.shapes(), vocab))
            for e in events if e.device_type() == DeviceType.CPU and e.duration_ns() > 0]


def profile_step(step, device: torch.device, vocab: int, head_floor_ms: float) -> StepFloor:
    """Run ``step()`` (one training step) once under the profiler and summarize it."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
        torch.cuda.synchronize(device)
    with profile(activities=activities, record_shapes=True) as prof:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return summarize(records_from_profile(prof, vocab, device), head_floor_ms, cpu=device.type != "cuda")


def head_gemm_rate(n: int, d: int, v: int, dtype: torch.dtype, device: torch.device) -> float:
    """FLOP/s of the LM head's three GEMMs (``X W^T``, ``G W``, ``G^T X``) at ``(n, d, v)``.

    CUDA: ``triton.testing.do_bench`` median of the three back to back; CPU: the wall-clock
    median of three runs (it keeps the pipeline running; not a GPU figure).
    """
    x = torch.randn(n, d, device=device, dtype=dtype)
    w = torch.randn(v, d, device=device, dtype=dtype)
    g = torch.randn(n, v, device=device, dtype=dtype)

    def three():
        torch.mm(x, w.t())
        torch.mm(g, w)
        torch.mm(g.t(), x)

    three()
    if device.type == "cuda":
        import triton.testing

        ms = float(triton.testing.do_bench(three, warmup=25, rep=100, return_mode="median"))
    else:
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            three()
            times.append((time.perf_counter() - t0) * 1e3)
        ms = statistics.median(times)
    return 6.0 * n * d * v / (ms * 1e-3)
