"""PTDPStrategy: Lightning's hooks in one class, each delegating to parallel/, the axes' packages,
checkpoint/ and faults/ (docs/architecture.md). Under PP the step hooks route the batch through the
rank's pipeline engine; collectives follow the dp group for logged values, the world for decisions."""

from __future__ import annotations

import dataclasses
import functools
import logging
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Generator, Literal, Optional, Union

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.ddp import _DDPForwardRedirection
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_ptdp import config as cfg
from lightning_ptdp import probe
from lightning_ptdp.checkpoint import Checkpointer
from lightning_ptdp.checkpoint.io import CheckedCheckpointIO
from lightning_ptdp.checkpoint.resume import resume_dataloader
from lightning_ptdp.core.dims import ParallelDims, init_process_group
from lightning_ptdp.core.shutdown import process_group_failed
from lightning_ptdp.expert_parallel import check_ep_plan
from lightning_ptdp.faults.nonfinite import check_grad_scaler
from lightning_ptdp.faults.records import FailureRecords
from lightning_ptdp.parallel.compile import adopt_compiled_module
from lightning_ptdp.parallel.head_logits import step_outputs
from lightning_ptdp.parallel.init import is_on_meta
from lightning_ptdp.parallel.parallelize import Parallelized, parallelize
from lightning_ptdp.parallel.pretrained import Pretrained, parameters_on_meta
from lightning_ptdp.pipeline import PipelineEngine
from lightning_ptdp.tensor_parallel.explicit_plan import check_plan

log = logging.getLogger(__name__)


