"""What context parallelism refuses, with the reason and the fix, on every rank before any step
completes (so no rank waits on a collective the others never reach)."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

SEQ, VOCAB, HIDDEN, HEADS = 30, 16, 16, 2
ALIBI_KEYS = 48  # the table's length: more keys than the sequence has, as MPT's max_seq_len
WINDOW = 5  # the sliding window: shorter than a rank's chunk of 8, so it cuts inside chunks and across them


class Block(nn.Module):
    """A pre-norm block whose attention is one of the idioms context parallelism cannot split."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.proj = nn.Linear(HIDDEN, HIDDEN)
        self.pos = nn.Embedding(SEQ + 2, HIDDEN)
        if kind == "conv":  # a short causal conv over the sequence, per channel
            self.conv = nn.Conv1d(HIDDEN, HIDDEN, 3, padding=2, groups=HIDDEN)
        if kind == "rope_cache":  # torchtitan's layout: [positions, cos | sin], one head of HIDDEN features
            angle = torch.arange(SEQ + 2)[:, None] * 0.1 ** torch.arange(HIDDEN)[None, :]
            self.register_buffer("rope", torch.cat([angle.cos(), angle.sin()], dim=-1), persistent=False)

    def forward(self, x: torch.Tensor, table: torch.Tensor | dict | None = None) -> torch.Tensor:
        B, T, C = x.shape
        if self.kind == "mlp":  # no attention at all
            return x + self.proj(F.gelu(self.qkv(x)[..., :C]))
        if self.kind == "conv":
            x = x + self.conv(x.transpose(1, 2))[..., :T].transpose(1, 2)
        if self.kind == "positions_dict":  # learned positions the model passes in a dict
            x = x + table["positions"]
        if self.kind == "arange":  # positions from the length the block sees
            x = x + self.pos(torch.arange(T, device=x.device))
        q, k, v = self.qkv(x).split(C, dim=2)
        if self.kind == "rope_cache":  # torchtitan: positions read up to the length, then features; C == local length
            cache = self.rope[0:T].view(1, T, 1, 2 * C)
            cos, sin = cache[..., :C], cache[..., C:]
            q, k = ((t.view(B, T, 1, C) * cos + t.view(B, T, 1, C) * sin).view(B, T, C) for t in (q, k))
        q, k, v = (t.view(B, T, HEADS, C // HEADS).transpose(1, 2) for t in (q, k, v))
        if self.kind == "alibi":  # MPT: a per-key bias table the model passes, read for the last n_keys keys
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=table[:, :, table.size(-1) - k.size(-2) :])
        elif self.kind == "local_mask":  # a causal mask built inside the block from its own length
            mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        elif self.kind == "sliding_eager":  # litgpt's sliding window: an additive mask made in the block, eager
            mask = torch.ones(T, T, dtype=q.dtype, device=x.device).triu(diagonal=1)
            mask.masked_fill_(mask.bool(), float("-inf"))
            window = torch.ones_like(mask).tril(diagonal=-WINDOW)
            mask += window.masked_fill_(window.bool(), float("-inf"))
            y = ((q @ k.transpose(-2, -1)) * (C // HEADS) ** -0.5 + mask).softmax(-1) @ v
        elif self.kind == "alibi_folded":  # BLOOM: heads folded into the batch, a per-key bias, baddbmm by keyword
            qf, kf, vf = (t.reshape(B * HEADS, T, C // HEADS) for t in (q, k, v))
            scores = table.baddbmm(batch1=qf, batch2=kf.transpose(1, 2), alpha=(C // HEADS) ** -0.5)
            causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
            y = (scores.masked_fill(~causal, float("-inf")).softmax(-1) @ vf).view(B, HEADS, T, C // HEADS)
        elif self.kind == "indexer":  # sparse attention: keys scored per query and head, the top 4 kept
            scores = torch.matmul(q.transpose(1, 2), k.mean(1).transpose(-1, -2).unsqueeze(1))  # [B, T, H, T]
            causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
            index = scores.relu().sum(2).masked_fill(~causal, float("-inf"))  # [B, T, T]
            top = index.topk(4, dim=-1).indices
            dropped = top.new_ones((B, T, T), dtype=torch.bool).scatter(-1, top, False)
            mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril() & ~dropped
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1))
        elif self.kind == "einsum":  # attention written with einsum
            weights = torch.einsum("bhqd,bhkd->bhqk", q, k).softmax(-1)
            y = torch.einsum("bhqk,bhkd->bhqd", weights, v)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.proj(y.transpose(1, 2).reshape(B, T, C))


class TinyLM(L.LightningModule):
    """Two blocks of ``block_class(kind)`` between an embedding and a head (the certificate's tests reuse it)."""

    def __init__(self, kind: str, block_class: type = Block) -> None:
        super().__init__()
        self.kind = kind
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(block_class(kind) for _ in range(2))
        self.head = nn.Linear(HIDDEN, VOCAB)

    def training_step(self, batch, batch_idx):
        x = emb = self.emb(batch[0])
        table = None
        if self.kind == "alibi":  # [heads, 1, ALIBI_KEYS]: a slope per head times the key's distance from the end
            slopes = 2.0 ** -torch.arange(1, HEADS + 1, dtype=x.dtype)
            table = slopes[:, None, None] * torch.arange(1 - ALIBI_KEYS, 1, dtype=x.dtype)
        elif self.kind == "alibi_folded":  # [batch * heads, 1, T]: exactly as long as the sequence
            slopes = (2.0 ** -torch.arange(1, HEADS + 1, dtype=x.dtype)).repeat(x.size(0))
            table = slopes[:, None, None] * torch.arange(1 - x.size(1), 1, dtype=x.dtype)
        elif self.kind == "positions_dict":
            table = {"positions": 0.1 * torch.sin(torch.arange(x.size(1) * HIDDEN, dtype=x.dtype)).view(1, -1, HIDDEN)}
        for block in self.blocks:
            x = block(x) if table is None else block(x, table)
        if self.kind == "recurrent":  # the blocks again (recurrent depth), from their output plus the input
            x = x + emb
            for block in self.blocks:
                x = block(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), batch[1].flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(kind: str, c: int, seq: int = SEQ + 2) -> dict:
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_ptdp import PTDPStrategy
    from lightning_ptdp.testing import quiet_trainer

    tokens = torch.randint(0, VOCAB, (8, seq + 1), generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=2)
    # c=1 is the reference: Lightning's default strategy, in the test process itself
    strategy = PTDPStrategy(context_parallel_size=c) if c > 1 else "auto"
    # dp is 1: every rank reads the whole batch in order (Lightning's sampler would shuffle under ptdp alone)
    trainer = quiet_trainer(devices=c, strategy=strategy, max_steps=1, use_distributed_sampler=False)
    torch.manual_seed(0)
    model = TinyLM(kind)
    trainer.fit(model, data)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_c2_equals_one_process(dist_pool, kind: str) -> None:
    """One SGD step at c=2 moves every weight as one process does (fp32 round-off: 1e-5)."""
    whole = fit(kind, 1)
    for split in dist_pool(2).run(fit, kind, 2):
        for name, value in whole.items():
            torch.testing.assert_close(split[name], value, rtol=1e-5, atol=1e-6, msg=name)


REFUSALS = {
    "mlp": r"context parallelism found no attention in blocks\.0: no scaled_dot_product_attention call",
    "arange": r"blocks\.0 computes torch\.arange over the 16 tokens it holds at .*test_context_parallel_refusals\.py"
    r".*Compute positions before the blocks and pass them in",
    "einsum": r"blocks\.0 multiplies two \[16, 16\] sequence-by-sequence operands at .*einsum.*"
    r"set attn_implementation='sdpa'",
    "conv": r"blocks\.0 convolves over the 16 tokens it holds \(kernel 3\) at .*test_context_parallel_refusals\.py",
}


@pytest.mark.world_size(2)
@pytest.mark.parametrize("kind", REFUSALS)
def test_an_attention_it_cannot_split_is_refused_with_its_source_line(dist_pool, kind):
    from lightning_ptdp.testing import RankFailure

    with pytest.raises(RankFailure, match=REFUSALS[kind]):
        dist_pool(2).run(fit, kind, 2)


@pytest.mark.world_size(2)
def test_a_rotary_cache_read_by_positions_then_features_trains_as_one_process(dist_pool):
    """``rope[0:T]`` reads positions (all of them, then this rank's), ``[..., :C]`` features, even where C
    equals the 16 tokens a rank holds: one SGD step at c=2 moves the weights as one process does."""
    assert_c2_equals_one_process(dist_pool, "rope_cache")


@pytest.mark.world_size(2)
def test_a_per_key_table_read_for_the_last_n_keys_reads_every_key(dist_pool):
    """ALiBi as MPT passes it: a table over more keys than the sequence has, read for the last
    ``k.size(-2)`` keys. A rank's local key count would read the last 16 of them for all 32 keys."""
    assert_c2_equals_one_process(dist_pool, "alibi")


@pytest.mark.world_size(2)
@pytest.mark.parametrize("kind", ["local_mask", "sliding_eager"])
def test_a_mask_made_inside_the_block_from_its_length_covers_every_position(dist_pool, kind):
    """``torch.ones(T, T).tril()`` (or litgpt's additive sliding window, read by eager attention) made
    from the 16 tokens a rank holds: made over all 32 positions instead, each rank's rows read where it
    meets the queries. Refused before: the mask was [16, 16], for the rank's positions as if 0..15."""
    assert_c2_equals_one_process(dist_pool, kind)


@pytest.mark.world_size(2)
def test_blocks_run_again_on_their_gathered_output_train_as_one_process(dist_pool):
    """A second pass over the blocks gathers their output (it meets the whole embedding) and cuts it anew:
    each rank's gradient reaches only its own chunks of the gathered sequence, so leaving the blocks sums
    the gradients over the ranks (one SGD step: a gradient twice too large moves every weight twice)."""
    assert_c2_equals_one_process(dist_pool, "recurrent")


@pytest.mark.world_size(2)
def test_a_sequence_not_divisible_by_2c_is_refused_on_every_rank(dist_pool):
    from lightning_ptdp.testing import RankFailure

    with pytest.raises(RankFailure, match=r"sequence length 30 is not divisible by 2 \* context_parallel_size = 4"):
        dist_pool(2).run(fit, "sdpa", 2, SEQ)
    dist_pool(2).run(fit, "sdpa", 2)  # and 32 tokens train: the refusal is about the length alone


@pytest.mark.world_size(2)
@pytest.mark.parametrize("kind", ["alibi_folded", "indexer", "positions_dict"])
def test_key_side_tables_and_per_query_scores_train_as_one_process(dist_pool, kind):
    """alibi_folded: a per-key bias [batch * heads, 1, T] as long as the sequence stays whole (its rows are
    broadcast over the queries), read by ``baddbmm`` with keyword batches. indexer: scores with the queries
    in a batch dim (``[B, T, H, d] @ [B, 1, d, T]``) gather their keys, and a boolean mask made by
    ``new_ones`` from the local sizes is made over every key. positions_dict: a dict input is cut as a
    tuple is. Before: a shape error inside the block (refused by the certificate)."""
    assert_c2_equals_one_process(dist_pool, kind)
