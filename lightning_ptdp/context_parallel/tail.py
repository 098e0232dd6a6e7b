"""The sequence after the last block, still cut: ``SequenceShard`` holds this rank's tokens of it
and reports the whole tensor's sizes, as in one process. Token-wise work stays local: the final
norm, the LM head, casts, softcapping, reshapes that merge batch and sequence. ``F.cross_entropy``
on it is the mean over every rank's tokens (``ignore_index`` counted on each rank, the counts
summed): logits and loss 1/c per rank, as in Megatron. Anything else (a shift ``logits[:, :-1]``,
argmax, returning the logits) gathers the whole sequence first, always correct, logged once.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd import Function

from lightning_ptdp.context_parallel.layout import CPGroup, gather_sequence, own_chunks
from lightning_ptdp.core.subclasses import CrossEntropyCall, run_converted

log = logging.getLogger(__name__)

_SHAPE = torch._C.TensorBase.__dict__["shape"]
_METADATA = {"dim", "__get__", "data_ptr", "element_size", "is_contiguous", "stride"}
_METADATA |= {"register_hook", "retain_grad", "requires_grad_", "is_floating_point", "get_device", "storage_offset"}
_ARITHMETIC = ("mul", "add", "sub", "truediv", "div")
_ELEMENTWISE = {"float", "double", "half", "bfloat16", "to", "type_as", "contiguous", "detach", "clone"}
_ELEMENTWISE |= {"tanh", "pow", "rsqrt", "sigmoid", "neg", "__neg__", "gelu", "silu", "relu", "dropout"}
_ELEMENTWISE |= {*_ARITHMETIC, *(f"__{op}__" for op in _ARITHMETIC), *(f"__r{op}__" for op in _ARITHMETIC)}
_ROWWISE = {"softmax", "log_softmax", "mean", "sum"}  # over the last dim
_VIEWS = {"view", "reshape", "flatten"}


class _SumOverContext(Function):
    """The loss's shares summed over cp; backward times c (gradients average over dp x cp, see layout.py)."""

    @staticmethod
    def forward(ctx, share: torch.Tensor, cp: CPGroup) -> torch.Tensor:
        ctx.c = cp.size
        total = share.detach().clone()
        dist.all_reduce(total, group=cp.group)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.c, None


class SequenceShard(torch.Tensor):
    """This rank's tokens of a [batch, sequence, ...] tensor ("seq") or of its [batch*sequence, ...]
    rows ("rows"); see the module docstring for the rules."""

    _cp: CPGroup
    _batch: int
    _rows: bool
    _warned_gather = False

    @staticmethod
    def wrap(local: torch.Tensor, cp: CPGroup, batch: int, rows: bool = False) -> "SequenceShard":
        out = local.as_subclass(SequenceShard)
        out._cp, out._batch, out._rows = cp, batch, rows
        return out

    def local(self) -> torch.Tensor:
        with torch._C.DisableTorchFunctionSubclass():
            return self.as_subclass(torch.Tensor)

    def whole(self) -> torch.Tensor:
        """Every rank's tokens, in sequence order (backward: this rank's share, times c)."""
        local = self.local()
        if not self._rows:
            return gather_sequence(local, 1, self._cp)
        tokens = local.reshape(self._batch, -1, *local.shape[1:])
        return gather_sequence(tokens, 1, self._cp).reshape(-1, *local.shape[1:])

    def _leading(self) -> tuple[int, ...]:
        shape = self.local().shape
        return (shape[0],) if self._rows else tuple(shape[:2])

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        cut = next(a for a in (*args, *kwargs.values()) if isinstance(a, SequenceShard))
        name = getattr(func, "__name__", "")
        if func is F.cross_entropy:
            return _cross_entropy(*args, **kwargs)
        if name in ("size", "numel", "__len__") or getattr(func, "__self__", None) is _SHAPE:
            return _whole_size(cut, name, args, kwargs)
        if name in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if _in_place(name):  # on this rank's tokens, or refused: a gathered copy would take the write
            whole = name != "__setitem__" or _tokenwise(cut, "__getitem__", args[:2], {})  # x[...] = v only
            if not whole or not _tokenwise(cut, "mul", args, kwargs):
                raise RuntimeError(
                    f"context parallelism: {name} writes into the sequence after the blocks with operands that span "
                    "the whole sequence, while each rank holds only its tokens; write it out of place"
                )
            run_converted(func, args, kwargs, SequenceShard, SequenceShard.local)
            return args[0]
        if _tokenwise(cut, name, args, kwargs):
            if name in _VIEWS and args and args[0] is cut:
                args = (cut, *_local_shape(cut, args[1:]))
            shard = _rewrap(run_converted(func, args, kwargs, SequenceShard, SequenceShard.local), cut)
            if shard is not None:
                return shard
        return _run_whole(func, args, kwargs)


def _in_place(name: str) -> bool:
    return name == "__setitem__" or (name.endswith("_") and not name.startswith("_")) or name.startswith("__i")


def _whole_size(cut: SequenceShard, name: str, args: tuple, kwargs: dict) -> Any:
    """Sizes are the whole sequence's, as in one process (a shard stands for the whole tensor)."""
    shape = list(cut.local().shape)
    shape[0 if cut._rows else 1] *= cut._cp.size
    size = torch.Size(shape)
    if name == "numel":
        return size.numel()
    if name == "__len__":
        return size[0]
    dim = kwargs.get("dim", args[1] if name == "size" and len(args) > 1 else None)
    return size if dim is None else size[dim]


