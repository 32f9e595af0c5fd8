"""Norm outputs recomputed in backward (``liger_kernel.transformers.recompute``).

The recompute runs the same deterministic kernel on the same inputs, so every gradient
must be bitwise equal to the run that keeps the outputs; what changes is what autograd
keeps, measured here by an outer saved-tensor hook that sees every tensor saved as usual.
"""

from __future__ import annotations

import weakref

import pytest
import torch

from liger_kernel.transformers.layer_norm import LigerLayerNorm
from liger_kernel.transformers.recompute import hook_norm_consumers, recompute_norm_outputs
from liger_kernel.transformers.rms_norm import LigerRMSNorm
from tests.utils import DEVICE

HIDDEN = 48


class Block(torch.nn.Module):
    """A pre-norm block: the norm output feeds two projections (both save it)."""

    def __init__(self, norm: torch.nn.Module) -> None:
        super().__init__()
        self.norm = norm
        self.up = torch.nn.Linear(HIDDEN, 2 * HIDDEN, bias=False)
        self.gate = torch.nn.Linear(HIDDEN, 2 * HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(x)
        return x.sum() + (self.up(y) * torch.sigmoid(self.gate(y))).sum()


def make_block(kind: str, hooked: bool = True) -> Block:
    """A block whose projections carry the recompute's consumer hooks (``hooked``), as a patch installs them."""
    torch.manual_seed(0)
    norm = LigerRMSNorm(HIDDEN) if kind == "rms" else LigerLayerNorm(HIDDEN)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.3)
    block = Block(norm).to(DEVICE)
    if hooked:
        hook_norm_consumers(block)
    return block


class SavedBytes:
    """An outer saved-tensor hook: how many bytes autograd saved through it."""

    def __init__(self) -> None:
        self.total = 0

    def __enter__(self):
        def pack(t):
            self.total += t.numel() * t.element_size()
            return t

        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def grads(block: Block, x: torch.Tensor, recompute: bool) -> tuple[list[torch.Tensor], int]:
    block.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    with SavedBytes() as saved, recompute_norm_outputs(recompute):
        out = block(x)
    out.backward()
    return [x.grad] + [p.grad for p in block.parameters()], saved.total


@pytest.mark.parametrize("kind", ["rms", "layer"])
@pytest.mark.parametrize("shape", [(3, 5, HIDDEN), (7, HIDDEN)])
def test_same_gradients_less_saved(kind, shape):
    block = make_block(kind)
    x = torch.randn(shape, device=DEVICE)
    kept, kept_bytes = grads(block, x, recompute=False)
    recomputed, recomputed_bytes = grads(block, x, recompute=True)
    for a, b in zip(kept, recomputed):
        assert torch.equal(a, b)
    # The two projections saved one view each of the same y: y no longer among the saved.
    y_bytes = x.numel() * x.element_size()
    assert kept_bytes - recomputed_bytes == 2 * y_bytes


def test_recomputed_once_for_all_views(monkeypatch):
    import liger_kernel.transformers.rms_norm as rms_module

    calls = []
    original = rms_module._recompute_rms_norm

    def counting(*args):
        calls.append(1)
        return original(*args)

    monkeypatch.setattr(rms_module, "_recompute_rms_norm", counting)
    block = make_block("rms")
    grads(block, torch.randn(4, 6, HIDDEN, device=DEVICE), recompute=True)
    assert len(calls) == 1


def test_input_modified_in_place_raises():
    block = make_block("rms")
    x = torch.randn(4, HIDDEN, device=DEVICE)
    h = (x * 1.0).requires_grad_(False)
    leaf = torch.zeros((), device=DEVICE, requires_grad=True)
    with recompute_norm_outputs():
        inp = h + leaf
        out = block.up(block.norm(inp)).sum()
    with torch.no_grad():
        inp.add_(1.0)
    with pytest.raises(RuntimeError, match="modified in place|modified by an inplace"):
        out.backward()


def test_outer_hooks_still_apply():
    """Tensors this context does not take over still go through hooks active outside it."""
    block = make_block("rms")
    x = torch.randn(4, HIDDEN, device=DEVICE, requires_grad=True)
    seen = []

    def pack(t):
        seen.append(t.shape)
        return ("outer", t)

    def unpack(packed):
        assert packed[0] == "outer"
        return packed[1]

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack), recompute_norm_outputs():
        out = block(x)
    out.backward()
    assert seen and x.grad is not None


