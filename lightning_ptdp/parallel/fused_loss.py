"""Step 1e: the LM head and the loss computed together. The head (core/blocks.py
``token_embedding_and_head``: whole, or TP's vocabulary-parallel one) returns ``HeadLogits``
(parallel/head_logits.py) instead of its logits: where the step only feeds them to
``F.cross_entropy`` the logits are never whole; any other use computes them, with today's result.
``fused_loss=True`` asks for the fusion and is refused at setup where the census saw the step use the
logits otherwise; None fuses where it applies; False leaves the head alone.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn as nn

from lightning_ptdp.core.blocks import find_block_lists, token_embedding_and_head
from lightning_ptdp.core.census import Armed, ModelCensus
from lightning_ptdp.parallel.chunked_loss import head_of
from lightning_ptdp.parallel.head_logits import HeadLogits
from lightning_ptdp.tensor_parallel.collectives import copy_to_tp_region
from lightning_ptdp.tensor_parallel.layers import VocabParallelHead

log = logging.getLogger(__name__)

CROSS_ENTROPY = "cross_entropy"


@dataclass
class FusedLossReport:
    """Which module is the LM head, and how the steps used its logits (first uses, in order)."""

    head: Optional[str]
    uses: list[str] = field(default_factory=list)

    def seen(self, use: str) -> None:
        if use in self.uses or len(self.uses) >= 8:
            return
        self.uses.append(use)
        if use != CROSS_ENTROPY:
            log.info(
                "fused_loss: the logits of '%s' are used by %s: computed for it, as without fusion", self.head, use
            )

    def summary(self) -> str:
        if self.head is None:
            return "no LM head found (a Linear outside the blocks with one output per token-embedding row)"
        if not self.uses:
            return f"'{self.head}' returns its logits uncomputed until the loss"
        fused = "fused with F.cross_entropy" if CROSS_ENTROPY in self.uses else "not fused"
        others = [use for use in self.uses if use != CROSS_ENTROPY]
        return f"'{self.head}' {fused}" + (f"; computed for {', '.join(others)}" if others else "")


def lm_head_path(module: nn.Module) -> Optional[str]:
    """The LM head of the whole model (before TP swaps it for its vocabulary-parallel shard)."""
    inside = {id(m) for _, blocks in find_block_lists(module) for block in blocks for m in block.modules()}
    return (token_embedding_and_head(module, inside)[1] or (None,))[0]


def apply_fused_loss(module: nn.Module, path: Optional[str]) -> FusedLossReport:
    """Step 1e: the head at ``path`` (whole or vocabulary-parallel) returns ``HeadLogits``."""
    report = FusedLossReport(path)
    if path is not None:
        _lazy(module.get_submodule(path), report.seen)
    log.info("fused_loss: %s", report.summary())
    return report


class HeadUses:
    """Census reader for ``fused_loss=True``: the whole model's head lazy for the run, and what the
    step did with its logits (the run goes to the end: the loss comes after the blocks)."""

    needs_grad = False
    done = False

    def __init__(self, module: nn.Module, path: Optional[str]) -> None:
        self.module, self.report = module, FusedLossReport(path)

    def arm(self, census: ModelCensus) -> list[Armed]:
        return [] if self.report.head is None else [self._lazy_for_the_run()]

    @contextmanager
    def _lazy_for_the_run(self) -> Iterator[None]:
        head = self.module.get_submodule(self.report.head)
        _lazy(head, self.report.seen)
        try:
            yield
        finally:
            del head.forward

    def finish(self, output: Any) -> None:
        pass

    def check(self) -> None:
        """Refuse ``fused_loss=True`` where the step's logits were not only F.cross_entropy's input."""
        report = self.report
        if report.head is not None and report.uses == [CROSS_ENTROPY]:
            return
        if report.head is None:
            found = report.summary()
        else:
            used = ", ".join(report.uses) or "nothing (the step never used them)"
            found = f"the logits of '{report.head}' were used by {used}"
        raise ValueError(
            f"fused_loss=True: {found}; the head and loss fuse only where the step's loss is F.cross_entropy "
            "(or nn.CrossEntropyLoss) on the head's logits and nothing else reads them. Compute the loss that "
            "way, or pass fused_loss=None (fuse where it applies) or False"
        )


def _lazy(head: nn.Module, seen: Callable[[str], None]) -> None:
    """``head.forward`` returning ``HeadLogits``: an instance attribute, since only a forward of its
    own can skip the matmul (a hook runs after it); the class, parameters and state dict stay."""
    vocab_parallel = isinstance(head, VocabParallelHead)
    vocab_size = head.out_features
    compute = head.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.is_meta or torch.compiler.is_compiling():  # shape probes, and a model the user compiled whole
            return compute(x)
        vocab = None
        if vocab_parallel:
            x, vocab = copy_to_tp_region(x, head.tp), (head.shard, head.tp)
        return HeadLogits.make(x, head_of(x, head.weight, head.bias, vocab, vocab_size, seen))

    head.forward = forward
