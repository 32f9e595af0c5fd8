"""Medusa-style extra decoding heads trained with the fused linear cross entropy.

Medusa (Cai et al., 2024) adds K heads to a frozen causal LM; head k (k = 1..K) reads the
last hidden state h_t and predicts token t + k + 1 (the model's own LM head predicts t + 1)::

    f_k(h) = h + SiLU(W_k h + b_k)            # residual block, W_k initialised to zero
    loss_k = CE(f_k(h_t) @ U_k^T, x_{t+k+1})  # U_k: the head's own (vocab, hidden) LM head
    loss   = sum_k decay**k * loss_k

Each head's logits are (B * (T - k - 1), vocab): with a Llama-3 vocabulary (128256) and K
heads, materialising them costs K times the memory of the model's own logits.
``LigerFusedLinearCrossEntropyLoss`` computes every loss_k and its gradients chunk by
chunk without ever holding the logits.

The script trains the heads on a frozen backbone (a Llama built from a config, or a local
checkpoint with ``--model-path``; the backbone's norms/MLP/RoPE are Liger-patched too):

* on a GPU, once with materialised logits (``F.cross_entropy`` on ``lm_head`` outputs) and
  once fused, from the same initial heads, and prints the peak memory and speed of each;
* on CPU (Triton interpreter), a tiny run: the fused loss and its gradients are checked
  against the materialised ones on one batch, the heads train a few steps with the fused
  loss, and the logits memory the fused loss avoids is reported from the shapes
  (theoretical bytes; no allocator statistics on CPU).

    python examples/medusa/train.py                   # CPU: tiny; GPU: 1024-wide backbone, 128256 vocab
    python examples/medusa/train.py --heads 4 --steps 50 --seq-len 4096
"""

import argparse
import copy
import os
import sys
import sysconfig
import time

import torch
import torch.nn.functional as F
from torch import nn

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before liger_kernel imports triton

from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

DEFAULTS = {
    # CPU: every kernel goes through the interpreter, so keep it tiny.
    "cpu": dict(hidden_size=64, layers=2, vocab_size=257, seq_len=64, batch_size=4, steps=5),
    # GPU: heads sized for a Llama-3 vocabulary, where the logits dominate memory.
    "cuda": dict(hidden_size=1024, layers=4, vocab_size=128256, seq_len=2048, batch_size=4, steps=10),
}


