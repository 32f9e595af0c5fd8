"""The checks of the cross-entropy losses' targets and class weights (plain and fused with
the LM head): shapes and dtypes raised at once, the targets' value range checked on the device
and raised when the caller waits for it (:class:`PendingTargetCheck`)."""

from __future__ import annotations

import torch

from liger_kernel.ops.checks import check_float_dtype, check_tensor


def check_class_weight(class_weight: torch.Tensor | None, n_cols: int, name: str = "weight") -> torch.Tensor | None:
    """Validate the class weights; returns them as the kernel reads them, with unit stride
    (it addresses ``class_weight_ptr + c``: a strided view such as ``w[::2]`` would be read
    wrong, silently). Copies only a non-contiguous ``class_weight``."""
    if class_weight is None:
        return None
    check_float_dtype(class_weight, name)
    if class_weight.dim() != 1 or class_weight.shape[0] != n_cols:
        raise ValueError(
            f"{name} (class weights) must have shape ({n_cols},), one per class, got {tuple(class_weight.shape)}"
        )
    return class_weight.contiguous()


class PendingTargetCheck:
    """The value-range check of a target, started on the device; :meth:`wait` raises.

    Waiting right after starting is a host sync that drains the GPU's queue, so the GPU
    idles while the host launches the next kernels. A caller that launches its kernels
    first (they never address memory with a bad target) and waits afterwards keeps the GPU
    busy: by then the check's result is usually long computed.
    """

    __slots__ = ("_bad", "_flag", "_event", "_target", "_n_cols", "_ignore_index", "_name")

    def __init__(self, target: torch.Tensor | None, n_cols: int = 0, ignore_index: int = -100,
                 name: str = "target") -> None:
        self._target, self._n_cols, self._ignore_index, self._name = target, n_cols, ignore_index, name
        self._bad = self._flag = self._event = None
        if target is None:
            return
        self._bad = ((target != ignore_index) & ((target < 0) | (target >= n_cols))).any()
        if target.is_cuda:
            # Copy the verdict into pinned host memory behind the work queued so far.
            self._flag = torch.empty((), dtype=torch.bool, pin_memory=True)
            self._flag.copy_(self._bad, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()

    def wait(self) -> None:
        """Block until the check has run; raise ``ValueError`` naming a bad class index."""
        if self._bad is None:
            return
        if self._event is not None:
            self._event.synchronize()
            bad = bool(self._flag)
        else:
            bad = bool(self._bad)
        target = self._target  # set whenever a check was started
        if bad and target is not None:
            outside = (target != self._ignore_index) & ((target < 0) | (target >= self._n_cols))
            first = int(target[outside][0])
            raise ValueError(
                f"{self._name} contains class index {first} outside [0, {self._n_cols}) that is not "
                f"ignore_index={self._ignore_index}"
            )


def start_target_check(
    target: torch.Tensor, n_rows: int, n_cols: int, ignore_index: int, name: str = "target"
) -> PendingTargetCheck:
    """Shape/dtype checks for class-index targets (raised at once) and the value-range check,
    started on the device and returned unfinished: call ``.wait()`` to raise on a bad value.

    Skipped (a check that passes) while ``torch.compile`` traces, a CUDA graph is being
    captured (a host sync would break either) or the target is a meta tensor.
    """
    check_tensor(target, name)
    if target.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{name} must hold class indices as int64 (or int32), got dtype {target.dtype}")
    if target.dim() != 1:
        raise ValueError(f"{name} must be 1-D (N,), got shape {tuple(target.shape)}")
    if target.shape[0] != n_rows:
        raise ValueError(f"{name} has {target.shape[0]} entries but the input has {n_rows} rows")
    if torch.compiler.is_compiling() or n_rows == 0 or target.device.type == "meta":
        return PendingTargetCheck(None)
    if target.is_cuda and torch.cuda.is_current_stream_capturing():
        return PendingTargetCheck(None)
    return PendingTargetCheck(target, n_cols, ignore_index, name)
