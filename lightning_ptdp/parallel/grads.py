"""Gradient finishing between backward and the optimizer step: weights tied across pipeline stages,
gradients TP leaves partial, the dp mean under PP, and the global norm for clipping (one owner:
``GradientFinisher``, built by ``parallelize``)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from lightning_ptdp.core.comm import PendingAllReduce, all_reduce_grads, flat_all_reduce, local_tensor
from lightning_ptdp.pipeline.grad_buckets import LastBackwardBuckets
from lightning_ptdp.pipeline.split import PipelineSplit
from lightning_ptdp.tensor_parallel.collectives import TPGroup
from lightning_ptdp.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelHead,
)

_TP_LAYERS = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, VocabParallelHead)


def _dp_shard_shape(shape: tuple[int, ...], dp_rank: int, dp_size: int) -> tuple[int, ...]:
    """The rows of ``shape`` FSDP2 gives dp rank ``dp_rank`` (torch.chunk over dim 0)."""
    rows = -(-shape[0] // dp_size)
    return (max(0, min(rows, shape[0] - dp_rank * rows)), *shape[1:])


def sum_tied_gradients(
    split: PipelineSplit, pp_group: Any, device: torch.device, fsdp_dp: Optional[tuple[int, int]] = None
) -> None:
    """Parameters used on several pipeline ranks (embedding tied to the LM head) get the sum of
    their gradients on every holder, as Megatron does, so the copies stay equal. Every rank of
    the pipeline group joins; ranks not holding a parameter add zeros (of the dp shard's shape
    under ZeRO, ``fsdp_dp`` = (dp rank, dp size): the holders share this rank's dp coordinate)."""
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
            local = _dp_shard_shape(shape, *fsdp_dp) if fsdp_dp is not None else shape
            grads.append(torch.zeros(local, dtype=dtype, device=device))
    flat_all_reduce(grads, pp_group)


def _replicated_kv(model: nn.Module) -> list[tuple[ColumnParallelLinear, nn.Parameter]]:
    """KV projection weights and biases replicated over several TP ranks (t > n_kv_heads), in model order."""
    return [
        (layer, param)
        for layer in model.modules()
        if isinstance(layer, ColumnParallelLinear) and layer.layout.replication > 1
        for param in (layer.weight, layer.bias)
        if param is not None
    ]


def sum_partial_gradients(model: nn.Module, partial: list[tuple[nn.Module, str]], tp: TPGroup) -> None:
    """Finish the gradients TP leaves partial, once per optimizer step (buffers from the parameter
    lists, identical on every rank; a rank that did not use a parameter adds zeros):

    - parameters replicated inside sequence-parallel blocks (norms, row biases) saw only this
      rank's part of the sequence: sum over the group (one flat all-reduce);
    - KV heads replicated over several ranks (t > n_kv_heads): each copy saw only its ranks'
      query heads: sum the copies (scatter into the full tensor, all-reduce, take own rows).
    """
    all_reduce_grads([getattr(module, name) for module, name in partial], tp.group)
    replicated = _replicated_kv(model)
    if not replicated:
        return
    if any(hasattr(param, "to_local") for _, param in replicated):
        raise NotImplementedError(
            "zero_stage 2 or 3 with key/value heads replicated over tensor-parallel ranks "
            "(tensor_parallel_size > n_kv_heads) is not supported yet; use zero_stage=0 or 1, or a smaller t"
        )
    rows = [layer.layout.indices(tp.rank).to(param.device) for layer, param in replicated]
    fulls = []
    for (layer, param), own in zip(replicated, rows):
        full = param.new_zeros((layer.layout.size, *param.shape[1:]))
        if param.grad is not None:
            full.index_copy_(0, own, param.grad)
        fulls.append(full)
    had = torch.tensor([param.grad is not None for _, param in replicated], dtype=torch.float32, device=fulls[0].device)
    flat_all_reduce([*fulls, had], tp.group)
    for (_, param), own, full, anywhere in zip(replicated, rows, fulls, had.tolist()):
        if anywhere and param.grad is None:
            param.grad = full.index_select(0, own)
        elif anywhere:
            param.grad.copy_(full.index_select(0, own))


def global_grad_norm(
    parameters: list[nn.Parameter],
    model: nn.Module,
    tp: TPGroup | None,
    dp_group: Any = None,
    pp_group: Any = None,
    exclude: frozenset[int] = frozenset(),
) -> torch.Tensor:
    """The 2-norm of the whole model's gradient, as a single process would compute it.

    Sharded parameters contribute their squares summed over the tp group; replicated ones (norms,
    row biases, position embeddings) once; KV heads replicated over r ranks 1/r from each copy.
    Under ZeRO each dp rank holds a slice of every gradient (summed over ``dp_group``); under
    pipeline parallelism each stage its own layers (summed over ``pp_group``), a weight tied
    across stages counted on one of them (the others pass its id in ``exclude``).
    """
    weight = {}
    for layer in model.modules():
        if isinstance(layer, _TP_LAYERS):
            replication = getattr(getattr(layer, "layout", None), "replication", 1)
            for attr, param in layer.named_parameters(recurse=False):
                replicated_bias = isinstance(layer, RowParallelLinear) and attr == "bias"
                weight[id(param)] = None if replicated_bias else 1.0 / replication
    sharded = torch.zeros((), dtype=torch.float64)
    replicated = torch.zeros((), dtype=torch.float64)
    for param in parameters:
        if param.grad is None or id(param) in exclude:
            continue
        square = local_tensor(param.grad.detach()).double().pow(2).sum().cpu()
        share = weight.get(id(param))
        if share is None:
            replicated += square
        else:
            sharded += square * share
    device = parameters[0].device if parameters else torch.device("cpu")
    if tp is not None:
        sharded = sharded.to(device)
        dist.all_reduce(sharded, group=tp.group)
    total = (sharded.cpu() + replicated).to(device)
    for group in (dp_group, pp_group):
        if group is not None:
            dist.all_reduce(total, group=group)
    return total.sqrt().cpu()


def clip_grad_norm(
    parameters: list[nn.Parameter],
    model: nn.Module,
    tp: TPGroup | None,
    max_norm: float,
    dp_group: Any = None,
    pp_group: Any = None,
    exclude: frozenset[int] = frozenset(),
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` with the norm taken over the whole parallel model."""
    total = global_grad_norm(parameters, model, tp, dp_group, pp_group, exclude)
    scale = max_norm / (float(total) + 1e-6)
    if scale < 1.0:
        for param in parameters:
            if param.grad is not None:
                local_tensor(param.grad).mul_(scale)
    return total


@dataclass(kw_only=True)
class GradientFinisher:
    """The gradient work between backward and the optimizer step, in this order: sum weights tied
    across pipeline stages; finish what TP leaves partial (sequence-parallel norms, replicated KV
    heads). (The dp mean is DDP's, FSDP's, or under PP the engine's DataParallelGradSync.)
    ``clip`` is Lightning's norm clipping over the whole model instead of this rank's part."""

    model: nn.Module
    """The LightningModule as parallelized (not a DDP wrapper)."""
    tp: Optional[TPGroup] = None
    partial: list[tuple[nn.Module, str]] = field(default_factory=list)
    """(module, parameter name) of parameters whose gradient each TP rank holds a part of."""
    split: Optional[PipelineSplit] = None
    pp_group: Any = None
    dp_group: Any = None
    dp_rank: int = 0
    dp_size: int = 1
    fsdp: bool = False
    device: torch.device = torch.device("cpu")

    @property
    def clips_globally(self) -> bool:
        """Whether a rank holds only part of the model (then Lightning's own clipping is per rank)."""
        return self.tp is not None or self.split is not None

    def finish(self, params: list[nn.Parameter]) -> None:
        """Called once per optimizer step on every rank, with the optimizer's parameters."""
        if self.split is not None:
            fsdp_dp = (self.dp_rank, self.dp_size) if self.fsdp else None
            sum_tied_gradients(self.split, self.pp_group, self.device, fsdp_dp)
        if self.tp is not None:
            sum_partial_gradients(self.model, self.partial, self.tp)

    def clip(self, params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
        """Scale the gradients so the whole model's norm is at most ``max_norm``; returns that norm."""
        exclude = self.split.norm_exclude() if self.split is not None else frozenset()
        dp_group = self.dp_group if self.fsdp else None
        return clip_grad_norm(params, self.model, self.tp, max_norm, dp_group, self.pp_group, exclude)


@dataclass(kw_only=True)
class DataParallelGradSync:
    """Under PP (no DDP wrapper), the mean of the gradients over the dp replicas, bucket by bucket.
    The pipeline engine calls ``ready`` with a chunk's parameters once that chunk's last backward
    has run, and ``finish`` after the schedule. With ``overlap`` (Megatron-Core's
    ``overlap_grad_reduce``) each bucket's all-reduce starts at ``ready`` and runs while the other
    chunks compute; without it, every bucket starts in ``finish``. Buckets are launched in the same
    order on every replica (the same schedule runs there)."""

    group: Any
    size: int
    overlap: bool = True
    _pending: list[PendingAllReduce] = field(default_factory=list)
    _deferred: list[nn.Parameter] = field(default_factory=list)

    def ready(self, params: list[nn.Parameter]) -> Optional[PendingAllReduce]:
        if not params:
            return None
        if not self.overlap:
            self._deferred += params
            return None
        self._pending.append(PendingAllReduce(params, self.group, 1.0 / self.size))
        return self._pending[-1]

    def finish(self, rest: list[nn.Parameter]) -> tuple[list[PendingAllReduce], float]:
        """Start what is left, wait for every bucket; returns the buckets and the seconds this rank
        waited (the communication the step could not hide)."""
        left = self._deferred + rest
        if left:
            self._pending.append(PendingAllReduce(left, self.group, 1.0 / self.size))
        start = time.perf_counter()
        for pending in self._pending:
            pending.wait()
        buckets, self._pending, self._deferred = self._pending, [], []
        return buckets, time.perf_counter() - start

    def abandon(self) -> None:
        """After a failed step: forget the started buckets (the process group is being torn down)."""
        self._pending, self._deferred = [], []


class PipelineStepGradients:
    """Under PP, the owner of a step's gradients while the schedule's backwards produce them.

    Lightning zeroes gradients after training_step and before backward, but the schedule's backward
    runs inside the step: ``begin`` sets Lightning's gradients aside, ``end`` keeps the step's
    (``apply_pending`` adds them back after Lightning's zero_grad) and restores the others. With a
    ``sync`` (d > 1 without FSDP) a chunk's final gradients go to the dp mean bucket by bucket
    during its last backward; parameters another local chunk still uses wait for that one. The
    engine only reports its backwards (``on_backward``) and never touches ``.grad``."""

    def __init__(self, module: nn.Module, split: PipelineSplit, sync: Optional[DataParallelGradSync]) -> None:
        self.module, self.split, self.sync = module, split, sync
        self._params: list[nn.Parameter] = []
        self._before: list[Optional[torch.Tensor]] = []
        self._pending: list[tuple[nn.Parameter, torch.Tensor]] = []
        self._finished: set[int] = set()
        self._synced: set[int] = set()
        self._chunk_of: dict[int, int] = {}

    def begin(self) -> None:
        self._params = [p for p in self.module.parameters() if p.requires_grad]
        self._before = [p.grad for p in self._params]
        for p in self._params:
            p.grad = None
        self._finished, self._synced, self._chunk_of = set(), set(), {}

    def on_backward(self, chunk: int, last: bool) -> Optional[Callable[[], None]]:
        """Before a gradient-producing backward of ``chunk``; ``last``: its last of the step. Returns
        what to call once that backward ran (it sends the buckets the hooks have not)."""
        if not last:
            return None
        self._finished.add(chunk)
        if self.sync is None:
            return None
        pending = [c for c in self.split.local_chunks if c not in self._finished]
        still_used = {id(p) for c in pending for p in self.split.params_of_chunk(c)}
        params = [
            p
            for p in self.split.params_of_chunk(chunk)
            if p.requires_grad and id(p) not in self._synced and id(p) not in still_used
        ]
        self._synced.update(id(p) for p in params)
        return LastBackwardBuckets(params, lambda bucket: self._launch(chunk, bucket)).close

    def _launch(self, chunk: int, bucket: list[nn.Parameter]) -> None:
        pending = self.sync.ready(bucket)  # armed only with a sync (on_backward)
        if pending is not None:
            self._chunk_of[id(pending)] = chunk

    def end(self, ok: bool) -> tuple[list[tuple[int, float, float]], float]:
        """After the schedule: wait for the dp mean (or forget it when the step failed), keep the
        step's gradients, restore Lightning's. Returns (chunk, start, end) of each dp bucket and the
        seconds this rank waited for them."""
        buckets: list[tuple[int, float, float]] = []
        waited = 0.0
        try:
            if self.sync is not None and ok:
                rest = [p for p in self._params if id(p) not in self._synced]
                pending, waited = self.sync.finish(rest)
                buckets = [(self._chunk_of.get(id(b), -1), b.started, b.done or b.started) for b in pending]
            elif self.sync is not None:
                self.sync.abandon()
        finally:
            self._pending = [(p, p.grad) for p in self._params if p.grad is not None]
            for p, grad in zip(self._params, self._before):
                p.grad = grad
            self._before = []
        return buckets, waited

    def apply_pending(self) -> None:
        """Add the last training step's gradients to ``.grad`` (after Lightning's zero_grad)."""
        for param, grad in self._pending:
            param.grad = grad if param.grad is None else param.grad.add_(grad)
        self._pending = []
