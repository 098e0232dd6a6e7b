"""Which modules become ZeRO 2-3's FSDP units outside the blocks (data_parallel/fsdp.py): modules whose
forward the step calls, as the census saw (core/census.py ``ModulesCalled``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from lightning_ptdp.core.census import ModulesCalled, record_alone
from lightning_ptdp.data_parallel.fsdp import _units_outside_blocks


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, 16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


class Wrapper(nn.Module):
    def __init__(self, own_scale: bool = False) -> None:
        super().__init__()
        self.inner = Inner()
        self.scale = nn.Parameter(torch.ones(())) if own_scale else None
        self.unused = nn.Linear(8, 8)  # never called by anything

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.inner(ids)


def _units(holder: nn.Module, step) -> dict:
    called = record_alone(step, ModulesCalled()).called
    return _units_outside_blocks(holder, list(holder.net.inner.blocks), zero_stage=3, called=called)


def test_a_wrapper_the_step_goes_around_is_no_unit_but_its_called_child_is():
    holder = nn.Module()
    holder.net = Wrapper()
    ids = torch.zeros(2, 3, dtype=torch.long)
    assert set(_units(holder, lambda: holder.net(ids))) == {"net"}
    assert set(_units(holder, lambda: holder.net.inner(ids))) == {"net.inner", "net.unused"}


def test_a_bypassed_module_with_parameters_of_its_own_is_refused_at_setup():
    holder = nn.Module()
    holder.net = Wrapper(own_scale=True)
    ids = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match=r"'net' \(Wrapper\) holds parameters of its own but the step calls modules"):
        _units(holder, lambda: holder.net.inner(ids))
