"""Run one Lightning step as a pipeline schedule over microbatches.

The user's own ``training_step`` (or validation/test/predict step) runs once per microbatch on
every stage, the model in that stage's chunk mode (split.py): on the last chunk it computes the loss
as written; elsewhere it stops at the chunk's end and the activation is sent on. torch's
PipelineStage and schedules order the work and do the transfers. ``self.log`` calls of the
microbatches are collected and replayed once per step on every pipeline rank, combined by their
``reduce_fx`` (sum, max, min; mean weighted by ``batch_size``), as one process would log them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.nn as nn

from lightning_ptdp.core.comm import detached_cpu
from lightning_ptdp.faults.records import FailureRecords
from lightning_ptdp.pipeline.failure import stop_pipeline
from lightning_ptdp.pipeline.microbatches import check_fixed_shapes, loss_of, merge_outputs, split_microbatches
from lightning_ptdp.pipeline.schedules import build_schedule, check_microbatches
from lightning_ptdp.pipeline.split import PipelineSplit
from lightning_ptdp.pipeline.step_results import StepResults, to_device
from lightning_ptdp.pipeline.timeline import Span, StepTimeline

log = logging.getLogger(__name__)


class _Chunk(nn.Module):
    """What a torch PipelineStage runs: one chunk of the user's step, for the microbatch ``mb``."""

    def __init__(self, engine: "PipelineEngine", chunk: int, params: list[nn.Parameter]) -> None:
        super().__init__()
        self.chunk = chunk
        self.params = nn.ParameterList(params)  # the chunk's Parameters: what zero-bubble's W step differentiates
        self.__dict__["engine"] = engine  # not a submodule

    def forward(self, *received: torch.Tensor, mb: torch.Tensor) -> torch.Tensor:
        return self.engine._forward_chunk(self.chunk, received, int(mb))


@dataclass
class _Step:
    step: Callable[..., Any]
    microbatches: list[Any]
    extra: tuple
    training: bool
    grad_scale: float
    gradients: Any = None
    """The owner of the step's gradients (parallel/gradients.py), told of each gradient-producing
    backward: the engine itself never reads or writes a gradient."""
    failures: Optional[FailureRecords] = None
    """Where a stage's error is recorded for the other ranks (the run's)."""
    outputs: dict[int, Any] = field(default_factory=dict)
    logs: list[tuple[int, str, Any, tuple, dict]] = field(default_factory=list)
    current: int = 0
    as_dict: bool = False


