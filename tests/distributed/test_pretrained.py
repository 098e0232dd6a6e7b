"""Starting from pretrained weights under t=2 p=2, and back to the original class's own files.

A tiny transformers Llama is saved with ``save_pretrained`` (safetensors). Three runs must give
the same losses and weights: one process loading it with ``from_pretrained``; t=2 p=2 with the
same ``from_pretrained`` in the LightningModule; and t=2 p=2 with the model built in
``configure_model`` (parameters on the meta device) and ``PTDPStrategy(pretrained=folder)``,
where each rank reads only its slices of the files. The trained weights, stripped of the
LightningModule's prefix, load back into ``LlamaForCausalLM`` and round-trip through
``save_pretrained`` / ``from_pretrained``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import lightning as L
import pytest
import torch

from tests.fit_utils import assert_ranks_match_reference, fit_and_record

STEPS = 3
# fp32: t and p split the sums, round-off only (see test_real_models.py)
LOSS_RTOL, GRAD_REL, UPDATE_REL = 1e-5, 1e-5, 1e-3
T2P2 = {"tensor_parallel_size": 2, "pipeline_parallel_size": 2, "micro_batch_size": 2, "pipeline_schedule": "1f1b"}


class SaveAtEnd(L.Callback):
    """A sharded checkpoint of the trained run, as a user's ModelCheckpoint would leave it (the
    run itself uses the full format, so that its recorded state is the whole model)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_end(self, trainer, pl_module) -> None:
        trainer.strategy.checkpoint_format = "sharded"
        try:
            trainer.save_checkpoint(self.path)
        finally:
            trainer.strategy.checkpoint_format = "full"


def consolidated_folder(tmp_path: Path, pretrained_dir: str) -> Path:
    """``tmp_path / "run.ckpt"`` (sharded) consolidated to the model's own keys with ``ptdp checkpoint
    consolidate ... --strip-prefix net.model.``, beside the original config: a from_pretrained folder."""
    from lightning_ptdp.checkpoint.command import main as checkpoint_command

    folder = tmp_path / "from_checkpoint"
    folder.mkdir()
    shutil.copy(Path(pretrained_dir) / "config.json", folder)
    args = [
        "consolidate",
        str(tmp_path / "run.ckpt"),
        str(folder / "model.safetensors"),
        "--strip-prefix",
        "net.model.",
    ]
    assert checkpoint_command(args) == 0
    return folder


@pytest.fixture(scope="module")
def pretrained_dir(tmp_path_factory) -> str:
    from tests.real_models import hf_llama

    torch.manual_seed(7)  # weights unlike any seed-0 initialisation
    folder = tmp_path_factory.mktemp("llama")
    hf_llama().model.save_pretrained(folder)
    return str(folder)


@pytest.mark.world_size(4)
def test_pretrained_start_and_round_trip_at_t2_p2(dist_pool, pretrained_dir, tmp_path):
    from transformers import LlamaForCausalLM

    ref = fit_and_record("hf_from", steps=STEPS, model_overrides={"path": pretrained_dir})
    loaded = dist_pool(4).run(
        fit_and_record,
        "hf_from",
        strategy_kwargs=T2P2,
        devices=4,
        steps=STEPS,
        model_overrides={"path": pretrained_dir},
    )
    assert_ranks_match_reference(loaded, ref, loss_rtol=LOSS_RTOL, grad_rel=GRAD_REL, update_rel=UPDATE_REL)
    streamed = dist_pool(4).run(
        fit_and_record,
        "hf_deferred",
        strategy_kwargs={**T2P2, "pretrained": pretrained_dir},
        devices=4,
        steps=STEPS,
        model_overrides={"path": pretrained_dir},
        callbacks=[SaveAtEnd(str(tmp_path / "run.ckpt"))],
    )
    assert_ranks_match_reference(streamed, ref, loss_rtol=LOSS_RTOL, grad_rel=GRAD_REL, update_rel=UPDATE_REL)
    full = sum(v.numel() for k, v in ref["state"].items() if k in ref["first_grads"])
    assert all(r["local_numel"] <= 0.45 * full for r in streamed)  # each rank holds its quarter (+ norms)

    # the trained weights under the original class's own keys, through its own files
    trained = next(r["state"] for r in streamed if r["state"])
    own = {k.removeprefix("net.model."): v for k, v in trained.items()}
    model = LlamaForCausalLM.from_pretrained(pretrained_dir)
    model.load_state_dict(own, strict=True)
    model.save_pretrained(tmp_path / "trained")
    again = LlamaForCausalLM.from_pretrained(tmp_path / "trained").state_dict()
    for key, value in own.items():
        assert torch.equal(again[key], value), key

    # and from the run's sharded checkpoint on disk, with the command the README gives
    consolidated = LlamaForCausalLM.from_pretrained(consolidated_folder(tmp_path, pretrained_dir)).state_dict()
    for key, value in own.items():
        assert torch.equal(consolidated[key], value), key


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory) -> str:
    from tests.real_models import moe_hf

    torch.manual_seed(7)
    folder = tmp_path_factory.mktemp("mixtral")
    moe_hf("hf_mixtral").model.save_pretrained(folder)
    return str(folder)


@pytest.mark.world_size(2)
def test_pretrained_mixture_of_experts_at_d2_e2_and_back_through_from_pretrained(dist_pool, mixtral_dir, tmp_path):
    """A transformers Mixtral built on the meta device in ``configure_model`` and started from its
    ``save_pretrained`` files at d2 e2: each rank allocates and reads only its 2 of the 4 experts,
    and trains as one process loading the files with ``from_pretrained``. The run's sharded
    checkpoint, consolidated to the model's own keys, loads with ``MixtralForCausalLM.from_pretrained``."""
    from transformers import MixtralForCausalLM

    ref = fit_and_record("hf_from", steps=STEPS, model_overrides={"path": mixtral_dir})
    streamed = dist_pool(2).run(
        fit_and_record,
        "hf_deferred",
        strategy_kwargs={"expert_parallel_size": 2, "pretrained": mixtral_dir},
        devices=2,
        steps=STEPS,
        model_overrides={"path": mixtral_dir},
        callbacks=[SaveAtEnd(str(tmp_path / "run.ckpt"))],
    )
    assert_ranks_match_reference(streamed, ref, loss_rtol=LOSS_RTOL, grad_rel=GRAD_REL, update_rel=UPDATE_REL)
    sizes = {k: v.numel() for k, v in ref["state"].items() if k in ref["first_grads"]}
    experts = sum(n for k, n in sizes.items() if ".experts." in k)
    assert all(r["local_numel"] == sum(sizes.values()) - experts // 2 for r in streamed)  # half the experts each

    consolidated = MixtralForCausalLM.from_pretrained(consolidated_folder(tmp_path, mixtral_dir)).state_dict()
    trained = next(r["state"] for r in streamed if r["state"])
    for key, value in trained.items():
        assert torch.equal(consolidated[key.removeprefix("net.model.")], value), key
