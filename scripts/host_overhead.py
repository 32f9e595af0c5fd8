"""Host time per call of Liger's modules against Hugging Face's, on the GPU.

With tiny inputs (a few tokens) every GPU kernel finishes in microseconds, so the wall time
per call is the host time: Python, autograd bookkeeping and kernel launches. That host time
is what leaves the GPU idle in a training step whose kernels are short (the llama-1b e2e
profile: ~11 ms idle per step, all in the forward). Each row is the median over repeats of
the mean over ``--calls`` calls, in microseconds.

Usage: ``PYTHONPATH=src:. python scripts/host_overhead.py --out OUT``
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import statistics
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():  # smoke run through the Triton interpreter
    import os

    os.environ.setdefault("TRITON_INTERPRET", "1")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def per_call_us(fn, calls: int, repeats: int = 7) -> float:
    for _ in range(min(20, calls)):
        fn()
    _sync()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        _sync()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(samples)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--profile", action="store_true",
                        help="also write cProfile tables of the patched layer and model forward")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, apply_rotary_pos_emb

    from liger_kernel.ops.config import override_launch_config
    from liger_kernel.ops.launch import KernelLaunchConfig
    from liger_kernel.ops.rms_norm import rms_norm_forward
    from liger_kernel.transformers import (
        LigerRMSNorm,
        LigerSwiGLUMLP,
        apply_liger_kernel_to_llama,
        liger_rotary_pos_emb,
    )
    from liger_kernel.transformers.recompute import recompute_norm_outputs
    from transformers import LlamaConfig, LlamaForCausalLM

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # cpu: a smoke run only
    dtype = torch.bfloat16
    hidden, inter, tokens = 2048, 8192, args.tokens
    config = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=2, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=4096, attn_implementation="sdpa", use_cache=False)
    x = torch.randn(1, tokens, hidden, device=device, dtype=dtype, requires_grad=True)
    rows = [("tokens", tokens)]

    def record(name: str, fn) -> None:
        us = per_call_us(fn, args.calls, args.repeats)
        rows.append((name, round(us, 2)))
        print(f"{name:60s} {us:9.2f} us", flush=True)

    def both_launch_modes(name: str, fn) -> None:
        for cached in (True, False):
            with override_launch_config(KernelLaunchConfig, cached=cached):
                record(f"{name} [{'cached' if cached else 'triton'} launch]", fn)

    weight = torch.ones(hidden, device=device, dtype=dtype, requires_grad=True)
    x_plain = x.detach().view(tokens, hidden)
    with torch.no_grad():
        both_launch_modes("rms_norm_forward launcher (no autograd)", lambda: rms_norm_forward(x_plain, weight, 1e-6, 0.0,
                                                                                            "llama"))
    liger_norm = LigerRMSNorm(hidden).to(device, dtype)
    hf_norm = LlamaRMSNorm(hidden).to(device, dtype)
    both_launch_modes("LigerRMSNorm forward (grad)", lambda: liger_norm(x))
    record("HF LlamaRMSNorm forward (grad)", lambda: hf_norm(x))

    linear = torch.nn.Linear(hidden, hidden, bias=False, device=device, dtype=dtype)
    record("nn.Linear forward (grad)", lambda: linear(x))
    with recompute_norm_outputs():
        record("nn.Linear forward (grad), recompute hooks active", lambda: linear(x))

    liger_mlp = LigerSwiGLUMLP(config).to(device, dtype)
    hf_mlp = LlamaMLP(config).to(device, dtype)
    both_launch_modes("LigerSwiGLUMLP forward (grad)", lambda: liger_mlp(x))
    record("HF LlamaMLP forward (grad)", lambda: hf_mlp(x))

    head_dim = hidden // 32
    q = torch.randn(1, 32, tokens, head_dim, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(1, 8, tokens, head_dim, device=device, dtype=dtype, requires_grad=True)
    cos = torch.randn(1, tokens, head_dim, device=device, dtype=dtype)
    sin = torch.randn(1, tokens, head_dim, device=device, dtype=dtype)
    both_launch_modes("liger_rotary_pos_emb (grad)", lambda: liger_rotary_pos_emb(q, k, cos, sin))
    record("HF apply_rotary_pos_emb (grad)", lambda: apply_rotary_pos_emb(q, k, cos, sin))

    torch.manual_seed(0)
    hf_model = LlamaForCausalLM(config).to(device, dtype)
    liger_model = LlamaForCausalLM(config).to(device, dtype)
    liger_model.load_state_dict(hf_model.state_dict())
    apply_liger_kernel_to_llama(model=liger_model)
    # The recompute is a patch option: a second copy patched without it.
    plain_model = LlamaForCausalLM(config).to(device, dtype)
    plain_model.load_state_dict(hf_model.state_dict())
    apply_liger_kernel_to_llama(model=plain_model, recompute_norm_outputs=False)
    ids = torch.randint(0, config.vocab_size, (1, tokens), device=device)
    position_ids = torch.arange(tokens, device=device)[None]
    rotary = hf_model.model.rotary_emb
    embeddings = rotary(x, position_ids)

    def layer_call(model, recompute: bool):
        layer = model.model.layers[0]

        def run():
            context = recompute_norm_outputs() if recompute else contextlib.nullcontext()
            with context:
                return layer(x, attention_mask=None, position_ids=position_ids, position_embeddings=embeddings)
        return run

    record("HF LlamaDecoderLayer forward (grad)", layer_call(hf_model, False))
    both_launch_modes("patched LlamaDecoderLayer forward (grad)", layer_call(liger_model, False))
    both_launch_modes("patched LlamaDecoderLayer forward (grad), recompute", layer_call(liger_model, True))

    def forward(model, recompute: bool):
        model = (liger_model if recompute else plain_model) if model is liger_model else model

        def run():
            return model(input_ids=ids, labels=ids).loss
        return run

    record("HF 2-layer model forward (grad)", forward(hf_model, False))
    record("patched 2-layer model forward (grad), recompute", forward(liger_model, True))
    record("patched 2-layer model forward (grad), no recompute", forward(liger_model, False))

    if args.profile:
        import cProfile
        import io
        import pstats

        for name, fn in (("layer_recompute", layer_call(liger_model, True)), ("layer_plain", layer_call(liger_model, False)),
                         ("model_forward", forward(liger_model, True))):
            fn()
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(200):
                fn()
            profiler.disable()
            stream = io.StringIO()
            pstats.Stats(profiler, stream=stream).sort_stats("tottime").print_stats(45)
            (args.out / f"host_profile_{name}.txt").write_text(stream.getvalue())

    def step(model):
        def run():
            model(input_ids=ids, labels=ids).loss.backward()
        return run

    record("HF 2-layer model forward+backward", step(hf_model))
    both_launch_modes("patched 2-layer model forward+backward", step(liger_model))
    with torch.no_grad():
        record("HF 2-layer model forward (no grad)", lambda: hf_model(input_ids=ids, labels=ids))

    path = args.out / "host_overhead.csv"
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["case", "us_per_call"])
        writer.writerows(rows)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
