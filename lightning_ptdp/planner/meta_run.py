"""A dry run of the user's own model: ptdp's real setup on a fake process group, on the meta device.

Each candidate layout builds the model on meta, runs the strategy's own setup (census, TP, EP, CP,
pipeline split, ZeRO) for one rank of each pipeline stage, then two training steps on meta tensors.
Bytes come from the tensors that setup made and the step allocated (torch's ``MemTracker``), and
communication from the collectives the step issued: no formula, no real storage, no GPU.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Union

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.pytorch.accelerators import CPUAccelerator
from torch.utils.flop_counter import FlopCounterMode

from lightning_ptdp.core.dims import ParallelDims
from lightning_ptdp.meta_routing import tensors_in
from lightning_ptdp.planner.meta_device import (
    EXTRA_FLOPS,
    Broadcasts,
    Communication,
    MetaCalls,
    MetaShapes,
    fake_group_reads,
    mesh_axes,
    step_peak_tracker,
)
from lightning_ptdp.probe import side_effects_muted
from lightning_ptdp.strategy import PTDPStrategy
from lightning_ptdp.testing import QUIET_TRAINER

Factory = Callable[[], Union[pl.LightningModule, tuple[pl.LightningModule, pl.LightningDataModule]]]
MEASURED_STEP = 1  # the second step is measured: the optimizer's state exists by then, as in a real run


@dataclass(frozen=True)
class RankMemory:
    """What one rank holds under a layout, in bytes."""

    rank: int
    like: tuple[int, ...]
    """The ranks that hold the same (this rank's pipeline stage: tp, cp, dp and ep shards are equal)."""
    parameters: int
    gradients: int
    optimizer: int
    buffers: int
    ddp_buckets: int
    """DDP's own copy of the gradients it all-reduces (torch's DDP cannot wrap meta parameters: counted)."""
    other: int
    """Other tensors the steps left alive (a pipeline stage's receive buffers, a loss's saved state)."""
    step_peak: int
    """The most live at once during a training step: the state above, activations and temporaries."""
    holders: tuple[tuple[str, int], ...] = ()
    """The largest parameters (name, bytes of weight, gradient and optimizer state), largest first."""
    flops: int = 0
    """Floating-point operations of this rank's step (torch's FlopCounterMode: matmuls, convolutions, attention)."""
    microbatches: int = 1
    collectives: tuple[tuple[str, str, int, int, int], ...] = ()
    """(axis, kind, group size, bytes, calls) of the step's collectives: what the cost model times."""

    @property
    def state(self) -> int:
        """Held across steps: weights, gradients, optimizer state and buffers."""
        return self.parameters + self.gradients + self.optimizer + self.buffers + self.ddp_buckets + self.other

    @property
    def activations(self) -> int:
        """The step's peak above the state it starts with (the last step's gradients are freed only
        after the forward, in Lightning's order: zero_grad comes after training_step)."""
        return max(self.step_peak - self.state, 0)

    @property
    def peak(self) -> int:
        return max(self.step_peak, self.state)


@dataclass(frozen=True)
class LayoutReport:
    """One layout's dry run: each pipeline stage's memory and the step's communication per axis."""

    layout: dict[str, Any]
    world_size: int
    ranks: tuple[RankMemory, ...]
    communication: dict[str, int] = field(default_factory=dict)
    """Bytes the collectives of one training step carry, by mesh axis: the most any stage's rank carries."""
    seconds: float = 0.0
    refused: Optional[str] = None
    """Why ptdp's setup refused this layout for this model (then there are no ranks)."""

    @property
    def largest(self) -> RankMemory:
        return max(self.ranks, key=lambda r: r.peak)

    def fits(self, device_bytes: float) -> bool:
        return self.refused is None and self.largest.peak <= device_bytes


class _OneRank(ClusterEnvironment):
    """The dry run's cluster: one given rank of ``world_size``, started by the dry run itself."""

    def __init__(self, rank: int, world_size: int) -> None:
        super().__init__()
        self._rank, self._world_size = rank, world_size

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return "127.0.0.1"

    @property
    def main_port(self) -> int:
        return 0

    @staticmethod
    def detect() -> bool:
        return False

    def world_size(self) -> int:
        return self._world_size

    def set_world_size(self, size: int) -> None:
        pass

    def global_rank(self) -> int:
        return self._rank

    def set_global_rank(self, rank: int) -> None:
        pass

    def local_rank(self) -> int:
        return self._rank

    def node_rank(self) -> int:
        return 0


class _MetaAccelerator(CPUAccelerator):
    """Every rank's device is meta: nothing to set up, no memory to allocate."""

    def setup_device(self, device: torch.device) -> None:
        pass


class DryRunStrategy(PTDPStrategy):
    """ptdp's strategy with the model left on meta: setup runs unchanged; what moves tensors to a
    real device or reads another rank's objects (the fake group carries no bytes) does not."""

    def backward_done(self, loss: torch.Tensor, params: list, step: int) -> None:
        """The step's backward (under PP it ran inside training_step: its gradients are added now),
        then what ``optimizer_step`` does before the optimizer: the gradients' owner finishes them."""
        if self.pipeline is None:
            loss.backward()
        else:
            self._parallelized.gradients.apply_pending()
        for param in params:
            if param.requires_grad and param.grad is None:
                # routing reads values meta tensors lack (which experts a batch hits): a real step's batch
                # reaches every expert, so each trainable parameter holds a gradient and optimizer state
                param.grad = torch.empty_like(param)
        self._parallelized.gradients.finish(params, loss, step)

    def dry_run_ddp_gradients(self, module: torch.nn.Module) -> int:
        """Bytes of the gradient copy DDP's buckets would hold: DDP is left out on meta (``_state``)."""
        dims, config = self.parallel_dims, self.parallel_config
        if config.fsdp or dims.pp > 1 or dims.dp * dims.cp == 1:
            return 0
        report = self._parallelized.ep_report
        experts = set(report.expert_params) if report is not None else set()
        return sum(_bytes(p) for n, p in module.named_parameters() if p.requires_grad and n not in experts)

    def teardown(self) -> None:
        if self._failures is not None:
            self._failures.release_sigterm()
        self.precision_plugin.teardown()
        self.checkpoint_io.teardown()  # Lightning's own teardown would copy the meta tensors to the CPU


def _bytes(tensor: Optional[torch.Tensor]) -> int:
    if tensor is None:
        return 0
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


class _StepMemory(pl.Callback):
    """After setup: two training steps on meta under ``MemTracker`` (the second's peak is the larger:
    the optimizer state exists by then, as in a real run); then stop the fit."""

    def __init__(self, communication: Communication) -> None:
        self.communication = communication
        self.measured: Optional[dict[str, Any]] = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        import gc

        from lightning_ptdp.data_parallel.zero1 import local_optimizer

        strategy = trainer.strategy
        assert isinstance(strategy, DryRunStrategy)
        batch = strategy.batch_to_device(next(iter(trainer.fit_loop._data_source.dataloader())))
        optimizers = trainer.optimizers
        # both steps tracked: what the first allocates and keeps (a pipeline stage's buffers) is held
        tracker = step_peak_tracker()
        tracker.track_external(pl_module, *(local_optimizer(o) for o in optimizers))  # ZeRO-1: the shard's
        flops = FlopCounterMode(display=False, custom_mapping=EXTRA_FLOPS)  # matmuls and attention, from shapes
        with tracker:
            for step in range(MEASURED_STEP + 1):
                if step == MEASURED_STEP:
                    self.communication.bytes.clear()
                    self.communication.calls.clear()
                    self.communication.__enter__()
                    flops.__enter__()
                with side_effects_muted(pl_module):
                    output = strategy.training_step(batch, step)
                for optimizer in optimizers:
                    optimizer.zero_grad()  # Lightning's closure: after training_step, before backward
                loss = output["loss"] if isinstance(output, dict) else output
                params = [p for opt in optimizers for g in opt.param_groups for p in g["params"]]
                strategy.backward_done(loss, params, step)
                for optimizer in optimizers:
                    optimizer.step()
                del output, loss
            flops.__exit__(None, None, None)
            self.communication.__exit__(None, None, None)
            gc.collect()
            live = sum(snap["Total"] for snap in tracker.get_tracker_snapshot().values())
        peak = sum(snap["Total"] for snap in tracker.get_tracker_snapshot("peak").values())
        self.measured = _state(pl_module, optimizers, peak, live, strategy)
        rows = next((t.shape[0] for t in tensors_in(batch) if t.dim()), 1)
        micro = strategy.parallel_config.micro_batch_size or rows
        self.measured.update(
            zero1_shards=_zero1_shards(optimizers),
            flops=flops.get_total_flops(),
            microbatches=max(rows // micro, 1),
            collectives=tuple((*key, *value) for key, value in sorted(self.communication.calls.items())),
        )
        trainer.should_stop = True


def _zero1_shards(optimizers: list) -> list[int]:
    """ZeRO-1: the optimizer-state bytes of each dp rank, from torch's own partition of the parameters:
    each other rank's local optimizer is built over its part and stepped on the meta gradients."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    zero = [o for o in optimizers if isinstance(o, ZeroRedundancyOptimizer)]
    if not zero:
        return []
    held = [0] * zero[0].world_size
    for optimizer in zero:
        for index, groups in enumerate(optimizer._partition_parameters()):
            if index == optimizer.rank:
                local = optimizer.optim
            else:
                local = optimizer._optim_constructor(groups, **optimizer._optim_defaults)
                local.step()
            held[index] += sum(
                _bytes(v) for state in local.state.values() for v in state.values() if isinstance(v, torch.Tensor)
            )
    return held


def _state(module: torch.nn.Module, optimizers: list, peak: int, live: int, strategy: DryRunStrategy) -> dict[str, Any]:
    from lightning_ptdp.data_parallel.zero1 import local_optimizer

    states = [state for opt in optimizers for state in local_optimizer(opt).state.items()]
    held = {id(p): sum(_bytes(v) for v in s.values() if isinstance(v, torch.Tensor)) for p, s in states}
    params = list(module.named_parameters())
    # torch's DDP cannot wrap meta parameters, so it is left out: it keeps its own copy of the replicated
    # gradients in its buckets (gradient_as_bucket_view=False, ddp.py's setting) and all-reduces them once
    replicated = strategy.dry_run_ddp_gradients(module)
    holders = sorted(((n, _bytes(p) + _bytes(p.grad) + held.get(id(p), 0)) for n, p in params), key=lambda kv: -kv[1])
    counted = {
        "parameters": sum(_bytes(p) for _, p in params),
        "gradients": sum(_bytes(p.grad) for _, p in params),
        "optimizer": sum(held.values()),
        "buffers": sum(_bytes(b) for b in module.buffers()),
    }
    return {
        **counted,
        "ddp_buckets": replicated,
        "other": max(live - sum(counted.values()), 0),
        "step_peak": peak + replicated,
        "holders": tuple(holders[:5]),
    }


@contextlib.contextmanager
def _process_left_as_found() -> Iterator[None]:
    """The strategy's run sets the launch environment and catches SIGTERM: a dry run in the user's
    process puts both back."""
    import os
    import signal

    keys = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK")
    saved, handler = {k: os.environ.get(k) for k in keys}, signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        for key, value in saved.items():
            os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)
        signal.signal(signal.SIGTERM, handler)


def representative_ranks(dims: ParallelDims, zero_stage: int = 0) -> dict[int, tuple[int, ...]]:
    """The first rank of each pipeline stage, with the ranks it stands for: within a stage the tp,
    cp, dp and ep shards are equal in size (an uneven split differs by at most one row; FSDP2 pads
    its shards). Under ZeRO-1 each dp rank apart: torch's ZeroRedundancyOptimizer gives each whole
    parameters, unevenly (the first dp rank runs; ``_zero1_shards`` builds the others' optimizers)."""
    stages: dict[tuple[int, int], list[int]] = {}
    for rank in range(dims.world_size):
        where = dims.coordinates(rank)
        stages.setdefault((where["pp"], where["dp"] if zero_stage == 1 else 0), []).append(rank)
    return {ranks[0]: tuple(ranks) for ranks in stages.values()}


def dry_run_layout(
    factory: Factory, layout: dict[str, Any], *, world_size: int, precision: str = "32-true"
) -> LayoutReport:
    """One layout: ptdp's setup and two meta training steps on a representative rank of each stage,
    under the Trainer's ``precision``."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  registers the "fake" backend

    from lightning_ptdp.config import ParallelConfig

    started = time.perf_counter()
    dims = ParallelDims.from_config(ParallelConfig(**_config_keys(layout)), world_size)
    communication = Communication(mesh_axes(dims))
    ranks, volume, broadcasts = [], {}, Broadcasts()
    stand_ins = representative_ranks(dims, layout.get("zero_stage", 0))
    run = {rank: like for rank, like in stand_ins.items() if dims.coordinates(rank)["dp"] == 0}
    for rank, like in sorted(run.items(), reverse=True):  # the last stage first
        if dist.is_initialized():
            raise RuntimeError("dry_run needs no process group: call it outside a distributed run")
        dist.init_process_group("fake", store=dist.HashStore(), rank=rank, world_size=world_size)
        try:
            with _process_left_as_found():
                measured = _one_rank(factory, layout, rank, world_size, communication, broadcasts, precision)
        finally:
            dist.destroy_process_group()
        carried, ddp = dict(communication.bytes), measured["ddp_buckets"]
        if ddp:  # DDP's all-reduce, in buckets of its default 25 MiB
            axis = "dp" if dims.cp == 1 else f"{dims.dp * dims.cp} ranks"  # DDP's group: dp, or dp x cp
            carried[axis] = carried.get(axis, 0) + ddp
            buckets = -(-ddp // (25 * 2**20))
            measured["collectives"] += ((axis, "all_reduce", dims.dp * dims.cp, ddp, buckets),)
        for axis, count in carried.items():  # the busiest stage's bytes on each axis bound the step
            volume[axis] = max(volume.get(axis, 0), count)
        shards = measured.pop("zero1_shards")
        ranks.append(RankMemory(rank=rank, like=like, **measured))
        for other, other_like in stand_ins.items():  # ZeRO-1: the stage's other dp ranks, their own shards
            where = dims.coordinates(other)
            if other != rank and where["pp"] == dims.coordinates(rank)["pp"] and where["dp"] < len(shards):
                held = shards[where["dp"]]
                delta = held - measured["optimizer"]
                changed = dict(measured, optimizer=held, step_peak=measured["step_peak"] + delta)
                ranks.append(RankMemory(rank=other, like=other_like, **changed))
    ranks.sort(key=lambda r: r.rank)
    return LayoutReport(dict(layout), world_size, tuple(ranks), volume, time.perf_counter() - started)


def _precision(precision: str) -> dict[str, Any]:
    """The Trainer's precision on the meta accelerator: a mixed one autocasts as on the CPU (Lightning
    would pick CUDA's autocast for an accelerator it did not choose), which ``MetaCalls`` applies to meta."""
    from lightning.pytorch.plugins import MixedPrecision

    if precision.endswith("-mixed"):
        return {"plugins": [MixedPrecision(precision, device="cpu")]}  # type: ignore[arg-type]
    return {"precision": precision}


def _config_keys(layout: dict[str, Any]) -> dict[str, Any]:
    import dataclasses

    from lightning_ptdp.config import ParallelConfig

    names = {f.name for f in dataclasses.fields(ParallelConfig)}
    return {k: v for k, v in layout.items() if k in names}


def _one_rank(
    factory: Factory,
    layout: dict[str, Any],
    rank: int,
    world_size: int,
    communication: Communication,
    broadcasts: Broadcasts,
    precision: str = "32-true",
) -> dict[str, Any]:
    try:
        built = factory()
    except Exception as error:
        raise ValueError(
            f"dry_run: the factory {getattr(factory, '__qualname__', factory)} raised {type(error).__name__}: {error}; "
            "it must build the LightningModule with no arguments (on any device: the dry run moves it to meta)"
        ) from error
    module, data = built if isinstance(built, tuple) else (built, None)
    if not isinstance(module, pl.LightningModule):
        raise TypeError(
            f"dry_run: the factory returned {type(module).__name__}; it must return a LightningModule "
            "(or a (LightningModule, LightningDataModule) pair)"
        )
    if type(module).training_step is pl.LightningModule.training_step:
        raise TypeError(f"dry_run: {type(module).__name__} defines no training_step; the dry run measures one")
    module = _to_meta(module)
    measure = _StepMemory(communication)
    strategy = DryRunStrategy(
        **layout,
        cluster_environment=_OneRank(rank, world_size),
        parallel_devices=[torch.device("meta")] * world_size,
        accelerator=_MetaAccelerator(),
        on_nonfinite="ignore",  # meta tensors hold no values to check
    )
    trainer = pl.Trainer(
        strategy=strategy,
        devices=world_size,
        max_steps=MEASURED_STEP + 1,
        callbacks=[measure],
        **_precision(precision),
        **{k: v for k, v in QUIET_TRAINER.items() if k != "accelerator"},  # the strategy brings its own
    )
    reads = MetaCalls()
    reads.name(module)
    with (
        reads,
        MetaShapes(reads),
        fake_group_reads(broadcasts),
        _failure_names_the_reads(module, reads),
    ):
        if data is None or isinstance(data, pl.LightningDataModule):
            trainer.fit(module, datamodule=data)
        else:  # the dataloader(s) the user's fit was given
            trainer.fit(module, train_dataloaders=data)
    assert measure.measured is not None
    return measure.measured


@contextlib.contextmanager
def _failure_names_the_reads(module: pl.LightningModule, reads: MetaCalls) -> Iterator[None]:
    """A step that fails on meta (not a refusal of ptdp's) says which values it read: they read as 0."""
    try:
        yield
    except (RuntimeError, IndexError) as error:
        if not reads.seen:
            raise
        raise MetaRunError(
            f"dry_run: {type(module).__name__} failed on the meta device ({type(error).__name__}: "
            f"{str(error).splitlines()[0]}) after reading values a dry run does not have, each taken as 0: "
            + "; ".join(reads.seen[:4])
            + ". Compute such sizes from shapes or Python constants, or build that value as a plain Python number"
        ) from error


class MetaRunError(RuntimeError):
    """The user's model cannot run its step on the meta device: the message names the values it read."""


def _to_meta(module: pl.LightningModule) -> pl.LightningModule:
    """A module the factory built with real tensors moves to meta (configure_model's build is on
    meta already); buffers computed from values become meta too, as the dry run needs shapes only."""
    real = [n for n, t in (*module.named_parameters(), *module.named_buffers()) if not t.is_meta]
    if real:
        module._apply(lambda t: t.to("meta"))
    return module
