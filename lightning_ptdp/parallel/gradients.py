"""One owner of a training step's gradients, from the first backward to ``optimizer.step``:
``StepGradients``, built by ``parallelize``. Each parameter's gradient is averaged over the group of
its placement (``ReduceGroup``), so a new kind of parameter (experts, context-parallel ranks) is one
more entry, not another code path. The pipeline engine only reports its backwards; the strategy
calls ``finish`` after the closure and ``clip`` from Lightning's clipping hook."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn as nn

from lightning_ptdp.core.comm import PendingAllReduce, all_reduce_grads, local_tensor
from lightning_ptdp.faults.nonfinite import apply_policy, nonfinite_ranks
from lightning_ptdp.parallel.grad_buckets import LastBackwardBuckets
from lightning_ptdp.parallel.grad_sums import clip_grad_norm, sum_partial_over_tp, sum_tied_over_pp
from lightning_ptdp.pipeline.split import PipelineSplit
from lightning_ptdp.tensor_parallel.collectives import TPGroup

DENSE = "dense"
"""The placement of every parameter no other entry claims: one replica per data-parallel rank."""
EXPERTS = "experts"
"""Split experts: one replica per expert-data-parallel rank (d / e of them)."""


@dataclass(frozen=True, kw_only=True)
class ReduceGroup:
    """The ranks that hold replicas of one placement's parameters: their gradients are averaged there."""

    group: Any
    size: int
    rank: int = 0
    """This rank's index in the group."""
    divisor: Optional[int] = None
    """The mean divides the sum by this (default: ``size``). Experts: d, not their d / e replicas,
    since each expert's gradient already sums the losses of its e expert-parallel ranks' tokens."""
    wrapped: bool = False
    """DDP or FSDP averages them already (the dense parameters without a pipeline, and under ZeRO 2/3)."""
    shard: Optional[tuple[Any, int, int]] = None
    """Under HSDP the (group, rank, size) FSDP shards over, a part of ``group``; None: all of ``group``."""

    @property
    def shards(self) -> tuple[Any, int, int]:
        """(group, rank, size) of the ranks whose FSDP shards together make one whole parameter."""
        return self.shard if self.shard is not None else (self.group, self.rank, self.size)

    @property
    def scale(self) -> float:
        return 1.0 / (self.divisor or self.size)


