"""Norm outputs recomputed in backward instead of kept alive between forward and backward.

In a pre-norm decoder layer the normalised hidden states ``y = norm(x)`` (N, H) feed the
attention projections and the MLP's gate/up projections, and every ``nn.Linear`` saves its
input for its weight gradient. ``x`` (the residual stream) is saved by the norm anyway, so
keeping ``y`` as well costs N * H elements twice per layer that could be recomputed from
``x`` in one cheap kernel: for Llama-3.2-1B at 8192 tokens, 1 GiB of the training step's peak.

:func:`recompute_norm_outputs` is a context manager; inside it the Liger norm modules register
each output ``y`` with a way to recompute it (:func:`register_recomputable`), and autograd
saved-tensor hooks (``torch.autograd.graph.saved_tensors_hooks``, kept per thread) replace a
saved ``y``, or a view of it (``F.linear`` saves a 2-D view of a 3-D input), by a small
handle. In backward the first unpack recomputes ``y`` once (the same deterministic kernel on
the same inputs: bitwise the same values) and every handle returns its view of it.
Everything else is saved as usual, and hooks already active outside (e.g. ``save_on_cpu``)
still handle those tensors.

The hooks are active only inside the forward of a consumer module (every ``nn.Linear``, plus
the classes a model family names, e.g. Mixtral's router) whose first input is a registered
norm output, via the module hooks :func:`hook_norm_consumers` installs (the patch installs
them when it patches a model). In the supported families those modules (projections, LoRA
adapters, routers) are what save norm outputs; every other op runs without Python
saved-tensor hooks, which would slow it down on the host.

Each context belongs to the thread that entered it (``nn.DataParallel`` runs one replica's
forward per thread): norms register into, and consumers push the hooks of, their own thread's
context only.

Not used (tensors saved as usual) while ``torch.compile`` traces, while grad is disabled,
where saved-tensor hooks are disabled, inside regions with their own hooks (activation
checkpointing already recomputes everything there), or for DeepSpeed ZeRO-3 parameters
(gathered per module only when the backward reaches the norm, after the recompute). FSDP2
unshards a whole decoder layer before any of its backward, so it is safe there.

The recompute gives the values the norm returned; a consumer's copy is replaced only where it
still holds them. Each registered output's version counter (shared by its views, bumped by
every in-place op) is recorded when the norm returns it and compared when a consumer saves it:
an output edited in place in between (a forward hook on the norm, a global module hook, the
consumer or its pre-hook) is saved as usual by that consumer, as HF's norm output would be, so
its gradient is HF's. Consumers that saved it before the edit keep the recipe: they computed
with the unedited values, which the recompute gives back. Every other tensor saved inside a
consumer keeps autograd's own check (a saved-tensor hook switches it off, so the unpack makes
it): edited in place before backward, it raises. If the norm's input was modified in place
after the forward, the recompute raises, as autograd would for a saved tensor. Under ``create_graph=True`` the recompute runs through the
autograd Function, so the recomputed output keeps its graph: second-order terms that reach
the norm only through its output (e.g. of a projection's weight gradient) still flow to the
norm's input and weight. Differentiating the norm's own backward (its input and weight
gradients) a second time raises, with or without the recompute: that backward is
``once_differentiable``.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator

import torch

# The active contexts of every thread, innermost last (plain lists: torch.compile guards on
# them being empty). Each entry names its thread: nn.DataParallel runs one replica's forward,
# context included, per thread, and saved-tensor hooks are per thread in autograd.
_ACTIVE: list[_Session] = []
# (thread, consumer module) whose forward pushed its thread's session hooks, innermost last.
_PUSHED: list[tuple[int, torch.nn.Module]] = []


class _Recipe:
    """How to recompute one norm output; caches it for the views saved by several consumers."""

    __slots__ = ("_compute", "_inputs", "_versions", "_cached")

    def __init__(self, compute: Callable[[], torch.Tensor], inputs: tuple[torch.Tensor, ...]) -> None:
        self._compute = compute
        self._inputs = inputs
        self._versions = tuple(t._version for t in inputs)
        self._cached: torch.Tensor | None = None

    def output(self) -> torch.Tensor:
        if self._cached is None:
            if any(t.numel() == 0 for t in self._inputs):
                raise RuntimeError(
                    "the parameters of a Liger norm whose output is recomputed in backward were released "
                    "(sharded) before the recompute; patch with recompute_norm_outputs=False"
                )
            if tuple(t._version for t in self._inputs) != self._versions:
                raise RuntimeError(
                    "an input of a Liger norm whose output is recomputed in backward was modified in place "
                    "after the forward; recompute the model without in-place edits, or patch with "
                    "recompute_norm_outputs=False"
                )
            self._cached = self._compute()
        return self._cached


class _SavedView:
    """What autograd keeps instead of a view of a registered norm output."""

    __slots__ = ("recipe", "size", "stride", "offset")

    def __init__(self, recipe: _Recipe, t: torch.Tensor) -> None:
        self.recipe = recipe
        self.size = t.size()
        self.stride = t.stride()
        self.offset = t.storage_offset()

    def tensor(self) -> torch.Tensor:
        return self.recipe.output().as_strided(self.size, self.stride, self.offset)


def _address_key(t: torch.Tensor) -> int | None:
    """The address of ``t``'s first element: a registered output (contiguous, at offset 0)
    and every view of it that starts at its beginning (the 2-D view ``F.linear`` saves)
    share it. Cheap (no storage object), as the pack hook runs for every saved tensor."""
    if type(t) is not torch.Tensor or t.layout != torch.strided or t.numel() == 0:
        return None  # subclasses (DTensor, ...) and empty tensors are never registered
    return t.data_ptr()


class _Saved:
    """A tensor saved as usual inside a consumer, with its version when saved: autograd checks
    that for the tensors it keeps itself, but not for those a saved-tensor hook returns, so the
    unpack does it (a tensor edited in place between forward and backward raises, as without
    the hooks)."""

    __slots__ = ("tensor", "version")

    def __init__(self, t: torch.Tensor) -> None:
        self.tensor = t
        self.version = t._version

    def unpack(self) -> torch.Tensor:
        if self.tensor._version != self.version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace "
                f"operation: a tensor of shape {list(self.tensor.shape)} saved by a module whose input is a "
                f"Liger norm output is at version {self.tensor._version}; expected version {self.version} "
                "instead (the same check autograd makes)"
            )
        return self.tensor


class _Session:
    """One active context: its registry (output address -> (weak output, recipe, the output's
    version when the norm returned it)) and its hooks."""

    __slots__ = ("outputs", "thread", "outer", "pack", "unpack")

    def __init__(self) -> None:
        self.outputs: dict[int, tuple[weakref.ref, _Recipe, int]] = {}
        self.thread = threading.get_ident()
        # The hooks active when the context was entered: ours chain to them, and a consumer
        # whose forward finds other hooks on top (activation checkpointing) leaves saving to those.
        self.outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        outer_pack, outer_unpack = self.outer if self.outer is not None else (None, None)
        outputs = self.outputs

        def pack(t: torch.Tensor):
            key = _address_key(t) if outputs else None
            entry = outputs.get(key) if key is not None else None
            if entry is not None:
                y, recipe, version = entry[0](), entry[1], entry[2]
                # A live y owns this memory, so a tensor starting at its address with its dtype
                # and device is a view of it (of at most its size: the same storage). Views
                # share y's version counter: an unchanged version proves that nothing (a hook
                # on the norm, a global hook, the consumer itself) edited y in place since the
                # norm returned it, so the recompute gives the values the consumer used. An
                # edited y is saved as usual, as HF's own norm output would be.
                if (y is not None and t.dtype == y.dtype and t.device == y.device
                        and t.untyped_storage().data_ptr() == y.untyped_storage().data_ptr()
                        and t._version == version):
                    return _SavedView(recipe, t)
            if outer_pack is not None:
                return outer_pack(t)
            return _Saved(t)

        def unpack(packed):
            if isinstance(packed, _SavedView):
                return packed.tensor()
            if isinstance(packed, _Saved):
                return packed.unpack()
            return outer_unpack(packed) if outer_unpack is not None else packed

        self.pack = pack
        self.unpack = unpack


def _current_session() -> _Session | None:
    """This thread's innermost active context, if any."""
    if not _ACTIVE:
        return None
    thread = threading.get_ident()
    for session in reversed(_ACTIVE):
        if session.thread == thread:
            return session
    return None