def test_inactive_without_grad_or_when_disabled():
    block = make_block("rms")
    x = torch.randn(4, HIDDEN, device=DEVICE, requires_grad=True)
    with torch.no_grad(), recompute_norm_outputs():
        block(x)  # nothing is saved; must not fail
    _, disabled = grads(block, x, recompute=False)
    block.zero_grad(set_to_none=True)
    with SavedBytes() as plain:
        out = block(x.detach().clone().requires_grad_(True))
    out.backward()
    assert plain.total == disabled


def test_create_graph_keeps_higher_order_path():
    """Under create_graph the recompute goes through the autograd Function: first-order
    gradients with a graph still equal the kept run's."""
    block = make_block("rms")
    x = torch.randn(4, HIDDEN, device=DEVICE)
    kept, _ = grads(block, x, recompute=False)
    xr = x.clone().requires_grad_(True)
    with recompute_norm_outputs():
        out = block(xr)
    (gx,) = torch.autograd.grad(out, xr, create_graph=True)
    assert torch.equal(gx.detach(), kept[0])


def test_consumer_hooks_inert_outside_a_context():
    """Hooked Linear modules save as usual outside a recompute context, and without hooks a
    context has nothing to replace."""
    block = make_block("rms", hooked=False)
    x = torch.randn(5, HIDDEN, device=DEVICE)
    plain, plain_bytes = grads(block, x, recompute=False)
    unhooked, unhooked_bytes = grads(block, x, recompute=True)
    assert hook_norm_consumers(block) == 2
    assert hook_norm_consumers(block) == 0  # once per module
    hooked, hooked_bytes = grads(block, x, recompute=False)
    recomputed, recomputed_bytes = grads(block, x, recompute=True)
    assert hooked_bytes == plain_bytes == unhooked_bytes
    assert recomputed_bytes == plain_bytes - 2 * x.numel() * x.element_size()
    for a, b, c, d in zip(plain, unhooked, hooked, recomputed):
        assert torch.equal(a, b) and torch.equal(a, c) and torch.equal(a, d)


def test_consumers_scope_only_hooks_norm_consumers():
    """Inside a "consumers" context only a Linear whose input is a norm output saves through the
    context's hooks: a Linear on another tensor, and the ops around, save as usual."""
    block = make_block("rms")
    seen = []
    x = torch.randn(6, HIDDEN, device=DEVICE, requires_grad=True)
    other = torch.randn(6, HIDDEN, device=DEVICE, requires_grad=True)

    def pack(t):
        seen.append(t.data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), recompute_norm_outputs():
        y = block.norm(x)
        block.up(other)  # not a norm output: saved as usual, through the outer hook
        z = torch.sigmoid(block.gate(y))  # y replaced by a handle; sigmoid's output saved as usual
    assert y.data_ptr() not in seen
    assert other.data_ptr() in seen and z.data_ptr() in seen


def test_consumers_scope_hooks_popped_when_the_forward_raises():
    block = make_block("rms")
    x = torch.randn(3, HIDDEN, device=DEVICE, requires_grad=True)
    with recompute_norm_outputs():
        y = block.norm(x)
        block.up.weight.data = block.up.weight.data[:, :-1]  # make the projection fail
        with pytest.raises(RuntimeError):
            block.up(y)
        assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


