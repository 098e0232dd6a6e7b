"""One rank's NaN is detected by all ranks together, and the configured policy holds."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F

from tests.models import CausalLM, Llama, ZooConfig

BAD_STEP, BAD_RANK, STEPS = 2, 1, 5


class NaNOnOneRank(CausalLM):
    """Turns its loss into NaN on one rank at one step, as a bad batch or overflow would."""

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        loss = F.cross_entropy(self.net(inputs).flatten(0, 1), targets.flatten())
        if self.trainer.global_step == BAD_STEP and self.trainer.global_rank == BAD_RANK:
            loss = loss * float("nan")
        return loss


class WeightTrace(L.Callback):
    def __init__(self) -> None:
        self.sums: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        self.sums.append(float(sum(p.detach().double().sum() for p in pl_module.parameters())))


def train(policy: str) -> dict:
    from lightning_ptdp import PTDPStrategy
    from tests.fit_utils import quiet_trainer, zoo_data

    L.seed_everything(0, verbose=False)
    model = NaNOnOneRank(Llama(ZooConfig()))
    data = zoo_data(4, 4000, 100)
    trace = WeightTrace()
    trainer = quiet_trainer(devices=2, strategy=PTDPStrategy(on_nonfinite=policy), max_steps=STEPS, callbacks=[trace])
    try:
        trainer.fit(model, data)
    except FloatingPointError as err:
        return {"error": str(err), "sums": trace.sums}
    return {"error": None, "sums": trace.sums}


@pytest.mark.world_size(2)
def test_raise_stops_every_rank_naming_step_and_rank(dist_pool):
    results = dist_pool(2).run(train, "raise")
    for result in results:  # both ranks stop at the same step, not only the one that saw the NaN
        assert result["error"] is not None
        assert f"global step {BAD_STEP}: loss on rank(s) [{BAD_RANK}]" in result["error"]
        assert len(result["sums"]) == BAD_STEP


@pytest.mark.world_size(2)
def test_skip_drops_the_step_on_every_rank(dist_pool):
    results = dist_pool(2).run(train, "skip")
    for result in results:
        sums = result["sums"]
        assert result["error"] is None and len(sums) == STEPS
        assert all(torch.isfinite(torch.tensor(sums)))
        assert sums[BAD_STEP] == sums[BAD_STEP - 1]  # that step changed nothing
        assert sums[BAD_STEP + 1] != sums[BAD_STEP]  # and training went on
    assert results[0]["sums"] == results[1]["sums"]  # replicas still identical


def test_unknown_policy_is_refused():
    from lightning_ptdp import PTDPStrategy

    with pytest.raises(ValueError, match=r"on_nonfinite='warn' is not one of 'raise', 'skip', 'ignore'"):
        PTDPStrategy(on_nonfinite="warn")


def _trainer_with_grad_scaler(policy: str):
    from lightning.pytorch.plugins.precision import MixedPrecision

    from lightning_ptdp import PTDPStrategy
    from tests.fit_utils import quiet_trainer

    # precision="16-mixed" on CPU becomes bf16 in Lightning; the plugin carries the GradScaler a GPU run has
    scaled = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    return quiet_trainer(devices=2, strategy=PTDPStrategy(on_nonfinite=policy), plugins=[scaled], max_steps=1)


@pytest.mark.parametrize("policy", ["raise", "skip"])
def test_grad_scaler_with_a_nonfinite_policy_is_refused_at_construction(policy):
    with pytest.raises(
        ValueError,
        match=rf"precision='16-mixed' scales the loss with a GradScaler, which skips a step "
        rf"whose gradients overflow and lowers the scale: that is how it works, not a "
        rf"failure, but on_nonfinite='{policy}' would act on it .* use "
        rf"precision='bf16-mixed', or on_nonfinite='ignore' to let the GradScaler "
        rf"decide alone",
    ):
        _trainer_with_grad_scaler(policy)


def test_grad_scaler_decides_alone_with_ignore():
    trainer = _trainer_with_grad_scaler("ignore")
    assert trainer.strategy.precision_plugin.scaler is not None
