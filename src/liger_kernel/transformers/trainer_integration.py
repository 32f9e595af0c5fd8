"""Entry points used by ``transformers.Trainer`` (``TrainingArguments(use_liger_kernel=True)``).

``Trainer.train()`` calls ``transformers.integrations.liger.apply_liger_kernel``, which imports
``_apply_liger_kernel_to_instance`` from :mod:`liger_kernel.transformers`, unwraps a PEFT model
to its base ``PreTrainedModel`` and calls ``_apply_liger_kernel_to_instance(model=base,
**liger_kernel_config)``. The options of ``liger_kernel_config`` are those of the family's
``apply_liger_kernel_to_<model_type>``; options it does not take are dropped with a warning.

In evaluation with ``prediction_loss_only`` the Trainer passes ``skip_logits=True`` to the
model's forward, which the patched forward (:mod:`liger_kernel.transformers.causal_lm`) takes.
"""

from liger_kernel.transformers.monkey_patch import (
    MODEL_TYPE_TO_APPLY_LIGER_FN,
    _apply_liger_kernel,
    _apply_liger_kernel_to_instance,
)

__all__ = ["MODEL_TYPE_TO_APPLY_LIGER_FN", "_apply_liger_kernel", "_apply_liger_kernel_to_instance"]
