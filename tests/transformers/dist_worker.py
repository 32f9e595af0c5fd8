"""Worker for the multi-process tests in ``test_distributed.py``; launched by ``torchrun``.

Every rank trains a tiny Liger-patched Llama (built from a config, fixed seed) for a few
SGD steps on its slice of one fixed global batch, under each requested wrapper, and rank 0
writes what the tests compare into ``<out>/results.pt``:

* ``losses``: the global loss of each step (the mean of the ranks' losses; every sequence
  has the same number of counted tokens, so that is the global-batch mean);
* ``grads``: the full (unsharded, rank-averaged) gradient of every parameter after the first
  backward, by parameter name;
* ``params``: the full parameters after the last step.

Rank 0 also computes the single-process references on the whole global batch (scenario
names ``single`` / ``single_tied`` for the patched model and ``hf`` / ``hf_tied`` for the
unpatched one) after the distributed scenarios.

Scenarios: ``ddp``, ``fsdp2`` (``fully_shard`` on each decoder layer, then the root),
``fsdp2_lm_head`` (also on ``lm_head`` alone, so the fused loss meets a sharded DTensor
weight), ``fsdp2_lm_head_bf16`` (the same with a bf16 ``MixedPrecisionPolicy``), ``zero3`` (DeepSpeed ZeRO-3 parameter partitioning); each with ``_tied`` appended
for tied input/output embeddings (not ``fsdp2_lm_head``: FSDP2 cannot shard one parameter
in two groups). ``tp_lm_head`` (a tensor-parallel ``lm_head``, which the fused loss does
not support) records the error the forward raises instead of training.

The launcher sets ``TRITON_INTERPRET=1`` (CPU) before this process imports triton, and
``LIGER_DIST_DEVICE`` (``cpu`` with gloo, ``cuda`` with NCCL and one GPU per rank).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

VOCAB = 512
HIDDEN = 32
SEQ_LEN = 12
GLOBAL_BATCH = 4
IGNORED_PER_ROW = 3
STEPS = 3
LR = 0.5
SEED = 1234


def build_model(tied: bool, patched: bool, device: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN + 8,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
        use_cache=False,
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config).to(device)
    # HF initialises weights with std 0.02: the loss starts at ~log(V) and barely moves in
    # three steps. Larger weights make each step change the loss visibly, so a gradient that
    # is wrong or missing on one rank shows in the later losses.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2)
    if patched:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance

        _apply_liger_kernel_to_instance(model=model)
        _count_fused_loss_calls()
    model.train()
    return model


FUSED_LOSS_CALLS = [0]


def _count_fused_loss_calls() -> None:
    """Count calls of the fused linear cross entropy, so the tests can tell that a scenario
    trained through the fused kernel and not through the forward's unfused fallback (which
    gives the same losses, from materialised logits)."""
    import liger_kernel.transformers.fused_linear_cross_entropy as flce

    if getattr(flce.liger_fused_linear_cross_entropy, "_counted", False):
        return
    original = flce.liger_fused_linear_cross_entropy

    def counted(*args, **kwargs):
        FUSED_LOSS_CALLS[0] += 1
        return original(*args, **kwargs)

    counted._counted = True
    flce.liger_fused_linear_cross_entropy = counted


def global_batch(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(GLOBAL_BATCH, SEQ_LEN) input ids and labels with IGNORED_PER_ROW ignored labels per row.

    The ignored positions are among 1..SEQ_LEN-1 (HF drops label 0 when shifting), so every
    row has the same number of counted tokens and the mean of per-rank mean losses equals
    the mean over the global batch.
    """
    gen = torch.Generator().manual_seed(SEED + 1)
    ids = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ_LEN), generator=gen)
    labels = ids.clone()
    for row in range(GLOBAL_BATCH):
        cols = 1 + torch.randperm(SEQ_LEN - 1, generator=gen)[:IGNORED_PER_ROW]
        labels[row, cols] = -100
    return ids.to(device), labels.to(device)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.full_tensor()
    return t.detach().float().cpu().clone()


def mean_over_ranks(loss: torch.Tensor, distributed: bool) -> float:
    loss = loss.detach().clone()
    if distributed:
        dist.all_reduce(loss)
        loss /= dist.get_world_size()
    return float(loss)


def run_plain(model, ids, labels, distributed: bool = True) -> dict:
    """Train ``model`` (wrapped by DDP/FSDP2, or alone in one process with ``distributed=False``)."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    inner = getattr(model, "module", model)
    losses, grads = [], None
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        losses.append(mean_over_ranks(loss, distributed))
        if step == 0:
            grads = {
                name: (None if p.grad is None else full_tensor(p.grad)) for name, p in inner.named_parameters()
            }
        opt.step()
    params = {name: full_tensor(p) for name, p in inner.named_parameters()}
    return {"losses": losses, "grads": grads, "params": params}


def run_ddp(tied: bool, device: str, ids, labels) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    model = build_model(tied, patched=True, device=device)
    ddp = DistributedDataParallel(model, device_ids=None if device == "cpu" else [torch.device(device)])
    return run_plain(ddp, ids, labels)


def run_fsdp2(tied: bool, device: str, ids, labels, shard_lm_head: bool, bf16_compute: bool = False) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor

    model = build_model(tied, patched=True, device=device)
    # bf16 compute over fp32 sharded master weights: inside each forward the gathered
    # weights (lm_head's included) are bf16 and the module inputs are cast to bf16.
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16_compute else None
    kwargs = {"mp_policy": policy} if policy is not None else {}
    for layer in model.model.layers:
        fully_shard(layer, **kwargs)
    if shard_lm_head:
        fully_shard(model.lm_head, **kwargs)
    fully_shard(model, **kwargs)
    if not isinstance(model.lm_head.weight, DTensor):
        raise AssertionError("fully_shard left lm_head.weight unsharded")
    return run_plain(model, ids, labels)


def run_tp_lm_head(device: str, ids, labels) -> dict:
    """Tensor-parallel lm_head: the fused loss must refuse it with a clear error."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    model = build_model(False, patched=True, device=device)
    mesh = init_device_mesh(torch.device(device).type, (dist.get_world_size(),))
    parallelize_module(model.lm_head, mesh, ColwiseParallel())
    try:
        model(input_ids=ids, labels=labels)
    except NotImplementedError as exc:
        return {"raised": f"NotImplementedError: {exc}"}
    return {"raised": None}


