"""Sharded checkpoints (the default format): each rank writes only its pieces, the pieces put
together are exactly the unsharded checkpoint, and a checkpoint converted either way loads and
resumes on another layout. Damaged ones are refused naming what is wrong.

The oracle for "the pieces are right" is the full-format checkpoint written from the same
trained state in the same process (its gathering is tested against a single process in
test_tensor_parallel/test_pipeline/test_zero): equal bit for bit, since both are copies of the same tensors.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch

STEPS = 4
LOSS_RTOL = 1e-5  # fp32; resumed runs repeat the same arithmetic on the same layout (1e-7 measured)
VAL_RTOL = 1e-6  # the same weights evaluated twice on one layout; only reduction order could differ


def _data(vocab: int, batch: int):
    from recipes.data import MarkovDataModule

    return MarkovDataModule(
        vocab_size=vocab, seq_length=32, batch_size=batch, train_tokens=STEPS * 8 * 33 + 1, val_tokens=400
    )


def fit(
    family: str,
    devices: int,
    strategy: dict,
    *,
    epochs: int = 1,
    resume: str | None = None,
    saves: dict[str, str] | None = None,
    vocab: int = 62,
    unused_param: bool = False,
    then_validate: str | None = None,
    **overrides,
) -> list:
    """Train; then save the final state under each path in the format given; return the losses
    (and with ``then_validate``, the validation loss of that checkpoint in the same trainer)."""
    import lightning as L
    import torch.nn as nn

    from lightning_ptdp import PTDPStrategy
    from tests.fit_utils import LossRecorder, quiet_trainer
    from tests.models import build_model

    L.seed_everything(0, verbose=False)
    ptdp = PTDPStrategy(**strategy)
    recorder = LossRecorder()
    trainer = quiet_trainer(devices=devices, strategy=ptdp, max_epochs=epochs, callbacks=[recorder])
    tp_pp = strategy.get("tensor_parallel_size", 1) * strategy.get("pipeline_parallel_size", 1)
    model = build_model(family, vocab_size=vocab, **overrides)
    if unused_param:  # optimized but never given a gradient: Adam keeps no state for it
        model.unused = nn.Linear(2, 2)
    data = _data(vocab, 8 * tp_pp // devices)
    trainer.fit(model, data, ckpt_path=resume)
    for path, fmt in (saves or {}).items():
        ptdp.checkpoint_format = fmt
        trainer.save_checkpoint(path)
    if then_validate is not None:  # the fit's optimizers still exist; evaluation must not want their state
        trainer.limit_val_batches = 2
        return [recorder.losses, trainer.validate(model, data, ckpt_path=then_validate, verbose=False)[0]["val_loss"]]
    return recorder.losses


def validate(devices: int, strategy: dict, paths: list[str], unused_param: bool = False) -> list[float]:
    """The recipe GPT's validation loss with the weights of each checkpoint."""
    import lightning as L
    import torch.nn as nn

    from lightning_ptdp import PTDPStrategy
    from tests.fit_utils import quiet_trainer
    from tests.models import build_model

    L.seed_everything(0, verbose=False)
    trainer = quiet_trainer(devices=devices, strategy=PTDPStrategy(**strategy), limit_val_batches=2)
    data = _data(62, 4)
    model = build_model("gpt", vocab_size=62)
    if unused_param:
        model.unused = nn.Linear(2, 2)
    return [trainer.validate(model, data, ckpt_path=p, verbose=False)[0]["val_loss"] for p in paths]


def _assert_same(consolidated: dict, full: dict) -> None:
    assert consolidated.keys() == full.keys()
    for key, value in full.items():
        assert torch.equal(consolidated[key], value), key