class StepGradients:
    """The gradient work of one optimizer step, in this order:

    1. ``begin`` (under PP): Lightning's gradients set aside, since the schedule's backward runs
       inside training_step, before Lightning's zero_grad;
    2. ``on_backward(chunk, last)``, from the engine: during a chunk's last backward of the step its
       final gradients start their group's mean bucket by bucket (Megatron-Core's
       ``overlap_grad_reduce``); parameters another local chunk still uses wait for that one;
    3. ``end``: wait for the buckets, keep the step's gradients, restore Lightning's;
       ``apply_pending`` adds them back after Lightning's zero_grad (the strategy's ``backward``);
    4. ``finish``, after the closure: sum weights tied across pipeline stages (over pp), finish what
       TP leaves partial (over tp), average what no wrapper and no schedule averaged (over each
       placement's group), then check on all ranks that the loss and gradients are finite;
    5. ``clip``: Lightning's norm clipping by the norm of the whole model, not of this rank's part.

    ``placements`` maps parameter names to a key of ``groups`` (others are ``DENSE``);
    ``expert_group``: the ranks holding different experts, over which ``clip`` sums their squares.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        groups: dict[str, ReduceGroup],
        placements: Optional[dict[str, str]] = None,
        tp: Optional[TPGroup] = None,
        partial: Sequence[tuple[nn.Module, str]] = (),
        split: Optional[PipelineSplit] = None,
        pp_group: Any = None,
        fsdp: bool = False,
        overlap: bool = True,
        on_nonfinite: str = "raise",
        device: torch.device = torch.device("cpu"),
        expert_group: Any = None,
    ) -> None:
        unknown = sorted(set((placements or {}).values()) - set(groups))
        if DENSE not in groups or unknown:
            raise ValueError(f"placements {unknown or [DENSE]} have no ReduceGroup; groups has {sorted(groups)}")
        self.model, self.groups, self.tp, self.partial = model, groups, tp, list(partial)
        self.split, self.pp_group, self.fsdp, self.overlap = split, pp_group, fsdp, overlap
        self.on_nonfinite, self.device, self.expert_group = on_nonfinite, device, expert_group
        named = dict(model.named_parameters())
        # a placement for each parameter this rank holds (the pipeline split dropped other stages')
        self._placement = {id(named[name]): where for name, where in (placements or {}).items() if name in named}
        self._params: list[nn.Parameter] = []
        self._before: list[Optional[torch.Tensor]] = []
        self._pending: list[tuple[nn.Parameter, torch.Tensor]] = []
        self._finished: set[int] = set()
        self._launched: set[int] = set()
        self._buckets: list[tuple[int, PendingAllReduce]] = []
        self._deferred: list[nn.Parameter] = []
        self.replicas: Any = None
        """``expert_balance``'s ``ExpertBalancer``: replicated experts' gradients summed over their holders."""

    # ------------------------------------------------------------------ what averages where
    def placement_of(self, param: nn.Parameter) -> str:
        return self._placement.get(id(param), DENSE)

    def _unaveraged(self, params: Sequence[nn.Parameter]) -> dict[str, list[nn.Parameter]]:
        """``params`` by placement, only those whose mean no wrapper takes and that is not the value itself."""
        out: dict[str, list[nn.Parameter]] = {}
        for param in params:
            where = self.placement_of(param)
            group = self.groups[where]
            if not group.wrapped and (group.size > 1 or group.scale != 1.0):
                out.setdefault(where, []).append(param)
        return out

    @property
    def clips_globally(self) -> bool:
        """Whether a rank holds only part of the model (then Lightning's own clipping is per rank)."""
        return self.tp is not None or self.split is not None or self.expert_group is not None

    # ------------------------------------------------------------------ during the pipeline schedule
    def begin(self) -> None:
        self._params = [p for p in self.model.parameters() if p.requires_grad]
        self._before = [p.grad for p in self._params]
        for p in self._params:
            p.grad = None
        self._finished, self._launched, self._buckets, self._deferred = set(), set(), [], []

    def on_backward(self, chunk: int, last: bool) -> Optional[Callable[[], None]]:
        """Before a gradient-producing backward of ``chunk``; ``last``: its last of the step. Returns
        what to call once that backward ran (it starts the buckets the hooks have not)."""
        if not last or self.split is None:
            return None
        self._finished.add(chunk)
        pending = [c for c in self.split.local_chunks if c not in self._finished]
        still_used = {id(p) for c in pending for p in self.split.params_of_chunk(c)}
        params = [
            p
            for placement in self._unaveraged(self.split.params_of_chunk(chunk)).values()
            for p in placement
            if p.requires_grad and id(p) not in self._launched and id(p) not in still_used
        ]
        if not params:
            return None
        self._launched.update(id(p) for p in params)
        return LastBackwardBuckets(params, lambda bucket: self._bucket_ready(chunk, bucket)).close

    def _bucket_ready(self, chunk: int, bucket: list[nn.Parameter]) -> None:
        if self.overlap:
            self._start_means(chunk, bucket)
        else:  # every bucket starts in ``end``
            self._deferred += bucket

    def _start_means(self, chunk: int, params: Sequence[nn.Parameter]) -> None:
        for where, same in self._unaveraged(params).items():
            group = self.groups[where]
            self._buckets.append((chunk, PendingAllReduce(same, group.group, group.scale)))

    def end(self, ok: bool) -> tuple[list[tuple[int, float, float]], float]:
        """After the schedule: wait for the means (or forget them when the step failed: the process
        group is being torn down), keep the step's gradients, restore Lightning's. Returns (chunk,
        start, end) of each bucket and the seconds this rank waited for them."""
        waited, spans = 0.0, []
        try:
            if ok:
                rest = [p for p in self._params if id(p) not in self._launched]
                self._start_means(-1, self._deferred + rest)
                start = time.perf_counter()
                for _, bucket in self._buckets:
                    bucket.wait()
                waited = time.perf_counter() - start
                spans = [(chunk, b.started, b.done or b.started) for chunk, b in self._buckets]
        finally:
            self._buckets, self._deferred = [], []
            self._pending = [(p, p.grad) for p in self._params if p.grad is not None]
            for p, grad in zip(self._params, self._before):
                p.grad = grad
            self._before = []
        return spans, waited

    def apply_pending(self) -> None:
        """Add the last training step's gradients to ``.grad`` (after Lightning's zero_grad)."""
        for param, grad in self._pending:
            param.grad = grad if param.grad is None else param.grad.add_(grad)
        self._pending = []

    # ------------------------------------------------------------------ before the optimizer step
    def finish(self, params: list[nn.Parameter], loss: Any, step: int) -> None:
        """Once per optimizer step on every rank, with the optimizer's parameters and the closure's loss."""
        if self.replicas is not None:  # a sum like TP's partial ones below, over the ep ranks of one expert
            self.replicas.sum_replica_grads()
        if self.split is not None:
            shard = self.groups[DENSE].shards[1:] if self.fsdp else None  # the tied copies' FSDP shards
            sum_tied_over_pp(self.split, self.pp_group, self.device, shard)
        if self.tp is not None:
            sum_partial_over_tp(self.model, self.partial, self.tp)
        if self.split is None:  # under PP the schedule averaged them (``end``)
            for where, same in self._unaveraged(params).items():
                all_reduce_grads(same, self.groups[where].group, self.groups[where].scale)
        self._rescale_wrapped(params)
        if self.on_nonfinite != "ignore":
            apply_policy(self.on_nonfinite, nonfinite_ranks(loss, params), step, params)

    def take_over_clipping(self, plugin: Any) -> None:
        """Lightning's ``clip_grad_by_norm`` on the precision ``plugin`` becomes ``clip`` where a rank
        holds only part of the model (Lightning's own would take the norm of that part)."""
        if self.clips_globally:
            plugin.clip_grad_by_norm = lambda optimizer, value: self.clip(
                list(plugin.main_params(optimizer)), float(value)
            )

    def _rescale_wrapped(self, params: list[nn.Parameter]) -> None:
        """A wrapper's mean divides by its group's size; a placement whose sum needs another divisor
        (FSDP's experts: d, not d / e) is rescaled here. (Not FSDP's own divide factor: it needs
        ReduceOp.PREMUL_SUM, which gloo lacks.)"""
        for where, group in self.groups.items():
            if group.wrapped and group.divisor not in (None, group.size):
                for param in params:
                    if param.grad is not None and self.placement_of(param) == where:
                        local_tensor(param.grad).mul_(group.size / group.divisor)

    def clip(self, params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
        """Scale the gradients so the whole model's norm is at most ``max_norm``; returns that norm."""
        exclude = self.split.norm_exclude() if self.split is not None else frozenset()
        dp_group = self.groups[DENSE].shards[0] if self.fsdp else None  # HSDP: the replicas hold the same shard
        experts = frozenset(id(p) for p in params if self.placement_of(p) == EXPERTS)
        # split experts' squares sum over the ep group; under FSDP every square already sums over dp
        split = (self.expert_group, experts) if self.expert_group is not None and not self.fsdp else None
        if split is not None and self.replicas is not None:  # a replicated expert's squares counted once
            split = (*split, self.replicas.norm_shares())
        return clip_grad_norm(params, self.model, self.tp, max_norm, dp_group, self.pp_group, exclude, split)
