"""liger_kernel: exact, fast, memory-lean Triton kernels for LLM training."""

__version__ = "0.9.0"
