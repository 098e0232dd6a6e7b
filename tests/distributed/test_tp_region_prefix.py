"""Tensor parallelism through idioms of chained and side inputs, in plain torch, trained by the
Trainer at t=2 (with and without SP) against one process:

- a low-rank chain before the heads (MLA: x -> q_a -> norm -> q_b -> heads, x -> kv_a -> kv_b), whose
  columns read different tensors made from one input, with one key head shared by all heads expanded
  to the local head count and written into a ``new_empty`` key in place;
- attention sinks: a per-head parameter concatenated to the head-sharded scores;
- a block whose MLP input is also read outside the MLP, by a routed branch reading its shape.
"""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

SEQ, VOCAB, HIDDEN, HEADS = 8, 16, 16, 4
RANK, ROPE, HEAD = 8, 3, 4  # kv_a makes RANK + ROPE = 11 features: t=2 cannot split it, so it stays whole
TOL = 1e-5  # fp32: the same arithmetic up to summation order (t=2 splits each row's sum in two)


class LowRankBlock(nn.Module):
    """Also: its norms in a ModuleList (a leaf container never called: each norm's ops are recorded
    one by one), an identity ``h.to(h.dtype)`` before ``h`` is read again (by the gate), and a norm on
    the shared key head written into the key through a view (its gradient is each rank's heads' part),
    after a depthwise conv whose taps are read through ``unsqueeze`` (a parameter of the whole side
    reached through values made of parameters alone: its gradient is summed over tp too)."""

    def __init__(self) -> None:
        super().__init__()
        self.norms = nn.ModuleList([nn.RMSNorm(HIDDEN), nn.RMSNorm(HIDDEN)])
        self.q_a, self.q_norm = nn.Linear(HIDDEN, RANK, bias=False), nn.RMSNorm(RANK)
        self.q_b = nn.Linear(RANK, HEADS * (HEAD + ROPE), bias=False)
        self.kv_a, self.kv_norm = nn.Linear(HIDDEN, RANK + ROPE, bias=False), nn.RMSNorm(RANK)
        self.kv_b = nn.Linear(RANK, HEADS * 2 * HEAD, bias=False)
        self.k_rot_norm = nn.RMSNorm(ROPE)
        self.k_rot_taps = nn.Parameter(torch.linspace(0.5, 1.0, ROPE * 2).view(ROPE, 2))
        self.gate = nn.Linear(HIDDEN, HEADS)  # one output gate per head
        self.o = nn.Linear(HEADS * HEAD, HIDDEN)
        self.up, self.down = nn.Linear(HIDDEN, 2 * HIDDEN), nn.Linear(2 * HIDDEN, HIDDEN)
        self.register_buffer("angle", torch.linspace(0.5, 1.5, SEQ).view(SEQ, 1))  # a position's own factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norms[0](x)
        B, T, _ = h.shape
        q = self.q_b(self.q_norm(self.q_a(h.to(h.dtype)))).view(B, T, -1, HEAD + ROPE).transpose(1, 2)
        q_pass, q_rot = torch.split(q, [HEAD, ROPE], dim=-1)  # (B, nh, T, hs), (B, nh, T, r)
        latent, k_rot = torch.split(self.kv_a(h), [RANK, ROPE], dim=-1)
        kv = self.kv_b(self.kv_norm(latent)).view(B, T, -1, 2 * HEAD).transpose(1, 2)  # (B, nh, T, 2 hs)
        k_pass, v = torch.split(kv, [HEAD, HEAD], dim=-1)
        k_rot = F.conv1d(k_rot.transpose(1, 2), self.k_rot_taps.unsqueeze(1), padding=1, groups=ROPE)
        k_rot = k_rot[..., :T].transpose(1, 2)  # a causal depthwise conv over the positions
        k_rot = self.k_rot_norm(k_rot * torch.cos(self.angle[:T])).view(B, 1, T, ROPE)  # one key head for all
        k_rot = k_rot.expand(-1, k_pass.shape[1], -1, -1)
        k = k_pass.new_empty(*k_pass.shape[:-1], HEAD + ROPE)
        k[..., :HEAD].copy_(k_pass)
        k[..., HEAD:].copy_(k_rot)
        q = torch.cat([q_pass, q_rot * torch.cos(self.angle[:T])], dim=-1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        y = y * torch.sigmoid(self.gate(h)).transpose(1, 2).unsqueeze(-1)  # (B, nh, T, 1) per head
        x = x + self.o(y.transpose(1, 2).reshape(B, T, -1))
        return x + self.down(F.gelu(self.up(self.norms[1](x))))


class SinkBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.q, self.k, self.v, self.o = (nn.Linear(HIDDEN, HIDDEN) for _ in range(4))
        self.sinks = nn.Parameter(torch.linspace(-1.0, 1.0, HEADS))  # one logit per head
        self.register_buffer("mask", torch.full((SEQ, SEQ), float("-inf")).triu(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        B, T, C = h.shape
        q, k, v = (p(h).view(B, T, HEADS, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + self.mask[:T, :T]  # (B, nh, T, T)
        sink = self.sinks.reshape(1, -1, 1, 1).expand(B, -1, T, 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
        return x + self.o((probs @ v).transpose(1, 2).reshape(B, T, C))


class RoutedBlock(nn.Module):
    """The MLP's input is also read by a branch outside it, which reads its shape to view its rows back."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.router = nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, 1)
        self.up, self.down = nn.Linear(HIDDEN, 2 * HIDDEN), nn.Linear(2 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        shape = h.shape
        rows = h.reshape(-1, shape[-1])
        routed = (rows * torch.sigmoid(self.router(rows))).view(*shape)
        return x + routed + self.down(F.gelu(self.up(h)))


class TinyLM(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.low_rank = nn.ModuleList([LowRankBlock(), LowRankBlock()])
        self.sinks = nn.ModuleList([SinkBlock(), SinkBlock()])
        self.routed = nn.ModuleList([RoutedBlock(), RoutedBlock()])
        self.head = nn.Linear(HIDDEN, VOCAB)

    def training_step(self, batch, batch_idx):
        x = self.emb(batch[0])
        for block in (*self.low_rank, *self.sinks, *self.routed):
            x = block(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), batch[1].flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def fit(t: int, sequence_parallel: bool) -> dict:
    from tests.tp_utils import fit_token_lm

    model, result = fit_token_lm(TinyLM, vocab=VOCAB, seq=SEQ, t=t, sequence_parallel=sequence_parallel)
    block = model.low_rank[0]
    return {
        **result,
        "layers": {n: type(getattr(block, n)).__name__ for n in ("q_a", "kv_a", "q_b", "kv_b", "gate", "o")},
        "sink_q": tuple(model.sinks[0].q.weight.shape),
        "warnings": sorted(set(result["warnings"])),
    }


@pytest.mark.world_size(2)
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["t2", "t2-sp"])
def test_chained_and_side_inputs_split_equal_to_one_process(dist_pool, sequence_parallel):
    from tests.tp_utils import t2_runs

    for split in t2_runs(dist_pool, fit, sequence_parallel, TOL):
        assert split["layers"] == {
            "q_a": "GatheredColumnLinear",  # the chain's opener: split by output features, gathered
            "kv_a": "Linear",  # 11 outputs: whole on every rank, its gradient summed over tp
            "q_b": "ColumnParallelLinear",
            "kv_b": "ColumnParallelLinear",
            "gate": "ColumnParallelLinear",
            "o": "RowParallelLinear",
        }
        assert split["sink_q"] == (HIDDEN // 2, HIDDEN)
        (warning,) = split["warnings"]  # every region splits; only kv_a's 11 outputs stay whole, and say so
        assert "keeps kv_a, k_rot_taps whole on every rank (computed from a region's input beside its heads)" in warning


def test_a_low_rank_chain_is_one_region_with_its_openers_before_the_columns():
    """The plan alone (no process group): q_a and kv_a would pair with q_b and kv_b in graph order and
    leave o with no row; as the region's prefix they let q_b, kv_b -> o split by heads."""
    from lightning_ptdp.tensor_parallel import tensor_parallel_plan

    net = nn.Sequential(LowRankBlock(), LowRankBlock())
    report = tensor_parallel_plan(net, 2, probe=lambda: net(torch.randn(2, SEQ, HIDDEN)))
    styles = {path.removeprefix("*."): style for path, style, _ in report.entries}
    names = ("q_a", "kv_a", "q_norm", "kv_norm", "k_rot_norm", "q_b", "kv_b", "gate", "o")
    assert {k: styles[k] for k in names} == {
        "q_a": "colwise_gathered",
        "kv_a": "replicated",
        "q_norm": "replicated",
        "kv_norm": "replicated",
        "k_rot_norm": "replicated",  # on the shared key head, beside the heads
        "q_b": "colwise",
        "kv_b": "colwise",
        "gate": "colwise",
        "o": "rowwise",
    }