def register_recomputable(y: torch.Tensor, compute: Callable[[], torch.Tensor],
                          inputs: tuple[torch.Tensor, ...]) -> None:
    """Let an active :func:`recompute_norm_outputs` context save ``y`` as ``compute()``.

    ``compute`` must return a tensor equal to ``y`` bitwise, with ``y``'s layout, from
    ``inputs`` (which the caller's autograd node keeps alive anyway). Call it as soon as ``y``
    exists: its version now is the one a consumer's saved view must still have to be replaced
    (a later in-place edit, by a hook or a consumer, keeps that consumer's copy saved as usual).
    No-op outside a context.
    """
    if not _ACTIVE or not torch.is_grad_enabled():
        return
    session = _current_session()
    if session is None:
        return
    # DeepSpeed ZeRO-3 gathers a module's parameters only when the backward reaches that
    # module, after its consumers' backward would need the recompute: keep y as usual.
    if any(hasattr(t, "ds_id") for t in inputs):
        return
    key = _address_key(y)
    if key is None or not y.is_contiguous():
        return
    session.outputs[key] = (weakref.ref(y), _Recipe(compute, inputs), y._version)


def autocast_recasts(device_type: str, dtype: torch.dtype) -> bool:
    """Whether autocast is on for ``device_type`` and casts a ``dtype`` tensor before a projection.

    Then every ``nn.Linear`` saves its own cast of a norm output (the cast is what it
    multiplies), never the output itself, so a recompute context would find nothing to replace
    and cost only the host time of its hooks. Under the HF Trainer's ``bf16=True`` / ``fp16=True``
    (fp32 weights under autocast) this is the case; in a model trained in bf16 it is not.
    """
    try:
        return torch.is_autocast_enabled(device_type) and torch.get_autocast_dtype(device_type) != dtype
    except RuntimeError:  # a device type autocast does not know (meta, ...): no autocast there
        return False