def _local_shape(cut: SequenceShard, shape: tuple) -> tuple:
    """A view's shape, given with the whole sequence's sizes (as ``size()`` reports them), for this
    rank's tokens: ``view(B * S, V)`` -> ``view(B * S/c, V)``, ``view(-1, S, h)`` -> ``view(-1, S/c, h)``."""
    items = shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)) else shape
    local, c = cut.local().shape, cut._cp.size
    tokens = local[0] // cut._batch if cut._rows else local[1]
    fixed = list(items)
    if fixed and fixed[0] == cut._batch * tokens * c:
        fixed[0] = cut._batch * tokens
    # dim 1 is the sequence only if what follows it is the tokens' own sizes: view(-1, h) with h == S is rows
    trailing, rest = math.prod(local[1:] if cut._rows else local[2:]), fixed[2:]
    if len(fixed) > 1 and fixed[1] == tokens * c and fixed[0] in (cut._batch, -1):
        fixed[1] = tokens if -1 in rest or math.prod(rest) == trailing else fixed[1]
    return (type(items)(fixed),) if items is not shape else tuple(fixed)


def _tokenwise(cut: SequenceShard, name: str, args: tuple, kwargs: dict) -> bool:
    """Each token's result reads only that token: every other operand misses the sequence's dim
    (a layer's weight and bias act on the last dim only)."""
    reach = cut.dim() - (1 if cut._rows else 2)  # a plain operand of fewer dims broadcasts over the tokens
    layer = name in ("linear", "layer_norm", "rms_norm")
    for value in (*args, *kwargs.values()):
        if value is cut:
            continue
        if isinstance(value, SequenceShard):
            if value._rows != cut._rows or value._leading() != cut._leading():
                return False
        elif isinstance(value, torch.Tensor) and value.dim() > reach and not layer:
            return False
    if name in _ELEMENTWISE or name in _VIEWS or layer:
        return True
    if name in _ROWWISE:  # a reduction or softmax over the last dim, named
        dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
        return dim in (-1, cut.dim() - 1)
    if name == "__getitem__":  # hidden[:, slice(0, None), :]: every item whole
        items = args[1] if isinstance(args[1], tuple) else (args[1],)
        full = (isinstance(i, slice) and i.start in (None, 0) and i.stop is None and i.step is None for i in items)
        return all(i is Ellipsis or f for i, f in zip(items, full))
    return False


def _rewrap(out: Any, cut: SequenceShard) -> SequenceShard | None:
    """The result as a shard when it still leads with this rank's tokens (or their batch-major rows)."""
    if not isinstance(out, torch.Tensor) or out.dim() == 0:
        return None
    batch, tokens = cut._batch, cut.local().shape[0] if cut._rows else cut.local().shape[1]
    rows = tokens if cut._rows else batch * tokens
    if out.dim() >= 2 and tuple(out.shape[:2]) == (batch, tokens if not cut._rows else rows // batch):
        return SequenceShard.wrap(out, cut._cp, batch, rows=False)
    if out.shape[0] == rows:
        return SequenceShard.wrap(out, cut._cp, batch, rows=True)
    return None


def _run_whole(func: Any, args: tuple, kwargs: dict) -> Any:
    if not SequenceShard._warned_gather:
        SequenceShard._warned_gather = True
        log.info(
            "context parallelism: gathering the whole sequence for %s (token-wise work and "
            "F.cross_entropy stay on each rank's tokens)",
            getattr(func, "__name__", func),
        )

    return run_converted(func, args, kwargs, SequenceShard, SequenceShard.whole)


def _cross_entropy(*args: Any, **kwargs: Any) -> torch.Tensor:
    call = CrossEntropyCall(*args, **kwargs)
    out = None
    if isinstance(call.input, SequenceShard) and call.plain and not isinstance(call.target, SequenceShard):

        def summed(local: torch.Tensor, mine: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(
                local, mine, ignore_index=call.ignore_index, reduction="sum", label_smoothing=call.label_smoothing
            )

        if call.reduction in ("mean", "sum"):
            out = context_cross_entropy(call.input, call.target, call.reduction, call.ignore_index, summed)
    return _run_whole(F.cross_entropy, (call.input, call.target), call.options()) if out is None else out


def context_cross_entropy(
    rows: SequenceShard,
    target: torch.Tensor,
    reduction: str,
    ignore_index: int,
    summed: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> Optional[torch.Tensor]:
    """The mean (or sum) over every rank's tokens of ``summed(this rank's rows, their targets)``, the
    loss summed over rows (the logits, or the head's input for the fused loss); None unless ``rows``
    are (tokens, ...) rows and ``target`` the whole sequence's (N,) targets."""
    if not rows._rows or rows.dim() != 2 or target.dim() != 1:
        return None
    cp, local = rows._cp, rows.local()
    if target.numel() != local.shape[0] * cp.size:
        return None
    mine = own_chunks(target.reshape(rows._batch, -1), 1, cp).reshape(-1)  # the targets of this rank's rows
    total = summed(local, mine)
    if reduction == "mean":  # over every rank's counted tokens: each rank's count differs with its padding
        counted = (mine != ignore_index).sum().to(total.dtype)
        dist.all_reduce(counted, group=cp.group)
        total = total / counted
    return _SumOverContext.apply(total, cp)
