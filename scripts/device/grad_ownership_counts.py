"""What the norms' ownership check counts on each device: the calibration probes, a norm feeding
a Linear, and every norm of a tiny patched Llama (counts recorded, nothing written in place).
Run from the repository root (it imports the test helpers)."""
import sys

import torch

sys.path.insert(0, ".")
from tests.utils import recorded_ownership_counts as recorded  # noqa: E402

import liger_kernel.ops.utils as u  # noqa: E402
from liger_kernel.ops.rms_norm import LigerRMSNormFunction  # noqa: E402


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
    from tests.transformers.model_configs import VOCAB, build_model, random_batch

    from liger_kernel.transformers import _apply_liger_kernel_to_instance
    model = build_model("llama", seed=1).to(device)
    _apply_liger_kernel_to_instance(model)
    model(**random_batch(VOCAB, seed=0, device=device)).loss.backward()


print("python", sys.version.split()[0], "torch", torch.__version__, "limits at import", u._OWNED_GRAD_REFERENCES)
devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
for device in devices:
    print(device, "calibrated limits", u._calibrate_owned_grad_references(device))
    print(device, "probe counts (refs, base refs, storage users)", recorded(probes, device))
    if device == "cuda" or u.is_interpreter():
        print(device, "norm -> Linear", recorded(norm_into_linear, device))
        print(device, "llama norms", recorded(llama, device))


def in_place_decisions(device):
    """As tests/transformers/test_layer_norm.py::test_in_place_option: was dx written over dy?"""
    from liger_kernel.ops.layer_norm import LigerLayerNormFunction
    x = torch.randn(5, 64, device=device, requires_grad=True)
    w, b = torch.ones(64, device=device, requires_grad=True), torch.zeros(64, device=device, requires_grad=True)
    seen = {}
    x.register_hook(lambda g: seen.update(dx=g.data_ptr()))
    y = LigerLayerNormFunction.apply(x, w, b, 1e-6, True)
    y.register_hook(lambda g: seen.update(dy=g.data_ptr()))
    (y * 1).backward(torch.randn(5, 64, device=device))
    return seen["dx"] == seen["dy"]


if "compile" in sys.argv[1:] and torch.cuda.is_available():
    print("cuda in place, before any torch.compile:", in_place_decisions("cuda"))
    compiled = torch.compile(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU()).cuda())
    compiled(torch.randn(4, 64, device="cuda", requires_grad=True)).sum().backward()
    print("cuda in place, after a torch.compile fwd+bwd:", in_place_decisions("cuda"))
    print("cuda probe counts after compile", recorded(probes, "cuda"))
    print("cuda norm -> Linear after compile", recorded(norm_into_linear, "cuda"))
    print("limits recalibrated after compile", u._calibrate_owned_grad_references("cuda"))
