"""Tensor-parallel discovery of per-head weights, splits along the heads and fused projections cut
behind a size-1 dim: plain-torch blocks, no process group but for one check against one process."""

from __future__ import annotations

import functools
from typing import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from lightning_ptdp.tensor_parallel import tensor_parallel_plan
from tests.unit.test_op_semantics import (
    ATTENTION,
    GRAD_REL,
    HEADS,
    LOSS_RTOL,
    SIZE,
    WIDTH,
    Attention,
    HeadsCat,
    HeadsChunk,
    _inputs,
)


class HeadNorm(nn.Module):
    """A LayerNorm over the head size with a weight per head, (heads, head size): Cohere's q/k norm."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(HEADS, SIZE))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, nh, hs)
        x = x - x.mean(-1, keepdim=True)
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)


class HeadScale(nn.Module):
    """One scalar per head, (heads, 1, 1), on (B, nh, T, hs): a per-head temperature."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(1 + 0.1 * torch.randn(HEADS, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


class HeadMix(HeadNorm):
    """Per-head weights normalised across the heads: no rank's slice gives its heads' share."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight.softmax(0)


class NormedAttention(Attention):
    """q and k through a module of their own on (B, T, nh, hs), or on (B, nh, T, hs) with ``late``."""

    def __init__(self, make: Callable[[], nn.Module] = HeadNorm, late: bool = False) -> None:
        super().__init__()
        self.q_norm, self.k_norm, self.late = make(), make(), late

    def normed(self, t: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        t = self.heads(t)
        return norm(t.transpose(1, 2)) if self.late else norm(t).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.normed(self.q(x), self.q_norm), self.normed(self.k(x), self.k_norm), self.kv(self.v(x))
        out = self.weights((q @ k.transpose(-2, -1)) * SIZE**-0.5) @ v
        return x + self.o(out.transpose(1, 2).reshape(x.shape))


class ScaledInBlock(Attention):
    """A per-head parameter of the block itself (no module of its own), applied to the queries."""

    def __init__(self) -> None:
        super().__init__()
        self.head_scale = nn.Parameter(torch.ones(HEADS, 1, 1))

    def weights(self, scores: torch.Tensor) -> torch.Tensor:
        return (scores * self.head_scale).softmax(-1)


class HeadPairs(nn.Module):
    """Pairs head i with head i + nh/2 by a split along the heads (DiffLlama's idiom, with split): a
    split of one rank's contiguous heads would pair others."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH // 2, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first, second = self.up(x).view(*x.shape[:2], HEADS, SIZE).split(HEADS // 2, dim=2)
        return x + self.down((first * torch.sigmoid(second)).flatten(2))


class FusedBehindUnsqueeze(Attention):
    """One q | k | v Linear whose output gains a size-1 dim before the split (GPTBigCode): ``kv_heads``
    1 is multi-query attention, its one key/value head broadcast onto the query heads."""

    def __init__(self, kv_heads: int = HEADS) -> None:
        super().__init__()
        del self.q, self.k, self.v
        self.qkv, self.kv_heads = nn.Linear(WIDTH, WIDTH + 2 * kv_heads * SIZE), kv_heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kv = self.kv_heads * SIZE
        q, k, v = self.qkv(x).unsqueeze(1).split((WIDTH, kv, kv), dim=3)  # (B, 1, T, ...)
        q = q.view(*x.shape[:2], -1, SIZE).transpose(1, 2)
        k, v = (t.view(*x.shape[:2], -1, SIZE).transpose(1, 2) if self.kv_heads > 1 else t for t in (k, v))
        out = self.weights((q @ k.transpose(-2, -1)) * SIZE**-0.5) @ v  # (B, 1, T, hs) broadcast onto nh
        return x + self.o(out.transpose(1, 2).reshape(x.shape))


class OneKeyHeadHalves(Attention):
    """One key/value head viewed as (B, T, 1, hs), its halves sliced (rotate_half): no fused parts."""

    def __init__(self) -> None:
        super().__init__(kv_heads=1)

    def kv(self, t: torch.Tensor) -> torch.Tensor:
        one = t.view(*t.shape[:2], 1, SIZE)
        one = torch.cat([-one[..., SIZE // 2 :], one[..., : SIZE // 2]], dim=-1)
        return one.transpose(1, 2).expand(-1, HEADS, -1, -1)


def _net(block: Callable[[], nn.Module]) -> nn.Sequential:
    return nn.Sequential(block(), block())


def _plan(block: Callable[[], nn.Module], strict: bool = True) -> dict[str, str]:
    net, x = _net(block), _inputs()
    report = tensor_parallel_plan(net, 2, probe=lambda: net(x), strict=strict)
    return {path.split("*.")[1]: style for path, style, _ in report.entries}


NORMED = {**ATTENTION, "q_norm": "replicated", "k_norm": "replicated"}


@pytest.mark.parametrize(
    "block",
    [NormedAttention, functools.partial(NormedAttention, HeadScale, late=True)],
    ids=["heads-by-head-size", "heads-1-1"],
)
def test_per_head_weights_are_sliced_to_each_ranks_heads(block):
    """A parameter with a dim of the heads' global size, aligned with the heads as broadcasting aligns
    it, holds one entry per head: each rank applies its heads' slice (the weight stays whole)."""
    assert _plan(block) == NORMED


def test_per_head_weights_whose_slice_is_no_share_run_whole_on_gathered_heads():
    """Sliced per rank, HeadMix would give other values than its heads' share: q and k are instead
    split by output features and gathered before the region (its prefix), their norms run whole, and
    the scores of all heads are cut to each rank's heads where they meet the split values."""
    block = functools.partial(NormedAttention, HeadMix)
    assert _plan(block) == {
        "q": "colwise_gathered",
        "k": "colwise_gathered",
        "q_norm": "replicated",
        "k_norm": "replicated",
        "v": "colwise",
        "o": "rowwise",
    }


def test_a_per_head_parameter_of_the_block_itself_is_sliced_where_it_is_used():
    """Read as a whole operand of an elementwise call, broadcast against the heads: each rank takes its
    heads' slice at that call (tests/distributed/test_tp_block_structures.py trains the idiom)."""
    assert _plan(ScaledInBlock) == ATTENTION


def test_a_split_along_the_heads_is_cut_at_fused_part_boundaries():
    # heads paired across two halves: the column split as two fused parts, each rank its share of both
    # (tests/distributed/test_tp_paired_heads.py trains the idiom against one process)
    assert _plan(HeadPairs) == {"up": "colwise_fused:2", "down": "rowwise"}
    # cut at q | k | v's boundaries: each rank's share of every part
    assert _plan(FusedBehindUnsqueeze) == {"qkv": "colwise_fused:3", "o": "rowwise"}


def test_a_fused_projection_with_one_key_value_head_splits_its_queries():
    """Multi-query q | k | v in one Linear: the parts (4 | 1 | 1 heads) are found behind the unsqueeze;
    the query heads split, the one key/value head stays whole on every rank (its gradient summed)."""
    assert _plan(functools.partial(FusedBehindUnsqueeze, 1)) == {"qkv": "colwise_fused:4|1|1", "o": "rowwise"}
    # a key of one head viewed as such is no part cut behind a size-1 dim: its halves are not parts
    assert _plan(OneKeyHeadHalves) == ATTENTION


class PerHeadMatmul(Attention):
    """A weight per head, (nh, hs, hs), applied to the values by a matmul batched over the heads
    (Zamba's per-head x_proj): cut to this rank's heads where the matmul reads it."""

    def __init__(self) -> None:
        super().__init__()
        self.per_head = nn.Parameter(torch.randn(HEADS, SIZE, SIZE) / SIZE)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.heads(self.q(x)).transpose(1, 2), self.kv(self.k(x)), self.kv(self.v(x))
        v = v @ self.per_head  # (B, nh, T, hs) @ (nh, hs, hs)
        out = self.weights((q @ k.transpose(-2, -1)) * SIZE**-0.5) @ v
        return x + self.o(out.transpose(1, 2).reshape(x.shape))


def test_a_weight_per_head_in_a_matmul_batched_over_the_heads_is_cut_to_each_ranks_heads():
    assert _plan(PerHeadMatmul) == ATTENTION


class DynamicMaskAttention(Attention):
    """Doge's: an additive mask per head made from all heads' values by a Linear (an inner row, whole
    on every rank after its sum) and a per-head scale, cut to each rank's heads where SDPA reads it."""

    def __init__(self) -> None:
        super().__init__()
        self.dt = nn.Linear(WIDTH, HEADS, bias=False)
        self.A = nn.Parameter(torch.linspace(0.5, 1.5, HEADS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.heads(self.q(x)).transpose(1, 2), self.kv(self.k(x)), self.kv(self.v(x))
        dt = self.dt(v.transpose(1, 2).reshape(x.shape))  # (B, T, nh) from every head's values
        mask = (self.A * F.softplus(dt)).transpose(1, 2)[:, :, None, :].expand(-1, -1, x.shape[1], -1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # mask (B, nh, T, S)
        return x + self.o(out.transpose(1, 2).reshape(x.shape))


def test_a_per_head_mask_made_by_an_inner_row_is_cut_to_each_ranks_heads():
    # A, read whole beside the inner row's sum and cut with the mask, is on the region's whole side
    assert _plan(DynamicMaskAttention) == {**ATTENTION, "dt": "rowwise_inner", "A": "replicated"}


MULTI_QUERY = functools.partial(FusedBehindUnsqueeze, 1)
COPIED_ROWS = (
    0,
    0,
    2 * SIZE,
    0,
    0,
    0,
    0,
    0,
    0,
)  # rows each rank holds whole: multi-query attention's key and value head


def _step(distributed: bool) -> list[dict]:
    """One forward/backward of per-head-normed and of fused-behind-unsqueeze blocks at t=2, or in one process."""
    results = []
    blocks = (functools.partial(NormedAttention, HeadNorm), FusedBehindUnsqueeze, MULTI_QUERY, L2NormedAttention)
    more = (PerHeadMatmul, functools.partial(NormedAttention, HeadMix), HeadsCat, HeadsChunk, DynamicMaskAttention)
    for block in (*blocks, *more):
        torch.manual_seed(0)
        net, x = _net(block), _inputs()
        if distributed:
            import torch.distributed as dist

            from lightning_ptdp.parallel.grad_sums import sum_partial_over_tp
            from lightning_ptdp.tensor_parallel import TPGroup, apply_tensor_parallel
            from lightning_ptdp.tensor_parallel.consolidate import full_gradients

            tp = TPGroup(dist.group.WORLD, dist.get_world_size(), dist.get_rank())
            report = apply_tensor_parallel(net, tp, sequence_parallel=False, probe=lambda: net(x), strict=True)
        loss = net(x).square().mean()
        loss.backward()
        if distributed:  # the per-head weights are whole on both ranks, each rank's gradient its heads' rows
            sum_partial_over_tp(net, report.partial_grad_params, tp)
        grads = full_gradients(net) if distributed else {n: p.grad for n, p in net.named_parameters()}
        rows = {n: p.shape[0] for n, p in net[0].named_parameters() if n in ("q.weight", "qkv.weight")}
        results.append({"loss": loss.item(), "grads": grads, "rows": rows})
    return results


@pytest.mark.world_size(2)
def test_per_head_norms_and_a_fused_projection_behind_unsqueeze_train_equal_to_one_process(dist_pool):
    from tests.fit_utils import noise_only, relative_error

    references = _step(False)
    for results in dist_pool(2).run(_step, True):
        for result, ref, copied in zip(results, references, COPIED_ROWS):
            assert {n: 2 * rows - copied for n, rows in result["rows"].items()} == ref["rows"]  # heads really split
            assert result["loss"] == pytest.approx(ref["loss"], rel=LOSS_RTOL)
            for name, expected in ref["grads"].items():
                if noise_only(expected):  # the key bias: zero in exact arithmetic (softmax is shift invariant)
                    continue
                assert relative_error(result["grads"][name], expected, expected) <= GRAD_REL, name


class L2NormedAttention(Attention):
    """nGPT's output: the attention output projected onto the unit sphere over all heads' features by a
    module without parameters, before the output projection (transformers' Dory)."""

    def __init__(self) -> None:
        super().__init__()
        self.sub_norm = _UnitNorm()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.heads(self.q(x)).transpose(1, 2), self.kv(self.k(x)), self.kv(self.v(x))
        out = self.weights((q @ k.transpose(-2, -1)) * SIZE**-0.5) @ v
        return x + self.o(self.sub_norm(out.transpose(1, 2).reshape(x.shape)))


class _UnitNorm(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)


def test_a_module_that_sums_over_all_heads_features_runs_whole_on_the_gathered_features():
    """Its forward's aten ops are followed (op_semantics.py): the sum over all heads' features would be
    this rank's share only, so it runs whole on the all-gathered features, each rank keeping its share
    (the region still splits; tests below train it against one process)."""
    assert _plan(L2NormedAttention) == {**ATTENTION, "sub_norm": "replicated"}