def recomputing() -> bool:
    """Whether norm outputs created now would be registered (a context is active in this thread)."""
    return bool(_ACTIVE) and _current_session() is not None


def _saved_tensors_hooks_enabled() -> bool:
    """False inside ``torch.autograd.graph.disable_saved_tensors_hooks`` (torch.func transforms)."""
    return torch._C._autograd._saved_tensors_hooks_is_enabled()  # type: ignore[attr-defined]  # not in torch's stubs


@contextlib.contextmanager
def recompute_norm_outputs(enabled: bool = True) -> Iterator[None]:
    """Within this context, autograd saves Liger norm outputs as recipes (see the module docstring):
    those saved inside modules hooked by :func:`hook_norm_consumers` whose first input is a
    norm output registered here."""
    if (not enabled or not torch.is_grad_enabled() or torch.compiler.is_compiling()
            or not _saved_tensors_hooks_enabled()):
        yield
        return
    session = _Session()
    _ACTIVE.append(session)
    try:
        yield
    finally:
        _ACTIVE.remove(session)
        # Autograd keeps ``pack`` (so this dict) alive with every tensor saved here; cleared,
        # each recipe lives only as long as the handles that use it.
        session.outputs.clear()


def _consumer_pre_hook(module: torch.nn.Module, args: tuple) -> None:
    if not _ACTIVE or not args:
        return
    session = _current_session()
    if session is None or not session.outputs:
        return
    key = _address_key(args[0])
    if key is None or key not in session.outputs:
        return
    # Code that disabled saved-tensor hooks since the context began (torch.func transforms)
    # would make the push raise; code that pushed its own (checkpointing) owns the saving.
    if (not torch.is_grad_enabled() or not _saved_tensors_hooks_enabled()
            or torch._C._autograd._top_saved_tensors_default_hooks(False) != session.outer):
        return
    torch._C._autograd._push_saved_tensors_default_hooks(session.pack, session.unpack)
    _PUSHED.append((session.thread, module))


def _consumer_post_hook(module: torch.nn.Module, args: tuple, output: object) -> None:
    if not _PUSHED:
        return
    thread = threading.get_ident()
    for i in range(len(_PUSHED) - 1, -1, -1):
        if _PUSHED[i][0] == thread and _PUSHED[i][1] is module:
            del _PUSHED[i]
            torch._C._autograd._pop_saved_tensors_default_hooks()
            return


# The module hooks this module installs: they never read or keep what they see.
RECOMPUTE_HOOKS = (_consumer_pre_hook, _consumer_post_hook)


def has_only_recompute_hooks(module: torch.nn.Module) -> bool:
    """Whether every forward (pre-)hook of ``module`` is one :func:`hook_norm_consumers`
    installed (or there are none). Those hooks never change what the forward computes, so a
    caller may run the module's math itself (e.g. fused into a kernel) and skip them: they
    only act on an input that is a registered norm output."""
    return (all(hook is _consumer_pre_hook for hook in module._forward_pre_hooks.values())
            and all(hook is _consumer_post_hook for hook in module._forward_hooks.values()))


def hook_norm_consumers(model: torch.nn.Module, class_names: tuple[str, ...] = ()) -> int:
    """Install the recompute's forward hooks on every ``nn.Linear`` of ``model`` and every
    module whose class is named in ``class_names`` (each module once).

    Outside a :func:`recompute_norm_outputs` context the hooks return at once.
    Modules added later (e.g. adapters attached after the first training step) are not hooked
    until this is called again; a norm output they save is then kept as usual.
    Returns the number of modules newly hooked.
    """
    hooked = 0
    for module in model.modules():
        if module.__dict__.get("_liger_recompute_hooked", False):
            continue
        if isinstance(module, torch.nn.Linear) or type(module).__name__ in class_names:
            module.register_forward_pre_hook(_consumer_pre_hook)
            module.register_forward_hook(_consumer_post_hook, always_call=True)
            module.__dict__["_liger_recompute_hooked"] = True
            hooked += 1
    return hooked
