"""Attention over a sequence split across the context-parallel ranks, by intercepting the block's
own ``F.scaled_dot_product_attention`` calls (transformers' sdpa, litgpt, nanoGPT, torchtitan).

Each rank keeps its queries and all-gathers the keys and values of the layer (the Llama 3 paper's
choice over ring passing): one collective per layer, exact for any mask the model passes to its
blocks (document masks included) and any SDPA backend, GQA included (only the KV heads travel).
Under causal attention each of the rank's two chunks attends to the keys up to its own end, a
lower-right causal mask, so every rank does the same work.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from lightning_ptdp.context_parallel.layout import CPGroup, gather_keys_values

_MATMULS = {torch.matmul, torch.bmm, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.bmm, torch.einsum}
_FIX = (
    "set attn_implementation='sdpa' (transformers) or call F.scaled_dot_product_attention, or context_parallel_size=1"
)


def _sdpa_args(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    return query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa


def _user_line() -> str:
    """The first frame outside torch and this package: the model's own source line."""
    for frame in inspect.stack()[2:]:
        name = frame.filename
        if "lightning_ptdp" not in name and "/torch/" not in name:
            return f"{name}:{frame.lineno} ({(frame.code_context or ['?'])[0].strip()})"
    return "?"


class ContextAttention(TorchFunctionMode):
    """Active inside one block's forward while the block holds ``local`` of ``length`` tokens."""

    def __init__(self, cp: CPGroup, block: str, local: int, length: int) -> None:
        super().__init__()
        self.cp, self.block, self.local, self.length = cp, block, local, length
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return self._attention(*args, **kwargs)
        out = func(*args, **kwargs)
        if func in _MATMULS and isinstance(out, torch.Tensor) and out.dim() >= 2:
            if out.shape[-2:] == (self.local, self.local) and not any(isinstance(a, torch.nn.Parameter) for a in args):
                raise ValueError(
                    f"context parallelism: {self.block} multiplies two [{self.local}, {self.local}] sequence-by-"
                    f"sequence operands at {_user_line()}, an attention written out by hand (eager attention); only "
                    f"scaled_dot_product_attention calls are split over the sequence so far. {_FIX}"
                )
        return out

    def _attention(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        q, k, v, mask, dropout_p, is_causal, scale, gqa = _sdpa_args(*args, **kwargs)
        local, length = self.local, self.length
        if q.size(-2) != local or k.size(-2) != local:  # not over this block's sequence (cross-attention)
            return F.scaled_dot_product_attention(*args, **kwargs)
        self.calls += 1
        k, v = gather_keys_values(k, k.dim() - 2, self.cp), gather_keys_values(v, v.dim() - 2, self.cp)
        common = dict(dropout_p=dropout_p, scale=scale, enable_gqa=gqa)
        if mask is not None:
            if mask.size(-1) != length or mask.size(-2) not in (1, local):
                raise ValueError(
                    f"context parallelism: the attention mask of {self.block} has shape {tuple(mask.shape)} at "
                    f"{_user_line()}; over {local} local queries and all {length} keys it must be [..., {local} or 1, "
                    f"{length}]. A mask the model passes to its blocks is cut for each rank; one built inside a block "
                    f"from the length it sees is not. {_FIX}"
                )
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **common)
        if not is_causal:
            return F.scaled_dot_product_attention(q, k, v, **common)
        chunk = local // 2
        outputs = []
        for j, g in enumerate(self.cp.chunks):  # each chunk: the keys up to its own end, lower-right causal
            end = (g + 1) * chunk
            allowed = torch.ones(chunk, end, dtype=torch.bool, device=q.device).tril(end - chunk)
            rows = q.narrow(-2, j * chunk, chunk)
            keys, values = k.narrow(-2, 0, end), v.narrow(-2, 0, end)
            outputs.append(F.scaled_dot_product_attention(rows, keys, values, attn_mask=allowed, **common))
        return torch.cat(outputs, dim=-2)
