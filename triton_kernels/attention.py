"""Fused flash attention (forward + backward) with the F.scaled_dot_product_attention layout.

The kernels live in attention_fwd.py and attention_bwd.py and are imported on first use, so
this module (the autograd wrapper and public entry point) imports without triton.
"""

from __future__ import annotations

import math

import torch
from torch.autograd.function import once_differentiable

from .support import attention_supported


class FlashAttentionFunction(torch.autograd.Function):
    """O = softmax(scale * Q K^T [+ causal mask]) V; saves Q, K, V, O and the row log-sum-exp."""

    @staticmethod
    def forward(ctx, q, k, v, causal: bool, scale: float):
        from .attention_fwd import attention_forward

        out, lse = attention_forward(q, k, v, causal, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal = causal
        ctx.scale = scale
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        from .attention_bwd import attention_backward

        dq, dk, dv = attention_backward(grad_out, q, k, v, out, lse, ctx.causal, ctx.scale)
        return dq, dk, dv, None, None


@torch.compiler.disable  # opaque to torch.compile: a graph break, the kernel runs as launched
def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention over (batch, heads, seq, head_dim) tensors, like
    ``F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)``.

    k and v may have fewer heads than q (grouped-query attention, q heads a multiple of kv
    heads); query head h reads key/value head h // (q_heads // kv_heads). The causal mask is
    aligned top-left (query i sees keys 0..i), as in SDPA, also when q and k lengths differ.
    Raises ValueError naming the reason when the inputs are outside what the kernel supports.
    """
    reason = attention_supported(q, k, v)
    if reason is not None:
        raise ValueError(f"flash_attention cannot run these inputs: {reason}")
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    return FlashAttentionFunction.apply(q, k, v, bool(causal), float(scale))