LAYOUTS = {  # chosen so every kind of piece appears
    "nanogpt-t2p2": ("nanogpt", {"tensor_parallel_size": 2, "pipeline_parallel_size": 2, "micro_batch_size": 2}, {}),
    # fused q/k/v rows cut by TP, then by ZeRO across the q|k block edge; vocab 62 padded to 64
    "nanogpt-t2d2-zero3": ("nanogpt", {"tensor_parallel_size": 2, "zero_stage": 3}, {}),
    # ZeRO-1: each dp rank writes the Adam state of the parameters it owns, the full file gathers them
    "nanogpt-t2d2-zero1": ("nanogpt", {"tensor_parallel_size": 2, "zero_stage": 1}, {}),
    "nanogpt-p2d2-zero1": ("nanogpt", {"pipeline_parallel_size": 2, "micro_batch_size": 2, "zero_stage": 1}, {}),
    # HSDP, 2 groups of 2: each half of every tensor is held by two ranks (written once)
    "nanogpt-d4-hsdp-2x2": ("nanogpt", {"zero_stage": 3, "data_parallel_shard_size": 2}, {}),
    # 2 KV heads over t=4: each KV head replicated on two ranks (written once)
    "llama-t4-gqa": ("llama", {"tensor_parallel_size": 4}, {"num_kv_heads": 2}),
}


@pytest.mark.world_size(4)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_pieces_put_together_are_the_unsharded_checkpoint(dist_pool, tmp_path, layout):
    from lightning_ptdp.checkpoint.command import consolidate, consolidated_state_dict
    from tests.models import build_model

    family, strategy, overrides = LAYOUTS[layout]
    sharded, full = tmp_path / "sharded.ckpt", tmp_path / "full.ckpt"
    dist_pool(4).run(fit, family, 4, strategy, saves={str(sharded): "sharded", str(full): "full"}, **overrides)
    reference = torch.load(full, weights_only=False)
    weights = consolidated_state_dict(str(sharded))  # no process group here
    _assert_same(weights, reference["state_dict"])
    single = build_model(family, vocab_size=62, **overrides)
    single.load_state_dict(weights, strict=True)  # plain load, one device
    whole = consolidate(str(sharded))
    # optimizer state under the single process's parameter names (a tied weight once, by its first name)
    assert sorted(whole["optimizer_states"][0]["state"]) == sorted(name for name, _ in single.named_parameters())
    for name, state in whole["optimizer_states"][0]["state"].items():
        _assert_same(state, reference["optimizer_states"][0]["state"][name])
    assert whole["global_step"] == reference["global_step"] == STEPS and whole["loops"] == reference["loops"]
    # each rank wrote its own file, every piece once (the tensor bytes in the files add up to the
    # unsharded checkpoint's exactly), and no rank wrote everything: the largest share is under 45%
    # (its quarter of the blocks plus embeddings; t2p2's stage 0 is the largest)
    written = _tensor_bytes_per_file(sharded)
    assert sorted(written) == [f"__{r}_0.distcp" for r in range(4)]
    tensors = [*weights.values(), *(v for s in whole["optimizer_states"][0]["state"].values() for v in s.values())]
    assert sum(written.values()) == sum(v.numel() * v.element_size() for v in tensors)
    assert max(written.values()) < 0.45 * sum(written.values()), written


def _tensor_bytes_per_file(checkpoint: Path) -> dict[str, int]:
    """Bytes of tensor data each rank's file holds, from the checkpoint's own index."""
    from lightning_ptdp.checkpoint.dcp_load import open_checkpoint

    _, metadata = open_checkpoint(str(checkpoint.resolve()))
    written: dict[str, int] = {}
    for index, info in metadata.storage_data.items():
        stored = metadata.state_dict_metadata[index.fqn]
        if hasattr(stored, "chunks"):  # a tensor (the rest are pickled objects)
            chunk = next(c for c in stored.chunks if c.offsets == index.offset)
            size = chunk.sizes.numel() * stored.properties.dtype.itemsize
            written[info.relative_path] = written.get(info.relative_path, 0) + size
    return written