class MedusaHead(nn.Module):
    """Residual SiLU block plus an LM head of its own."""

    def __init__(self, hidden_size: int, vocab_size: int, lm_head_weight: torch.Tensor | None = None):
        super().__init__()
        self.block = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.block.weight)  # start as the identity on h, as Medusa does
        nn.init.zeros_(self.block.bias)
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)
        if lm_head_weight is not None:
            with torch.no_grad():
                self.lm_head.weight.copy_(lm_head_weight)

    def features(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + F.silu(self.block(hidden))


def medusa_loss(heads: nn.ModuleList, hidden: torch.Tensor, input_ids: torch.Tensor, fused: bool,
                decay: float) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Weighted sum of the heads' losses and the per-head losses.

    ``hidden`` (B, T, D) last hidden states of the backbone, ``input_ids`` (B, T). Head k uses
    positions t < T - k - 1 and targets ``input_ids[:, t + k + 1]``.
    """
    flce = LigerFusedLinearCrossEntropyLoss()
    total, per_head = 0.0, []
    for k, head in enumerate(heads, start=1):
        shift = k + 1
        features = head.features(hidden[:, :-shift]).reshape(-1, hidden.shape[-1])
        targets = input_ids[:, shift:].reshape(-1)
        if fused:
            loss = flce(head.lm_head.weight, features, targets)
        else:
            loss = F.cross_entropy(head.lm_head(features).float(), targets)
        per_head.append(loss)
        total = total + decay**k * loss
    return total, per_head


def materialized_logits_bytes(batch: int, seq: int, n_heads: int, vocab: int, dtype: torch.dtype) -> int:
    """Bytes of head logits a materialised loss keeps alive until backward.

    Per head: the logits in the model dtype plus their float32 upcast, which cross entropy
    saves (as log-probabilities) for backward. Their gradient adds about as much again,
    transiently, during backward; that is not counted here.
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    rows = sum(batch * (seq - k - 1) for k in range(1, n_heads + 1))
    return rows * vocab * (itemsize + 4)


def load_backbone(args, device, dtype):
    from liger_kernel.transformers import _apply_liger_kernel_to_instance
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if args.model_path:
        model = AutoModelForCausalLM.from_pretrained(args.model_path, local_files_only=True, dtype=dtype)
    else:
        config = LlamaConfig(hidden_size=args.hidden_size, intermediate_size=args.hidden_size * 11 // 4,
                             num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden_size // 64),
                             num_key_value_heads=max(1, args.hidden_size // 256), vocab_size=args.vocab_size,
                             max_position_embeddings=max(2048, args.seq_len), tie_word_embeddings=True,
                             attn_implementation="sdpa", use_cache=False)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                model = LlamaForCausalLM(config)
        finally:
            torch.set_default_dtype(previous)
    _apply_liger_kernel_to_instance(model=model)  # RMSNorm, SwiGLU, RoPE kernels in the backbone
    model.to(device).eval().requires_grad_(False)
    return model


def tokenize(args, vocab_size: int) -> torch.Tensor:
    with open(args.data, "rb") as handle:
        data = handle.read()
    if args.model_path:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model_path, local_files_only=True)
        return torch.tensor(tokenizer(data.decode("utf-8", errors="replace"))["input_ids"])
    if vocab_size < 256:
        raise ValueError(f"byte-level tokens need a vocabulary of at least 256, got {vocab_size}")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def batches(tokens: torch.Tensor, batch: int, seq: int, steps: int, seed: int, device):
    n_blocks = tokens.numel() // seq
    if n_blocks < batch:
        raise ValueError(f"text has {tokens.numel()} tokens: too few for batch {batch} x seq {seq}")
    blocks = tokens[: n_blocks * seq].view(n_blocks, seq)
    generator = torch.Generator().manual_seed(seed)
    return [blocks[torch.randint(0, n_blocks, (batch,), generator=generator)].to(device) for _ in range(steps)]


def train_heads(backbone, heads, data, fused: bool, args, device) -> dict:
    optimizer = torch.optim.AdamW(heads.parameters(), lr=args.lr, weight_decay=0.0, fused=device.type == "cuda")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    start, losses = time.perf_counter(), []
    for input_ids in data:
        with torch.no_grad():
            hidden = backbone.base_model(input_ids=input_ids).last_hidden_state
        loss, per_head = medusa_loss(heads, hidden, input_ids, fused, args.decay)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(torch.stack([x.detach() for x in per_head]))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    return {"per_head": torch.stack(losses).float().cpu(), "seconds": seconds, "peak_gib": peak,
            "tokens_per_s": sum(x.numel() for x in data) / seconds}


def check_against_materialized(backbone, heads, input_ids, decay: float) -> float:
    """Largest relative difference of the loss and head gradients, fused versus materialised."""
    with torch.no_grad():
        hidden = backbone.base_model(input_ids=input_ids).last_hidden_state
    grads = {}
    for fused in (False, True):
        heads.zero_grad(set_to_none=True)
        loss, _ = medusa_loss(heads, hidden, input_ids, fused, decay)
        loss.backward()
        grads[fused] = [loss.detach()] + [p.grad.detach().clone() for p in heads.parameters()]
    heads.zero_grad(set_to_none=True)
    return max(float((a - b).norm() / b.norm().clamp_min(1e-30)) for a, b in zip(grads[True], grads[False]))


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Medusa heads trained with the fused linear cross entropy")
    parser.add_argument("--data", default=os.path.join(sysconfig.get_paths()["stdlib"], "argparse.py"),
                        help="local text file")
    parser.add_argument("--model-path", default=None, help="local HF causal LM directory (default: random Llama)")
    parser.add_argument("--heads", type=int, default=3, help="number of Medusa heads K")
    parser.add_argument("--decay", type=float, default=0.8, help="weight decay**k of head k's loss")
    parser.add_argument("--hidden-size", type=int, default=None)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="backbone vocabulary when built from a config (byte data uses ids < 256)")
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for key, value in DEFAULTS["cuda" if torch.cuda.is_available() else "cpu"].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.heads < 1 or args.seq_len < args.heads + 2:
        parser.error("--heads >= 1 and --seq-len >= heads + 2 are required")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(args.seed)
    backbone = load_backbone(args, device, dtype)
    vocab, hidden_size = backbone.config.vocab_size, backbone.config.hidden_size
    lm_head_weight = backbone.get_output_embeddings().weight
    initial_heads = nn.ModuleList(MedusaHead(hidden_size, vocab, lm_head_weight) for _ in range(args.heads))
    initial_heads.to(device=device, dtype=dtype)
    data = batches(tokenize(args, vocab), args.batch_size, args.seq_len, args.steps, args.seed, device)
    avoided = materialized_logits_bytes(args.batch_size, args.seq_len, args.heads, vocab, dtype)
    print(f"backbone: {type(backbone).__name__} hidden {hidden_size}, vocab {vocab} ({dtype}, frozen, Liger-patched); "
          f"{args.heads} Medusa heads; batch {args.batch_size} x seq {args.seq_len}; {device}")
    print(f"head logits a materialised loss keeps until backward: {avoided / 2**20:,.1f} MiB "
          f"(theoretical, from the shapes: rows x vocab x ({dtype} + float32)); the fused loss keeps none")

    if device.type == "cuda":
        results = {}
        for fused in (False, True):
            heads = copy.deepcopy(initial_heads)
            results[fused] = train_heads(backbone, heads, data, fused, args, device)
            del heads
            torch.cuda.empty_cache()
        for fused, name in ((False, "materialised logits"), (True, "fused linear CE   ")):
            r = results[fused]
            print(f"{name}: peak {r['peak_gib']:.2f} GiB, {r['tokens_per_s']:,.0f} tokens/s, "
                  f"final head losses {[round(float(x), 4) for x in r['per_head'][-1]]}")
        saved = results[False]["peak_gib"] - results[True]["peak_gib"]
        diff = float((results[False]["per_head"] - results[True]["per_head"]).abs().max())
        print(f"memory saved by the fused loss: {saved:.2f} GiB (x{results[True]['peak_gib'] / results[False]['peak_gib']:.2f}); "
              f"max |loss difference| over the run {diff:.2e}")
    else:
        heads = copy.deepcopy(initial_heads)
        error = check_against_materialized(backbone, heads, data[0], args.decay)
        # fp32 on CPU: both paths compute the same sums in a different order.
        print(f"fused vs materialised on one batch: largest relative difference of loss and gradients {error:.2e}")
        if not error < 1e-4:
            print("MISMATCH between the fused and the materialised loss")
            return 1
        r = train_heads(backbone, heads, data, True, args, device)
        first, last = r["per_head"][0], r["per_head"][-1]
        for k in range(args.heads):
            print(f"head {k + 1} (predicts t+{k + 2}): loss {float(first[k]):.4f} -> {float(last[k]):.4f}")
        print(f"trained {args.steps} steps in {r['seconds']:.1f} s (CPU, Triton interpreter; no memory statistics)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
