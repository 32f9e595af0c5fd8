"""One training step's loss and gradients, HF fp32 and Liger fp32 against HF float64.

Separates a precision defect from training chaos: if Liger's single-step gradient error
against float64 is comparable to HF fp32's own, later drift is amplification of rounding;
if it is much larger, a kernel loses precision. With ``--train`` it also trains all
three for the convergence test's 32 steps and prints how far each ends from the others,
including the patched model's trained weights evaluated by an unpatched forward (which
separates weight drift from an eval-forward difference). Usage:
    python scripts/grad_precision_check.py [--train] gemma2 mixtral ...
"""

from __future__ import annotations

import copy
import sys

from tests.transformers.model_configs import build_model, convergence_config, random_batch
from tests.utils import DEVICE

from liger_kernel.transformers import _apply_liger_kernel_to_instance


def _step(model, batch):
    model.zero_grad(set_to_none=True)
    model.train()
    loss = model(**batch).loss
    loss.backward()
    grads = {n: p.grad.detach().double() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach().double(), grads


def _train_and_compare(model_type: str, reference, patched, truth) -> None:
    from tests.transformers.test_convergence import BATCH, SEQ, STEPS, _eval_logprobs, _train

    config = reference.config
    batches = [random_batch(config.vocab_size, BATCH, SEQ, seed=100 + i, device=DEVICE) for i in range(4)]
    eval_batch = random_batch(config.vocab_size, BATCH, SEQ, seed=999, device=DEVICE)
    losses = {name: _train(model, batches, STEPS).double() for name, model in
              (("hf", reference), ("liger", patched), ("f64", truth))}
    unpatched_with_liger_weights = copy.deepcopy(reference)
    unpatched_with_liger_weights.load_state_dict(patched.state_dict())
    logprobs = {name: _eval_logprobs(model, eval_batch).double() for name, model in
                (("hf", reference), ("liger", patched), ("f64", truth), ("hf-fwd(liger w)", unpatched_with_liger_weights))}
    params = {name: dict(model.named_parameters()) for name, model in
              (("hf", reference), ("liger", patched), ("f64", truth))}
    for a, b in (("liger", "hf"), ("hf", "f64"), ("liger", "f64")):
        first = int(((losses[a] - losses[b]).abs() > 1e-5).nonzero()[0]) if ((losses[a] - losses[b]).abs() > 1e-5).any() else -1
        diffs = {n: float((params[a][n].detach().double() - params[b][n].detach().double()).abs().max()) for n in params[b]}
        worst_param = max(diffs.values())
        print(f"{model_type:8s} {a:>6s} vs {b:<4s} loss max diff {float((losses[a] - losses[b]).abs().max()):.3e} "
              f"(first step > 1e-5: {first}), logprobs {float((logprobs[a] - logprobs[b]).abs().max()):.3e}, "
              f"params {worst_param:.3e} ({', '.join(f'{n} {diffs[n]:.1e}' for n in sorted(diffs, key=diffs.get)[-3:])})")
    print(f"{model_type:8s} liger weights, HF forward vs liger forward: logprobs "
          f"{float((logprobs['hf-fwd(liger w)'] - logprobs['liger']).abs().max()):.3e}")


def main(model_types: list[str], train: bool = False) -> None:
    for model_type in model_types:
        config = convergence_config(model_type)
        reference = build_model(model_type, seed=0, config=config)
        patched = copy.deepcopy(reference)
        _apply_liger_kernel_to_instance(patched)
        truth = copy.deepcopy(reference).double()
        if model_type == "mixtral":
            truth.config._experts_implementation = "eager"
        batch = random_batch(config.vocab_size, 4, 64, seed=100, device=DEVICE)
        loss64, grads64 = _step(truth, batch)
        errors = {}
        for label, model in (("hf-fp32", reference), ("liger-fp32", patched)):
            loss, grads = _step(model, batch)
            errors[label] = {n: ((grads[n] - g).norm() / g.norm().clamp_min(1e-30)).item() for n, g in grads64.items()}
            worst = max(((grads[n] - g).norm() / g.norm().clamp_min(1e-30)).item() for n, g in grads64.items())
            worst_name = max(grads64, key=lambda n: ((grads[n] - grads64[n]).norm() / grads64[n].norm().clamp_min(1e-30)).item())
            print(f"{model_type:8s} {label:10s} loss err {abs(loss - loss64).item():.3e}  worst grad rel err {worst:.3e} ({worst_name})")
        ratio = {n: errors["liger-fp32"][n] / max(errors["hf-fp32"][n], 1e-12) for n in grads64}
        for n in sorted(ratio, key=ratio.get, reverse=True)[:4]:
            print(f"{model_type:8s}   grad error liger/hf {ratio[n]:7.2f}: {n} (liger {errors['liger-fp32'][n]:.2e}, "
                  f"hf {errors['hf-fp32'][n]:.2e})")
        if train:
            _train_and_compare(model_type, reference, patched, truth)


if __name__ == "__main__":
    flags = [a for a in sys.argv[1:] if a.startswith("--")]
    main([a for a in sys.argv[1:] if not a.startswith("--")] or ["gemma2", "mixtral"], train="--train" in flags)
