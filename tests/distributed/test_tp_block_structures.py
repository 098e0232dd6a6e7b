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
