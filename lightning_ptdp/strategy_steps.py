"""Lightning's step hooks of PTDPStrategy: under pipeline parallelism each routes the whole batch
through the rank's pipeline engine (pipeline/engine.py); otherwise Lightning's own step runs."""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch
from lightning.pytorch.strategies import ParallelStrategy
from typing_extensions import override

from lightning_ptdp.pipeline import PipelineEngine


class PipelineSteps(ParallelStrategy):
    """Mixed into PTDPStrategy; ``_parallelized`` is set by its ``setup``."""

    _parallelized: Any = None

    @property
    def pipeline(self) -> Optional[PipelineEngine]:
        """This rank's pipeline engine (its chunks, the last step's measured timeline); None if p = 1."""
        return self._parallelized.pipeline if self._parallelized is not None else None

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Under PP: the whole batch through the pipeline schedule (forward and backward of every
        microbatch); returns the mean loss on every rank. Otherwise Lightning's own step."""
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
        engine.gradients.apply_pending()
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
