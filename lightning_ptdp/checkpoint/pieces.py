"""Where this rank's data of each tensor sits inside the single-process model's tensor.

A parameter may be cut by tensor parallelism (``ShardLayout`` / ``VocabShard`` say which rows or
columns) or expert parallelism (whole experts: rows of dim 0), then by ZeRO (an FSDP2 DTensor
sharded by rows over dp). ``pieces`` maps what this rank holds back to original coordinates as a
few rectangles (one per q/k/v block of a fused projection, split where a ZeRO row range crosses a
block edge; vocabulary padding belongs to none). Checkpoints, initialisation and pretrained reads
use them, so a file saved at one (t, p, d, e, zero) loads on any other."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn

from lightning_ptdp.expert_parallel import ExpertShard
from lightning_ptdp.tensor_parallel.consolidate import tp_layout
from lightning_ptdp.tensor_parallel.layers import RowParallelLinear, VocabParallelEmbedding, VocabParallelHead


@dataclass(frozen=True)
class Segment:
    """Local indices [local_start, local_start + length) along the TP-cut dim are original
    indices [start, start + length)."""

    local_start: int
    length: int
    start: int


@dataclass(frozen=True)
class TPCut:
    """How tensor (or expert) parallelism cut one parameter: along ``dim`` to ``full_size`` originally."""

    dim: int
    full_size: int
    segments: tuple[Segment, ...]


@dataclass(frozen=True)
class Piece:
    offsets: tuple[int, ...]  # where it starts in the original tensor
    local: torch.Tensor  # this rank's data for it: a view of the parameter (or state) tensor


@dataclass(frozen=True)
class Pieces:
    """This rank's part of one original tensor of shape ``full_shape``; other ranks hold the
    rest (or the same, replicated: then the same offsets appear on several ranks)."""

    full_shape: tuple[int, ...]
    items: tuple[Piece, ...]


def tp_cut(layer: nn.Module, attr: str) -> Optional[TPCut]:
    """The cut of ``layer.<attr>`` if ``layer`` is one of our tensor-parallel layers or a split
    experts module, else None."""
    experts: Optional[ExpertShard] = layer.__dict__.get("_ptdp_experts")
    if experts is not None:
        return TPCut(0, experts.num_experts, expert_segments(experts.mine))
    if isinstance(layer, (VocabParallelEmbedding, VocabParallelHead)):
        shard = layer.shard
        return TPCut(0, shard.vocab_size, (Segment(0, shard.valid, shard.start),) if shard.valid else ())
    if isinstance(layer, RowParallelLinear) and attr == "bias":
        return None  # replicated on every TP rank
    found = tp_layout(layer, attr)
    if found is None:
        return None
    tp, dim, layout = found
    return TPCut(dim, layout.size, tuple(Segment(*piece) for piece in layout.segments(tp.rank)))


def expert_segments(mine: tuple[int, ...]) -> tuple[Segment, ...]:
    """Slot i holds expert ``mine[i]`` (increasing): one segment per run of consecutive experts."""
    out: list[Segment] = []
    for i, j in enumerate(mine):
        last = out[-1] if out else None
        if last is not None and last.start + last.length == j:
            out[-1] = Segment(last.local_start, last.length + 1, last.start)
        else:
            out.append(Segment(i, 1, j))
    return tuple(out)


def tp_cuts(model: nn.Module) -> dict[str, TPCut]:
    """Parameter name -> its cut, for every parameter our TP layers and split experts hold."""
    cuts = {}
    for path, module in model.named_modules(remove_duplicate=False):  # a module reached by two paths: both
        for attr, _ in module.named_parameters(recurse=False):
            cut = tp_cut(module, attr)
            if cut is not None:
                cuts[f"{path}.{attr}" if path else attr] = cut
    return cuts


def _local_box(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """(local data, its offsets, the shape it is part of) before TP is undone: a ZeRO DTensor's
    rows within the TP-local tensor, or the tensor itself."""
    if hasattr(tensor, "to_local"):
        chunk = tensor.__create_chunk_list__()[0]  # the checkpoint protocol DTensor implements
        return tensor.to_local(), tuple(chunk.offsets), tuple(tensor.shape)
    return tensor, (0,) * tensor.dim(), tuple(tensor.shape)


def pieces(tensor: torch.Tensor, cut: Optional[TPCut] = None) -> Pieces:
    """This rank's pieces of ``tensor`` (a parameter, or optimizer state shaped like it)."""
    local, offsets, shape = _local_box(tensor.detach())
    if local.numel() == 0:
        full = list(shape)
        if cut is not None:
            full[cut.dim] = cut.full_size
        return Pieces(tuple(full), ())
    if cut is None:
        return Pieces(shape, (Piece(offsets, local),))
    full_shape = tuple(cut.full_size if d == cut.dim else n for d, n in enumerate(shape))
    lo, hi = offsets[cut.dim], offsets[cut.dim] + local.shape[cut.dim]
    items = []
    for segment in cut.segments:
        start, stop = max(lo, segment.local_start), min(hi, segment.local_start + segment.length)
        if start >= stop:
            continue
        where = list(offsets)
        where[cut.dim] = segment.start + (start - segment.local_start)
        items.append(Piece(tuple(where), local.narrow(cut.dim, start - lo, stop - start)))
    return Pieces(full_shape, tuple(items))