def test_consumers_scope_defers_to_checkpointing():
    """Inside an activation-checkpointed region (its own saved-tensor hooks) the Linear hooks
    leave saving to the checkpoint, which recomputes everything anyway."""
    block = make_block("rms")
    x = torch.randn(4, 3, HIDDEN, device=DEVICE)
    kept, _ = grads(block, x, recompute=False)
    hook_norm_consumers(block)
    block.zero_grad(set_to_none=True)
    xc = x.clone().requires_grad_(True)
    with recompute_norm_outputs():
        out = torch.utils.checkpoint.checkpoint(block, xc, use_reentrant=False)
    out.backward()
    for a, b in zip(kept, [xc.grad] + [p.grad for p in block.parameters()]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("model_type", ["llama", "gemma2"])
def test_patched_model_same_gradients(model_type):
    pytest.importorskip("transformers")
    from liger_kernel.transformers import _apply_liger_kernel_to_instance
    from tests.transformers.model_configs import build_model, loss_and_grads, random_batch

    batch = random_batch(1024, seed=0)
    results = []
    for recompute in (False, True):
        model = build_model(model_type)
        _apply_liger_kernel_to_instance(model, recompute_norm_outputs=recompute)
        assert bool(model.model.layers[0].mlp.up_proj._forward_pre_hooks) is recompute  # hooked when patched
        with SavedBytes() as saved:
            results.append((loss_and_grads(model, batch), saved.total))
    ((loss_a, grads_a), bytes_a), ((loss_b, grads_b), bytes_b) = results
    assert torch.equal(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), name
    assert bytes_b < bytes_a


def test_patched_model_skips_the_recompute_under_autocast():
    """Under autocast that casts the residual stream (the HF Trainer's ``bf16=True`` over fp32
    weights) every projection saves its own cast of a norm output, never the output, so the
    patched forward leaves the recompute context (and its hooks' host time) out: the same
    loss, gradients and saved bytes as without it. Without autocast the same model uses it."""
    pytest.importorskip("transformers")
    from liger_kernel.transformers import _apply_liger_kernel_to_instance
    from liger_kernel.transformers.recompute import autocast_recasts, recomputing
    from tests.transformers.model_configs import build_model, loss_and_grads, random_batch

    device_type = torch.device(DEVICE).type
    batch = random_batch(1024, seed=3)
    seen: list[bool] = []
    results = []
    for recompute in (False, True):
        model = build_model("llama")
        _apply_liger_kernel_to_instance(model, recompute_norm_outputs=recompute)
        model.model.layers[0].input_layernorm.register_forward_pre_hook(lambda m, a: seen.append(recomputing()))
        with SavedBytes() as saved, torch.autocast(device_type, dtype=torch.bfloat16):
            assert autocast_recasts(device_type, torch.float32)
            assert not autocast_recasts(device_type, torch.bfloat16)
            results.append((loss_and_grads(model, batch), saved.total))
    assert seen == [False, False]
    ((loss_a, grads_a), bytes_a), ((loss_b, grads_b), bytes_b) = results
    assert bytes_a == bytes_b
    assert torch.equal(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), name
    assert not autocast_recasts(device_type, torch.float32)
    loss_and_grads(model, batch)
    assert seen[-1] is True


def test_autocast_check_accepts_device_types_autocast_does_not_know():
    """Offloaded weights (accelerate) sit on the meta device, which autocast rejects: no cast there."""
    from liger_kernel.transformers.recompute import autocast_recasts

    assert autocast_recasts("meta", torch.float32) is False


def test_zero3_parameters_are_not_recomputed():
    """A DeepSpeed ZeRO-3 parameter (marked ``ds_id``) is gathered too late for a recompute."""
    block = make_block("rms")
    block.norm.weight.ds_id = 0
    x = torch.randn(4, HIDDEN, device=DEVICE)
    kept, kept_bytes = grads(block, x, recompute=False)
    same, same_bytes = grads(block, x, recompute=True)
    assert same_bytes == kept_bytes
    for a, b in zip(kept, same):
        assert torch.equal(a, b)


def test_released_parameters_raise():
    block = make_block("rms")
    x = torch.randn(4, HIDDEN, device=DEVICE, requires_grad=True)
    with recompute_norm_outputs():
        out = block(x)
    block.norm.weight.data = torch.empty(0, device=DEVICE)  # what a sharding release leaves
    with pytest.raises(RuntimeError, match="released"):
        out.backward()


class SavedNormOutputs(SavedBytes):
    """:class:`SavedBytes` that also counts the bytes of saved tensors that are (views starting
    at) the output of a norm module of ``model``: what the recompute must drop."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.norm_bytes = 0
        self._outputs: list = []
        self._handles = [
            module.register_forward_hook(lambda m, a, out: self._outputs.append(weakref.ref(out)))
            for module in model.modules() if type(module).__name__.endswith(("RMSNorm", "LayerNorm"))
        ]
        assert self._handles

    def _is_norm_output(self, t: torch.Tensor) -> bool:
        for ref in self._outputs:
            y = ref()
            if (y is not None and t.data_ptr() == y.data_ptr() and t.dtype == y.dtype
                    and t.untyped_storage().data_ptr() == y.untyped_storage().data_ptr()):
                return True
        return False

    def __enter__(self):
        def pack(t):
            size = t.numel() * t.element_size()
            self.total += size
            if self._is_norm_output(t):
                self.norm_bytes += size
            return t

        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        for handle in self._handles:
            handle.remove()


def steps_with_and_without(make_model, batch: dict) -> dict:
    """{recompute: (loss, grads, saved bytes, model, saved norm-output bytes)} of one training
    step of ``make_model(recompute)``."""
    from tests.transformers.model_configs import loss_and_grads

    results = {}
    for recompute in (False, True):
        model = make_model(recompute)
        with SavedNormOutputs(model) as saved:
            loss, grads_ = loss_and_grads(model, batch)
        results[recompute] = (loss, grads_, saved.total, model, saved.norm_bytes)
    return results


def assert_drops_every_saved_norm_output(results: dict) -> None:
    """Bitwise the same loss and gradients; the recompute saves exactly the norm outputs the
    plain step saved less, and none itself."""
    (loss_a, grads_a, bytes_a, _, norm_a), (loss_b, grads_b, bytes_b, _, norm_b) = results[False], results[True]
    assert norm_a > 0
    assert norm_b == 0
    assert bytes_a - bytes_b == norm_a
    assert torch.equal(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), name


@pytest.mark.parametrize("model_type", ["llama", "mistral", "mixtral", "gemma", "gemma2", "qwen2", "qwen3", "phi3"])
def test_patched_model_drops_every_saved_norm_output(model_type):
    """The patch hooks the norm consumers (every ``nn.Linear``, the family's routers) when it
    patches, before any forward; the fused forward's recompute then drops every norm output
    the unrecomputed step saves, with bitwise the same gradients."""
    pytest.importorskip("transformers")
    from liger_kernel.transformers import _apply_liger_kernel_to_instance
    from tests.transformers.model_configs import build_model, random_batch

    def make_model(recompute):
        model = build_model(model_type)
        _apply_liger_kernel_to_instance(model, recompute_norm_outputs=recompute)
        assert bool(model.model.layers[0].self_attn.o_proj._forward_pre_hooks) is recompute
        return model

    assert_drops_every_saved_norm_output(steps_with_and_without(make_model, random_batch(1024, seed=1)))


def test_class_level_patch_hooks_consumers_when_the_model_is_built():
    """Models built after a class-level patch get the consumer hooks in their construction
    (``post_init``), and their recompute drops every saved norm output; revert removes it."""
    pytest.importorskip("transformers")
    from liger_kernel.transformers import _apply_liger_kernel, revert_liger_kernel
    from tests.transformers.model_configs import build_model, random_batch

    def make_model(recompute):
        revert_liger_kernel("llama")
        _apply_liger_kernel("llama", recompute_norm_outputs=recompute)
        model = build_model("llama")
        assert bool(model.model.layers[0].self_attn.q_proj._forward_pre_hooks) is recompute
        return model

    try:
        results = steps_with_and_without(make_model, random_batch(1024, seed=2))
    finally:
        revert_liger_kernel("llama")
    assert_drops_every_saved_norm_output(results)
    assert not build_model("llama").model.layers[0].self_attn.q_proj._forward_pre_hooks


def test_consumers_scope_threads_interleaved():
    """nn.DataParallel runs each replica's forward (the context included) in its own thread,
    and autograd keeps saved-tensor hooks per thread. Two threads interleave inside their
    projections: thread 0 pushes its hooks and waits there, thread 1 enters its context,
    runs its norm and pushes its hooks, then thread 0 finishes first (its pop is not the
    latest push) and thread 1 after it. Each registers into, pushes and pops only its own
    context, saves as little as alone and leaves no hooks behind. Kernels never run in both
    threads at once (the Triton interpreter patches triton.language globally while it runs)."""
    import threading

    x = torch.randn(5, HIDDEN, device=DEVICE)
    blocks = [make_block("rms") for _ in range(2)]
    kept, kept_bytes = grads(make_block("rms"), x, recompute=False)
    inside = [threading.Event(), threading.Event()]
    first_done = threading.Event()
    results: dict[int, object] = {}

    def wait_inside(index: int):
        def hook(module, args):
            inside[index].set()
            assert (inside[1] if index == 0 else first_done).wait(timeout=60), "the other thread stalled"
        return hook

    def worker(index: int) -> None:
        try:
            if index == 1:
                assert inside[0].wait(timeout=60), "thread 0 never reached its projection"
            block = blocks[index]
            hook_norm_consumers(block)
            handle = block.up.register_forward_pre_hook(wait_inside(index))  # after the recompute's hook
            try:
                results[index] = grads(block, x, recompute=True)
            finally:
                handle.remove()
            assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
        except BaseException as error:  # reported by the main thread
            results[index] = error
        finally:
            if index == 0:
                first_done.set()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for index in range(2):
        result = results[index]
        if isinstance(result, BaseException):
            raise result
        recomputed, recomputed_bytes = result
        assert kept_bytes - recomputed_bytes == 2 * x.numel() * x.element_size()
        for a, b in zip(kept, recomputed):
            assert torch.equal(a, b)


def test_consumers_scope_respects_hooks_disabled_inside():
    """A consumer that runs where saved-tensor hooks were disabled after the context began
    saves as usual instead of failing to push the context's hooks."""
    block = make_block("rms")
    x = torch.randn(4, HIDDEN, device=DEVICE, requires_grad=True)
    with recompute_norm_outputs():
        y = block.norm(x)
        with torch.autograd.graph.disable_saved_tensors_hooks("disabled for this test"):
            out = block.up(y).sum()
        assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    out.backward()
    assert x.grad is not None


def test_lora_adapters_are_consumers_too():
    """With PEFT LoRA on the projections (dropout 0: the adapters' ``lora_A`` receive the norm
    output itself) the recompute drops every saved norm output: the base layers and the
    adapters are all ``nn.Linear``, hooked by the patch. Bitwise the same gradients."""
    pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from liger_kernel.transformers import _apply_liger_kernel_to_instance
    from tests.transformers.model_configs import build_model, random_batch

    def make_model(recompute):
        config = peft.LoraConfig(r=4, lora_dropout=0.0,
                                 target_modules=["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"])
        model = peft.get_peft_model(build_model("llama", seed=3), config)
        torch.manual_seed(4)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(std=0.1)
        _apply_liger_kernel_to_instance(model, recompute_norm_outputs=recompute)
        return model

    results = steps_with_and_without(make_model, random_batch(1024, seed=3))
    assert any("lora_A" in name for name in results[True][1])
    assert_drops_every_saved_norm_output(results)


# ---- Norm outputs edited in place between the norm and its consumers ----
#
# The recompute must give HF's gradients whatever edits a norm output in place: a forward hook
# on the norm (activation steering), a global module hook, the consumer itself. Tiny Llama,
# instance-patched (recompute on, in-place backwards on), against HF's own model with the same
# hooks; fp32 with the patching tests' tolerance, eager and under torch.compile (aot_eager:
# AOTAutograd's functionalisation of the edit, no code generation).

STEERING = 1.5


def _is_norm(module: torch.nn.Module) -> bool:
    return type(module).__name__.endswith("RMSNorm")


def _edit_norm_outputs(model: torch.nn.Module, edit: str) -> list:
    """Install ``edit`` on ``model``; returns the handles to remove."""
    layer = model.model.layers[0]
    if edit == "norm_hook":
        return [layer.input_layernorm.register_forward_hook(lambda m, args, out: out.mul_(STEERING))]
    if edit == "global_hook":
        # Every module's forward hook, editing every norm's output (including the final norm).
        return [torch.nn.modules.module.register_module_forward_hook(
            lambda m, args, out: out.mul_(STEERING) if _is_norm(m) else None)]
    if edit == "consumer_edits_its_input":
        # The first consumer (q_proj) scales its input in place before using it: k_proj and
        # v_proj see the edited values too, in HF's model as in ours.
        return [layer.self_attn.q_proj.register_forward_pre_hook(lambda m, args: args[0].mul_(STEERING))]
    raise ValueError(edit)


def _steered_loss_and_grads(patched: bool, edit: str, compiled: bool, batch: dict):
    from liger_kernel.transformers import _apply_liger_kernel_to_instance
    from tests.transformers.model_configs import build_model, loss_and_grads

    model = build_model("llama", seed=0, use_cache=False)
    if patched:
        _apply_liger_kernel_to_instance(model)
    handles = _edit_norm_outputs(model, edit)
    try:
        if compiled:
            torch._dynamo.reset()
            model.compile(backend="aot_eager")
            model.train()
            model.zero_grad(set_to_none=True)
            loss = model(**batch).loss
            loss.backward()
            return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()
                                   if p.grad is not None}
        return loss_and_grads(model, batch)
    finally:
        for handle in handles:
            handle.remove()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("edit", ["norm_hook", "global_hook", "consumer_edits_its_input"])
def test_norm_output_edited_in_place_gives_hf_gradients(edit, compiled):
    """The issue's case: a hook that scales a norm's output in place made the recompute rebuild
    the unscaled output, so q_proj's weight gradient was off by a third. The edit bumps the
    output's version counter, so the consumers save it as usual: every gradient is HF's."""
    pytest.importorskip("transformers")
    from tests.transformers.model_configs import random_batch

    batch = random_batch(1024, seed=3)
    hf_loss, hf_grads = _steered_loss_and_grads(False, edit, compiled, batch)
    loss, grads = _steered_loss_and_grads(True, edit, compiled, batch)
    torch.testing.assert_close(loss, hf_loss, atol=2e-5, rtol=1e-4)
    assert grads.keys() == hf_grads.keys()
    for name, grad in hf_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=2e-5, rtol=1e-4, msg=name)


