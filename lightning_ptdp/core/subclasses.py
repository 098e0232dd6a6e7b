"""Running a torch function on the plain tensors behind a tensor subclass: what TP's
``VocabParallelLogits``, CP's ``SequenceShard`` and the fused loss's ``HeadLogits`` do for every
operation they do not keep; and ``F.cross_entropy``'s arguments by name, which each of them takes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch


def convert(value: Any, kind: type, how: Callable[[Any], Any]) -> Any:
    """``how(value)`` for an instance of ``kind``, inside tuples, lists and dicts too; anything else as is."""
    if isinstance(value, kind):
        return how(value)
    if isinstance(value, (tuple, list)):
        return type(value)(convert(v, kind, how) for v in value)
    if type(value) is dict:  # a step's output dict; other mappings (a transformers ModelOutput) as they are
        return {k: convert(v, kind, how) for k, v in value.items()}
    return value


def run_converted(func: Any, args: tuple, kwargs: dict, kind: type, how: Callable[[Any], Any]) -> Any:
    """``func`` on the arguments with every ``kind`` instance converted, subclass dispatch off."""
    with torch._C.DisableTorchFunctionSubclass():
        return func(*(convert(a, kind, how) for a in args), **{k: convert(v, kind, how) for k, v in kwargs.items()})


@dataclass(frozen=True)
class CrossEntropyCall:
    """``F.cross_entropy``'s arguments by name. ``plain``: no class weights and no legacy
    ``size_average``/``reduce``, the cases a subclass computes its own way."""

    input: Any
    target: Any
    weight: Optional[torch.Tensor] = None
    size_average: Optional[bool] = None
    ignore_index: int = -100
    reduce: Optional[bool] = None
    reduction: str = "mean"
    label_smoothing: float = 0.0

    @property
    def plain(self) -> bool:
        return self.weight is None and self.size_average is None and self.reduce is None

    def options(self) -> dict:
        """The keyword arguments besides input and target, to call ``F.cross_entropy`` again."""
        names = ("weight", "size_average", "ignore_index", "reduce", "reduction", "label_smoothing")
        return {name: getattr(self, name) for name in names}
