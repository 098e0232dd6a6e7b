"""The plan certificate refuses, at setup, a block whose rewrite computes something else than the
block run whole: idioms no discovery saw, written as plain-torch blocks."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.distributed.test_context_parallel_refusals import HEADS, HIDDEN, VOCAB, TinyLM

SEQ = 32
HEAD_DIM = HIDDEN // HEADS


class HeadScale(nn.Module):
    """A per-head weight [heads, head_dim] (Cohere's q/k norm weight), applied to [B, T, heads, head_dim]."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, HEADS * HEAD_DIM).view(HEADS, HEAD_DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


class Block(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.q, self.k, self.v = (nn.Linear(HIDDEN, HIDDEN) for _ in range(3))
        self.proj = nn.Linear(HIDDEN, HIDDEN)
        self.head_scale = HeadScale()
        # rotary-like tables as a plain tensor attribute (not a buffer), sliced by the length the block sees
        self.angles = torch.outer(torch.arange(SEQ, dtype=torch.float32), torch.ones(HEAD_DIM)) / 3
        self.causal = torch.full((SEQ, SEQ), float("-inf")).triu(1)
        if kind == "shared_bank":  # one matrix every head's queries multiply
            self.bank = nn.Parameter(torch.eye(HEAD_DIM) + 0.1 * torch.randn(HEAD_DIM, HEAD_DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.q(x), self.k(x), self.v(x)
        if self.kind == "feature_norm":  # a weightless norm over all of q's features (OLMo 2's q_norm), not per head
            q = F.rms_norm(q, (q.shape[-1],))
        q, k, v = (t.view(B, T, -1, HEAD_DIM) for t in (q, k, v))  # this rank's heads
        if self.kind == "per_head_weight":
            q = self.head_scale(q)
        if self.kind == "shared_bank":
            q = q @ self.bank
        if self.kind == "local_positions":
            angle = self.angles[:T]  # positions 0..T-1 of what this rank holds, not of the sequence
            q, k = q * torch.cos(angle)[:, None], k * torch.cos(angle)[:, None]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.kind == "local_mask":  # a causal bias sliced by the length this block sees from a plain tensor
            bias = self.causal[:T, :T]  # attribute (not a buffer): this rank's positions read as 0..T-1
            y = ((q @ k.transpose(-2, -1)) / HEAD_DIM**0.5 + bias).softmax(-1) @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.proj(y.transpose(1, 2).flatten(2))


class KeywordLM(TinyLM):
    """Calls its blocks with the hidden states by keyword, ``block(x=x)`` (transformers' BLT)."""

    def training_step(self, batch, batch_idx):
        x = self.emb(batch[0])
        for block in self.blocks:
            x = block(x=x)
        return F.cross_entropy(self.head(x).flatten(0, 1), batch[1].flatten())


def fit(kind: str, layout: dict, model_class: type = TinyLM) -> None:
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_ptdp import PTDPStrategy
    from lightning_ptdp.testing import quiet_trainer

    torch.manual_seed(0)
    tokens = torch.randint(0, VOCAB, (8, SEQ + 1), generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=2)
    trainer = quiet_trainer(devices=2, strategy=PTDPStrategy(**layout), max_steps=1)
    trainer.fit(model_class(kind, Block), data)


CASES = {
    "local_positions": (
        {"context_parallel_size": 2},
        r"plan certificate: block 'blocks\.0' under the layout c=2 differs from the same block run whole: its "
        r"output is off by .*a position, a mask.*the first op that differs: mul at .*test_plan_certificate\.py:\d+ "
        r"\(q, k = q \* torch\.cos\(angle\)",
    ),
    "local_mask": (
        {"context_parallel_size": 2},
        r"plan certificate: block 'blocks\.0' under the layout c=2 (raised RuntimeError|differs from the same block)",
    ),
    "feature_norm": (  # an explicit plan that splits q's features but not the norm's statistic over them
        {"tensor_parallel_size": 2, "tp_plan": {"blocks.*.[qkv]": "colwise", "blocks.*.proj": "rowwise"}},
        r"plan certificate: block 'blocks\.0' under the layout t=2 differs from the same block run whole: its "
        r"output is off by .*the first op that differs: rms_norm at .*test_plan_certificate\.py:\d+ "
        r"\(q = F\.rms_norm\(q, \(q\.shape\[-1\],\)\)\)",
    ),
    "per_head_weight": (  # an explicit plan that splits the heads but leaves their [heads, head_dim] weight whole
        {"tensor_parallel_size": 2, "tp_plan": {"blocks.*.[qkv]": "colwise", "blocks.*.proj": "rowwise"}},
        r"plan certificate: block 'blocks\.0' under the layout t=2 (raised RuntimeError|differs from the same block)",
    ),
    "shared_bank": (  # an explicit plan that splits the heads; the bank's gradient is each rank's heads' part
        {"tensor_parallel_size": 2, "tp_plan": {"blocks.*.[qkv]": "colwise", "blocks.*.proj": "rowwise"}},
        r"plan certificate: block 'blocks\.0' under the layout t=2 differs from the same block run whole: its "
        r"gradient of bank is off by .*the forward agrees \(the difference is in the backward\)",
    ),
}


@pytest.mark.world_size(2)
@pytest.mark.parametrize("kind", CASES)
def test_the_certificate_refuses_a_block_that_differs_from_it_whole(dist_pool, kind):
    from lightning_ptdp.testing import RankFailure

    layout, match = CASES[kind]
    with pytest.raises(RankFailure, match=match):
        dist_pool(2).run(fit, kind, layout)


@pytest.mark.world_size(2)
def test_certify_plan_false_skips_it_and_a_plain_block_passes_it(dist_pool):
    dist_pool(2).run(fit, "local_positions", {"context_parallel_size": 2, "certify_plan": False})
    dist_pool(2).run(fit, "plain", {"context_parallel_size": 2})
    dist_pool(2).run(fit, "plain", {"tensor_parallel_size": 2, "sequence_parallel": True})


@pytest.mark.world_size(2)
def test_blocks_called_with_their_hidden_states_by_keyword_are_certified(dist_pool):
    """The certificate finds the residual input by keyword too; sequence parallelism, which scatters
    the first positional argument, refuses such blocks at setup."""
    from lightning_ptdp.testing import RankFailure

    dist_pool(2).run(fit, "plain", {"tensor_parallel_size": 2}, KeywordLM)
    with pytest.raises(
        RankFailure, match=r"block 'blocks\.0' is called without one \(its hidden states passed by keyword"
    ):
        dist_pool(2).run(fit, "plain", {"tensor_parallel_size": 2, "sequence_parallel": True}, KeywordLM)


class SelfReferringBlock(Block):
    """A block holding a bound method of itself (as a model that patches a forward does): it, and any
    copy of it, sits in a reference cycle that only the cyclic garbage collector frees."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.run_whole = self.forward


def blocks_alive_at_train_start(layout: dict) -> tuple[int, int]:
    """(blocks alive when training starts, blocks of the model), with the cyclic collector off."""
    import gc

    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_ptdp import PTDPStrategy
    from lightning_ptdp.testing import quiet_trainer

    class Count(L.Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            self.alive = sum(isinstance(o, SelfReferringBlock) for o in gc.get_objects())

    tokens = torch.randint(0, VOCAB, (8, SEQ + 1), generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=2)
    model, count = TinyLM("plain", SelfReferringBlock), Count()
    gc.collect()
    gc.disable()  # what setup leaves in cycles stays, unless setup collects it
    try:
        quiet_trainer(devices=2, strategy=PTDPStrategy(**layout), max_steps=1, callbacks=[count]).fit(model, data)
    finally:
        gc.enable()
    return count.alive, len(model.blocks)


@pytest.mark.world_size(2)
def test_the_whole_copies_are_freed_at_setup_even_in_a_reference_cycle(dist_pool):
    """The certificate's whole copy of a block would otherwise stay until the collector runs, during
    the first steps, raising their peak by a block's weights (found by the dry run's check)."""
    for alive, blocks in dist_pool(2).run(blocks_alive_at_train_start, {"tensor_parallel_size": 2}):
        assert alive == blocks