def test_consumer_editing_its_input_after_using_it_gets_the_values_it_used():
    """q_proj's forward hook scales its input (the norm output) in place after q_proj used it.
    HF's model then fails in backward (q_proj's saved input was modified); with the recompute
    q_proj's copy is the recipe, which gives back the values q_proj used, and k_proj/v_proj,
    which saved the edited output, keep it as usual: the gradients are those of HF's model in
    which k_proj and v_proj read the scaled output and q_proj the unscaled one."""
    pytest.importorskip("transformers")
    from liger_kernel.transformers import _apply_liger_kernel_to_instance
    from tests.transformers.model_configs import build_model, loss_and_grads, random_batch

    def scale_input_after_use(module, args, out):
        args[0].mul_(STEERING)  # returns None: q_proj's output stays its own

    batch = random_batch(1024, seed=4)
    reference = build_model("llama", seed=0, use_cache=False)
    attention = reference.model.layers[0].self_attn
    for projection in (attention.k_proj, attention.v_proj):
        projection.register_forward_pre_hook(lambda m, args: (args[0] * STEERING,))
    hf_loss, hf_grads = loss_and_grads(reference, batch)

    hf = build_model("llama", seed=0, use_cache=False)
    hf.model.layers[0].self_attn.q_proj.register_forward_hook(scale_input_after_use)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss_and_grads(hf, batch)

    model = build_model("llama", seed=0, use_cache=False)
    _apply_liger_kernel_to_instance(model)
    model.model.layers[0].self_attn.q_proj.register_forward_hook(scale_input_after_use)
    loss, grads = loss_and_grads(model, batch)
    torch.testing.assert_close(loss, hf_loss, atol=2e-5, rtol=1e-4)
    for name, grad in hf_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=2e-5, rtol=1e-4, msg=name)


def test_tensor_saved_inside_a_consumer_and_edited_raises_as_without_the_recompute():
    """A saved-tensor hook switches off autograd's check of in-place edits for the tensors it
    returns; the recompute's hook makes that check itself, so a consumer's saved weight edited
    in place before backward raises, as it does without the recompute."""
    block = make_block("rms")
    x = torch.randn(4, HIDDEN, device=DEVICE)
    for recompute in (False, True):
        with recompute_norm_outputs(recompute):
            out = block(x)
        with torch.no_grad():
            block.up.weight.mul_(2.0)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.backward()
