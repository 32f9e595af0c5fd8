"""A DPO update on a tiny Llama-style model with the fused linear DPO loss (no logits).

The policy's hidden states go straight into ``LigerFusedLinearDPOLoss`` with its ``lm_head``
weight, as TRL's DPO trainer does, and a frozen copy of the initial model is the reference.
The batch is synthetic (random prompts, a chosen and a rejected completion each; prompt
tokens are labelled -100), kept fixed so that a few steps show the preference being learned:
the loss starts at log 2 (policy = reference) and falls while the chosen-minus-rejected reward
margin grows. ``--check`` also computes the first step's loss and ``lm_head`` gradient from
materialised float64 logits with plain PyTorch and fails on a mismatch.

    python examples/post_training/dpo_tiny.py --steps 20 --check

Runs on CPU (slowly, through Triton's interpreter when ``TRITON_INTERPRET=1``) or a GPU.
"""

from __future__ import annotations

import argparse
import copy
import math
import sys

import torch
import torch.nn.functional as F

from liger_kernel.chunked_loss import LigerFusedLinearDPOLoss
from transformers import LlamaConfig, LlamaForCausalLM

IGNORE_INDEX = -100


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--pairs", type=int, default=4, help="preference pairs per batch")
    p.add_argument("--prompt-len", type=int, default=6)
    p.add_argument("--completion-len", type=int, default=10)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=317)
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--loss-type", default="sigmoid")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--check", action="store_true", help="compare the first step with materialised logits")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return p.parse_args(argv)


def tiny_model(args) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=args.prompt_len + args.completion_len)
    return LlamaForCausalLM(config)


def preference_batch(args, generator):
    """input_ids (2P, L): chosen sequences then rejected ones (each prompt twice); labels with
    the prompt masked, shifted for next-token prediction: (2P, L-1)."""
    prompts = torch.randint(0, args.vocab, (args.pairs, args.prompt_len), generator=generator)
    chosen = torch.randint(0, args.vocab, (args.pairs, args.completion_len), generator=generator)
    rejected = torch.randint(0, args.vocab, (args.pairs, args.completion_len), generator=generator)
    input_ids = torch.cat([torch.cat([prompts, chosen], 1), torch.cat([prompts, rejected], 1)])
    labels = input_ids[:, 1:].clone()
    labels[:, : args.prompt_len - 1] = IGNORE_INDEX
    return input_ids, labels


def materialised_dpo_loss(hidden, weight, ref_hidden, ref_weight, labels, beta):
    """The sigmoid DPO loss from float64 logits, written out (TRL's formula)."""

    def logps(h, w):
        logp = (h.double() @ w.double().t()).log_softmax(-1)
        counted = labels != IGNORE_INDEX
        picked = logp.gather(-1, torch.where(counted, labels, 0).unsqueeze(-1)).squeeze(-1)
        return (picked * counted).sum(-1)

    policy, ref = logps(hidden, weight), logps(ref_hidden, ref_weight)
    half = labels.shape[0] // 2
    margin = (policy[:half] - ref[:half]) - (policy[half:] - ref[half:])
    return -F.logsigmoid(beta * margin).mean()


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    policy = tiny_model(args).to(device)
    reference = copy.deepcopy(policy).eval().requires_grad_(False)
    generator = torch.Generator().manual_seed(args.seed)
    input_ids, labels = (t.to(device) for t in preference_batch(args, generator))
    loss_fn = LigerFusedLinearDPOLoss(beta=args.beta, loss_type=args.loss_type)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr)
    history = []
    for step in range(args.steps):
        hidden = policy.model(input_ids=input_ids).last_hidden_state[:, :-1]
        with torch.no_grad():
            ref_hidden = reference.model(input_ids=input_ids).last_hidden_state[:, :-1]
        lm_head, ref_head = policy.lm_head, reference.lm_head
        loss, metrics = loss_fn(lm_head.weight, hidden, labels, lm_head.bias, ref_hidden, ref_head.weight,
                                ref_head.bias)
        chosen_rewards, rejected_rewards = metrics[5], metrics[6]
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if args.check and step == 0:
            if not check_first_step(args, policy, hidden, ref_hidden, labels, loss):
                return 1
        optimizer.step()
        margin = float((chosen_rewards - rejected_rewards).mean())
        accuracy = float((chosen_rewards > rejected_rewards).float().mean())
        history.append(loss.item())
        print(f"step {step:3d}  loss {loss.item():.4f}  reward margin {margin:+.4f}  reward accuracy {accuracy:.2f}",
              flush=True)
    print(f"dpo: {args.steps} steps, loss {history[0]:.4f} -> {history[-1]:.4f}")
    return 0


def check_first_step(args, policy, hidden, ref_hidden, labels, loss) -> bool:
    """The fused loss and lm_head gradient against the same loss on materialised float64 logits."""
    weight = policy.lm_head.weight.detach().clone().requires_grad_()
    expected = materialised_dpo_loss(hidden.detach(), weight, ref_hidden, policy.lm_head.weight.detach(), labels,
                                     args.beta) if args.loss_type == "sigmoid" else None
    if expected is None:
        print("check: only the sigmoid loss type is written out here; skipped")
        return True
    expected.backward()
    loss_error = abs(loss.item() - expected.item())
    grad = policy.lm_head.weight.grad.double()
    grad_error = float((grad - weight.grad).norm() / weight.grad.norm().clamp_min(1e-30))
    ok = loss_error < 1e-5 and grad_error < 1e-4 and math.isclose(expected.item(), math.log(2), rel_tol=1e-6)
    print(f"check: loss {loss.item():.7f} vs materialised {expected.item():.7f} (log 2 = {math.log(2):.7f}), "
          f"lm_head grad relative error {grad_error:.2e}: {'OK' if ok else 'MISMATCH'}")
    return ok


if __name__ == "__main__":
    sys.exit(main())
