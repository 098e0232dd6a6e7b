"""Ops no discovery handler names, planned from torch's own op knowledge (op_semantics.py): aten
pointwise tags and DTensor's sharding rules; plain-torch blocks, no process group but for one check
against one process."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from lightning_ptdp.tensor_parallel import tensor_parallel_plan

# fp32; t=2 splits the row Linear's sum in two: round-off only (test_tensor_parallel.py)
LOSS_RTOL, GRAD_REL = 1e-5, 1e-5
HEADS, SIZE, WIDTH = 4, 4, 16


class ErfMLP(nn.Module):
    """Pointwise ops nobody listed: clamp (DBRX's qkv clip), erf, sin, a dtype round trip."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(WIDTH, 32), nn.Linear(32, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x).clamp(-2.0, 2.0)
        return x + self.down((torch.special.erf(h) * torch.sin(h)).double().float())


class Attention(nn.Module):
    """Attention written out over 4 heads (q @ k^T, softmax, @ v); subclasses change one step."""

    def __init__(self, kv_heads: int = HEADS) -> None:
        super().__init__()
        self.q, self.o = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)
        self.k, self.v = nn.Linear(WIDTH, kv_heads * SIZE), nn.Linear(WIDTH, kv_heads * SIZE)

    def heads(self, t: torch.Tensor) -> torch.Tensor:
        return t.view(t.shape[0], t.shape[1], -1, SIZE)  # (B, T, nh, hs)

    def kv(self, t: torch.Tensor) -> torch.Tensor:
        return self.heads(t).transpose(1, 2)  # (B, nh, T, hs)

    def weights(self, scores: torch.Tensor) -> torch.Tensor:
        return scores.softmax(-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.heads(self.q(x)).transpose(1, 2), self.kv(self.k(x)), self.kv(self.v(x))
        out = self.weights((q @ k.transpose(-2, -1)) * SIZE**-0.5) @ v
        return x + self.o(out.transpose(1, 2).reshape(x.shape))


class SinkAttention(Attention):
    """A softmax over [scores, 0] (gpt-oss's attention sink) by amax and logsumexp over the keys."""

    def weights(self, scores: torch.Tensor) -> torch.Tensor:
        top = scores.amax(-1, keepdim=True)
        lse = torch.logsumexp(scores - top, dim=-1).unsqueeze(-1)
        return (scores - top - torch.logaddexp(lse, -top)).exp()


class RepeatAttention(Attention):
    """Keys and values repeated along the positions (a non-head dim): the same attention output."""

    def kv(self, t: torch.Tensor) -> torch.Tensor:
        return super().kv(t).repeat(1, 1, 2, 1)


class MultiQueryAttention(Attention):
    """One key/value head, whole on every rank, expanded onto each rank's query heads; q and k are
    clipped (DBRX) and rotated as complex pairs (Llama 4, Meta's Llama)."""

    def __init__(self) -> None:
        super().__init__(kv_heads=1)

    def rotate(self, t: torch.Tensor) -> torch.Tensor:
        b, n, h, s = t.shape  # (B, T, nh, hs)
        angles = torch.arange(n, dtype=torch.float32)[:, None] * torch.arange(1, s // 2 + 1) / s
        pairs = torch.view_as_complex(t.float().reshape(b, n, h, s // 2, 2))
        return torch.view_as_real(pairs * torch.polar(torch.ones_like(angles), angles)[:, None]).flatten(3).type_as(t)

    def heads(self, t: torch.Tensor) -> torch.Tensor:
        return self.rotate(super().heads(t).clamp(-3.0, 3.0))

    def kv(self, t: torch.Tensor) -> torch.Tensor:
        one = t.view(t.shape[0], t.shape[1], 1, SIZE).transpose(1, 2)  # (B, 1, T, hs)
        return one.expand(-1, HEADS, -1, -1)


class HeadsCat(Attention):
    """Concatenates two head-sharded tensors along the heads (each rank then holds its share of both
    parts) and takes heads across the parts' boundary: no rank's share of the result."""

    def weights(self, scores: torch.Tensor) -> torch.Tensor:
        both = torch.cat([scores, scores.flip(-1)], dim=1)
        return both[:, HEADS // 2 : HEADS // 2 + HEADS].softmax(-1)


class HeadsChunk(Attention):
    """Pairs head i with head i + nh/2 (DiffLlama): a chunk of each rank's heads is another pairing."""

    def weights(self, scores: torch.Tensor) -> torch.Tensor:
        first, second = scores.chunk(2, dim=1)
        return torch.cat([first - second, second - first], dim=1).softmax(-1)


def _blocks(block: type[nn.Module]) -> nn.Sequential:
    return nn.Sequential(block(), block())  # a block list of two


def _inputs() -> torch.Tensor:
    return torch.randn(2, 6, WIDTH, generator=torch.Generator().manual_seed(1))


def _styles(block: type[nn.Module]) -> dict[str, str]:
    net, x = _blocks(block), _inputs()
    report = tensor_parallel_plan(net, 2, probe=lambda: net(x), strict=True)  # strict: a region kept whole raises
    return {path.split("*.")[1]: style for path, style, _ in report.entries}


ATTENTION = {"q": "colwise", "k": "colwise", "v": "colwise", "o": "rowwise"}


@pytest.mark.parametrize(
    ("block", "styles"),
    [
        (ErfMLP, {"up": "colwise", "down": "rowwise"}),
        (SinkAttention, ATTENTION),
        (RepeatAttention, ATTENTION),
        (MultiQueryAttention, ATTENTION),
    ],
    ids=["pointwise", "amax-logsumexp-unsqueeze", "repeat", "multi-query-complex-rotary"],
)
def test_ops_no_handler_names_are_planned_from_torch_op_knowledge(block, styles):
    assert _styles(block) == styles


@pytest.mark.parametrize("block", [HeadsCat, HeadsChunk], ids=["cat-along-heads", "chunk-of-heads"])
def test_scores_mixed_across_the_heads_are_computed_whole_and_cut_where_they_meet_the_values(block):
    """Heads taken across a cat's parts, or paired across the chunks of all heads, have no rank's share:
    q and k are split by features and gathered before the region, every rank computes all heads'
    weights, and the matmul with the split values cuts them to the rank's heads (torch's rules).
    tests/unit/test_tp_head_idioms.py trains both against one process."""
    assert _styles(block) == {"q": "colwise_gathered", "k": "colwise_gathered", "v": "colwise", "o": "rowwise"}


def _multi_query_step(distributed: bool) -> dict:
    """One forward/backward of two multi-query blocks at t=2, or in one process."""
    torch.manual_seed(0)
    net, x = _blocks(MultiQueryAttention), _inputs()
    if distributed:
        import torch.distributed as dist

        from lightning_ptdp.parallel.grad_sums import sum_partial_over_tp
        from lightning_ptdp.tensor_parallel import TPGroup, apply_tensor_parallel
        from lightning_ptdp.tensor_parallel.consolidate import full_gradients

        tp = TPGroup(dist.group.WORLD, dist.get_world_size(), dist.get_rank())
        report = apply_tensor_parallel(net, tp, sequence_parallel=False, probe=lambda: net(x))
    loss = net(x).square().mean()
    loss.backward()
    if distributed:  # the key/value head is whole on both ranks: the strategy sums its two copies' gradients
        sum_partial_over_tp(net, report.partial_grad_params, tp)
    grads = full_gradients(net) if distributed else {n: p.grad for n, p in net.named_parameters()}
    return {"loss": loss.item(), "grads": grads, "q_rows": net[0].q.weight.shape[0]}


@pytest.mark.world_size(2)
def test_clamp_multi_query_and_complex_rotary_train_equal_to_one_process(dist_pool):
    from tests.fit_utils import noise_only, relative_error

    ref = _multi_query_step(False)
    for result in dist_pool(2).run(_multi_query_step, True):
        assert result["loss"] == pytest.approx(ref["loss"], rel=LOSS_RTOL)
        assert result["q_rows"] == WIDTH // 2  # the query heads really are split
        for name, expected in ref["grads"].items():
            if noise_only(expected):  # the key bias: zero in exact arithmetic (softmax is shift invariant)
                continue
            assert relative_error(result["grads"][name], expected, expected) <= GRAD_REL, name
