"""Tensor parallelism over block lists whose blocks differ in structure (dense blocks, then wider or
MoE-like ones, of one class): each structure gets its own plan, against one process."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

# fp32; t=2 splits each row's sum in two: round-off only (test_tensor_parallel.py)
LOSS_RTOL, GRAD_REL = 1e-5, 1e-5


class DenseOrWideBlock(nn.Module):
    """One class, two structures: its first instances hold ``up``/``down``, the later ones ``fc1``/``fc2``
    of another width (as a model's first dense layers before its MoE layers)."""

    def __init__(self, dense: bool) -> None:
        super().__init__()
        self.dense = dense
        if dense:
            self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)
        else:
            self.fc1, self.fc2 = nn.Linear(8, 32), nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense:
            return x + self.down(F.gelu(self.up(x)))
        return x + self.fc2(F.silu(self.fc1(x)))


class MixedList(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([DenseOrWideBlock(True), DenseOrWideBlock(False), DenseOrWideBlock(False)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_each_block_structure_of_a_list_gets_its_own_plan():
    from lightning_ptdp.tensor_parallel import tensor_parallel_plan

    net = MixedList()
    report = tensor_parallel_plan(net, 2, probe=lambda: net(torch.ones(2, 4, 8)))
    assert {path: style for path, style, _ in report.entries} == {
        "layers.0.up": "colwise",
        "layers.0.down": "rowwise",
        "layers.{1,2}.fc1": "colwise",
        "layers.{1,2}.fc2": "rowwise",
    }


def _step(distributed: bool) -> dict:
    torch.manual_seed(0)
    net = MixedList()
    inputs = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(1))
    if distributed:
        import torch.distributed as dist

        from lightning_ptdp.tensor_parallel import TPGroup, apply_tensor_parallel
        from lightning_ptdp.tensor_parallel.consolidate import full_gradients

        tp = TPGroup(dist.group.WORLD, dist.get_world_size(), dist.get_rank())
        apply_tensor_parallel(net, tp, sequence_parallel=False, probe=lambda: net(inputs))
    loss = net(inputs).square().mean()
    loss.backward()
    grads = full_gradients(net) if distributed else {n: p.grad for n, p in net.named_parameters()}
    rows = [layer.up.weight.shape[0] if layer.dense else layer.fc1.weight.shape[0] for layer in net.layers]
    return {"loss": loss.item(), "grads": grads, "rows": rows}


@pytest.mark.world_size(2)
def test_a_list_of_two_block_structures_trains_equal_to_one_process(dist_pool):
    from tests.fit_utils import relative_error

    ref = _step(False)
    for result in dist_pool(2).run(_step, True):
        assert result["loss"] == pytest.approx(ref["loss"], rel=LOSS_RTOL)
        assert result["rows"] == [8, 16, 16]  # every block split in half, each by its own plan
        for name, expected in ref["grads"].items():
            assert relative_error(result["grads"][name], expected, expected) <= GRAD_REL, name


SHARED_ACT = nn.GELU()  # one instance every block (and every model) calls, as a global activation table holds it


class SharedActBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down, self.act = nn.Linear(8, 16), nn.Linear(16, 8), SHARED_ACT

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.act(self.up(x)))


def _shared_leaf_models() -> list:
    """Two models in one process whose blocks call one activation module instance: the second one's
    blocks still copy (the certificate needs a whole copy) after the first one's rewrite."""
    import copy

    import torch.distributed as dist

    from lightning_ptdp.tensor_parallel import TPGroup, apply_tensor_parallel

    tp = TPGroup(dist.group.WORLD, dist.get_world_size(), dist.get_rank())
    copied, inputs = [], torch.randn(2, 4, 8)
    for _ in range(2):
        torch.manual_seed(0)
        net = nn.Sequential(SharedActBlock(), SharedActBlock())
        copied.append(isinstance(copy.deepcopy(net[0]), SharedActBlock))  # raises if a hook holds a process group
        apply_tensor_parallel(net, tp, sequence_parallel=False, probe=lambda net=net: net(inputs))
        net(inputs).sum().backward()
    return copied


@pytest.mark.world_size(2)
def test_a_leaf_module_shared_by_blocks_and_models_keeps_them_copyable(dist_pool):
    for copied in dist_pool(2).run(_shared_leaf_models):
        assert copied == [True, True]


class WeightsReturningBlock(nn.Module):
    """Eager attention that returns its weights beside the hidden states (GPT-Neo's and MPT's blocks)."""

    def __init__(self, heads: int = 4, width: int = 16) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(width, width) for _ in range(4))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, t, c = x.shape
        q, k, v = (p(x).view(b, t, self.heads, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        weights = torch.softmax(q @ k.transpose(-1, -2) / 2.0, dim=-1)  # [B, H, T, T]
        out = (weights @ v).transpose(1, 2).reshape(b, t, c)
        return x + self.o(out), weights


class WeightsReturningNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([WeightsReturningBlock(), WeightsReturningBlock()])

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        seen = []
        for layer in self.layers:
            x, weights = layer(x)
            seen.append(weights)
        return x, seen


def _tp_step(net: nn.Module, inputs: torch.Tensor, distributed: bool, loss_of=None, split_all: bool = False) -> dict:
    """One step of ``net`` on ``inputs``, split at t = world size (or whole): loss, gradients (whole).
    ``loss_of(output)``: the loss (default: the mean square of the first output); ``split_all``: a
    region kept whole is an error, not a warning."""
    import warnings

    from lightning_ptdp.tensor_parallel.consolidate import full_gradients
    from lightning_ptdp.tensor_parallel.whole_regions import PartialSplitWarning

    first = lambda out: out[0] if isinstance(out, tuple) else out  # noqa: E731
    if distributed:
        import torch.distributed as dist

        from lightning_ptdp.tensor_parallel import TPGroup, apply_tensor_parallel

        tp = TPGroup(dist.group.WORLD, dist.get_world_size(), dist.get_rank())
        with warnings.catch_warnings():
            if split_all:
                warnings.simplefilter("error", PartialSplitWarning)
            apply_tensor_parallel(net, tp, sequence_parallel=False, probe=lambda: first(net(inputs)))
    out = net(inputs)
    loss = loss_of(out) if loss_of is not None else first(out).square().mean()
    loss.backward()
    grads = full_gradients(net) if distributed else {n: p.grad for n, p in net.named_parameters()}
    return {"loss": loss.item(), "grads": grads, "out": out}


def _assert_as_one_process(result: dict, ref: dict, skip_noise: bool = True) -> None:
    """Loss and every gradient as the single process's; ``skip_noise``: a gradient that is round-off
    only (the key bias: softmax ignores a constant per query) is not compared."""
    from tests.fit_utils import noise_only, relative_error

    assert result["loss"] == pytest.approx(ref["loss"], rel=LOSS_RTOL)
    for name, expected in ref["grads"].items():
        if skip_noise and noise_only(expected):
            continue
        assert relative_error(result["grads"][name], expected, expected) <= GRAD_REL, name


def _inputs(width: int, tokens: int = 6) -> torch.Tensor:
    torch.manual_seed(0)  # the model built next draws the same weights on every rank and in the reference
    return torch.randn(2, tokens, width, generator=torch.Generator().manual_seed(1))


def _weights_step(distributed: bool, reads_weights: bool) -> dict:
    inputs = _inputs(16)
    net = WeightsReturningNet()

    def loss_of(out: tuple) -> torch.Tensor:
        loss = out[0].square().mean()
        if reads_weights:  # the whole [B, H, T, T] weights, as one process has them
            loss = loss + sum((w * torch.arange(w.shape[1]).view(1, -1, 1, 1)).mean() for w in out[1])
        return loss

    result = _tp_step(net, inputs, distributed, loss_of)
    heads = result.pop("out")[1][0].shape
    return {**result, "rows": net.layers[0].q.weight.shape[0], "heads": heads}


@pytest.mark.world_size(2)
@pytest.mark.parametrize("reads_weights", [False, True])
def test_attention_weights_a_block_returns_are_gathered_where_read(dist_pool, reads_weights):
    """The heads are split (not kept whole with a warning); the returned weights, read by the loss
    with a per-head factor, are the whole [B, H, T, T]: loss and gradients equal one process's."""
    ref = _weights_step(False, reads_weights)
    for result in dist_pool(2).run(_weights_step, True, reads_weights):
        assert result["rows"] == 8  # q split by heads over t = 2
        assert tuple(result["heads"]) == (2, 4, 6, 6)
        _assert_as_one_process(result, ref)


class CarriedStateNet(nn.Module):
    """A block handing a column output to the next block besides the hidden states (ZAYA's router
    state): tests/unit/test_tp_discovery.py's HandsOnBlock."""

    def __init__(self) -> None:
        super().__init__()
        from tests.unit.test_tp_discovery import HandsOnBlock

        self.layers = nn.ModuleList([HandsOnBlock(True), HandsOnBlock(False)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        carried = None
        for layer in self.layers:
            x, carried = layer(x, carried)
        return x


def _carried_step(distributed: bool) -> dict:
    inputs = _inputs(8, tokens=4)
    net = CarriedStateNet()
    result = _tp_step(net, inputs, distributed, split_all=True)  # both blocks split: no region kept whole
    result.pop("out")
    return {**result, "rows": [layer.down.weight.shape[0] for layer in net.layers]}


@pytest.mark.world_size(2)
def test_a_state_handed_to_the_next_block_is_gathered_there(dist_pool):
    ref = _carried_step(False)
    for result in dist_pool(2).run(_carried_step, True):
        assert result["rows"] == [8, 8]  # both blocks' down split: the state stays this rank's share between them
        _assert_as_one_process(result, ref, skip_noise=False)


class PerHeadBiasBlock(nn.Module):
    """Attention scores plus a whole [H, 1, T] per-head tensor the model computes (ALiBi, as BLOOM's
    and MPT's blocks take it): each rank adds its heads' slice."""

    def __init__(self, heads: int = 4, width: int = 16) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(width, width) for _ in range(4))

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (p(x).view(b, t, self.heads, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        scores = (q @ k.transpose(-1, -2)) * 0.5 + bias
        return x + self.o((torch.softmax(scores, -1) @ v).transpose(1, 2).reshape(b, t, c))


class PerHeadBiasNet(nn.Module):
    def __init__(self, learned: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList([PerHeadBiasBlock(), PerHeadBiasBlock()])
        slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
        self.slopes = nn.Parameter(slopes) if learned else nn.Buffer(slopes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        bias = self.slopes.view(-1, 1, 1) * -torch.arange(t, dtype=x.dtype).view(1, 1, t)  # [H, 1, T]
        for layer in self.layers:
            x = layer(x, bias)
        return x


def _bias_step(distributed: bool, learned: bool) -> dict:
    inputs = _inputs(16)
    net = PerHeadBiasNet(learned)
    result = _tp_step(net, inputs, distributed)
    result.pop("out")
    return {**result, "rows": net.layers[0].q.weight.shape[0]}


@pytest.mark.world_size(2)
@pytest.mark.parametrize("learned", [False, True])  # a buffer; a parameter, whose gradient sums every rank's heads
def test_a_whole_per_head_bias_is_sliced_to_each_ranks_heads(dist_pool, learned):
    ref = _bias_step(False, learned)
    for result in dist_pool(2).run(_bias_step, True, learned):
        assert result["rows"] == 8  # split by heads, no warning
        _assert_as_one_process(result, ref)
