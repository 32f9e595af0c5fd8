"""Triton kernels and their autograd Functions. Imports torch and triton only."""

_EXPORTS = {
    "LigerRMSNormFunction": "rms_norm",
    "LigerLayerNormFunction": "layer_norm",
    "LigerRopeFunction": "rope",
    "LigerSiLUMulFunction": "swiglu",
    "LigerGELUMulFunction": "geglu",
    "LigerGatedDownProjFunction": "swiglu",
    "LigerCrossEntropyFunction": "cross_entropy",
    "LigerFusedLinearCrossEntropyFunction": "fused_linear_cross_entropy",
    "LigerJSDFunction": "jsd",
    "LigerKLDivLossFunction": "kl_div",
    "LigerTVDLossFunction": "tvd",
    "LigerSelectiveLogSoftmaxFunction": "grpo_loss",
    "GrpoLossFunction": "grpo_loss",
    "fused_selective_log_softmax": "grpo_loss",
    "LigerChunkedHeadFunction": "chunked_head",
    "LigerFusedLinearLogProbsFunction": "fused_linear_logprobs",
    "LigerFusedLinearScaledCrossEntropyFunction": "fused_linear_logprobs",
    "LigerFusedLinearTokenStatisticsFunction": "fused_linear_logprobs",
    "LigerFusedLinearTokenDivergenceFunction": "fused_linear_token_divergence",
}

__all__ = list(_EXPORTS)


def __getattr__(name):
    # Lazy so that importing liger_kernel.ops does not import triton until a kernel is used.
    if name in _EXPORTS:
        import importlib

        module = importlib.import_module(f"{__name__}.{_EXPORTS[name]}")
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
