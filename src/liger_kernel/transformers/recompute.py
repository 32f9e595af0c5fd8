"""Norm outputs recomputed in backward instead of kept alive between forward and backward.

In a pre-norm decoder layer the normalised hidden states ``y = norm(x)`` (N, H) feed the
attention projections and the MLP's gate/up projections, and every ``nn.Linear`` saves its
input for its weight gradient. ``x`` (the residual stream) is saved by the norm anyway, so
keeping ``y`` as well costs N * H elements twice per layer that could be recomputed from
``x`` in one cheap kernel: for Llama-3.2-1B at 8192 tokens, 1 GiB of the training step's peak.

:func:`recompute_norm_outputs` is a context manager installing autograd saved-tensor hooks
(``torch.autograd.graph.saved_tensors_hooks``). Inside it, the Liger norm modules register
each output ``y`` with a way to recompute it (:func:`register_recomputable`). When autograd
saves a tensor that is ``y`` or a view of it (``F.linear`` saves a 2-D view of a 3-D
input), the pack hook stores a small handle instead; in backward the first unpack
recomputes ``y`` once (the same deterministic kernel on the same inputs: bitwise the same
values) and every handle returns its view of it. Everything else is saved as usual, and
hooks already active outside (e.g. ``save_on_cpu``) still handle those tensors.

Not used (tensors saved as usual) while ``torch.compile`` traces, while grad is disabled,
where saved-tensor hooks are disabled, inside regions with their own hooks (activation
checkpointing already recomputes everything there), or for DeepSpeed ZeRO-3 parameters
(gathered per module only when the backward reaches the norm, after the recompute). FSDP2
unshards a whole decoder layer before any of its backward, so it is safe there. If the norm's input was modified in
place after the forward, the recompute raises, as autograd would for a saved tensor. Under
double backward (``create_graph=True``) the recompute runs through the autograd Function,
so higher-order gradients still flow to the norm's input and weight.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator

import torch

# Registries of the active contexts (innermost last): output address -> (weak output, recipe).
_ACTIVE: list[dict[int, tuple[weakref.ref, _Recipe]]] = []


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


def register_recomputable(y: torch.Tensor, compute: Callable[[], torch.Tensor],
                          inputs: tuple[torch.Tensor, ...]) -> None:
    """Let an active :func:`recompute_norm_outputs` context save ``y`` as ``compute()``.

    ``compute`` must return a tensor equal to ``y`` bitwise, with ``y``'s layout, from
    ``inputs`` (which the caller's autograd node keeps alive anyway). No-op outside a context.
    """
    if not _ACTIVE or not torch.is_grad_enabled():
        return
    # DeepSpeed ZeRO-3 gathers a module's parameters only when the backward reaches that
    # module, after its consumers' backward would need the recompute: keep y as usual.
    if any(hasattr(t, "ds_id") for t in inputs):
        return
    key = _address_key(y)
    if key is None or not y.is_contiguous():
        return
    _ACTIVE[-1][key] = (weakref.ref(y), _Recipe(compute, inputs))


def recomputing() -> bool:
    """Whether norm outputs created now would be registered (a context is active)."""
    return bool(_ACTIVE)


@contextlib.contextmanager
def recompute_norm_outputs(enabled: bool = True) -> Iterator[None]:
    """Within this context, autograd saves Liger norm outputs as recipes (see the module docstring)."""
    if (not enabled or not torch.is_grad_enabled() or torch.compiler.is_compiling()
            or not torch._C._autograd._saved_tensors_hooks_is_enabled()):
        yield
        return
    registry: dict[int, tuple[weakref.ref, _Recipe]] = {}
    outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
    outer_pack, outer_unpack = outer if outer is not None else (None, None)

    def pack(t: torch.Tensor):
        entry = registry.get(_address_key(t)) if registry else None
        if entry is not None:
            y = entry[0]()
            # A live y owns this memory, so a tensor starting at its address with its dtype
            # and device is a view of it (of at most its size: the same storage).
            if (y is not None and t.dtype == y.dtype and t.device == y.device
                    and t.untyped_storage().data_ptr() == y.untyped_storage().data_ptr()):
                return _SavedView(entry[1], t)
        return outer_pack(t) if outer_pack is not None else t

    def unpack(packed):
        if isinstance(packed, _SavedView):
            return packed.tensor()
        return outer_unpack(packed) if outer_unpack is not None else packed

    _ACTIVE.append(registry)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield
    finally:
        _ACTIVE.pop()
        # Autograd keeps ``pack`` (so this dict) alive with every tensor saved here; cleared,
        # each recipe lives only as long as the handles that use it.
        registry.clear()
