"""The share checks of tests/shares.py pass what a layout gives a rank and fail what it does not: a MoE
model's dense weights left whole under TP (which "held <= full" let through), or its router split."""

from __future__ import annotations

import pytest

from tests.shares import check_moe_share, check_share, expected_moe_shares, expected_shares

LAYER = "model.layers.{}."
# a Mixtral-like model at the zoo's shape: (numel, dim) by name; 2 layers, 4 experts
DENSE = {"self_attn.q_proj.weight": 1024, "self_attn.o_proj.weight": 1024, "self_attn.k_proj.weight": 512}
ROUTER, NORM, EXPERTS = {"mlp.gate.weight": 128}, {"input_layernorm.weight": 32}, {"mlp.experts.gate_up_proj": 16384}
T2 = {"tensor_parallel_size": 2}


def _model(dense_share: float = 1.0, router_share: float = 1.0, expert_share: float = 1.0) -> dict:
    """The model's (numel, dim) by name, each kind of parameter scaled to the share a rank holds."""
    held = {"model.embed_tokens.weight": (int(2048 * dense_share), 2), "model.norm.weight": (32, 1)}
    for layer in range(2):
        for part, share, dim in ((DENSE, dense_share, 2), (ROUTER, router_share, 2), (NORM, 1, 1)):
            held |= {LAYER.format(layer) + name: (int(n * share), dim) for name, n in part.items()}
        held |= {LAYER.format(layer) + name: (int(n * expert_share), 3) for name, n in EXPERTS.items()}
    return held


def test_tp_split_dense_weights_with_whole_routers_and_norms_pass():
    check_moe_share({"held": _model(dense_share=0.5)}, expected_moe_shares(_model(), T2, 2))


def test_dense_weights_left_whole_under_tp_fail():
    full = _model()
    assert all(n <= full[name][0] for name, (n, _) in full.items())  # the check this replaced passed it
    with pytest.raises(AssertionError, match="dense blocks parameters"):
        check_moe_share({"held": full}, expected_moe_shares(full, T2, 2))


def test_key_value_heads_copied_over_ranks_widen_the_bound_by_what_the_layout_copies():
    """Fewer key/value heads than t: each rank holds one whole, as the layout reports (fit_utils
    ``replicated_heads``); the bound grows by exactly that, not more."""
    held = _model(dense_share=0.5)
    held[LAYER.format(0) + "self_attn.k_proj.weight"] = (512, 2)  # whole: one KV head on both ranks
    expected = expected_moe_shares(_model(), T2, 2)
    check_moe_share({"held": held, "replicated": 256}, expected)
    with pytest.raises(AssertionError, match=r"\(\+255 of key/value heads copied over ranks\)"):
        check_moe_share({"held": held, "replicated": 255}, expected)


def test_a_router_split_under_tp_fails():
    held = _model(dense_share=0.5, router_share=0.5)  # ranks would route the same token differently
    with pytest.raises(AssertionError, match="dense blocks parameters"):
        check_moe_share({"held": held}, expected_moe_shares(_model(), T2, 2))


def test_experts_held_whole_under_ep_fail():
    expected = expected_moe_shares(_model(), {"expert_parallel_size": 2}, 2)
    check_moe_share({"held": _model(expert_share=0.5)}, expected)
    with pytest.raises(AssertionError, match="expert parameters"):
        check_moe_share({"held": _model()}, expected)


def test_zero1_state_not_spread_over_the_data_parallel_ranks_fails():
    # d2 and ZeRO-1 hold every parameter (the cap of 1.0 this replaced held nothing back); the state is 1/d
    full = {f"layers.{i}.w": (100, 2) for i in range(4)} | {"embed.weight": (40, 2)}
    expected, ref = expected_shares(full, {"zero_stage": 1}, 2), {"optimizer_numel": 2 * 440}
    rank = {"held": full, "local_numel": 440}
    check_share({**rank, "optimizer_numel": 440}, expected, ref)
    with pytest.raises(AssertionError, match="ZeRO-1 rank holds"):
        check_share({**rank, "optimizer_numel": 2 * 440}, expected, ref)
    with pytest.raises(AssertionError, match="a balanced split holds"):  # d2: every rank holds the whole model
        check_share({**rank, "held": {"layers.0.w": (100, 2)}, "optimizer_numel": 200}, expected, ref)


def test_a_vector_every_expert_shares_and_a_router_under_experts_are_dense():
    """JetMoE keeps experts.bias (one per output, all experts) and experts.router.layer beside its
    stacked experts: expert parallelism splits only the stacked ones, and the check says so."""
    from tests.shares import is_expert

    assert is_expert("layers.0.attn.experts.input_linear.weight", 3)
    assert is_expert("layers.0.moe.experts.0.w1.weight", 2)  # one expert of a ModuleList
    assert not is_expert("layers.0.attn.experts.bias", 1)
    assert not is_expert("layers.0.attn.experts.router.layer.weight", 2)
    assert not is_expert("layers.0.mlp.gate.weight", 2)


def test_each_parameter_is_classed_by_its_shape_in_the_whole_model():
    """A [1, E] routing bias is a vector; a depthwise conv's [C, 1, k] weight a matrix; a router may sit
    one module down ("mlp.gate.wg"), but a gating column ("output_gate") is no router. A rank's share
    of an expert stack is counted by the whole model's class: an expert-parallel rank holding one
    expert of the stack still holds experts."""
    from tests.shares import ROUTER, held_dims

    assert held_dims((1, 4)) == 1 and held_dims((64, 1, 4)) == 2
    assert ROUTER.search("layers.0.mlp.gate.wg.weight") and not ROUTER.search("layers.0.attn.output_gate.weight")
    stack = "layers.0.mlp.experts.gate_up_proj"
    full = {stack: (4 * 64, 3), "layers.0.attn.q.weight": (64, 2)}
    expected = expected_moe_shares(full, {"expert_parallel_size": 4}, 4)
    check_moe_share({"held": {stack: (64, 2), "layers.0.attn.q.weight": (64, 2)}}, expected)
    with pytest.raises(AssertionError, match="expert parameters"):
        check_moe_share({"held": {stack: (128, 3), "layers.0.attn.q.weight": (64, 2)}}, expected)
