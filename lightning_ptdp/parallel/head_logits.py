"""The LM head's logits before they exist: ``HeadLogits`` holds the head's input, weight and bias and
stands for the (..., V) logits. ``F.cross_entropy`` on it computes the loss chunk of rows by chunk
(parallel/chunked_loss.py): torch's own cross-entropy per chunk, TP's vocabulary-parallel one, or on
this CP rank's tokens. Reshapes, token-wise indexing and splits that keep the vocabulary last act on
the head's input; casts and pointwise functions of the logits alone (a softcap) become steps after the
head, run per chunk. Anything else computes the logits as the head would have (same autocast, same
weights) and runs on them, so its result is today's; an in-place change computes them and keeps them.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from lightning_ptdp.context_parallel.tail import SequenceShard, context_cross_entropy
from lightning_ptdp.core.subclasses import CrossEntropyCall, convert
from lightning_ptdp.parallel.chunked_loss import Head, Rule, apply_after, autocast_now, chunked_cross_entropy
from lightning_ptdp.tensor_parallel.logits import VocabParallelLogits
from lightning_ptdp.tensor_parallel.op_semantics import AtenOps

log = logging.getLogger(__name__)

_ATTRIBUTES = {"shape", "dtype", "device", "ndim", "requires_grad", "is_cuda", "is_cpu", "is_meta", "layout"}
_ATTRIBUTES |= {"is_leaf", "grad_fn", "_base", "is_sparse", "is_quantized", "is_nested", "names", "_version"}
_METADATA = {"size", "dim", "numel", "__len__", "is_floating_point", "is_complex", "get_device", "element_size"}
_METADATA |= {"is_contiguous", "stride"}
_CASTS = {"float": torch.float32, "double": torch.float64, "half": torch.float16, "bfloat16": torch.bfloat16}


class _Cast:
    """``.to(dtype)`` (``.float()``, ``.type_as(...)``) after the head."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.to(self.dtype)


class _Pointwise:
    """A function of the logits alone, element by element (aten's pointwise tag on every op it runs), with
    its other, scalar arguments: a softcap's ``/ cap``, ``tanh``, ``* cap``, a logit scale."""

    def __init__(self, func: Callable[..., torch.Tensor], args: tuple, kwargs: dict) -> None:
        self.func, self.args, self.kwargs = func, args, kwargs

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        return self.func(logits, *self.args, **self.kwargs)


def _pointwise(func: Any, dtype: torch.dtype, args: tuple, kwargs: dict) -> Optional[tuple[_Pointwise, torch.dtype]]:
    """``func(logits, *args, **kwargs)`` as a step after the head, with its result's dtype, where every
    other argument is a number and every aten op it runs is pointwise and not random (tried on a meta
    tensor, once per call signature: a step's argmax asks each step); else None."""
    if not all(isinstance(v, (bool, int, float)) or v is None for v in (*args, *kwargs.values())):
        return None
    out = _pointwise_dtype(func, dtype, args, tuple(sorted(kwargs.items())))
    return None if out is None else (_Pointwise(func, args, kwargs), out)


@functools.lru_cache(maxsize=1024)
def _pointwise_dtype(func: Any, dtype: torch.dtype, args: tuple, kwargs: tuple) -> Optional[torch.dtype]:
    probe = torch.empty((2, 3), dtype=dtype, device="meta")
    with AtenOps() as seen:
        try:
            out = func(probe, *args, **dict(kwargs))
        except Exception:  # not a function of one tensor and numbers
            return None
    if not isinstance(out, torch.Tensor) or out.shape != probe.shape or not seen.ops:
        return None
    tags = [op.tags for op, *_ in seen.ops]
    if not all(torch.Tag.pointwise in t and torch.Tag.nondeterministic_seeded not in t for t in tags):
        return None  # a step run again per chunk and in backward must give the same values: no random op
    return out.dtype