def run_zero3(tied: bool, device: str, ids, labels) -> dict:
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

    ds_config = {
        "train_micro_batch_size_per_gpu": ids.shape[0],
        "gradient_accumulation_steps": 1,
        # DeepSpeed clips the global gradient norm to 1.0 unless told otherwise; the
        # reference does plain SGD.
        "gradient_clipping": 0.0,
        "zero_optimization": {
            "stage": 3,
            # Partition every parameter, however small, so lm_head.weight is a 0-size
            # partition outside its module's forward as in a real model.
            "stage3_param_persistence_threshold": 0,
            "stage3_prefetch_bucket_size": 0,
        },
        "zero_allow_untested_optimizer": True,
    }
    # Built outside deepspeed.zero.Init, so the initialisation is the reference's exactly;
    # deepspeed.initialize then partitions every parameter.
    model = build_model(tied, patched=True, device=device)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config)
    if model.lm_head.weight.numel() != 0:
        raise AssertionError("ZeRO-3 left lm_head.weight unpartitioned")
    losses, grads = [], None
    for step in range(STEPS):
        loss = engine(input_ids=ids, labels=labels).loss
        engine.backward(loss)
        losses.append(mean_over_ranks(loss, True))
        if step == 0:
            # safe_get_full_grad all-gathers: every rank calls it in the same order.
            grads = {}
            for name, p in model.named_parameters():
                g = safe_get_full_grad(p)
                grads[name] = None if g is None else g.detach().float().cpu().clone()
        engine.step()
    params = {name: safe_get_full_fp32_param(p).detach().float().cpu().clone() for name, p in model.named_parameters()}
    return {"losses": losses, "grads": grads, "params": params}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--scenarios", required=True, help="comma-separated scenario names")
    parser.add_argument("--references", default="single,single_tied,hf,hf_tied")
    args = parser.parse_args(argv)

    device_type = os.environ.get("LIGER_DIST_DEVICE", "cpu")
    # Import the model code before any deepspeed.zero.Init context: Init patches tensor
    # constructors, and torch._dynamo (imported by transformers) fails to import under it.
    import transformers.models.llama.modeling_llama  # noqa: F401
    if "zero3" in args.scenarios:
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo" if device_type == "cpu" else "nccl")
    else:
        # A rank that fails alone leaves the other waiting in a collective: fail it soon.
        dist.init_process_group("gloo" if device_type == "cpu" else "nccl", timeout=timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = "cpu"
    if device_type == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local_rank)
        device = f"cuda:{local_rank}"

    ids, labels = global_batch(device)
    if GLOBAL_BATCH % world:
        raise ValueError(f"world size {world} must divide the global batch {GLOBAL_BATCH}")
    rows = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
    local_ids, local_labels = ids[rows], labels[rows]

    runners: dict[str, Callable[[bool], dict]] = {
        "ddp": lambda tied: run_ddp(tied, device, local_ids, local_labels),
        "fsdp2": lambda tied: run_fsdp2(tied, device, local_ids, local_labels, shard_lm_head=False),
        "fsdp2_lm_head": lambda tied: run_fsdp2(tied, device, local_ids, local_labels, shard_lm_head=True),
        "fsdp2_lm_head_bf16": lambda tied: run_fsdp2(
            tied, device, local_ids, local_labels, shard_lm_head=True, bf16_compute=True
        ),
        "zero3": lambda tied: run_zero3(tied, device, local_ids, local_labels),
        "tp_lm_head": lambda tied: run_tp_lm_head(device, local_ids, local_labels),
    }
    results: dict[str, dict] = {}
    for scenario in filter(None, args.scenarios.split(",")):
        base, tied = scenario.removesuffix("_tied"), scenario.endswith("_tied")
        try:
            FUSED_LOSS_CALLS[0] = 0
            results[scenario] = runners[base](tied)
            results[scenario]["fused_loss_calls"] = FUSED_LOSS_CALLS[0]
        except Exception as exc:  # recorded per scenario so one failure does not hide the others
            import traceback

            # The usual failure (e.g. a kernel rejecting a DTensor) happens on every rank at
            # the same point, so the ranks stay in step for the next scenario; a one-rank
            # failure makes the other time out in its next collective (see init timeout).
            results[scenario] = {"error": f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"}
            print(results[scenario]["error"], file=sys.stderr, flush=True)
    dist.barrier()
    if rank == 0:
        for reference in filter(None, args.references.split(",")):
            base, tied = reference.removesuffix("_tied"), reference.endswith("_tied")
            model = build_model(tied, patched=base == "single", device=device)
            FUSED_LOSS_CALLS[0] = 0
            results[reference] = run_plain(model, ids, labels, distributed=False)
            results[reference]["fused_loss_calls"] = FUSED_LOSS_CALLS[0]
        torch.save(results, os.path.join(args.out, "results.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
