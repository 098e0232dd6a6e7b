"""Context parallelism on the found blocks: the sequence is cut where it enters each block.

Before each block, every input with the sequence's length (the residual stream, and what the
model computed before its blocks: learned positions already added, rotary tables, position ids,
mask rows) is cut to this rank's two chunks, so positions stay global with no change to the
model; attention runs under ``ContextAttention``; the last block's output leaves cut (tail.py):
the final norm, the head and ``F.cross_entropy`` run on this rank's tokens, and anything else
sees the whole sequence, exactly as in one process.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from lightning_ptdp.context_parallel.attention import ChunkMasks, ContextAttention
from lightning_ptdp.context_parallel.layout import CPGroup, check_sequence_length, gather_sequence, own_chunks
from lightning_ptdp.context_parallel.tail import SequenceShard


def apply_context_parallel(
    model: nn.Module, cp: CPGroup, sequence_parallel: int = 1, cut_tail: bool = True
) -> list[str]:
    """Cut the sequence into ``model``'s found blocks for ``cp``; returns the block paths.
    ``sequence_parallel``: t under SP (a block's residual stream then holds 1/(c*t) of the sequence).
    ``cut_tail=False`` (under TP, whose vocabulary-parallel head splits the logits by t): the last
    block's output is gathered whole instead of leaving as a ``SequenceShard``.

    Hooks, so they nest outside SP's (cut before SP scatters, gather after SP gathers) and a
    recompute replays only the forward; the forward itself runs under ``ContextAttention``."""
    from lightning_ptdp.core.blocks import find_block_lists

    found = find_block_lists(model)
    if len(found) != 1:
        what = "no transformer blocks" if not found else f"{len(found)} block lists ({', '.join(p for p, _ in found)})"
        raise ValueError(
            f"context_parallel_size={cp.size} found {what} in {type(model).__name__}; context parallelism cuts the "
            "sequence where it enters one stack of blocks (a ModuleList, Sequential or ModuleDict of "
            "modules holding Linears) and makes it whole after the last. Use context_parallel_size=1"
        )
    path, blocks = found[0]
    container = model.get_submodule(path)
    names = [f"{path}.{key}" if path else key for key, _ in container.named_children()]
    shrink = cp.size * sequence_parallel  # whole sequence / a block's residual stream
    masks = ChunkMasks()  # one set for all blocks
    cuts = WeakIdKeyDictionary()  # an input each block takes (rotary tables, a mask) cut once per forward
    for index, (name, block) in enumerate(zip(names, blocks)):
        if "_ptdp_cp_forward" in block.__dict__:
            continue
        block.__dict__["_ptdp_cp_forward"] = block.forward
        block.forward = _attention_split(block, name, cp, shrink, masks)
        hook = _cut_inputs(name, cp, index == 0, shrink, cuts)
        block.register_forward_pre_hook(hook, with_kwargs=True, prepend=True)
        if index == len(blocks) - 1:
            block.register_forward_hook(_leave_blocks(name, cp, cut_tail))
    return names


def _cut_inputs(name: str, cp: CPGroup, first: bool, shrink: int, cuts: WeakIdKeyDictionary) -> Any:
    """Every input with the sequence's length cut to this rank's chunks; the first block's
    residual stream too (later blocks receive it cut). ``cuts``: the cut of each input tensor
    autograd does not track, kept while that tensor lives: the blocks share one copy of what they
    all take (rotary tables, a mask's rows) instead of each making its own."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        hidden = _residual(args, name)
        length = hidden.size(1) * (1 if first else shrink)
        if first:
            check_sequence_length(length, cp)
        rest = (_cut(a, length, cp, name, f"argument {i}", cuts) for i, a in enumerate(args[1:], 1))
        kwargs = {k: _cut(v, length, cp, name, f"argument {k!r}", cuts) for k, v in kwargs.items()}
        return (own_chunks(hidden, 1, cp) if first else hidden, *rest), kwargs

    return hook


def _attention_split(block: nn.Module, name: str, cp: CPGroup, shrink: int, masks: ChunkMasks) -> Any:
    forward = block.forward

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        length = _residual(args, name).size(1) * shrink
        buffers = list(block.buffers())
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]  # a mask among them
        attention = ContextAttention(cp, name, length // cp.size, length, buffers, masks, inputs)
        with attention:
            out = forward(*args, **kwargs)
        if attention.calls == 0:
            raise ValueError(
                f"context parallelism found no attention in {name}: no scaled_dot_product_attention call over the "
                "block's sequence. Context parallelism splits the attention calls it finds; use "
                "context_parallel_size=1 for this model"
            )
        return out

    return run


def _residual(args: tuple, name: str) -> torch.Tensor:
    hidden = args[0] if args else None
    if not isinstance(hidden, torch.Tensor) or hidden.dim() < 2:
        raise ValueError(
            f"context parallelism: {name} was called without the residual stream as its first argument "
            f"(got {type(hidden).__name__}); the blocks must take a batch-first [batch, sequence, ...] tensor first"
        )
    return hidden


def _cut(value: Any, length: int, cp: CPGroup, block: str, what: str, cuts: WeakIdKeyDictionary) -> Any:
    """This rank's chunks of every tensor in ``value`` with a dim of the sequence's length: that dim,
    or the rows of a square [..., length, length] mask."""
    if isinstance(value, torch.Tensor):
        done = cuts.get(value)
        if done is not None and done[0] == length:
            return done[1]
        dims = [d for d in range(value.dim()) if value.size(d) == length]
        if not dims or _per_key(value, length):
            return value
        if len(dims) == 1 or dims[-2:] == [value.dim() - 2, value.dim() - 1]:
            cut = own_chunks(value, dims[0] if len(dims) == 1 else value.dim() - 2, cp)
            if not value.requires_grad:  # constants of the forward; what autograd tracks is cut in each block
                cuts[value] = (length, cut)
            return cut
        raise ValueError(
            f"context parallelism: {what} of {block} has shape {tuple(value.shape)}, with dims {dims} all of the "
            f"sequence's length {length}, so which one is the sequence is ambiguous; use another sequence length"
        )
    if isinstance(value, (tuple, list)):
        items = [_cut(v, length, cp, block, what, cuts) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, dict):  # e.g. rotary tables per attention kind
        return {key: _cut(v, length, cp, block, what, cuts) for key, v in value.items()}
    return value


def _per_key(value: torch.Tensor, length: int) -> bool:
    """A row over the keys broadcast over the queries, ``[..., 1, length]`` (a key-padding mask, an
    ALiBi bias per key): every rank's queries read all of it, so it stays whole."""
    return value.dim() >= 3 and value.size(-1) == length and value.size(-2) == 1


def _leave_blocks(block: str, cp: CPGroup, cut_tail: bool) -> Any:
    """The last block's output stays cut, as a ``SequenceShard``: the head and the loss run on this
    rank's tokens, and whatever needs the whole sequence gathers it (tail.py); or leaves whole."""

    def leave(x: torch.Tensor) -> torch.Tensor:
        return SequenceShard.wrap(x, cp, x.size(0)) if cut_tail else gather_sequence(x, 1, cp)

    def hook(module: nn.Module, args: tuple, out: Any) -> Any:
        if isinstance(out, torch.Tensor):
            return leave(out)
        if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
            return type(out)([leave(out[0]), *out[1:]])
        raise ValueError(
            f"context parallelism: the last block {block} returned {type(out).__name__}; it must return the "
            "residual stream (a tensor, or a tuple whose first item is it) for the sequence to leave the blocks"
        )

    return hook