class HeadLogits(torch.Tensor):
    """The logits of ``head`` on ``hidden``, not computed; see the module docstring for the rules.
    Once a use computed them (``_value``), the stand-in is those logits for every later use."""

    _hidden: torch.Tensor
    _head: Head
    _value: Optional[torch.Tensor]
    _family: dict  # shared by every stand-in made from one head call: who changed the logits in place

    @staticmethod
    def make(hidden: torch.Tensor, head: Head, family: Optional[dict] = None) -> "HeadLogits":
        shape = (*hidden.shape[:-1], head.weight.shape[0])  # a SequenceShard reports the whole sequence
        grad = torch.is_grad_enabled() and (hidden.requires_grad or head.weight.requires_grad)
        out = torch.Tensor._make_wrapper_subclass(
            HeadLogits, shape, dtype=head.dtype, device=hidden.device, requires_grad=grad
        )
        out._hidden, out._head, out._value = hidden, head, None
        out._family = family if family is not None else {"changed_by": None}
        return out

    def derived(self, hidden: torch.Tensor, head: Optional[Head] = None) -> "HeadLogits":
        return HeadLogits.make(hidden, head or self._head, self._family)

    def computed(self) -> torch.Tensor:
        """The logits, as the head would have returned them (then the loss code's steps after it)."""
        if self._value is not None:
            return self._value
        head = self._head
        if self._family["changed_by"] is not None:
            raise RuntimeError(
                f"fused_loss: the LM head's logits were changed in place ({self._family['changed_by']}) after "
                "this view of them was taken, and the view was never computed; change a copy, or pass "
                "fused_loss=False to the strategy"
            )
        if head.weight._version != head.version:
            raise RuntimeError(
                "fused_loss: these logits are read after the LM head's weight changed (an optimizer step): they "
                "were never computed, and the weight they stood for is gone; read them inside the step that made "
                "them, or pass fused_loss=False to the strategy"
            )
        logits = apply_after(head, head.logits(self._hidden, head.weight, head.bias))
        if head.vocab is not None:
            logits = VocabParallelLogits.wrap(logits, *head.vocab)
        if logits.requires_grad:
            for hook in head.hooks:
                logits.register_hook(hook)
        self._value = logits
        return logits

    def head_input(self) -> torch.Tensor:
        """The (..., h) rows the logits are the head's output of."""
        return self._hidden

    def whole(self) -> torch.Tensor:
        """The logits a step returns: computed, and whole where CP cut them."""
        out = self.computed()
        return out.whole() if isinstance(out, SequenceShard) else out

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        # every torch function is answered above; an aten op here came from below them (a C++ caller)
        raise RuntimeError(f"fused_loss: {func} reached the uncomputed logits below torch's Python API")

    def __repr__(self, **kwargs: Any) -> str:
        return f"HeadLogits(shape={tuple(self.shape)}, dtype={self.dtype}, not computed)"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "__get__" and getattr(func.__self__, "__name__", "") in _ATTRIBUTES or name in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if name == "register_hook":
            return _Hook(args[0]._head.hooks, args[1])
        for value in (*args, *kwargs.values()):
            if isinstance(value, HeadLogits) and value._value is None and value._family["changed_by"]:
                value.computed()  # refuses: the in-place change cannot be replayed on this view
        first = args[0] if args and isinstance(args[0], HeadLogits) and args[0]._value is None else None
        if func is F.cross_entropy:
            out = _cross_entropy(*args, **kwargs)
            if out is not None:
                return out
        elif first is not None and _in_place(name):  # computed once, changed; later uses read the change
            first._head.seen(name)
            func(first.computed(), *convert(args[1:], HeadLogits, HeadLogits.computed), **kwargs)
            first._family["changed_by"] = name
            return first
        elif first is not None:
            out = _on_hidden(name, first, args[1:], kwargs)
            step = None if out is not None else _pointwise(func, first.dtype, args[1:], kwargs)
            if step is not None:
                return first.derived(first._hidden, first._head.then(*step))
            if out is not None:
                return out
        for value in (*args, *kwargs.values()):
            if isinstance(value, HeadLogits) and value._value is None:
                value._head.seen(name or str(func))
        return func(*convert(args, HeadLogits, HeadLogits.computed), **convert(kwargs, HeadLogits, HeadLogits.computed))


def _in_place(name: str) -> bool:
    return name == "__setitem__" or (name.endswith("_") and not name.startswith("_")) or name.startswith("__i")


def step_outputs(step: Callable[..., Any]) -> Callable[..., Any]:
    """``step`` returning its logits computed (and whole under CP): what reaches callbacks and
    ``trainer.predict`` is a plain tensor, made before any optimizer step changes the weights."""

    def run(*args: Any, **kwargs: Any) -> Any:
        out = convert(step(*args, **kwargs), HeadLogits, HeadLogits.whole)
        return convert(out, SequenceShard, SequenceShard.whole)

    return run


