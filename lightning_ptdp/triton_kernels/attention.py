"""Fused flash attention (forward + backward) with the F.scaled_dot_product_attention layout.

The kernels live in attention_fwd.py and attention_bwd.py and are imported on first use, so
this module (the custom ops, their autograd and the public entry point) imports without triton.
"""

from __future__ import annotations

import math

import torch

from .support import attention_supported


# Custom ops (torch.library): eager runs them as launched; torch.compile sees one opaque op per
# direction, traced by its fake (shape-only) implementation, so a compiled graph keeps the kernel.
@torch.library.custom_op("lightning_ptdp::flash_attention_forward", mutates_args=())
def _forward_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """O = softmax(scale * Q K^T [+ causal mask]) V, and the row log-sum-exp (base 2, fp32)."""
    from .attention_fwd import attention_forward

    return attention_forward(q, k, v, causal, scale)


@_forward_op.register_fake
def _(q, k, v, causal, scale):
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("lightning_ptdp::flash_attention_backward", mutates_args=())
def _backward_op(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from .attention_bwd import attention_backward

    return attention_backward(grad_out, q, k, v, out, lse, causal, scale)


@_backward_op.register_fake
def _(grad_out, q, k, v, out, lse, causal, scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _save(ctx, inputs, output) -> None:
    q, k, v, ctx.causal, ctx.scale = inputs
    ctx.save_for_backward(q, k, v, *output)


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = _backward_op(grad_out, q, k, v, out, lse, ctx.causal, ctx.scale)
    return dq, dk, dv, None, None


_forward_op.register_autograd(_backward, setup_context=_save)


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
    return _forward_op(q, k, v, bool(causal), float(scale))[0]
