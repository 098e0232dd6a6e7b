"""A linear-attention mixer in plain torch (Gated DeltaNet's shape, as Qwen3.5's and Kimi-Linear's):
a fused q | k | v projection of unequal parts (or three projections joined by ``torch.cat``), moved
channels-first through a depthwise causal conv (``groups`` = channels: its weight [C, k] a parameter of
the block, or an ``nn.Conv1d`` with a bias), split, a recurrent state made
from sizes alone (``torch.zeros(B, heads, dk, dv)`` with the config's head count), an output written
step by step (``out[:, :, t] = ...``), and a gated norm on rows holding every head
((B*T*heads, dv)). Split by heads at t=2 it trains as one process, each rank holding its share of
every matrix: the conv's weight and bias too (cut to its channels where the conv reads them), with
no warning. A module the
recorded forward never runs (a decoder's cross-attention without an encoder) stays whole with a
warning naming it."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

HIDDEN, HEADS, DK, DV, KERNEL, SEQ = 16, 4, 4, 8, 3, 6
LOSS_RTOL, GRAD_REL = 1e-5, 1e-5  # fp32: t=2 splits each output row's sum in two, round-off only


class GatedNorm(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, width))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * x * F.silu(gate)


class ConvLinearAttention(nn.Module):
    def __init__(self, unused: bool = False, separate: bool = False, frozen_conv: bool = False) -> None:
        super().__init__()
        self.key_dim, self.value_dim = HEADS * DK, HEADS * DV
        channels = 2 * self.key_dim + self.value_dim
        self.separate = separate
        if separate:
            self.q, self.k = nn.Linear(HIDDEN, self.key_dim, bias=False), nn.Linear(HIDDEN, self.key_dim, bias=False)
            self.v = nn.Linear(HIDDEN, self.value_dim, bias=False)
            self.conv = nn.Conv1d(channels, channels, KERNEL, groups=channels, padding=KERNEL - 1)
        else:
            self.in_qkv = nn.Linear(HIDDEN, channels, bias=False)
            taps = torch.randn(channels, KERNEL) / KERNEL
            if frozen_conv:  # a buffer: cut at the call, held whole (MiniMax's decay rates)
                self.register_buffer("conv_weight", taps)
            else:
                self.conv_weight = nn.Parameter(taps)
        self.in_z = nn.Linear(HIDDEN, self.value_dim, bias=False)
        self.norm = GatedNorm(DV)
        self.out = nn.Linear(self.value_dim, HIDDEN, bias=False)
        self.cross = nn.Linear(HIDDEN, HIDDEN) if unused else None  # read only with an encoder

    def forward(self, x: torch.Tensor, encoder: torch.Tensor | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        if self.separate:
            qkv = self.conv(torch.cat([self.q(x), self.k(x), self.v(x)], dim=-1).transpose(1, 2))[:, :, :T]
        else:
            qkv = self.in_qkv(x).transpose(1, 2)  # (B, C, T)
            channels = qkv.shape[1]
            qkv = F.conv1d(qkv, self.conv_weight.unsqueeze(1), padding=KERNEL - 1, groups=channels)[:, :, :T]
        q, k, v = F.silu(qkv).transpose(1, 2).split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q, k = (F.normalize(t.reshape(B, T, -1, DK), dim=-1) for t in (q, k))  # (B, T, nh, dk)
        v = v.reshape(B, T, -1, DV)
        state = torch.zeros(B, HEADS, DK, DV)  # the config's head count: 1/t of it on each rank
        out = torch.zeros_like(v.transpose(1, 2))  # (B, nh, T, dv)
        for t in range(T):  # a recurrence over time, per head
            kt, vt, qt = k[:, t].unsqueeze(-1), v[:, t].unsqueeze(-2), q[:, t].unsqueeze(-2)
            state = 0.9 * state + kt @ vt  # (B, nh, dk, dv)
            out[:, :, t] = (qt @ state).squeeze(-2)
        z = self.in_z(x)
        out = self.norm(out.transpose(1, 2).reshape(-1, DV), z.reshape(-1, DV))  # (B*T*nh, dv)
        if encoder is not None:
            out = out + self.cross(encoder)
        return x + self.out(out.reshape(z.shape))  # a shape read from a head-sharded tensor, handed on


class MixerNet(nn.Module):
    def __init__(self, unused: bool = False, separate: bool = False, frozen_conv: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([ConvLinearAttention(unused, separate, frozen_conv) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _step(distributed: bool, variant: str) -> dict:
    import warnings

    from tests.distributed.test_tp_block_structures import _inputs

    inputs = _inputs(HIDDEN, SEQ)
    separate = variant == "cat-of-q-k-v"
    net = MixerNet(separate=separate, frozen_conv=variant == "frozen-conv")
    if distributed:
        import torch.distributed as dist

        from lightning_ptdp.tensor_parallel import PartialSplitWarning, TPGroup, apply_tensor_parallel

        tp = TPGroup(dist.group.WORLD, dist.get_world_size(), dist.get_rank())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", PartialSplitWarning)
            report = apply_tensor_parallel(net, tp, sequence_parallel=False, probe=lambda: net(inputs))
        said = [str(w.message) for w in caught if issubclass(w.category, PartialSplitWarning)]
    loss = net(inputs).square().mean()
    loss.backward()
    if distributed:  # the norm's weight is whole on both ranks, each rank's gradient from its heads' rows
        from lightning_ptdp.parallel.grad_sums import sum_partial_over_tp
        from lightning_ptdp.tensor_parallel.consolidate import full_gradients, full_state_dict

        sum_partial_over_tp(net, report.partial_grad_params, tp)
        grads = full_gradients(net)
        state = full_state_dict(net)  # the conv's share gathered back to the model's own tensor
    else:
        grads = {n: p.grad for n, p in net.named_parameters()}
        state = net.state_dict()
    first = net.blocks[0]
    rows = sum(first.get_submodule(n).weight.shape[0] for n in (("q", "k", "v") if separate else ("in_qkv",)))
    conv = [first.conv.weight, first.conv.bias] if separate else [first.conv_weight]
    return {
        "loss": loss.item(),
        "grads": grads,
        "rows": rows,
        "conv_rows": [p.shape[0] for p in conv],
        "state": {k: v.detach().clone() for k, v in state.items()},
        "said": said if distributed else [],
    }


@pytest.mark.world_size(2)
@pytest.mark.parametrize("variant", ["fused-qkv", "cat-of-q-k-v", "frozen-conv"])
def test_a_conv_linear_attention_mixer_splits_by_heads_equal_to_one_process(dist_pool, variant):
    from tests.distributed.test_tp_block_structures import _assert_as_one_process

    ref = _step(False, variant)
    for result in dist_pool(2).run(_step, True, variant):
        assert result["rows"] == (2 * HEADS * DK + HEADS * DV) // 2  # each rank: its share of q, k and v
        if variant == "frozen-conv":  # a buffer: whole on every rank, cut where the conv reads it, and named
            assert result["conv_rows"] == [2 * result["rows"]]
            (said,) = result["said"]
            assert "keeps conv_weight whole on every rank (each rank reads its heads' share where it is used)" in said
        else:  # and of the conv's channels, its bias's too
            assert set(result["conv_rows"]) == {result["rows"]} and result["said"] == []
        _assert_as_one_process(result, ref)
        assert result["state"].keys() == ref["state"].keys()
        for key, value in ref["state"].items():  # after the same step on the same weights
            torch.testing.assert_close(result["state"][key], value, rtol=0, atol=0, msg=key)


def test_a_module_the_recorded_forward_never_runs_stays_whole_with_a_warning():
    from lightning_ptdp.tensor_parallel import PartialSplitWarning, tensor_parallel_plan

    net = MixerNet(unused=True)
    with pytest.warns(PartialSplitWarning, match=r"keeps cross whole on every rank \(the recorded forward never ran"):
        report = tensor_parallel_plan(net, 2, probe=lambda: net(torch.randn(2, SEQ, HIDDEN)))
    styles = {path: style for path, style, _ in report.entries}
    assert styles["blocks.*.in_qkv"].startswith("colwise_fused") and styles["blocks.*.out"] == "rowwise"