class PTDPStrategy(ParallelStrategy):
    """Pipeline x tensor x data parallelism (Narayanan et al. 2021) behind the standard Trainer.

    ``Trainer(strategy="ptdp")`` with no arguments is plain data parallelism over all devices.
    The degrees multiply to the world size (devices x num_nodes); ``data_parallel_size="auto"``
    takes what t and p leave. The LightningModule stays ordinary: no parallel code inside.
    """

    strategy_name = "ptdp"

    def __init__(
        self,
        *,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        expert_parallel_size: int = 1,
        context_parallel_size: int = 1,
        data_parallel_size: Union[int, Literal["auto"]] = "auto",
        virtual_pipeline_size: int = 1,
        micro_batch_size: Optional[int] = None,
        sequence_parallel: bool = False,
        strict_plan: bool = False,
        certify_plan: bool = True,
        zero_stage: int = 0,
        data_parallel_shard_size: Optional[int] = None,
        activation_checkpointing: Optional[cfg.RecomputeMode] = None,
        pipeline_schedule: cfg.PipelineSchedule = "interleaved_1f1b",
        kernels: cfg.KernelMode = "auto",
        overlap_grad_reduce: bool = True,
        compile: Union[bool, dict, cfg.CompileConfig] = False,
        float8: Union[bool, str, dict, cfg.Float8Config, None] = None,
        fused_loss: Optional[bool] = None,
        expert_capacity_factor: Optional[float] = None,
        expert_balance: Union[bool, int, dict, cfg.ExpertBalanceConfig, None] = None,
        tp_plan: Optional[dict[str, str]] = None,
        ep_plan: Optional[dict[str, str]] = None,
        pretrained: Optional[str] = None,
        pretrained_prefix: Optional[str] = None,
        on_nonfinite: cfg.NonfinitePolicy = "raise",
        checkpoint_format: cfg.CheckpointFormat = "sharded",
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = cfg.DEFAULT_TIMEOUT,
        failure_timeout: timedelta = cfg.FAILURE_TIMEOUT,
        start_method: cfg.StartMethod = "popen",
        accelerator: Optional["pl.accelerators.Accelerator"] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io if checkpoint_io is not None else CheckedCheckpointIO(),
            precision_plugin=precision_plugin,
        )
        given = locals()  # every ParallelConfig and RunOptions field is an argument of the same name
        self.parallel_config, self.options = (
            c(**{f.name: given[f.name] for f in dataclasses.fields(c)}) for c in (cfg.ParallelConfig, cfg.RunOptions)
        )
        self.pretrained = None if pretrained is None else Pretrained(path=str(pretrained), prefix=pretrained_prefix)
        self.tp_plan = check_plan(
            tp_plan, tensor_parallel_size=tensor_parallel_size, sequence_parallel=self.parallel_config.sequence_parallel
        )
        self.ep_plan = check_ep_plan(ep_plan, self.parallel_config.expert_parallel_size)
        self.checkpointer = Checkpointer(format=checkpoint_format)
        self._process_group_backend = process_group_backend
        self._parallelized: Optional[Parallelized] = None
        self._failures: Optional[FailureRecords] = None
        self._forward_redirection = _DDPForwardRedirection()
        self._dims: Optional[ParallelDims] = None
        self._device_mesh: Optional[DeviceMesh] = None
        self._expert_mesh: Optional[DeviceMesh] = None  # (pp, edp, ep, tp) when expert_parallel_size > 1
        self._dp_group: Optional[tuple[Any, int]] = None
        self.num_nodes = 1

    @property
    def checkpoint_format(self) -> str:
        return self.checkpointer.format

    @checkpoint_format.setter
    def checkpoint_format(self, value: str) -> None:
        self.options = dataclasses.replace(self.options, checkpoint_format=value)  # validated again
        self.checkpointer = Checkpointer(format=value)

    @property
    def _lightning_module(self) -> Optional[pl.LightningModule]:
        return self.__dict__.get("_ptdp_lightning_module")

    @_lightning_module.setter
    def _lightning_module(self, module: Optional[pl.LightningModule]) -> None:
        """Trainer.fit hands ``torch.compile(lightning_module)`` over here, before Lightning would refuse it."""
        if adopt_compiled_module(module):
            compiled = self.parallel_config.compile or True
            self.parallel_config = dataclasses.replace(self.parallel_config, compile=compiled)
        self.__dict__["_ptdp_lightning_module"] = module

    @property  # ------------------------------------------------------------------ topology
    def parallel_dims(self) -> ParallelDims:
        """The resolved degrees; known once the world size is (Trainer construction)."""
        if self._dims is None:
            self._dims = ParallelDims.from_config(self.parallel_config, self.num_nodes * self.num_processes)
        return self._dims

    @property
    def device_mesh(self) -> DeviceMesh:
        """The (pp, dp, tp) mesh, or (pp, dp, cp, tp) when c > 1; it exists after ``setup_environment``."""
        if self._device_mesh is None:
            raise RuntimeError(
                "PTDPStrategy.device_mesh is built in setup_environment(); access it from configure_model() "
                "or later hooks, not before Trainer.fit/validate/test/predict started"
            )
        return self._device_mesh

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        """Lightning injects its DistributedSampler only for strategies that say they are distributed."""
        return True

    @property
    def process_group_backend(self) -> Optional[str]:
        return self._process_group_backend

    @override  # ------------------------------------------------------------------ launch and setup
    def _configure_launcher(self) -> None:
        """Called at Trainer construction: validate the layout before any process is started."""
        assert self.cluster_environment is not None
        self._dims = None
        _ = self.parallel_dims
        check_grad_scaler(self.precision_plugin, self.options.on_nonfinite)
        if self.cluster_environment.creates_processes_externally:
            return
        if self.options.start_method == "popen":
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = _MultiProcessingLauncher(self, start_method=self.options.start_method)

    @override
    def setup_environment(self) -> None:
        """Called on every rank before the model is set up: process group, then the (pp, dp[, cp], tp) mesh."""
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        default_backend = _get_default_process_group_backend_for_device(self.root_device)
        self._process_group_backend = self._process_group_backend or default_backend
        init_process_group(
            self.cluster_environment, self._process_group_backend, self.options.timeout, self.root_device
        )
        self._failures = FailureRecords.open(self.global_rank, self.world_size, self.options.failure_timeout)
        if not getattr(self.cluster_environment, "auto_requeue", False):  # SLURM requeue owns SIGTERM there
            self._failures.catch_sigterm()  # until teardown: a launcher's SIGTERM stops this rank through on_exception
        self._dims = ParallelDims.from_config(self.parallel_config, self.world_size)
        self._device_mesh = self._dims.build_mesh(self.root_device.type)
        self._expert_mesh = self._dims.build_expert_mesh(self.root_device.type) if self._dims.ep > 1 else None
        self._dp_group = None  # (group, size), looked up on the first reduce
        where = self._dims.coordinates(self.global_rank)
        log.info("rank %d: mesh coordinates %s of %s", self.global_rank, where, self._dims.mesh_shape)
        # Same attribute ModelParallelStrategy sets, so configure_model() code ports unchanged.
        self.lightning_module._device_mesh = self._device_mesh

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        """Called on every rank after setup_environment: shard the model, then build optimizers."""
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        fitting = trainer.state.fn == TrainerFn.FITTING
        if self.parallel_dims.pp > 1:
            check_grad_scaler(self.precision_plugin, self.options.on_nonfinite, pipeline=True)
        self._parallelized = parallel = parallelize(
            self.model,
            config=self.parallel_config,
            dims=self.parallel_dims,
            mesh=self.device_mesh,
            probe=lambda: probe.forward_probe(self, trainer),
            tp_plan=self.tp_plan,
            ep_plan=self.ep_plan,
            training=fitting,
            pipeline_probe=lambda: probe.microbatch_probe(self, trainer, self.parallel_config.micro_batch_size),
            device=self.root_device,
            pretrained=self.pretrained,
            on_nonfinite=self.options.on_nonfinite,
            expert_mesh=self._expert_mesh,
        )
        self.model = parallel.module
        parallel.gradients.take_over_clipping(self.precision_plugin)
        if fitting:
            self.setup_optimizers(trainer)
            self.optimizers = parallel.shard_optimizer_states(self.optimizers, self.lr_scheduler_configs)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)

    @property  # ------------------------------------------------------------------ steps
    def pipeline(self) -> Optional[PipelineEngine]:
        """This rank's pipeline engine (its chunks, the last step's measured timeline); None if p = 1."""
        return self._parallelized.pipeline if self._parallelized is not None else None

    @property
    def expert_report(self) -> Any:
        """The split MoE layers and their exchange stats (callbacks.ExpertLoad); None if e = 1."""
        return self._parallelized.ep_report if self._parallelized is not None else None

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Under PP: the whole batch through the pipeline schedule (forward and backward of every
        microbatch); returns the mean loss on every rank. Otherwise Lightning's own step."""
        if self.expert_report is not None:  # this step's exchange stats, which callbacks.ExpertLoad reads
            self.expert_report.stats.reset()
        engine = self.pipeline
        if engine is None:
            return step_outputs(super().training_step)(*args, **kwargs)
        module = self.lightning_module
        step = step_outputs(functools.partial(module.training_step, **kwargs))
        scale = 1.0 / module.trainer.accumulate_grad_batches
        with self.precision_plugin.train_step_context():
            return engine.train_step(
                step, args[0], args[1:], scale, gradients=self._parallelized.gradients, failures=self._failures
            )

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Under PP the schedule already ran backward inside training_step: its gradients are
        added here (after Lightning's zero_grad), between the usual hooks."""
        if self.pipeline is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        self._parallelized.gradients.apply_pending()
        closure_loss = self.precision_plugin.post_backward(closure_loss, self.lightning_module)
        self.post_backward(closure_loss)
        return closure_loss

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """Right after backward, before Lightning's clipping and the step: the gradients' owner
        finishes them and checks on all ranks together that loss and gradients are finite."""
        params = [p for group in optimizer.param_groups for p in group["params"]]

        def closure_then_finish() -> Any:
            output = closure()
            self._parallelized.gradients.finish(params, output, self.lightning_module.trainer.global_step)
            return output

        stepped = super().optimizer_step(optimizer, closure_then_finish, model, **kwargs)
        self._parallelized.stepped(optimizer)  # expert_balance: the experts move every interval steps
        return stepped

    def _eval_step(self, name: str, args: tuple, kwargs: dict, context: Any, collect: bool = False) -> Any:
        engine = self.pipeline
        if engine is None:
            return step_outputs(getattr(super(), name))(*args, **kwargs)
        step = step_outputs(functools.partial(getattr(self.lightning_module, name), **kwargs))
        with context():
            return engine.eval_step(step, args[0], args[1:], collect=collect, failures=self._failures)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("validation_step", args, kwargs, self.precision_plugin.val_step_context)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval_step("test_step", args, kwargs, self.precision_plugin.test_step_context)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """Under PP the predictions of the last stage, returned on every rank."""
        return self._eval_step("predict_step", args, kwargs, self.precision_plugin.predict_step_context, True)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Resuming mid-epoch: start the training dataloader at the checkpoint's batch (checkpoint/resume.py)."""
        return resume_dataloader(self.lightning_module.trainer if self.lightning_module else None, dataloader)

    @override
    def model_to_device(self) -> None:
        """Tensors built on the meta device stay there: parallelize materialises this rank's shards."""
        assert self.model is not None
        if is_on_meta(self.model):
            self.model._apply(lambda t: t if t.is_meta else t.to(self.root_device))  # what Module.to does, meta kept
        else:
            self.model.to(self.root_device)

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        """``configure_model`` builds on the meta device (no memory); after TP and the pipeline split cut
        the model, each rank allocates and initialises only what it holds, with the single-process values
        (parallel/init.py). ``empty_init=False``, or ``trainer.init_module()`` before the run: real tensors."""
        if empty_init is False or self._device_mesh is None:  # outside a run (trainer.init_module()): Lightning's way
            with super().tensor_init_context(empty_init):
                yield
            return
        meta = parameters_on_meta() if self.pretrained is not None else torch.device("meta")  # pretrained: buffers real
        with meta, self.precision_plugin.tensor_init_context():
            yield

    @property  # ------------------------------------------------------------------ collectives on the (pp, dp, cp, tp) world
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Replicas are the dp ranks: all tp and pp ranks of one replica read the same samples."""
        dp = self.device_mesh["dp"]
        return {"num_replicas": dp.size(), "rank": dp.get_local_rank()}

    @override
    def reduce(
        self, tensor: Union[torch.Tensor, Any], group: Optional[Any] = None, reduce_op: Optional[Any] = "mean"
    ) -> Union[torch.Tensor, Any]:
        """A logged value, reduced over the dp group (tp/pp ranks of one replica hold the same value)."""
        if not isinstance(tensor, torch.Tensor):
            return tensor
        if group is None and self._device_mesh is not None:
            if self._dp_group is None:
                dp = self.device_mesh["dp"]
                self._dp_group = (dp.get_group(), dp.size())
            group, members = self._dp_group
            if members == 1:  # any reduction over one replica is the value itself: no barrier, no all-reduce
                return tensor
        return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """One decision for the whole world (not per dp group): ModelCheckpoint's top-k update and
        file names, EarlyStopping's stop; every rank must then join the same save."""
        if not _distributed_is_initialized():
            return decision
        flag = torch.tensor(int(decision), device=self.root_device)
        dist.all_reduce(flag, op=dist.ReduceOp.SUM)
        return bool(flag == self.world_size) if all else bool(flag)

    @override
    def barrier(self, name: Optional[str] = None) -> None:
        if _distributed_is_initialized():
            dist.barrier(device_ids=[self.root_device.index]) if dist.get_backend() == "nccl" else dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """``obj`` from global rank ``src``."""
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    @property  # ------------------------------------------------------------------ checkpoints (checkpoint/)
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # loading cuts the saved tensors to this rank's shards: after parallelize

    @property
    def _sharding(self) -> Any:
        assert self._parallelized is not None, "checkpoints are saved and loaded after setup"
        return self._parallelized.sharding

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return self.checkpointer.model_state(self._sharding)

    @override
    def load_model_state_dict(self, state: Any, strict: bool = True) -> None:
        self.checkpointer.load_model_state(self._sharding, state, strict)

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return self.checkpointer.optimizer_state(self._sharding, getattr(optimizer, "_optimizer", optimizer))

    @override
    def load_optimizer_state_dict(self, state: Any) -> None:
        optimizers = [getattr(o, "_optimizer", o) for o in self.optimizers]
        self.checkpointer.load_optimizer_states(self._sharding, optimizers, state)
        _optimizers_to_device(self.optimizers, self.root_device)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """A folder is a sharded checkpoint, loaded here in place (optimizers only when fitting); a file is full."""
        path = self.broadcast(str(checkpoint_path))
        if not Checkpointer.is_sharded(path):
            loaded = super().load_checkpoint(path, weights_only=weights_only)
            Checkpointer.restore_rng(loaded)
            return loaded
        module = self.lightning_module
        fitting = module.trainer.state.fn == TrainerFn.FITTING
        optimizers = [getattr(o, "_optimizer", o) for o in self.optimizers] if fitting else []
        return self.checkpointer.load_sharded(
            path, self._sharding, optimizers, weights_only=weights_only, strict=module.strict_loading
        )

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        Checkpointer.remove(str(filepath), self.checkpoint_io.remove_checkpoint)

    @override
    def save_checkpoint(self, state: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """A failure on any rank is raised on every rank; the previous checkpoint stays as it was."""
        self.checkpointer.save(
            state,
            str(filepath),
            layout=self.parallel_dims.checkpoint_layout(self.parallel_config),
            storage_options=storage_options,
            write_file=lambda full: self.checkpoint_io.save_checkpoint(full, filepath, storage_options=storage_options),
        )

    @override  # ------------------------------------------------------------------ failures and teardown
    def on_exception(self, exception: BaseException) -> None:
        """Called by Lightning on every rank whose run raised, before its teardown: this rank's own
        error is recorded for its peers; one whose collective broke because a peer stopped gets a
        message naming that rank and its error (faults/records.py)."""
        process_group_failed()
        if self._failures is not None:
            self._failures.on_exception(exception)

    @override
    def teardown(self) -> None:
        """Unwrap the DDP wrapper so the LightningModule is usable again after fit; SIGTERM as before the run."""
        if self._failures is not None:
            self._failures.release_sigterm()
        if isinstance(self.model, DistributedDataParallel):
            self.model = self.lightning_module
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="PTD-P: pipeline x tensor x data parallelism (lightning-ptdp)"
        )
