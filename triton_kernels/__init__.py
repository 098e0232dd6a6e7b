"""Triton kernels: fused flash attention and fused bias + GeLU.

``import triton_kernels`` never imports triton itself: ``flash_attention`` and ``bias_gelu``
are loaded on first access, so the package stays importable where triton is absent (the
access then raises ImportError). Under the CPU interpreter, set TRITON_INTERPRET=1 before
that first access: triton decides interpreted-vs-compiled when the kernels are defined.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .support import attention_supported, triton_available

if TYPE_CHECKING:
    from .attention import flash_attention
    from .bias_gelu import bias_gelu

__all__ = ["attention_supported", "bias_gelu", "flash_attention", "triton_available"]

_LAZY = {"flash_attention": ".attention", "bias_gelu": ".bias_gelu"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
