"""Vocabulary-parallel logits: the LM head's output stays split by vocabulary on every rank.

``VocabParallelLogits`` is a tensor subclass around this rank's (..., V/t) slice. The user's own
loss code runs unchanged: ``F.cross_entropy`` on it becomes Megatron's vocab-parallel
cross-entropy (max, target logit and sum of exponentials reduced over the group; no rank ever
holds V logits); reshapes and dtype casts that keep the vocabulary last stay local; any other
use (argmax, softmax, returning logits from predict_step) gathers the full logits first, which
is always correct, and logs once that it did.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd import Function

from lightning_ptdp.core.dtypes import at_least_fp32
from lightning_ptdp.core.subclasses import CrossEntropyCall, run_converted
from lightning_ptdp.tensor_parallel.collectives import TPGroup, all_reduce_max, all_reduce_sum

log = logging.getLogger(__name__)

_LOCAL_METHODS = {"view", "reshape", "flatten", "float", "double", "half", "bfloat16", "to", "contiguous", "type_as"}
_METADATA = {"size", "dim", "numel", "__get__", "__len__", "data_ptr", "element_size", "is_contiguous", "stride"}


class _VocabParallelCrossEntropy(Function):
    """Per-token loss from vocab-split logits (N, V/t) and global targets (N,), with torch's label
    smoothing: (1 - e) * nll + e * (the mean over the V classes of -log p)."""

    @staticmethod
    def forward(ctx, local, target, shard, tp: TPGroup, ignore_index: int, smoothing: float = 0.0):
        x = at_least_fp32(local)
        padding = torch.arange(shard.local, device=x.device) >= shard.valid
        if shard.valid < shard.local:  # padding rows never win the softmax
            x = x.masked_fill(padding, float("-inf"))
        x = x - all_reduce_max(x.max(dim=-1).values, tp).unsqueeze(-1)
        target_local = target - shard.start
        owned = (target_local >= 0) & (target_local < shard.valid)
        picked = x.gather(-1, target_local.clamp(0, shard.local - 1).unsqueeze(-1)).squeeze(-1)
        exp = x.exp()
        summed = x.masked_fill(padding, 0.0).sum(-1) if smoothing else torch.zeros_like(picked)
        parts = torch.stack((picked.where(owned, torch.zeros_like(picked)), exp.sum(-1), summed))
        totals = all_reduce_sum(parts, tp)
        ignored = target == ignore_index
        log_total = totals[1].log()
        loss = (1.0 - smoothing) * (log_total - totals[0]) + smoothing * (log_total - totals[2] / shard.vocab_size)
        ctx.save_for_backward(exp / totals[1].unsqueeze(-1), target_local, owned, ignored, padding)
        ctx.input_dtype, ctx.smoothing, ctx.vocab_size = local.dtype, smoothing, shard.vocab_size
        return loss.masked_fill(ignored, 0.0)

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        softmax, target_local, owned, ignored, padding = ctx.saved_tensors
        grad = softmax
        rows = owned.nonzero(as_tuple=True)[0]
        grad[rows, target_local[rows]] -= 1.0 - ctx.smoothing
        if ctx.smoothing:  # d/dx of -e/V * sum(log p): softmax * e - e/V on every real class
            grad -= (ctx.smoothing / ctx.vocab_size) * (~padding).to(grad.dtype)
        grad = grad * grad_loss.masked_fill(ignored, 0.0).unsqueeze(-1)
        return grad.to(ctx.input_dtype), None, None, None, None, None


class _GatherVocab(Function):
    """All-gather along the vocabulary (dropping padding); backward keeps this rank's slice."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, shard, tp: TPGroup) -> torch.Tensor:
        ctx.shard = shard
        parts = [torch.empty_like(local) for _ in range(tp.size)]
        torch.distributed.all_gather(parts, local.contiguous(), group=tp.group)
        return torch.cat(parts, dim=-1)[..., : shard.vocab_size]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        shard = ctx.shard
        local = grad.new_zeros((*grad.shape[:-1], shard.local))
        local[..., : shard.valid] = grad[..., shard.start : shard.start + shard.valid]
        return local, None, None


