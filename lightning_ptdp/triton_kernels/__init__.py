"""Triton kernels: fused flash attention and fused bias + GeLU.

Importing this package (or its public modules attention / bias_gelu / support / reference)
never imports triton: the kernel modules are loaded on the first kernel call, which raises
ImportError where triton is absent. Triton picks interpreted vs compiled execution at its own
first import, so for the CPU interpreter set TRITON_INTERPRET=1 before anything imports triton.
"""

from .attention import flash_attention
from .bias_gelu import bias_gelu
from .support import attention_supported, triton_available

__all__ = ["attention_supported", "bias_gelu", "flash_attention", "triton_available"]
