"""PTDPStrategy: Lightning hooks only; the parallel work is delegated to mesh.py and parallelize.py."""

from __future__ import annotations

import functools
import logging
import os
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Generator, Literal, Optional, Union

import lightning.pytorch as pl
import torch
from torch.overrides import TorchFunctionMode
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning_utilities.core.apply_func import apply_to_collection
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

from lightning_ptdp.config import ParallelConfig
from lightning_ptdp.failure import FAILURE_TIMEOUT, FailureRecords, check_timeout
from lightning_ptdp.mesh import ParallelDims, destroy_process_group_at_exit, process_group_failed
from lightning_ptdp.nonfinite import NONFINITE_POLICIES, apply_policy, nonfinite_ranks
from lightning_ptdp.parallelize import Parallelized, parallelize
from lightning_ptdp import checkpoint, distcp
from lightning_ptdp.distcp_load import LOADED_IN_PLACE
from lightning_ptdp.distcp_load import load as load_sharded
from lightning_ptdp import init as ptdp_init
from lightning_ptdp.pretrained import Pretrained, parameters_on_meta
from lightning_ptdp.pipeline import PipelineEngine, split_microbatches
from lightning_ptdp.resume import resume_at
from lightning_ptdp.pipeline.grads import average_data_parallel_gradients, sum_tied_gradients
from lightning_ptdp.tensor_parallel.consolidate import clip_grad_norm, sum_partial_gradients

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = timedelta(minutes=10)
"""Collective timeout: long enough for a slow first NCCL connect, short enough that a dead rank
turns into an error on the others within minutes instead of torch's 30."""


PROCESS_GROUP_BACKENDS = ("gloo", "nccl", "mpi", "ucc", "xccl")
CHECKPOINT_FORMATS = ("sharded", "full")


def _checked_tp_plan(plan: Optional[dict[str, str]], config: ParallelConfig) -> Optional[dict[str, str]]:
    """An explicit tensor-parallel plan: {module path: style}, consistent with the layout."""
    if plan is None:
        return None
    from lightning_ptdp.tensor_parallel.apply import EXPLICIT_STYLES
    from lightning_ptdp.tensor_parallel.explicit_plan import fused_parts

    if not isinstance(plan, dict):
        raise ValueError(f"tp_plan={plan!r} must be a dict of module path -> style, e.g. {{'blocks.0.attn.q': 'colwise'}}")
    for path, style in plan.items():
        kind, _, parts = str(style).partition(":")
        fused = kind == "colwise_fused" and fused_parts(parts) is not None
        if not isinstance(path, str) or not (fused or (style in EXPLICIT_STYLES)):
            raise ValueError(
                f"tp_plan[{path!r}]={style!r} is not a style: use one of "
                f"{', '.join(repr(s) for s in EXPLICIT_STYLES)}, 'colwise_fused:K' (K equal parts) or "
                "'colwise_fused:a|b|c' (parts of a, b, c heads, e.g. q | k | v = 4|2|2)"
            )
    if config.tensor_parallel_size == 1:
        raise ValueError("tp_plan is given but tensor_parallel_size=1; set tensor_parallel_size > 1 or drop tp_plan")
    if config.sequence_parallel:
        raise ValueError("sequence_parallel=True needs the discovered plan; drop tp_plan or sequence_parallel")
    return plan


class _MetaScalarsAsZero(TorchFunctionMode):
    """During a setup probe on the meta device, a value read out of a meta tensor (``.item()``,
    ``bool(mask.any())``: transformers checks for packed sequences so) is 0: the probe only
    needs shapes, and such checks guard rare paths (here: no packed sequences)."""

    _READS = {torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.tolist, torch.Tensor.__int__, torch.Tensor.__float__}

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        if func in self._READS and args and isinstance(args[0], torch.Tensor) and args[0].is_meta:
            zeros = torch.zeros(args[0].shape, dtype=args[0].dtype)
            return func(zeros, *args[1:], **(kwargs or {}))
        return func(*args, **(kwargs or {}))