@pytest.mark.world_size(4)
def test_converted_checkpoints_load_and_resume_on_other_layouts(dist_pool, tmp_path):
    """Saved at (t2, p2): a plain state_dict made sharded evaluates like the original on t=4; a full
    checkpoint made sharded resumes at t=4 exactly like the sharded checkpoint of the same state."""
    from lightning_ptdp.checkpoint.command import consolidated_state_dict
    from lightning_ptdp.tools.cli import main

    t2p2 = {"tensor_parallel_size": 2, "pipeline_parallel_size": 2, "micro_batch_size": 2}
    sharded, full = str(tmp_path / "s.ckpt"), str(tmp_path / "f.ckpt")
    dist_pool(4).run(fit, "gpt", 4, t2p2, saves={sharded: "sharded", full: "full"}, unused_param=True)
    plain = tmp_path / "plain.pt"
    for command in (
        ["consolidate", sharded, str(plain)],
        ["shard", str(plain), str(tmp_path / "from_plain.ckpt")],
        ["shard", full, str(tmp_path / "from_full.ckpt")],
    ):  # `ptdp checkpoint ...`, both ways
        with pytest.raises(SystemExit) as exit_info:
            main(["checkpoint", *command])
        assert exit_info.value.code == 0
    _assert_same(consolidated_state_dict(str(tmp_path / "from_plain.ckpt")), torch.load(plain))
    original, converted = dist_pool(4).run(
        validate, 4, {"tensor_parallel_size": 4}, [sharded, str(tmp_path / "from_plain.ckpt")], unused_param=True
    )[0]
    assert converted == pytest.approx(original, rel=VAL_RTOL)
    # a parameter that never had a gradient has no Adam state: it resumes fresh, as in an uninterrupted run
    t4 = {"tensor_parallel_size": 4}  # (DDP would refuse the unused parameter; that is DDP's rule, not ours)
    continued, val = dist_pool(4).run(
        fit, "gpt", 4, t4, epochs=2, resume=sharded, unused_param=True, then_validate=str(tmp_path / "from_plain.ckpt")
    )[0]
    assert math.isfinite(val)  # a weights-only checkpoint evaluated by the trainer that just fit
    from_full = dist_pool(4).run(
        fit, "gpt", 4, t4, epochs=2, resume=str(tmp_path / "from_full.ckpt"), unused_param=True
    )[0]
    assert len(continued) == STEPS and from_full == pytest.approx(continued, rel=LOSS_RTOL)


def refusals(root: str) -> dict[str, str]:
    """Try to resume from each damaged checkpoint under ``root``; return each error message."""
    import lightning as L

    from lightning_ptdp import PTDPStrategy
    from tests.fit_utils import quiet_trainer
    from tests.models import build_model

    errors = {}
    for name, family, overrides in [
        ("missing", "gpt", {}),
        ("truncated", "gpt", {}),
        ("unfinished", "gpt", {}),
        ("good", "gpt", {"hidden_size": 64}),
        ("good", "nanogpt", {}),
    ]:
        L.seed_everything(0, verbose=False)
        trainer = quiet_trainer(devices=2, strategy=PTDPStrategy(tensor_parallel_size=2), max_epochs=2)
        try:
            trainer.fit(
                build_model(family, vocab_size=62, **overrides), _data(62, 8), ckpt_path=os.path.join(root, name)
            )
        except ValueError as error:
            errors[f"{name}-{family}-{overrides}"] = str(error)
    return errors


@pytest.mark.world_size(2)
def test_damaged_or_foreign_sharded_checkpoints_are_refused_with_the_reason(dist_pool, tmp_path):
    good = tmp_path / "good"
    dist_pool(2).run(fit, "gpt", 2, {"tensor_parallel_size": 2}, saves={str(good): "sharded"})
    for name in ("missing", "truncated", "unfinished"):
        copy = tmp_path / name
        os.system(f"cp -rL '{good}' '{copy}'")
    (tmp_path / "missing" / "__1_0.distcp").unlink()
    cut = tmp_path / "truncated" / "__0_0.distcp"
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])
    (tmp_path / "unfinished" / ".metadata").unlink()  # what a crash before the end of the save leaves
    errors = dist_pool(2).run(refusals, str(tmp_path))[0]
    assert len(errors) == 5, errors
    assert "is incomplete: missing shard file(s) __1_0.distcp" in errors["missing-gpt-{}"]
    assert "is incomplete: truncated shard file(s) __0_0.distcp" in errors["truncated-gpt-{}"]
    assert "is not a complete sharded checkpoint: it has no .metadata file" in errors["unfinished-gpt-{}"]
    wider = errors["good-gpt-{'hidden_size': 64}"]
    assert wider.startswith("the checkpoint's weights do not fit this model: ")
    assert "shapes differ, checkpoint vs model (first: gpt.token_embedding.weight (62, 32) vs (62, 64)" in wider
    other = errors["good-nanogpt-{}"]
    assert (
        "entries are missing (first: net.wte.weight" in other and "entries are not in this model (first: gpt." in other
    )
    assert Path(good).is_symlink() and os.path.realpath(good).startswith(str(tmp_path / ".ptdp" / "good.v"))