class PipelineEngine:
    """Runs Lightning steps of ``module`` through torch pipeline schedules on this pipeline rank."""

    def __init__(
        self,
        module: nn.Module,
        split: PipelineSplit,
        *,
        schedule: str,
        micro_batch_size: Optional[int],
        pp_group: Any,
        device: torch.device,
    ) -> None:
        self.module, self.split, self.schedule_name = module, split, schedule
        self.micro_batch_size = micro_batch_size
        self.pp_group, self.device = pp_group, device
        self.pp = split.layout.pp
        self.is_last = split.rank == self.pp - 1
        self._schedules: dict[tuple, Any] = {}
        self._run: Optional[_Step] = None
        self._finished: Optional[_Step] = None
        self.results = StepResults(module, pp_group, is_last=self.is_last, device=device)
        self._spans: list[Span] = []
        self._input_shapes: Optional[list[tuple]] = None
        self.timeline: Optional[StepTimeline] = None
        """The last step's measured schedule on this rank."""
        self._backwards_done: dict[int, int] = {}

    def check_reusable(self, config: Any, dims: Any) -> None:
        """A model already cut for one pipeline (an earlier fit) cannot be cut again for another."""
        layout = self.split.layout
        now = (dims.pp, config.virtual_pipeline_size)
        if now != (layout.pp, layout.vpp):
            raise ValueError(
                f"this model was already split for pipeline_parallel_size={layout.pp}, virtual_pipeline_size="
                f"{layout.vpp} by an earlier Trainer in this process (its other stages' parameters are gone), so a "
                f"Trainer with pipeline_parallel_size={now[0]}, virtual_pipeline_size={now[1]} cannot use it. Keep that "
                "layout, or build the model again for the new one (to carry the trained weights over, save a "
                "checkpoint and load it there: checkpoints load on any layout)"
            )
        if (config.micro_batch_size, config.pipeline_schedule) != (self.micro_batch_size, self.schedule_name):
            self.micro_batch_size, self.schedule_name = config.micro_batch_size, config.pipeline_schedule
            self._schedules.clear()

    # ------------------------------------------------------------------ stages
    def _stage_args(self, chunk: int, rows: int, training: bool) -> tuple[tuple, Any]:
        layout, record = self.split.layout, self.split.record

        def example(block: int) -> torch.Tensor:
            meta = record.block_outputs[block]
            grad = training and meta.dtype.is_floating_point
            return torch.empty(
                meta.with_rows(rows, record.rows), dtype=meta.dtype, device=self.device, requires_grad=grad
            )

        blocks = layout.blocks_of(chunk)
        inputs = () if chunk == 0 else (example(blocks.start - 1),)
        last = chunk == layout.num_chunks - 1
        # the last stage returns its loss as shape (1,): torch merges last-stage outputs with cat
        outputs = torch.empty(1, device=self.device, requires_grad=training) if last else example(blocks.stop - 1)
        return inputs, outputs

    def _schedule(self, microbatches: int, rows: int, training: bool) -> Any:
        key = (microbatches, rows, training)
        if key not in self._schedules:
            from torch.distributed.pipelining import PipelineStage

            stages = []
            for chunk in self.split.local_chunks:
                inputs, outputs = self._stage_args(chunk, rows, training)
                stage = PipelineStage(
                    _Chunk(self, chunk, self.split.params_of_chunk(chunk) if training else []),
                    chunk,
                    self.split.layout.num_chunks,
                    self.device,
                    input_args=inputs,
                    output_args=outputs,
                    group=self.pp_group,
                )
                self._time(stage)
                stages.append(stage)
            loss_fn = (lambda output, target: output.sum()) if training else None
            self._schedules[key] = (build_schedule(self.schedule_name, stages, microbatches, loss_fn), stages)
        return self._schedules[key]

    def _time(self, stage: Any) -> None:
        """Record every forward/backward the schedule runs on ``stage`` (a few appends per microbatch)."""
        for attr, kind in (("forward_one_chunk", "F"), ("backward_one_chunk", "B"), ("backward_weight_one_chunk", "W")):
            run = getattr(stage, attr)

            def timed(mb: int, *args: Any, _run: Callable = run, _kind: str = kind, **kwargs: Any) -> Any:
                start = time.perf_counter()
                kind = "I" if _kind == "B" and kwargs.get("full_backward", True) is False else _kind
                after = self._on_backward(stage.stage_index) if kind in ("B", "W") else None
                out = _run(mb, *args, **kwargs)
                self._spans.append(Span(kind, stage.stage_index, mb, start, time.perf_counter()))
                if after is not None:  # the chunk's gradients are final: send what the hooks have not
                    after()
                return out

            setattr(stage, attr, timed)

    def _on_backward(self, chunk: int) -> Optional[Callable[[], None]]:
        """Before a gradient-producing backward of ``chunk``: the gradients' owner learns whether it
        is the chunk's last of the step, and may return what to run once it ran."""
        run = self._run
        self._backwards_done[chunk] = done = self._backwards_done.get(chunk, 0) + 1
        if run is None or run.gradients is None or not run.training:
            return None
        return run.gradients.on_backward(chunk, last=done == len(run.microbatches))

    # ------------------------------------------------------------------ one step
    def _forward_chunk(self, chunk: int, received: tuple, index: int) -> torch.Tensor:
        run = self._run
        assert run is not None
        run.current = index
        finished, value = self.split.run_chunk(
            chunk, received[0] if received else None, lambda: run.step(run.microbatches[index], *run.extra)
        )
        if not finished:
            return value
        if chunk != self.split.layout.num_chunks - 1:
            raise RuntimeError(
                f"the step returned before the model's forward reached the end of pipeline chunk {chunk}"
            )
        if run.training:  # keep only the loss: a returned logits tensor would outlive its microbatch
            loss = loss_of(value)
            run.outputs[index], run.as_dict = loss.detach(), isinstance(value, dict)
            return (loss * run.grad_scale).reshape(1)
        run.outputs[index] = value
        return torch.zeros(1, device=self.device)

    def train_step(
        self,
        step: Callable[..., Any],
        batch: Any,
        extra: tuple,
        grad_scale: float,
        *,
        gradients: Any,
        failures: Optional[FailureRecords] = None,
    ) -> Any:
        """Forward and backward of every microbatch; returns the mean loss (on every pipeline rank),
        as a tensor or as {"loss": ...} like the step returned it (other keys are not carried).
        ``grad_scale`` multiplies the gradients (1/accumulation); they belong to ``gradients``."""
        self._backwards_done = {}
        gradients.begin()
        ok = False
        try:
            run = _Step(step, [], extra, True, grad_scale, gradients=gradients, failures=failures)
            outputs = self._run_schedule(run, batch)
            ok = True
        finally:
            buckets, waited = gradients.end(ok)
        assert self.timeline is not None
        self.timeline.comm = [Span("D", chunk, -1, start, end) for chunk, start, end in buckets]
        self.timeline.exposed_comm = waited
        run = self._finished
        payload = self.results.share_and_replay(
            lambda: {"loss": sum(float(o) for o in outputs) / len(outputs), "dtype": outputs[0].dtype},
            run.logs,
            run.as_dict,
        )
        # the step's own dtype: under precision="bf16-true" the default dtype is bf16 here, which
        # would round a float32 loss to 8 bits (4.162 reported as 4.156)
        loss = torch.tensor(payload["loss"], dtype=payload["dtype"], device=self.device)
        return {"loss": loss} if payload["as_dict"] else loss

    def eval_step(
        self,
        step: Callable[..., Any],
        batch: Any,
        extra: tuple,
        *,
        collect: bool,
        failures: Optional[FailureRecords] = None,
    ) -> Any:
        """Forward of every microbatch; with ``collect`` the step outputs (predictions) of the last
        stage, concatenated over microbatches, on every pipeline rank."""
        outputs = self._run_schedule(_Step(step, [], extra, False, 1.0, failures=failures), batch)
        run = self._finished
        payload = self.results.share_and_replay(
            lambda: {"outputs": merge_outputs([detached_cpu(o) for o in outputs]) if collect else None},
            run.logs,
            run.as_dict,
        )
        return to_device(payload["outputs"], self.device)

    def _run_schedule(self, run: _Step, batch: Any) -> list[Any]:
        """Run ``run.step(microbatch, *run.extra)`` over the microbatches of ``batch`` through the
        schedule; returns the last stage's per-microbatch outputs (empty elsewhere)."""
        self.results.begin()
        training = run.training
        microbatches, rows = self._split(batch, training)
        schedule, stages = self._schedule(len(microbatches), rows, training)
        run.microbatches, run.grad_scale = microbatches, run.grad_scale / len(microbatches)
        self._run = run
        ids = torch.arange(len(microbatches))
        self._spans = []
        original_log = self.module.__dict__.get("log")
        self.module.log = self._capture_log  # type: ignore[method-assign]
        start = time.perf_counter()
        wall_offset = time.time() - start
        try:
            if training:
                schedule.step(mb=ids, target=ids)
            else:
                schedule.step(mb=ids)
        except BaseException as error:
            stop_pipeline(error, self.pp_group, run.failures)
            raise
        finally:
            end = time.perf_counter()
            for stage in stages:  # torch keeps the last stage's outputs, and so their graphs, until the next step
                stage.clear_runtime_states()
            if original_log is None:
                del self.module.log
            else:
                self.module.log = original_log
        self.timeline = StepTimeline(self.split.rank, start, end, self._spans, wall_offset)
        self._finished, self._run = self._run, None
        return [self._finished.outputs[i] for i in sorted(self._finished.outputs)]

    def _split(self, batch: Any, training: bool) -> tuple[list[Any], int]:
        microbatches, size = split_microbatches(batch, self.micro_batch_size, strict=training)
        self._input_shapes = check_fixed_shapes(microbatches[0], self._input_shapes)
        if training:
            check_microbatches(self.schedule_name, len(microbatches), self.pp, size * len(microbatches), size)
        return microbatches, size

    def _capture_log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        run = self._run
        assert run is not None
        # detached: a logged loss would keep its microbatch's graph alive until the next step
        value = value.detach() if isinstance(value, torch.Tensor) else value
        run.logs.append((run.current, name, value, args, kwargs))
