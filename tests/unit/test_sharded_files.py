"""Sharded checkpoint folders on disk, with no process group: names are links swapped onto
version folders, data goes once no name points at it, and damaged copies say what happened."""

from __future__ import annotations

import os

import pytest
import torch

from lightning_ptdp.checkpoint.command import consolidated_state_dict, shard
from lightning_ptdp.checkpoint.dcp_load import open_checkpoint
from lightning_ptdp.checkpoint.dcp_save import VERSIONS, _version_dir, remove


def _weights(value: float) -> dict:
    return {"w": torch.full((3, 2), value), "b": torch.zeros(2)}


def test_a_name_is_swapped_onto_a_new_version_and_the_old_one_goes(tmp_path):
    name = tmp_path / "last.ckpt"
    shard(_weights(1.0), str(name))
    first = os.path.realpath(name)
    shard(_weights(2.0), str(name))
    assert os.path.realpath(name) != first and not os.path.exists(first)
    assert consolidated_state_dict(str(name))["w"][0, 0] == 2.0
    assert os.listdir(tmp_path / VERSIONS) == [os.path.basename(os.path.realpath(name))]


def test_removing_a_link_keeps_the_data_another_name_points_at(tmp_path):
    epoch = tmp_path / "epoch=0.ckpt"
    shard(_weights(1.0), str(epoch))
    os.symlink("epoch=0.ckpt", tmp_path / "last.ckpt")  # ModelCheckpoint(save_last="link") does this
    remove(str(tmp_path / "last.ckpt"))
    assert consolidated_state_dict(str(epoch))["w"][0, 0] == 1.0
    os.symlink("epoch=0.ckpt", tmp_path / "last.ckpt")
    remove(str(epoch))  # last.ckpt now dangles; its data went with the only real name
    assert os.listdir(tmp_path / VERSIONS) == []


def test_a_version_left_by_a_crash_is_collected_at_the_next_save(tmp_path):
    _version_dir(str(tmp_path / "epoch=3.ckpt"))  # a save that never published
    shard(_weights(1.0), str(tmp_path / "last.ckpt"))
    assert sorted(os.listdir(tmp_path / VERSIONS)) == ["last.ckpt.v1"]


def test_cleanup_leaves_what_ptdp_did_not_write(tmp_path):
    """Only marked version folders that no name references go: a folder or file of the user's in
    the versions folder, and a version another name still points at, stay."""
    (tmp_path / VERSIONS / "notes").mkdir(parents=True)
    (tmp_path / VERSIONS / "notes" / "keep.txt").write_text("mine")
    (tmp_path / VERSIONS / "epoch=3.ckpt.v1").mkdir()  # looks like a version, but ptdp never wrote it
    (tmp_path / VERSIONS / "data.bin").write_bytes(b"x")
    shard(_weights(1.0), str(tmp_path / "last.ckpt"))
    os.symlink("last.ckpt", tmp_path / "best.ckpt")
    shard(_weights(2.0), str(tmp_path / "other.ckpt"))
    remove(str(tmp_path / "other.ckpt"))
    assert sorted(os.listdir(tmp_path / VERSIONS)) == ["data.bin", "epoch=3.ckpt.v1", "last.ckpt.v1", "notes"]
    assert (tmp_path / VERSIONS / "notes" / "keep.txt").read_text() == "mine"
    assert consolidated_state_dict(str(tmp_path / "best.ckpt"))["w"][0, 0] == 1.0


def test_a_plain_folder_at_the_name_is_refused_and_left_untouched(tmp_path):
    target = tmp_path / "last.ckpt"
    target.mkdir()
    (target / "results.csv").write_text("user data")
    with pytest.raises(
        OSError,
        match=r"last\.ckpt' is a plain folder, not a ptdp sharded checkpoint .* ptdp does "
        r"not replace, move or delete it\. Move or delete it yourself, or save the "
        r"checkpoint under another name",
    ):
        shard(_weights(1.0), str(target))
    assert (target / "results.csv").read_text() == "user data" and not target.is_symlink()
    assert not (tmp_path / VERSIONS).exists() or os.listdir(tmp_path / VERSIONS) == []  # nothing written
    with pytest.warns(UserWarning, match=r"not removing .*last\.ckpt': a plain folder"):
        remove(str(target))
    assert (target / "results.csv").read_text() == "user data"


def test_a_copy_without_the_versions_folder_says_so(tmp_path):
    shard(_weights(1.0), str(tmp_path / "a" / "last.ckpt"))
    (tmp_path / "b").mkdir()
    os.symlink(os.readlink(tmp_path / "a" / "last.ckpt"), tmp_path / "b" / "last.ckpt")  # `cp -r` of the name only
    with pytest.raises(
        ValueError,
        match=r"which is not there: a sharded checkpoint's name points into the hidden "
        r"\.ptdp folder beside it\. Copy the checkpoint with `cp -rL`",
    ):
        open_checkpoint(str(tmp_path / "b" / "last.ckpt"))


def test_consolidate_keeps_one_submodule_under_its_own_keys_as_safetensors(tmp_path):
    """`ptdp checkpoint consolidate CKPT out.safetensors --strip-prefix net.model.`: the weights a
    wrapped model (a transformers model held as ``self.net.model``) loads with its own keys."""
    from safetensors.torch import load_file

    from lightning_ptdp.checkpoint.command import main

    state = {
        "net.model.layer.weight": torch.randn(4, 3),
        "net.model.norm.bias": torch.randn(3),
        "head.weight": torch.randn(2),
    }
    shard(state, str(tmp_path / "run.ckpt"))
    out = tmp_path / "model.safetensors"
    assert main(["consolidate", str(tmp_path / "run.ckpt"), str(out), "--strip-prefix", "net.model."]) == 0
    loaded = load_file(str(out))
    assert loaded.keys() == {"layer.weight", "norm.bias"}
    assert torch.equal(loaded["layer.weight"], state["net.model.layer.weight"])
    assert torch.equal(loaded["norm.bias"], state["net.model.norm.bias"])


@pytest.mark.parametrize("suffix", ["model.safetensors", "model.pt"])
def test_consolidate_creates_the_output_folder(tmp_path, suffix):
    """`ptdp checkpoint consolidate CKPT new/dir/model.safetensors`: the folder is made, as
    `save_pretrained` makes its own, instead of safetensors' bare "No such file or directory"."""
    from lightning_ptdp.checkpoint.command import main

    shard(_weights(3.0), str(tmp_path / "run.ckpt"))
    out = tmp_path / "new" / "dir" / suffix
    assert main(["consolidate", str(tmp_path / "run.ckpt"), str(out)]) == 0
    assert out.is_file()
