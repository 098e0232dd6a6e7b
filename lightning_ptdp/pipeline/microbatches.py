"""A Lightning batch as pipeline microbatches, and their results back as one batch's."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten


def split_microbatches(batch: Any, micro_batch_size: Optional[int], *, strict: bool = True) -> tuple[list[Any], int]:
    """Cut every tensor in ``batch`` along dim 0 into microbatches of ``micro_batch_size`` rows
    (other leaves are shared). Returns (microbatches, rows per microbatch). Not ``strict``
    (evaluation): a batch that ``micro_batch_size`` does not divide is one microbatch."""
    leaves, spec = tree_flatten(batch)
    tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor) and leaf.dim() > 0]
    if not tensors:
        raise ValueError("pipeline parallelism splits the batch into microbatches along dim 0, but it holds no tensors")
    rows = tensors[0].shape[0]
    if any(t.shape[0] != rows for t in tensors):
        shapes = [tuple(t.shape) for t in tensors]
        raise ValueError(
            f"the batch's tensors {shapes} disagree on dim 0; pipeline microbatches split every tensor there"
        )
    size = micro_batch_size or rows
    if rows % size and not strict:
        size = rows
    if rows % size:
        fits = [k for k in range(1, rows + 1) if rows % k == 0]
        raise ValueError(
            f"micro_batch_size={size} does not divide the per-replica batch of {rows} samples; choose one of "
            f"{fits}, or a batch size that is a multiple of {size} (DataLoader(drop_last=True) for a short last batch)"
        )
    count = rows // size
    pieces = [
        leaf.split(size) if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 else [leaf] * count for leaf in leaves
    ]
    return [tree_unflatten([p[i] for p in pieces], spec) for i in range(count)], size


def loss_of(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict) and isinstance(output.get("loss"), torch.Tensor):
        return output["loss"]
    raise ValueError(
        f"under pipeline parallelism training_step must return the loss tensor or a dict with 'loss'; it returned "
        f"{type(output).__name__} (skipping a step by returning None is not supported: every stage has started it)"
    )


def merge_outputs(outputs: list[Any]) -> Any:
    """Microbatch outputs back into one batch: tensors concatenated along dim 0, else a list."""
    if outputs and all(isinstance(o, torch.Tensor) and o.dim() > 0 for o in outputs):
        return torch.cat(outputs)
    return outputs


def check_fixed_shapes(microbatch: Any, first: Optional[list[tuple]]) -> list[tuple]:
    """The per-sample shapes of ``microbatch``'s tensors, refused when they differ from the first
    batch's (``first``; None on the first batch): stages exchange fixed-shape activations."""
    shapes = [tuple(t.shape[1:]) for t in tree_flatten(microbatch)[0] if isinstance(t, torch.Tensor) and t.dim() > 0]
    if first is not None and shapes != first:
        raise ValueError(
            f"pipeline stages exchange fixed-shape activations, but this batch's tensors have per-sample shapes "
            f"{shapes} where the first batch had {first}; pad or crop to a fixed sequence length"
        )
    return shapes
