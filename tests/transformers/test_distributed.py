"""Patched models under DDP, FSDP2 and DeepSpeed ZeRO-3 train exactly like one process.

``dist_worker.py`` is launched with ``torchrun --nproc_per_node 2`` (localhost, a free port):
on CPU with the gloo backend and the Triton interpreter (``TRITON_INTERPRET=1`` is put in the
children's environment, so it is set before they import triton), on CUDA with NCCL when the
machine has two GPUs. A one-GPU machine runs the workers on CPU as well: two ranks cannot
share one GPU under NCCL, and what is tested here is the wrappers' interplay with the fused
loss, not the kernels (their GPU numerics are tested in ``tests/ops``).

Each rank trains a tiny Liger-patched Llama (2 layers, hidden 32, vocab 512) for three SGD
steps on its half of one fixed global batch; rank 0 also trains the same model alone on the
whole batch. We compare, per scenario, the global loss of every step, the full gradient of
every parameter after the first backward (this is where a fused loss that bypasses the
wrapper goes wrong: a gradient that misses ``lm_head.weight`` or the tied embedding, or that
is not averaged across ranks) and the parameters after the last step. The worker also counts
the fused-loss calls: every step of a patched run must go through the fused kernel, not
through the forward's unfused fallback (which would give the same numbers from logits).

Tolerance: everything is fp32 and the distributed run computes the same sums in a different
order (each rank reduces over half the tokens, then the ranks' gradients are averaged), so
the results agree to a few float32 roundings of the longest reduction, observed <= 2e-7
relative. We allow 1e-5 relative (norm-wise for tensors). A real error is orders of
magnitude larger: a rank's own (not averaged) first-step gradient differs from the
global one by 0.54-1.24 relative on this model and batch (1.0 for lm_head.weight), a
missing gradient by 1.0, and with the learning rate used each step changes the loss by
~25%, so a wrong update shows in the later losses and the parameters too.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.utils import cpu_interpreter_problem, rel_error

pytest.importorskip("transformers")

WORKER = Path(__file__).with_name("dist_worker.py")
REPO_ROOT = Path(__file__).resolve().parents[2]
WORLD_SIZE = 2
REL_TOL = 1e-5

TORCH_SCENARIOS = ["ddp", "ddp_tied", "fsdp2", "fsdp2_tied", "fsdp2_lm_head", "fsdp2_lm_head_bf16"]
# (loss, tensor) relative tolerances where the run is not fp32 throughout. FSDP2 with a
# bf16 MixedPrecisionPolicy computes every matmul and kernel in bf16 (unit roundoff
# 2**-8 = 3.9e-3) over fp32 master weights and fp32 gradient reduction, against the fp32
# single-process reference: observed 1.4e-3 on the losses and <= 2.6e-2 norm-wise on
# gradients (a handful of bf16 roundings through two layers) and parameters. A gradient
# that is missing or not averaged over the ranks is off by > 0.3.
BF16_TOLERANCES = (1e-2, 8e-2)
SCENARIO_TOLERANCES = {"fsdp2_lm_head_bf16": BF16_TOLERANCES}
REFUSED_SCENARIOS = ["tp_lm_head"]
ZERO3_SCENARIOS = ["zero3", "zero3_tied"]
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launch(out_dir: Path, scenarios: list[str], references: list[str]) -> dict:
    env = dict(os.environ)
    if torch.cuda.device_count() >= WORLD_SIZE:
        env["LIGER_DIST_DEVICE"] = "cuda"
    else:
        problem = cpu_interpreter_problem() if torch.cuda.is_available() else None
        if problem:
            pytest.skip(f"{problem} (these gloo runs need it with fewer than {WORLD_SIZE} GPUs; CI runs them)")
        env.update(LIGER_DIST_DEVICE="cpu", TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
        # DeepSpeed picks its accelerator at import; without this it looks for CUDA.
        env.setdefault("DS_ACCELERATOR", "cpu")
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    command = [
        sys.executable, "-m", "torch.distributed.run",
        "--nproc_per_node", str(WORLD_SIZE), "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
        str(WORKER), "--out", str(out_dir),
        "--scenarios", ",".join(scenarios), "--references", ",".join(references),
    ]  # fmt: skip
    proc = subprocess.run(command, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)
    results_file = out_dir / "results.pt"
    if proc.returncode != 0 or not results_file.exists():
        pytest.fail(f"torchrun exited with {proc.returncode}\n--- stderr (tail) ---\n{proc.stderr[-6000:]}")
    return torch.load(results_file, weights_only=False)


@pytest.fixture(scope="module")
def torch_results(tmp_path_factory) -> dict:
    return _launch(
        tmp_path_factory.mktemp("dist"), TORCH_SCENARIOS + REFUSED_SCENARIOS, ["single", "single_tied", "hf", "hf_tied"]
    )


@pytest.fixture(scope="module")
def zero3_results(tmp_path_factory) -> dict:
    return _launch(tmp_path_factory.mktemp("zero3"), ZERO3_SCENARIOS, ["single", "single_tied"])


def _result(results: dict, name: str) -> dict:
    if name not in results:
        pytest.fail(f"the worker did not record {name!r}; recorded: {sorted(results)}")
    return results[name]


def _reference_name(scenario: str) -> str:
    return "single_tied" if scenario.endswith("_tied") else "single"


def _check_against(result: dict, reference: dict, rel_tol: float, label: str, loss_tol: float | None = None) -> None:
    if "error" in result:
        pytest.fail(f"{label} failed in the worker:\n{result['error']}")
    loss_tol = rel_tol if loss_tol is None else loss_tol
    if reference["fused_loss_calls"] > 0:  # a patched reference: the run must be fused too
        assert result["fused_loss_calls"] == len(result["losses"]), (
            f"{label}: {result['fused_loss_calls']} fused-loss calls in {len(result['losses'])} steps; "
            "the patched forward fell back to materialised logits"
        )
    losses, ref_losses = torch.tensor(result["losses"]), torch.tensor(reference["losses"])
    torch.testing.assert_close(losses, ref_losses, rtol=loss_tol, atol=0.0, msg=lambda m: f"{label} losses\n{m}")
    # Every parameter (lm_head.weight and embed_tokens.weight included) has its gradient,
    # equal to the single-process one. With tied embeddings named_parameters() lists the
    # shared weight once, as embed_tokens.weight, and its gradient holds both uses.
    assert result["grads"].keys() == reference["grads"].keys(), label
    for name, ref_grad in reference["grads"].items():
        grad = result["grads"][name]
        assert ref_grad is not None and ref_grad.abs().sum() > 0, f"{label}: reference {name} has no gradient"
        assert grad is not None, f"{label}: {name} got no gradient"
        err = rel_error(grad, ref_grad)
        assert err <= rel_tol, f"{label}: gradient of {name} off by {err:.2e} (relative)"
    for name, ref_param in reference["params"].items():
        err = rel_error(result["params"][name], ref_param)
        assert err <= rel_tol, f"{label}: {name} after {len(losses)} steps off by {err:.2e} (relative)"


@pytest.mark.parametrize("scenario", TORCH_SCENARIOS)
def test_two_ranks_match_one_process(torch_results: dict, scenario: str) -> None:
    loss_tol, tensor_tol = SCENARIO_TOLERANCES.get(scenario, (REL_TOL, REL_TOL))
    _check_against(
        _result(torch_results, scenario), _result(torch_results, _reference_name(scenario)), tensor_tol, scenario,
        loss_tol=loss_tol,
    )


def test_tensor_parallel_lm_head_is_refused(torch_results: dict) -> None:
    # ColwiseParallel keeps lm_head.weight a DTensor inside lm_head's forward: the fused loss
    # cannot use it and must say so instead of failing inside a kernel.
    result = _result(torch_results, "tp_lm_head")
    assert "error" not in result, result.get("error")
    assert result["raised"] is not None, "the fused loss accepted a tensor-parallel lm_head"
    assert "tensor-parallel" in result["raised"] and "fused_linear_cross_entropy=False" in result["raised"]


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_patched_reference_matches_unpatched(torch_results: dict, tied: bool) -> None:
    # The reference the distributed runs are held to is itself the HF model's training run:
    # the patched kernels round differently from HF's fp32 ops (fused reductions, the chunked
    # logits), observed <= 7e-7 relative after three steps; same 1e-5 bound.
    suffix = "_tied" if tied else ""
    patched = _result(torch_results, f"single{suffix}")
    assert patched["fused_loss_calls"] == len(patched["losses"]), "the patched reference did not use the fused loss"
    _check_against(
        _result(torch_results, f"single{suffix}"), _result(torch_results, f"hf{suffix}"), REL_TOL, f"patched{suffix} vs HF"
    )


@pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed is not installed (see docs/compatibility.md)")
@pytest.mark.parametrize("scenario", ZERO3_SCENARIOS)
def test_zero3_two_ranks_match_one_process(zero3_results: dict, scenario: str) -> None:
    _check_against(_result(zero3_results, scenario), _result(zero3_results, _reference_name(scenario)), REL_TOL, scenario)


# ------------------------------------------------------------------------------------------
# The helper the fused loss uses to see full parameters, in one process.
# ------------------------------------------------------------------------------------------
class _FakeZeroStatus:
    def __init__(self, name: str) -> None:
        self.name = name


def _zero3_like_linear(status: str) -> torch.nn.Linear:
    """A Linear whose weight carries the attributes DeepSpeed ZeRO-3 sets on a partitioned one."""
    linear = torch.nn.Linear(4, 3)
    linear.weight.ds_id = 0
    linear.weight.ds_status = _FakeZeroStatus(status)
    return linear


def test_call_with_full_parameters_plain_module_calls_directly() -> None:
    from liger_kernel.transformers.distributed import call_with_full_parameters, parameters_are_sharded

    linear = torch.nn.Linear(4, 3)
    calls = []
    linear.register_forward_pre_hook(lambda module, args: calls.append("hook"))
    x = torch.randn(2, 4)
    out = call_with_full_parameters(linear, lambda m, h: h @ m.weight.t(), x)
    torch.testing.assert_close(out, x @ linear.weight.t())
    assert not parameters_are_sharded(linear)
    assert calls == [], "an unsharded module must not go through its hooks"
    assert "forward" not in linear.__dict__


@pytest.mark.parametrize("own_forward", [False, True], ids=["class_forward", "instance_forward"])
def test_call_with_full_parameters_partitioned_runs_module_hooks(own_forward: bool) -> None:
    from liger_kernel.transformers.distributed import call_with_full_parameters, parameters_are_sharded

    linear = _zero3_like_linear("NOT_AVAILABLE")
    assert parameters_are_sharded(linear)
    bound_forward = None
    if own_forward:  # e.g. another patch bound a forward on the instance
        bound_forward = lambda h: h * 0
        linear.forward = bound_forward
    seen = []
    # Stands in for the wrapper's gather hook: it must run, with the hidden states as input.
    linear.register_forward_pre_hook(lambda module, args: seen.append(args[0].shape))
    x = torch.randn(5, 4, requires_grad=True)
    out = call_with_full_parameters(linear, lambda m, h, scale: scale * (h @ m.weight.t()).sum(), x, scale=2.0)
    out.backward()
    torch.testing.assert_close(out, 2.0 * (x @ linear.weight.t()).sum())
    torch.testing.assert_close(linear.weight.grad, 2.0 * x.sum(0).expand(3, 4))
    assert seen == [torch.Size([5, 4])]
    # The module's own forward is back.
    assert linear.__dict__.get("forward") is bound_forward
    if not own_forward:
        torch.testing.assert_close(linear(x), x @ linear.weight.t() + linear.bias)


def test_call_with_full_parameters_restores_forward_on_error() -> None:
    from liger_kernel.transformers.distributed import call_with_full_parameters

    linear = _zero3_like_linear("NOT_AVAILABLE")

    def failing(module, h):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        call_with_full_parameters(linear, failing, torch.randn(1, 4))
    assert "forward" not in linear.__dict__


def test_unwrapped_class_of_fully_sharded_module() -> None:
    from liger_kernel.transformers.distributed import FSDPModule, unwrapped_class

    linear = torch.nn.Linear(4, 3)
    assert unwrapped_class(linear) is torch.nn.Linear
    if FSDPModule is None:
        pytest.skip("torch without FSDP2")
    # The class fully_shard gives a module (without needing a process group to build it).
    fsdp_linear_class = type("FSDPLinear", (FSDPModule, torch.nn.Linear), {})
    linear.__class__ = fsdp_linear_class
    assert unwrapped_class(linear) is torch.nn.Linear


def test_zero3_available_parameter_is_not_sharded() -> None:
    from liger_kernel.transformers.distributed import parameters_are_sharded

    # Inside the owning module's forward (or gathered by a GatheredParameters context) the
    # partition is AVAILABLE: no second gather.
    assert not parameters_are_sharded(_zero3_like_linear("AVAILABLE"))
