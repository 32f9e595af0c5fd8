"""What the norms' ownership check counts on each device: the calibration probes, a norm feeding
a Linear, and every norm of a tiny patched Llama (counts recorded, nothing written in place)."""
import sys

import torch

import liger_kernel.ops.utils as u
from liger_kernel.ops.rms_norm import LigerRMSNormFunction


def recorded(run):
    u._CALIBRATION_COUNTS = []
    try:
        run()
        return list(u._CALIBRATION_COUNTS)
    finally:
        u._CALIBRATION_COUNTS = None


def probes(device):
    x = torch.ones(2, 4, device=device, requires_grad=True)
    (u._GradOwnershipProbe.apply(x) * 2.0).sum().backward()
    (u._GradOwnershipProbe.apply(x).view(-1) * 2.0).sum().backward()


def norm_into_linear(device):
    x = torch.randn(2, 3, 64, device=device, requires_grad=True)
    w = torch.ones(64, device=device, requires_grad=True)
    lin = torch.nn.Linear(64, 8, device=device)
    lin(LigerRMSNormFunction.apply(x, w, 1e-6, 0.0, "llama", True)).sum().backward()
    lin(LigerRMSNormFunction.apply(x.view(6, 64), w, 1e-6, 0.0, "llama", True)).sum().backward()


def llama(device):
    sys.path.insert(0, ".")
    from liger_kernel.transformers import _apply_liger_kernel_to_instance
    from tests.transformers.model_configs import VOCAB, build_model, random_batch
    model = build_model("llama", seed=1).to(device)
    _apply_liger_kernel_to_instance(model)
    model(**random_batch(VOCAB, seed=0, device=device)).loss.backward()


print("python", sys.version.split()[0], "torch", torch.__version__, "limits at import", u._OWNED_GRAD_REFERENCES)
devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
for device in devices:
    print(device, "calibrated limits", u._calibrate_owned_grad_references(device))
    print(device, "probe counts (refs, base refs, storage users)", recorded(lambda: probes(device)))
    if device == "cuda" or u.is_interpreter():
        print(device, "norm -> Linear", recorded(lambda: norm_into_linear(device)))
        print(device, "llama norms", recorded(lambda: llama(device)))
