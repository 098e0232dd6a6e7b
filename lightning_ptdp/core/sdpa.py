"""``F.scaled_dot_product_attention``'s arguments by name, as an intercepted call gives them
positionally or by keyword (the kernel router and context parallelism read them)."""

from __future__ import annotations


def sdpa_args(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)."""
    return query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa
