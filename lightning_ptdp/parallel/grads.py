"""Gradient work a pipeline step leaves for the optimizer step: tied weights and data parallelism."""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn as nn

from lightning_ptdp.pipeline.split import PipelineSplit
from lightning_ptdp.tensor_parallel.consolidate import all_reduce_grads, flat_all_reduce, local_tensor


def _dp_shard_shape(shape: tuple[int, ...], dp_rank: int, dp_size: int) -> tuple[int, ...]:
    """The rows of ``shape`` FSDP2 gives dp rank ``dp_rank`` (torch.chunk over dim 0)."""
    rows = -(-shape[0] // dp_size)
    return (max(0, min(rows, shape[0] - dp_rank * rows)), *shape[1:])


def sum_tied_gradients(
    split: PipelineSplit, pp_group: Any, device: torch.device, zero_dp: Optional[tuple[int, int]] = None
) -> None:
    """Parameters used on several pipeline ranks (embedding tied to the LM head) get the sum of
    their gradients on every holder, as Megatron does, so the copies stay equal. Every rank of
    the pipeline group joins; ranks not holding a parameter add zeros (of the dp shard's shape
    under ZeRO, ``zero_dp`` = (dp rank, dp size): the holders share this rank's dp coordinate)."""
    if not split.tied:
        return
    grads = []
    for _, shape, dtype, local_name in split.tied:
        param = split.tied_param(local_name)
        if param is not None and param.grad is None:  # this copy saw no gradient: it still takes the sum
            param.grad = torch.zeros_like(param)
        if param is not None:
            grads.append(local_tensor(param.grad))
        else:
            local = _dp_shard_shape(shape, *zero_dp) if zero_dp is not None else shape
            grads.append(torch.zeros(local, dtype=dtype, device=device))
    flat_all_reduce(grads, pp_group)


def average_data_parallel_gradients(params: list[nn.Parameter], dp_group: Any, dp_size: int) -> None:
    """Mean of the gradients over the data-parallel replicas, once per optimizer step (not per
    microbatch): one flat all-reduce per dtype, instead of DDP, whose hooks would fire in every
    microbatch's backward unless each were wrapped in no_sync. The buffer is built from ``params``,
    the same on every replica whatever its forward touched."""
    if dp_size == 1:
        return
    all_reduce_grads([p for p in params if p.requires_grad], dp_group, 1.0 / dp_size)
