"""Post-training losses of a linear head's hidden states, computed without materialising the logits.

Every loss here runs on the chunked head engine (:mod:`liger_kernel.ops.chunked_head`).
"""

# RL (policy gradient) and distillation
from liger_kernel.chunked_loss.cosine_similarity_loss import LigerFusedLinearCosineSimilarityLoss  # noqa: F401
from liger_kernel.chunked_loss.fused_linear_distillation import LigerFusedLinearDistillationBase  # noqa: F401
from liger_kernel.chunked_loss.fused_linear_ppo import LigerFusedLinearPPOBase  # noqa: F401
from liger_kernel.chunked_loss.grpo_loss import LigerFusedLinearGRPOLoss  # noqa: F401
from liger_kernel.chunked_loss.jsd_loss import LigerFusedLinearJSDLoss  # noqa: F401
