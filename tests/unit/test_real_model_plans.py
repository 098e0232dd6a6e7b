"""Plans discovered on real third-party models (no process group): the styles and layouts each
family needs, the model's own plan as a cross-check, and the errors for layouts that cannot work."""

from __future__ import annotations

import logging

import pytest
import torch

from lightning_ptdp.tensor_parallel import tensor_parallel_plan
from tests.real_models import REAL_FAMILIES


def _plan(family: str, t: int = 2):
    torch.manual_seed(0)
    net = REAL_FAMILIES[family]()
    ids = torch.randint(0, 64, (2, 32))
    return tensor_parallel_plan(net, t, probe=lambda: net(ids))


def _entries(report) -> dict[str, tuple[str, str]]:
    return {path.split("*.", 1)[1]: (style, detail) for path, style, detail in report.entries}


@pytest.mark.parametrize(
    ("family", "module", "style", "share"),
    [
        ("hf_llama", "self_attn.k_proj", "colwise", "1/2 heads"),  # GQA: 2 KV heads over t=2
        ("hf_gpt2", "attn.c_attn", "colwise_fused:3", "2/4 heads"),  # Conv1D, equal q | k | v
        ("hf_neox", "attention.query_key_value", "colwise", "2/4 heads"),  # per-head interleaved q, k, v
        ("litgpt_llama", "attn.qkv", "colwise_fused:4|2|2", "2/4 heads"),  # unequal q | k | v parts
        ("litgpt_pythia", "attn.qkv", "colwise_fused:3", "2/4 heads"),
        ("titan_llama3", "attention.qkv_linear.wqkv", "colwise", "1/2 heads"),  # whole KV groups
    ],
)
def test_fused_and_grouped_projections_get_whole_heads(family, module, style, share):
    found_style, detail = _entries(_plan(family))[module]
    assert (found_style, detail.split(" per rank")[0]) == (style, share)


def test_the_models_own_plan_agrees_and_a_disagreement_is_logged(caplog):
    entries = _entries(_plan("hf_llama"))
    assert all(
        detail.endswith("model's tp plan agrees (colwise)") or detail.endswith("agrees (rowwise)")
        for _, detail in entries.values()
    )
    torch.manual_seed(0)
    net = REAL_FAMILIES["hf_llama"]()
    net.model.config.base_model_tp_plan = {**net.model.config.base_model_tp_plan, "layers.*.mlp.up_proj": "rowwise"}
    ids = torch.randint(0, 64, (2, 32))
    with caplog.at_level(logging.WARNING):
        report = tensor_parallel_plan(net, 2, probe=lambda: net(ids))
    assert _entries(report)["mlp.up_proj"] == ("colwise", "32/64 units per rank; model's tp plan says rowwise")
    assert "mlp.up_proj: discovered colwise, the model's plan says rowwise" in caplog.text


def test_unequal_fused_parts_that_t_cannot_split_are_refused():
    with pytest.raises(
        ValueError,
        match=r"tensor_parallel_size=3 does not divide every part of the fused "
        r"'transformer.h.0.attn.qkv' \(4 \| 2 \| 2 units of 8\).*choose tensor_parallel_size from 1, 2 or 4",
    ):
        _plan("litgpt_llama", 3)


def test_a_fused_part_of_fewer_heads_than_t_is_copied_to_the_ranks_sharing_it():
    """q | k | v of 4 | 2 | 2 heads at t=4: one query head a rank; each key/value head on two ranks."""
    style, detail = _entries(_plan("litgpt_llama", 4))["attn.qkv"]
    assert (style, detail.split(" per rank")[0]) == ("colwise_fused:4|2|2", "1/4 heads, replicated x2")


def test_a_module_both_plans_keep_whole_agrees(caplog):
    """transformers names a module every rank holds whole "replicate"; discovery says "replicated"."""
    from types import SimpleNamespace

    from lightning_ptdp.tensor_parallel.model_plan import cross_check

    net = torch.nn.Module()
    net.config = SimpleNamespace(base_model_tp_plan={"embed": "replicate"})
    with caplog.at_level(logging.WARNING):
        (entry,) = cross_check(net, [("embed", "replicated", "whole")])
    assert entry == ("embed", "replicated", "whole; model's tp plan agrees (replicate)")
    assert "differs" not in caplog.text
