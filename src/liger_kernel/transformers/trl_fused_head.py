"""TRL's fused LM head (TRL >= 1.13) computed by liger_kernel's chunked head engine.

TRL 1.13 and later compute per-token log-probabilities in their trainers (GRPO, RLOO, DPO, KTO,
SFT's fused head, the experimental async GRPO) without the logits: ``add_fused_lm_head(model,
temperature, cast_lm_head_to_fp32, outputs)`` (``trl/trainer/utils.py``) makes
``model(..., labels, fused_lm_head=True)`` call ``_ChunkedLogProbFunction.apply(hidden (N, H),
weight (V, H), bias, targets (N,), temperature, chunk_size, final_logit_softcapping,
logit_scale, outputs)``, the module-level name under which ``trl.trainer.utils`` imports
``trl.kernels.ChunkedLogProbFunction``. :func:`use_liger_fused_head` points that name at
:class:`LigerChunkedLogProbFunction` (same call shape, same return tuple), so every fused-head
forward, whichever trainer runs it, goes through
:func:`~liger_kernel.ops.fused_linear_logprobs.fused_linear_token_statistics`::

    from liger_kernel.transformers.trl_fused_head import use_liger_fused_head

    with use_liger_fused_head():          # or: handle = use_liger_fused_head(); ...; handle.undo()
        trainer = GRPOTrainer(...)
        trainer.train()

The name is looked up at each forward, so installing before or after the trainer is built both
work, and undoing restores TRL's own function. The same goes for the distillation trainer's
``ChunkedDivergenceFunction`` (``trl.trainer.distillation_trainer``), replaced by
:class:`LigerChunkedDivergenceFunction` (per-token divergence and student entropy,
:mod:`liger_kernel.ops.fused_linear_token_divergence`).

The semantics are TRL's: at ``s = softcap(z * logit_scale) / temperature`` of the logits
``z = hidden W^T + b`` (``softcap(u) = c tanh(u / c)``, ``c = final_logit_softcapping``),
``p = softmax(s)``, the tuple ``(logprobs, entropy, log_sum_sq_probs, mean_logits, is_top1)``
holds ``log p_y``, ``-sum p log p``, ``log sum p^2``, ``sum_v s_v / V`` and "y is the first
argmax of s" (bool), float32, each optional one None unless named in ``outputs``; the first two
are differentiable in hidden, weight and bias, the others are not. Under ``torch.autocast`` the
head runs in the autocast dtype, otherwise in ``hidden``'s dtype (``weight`` and ``bias`` are cast
to it, as TRL does; gradients come back in each tensor's own dtype); dW accumulates in float32.

Where it differs from TRL's function:

* ``chunk_size`` (TRL's vocabulary tile width) is checked and not used: the engine sizes its
  row chunks from its memory budget (:class:`~liger_kernel.ops.chunked_head.ChunkedHeadConfig`)
  and takes the whole vocabulary per chunk.
* ``sampling_mask`` (a keyword newer TRL releases may pass) is accepted only as None; anything
  else raises ``NotImplementedError``.
* A target of -100 gives 0 (False) in every output, and any other target outside [0, V) raises
  ``ValueError``; TRL never passes either (it scores only labelled positions, or clamps them).
* ``outputs`` may name ``"log_probs"`` (always computed, as in TRL) and the four statistics; an
  unknown name raises ``ValueError`` (TRL ignores it).
* Under DeepSpeed ZeRO-3 the backward gathers the head again with TRL's own
  ``maybe_gather_lm_head_ctx`` (read from ``trl.trainer.utils`` when it is loaded); this path is
  not tested here (no DeepSpeed).
"""

from __future__ import annotations

import functools
import importlib
import sys
from contextlib import nullcontext
from types import ModuleType
from typing import Any

import torch

from liger_kernel.ops.fused_linear_logprobs import (
    TOKEN_STATISTICS,
    LigerFusedLinearTokenStatisticsFunction,
    check_token_statistics,
)
from liger_kernel.ops.fused_linear_token_divergence import LigerFusedLinearTokenDivergenceFunction

# TRL's name for the log-probabilities among ``outputs`` (always computed).
LOG_PROBS = "log_probs"
# A target TRL's callers use for "not scored"; never passed by ``add_fused_lm_head``.
IGNORE_INDEX = -100


