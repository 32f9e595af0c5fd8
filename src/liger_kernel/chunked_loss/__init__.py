"""Post-training losses fused with the model's linear head, so the (tokens x vocabulary) logits
never exist at once: preference optimisation (DPO and TRL's loss types, ORPO, SimPO, CPO, KTO),
RL policy gradients (GRPO and its variants) and distillation (JSD, cosine similarity).
All run on one chunked engine, :mod:`liger_kernel.ops.chunked_head`."""

from liger_kernel.chunked_loss.cosine_similarity_loss import (
    LigerFusedLinearCosineSimilarityFunction,
    LigerFusedLinearCosineSimilarityLoss,
)
from liger_kernel.chunked_loss.cpo_loss import LigerFusedLinearCPOFunction, LigerFusedLinearCPOLoss
from liger_kernel.chunked_loss.dpo_loss import LigerFusedLinearDPOFunction, LigerFusedLinearDPOLoss
from liger_kernel.chunked_loss.functional import (
    liger_fused_linear_cosine,
    liger_fused_linear_cpo,
    liger_fused_linear_dpo,
    liger_fused_linear_grpo,
    liger_fused_linear_jsd,
    liger_fused_linear_kto,
    liger_fused_linear_orpo,
    liger_fused_linear_simpo,
)
from liger_kernel.chunked_loss.fused_linear_distillation import LigerFusedLinearDistillationBase
from liger_kernel.chunked_loss.fused_linear_ppo import LigerFusedLinearPPOBase
from liger_kernel.chunked_loss.fused_linear_preference import LigerFusedLinearPreferenceBase
from liger_kernel.chunked_loss.fused_linear_unpaired_preference import LigerFusedLinearUnpairedPreferenceBase
from liger_kernel.chunked_loss.grpo_loss import LigerFusedLinearGRPOFunction, LigerFusedLinearGRPOLoss
from liger_kernel.chunked_loss.jsd_loss import LigerFusedLinearJSDFunction, LigerFusedLinearJSDLoss
from liger_kernel.chunked_loss.kto_loss import LigerFusedLinearKTOFunction, LigerFusedLinearKTOLoss
from liger_kernel.chunked_loss.orpo_loss import LigerFusedLinearORPOFunction, LigerFusedLinearORPOLoss
from liger_kernel.chunked_loss.simpo_loss import LigerFusedLinearSimPOFunction, LigerFusedLinearSimPOLoss

__all__ = [
    "LigerFusedLinearPreferenceBase",
    "LigerFusedLinearUnpairedPreferenceBase",
    "LigerFusedLinearPPOBase",
    "LigerFusedLinearDistillationBase",
    "LigerFusedLinearDPOFunction",
    "LigerFusedLinearDPOLoss",
    "LigerFusedLinearORPOFunction",
    "LigerFusedLinearORPOLoss",
    "LigerFusedLinearSimPOFunction",
    "LigerFusedLinearSimPOLoss",
    "LigerFusedLinearCPOFunction",
    "LigerFusedLinearCPOLoss",
    "LigerFusedLinearKTOFunction",
    "LigerFusedLinearKTOLoss",
    "LigerFusedLinearGRPOFunction",
    "LigerFusedLinearGRPOLoss",
    "LigerFusedLinearJSDFunction",
    "LigerFusedLinearJSDLoss",
    "LigerFusedLinearCosineSimilarityFunction",
    "LigerFusedLinearCosineSimilarityLoss",
    "liger_fused_linear_dpo",
    "liger_fused_linear_orpo",
    "liger_fused_linear_simpo",
    "liger_fused_linear_cpo",
    "liger_fused_linear_kto",
    "liger_fused_linear_grpo",
    "liger_fused_linear_jsd",
    "liger_fused_linear_cosine",
]