def _on_hidden(name: str, logits: HeadLogits, args: tuple, kwargs: dict) -> Optional[Any]:
    """A reshape, token-wise index, split or cast that keeps the vocabulary last, done to the head's
    input: the result stands for the logits it would have given. None where the op is not one."""
    hidden, head, width = logits._hidden, logits._head, logits.shape[-1]
    if name in _CASTS and not args and not kwargs:
        return logits.derived(hidden, head.then(_Cast(_CASTS[name]), _CASTS[name]))
    if name in ("to", "type_as") and not kwargs and len(args) == 1:
        dtype = args[0] if isinstance(args[0], torch.dtype) else getattr(args[0], "dtype", None)
        if isinstance(dtype, torch.dtype) and (name == "type_as" or isinstance(args[0], torch.dtype)):
            return logits.derived(hidden, head.then(_Cast(dtype), dtype))
        return None
    if name == "contiguous" and not args:
        return logits
    if name in ("view", "reshape") and not kwargs:
        shape = list(args[0] if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)) else args)
        if not shape or not all(isinstance(s, int) for s in shape) or shape[-1] not in (width, head.vocab_size, -1):
            return None
        shape[-1] = hidden.shape[-1]
        return logits.derived(getattr(hidden, name)(*shape))
    if name == "flatten" and not kwargs and len(args) == 2:
        end = args[1] % logits.dim()
        return logits.derived(hidden.flatten(*args)) if end < logits.dim() - 1 else None
    if name in ("split", "chunk"):
        dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
        if not isinstance(dim, int) or dim % logits.dim() == logits.dim() - 1 or len(args) < 1:
            return None
        parts = getattr(hidden, name)(args[0], dim=dim)
        return tuple(logits.derived(part) for part in parts)
    if name == "__getitem__" and len(args) == 1 and _keeps_vocabulary(args[0], logits.dim()):
        return logits.derived(hidden[args[0]])  # the same index on (..., h): a full slice at h
    return None


def _keeps_vocabulary(index: Any, ndim: int) -> bool:
    """``index`` leaves the last (vocabulary) dim whole: ``logits[:, :-1]``, ``logits[:, :-1, :]``,
    ``logits[mask]`` with a (B, T) mask, ``logits[..., :-1, :]``; not ``logits[..., 0]`` or ``[None]``."""
    items = list(index) if isinstance(index, tuple) else [index]
    if any(i is None for i in items) or sum(i is Ellipsis for i in items) > 1:
        return False
    if items and items[-1] is Ellipsis:
        return True
    if Ellipsis in items:
        landing = items[-1]  # the items after ... end at the vocabulary
    else:
        taken = sum(i.dim() if isinstance(i, torch.Tensor) and i.dtype == torch.bool else 1 for i in items)
        if taken < ndim:
            return True
        landing = items[-1] if taken == ndim else None
    return isinstance(landing, slice) and landing == slice(None)


def _cross_entropy(*args: Any, **kwargs: Any) -> Optional[torch.Tensor]:
    """The fused loss, or None where its rules do not hold (the caller then computes the logits)."""
    call = CrossEntropyCall(*args, **kwargs)
    logits, target, reduction, ignore_index = call.input, call.target, call.reduction, call.ignore_index
    lazy = isinstance(logits, HeadLogits) and logits._value is None
    if not lazy or not call.plain or isinstance(target, (HeadLogits, SequenceShard)):
        return None
    hidden, head = logits._hidden, logits._head
    rule = Rule(ignore_index, float(call.label_smoothing), autocast_now(hidden.device))
    if isinstance(hidden, SequenceShard):  # CP: this rank's tokens, the sum over ranks (context_parallel/tail.py)
        if reduction == "none":
            return None
        out = context_cross_entropy(
            hidden,
            target,
            reduction,
            ignore_index,
            lambda local, mine: chunked_cross_entropy(local, mine, head, rule, True),
        )
    elif hidden.dim() != 2 or target.dim() != 1 or target.shape[0] != hidden.shape[0]:
        return None
    else:
        out = chunked_cross_entropy(hidden, target, head, rule, reduction != "none")
        if reduction == "mean":
            out = out / (target != ignore_index).sum()
    if out is not None:
        head.seen("cross_entropy")
        if out.requires_grad:  # the loss's gradient arrives when the logits' would have: their hooks run then
            for hook in head.hooks:
                out.register_hook(functools.partial(_run_only, hook))
    return out


def _run_only(hook: Callable[[torch.Tensor], Any], grad: torch.Tensor) -> None:
    hook(grad)  # no logits gradient exists for its result to replace


class _Hook:
    """The handle ``register_hook`` returns, as torch's: ``remove()`` takes the hook off."""

    def __init__(self, hooks: list, hook: Callable[[torch.Tensor], Any]) -> None:
        self.hooks, self.hook = hooks, hook
        hooks.append(hook)

    def remove(self) -> None:
        if self.hook in self.hooks:
            self.hooks.remove(self.hook)