def _gather_head_context(*params: torch.Tensor | None):
    """TRL's ZeRO-3 gather of the heads for a recomputing backward, or a null context where TRL's
    trainer utilities are not loaded."""
    trl_utils = sys.modules.get("trl.trainer.utils")
    gather = getattr(trl_utils, "maybe_gather_lm_head_ctx", None)
    return functools.partial(gather, *params) if gather is not None else nullcontext


def _compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    """TRL's: the autocast dtype where autocast is on for the device, else the hidden states'."""
    device_type = hidden.device.type
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else hidden.dtype


def _cast(dtype: torch.dtype, *tensors: torch.Tensor | None) -> tuple:
    return tuple(t.to(dtype) if t is not None else None for t in tensors)


def _import_or_none(module_name: str):
    try:
        return importlib.import_module(module_name)
    except ImportError:
        return None


class LigerChunkedLogProbFunction:
    """TRL 1.16's ``ChunkedLogProbFunction`` call shape over liger_kernel's head engine.

    ``apply(hidden (N, H), weight (V, H), bias (V,) or None, targets (N,), temperature,
    chunk_size, final_logit_softcapping=None, logit_scale=1.0, outputs=(all four),
    sampling_mask=None)`` -> ``(logprobs, entropy, log_sum_sq_probs, mean_logits, is_top1)``,
    each (N,); see the module docstring for the math and the differences from TRL.
    """

    @staticmethod
    def apply(hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping=None,
              logit_scale=1.0, outputs=TOKEN_STATISTICS, sampling_mask=None):
        if sampling_mask is not None:
            raise NotImplementedError("sampling_mask is not supported by liger_kernel's fused head; undo "
                                      "use_liger_fused_head() to run TRL's own function for this call")
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
        if hidden.dim() != 2 or targets.dim() != 1:
            raise ValueError(f"hidden must be 2-D (N, H) and targets 1-D (N,), got shapes {tuple(hidden.shape)} "
                             f"and {tuple(targets.shape)}")
        if isinstance(outputs, str):
            raise TypeError(f"outputs must be a tuple of names, got {outputs!r}")
        statistics = check_token_statistics(tuple(name for name in outputs if name != LOG_PROBS))
        head_context = _gather_head_context(weight, bias)
        hidden, weight, bias = _cast(_compute_dtype(hidden), hidden, weight, bias)
        return LigerFusedLinearTokenStatisticsFunction.apply(
            hidden, weight, bias, targets, temperature, final_logit_softcapping, logit_scale, statistics,
            IGNORE_INDEX, True, head_context)


class LigerChunkedDivergenceFunction:
    """TRL 1.16's ``ChunkedDivergenceFunction`` call shape over liger_kernel's head engine.

    ``apply(student_hidden (N, H_s), student_weight (V, H_s), student_bias, teacher_hidden (N, H_t),
    teacher_weight (V, H_t), teacher_bias, beta, temperature=1.0, student_logit_scale=1.0,
    student_final_logit_softcapping=None, teacher_logit_scale=1.0,
    teacher_final_logit_softcapping=None)`` -> ``(divergence, entropy)``, each (N,) float32:
    beta 0 the forward KL(teacher || student), 1 the reverse KL, between the generalised JSD with
    the mixture ``(1 - beta) P + beta Q``; the student's entropy (no gradient); the gradient flows
    to the student only (:mod:`liger_kernel.ops.fused_linear_token_divergence`). Each head runs
    in the autocast dtype where autocast is on, else in its hidden states' dtype, as TRL's.
    Deviation: TRL projects both heads with float32 output; here the logits are rounded to the
    GEMM's dtype (as the model's ``lm_head`` would), which differs for bf16 heads.
    """

    @staticmethod
    def apply(student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias, beta,
              temperature=1.0, student_logit_scale=1.0, student_final_logit_softcapping=None, teacher_logit_scale=1.0,
              teacher_final_logit_softcapping=None):
        head_context = _gather_head_context(student_weight, student_bias, teacher_weight, teacher_bias)
        student = _cast(_compute_dtype(student_hidden), student_hidden, student_weight, student_bias)
        teacher = _cast(_compute_dtype(teacher_hidden), teacher_hidden, teacher_weight, teacher_bias)
        return LigerFusedLinearTokenDivergenceFunction.apply(
            *student, *teacher, beta, temperature, student_logit_scale, student_final_logit_softcapping,
            teacher_logit_scale, teacher_final_logit_softcapping, head_context)


