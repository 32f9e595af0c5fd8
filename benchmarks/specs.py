"""The benchmark specs of every op family (``bench_*.py``), by name: what ``python -m benchmarks``
and the upstream-Liger child process (:mod:`benchmarks.peers`) both run."""

from __future__ import annotations

OPS = ("rms_norm", "layer_norm", "rope", "swiglu", "geglu", "cross_entropy", "fused_linear_cross_entropy", "jsd",
       "dpo", "fused_linear_logprobs", "grpo", "fused_linear_jsd")


def load_specs(ops: tuple[str, ...]):
    from benchmarks import (
        bench_cross_entropy,
        bench_distillation,
        bench_gated_mlp,
        bench_norms,
        bench_post_training,
        bench_rl_distillation,
        bench_rope,
    )

    modules = (bench_norms, bench_rope, bench_gated_mlp, bench_cross_entropy, bench_distillation, bench_post_training,
               bench_rl_distillation)
    specs = {s.name: s for m in modules for s in m.SPECS}
    return [specs[name] for name in ops]