@contextmanager
def _side_effects_muted(module: "pl.LightningModule") -> Generator[None, None, None]:
    """A setup probe runs the user's step once: its ``self.log`` calls and torchmetrics updates
    must not count (and on a model built on the meta device they could not: values are unknown)."""
    from torchmetrics import Metric

    metrics = [m for m in module.modules() if isinstance(m, Metric)]
    updates = [m.__dict__.get("update") for m in metrics]
    module.log = lambda *args, **kwargs: None  # type: ignore[method-assign]
    for metric in metrics:
        metric.update = lambda *args, **kwargs: None  # type: ignore[method-assign]
    try:
        with _MetaScalarsAsZero():
            yield
    finally:
        del module.log
        for metric, update in zip(metrics, updates):
            if update is None:
                del metric.update
            else:
                metric.update = update


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
        data_parallel_size: Union[int, Literal["auto"]] = "auto",
        virtual_pipeline_size: int = 1,
        micro_batch_size: Optional[int] = None,
        sequence_parallel: bool = False,
        zero_stage: int = 0,
        activation_checkpointing: Optional[Literal["full", "selective"]] = None,
        pipeline_schedule: Literal["interleaved_1f1b", "1f1b", "gpipe", "zero_bubble"] = "interleaved_1f1b",
        kernels: Literal["auto", "triton", "torch"] = "auto",
        tp_plan: Optional[dict[str, str]] = None,
        pretrained: Optional[str] = None,
        pretrained_prefix: Optional[str] = None,
        on_nonfinite: Literal["raise", "skip", "ignore"] = "raise",
        checkpoint_format: Literal["sharded", "full"] = "sharded",
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = DEFAULT_TIMEOUT,
        failure_timeout: timedelta = FAILURE_TIMEOUT,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
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
            checkpoint_io=checkpoint_io if checkpoint_io is not None else checkpoint.CheckedCheckpointIO(),
            precision_plugin=precision_plugin,
        )
        self.parallel_config = ParallelConfig(
            tensor_parallel_size=tensor_parallel_size,
            pipeline_parallel_size=pipeline_parallel_size,
            data_parallel_size=data_parallel_size,
            virtual_pipeline_size=virtual_pipeline_size,
            micro_batch_size=micro_batch_size,
            sequence_parallel=sequence_parallel,
            zero_stage=zero_stage,
            activation_checkpointing=activation_checkpointing,
            pipeline_schedule=pipeline_schedule,
            kernels=kernels,
        )
        self.pretrained = None if pretrained is None else Pretrained(path=str(pretrained), prefix=pretrained_prefix)
        self.tp_plan = _checked_tp_plan(tp_plan, self.parallel_config)
        if on_nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"on_nonfinite={on_nonfinite!r} is not one of 'raise', 'skip', 'ignore'; choose one of those")
        self.on_nonfinite = on_nonfinite
        if checkpoint_format not in CHECKPOINT_FORMATS:
            raise ValueError(
                f"checkpoint_format={checkpoint_format!r} is not one of 'sharded' (each rank writes its pieces, a folder) "
                "or 'full' (rank 0 writes one file of unsharded tensors); choose one of those"
            )
        self.checkpoint_format = checkpoint_format
        self._parallelized: Optional[Parallelized] = None
        if start_method not in ("popen", "spawn", "fork", "forkserver"):
            raise ValueError(f"start_method={start_method!r} must be 'popen', 'spawn', 'fork' or 'forkserver'")
        if process_group_backend not in (None, *PROCESS_GROUP_BACKENDS):
            raise ValueError(
                f"process_group_backend={process_group_backend!r} is not one of "
                f"{', '.join(repr(b) for b in PROCESS_GROUP_BACKENDS)}; or None for gloo on CPU, nccl on GPU"
            )
        if timeout is not None and not isinstance(timeout, timedelta):
            raise ValueError(f"timeout={timeout!r} must be a datetime.timedelta (e.g. timedelta(minutes=10)) or None")
        if timeout is not None and timeout.total_seconds() <= 0:
            raise ValueError(f"timeout={timeout} must be positive; a dead rank turns into an error after it")
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self.failure_timeout = check_timeout(failure_timeout)
        self._failures: Optional[FailureRecords] = None
        self._start_method = start_method
        self._forward_redirection = _DDPForwardRedirection()
        self._dims: Optional[ParallelDims] = None
        self._device_mesh: Optional[DeviceMesh] = None
        self._dp_group: Optional[tuple[Any, int]] = None
        self.num_nodes = 1

    # ------------------------------------------------------------------ topology
    @property
    def parallel_dims(self) -> ParallelDims:
        """The resolved degrees; known once the world size is (Trainer construction)."""
        if self._dims is None:
            self._dims = ParallelDims.from_config(self.parallel_config, self.num_nodes * self.num_processes)
        return self._dims

    @property
    def device_mesh(self) -> DeviceMesh:
        """The (pp, dp, tp) mesh; it exists after ``setup_environment``."""
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

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Replicas are the dp ranks: all tp and pp ranks of one replica read the same samples."""
        dp = self.device_mesh["dp"]
        return {"num_replicas": dp.size(), "rank": dp.get_local_rank()}

    # ------------------------------------------------------------------ launch and setup
    @override
    def _configure_launcher(self) -> None:
        """Called at Trainer construction: validate the layout before any process is started."""
        assert self.cluster_environment is not None
        self._dims = None
        _ = self.parallel_dims
        self._check_grad_scaler()
        if self.cluster_environment.creates_processes_externally:
            return
        if self._start_method == "popen":
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = _MultiProcessingLauncher(self, start_method=self._start_method)

    @override
    def setup_environment(self) -> None:
        """Called on every rank before the model is set up: process group, then the 3D mesh."""
        super().setup_environment()
        self._setup_distributed()
        self._failures = FailureRecords.open(self.global_rank, self.world_size, self.failure_timeout)
        self._dims = ParallelDims.from_config(self.parallel_config, self.world_size)
        self._device_mesh = self._dims.build_mesh(self.root_device.type)
        self._dp_group = None  # (group, size), looked up on the first reduce
        coords = self._dims.coordinates(self.global_rank)
        log.info("rank %d: mesh coordinates %s of %s", self.global_rank, coords, self._dims.mesh_shape)
        assert self.lightning_module is not None
        # Same attribute ModelParallelStrategy sets, so configure_model() code ports unchanged.
        self.lightning_module._device_mesh = self._device_mesh

    def _setup_distributed(self) -> None:
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._process_group_backend or _get_default_process_group_backend_for_device(
            self.root_device
        )
        assert self.cluster_environment is not None
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        if self.root_device.type != "cpu":
            kwargs["device_id"] = self.root_device
        created = not _distributed_is_initialized()
        _init_dist_connection(self.cluster_environment, self._process_group_backend, **kwargs)
        if created:  # this process's group is the strategy's to close (not a caller's, e.g. a test pool)
            destroy_process_group_at_exit()

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        """Called on every rank after setup_environment: shard the model, then build optimizers."""
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        fitting = trainer.state.fn == TrainerFn.FITTING
        if self.parallel_dims.pp > 1:
            self._check_pipeline_precision()
        self._parallelized = parallelize(
            self.model,
            config=self.parallel_config,
            dims=self.parallel_dims,
            mesh=self.device_mesh,
            probe=lambda: self._probe_forward(trainer),
            tp_plan=self.tp_plan,
            training=fitting,
            pipeline_probe=lambda: self._microbatch_probe(trainer),
            device=self.root_device,
            pretrained=self.pretrained,
        )
        self.model = self._parallelized.module
        if self.pipeline is not None:
            self.pipeline.failures = self._failures
        if self._parallelized.tp_report is not None or self._parallelized.pipeline is not None:
            self._clip_by_global_norm()
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _clip_by_global_norm(self) -> None:
        """Lightning clips by the norm of the gradients a rank holds; under tensor or pipeline
        parallelism that is a part, so clipping would differ per rank and from a single process.
        Clip by the norm of the whole model instead, over t, p and (ZeRO) d, a weight tied across
        stages counted once (the precision plugin's hook, so every precision gets it)."""
        plugin, parallel = self.precision_plugin, self._parallelized

        def clip_grad_by_norm(optimizer: Any, clip_val: float) -> None:
            params = list(plugin.main_params(optimizer))
            dp_group = self.device_mesh["dp"].get_group() if self.parallel_config.zero_stage > 0 else None
            pipeline = parallel.pipeline
            pp_group = pipeline.pp_group if pipeline is not None else None
            exclude = pipeline.split.norm_exclude() if pipeline is not None else frozenset()
            clip_grad_norm(
                params, self.lightning_module, parallel.tp_group, float(clip_val), dp_group, pp_group, exclude
            )

        plugin.clip_grad_by_norm = clip_grad_by_norm

    def _check_grad_scaler(self) -> None:
        """A GradScaler skips a step whose (scaled) gradients overflow, and lowers the scale: normal
        in its first steps. The non-finite policy runs before it unscales, so "raise" would stop on
        those overflows and "skip" would leave the scaler no gradients to check: refused together."""
        if getattr(self.precision_plugin, "scaler", None) is not None and self.on_nonfinite != "ignore":
            raise ValueError(
                "precision='16-mixed' scales the loss with a GradScaler, which skips a step whose gradients overflow "
                "and lowers the scale: that is how it works, not a failure, but "
                f"on_nonfinite={self.on_nonfinite!r} would act on it (the check sees the still-scaled gradients). "
                "With PTDPStrategy use precision='bf16-mixed', or on_nonfinite='ignore' to let the GradScaler "
                "decide alone"
            )

    def _check_pipeline_precision(self) -> None:
        if getattr(self.precision_plugin, "scaler", None) is not None:
            raise ValueError(
                "precision='16-mixed' scales the loss with a GradScaler, which the pipeline schedule's backward "
                "cannot apply; with pipeline_parallel_size > 1 use precision='bf16-mixed', 'bf16-true' or '32-true'"
            )

    def _stage_step(self, trainer: "pl.Trainer") -> tuple[Any, Any]:
        """The stage's step method and its dataloader's first batch (on this device)."""
        module = self.lightning_module
        stage = trainer.state.fn
        loop, step = {
            TrainerFn.FITTING: (trainer.fit_loop, module.training_step),
            TrainerFn.VALIDATING: (trainer.validate_loop, module.validation_step),
            TrainerFn.TESTING: (trainer.test_loop, module.test_step),
            TrainerFn.PREDICTING: (trainer.predict_loop, module.predict_step),
        }[stage]
        loader = loop._data_source.dataloader()  # Lightning has no public "the stage's dataloader" hook
        if isinstance(loader, (list, tuple)):
            loader = loader[0]
        return step, self._probe_batch(next(iter(loader)))

    def _probe_batch(self, batch: Any) -> Any:
        """A batch for the setup probes: on the meta device while the model is (shapes only)."""
        if self.model is not None and ptdp_init.is_on_meta(self.model):
            return apply_to_collection(batch, torch.Tensor, lambda t: t.to("meta"))
        return self.batch_to_device(batch)

    def _microbatch_probe(self, trainer: "pl.Trainer") -> tuple[Any, int]:
        """One ordinary step on the first microbatch of the stage's first batch (logging muted), for
        the pipeline split; returns it unrun with its sample count."""
        step, batch = self._stage_step(trainer)
        microbatches, rows = split_microbatches(
            batch, self.parallel_config.micro_batch_size, strict=trainer.state.fn == TrainerFn.FITTING
        )
        module = self.lightning_module

        def run() -> None:
            with _side_effects_muted(module), self.precision_plugin.forward_context():
                step(microbatches[0], 0)

        return run, rows

    def _probe_forward(self, trainer: "pl.Trainer") -> None:
        """One ordinary step on a sample batch, so discovery sees the blocks' real inputs.

        Uses ``example_input_array`` when the module has one, else the first batch of the stage's
        dataloader (through the loop's data source, which knows every way Lightning accepts data).
        """
        module = self.lightning_module
        assert module is not None
        if module.example_input_array is not None:
            example = self._probe_batch(module.example_input_array)
            module(*example) if isinstance(example, tuple) else module(example)
            return
        step, batch = self._stage_step(trainer)
        with _side_effects_muted(module):
            step(batch, 0)

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """Right after backward, before Lightning's clipping and the step: sum weights tied across
        pipeline stages, finish tensor-parallel gradients (sequence-parallel norms, replicated KV
        heads), average over dp under PP (no DDP there), then check, on all ranks together, that
        the loss and gradients are finite (``on_nonfinite``)."""
        parallel = self._parallelized
        params = [p for group in optimizer.param_groups for p in group["params"]]

        def closure_then_finish() -> Any:
            output = closure()
            pipeline = parallel.pipeline if parallel is not None else None
            if pipeline is not None:
                dp = self.device_mesh["dp"]
                zero_dp = (dp.get_local_rank(), dp.size()) if self.parallel_config.zero_stage > 0 else None
                sum_tied_gradients(pipeline.split, pipeline.pp_group, self.root_device, zero_dp)
            if parallel is not None and parallel.tp_report is not None:
                sum_partial_gradients(self.lightning_module, parallel.tp_report.partial_grad_params, parallel.tp_group)
            if pipeline is not None and self.parallel_config.zero_stage == 0:
                average_data_parallel_gradients(params, self.device_mesh["dp"].get_group(), self.parallel_dims.dp)
            if self.on_nonfinite != "ignore":
                step = self.lightning_module.trainer.global_step if self.lightning_module is not None else -1
                apply_policy(self.on_nonfinite, nonfinite_ranks(output, params), step, params)
            return output

        return super().optimizer_step(optimizer, closure_then_finish, model, **kwargs)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Resuming mid-epoch: start the training dataloader at the checkpoint's batch (resume.py)."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or not trainer.training or not trainer.fit_loop.restarting:
            return dataloader
        done = trainer.fit_loop.epoch_loop.batch_progress.current.processed
        try:
            total = len(dataloader)  # type: ignore[arg-type]
        except TypeError:
            total = None
        if total is not None and done >= total:
            return dataloader
        return resume_at(dataloader, done)

    # ------------------------------------------------------------------ pipeline steps
    @property
    def pipeline(self) -> Optional[PipelineEngine]:
        """This rank's pipeline engine (its chunks, the last step's measured timeline); None if p = 1."""
        return self._parallelized.pipeline if self._parallelized is not None else None

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Under PP: the whole global batch through the pipeline schedule (forward and backward of
        every microbatch); returns the mean loss on every rank. Otherwise Lightning's own step."""
        engine = self.pipeline
        if engine is None:
            return super().training_step(*args, **kwargs)
        module = self.lightning_module
        step = functools.partial(module.training_step, **kwargs)
        with self.precision_plugin.train_step_context():
            return engine.train_step(step, args[0], args[1:], 1.0 / module.trainer.accumulate_grad_batches)

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Under PP the schedule already ran backward inside training_step: its gradients are
        added here (after Lightning's zero_grad), between the usual hooks."""
        engine = self.pipeline
        if engine is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        engine.apply_pending_grads()
        closure_loss = self.precision_plugin.post_backward(closure_loss, self.lightning_module)
        self.post_backward(closure_loss)
        return closure_loss

    def _eval_step(self, name: str, args: tuple, kwargs: dict, context: Any, collect: bool = False) -> Any:
        engine = self.pipeline
        if engine is None:
            return getattr(super(), name)(*args, **kwargs)
        step = functools.partial(getattr(self.lightning_module, name), **kwargs)
        with context():
            return engine.eval_step(step, args[0], args[1:], collect=collect)

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

    def _tensor_parallel(self) -> bool:
        return self._parallelized is not None and self._parallelized.tp_report is not None

    def _pp_group(self) -> Any:
        engine = self.pipeline
        return engine.pp_group if engine is not None else None

    def _sharded_by_zero(self) -> bool:
        return self.parallel_config.zero_stage > 0 and self._parallelized is not None

    @override
    def model_to_device(self) -> None:
        """Tensors built on the meta device stay there: parallelize materialises this rank's shards."""
        assert self.model is not None
        if ptdp_init.is_on_meta(self.model):
            self.model._apply(lambda t: t if t.is_meta else t.to(self.root_device))  # what Module.to does, meta kept
        else:
            self.model.to(self.root_device)

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        """``configure_model`` builds on the meta device (no memory); after tensor and pipeline
        parallelism cut the model, each rank allocates and initialises only what it holds, with
        the values the single-process model has (lightning_ptdp.init). ``empty_init=False``, or
        ``trainer.init_module()`` before the run: real tensors, as Lightning does."""
        if empty_init is False or self._device_mesh is None:  # outside a run (trainer.init_module()): Lightning's way
            with super().tensor_init_context(empty_init):
                yield
            return
        if self.pretrained is not None:  # values come from the files: buffers stay real
            with parameters_on_meta(), self.precision_plugin.tensor_init_context():
                yield
            return
        with torch.device("meta"), self.precision_plugin.tensor_init_context():
            yield

    # ------------------------------------------------------------------ checkpoints
    # Sharded (default): every rank writes its pieces of the original tensors (distcp.py), nothing
    # is gathered. Full: rank 0 writes one file of unsharded tensors (checkpoint.py). Either loads
    # on any layout; loading happens after setup, into the parallelized model.
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    def _aliases(self) -> Optional[dict[str, list[str]]]:
        engine = self.pipeline
        return engine.split.aliases if engine is not None else None

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Sharded: this rank's pieces. Full: unsharded weights; a collective under TP, PP and ZeRO."""
        assert self.lightning_module is not None
        if self.checkpoint_format == "sharded":
            return distcp.model_pieces(self.lightning_module, self._aliases())
        return checkpoint.model_state(
            self.lightning_module, tensor_parallel=self._tensor_parallel(), zero=self._sharded_by_zero(),
            pp_group=self._pp_group(),
        )

    @override
    def load_model_state_dict(self, state: Any, strict: bool = True) -> None:
        """Checkpoints hold unsharded weights: cut them to this rank's shards (any saved layout)."""
        assert self.lightning_module is not None
        if state.get(LOADED_IN_PLACE):
            return
        checkpoint.load_model_state(
            self.lightning_module, state["state_dict"], strict=strict,
            tensor_parallel=self._tensor_parallel(), zero=self._sharded_by_zero(), pipeline=self._pp_group() is not None,
        )

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """Sharded: this rank's pieces. Full: unsharded, a collective under TP, PP and ZeRO."""
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        if self.checkpoint_format == "sharded":
            return distcp.optimizer_pieces(self.lightning_module, optimizer, self._aliases())
        return checkpoint.optimizer_state(
            self.lightning_module, optimizer,
            tensor_parallel=self._tensor_parallel(), zero=self._sharded_by_zero(), pp_group=self._pp_group(),
        )

    @override
    def load_optimizer_state_dict(self, state: Any) -> None:
        if state.get(LOADED_IN_PLACE):
            return
        for optimizer, optimizer_state in zip(self.optimizers, state["optimizer_states"]):
            checkpoint.load_optimizer_state(
                self.lightning_module, getattr(optimizer, "_optimizer", optimizer), optimizer_state,
                tensor_parallel=self._tensor_parallel(), zero=self._sharded_by_zero(), aliases=self._aliases(),
            )
        _optimizers_to_device(self.optimizers, self.root_device)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """A folder is a sharded checkpoint: loaded here, in place, on every rank (optimizers only
        when fitting); a file is full."""
        path = self.broadcast(str(checkpoint_path))
        if not (os.path.isdir(path) or os.path.islink(path)):
            loaded = super().load_checkpoint(path, weights_only=weights_only)
            checkpoint.restore_rng_states(loaded.pop(checkpoint.RNG_KEY, None), self.global_rank)
            return loaded
        if weights_only:
            raise ValueError(
                f"weights_only=True cannot be honoured for the sharded checkpoint {path!r}: torch.distributed.checkpoint "
                "unpickles its metadata and Lightning's state in full. Load only checkpoints you trust, with "
                "weights_only=None or False; or consolidate it (ptdp checkpoint consolidate) and load that file"
            )
        module = self.lightning_module
        assert module is not None
        fitting = module.trainer.state.fn == TrainerFn.FITTING
        return load_sharded(
            path, module=module, optimizers=[getattr(o, "_optimizer", o) for o in self.optimizers] if fitting else [],
            aliases=self._aliases(), rank=self.global_rank, world_size=self.world_size,
            strict=module.strict_loading, pipeline=self._pp_group() is not None,
        )

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            if os.path.islink(str(filepath)) or os.path.isdir(str(filepath)):
                distcp.remove(str(filepath))
            else:
                self.checkpoint_io.remove_checkpoint(filepath)

    @override
    def save_checkpoint(self, state: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """A failure (disk full, quota) is raised on every rank, so none waits in the barrier that
        follows a save until the collective timeout; the previous checkpoint stays as it was."""
        if self.checkpoint_format == "sharded":
            return self._save_sharded(state, filepath, storage_options)
        rng: list[Any] = [None] * self.world_size
        if _distributed_is_initialized():
            dist.all_gather_object(rng, checkpoint.collect_rng_states())
        else:
            rng = [checkpoint.collect_rng_states()]
        state = {**state, checkpoint.RNG_KEY: rng}
        failure = None
        if self.is_global_zero:
            try:
                self.checkpoint_io.save_checkpoint(state, filepath, storage_options=storage_options)
            except Exception as error:  # reported to all ranks below, then raised here with its cause
                cause = root = error
                while root.__cause__ is not None or root.__context__ is not None:  # torch.save wraps OS errors
                    root = root.__cause__ or root.__context__
                failure = f"{type(root).__name__}: {root}"
        failure = self.broadcast(failure, src=0)
        if failure is not None:
            message = f"saving checkpoint {str(filepath)!r} failed on rank 0 ({failure}); the previous checkpoint is untouched"
            if self.is_global_zero:
                raise checkpoint.CheckpointSaveError(message) from cause
            raise checkpoint.CheckpointSaveError(message)

    def _save_sharded(self, state: dict[str, Any], filepath: Any, storage_options: Optional[Any]) -> None:
        if storage_options is not None or "://" in str(filepath):
            raise ValueError(
                f"checkpoint_format='sharded' writes to a local or mounted shared folder; {str(filepath)!r} with "
                f"storage_options={storage_options!r} is not one. Use checkpoint_format='full' for remote storage"
            )
        dims = self.parallel_dims
        layout = dict(t=dims.tp, p=dims.pp, d=dims.dp, v=self.parallel_config.virtual_pipeline_size,
                      zero=self.parallel_config.zero_stage, world_size=self.world_size)
        flat = distcp.flat_state(state, self.global_rank, layout)
        try:
            distcp.save(flat, self.broadcast(str(filepath)))
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as error:  # DCP's CheckpointException (a BaseException) carries every rank's outcome
            raise checkpoint.CheckpointSaveError(
                f"saving checkpoint {str(filepath)!r} failed ({distcp.describe_failure(error)}); the previous "
                "checkpoint is untouched"
            ) from error

    # ------------------------------------------------------------------ collectives
    @override
    def reduce(
        self, tensor: Union[torch.Tensor, Any], group: Optional[Any] = None, reduce_op: Optional[Any] = "mean"
    ) -> Union[torch.Tensor, Any]:
        """Reduce a logged value over the dp group (tp/pp ranks of one replica hold the same value).
        Decisions reduce over the world (``reduce_boolean_decision``); ``broadcast`` is from a global rank."""
        if not isinstance(tensor, torch.Tensor):
            return tensor
        if group is None and self._device_mesh is not None:
            if self._dp_group is None:
                dp = self._device_mesh["dp"]
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
        if not _distributed_is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    # ------------------------------------------------------------------ failures
    @override
    def on_exception(self, exception: BaseException) -> None:
        """Called by Lightning on every rank whose fit/validate/test/predict raised, before its
        teardown: this rank's own error is recorded for its peers; a collective that broke because
        a peer stopped gets a message naming that rank and its error (failure.py)."""
        process_group_failed()
        if self._failures is not None:
            self._failures.on_exception(exception)

    # ------------------------------------------------------------------ teardown
    @override
    def teardown(self) -> None:
        """Unwrap the DDP wrapper so the LightningModule is usable again after fit."""
        if isinstance(self.model, DistributedDataParallel):
            self.model = self.lightning_module
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="PTD-P: pipeline x tensor x data parallelism (lightning-ptdp)"
        )
