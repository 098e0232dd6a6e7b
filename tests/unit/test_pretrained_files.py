"""``load_pretrained`` in one process: a torch.save-d state_dict and a safetensors file of the inner
model's own keys fill a LightningModule's parameters (prefix found from the keys), bit for bit."""

from __future__ import annotations

import pytest
import torch

from lightning_ptdp.parallel.pretrained import load_pretrained
from tests.models import build_model


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_a_plain_state_dict_file_fills_the_model(tmp_path, suffix):
    torch.manual_seed(7)
    source = build_model("llama")
    path = str(tmp_path / f"weights{suffix}")
    inner = {k: v.clone() for k, v in source.net.state_dict().items()}  # the files lack the module's "net."
    if suffix == ".pt":
        torch.save(inner, path)
    else:
        from safetensors.torch import save_file

        save_file(inner, path)
    torch.manual_seed(0)
    target = build_model("llama")
    assert not torch.equal(target.net.tok_embeddings.weight, inner["tok_embeddings.weight"])
    read = load_pretrained(target, path)
    assert read == sum(p.numel() for p in target.parameters())
    for key, value in inner.items():
        assert torch.equal(target.net.state_dict()[key], value), key


def test_a_file_missing_weights_names_them(tmp_path):
    path = str(tmp_path / "partial.pt")
    torch.save({"tok_embeddings.weight": torch.zeros(64, 32)}, path)
    with pytest.raises(ValueError, match=r"has no weights for \d+ parameter\(s\), e\.g\."):
        load_pretrained(build_model("llama"), path, prefix="net.")
