"""Training objectives of the end-to-end benchmark: an SFT, a DPO and a GRPO step on one causal LM.

* ``sft``: the model's own causal-LM loss (labels = inputs); a patched model fuses its head and loss.
* ``dpo``: the batch's first half are chosen sequences, the second half rejected ones. The
  decoder's hidden states (positions 0..T-2, predicting tokens 1..T-1) go through the LM head
  into TRL's sigmoid DPO loss (beta 0.1) against a frozen reference model (a copy of the
  initial policy, as TRL's ``ref_model``): a DPO step costs one more decoder forward, as TRL's does.
* ``grpo``: the batch's tokens are the sampled completions; TRL's DAPO loss (the kernel
  benchmark's options: clipped ratios, beta 0.04 times the k3 KL to the reference) on their
  per-token log-probabilities, with advantages spread over [-0.5, 1] across the batch (a loss
  away from 0, whose curves the variants can be compared on), the old log-probabilities from a
  no_grad pass of the policy and the reference ones from the frozen reference model.

HF variants materialise the logits (``materialised_*`` of the kernel benchmarks; compiled with
the decoder for ``*-compile``); liger variants compute the head-bound loss with
``liger_kernel.chunked_loss`` on the hidden states, never forming the logits. In the upstream
child (``liger-upstream``) ``liger_kernel`` is the upstream release, whose loss classes share the
names and call shapes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from benchmarks.bench_post_training import BETA, materialised_dpo
from benchmarks.bench_rl_distillation import GRPO_OPTIONS, materialised_grpo

OBJECTIVES = ("sft", "dpo", "grpo")

Objective = Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]


def sft(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=input_ids, labels=input_ids).loss


def _shifted_hidden(model: torch.nn.Module, input_ids: torch.Tensor, grad: bool = True) -> torch.Tensor:
    """The decoder's hidden states at the positions that predict the next token (B, T-1, D)."""
    with torch.set_grad_enabled(grad):
        return model.get_decoder()(input_ids=input_ids).last_hidden_state[:, :-1]


def _head_weight(model: torch.nn.Module) -> torch.Tensor:
    return model.get_output_embeddings().weight


@torch.no_grad()
def sampled_token_logps(hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor,
                        rows_per_chunk: int = 1024) -> torch.Tensor:
    """The policy's log-probabilities of ``ids`` (B, T) before the step (the old and reference
    log-probs of the GRPO objective): materialised a sequence chunk at a time, the same
    computation in every variant."""
    out = torch.empty(ids.shape, device=ids.device, dtype=torch.float32)
    step = max(1, rows_per_chunk // max(1, ids.shape[1]))
    for start in range(0, ids.shape[0], step):
        logits = torch.matmul(hidden[start:start + step], weight.t()).float() / GRPO_OPTIONS["temperature"]
        out[start:start + step] = logits.log_softmax(-1).gather(-1, ids[start:start + step].unsqueeze(-1)).squeeze(-1)
    return out


def _dpo(fused: bool, compile_backend: str | None, reference: torch.nn.Module) -> Objective:
    if fused:
        from liger_kernel.chunked_loss import LigerFusedLinearDPOLoss

        loss_fn = LigerFusedLinearDPOLoss(beta=BETA, loss_type="sigmoid")

        def head_loss(hidden, weight, labels, ref_hidden, ref_weight):
            return loss_fn(weight, hidden, labels, None, ref_hidden, ref_weight)[0]
    else:
        head_loss = materialised_dpo if compile_backend is None else torch.compile(materialised_dpo,
                                                                                   backend=compile_backend)

    def objective(model, input_ids):
        if input_ids.shape[0] % 2:
            raise ValueError(f"the DPO objective needs an even batch (chosen, then rejected), got {input_ids.shape[0]}")
        hidden = _shifted_hidden(model, input_ids)
        reference_hidden = _shifted_hidden(reference, input_ids, grad=False)
        return head_loss(hidden, _head_weight(model), input_ids[:, 1:], reference_hidden, _head_weight(reference))

    return objective


def _grpo(fused: bool, compile_backend: str | None, reference: torch.nn.Module) -> Objective:
    if fused:
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        loss_fn = LigerFusedLinearGRPOLoss(**GRPO_OPTIONS)

        def head_loss(hidden, weight, ids, mask, advantages, old, ref):
            return loss_fn(hidden, weight, ids, mask, advantages, None, ref, old)[0]
    else:
        head_loss = materialised_grpo if compile_backend is None else torch.compile(materialised_grpo,
                                                                                    backend=compile_backend)

    def objective(model, input_ids):
        ids = input_ids[:, 1:]
        hidden = _shifted_hidden(model, input_ids)
        weight = _head_weight(model)
        old = sampled_token_logps(hidden, weight, ids)
        ref = sampled_token_logps(_shifted_hidden(reference, input_ids, grad=False), _head_weight(reference), ids)
        mask = torch.ones(ids.shape, device=ids.device)
        advantages = torch.linspace(-0.5, 1.0, ids.shape[0], device=ids.device)
        return head_loss(hidden, weight, ids, mask, advantages, old, ref)

    return objective


def needs_reference(name: str) -> bool:
    """Whether objective ``name`` reads a frozen reference model."""
    return name in ("dpo", "grpo")


def build_objective(name: str, fused: bool, compile_backend: str | None = None,
                    reference: torch.nn.Module | None = None) -> Objective:
    """The step's loss for objective ``name``; ``fused``: the liger head-bound loss, else the
    materialised one (compiled with ``compile_backend`` when given); ``reference``: the frozen
    reference model the DPO and GRPO objectives read."""
    if name == "sft":
        return sft
    if name not in ("dpo", "grpo"):
        raise ValueError(f"unknown objective {name!r}; choose from {', '.join(OBJECTIVES)}")
    if reference is None:
        raise ValueError(f"the {name} objective needs a reference model")
    return (_dpo if name == "dpo" else _grpo)(fused, compile_backend, reference)
