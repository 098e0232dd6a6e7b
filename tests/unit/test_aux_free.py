"""AuxFreeBalancing in one process: it finds a plain-torch router's correction bias from the model,
applies DeepSeek-V3's sign rule exactly, balances a skewed router, and refuses a model without one."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_ptdp.callbacks import AuxFreeBalancing
from lightning_ptdp.testing import quiet_trainer

HIDDEN, EXPERTS, TOP_K, TOKENS = 16, 8, 2, 32
SKEW = 3.0  # router logits pushed toward experts 0 and 1: sigmoid(3) ~ 0.95 picks them for most tokens


class Router(nn.Module):
    """DeepSeek-V3's selection in plain torch: sigmoid scores, plus a correction bias, topk."""

    def __init__(self, corrected: bool = True) -> None:
        super().__init__()
        self.gate = nn.Linear(HIDDEN, EXPERTS)  # its 1-D bias is applied by linear, not added: not a correction
        with torch.no_grad():
            self.gate.bias.zero_()
            self.gate.bias[:2] = SKEW
        self.corrected = corrected
        if corrected:
            self.register_buffer("correction", torch.zeros(EXPERTS))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.gate(x).sigmoid()
        choice = scores + self.correction if self.corrected else scores
        indices = torch.topk(choice, TOP_K, dim=-1).indices
        return scores.gather(-1, indices), indices


class TinyMoE(L.LightningModule):
    def __init__(self, corrected: bool = True, lr: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.router = Router(corrected)
        self.experts = nn.Parameter(torch.randn(EXPERTS, HIDDEN, HIDDEN) / HIDDEN**0.5)
        self.lr = lr

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, HIDDEN)
        weights, indices = self.router(flat)
        out = torch.einsum("th,tkhg->tg", flat, self.experts[indices] * weights[..., None, None])
        return out.reshape(x.shape)

    def training_step(self, batch: tuple[torch.Tensor], idx: int) -> torch.Tensor:
        return self(batch[0]).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def batches(steps: int, batch: int = 4) -> torch.Tensor:
    return torch.randn(steps * batch, TOKENS, HIDDEN, generator=torch.Generator().manual_seed(1))


def fit(model: L.LightningModule, data: torch.Tensor, steps: int, batch: int = 4, **kwargs) -> AuxFreeBalancing:
    callback = AuxFreeBalancing(kwargs.pop("rate", 0.05))
    loader = DataLoader(TensorDataset(data), batch_size=batch, shuffle=False)
    quiet_trainer(devices=1, max_steps=steps, callbacks=[callback], **kwargs).fit(model, loader)
    return callback


@pytest.mark.parametrize("rate", [0, -1e-3, float("nan"), "1e-3", True])
def test_the_rate_must_be_positive(rate):
    with pytest.raises(ValueError, match=r"rate must be a number > 0.*Pass a positive rate"):
        AuxFreeBalancing(rate)


def test_one_step_applies_the_sign_rule_to_the_bias_found():
    data = batches(1)
    model = TinyMoE()
    with torch.no_grad():
        _, chosen = model.router(data.reshape(-1, HIDDEN))
    load = chosen.flatten().bincount(minlength=EXPERTS).double()
    expected = (0.05 * (load.mean() - load).sign()).float()
    callback = fit(model, data, steps=1)
    assert [r.bias.name for r in callback.routers] == ["router.correction"]  # not gate.bias
    assert torch.equal(model.router.correction, expected)
    assert callback.history[0]["router.correction"] == pytest.approx(float(load.max() / load.mean()))


def test_every_microbatch_of_an_accumulated_step_counts():
    whole, parts = TinyMoE(), TinyMoE()
    fit(whole, batches(3), steps=3)
    fit(parts, batches(3), steps=3, batch=2, accumulate_grad_batches=2)
    assert torch.equal(parts.router.correction, whole.router.correction)


def test_a_skewed_router_becomes_balanced():
    model = TinyMoE(lr=0.01)
    callback = fit(model, batches(30), steps=30)
    imbalance = [step["router.correction"] for step in callback.history]
    assert imbalance[0] > 3.0  # two of eight experts take most tokens: 4.0 at worst
    assert sum(imbalance[-10:]) / 10 < 0.5 * imbalance[0]
    assert model.router.correction[:2].max() < model.router.correction[2:].min()  # the hot experts pushed down


def test_a_model_without_a_correction_bias_is_refused():
    with pytest.raises(
        RuntimeError, match=r"found no router correction bias.*before a torch.topk.*drop AuxFreeBalancing"
    ):
        fit(TinyMoE(corrected=False), batches(1), steps=1)