class VocabParallelLogits(torch.Tensor):
    """This rank's vocabulary slice of the logits; see the module docstring for the rules."""

    _shard: Any
    _tp: TPGroup
    _warned_gather = False

    @staticmethod
    def wrap(local: torch.Tensor, shard, tp: TPGroup) -> "VocabParallelLogits":
        out = local.as_subclass(VocabParallelLogits)
        out._shard, out._tp = shard, tp
        return out

    def local(self) -> torch.Tensor:
        """The plain (..., V/t) tensor, still attached to autograd."""
        with torch._C.DisableTorchFunctionSubclass():
            return self.as_subclass(torch.Tensor)

    def full(self) -> torch.Tensor:
        """The full (..., V) logits, gathered over the tensor-parallel group."""
        return _GatherVocab.apply(self.local(), self._shard, self._tp)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        logits = next(a for a in (*args, *kwargs.values()) if isinstance(a, VocabParallelLogits))
        name = getattr(func, "__name__", "")
        if func is F.cross_entropy:
            return _cross_entropy(*args, **kwargs)
        if name in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if name in _LOCAL_METHODS or (name == "__getitem__" and _keeps_last_dim(args[1], logits.dim())):
            out = _run_local(func, logits, args, kwargs)
            if out is not None:
                return out
        return _run_gathered(func, logits, args, kwargs)


def _keeps_last_dim(index: Any, ndim: int) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return Ellipsis not in items and None not in items and len(items) < ndim


def _localise(arg: Any, logits: VocabParallelLogits) -> Any:
    if isinstance(arg, VocabParallelLogits):
        return arg.local()
    if isinstance(arg, int) and not isinstance(arg, bool) and arg == logits._shard.vocab_size:
        return logits._shard.local  # view(..., V) -> view(..., V/t)
    if isinstance(arg, (tuple, list)):
        return type(arg)(_localise(a, logits) for a in arg)
    return arg


def _run_local(func, logits: VocabParallelLogits, args, kwargs):
    with torch._C.DisableTorchFunctionSubclass():
        out = func(*(_localise(a, logits) for a in args), **kwargs)
    if isinstance(out, torch.Tensor) and out.dim() >= 1 and out.shape[-1] == logits._shard.local:
        return VocabParallelLogits.wrap(out, logits._shard, logits._tp)
    return None


def _run_gathered(func, logits: VocabParallelLogits, args, kwargs):
    if not VocabParallelLogits._warned_gather:
        VocabParallelLogits._warned_gather = True
        log.info("gathering full-vocabulary logits for %s (only F.cross_entropy stays vocab-parallel)", func)

    return run_converted(func, args, kwargs, VocabParallelLogits, VocabParallelLogits.full)


def _cross_entropy(*args: Any, **kwargs: Any) -> torch.Tensor:
    call = CrossEntropyCall(*args, **kwargs)
    logits, target = call.input, call.target
    if not call.plain or logits.dim() != 2 or target.dim() != 1:
        return _run_gathered(F.cross_entropy, logits, (logits, target), call.options())
    losses = vocab_parallel_losses(
        logits.local(), target, logits._shard, logits._tp, call.ignore_index, call.label_smoothing
    )
    if call.reduction == "none":
        return losses
    if call.reduction == "sum":
        return losses.sum()
    return losses.sum() / (target != call.ignore_index).sum()


def vocab_parallel_losses(local, target, shard, tp: TPGroup, ignore_index: int, smoothing: float) -> torch.Tensor:
    """Each row's cross-entropy from this rank's (N, V/t) logits, as F.cross_entropy(reduction="none")."""
    return _VocabParallelCrossEntropy.apply(local, target, shard, tp, ignore_index, smoothing)