# Where TRL's trainers look the functions up at each call: (module, name, TRL's own function's
# module and name, ours).
TRL_FUSED_HEAD_NAMES = (
    ("trl.trainer.utils", "_ChunkedLogProbFunction", "trl.kernels.chunked_logprob", "ChunkedLogProbFunction",
     LigerChunkedLogProbFunction),
    ("trl.trainer.distillation_trainer", "ChunkedDivergenceFunction", "trl.kernels.chunked_divergence",
     "ChunkedDivergenceFunction", LigerChunkedDivergenceFunction),
)


class LigerFusedHeadInstallation:
    """What :func:`use_liger_fused_head` replaced; :meth:`undo` (or leaving the ``with`` block)
    puts TRL's functions back."""

    def __init__(self, replaced: list[tuple[ModuleType, str, Any, Any]]):
        self._replaced = replaced

    @property
    def active(self) -> bool:
        return bool(self._replaced)

    @property
    def names(self) -> list[str]:
        """The ``module.name`` entries now pointing at liger_kernel's functions."""
        return [f"{module.__name__}.{name}" for module, name, _, _ in self._replaced]

    def undo(self) -> None:
        """Restore what was there before; a no-op when already undone. Raises ``RuntimeError``
        when the name was replaced again since (undo the later installation first)."""
        for module, name, _, ours in self._replaced:
            if getattr(module, name) is not ours:
                raise RuntimeError(f"{module.__name__}.{name} was replaced again after use_liger_fused_head(); "
                                   "undo that replacement first")
        for module, name, previous, _ in reversed(self._replaced):
            setattr(module, name, previous)
        self._replaced = []

    def __enter__(self) -> LigerFusedHeadInstallation:
        return self

    def __exit__(self, *exc_info) -> None:
        self.undo()


def use_liger_fused_head() -> LigerFusedHeadInstallation:
    """Make TRL's fused LM head (``add_fused_lm_head``) compute with liger_kernel's engine.

    Replaces the module-level names TRL's trainers call (:data:`TRL_FUSED_HEAD_NAMES`) with
    :class:`LigerChunkedLogProbFunction` and, where the distillation trainer imports,
    :class:`LigerChunkedDivergenceFunction`; returns a handle that undoes it (also a context
    manager; ``handle.names`` lists what was replaced). Raises ``ImportError`` without TRL and ``RuntimeError`` with a TRL that has no
    fused head (before 1.13: there ``use_liger_kernel=True`` reaches liger_kernel's chunked
    losses instead).
    """
    try:
        trl = importlib.import_module("trl")
    except ImportError as error:
        raise ImportError("use_liger_fused_head() needs TRL >= 1.13 (pip install 'trl>=1.13')") from error
    if getattr(_import_or_none("trl.kernels.chunked_logprob"), "ChunkedLogProbFunction", None) is None:
        # TRL 1.12's trainer utilities hold a `_ChunkedLogProbFunction` of another call shape (no
        # bias, two outputs): the kernels module is what marks the fused head of 1.13 and later.
        raise RuntimeError(
            f"TRL {getattr(trl, '__version__', '?')} has no fused LM head (trl.kernels.ChunkedLogProbFunction "
            "came with TRL 1.13). With an older TRL, liger_kernel is reached through use_liger_kernel=True and "
            "its chunked losses instead")
    replaced: list[tuple[ModuleType, str, Any, Any]] = []
    for module_name, name, trl_module_name, trl_name, ours in TRL_FUSED_HEAD_NAMES:
        trl_function = getattr(_import_or_none(trl_module_name), trl_name, None)
        # The distillation trainer is replaced where this TRL has it and it imports (its own
        # optional dependencies may be missing); `names` on the handle says what was replaced.
        module = importlib.import_module(module_name) if module_name == "trl.trainer.utils" \
            else _import_or_none(module_name)
        if module is None or trl_function is None:
            continue
        current = getattr(module, name, None)
        if current is not trl_function and current is not ours:
            raise RuntimeError(f"{module_name}.{name} is {current!r}, neither TRL's {trl_name} nor liger_kernel's; "
                               "this TRL is not one use_liger_fused_head() knows")
        replaced.append((module, name, current, ours))
    for module, name, _, ours in replaced:
        setattr(module, name, ours)
    return LigerFusedHeadInstallation(replaced)
