"""The reduction of the cross-entropy losses' per-row values (plain and fused with the LM
head): the mean's denominators, computed on the device, and the rows reduced."""

from __future__ import annotations

import torch


def mean_denominators(
    target: torch.Tensor, class_weight: torch.Tensor | None, ignore_index: int, n_cols: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Device scalars ``(D_ce, D_z, n_counted)`` for the mean, computed without a host sync.

    ``D_ce`` is the sum of the class weights of the counted targets (their count without
    weights), ``D_z`` the count. Both are set to 1 when nothing is counted, so an all-ignored
    batch gives loss 0 rather than 0/0.
    """
    counted = target != ignore_index
    n_counted = counted.sum(dtype=torch.float32)
    nothing_counted = n_counted == 0
    z_denominator = torch.where(nothing_counted, 1.0, n_counted)
    if class_weight is None:
        ce_denominator = z_denominator
    else:
        # Clamping keeps the gather in bounds for bad targets; those rows are masked out
        # here, and the host check (or the kernel's NaN) reports them.
        safe_target = target.clamp(0, n_cols - 1).long()
        target_weights = class_weight.float().gather(0, safe_target) * counted
        ce_denominator = torch.where(nothing_counted, 1.0, target_weights.sum())
    return ce_denominator.reshape(1), z_denominator.reshape(1), n_counted


def reduce_rows(loss_rows: torch.Tensor, z_rows: torch.Tensor, correct_rows: torch.Tensor,
                n_counted: torch.Tensor, reduction: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row (loss, z-loss, correct) reduced: kept for ``"none"``, else summed (the mean's
    division already happened in the kernel) with the accuracy averaged over counted rows."""
    if reduction == "none":
        return loss_rows, z_rows, correct_rows
    return loss_rows.sum(), z_rows.sum(), correct_rows.sum() / n_counted.clamp_min(1.0)
