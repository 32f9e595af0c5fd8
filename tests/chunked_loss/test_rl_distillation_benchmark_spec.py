"""The GRPO and JSD benchmarks compare like with like: each materialised-logits reference agrees with
its fused loss (value and gradients) at a tiny shape, and the target shapes and floors are the issue's."""

import pytest
import torch

from benchmarks import bench_rl_distillation
from tests.utils import DEVICE

SPECS = {spec.name: spec for spec in bench_rl_distillation.SPECS}


@pytest.mark.parametrize("name", sorted(SPECS))
def test_materialised_reference_matches_fused_loss(name):
    spec = SPECS[name]
    inputs = spec.make_inputs(spec.tiny_shapes[1], torch.float32, torch.device(DEVICE))
    leaves = [inputs.args[i] for i in inputs.grad_args]
    results = []
    for provider in (spec.reference, spec.liger()):
        loss = provider(*inputs.args)
        results.append((loss.detach(), torch.autograd.grad(loss, leaves)))
    (want, want_grads), (got, got_grads) = results
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, atol=1e-5 * float(w.abs().max()), rtol=1e-4)


def test_target_shapes_and_floors():
    grpo, jsd = SPECS["grpo"], SPECS["fused_linear_jsd"]
    assert grpo.gpu_shapes[0] == {"B": 8, "T": 1024, "D": 4096, "V": 128256}
    assert jsd.gpu_shapes[0] == {"N": 8192, "D": 4096, "V": 128256}
    macs = 8192 * 4096 * 128256
    assert grpo.floor(grpo.gpu_shapes[0], torch.bfloat16, "full").flops == 6 * macs
    assert jsd.floor(jsd.gpu_shapes[0], torch.bfloat16, "full").flops == 8 * macs
    grads_bytes = (8192 + 128256) * 4096 * 2
    for spec in (grpo, jsd):
        assert spec.floor_peak_bytes(spec.gpu_shapes[0], torch.bfloat16, "full") == grads_bytes
        assert spec.floor_peak_bytes(spec.gpu_shapes[0], torch.bfloat16, "forward") == 0
