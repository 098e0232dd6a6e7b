"""Running a torch function on the plain tensors behind a tensor subclass: what TP's
``VocabParallelLogits`` and CP's ``SequenceShard`` do for every operation they do not keep."""

from __future__ import annotations

from typing import Any, Callable

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
