"""Which patched kernel makes a family's 32-step training drift from HF (GPU diagnostic).

Trains HF fp32, HF float64 and the model patched with one kernel at a time (and all), from
the same weights, and prints each one's worst loss / parameter distance to float64 next to
HF fp32's own. Then compares gradients at the trained weights (no trajectory).
Usage: PYTHONPATH=src:. python scripts/device/bisect_convergence.py gemma2
"""

import copy
import sys

from tests.transformers.model_configs import build_model, convergence_config, loss_and_grads, random_batch
from tests.transformers.test_convergence import BATCH, SEQ, STEPS, _float64_copy, _train
from tests.utils import DEVICE

from liger_kernel.transformers import _apply_liger_kernel_to_instance

KERNELS = ("rope", "rms_norm", "mlp", "fused_linear_cross_entropy")


def main(model_type: str) -> None:
    config = convergence_config(model_type)
    start = build_model(model_type, seed=0, config=config)
    batches = [random_batch(config.vocab_size, BATCH, SEQ, seed=100 + i, device=DEVICE) for i in range(4)]
    truth = _float64_copy(start)
    truth_losses = _train(truth, batches, STEPS).double()
    truth_params = dict(truth.named_parameters())

    def report(label, model):
        losses = _train(model, batches, STEPS).double()
        params = dict(model.named_parameters())
        worst = max(params, key=lambda n: float((params[n].detach().double() - truth_params[n].detach()).abs().max()))
        diff = float((params[worst].detach().double() - truth_params[worst].detach()).abs().max())
        print(f"{model_type} {label:28s} loss vs f64 {float((losses - truth_losses).abs().max()):.2e}  "
              f"params vs f64 {diff:.2e} ({worst})", flush=True)
        return model

    trained_hf = report("hf fp32", copy.deepcopy(start))
    for kernel in KERNELS:
        model = copy.deepcopy(start)
        flags = {k: (k == kernel) for k in ("rope", "rms_norm", "fused_linear_cross_entropy")}
        flags["swiglu" if model_type not in ("gemma", "gemma2") else "geglu"] = kernel == "mlp"
        _apply_liger_kernel_to_instance(model, **flags)
        report(f"only {kernel}", model)
    model = copy.deepcopy(start)
    _apply_liger_kernel_to_instance(model)
    report("all kernels", model)

    # Gradients at HF's trained weights, for every batch.
    patched = copy.deepcopy(trained_hf)
    _apply_liger_kernel_to_instance(patched)
    truth_at = _float64_copy(trained_hf)
    for i, batch in enumerate(batches):
        l64, g64 = loss_and_grads(truth_at, batch)
        lh, gh = loss_and_grads(trained_hf, batch)
        ll, gl = loss_and_grads(patched, batch)
        ratios = {n: float((gl[n] - g).norm() / g.norm().clamp_min(1e-30)) /
                  max(float((gh[n] - g).norm() / g.norm().clamp_min(1e-30)), 1e-12) for n, g in g64.items()}
        worst = max(ratios, key=ratios.get)
        print(f"{model_type} trained weights, batch {i}: loss err liger {float(abs(ll - l64)):.2e} "
              f"hf {float(abs(lh - l64)):.2e}; worst grad error ratio liger/hf {ratios[worst]:.2f} ({worst})",
              flush=True)


if __name__ == "__main__":
    for name in sys.argv[1:] or ["gemma2"]:
        main(name)
