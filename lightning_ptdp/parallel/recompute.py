"""Activation recompute on the transformer blocks, found structurally like the TP plan.

"full":      each block keeps only its input; its forward runs again in backward
             (Korthikanti et al. 2022: 2*s*b*h bytes per layer in 16-bit, the paper's Eq. 3 FLOPs).
"selective": only the attention core (``F.scaled_dot_product_attention`` inside a block) is
             recomputed; the large s*s-sized softmax terms are never stored.
Applied after tensor parallelism, so a recomputed block replays its TP collectives too.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import checkpoint

from lightning_ptdp.core.blocks import find_block_lists


class _RecomputeAttention(TorchFunctionMode):
    """Inside a block's forward: run every SDPA call under checkpoint."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and torch.is_grad_enabled():
            return checkpoint(func, *args, use_reentrant=False, **kwargs)
        return func(*args, **kwargs)


def _full(block: nn.Module) -> None:
    forward = block.forward

    @functools.wraps(forward)
    def recomputed(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    block.forward = recomputed


def _selective(block: nn.Module) -> None:
    forward = block.forward

    @functools.wraps(forward)
    def attention_recomputed(*args: Any, **kwargs: Any) -> Any:
        with _RecomputeAttention():
            return forward(*args, **kwargs)

    block.forward = attention_recomputed


def apply_activation_checkpointing(model: nn.Module, mode: str) -> list[str]:
    """Wrap every transformer block of ``model`` for ``mode``; returns the wrapped block paths."""
    if mode not in ("full", "selective"):
        raise ValueError(f"activation_checkpointing={mode!r} is not one of 'full', 'selective'")
    block_lists = find_block_lists(model)
    if not block_lists:
        raise ValueError(
            f"activation_checkpointing={mode!r} found no transformer blocks in {type(model).__name__} (a ModuleList, "
            "Sequential or ModuleDict of blocks holding Linears); use activation_checkpointing=None"
        )
    wrap = _full if mode == "full" else _selective
    wrapped = []
    for path, blocks in block_lists:
        container = model.get_submodule(path)
        for (key, _), block in zip(container.named_children(), blocks):
            wrap(block)
            wrapped.append(f"{path}.{key}" if path else key)
    return wrapped


class SavedActivations:
    """Bytes of tensors autograd saves for backward while active (parameters excluded)."""

    def __init__(self, model: nn.Module) -> None:
        self._params = {p.data_ptr() for p in model.parameters()}
        self._seen: set[tuple[int, int]] = set()
        self.bytes = 0
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda x: x)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        key = (tensor.data_ptr(), tensor.numel())
        if tensor.data_ptr() not in self._params and key not in self._seen:
            self._seen.add(key)  # one storage saved by several ops counts once
            self.bytes += tensor.numel() * tensor.element_size()
        return tensor

    def __enter__(self) -> "SavedActivations":
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._ctx.__exit__(*exc)
