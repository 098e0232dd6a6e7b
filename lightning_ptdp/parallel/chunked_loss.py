"""The LM head and cross-entropy computed chunk of rows by chunk, never holding more than one chunk's
logits: ``Head`` (how the head's logits are made: its parameters, the autocast it ran under, and the
pointwise steps the loss code applied after it) and ``chunked_cross_entropy`` (Liger-Kernel's fused
linear cross-entropy in torch ops; its kernel is CUDA-only and has no vocabulary-parallel form, and the
matmuls, the bulk of the work, are cuBLAS's either way). parallel/head_logits.py decides when it runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch.autograd import Function

from lightning_ptdp.tensor_parallel.logits import vocab_parallel_losses

Autocast = tuple[str, bool, torch.dtype]  # (device type, enabled, dtype)


def autocast_now(device: torch.device) -> Autocast:
    """The autocast in force now for ``device``'s type."""
    kind = device.type
    return kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)


def _amp(state: Autocast) -> torch.autocast:
    kind, enabled, dtype = state
    return torch.autocast(kind, dtype=dtype, enabled=enabled)


@dataclass(frozen=True)
class Head:
    """What computing the logits needs, as the head ran: its parameters, the autocast then active, the
    steps the loss code applied after it (casts, pointwise functions of the logits alone, such as a
    softcap), and who to tell how the logits were used."""

    weight: torch.Tensor
    bias: Optional[torch.Tensor]
    vocab: Optional[tuple[Any, Any]]  # (VocabShard, TPGroup) of TP's vocabulary-parallel head
    vocab_size: int
    autocast: Autocast
    dtype: torch.dtype
    """The dtype of the logits after ``after``."""
    version: int
    seen: Callable[[str], None]
    after: tuple[Callable[[torch.Tensor], torch.Tensor], ...] = ()
    hooks: list = field(default_factory=list, compare=False)
    """Gradient hooks registered on the logits (FSDP2's pre-backward, on the head unit's output)."""

    def then(self, step: Callable[[torch.Tensor], torch.Tensor], dtype: torch.dtype) -> "Head":
        return replace(self, after=(*self.after, step), dtype=dtype)

    def logits(self, hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """The head's own logits of ``hidden`` (``apply_after`` then takes the steps after it)."""
        with _amp(self.autocast):
            return F.linear(hidden, weight, bias)


def head_of(hidden: torch.Tensor, weight, bias, vocab, vocab_size: int, seen: Callable[[str], None]) -> Head:
    """The ``Head`` of a forward on ``hidden`` now (the autocast in force decides the logits' dtype)."""
    state = autocast_now(hidden.device)
    dtype = state[2] if state[1] else torch.promote_types(hidden.dtype, weight.dtype)
    return Head(weight, bias, vocab, vocab_size, state, dtype, weight._version, seen)


def apply_after(head: Head, logits: torch.Tensor) -> torch.Tensor:
    for step in head.after:
        logits = step(logits)
    return logits


@dataclass(frozen=True)
class Rule:
    """The loss's own arguments, and the autocast in force where it was called (its backward recomputes)."""

    ignore_index: int
    smoothing: float
    autocast: Autocast


MIN_CHUNK_LOGITS = 2**22
"""Logits per chunk at least (16 MiB in fp32): below that each chunk's fixed cost (a few launches and
an autograd pass) outweighs its matmuls; a model whose logits are smaller runs as one chunk."""


def chunk_rows(rows: int, vocab: int, hidden: int, least: Optional[int] = None) -> int:
    """Rows per chunk: a chunk's logits about the size of the head's input (Liger-Kernel's rule), and
    at least ``least`` (``MIN_CHUNK_LOGITS``) logits."""
    least = MIN_CHUNK_LOGITS if least is None else least
    per_row = max(1, -(-vocab // hidden))
    liger = 1 << max(0, math.ceil(math.log2(max(1, -(-rows // per_row)))))
    return min(rows, max(liger, -(-least // vocab)))


def chunked_cross_entropy(hidden: torch.Tensor, target: torch.Tensor, head: Head, rule: Rule, summed: bool):
    """Cross-entropy of the head's logits of (N, h) rows against (N,) targets: summed, or per row."""
    graph = torch.is_grad_enabled()  # under no_grad a parameter still "needs" its gradient: none is made
    return _ChunkedHeadLoss.apply(hidden, head.weight, head.bias, target, head, rule, summed, graph)


def _chunk_losses(hidden, weight, bias, target, head: Head, rule: Rule) -> torch.Tensor:
    """Each row's loss, as ``F.cross_entropy(reduction="none")`` on the head's logits of these rows,
    each under the autocast it ran under (autocast computes cross-entropy in fp32)."""
    logits = apply_after(head, head.logits(hidden, weight, bias))
    with _amp(rule.autocast):
        if head.vocab is not None:
            return vocab_parallel_losses(logits, target, *head.vocab, rule.ignore_index, rule.smoothing)
        return F.cross_entropy(
            logits, target, ignore_index=rule.ignore_index, reduction="none", label_smoothing=rule.smoothing
        )


def _chunked(inputs: tuple, target, head: Head, rule: Rule, wanted: tuple, grad_rows: Optional[torch.Tensor]):
    """The rows' summed loss (summed in at least fp32, returned in the dtype cross-entropy gave) and the
    gradients of ``sum(grad_rows * loss)`` (``grad_rows`` None: the plain sum) for the inputs in
    ``wanted``, chunk by chunk; weight gradients summed in at least fp32."""
    hidden, weight, bias = inputs
    wide = [None if x is None else torch.promote_types(x.dtype, torch.float32) for x in inputs]
    grads = [
        None if not want else torch.empty_like(x) if i == 0 else torch.zeros_like(x, dtype=wide[i])
        for i, (x, want) in enumerate(zip(inputs, wanted))
    ]
    dtype = head.dtype  # what cross-entropy returns, until a chunk says
    total = torch.zeros((), dtype=torch.float64 if dtype == torch.float64 else torch.float32, device=hidden.device)
    size = chunk_rows(hidden.shape[0], weight.shape[0], hidden.shape[-1])
    for start in range(0, hidden.shape[0], size):
        rows = slice(start, start + size)
        with torch.enable_grad():
            leaves = [hidden[rows], weight, bias]
            leaves = [x if x is None else x.detach().requires_grad_(want) for x, want in zip(leaves, wanted)]
            losses = _chunk_losses(*leaves, target[rows], head, rule)
            total, dtype = total + losses.detach().to(total.dtype).sum(), losses.dtype
            if not any(wanted):
                continue
            weights = torch.ones_like(losses) if grad_rows is None else grad_rows[rows].to(losses.dtype)
            found = iter(torch.autograd.grad(losses, [x for x, want in zip(leaves, wanted) if want], weights))
            for i in (i for i, want in enumerate(wanted) if want):
                if i == 0:
                    grads[0][rows] = next(found)
                else:
                    grads[i] += next(found)
    return total.to(dtype), [g if g is None or g.dtype == x.dtype else g.to(x.dtype) for g, x in zip(grads, inputs)]


class _ChunkedHeadLoss(Function):
    """Cross-entropy of the head's logits on (N, h) rows, summed (``summed``) or per row, never holding
    more than one chunk's logits. A summed loss takes its gradients during forward, as Liger-Kernel
    does (three matmuls per chunk, as unfused); a per-row loss recomputes each chunk in backward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, head: Head, rule: Rule, summed: bool, graph: bool):
        wanted = tuple(want and graph for want in ctx.needs_input_grad[:3])
        ctx.head, ctx.rule, ctx.summed = head, rule, summed
        if summed:
            total, ctx.grads = _chunked((hidden, weight, bias), target, head, rule, wanted, None)
            return total
        with torch.no_grad():
            size = chunk_rows(hidden.shape[0], weight.shape[0], hidden.shape[-1])
            parts = [
                _chunk_losses(hidden[i : i + size], weight, bias, target[i : i + size], head, rule)
                for i in range(0, hidden.shape[0], size)
            ]
        ctx.save_for_backward(hidden, weight, bias, target)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.summed:  # kept, not handed over: zero-bubble's weight pass runs this backward a second time
            return (*(g if g is None else g * grad.to(g.dtype) for g in ctx.grads), None, None, None, None, None)
        hidden, weight, bias, target = ctx.saved_tensors
        wanted = tuple(ctx.needs_input_grad[:3])
        _, grads = _chunked((hidden, weight, bias), target, ctx.head, ctx.rule, wanted, grad)
        return (*grads, None, None, None, None, None)
