"""Functional forms of the chunked losses: each is its autograd Function's ``apply`` (positional arguments)."""

# RL (policy gradient) and distillation
from liger_kernel.chunked_loss.cosine_similarity_loss import LigerFusedLinearCosineSimilarityFunction
from liger_kernel.chunked_loss.grpo_loss import LigerFusedLinearGRPOFunction
from liger_kernel.chunked_loss.jsd_loss import LigerFusedLinearJSDFunction

liger_fused_linear_grpo = LigerFusedLinearGRPOFunction.apply
liger_fused_linear_jsd = LigerFusedLinearJSDFunction.apply
liger_fused_linear_cosine = LigerFusedLinearCosineSimilarityFunction.apply
