"""Plain-torch references the kernel tests compare against (small shapes only: the attention
reference materialises the full score matrix)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False, scale: float | None = None
) -> torch.Tensor:
    """softmax(scale * q k^T, causal top-left) v, with k/v heads repeated for grouped-query attention."""
    heads, kv_heads = q.shape[1], k.shape[1]
    if kv_heads != heads:
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q @ k.transpose(-2, -1)) * scale  # (B, H, Lq, Lk)
    if causal:
        q_len, kv_len = scores.shape[-2:]
        hidden = torch.ones(q_len, kv_len, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(hidden, float("-inf"))
    return scores.softmax(dim=-1) @ v


def bias_gelu_reference(x: torch.Tensor, bias: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """gelu(x + bias) in torch."""
    return F.gelu(x + bias, approximate=approximate)
