"""The setup probes: one ordinary step of the user's LightningModule before parallelism is applied,
so tensor-parallel discovery and the pipeline split see the blocks' real inputs. Logging and
torchmetrics updates are muted; on a model built on the meta device values read out are zero."""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Generator, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning_utilities.core.apply_func import apply_to_collection
from torch.overrides import TorchFunctionMode

from lightning_ptdp.meta_routing import MetaRouting
from lightning_ptdp.parallel.init import is_on_meta
from lightning_ptdp.pipeline import split_microbatches


class MetaScalarsAsZero(TorchFunctionMode):
    """A value read out of a meta tensor (``.item()``, ``bool(mask.any())``: transformers checks
    for packed sequences so) is 0: the probe needs shapes only, and such checks guard rare paths."""

    _READS = {
        torch.Tensor.item,
        torch.Tensor.__bool__,
        torch.Tensor.tolist,
        torch.Tensor.__int__,
        torch.Tensor.__float__,
    }

    def __init__(self) -> None:
        super().__init__()
        self.known: Any = {}  # meta tensor -> its values, where a balanced routing gives them (``MetaRouting``)

    def on_read(self, func: Any, tensor: torch.Tensor) -> None:
        """Told of each read, by this mode or one nested inside it (the dry run records them)."""

    def knows(self, tensor: torch.Tensor) -> bool:
        return tensor in self.known

    def value_of(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.known[tensor]

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        if func in self._READS and args and isinstance(args[0], torch.Tensor) and args[0].is_meta:
            tensor = args[0]
            modes = [
                m
                for m in (self, *torch.overrides._get_current_function_mode_stack())
                if isinstance(m, MetaScalarsAsZero)
            ]
            knower = next((m for m in modes if m.knows(tensor)), None)
            if knower is not None:
                return func(knower.value_of(tensor), *args[1:], **(kwargs or {}))
            for mode in modes:
                mode.on_read(func, tensor)
            return func(torch.zeros(tensor.shape, dtype=tensor.dtype), *args[1:], **(kwargs or {}))
        return func(*args, **(kwargs or {}))


@contextmanager
def side_effects_muted(module: pl.LightningModule) -> Generator[None, None, None]:
    """The probe's ``self.log`` calls and torchmetrics updates do not count (on a model built on
    the meta device they could not: values are unknown); on meta, routing is taken as balanced."""
    from torchmetrics import Metric

    metrics = [m for m in module.modules() if isinstance(m, Metric)]
    updates = [m.__dict__.get("update") for m in metrics]
    module.log = lambda *args, **kwargs: None  # type: ignore[method-assign]
    for metric in metrics:
        metric.update = lambda *args, **kwargs: None  # type: ignore[method-assign]
    try:
        scalars = MetaScalarsAsZero()
        balanced = is_on_meta(module) and not MetaRouting.active()  # the dry run has its own
        with scalars, MetaRouting(scalars) if balanced else nullcontext():
            yield
    finally:
        del module.log
        for metric, update in zip(metrics, updates):
            if update is None:
                del metric.update
            else:
                metric.update = update


def stage_step(strategy: Strategy, trainer: pl.Trainer) -> tuple[Callable[..., Any], Any]:
    """The stage's step method and its dataloader's first batch (on this device, or on meta)."""
    module = strategy.lightning_module
    loop, step = {
        TrainerFn.FITTING: (trainer.fit_loop, module.training_step),
        TrainerFn.VALIDATING: (trainer.validate_loop, module.validation_step),
        TrainerFn.TESTING: (trainer.test_loop, module.test_step),
        TrainerFn.PREDICTING: (trainer.predict_loop, module.predict_step),
    }[trainer.state.fn]
    loader = loop._data_source.dataloader()  # Lightning has no public "the stage's dataloader" hook
    if isinstance(loader, (list, tuple)):
        loader = loader[0]
    return step, probe_batch(strategy, next(iter(loader)))


def probe_batch(strategy: Strategy, batch: Any) -> Any:
    """A batch for the setup probes: on the meta device while the model is (shapes only)."""
    if strategy.model is not None and is_on_meta(strategy.model):
        return apply_to_collection(batch, torch.Tensor, lambda t: t.to("meta"))
    return strategy.batch_to_device(batch)


def forward_probe(strategy: Strategy, trainer: pl.Trainer) -> Any:
    """One ordinary step on a sample batch: ``example_input_array`` when the module has one, else
    the first batch of the stage's dataloader (the loop's data source knows every way Lightning
    accepts data). Returns what the step returns (data parallelism reads its autograd graph)."""
    module = strategy.lightning_module
    if module.example_input_array is not None:
        example = probe_batch(strategy, module.example_input_array)
        with side_effects_muted(module):
            return module(*example) if isinstance(example, tuple) else module(example)
    step, batch = stage_step(strategy, trainer)
    with side_effects_muted(module):
        return step(batch, 0)


def microbatch_probe(
    strategy: Strategy, trainer: pl.Trainer, micro_batch_size: Optional[int]
) -> tuple[Callable[[], None], int]:
    """One ordinary step on the first microbatch of the stage's first batch, for the pipeline split;
    returned unrun, with the batch's sample count."""
    step, batch = stage_step(strategy, trainer)
    fitting = trainer.state.fn == TrainerFn.FITTING
    microbatches, rows = split_microbatches(batch, micro_batch_size, strict=fitting)
    module, plugin = strategy.lightning_module, strategy.precision_plugin

    def run() -> None:
        with side_effects_muted(module), plugin.forward_context():
            step(microbatches[0], 0)

    return run, rows
