"""Find the transformer blocks, record one microbatch forward, keep this rank's chunks."""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch
import torch.nn as nn

from lightning_ptdp.core.blocks import find_block_lists
from lightning_ptdp.pipeline.engine import PipelineEngine
from lightning_ptdp.pipeline.split import ChunkLayout, PipelineSplitError, record_forward, split_model

log = logging.getLogger(__name__)


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's one list of repeated transformer blocks (same finder as tensor parallelism)."""
    found = find_block_lists(model)
    if not found:
        raise PipelineSplitError(
            f"{type(model).__name__} has no nn.ModuleList/nn.Sequential/nn.ModuleDict of repeated blocks holding Linear layers; "
            "the pipeline split cuts between such transformer blocks"
        )
    if len(found) > 1:
        names = ", ".join(f"'{path}' ({len(blocks)} blocks)" for path, blocks in found)
        raise PipelineSplitError(f"the model has several block lists ({names}); the pipeline split handles one")
    return found[0][1]


def apply_pipeline(
    module: nn.Module,
    *,
    pp: int,
    vpp: int,
    rank: int,
    schedule: str,
    micro_batch_size: Optional[int],
    pp_group: Any,
    device: torch.device,
    probe: Callable[[], Any],
    probe_rows: int,
) -> PipelineEngine:
    """Cut ``module`` in place to pipeline rank ``rank``'s chunks; ``probe`` runs one ordinary
    forward on a microbatch of ``probe_rows`` samples (every rank still holds the whole model)."""
    blocks = transformer_blocks(module)
    layout = ChunkLayout(num_layers=len(blocks), pp=pp, vpp=vpp)
    record = record_forward(module, blocks, layout, probe, probe_rows)
    split = split_model(module, blocks, layout, rank, record)
    kept = sum(p.numel() for p in module.parameters())
    log.info(
        "pipeline rank %d: chunks %s (blocks %s), %d parameters kept, %d tied across stages",
        rank,
        split.local_chunks,
        [list(layout.blocks_of(c)) for c in split.local_chunks],
        kept,
        len(split.tied),
    )
    return PipelineEngine(
        module,
        split,
        schedule=schedule,
        micro_batch_size=micro_batch_size,
        pp_group=pp_group,
        device=device,
    )
