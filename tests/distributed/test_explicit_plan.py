"""Explicit tp_plan with globs on real transformers models, against the single-process run."""

from __future__ import annotations

import pytest

from tests.fit_utils import assert_matches_reference, fit_and_record

STEPS, GLOBAL_BATCH = 5, 8
# fp32; t=2 splits the sharded layers' sums in two: round-off only (test_tensor_parallel.py).
LOSS_RTOL, GRAD_REL, UPDATE_REL = 1e-5, 1e-5, 1e-4
# key biases get an exactly-zero gradient (softmax shift invariance): their updates are noise;
# GPT-2's fused c_attn bias holds the key bias as its middle third, left out alone (fit_utils.without_key_third)
NOISE_DRIVEN: tuple = ()

# GPT-2 (transformers' Conv1D layers, LM head tied to wte). Its attention splits c_attn's output
# with the global ``self.split_size``, so a sharded c_attn cannot run its forward: attention stays
# replicated here (discovery, which rewrites such shape arguments, is what splits it by heads).
GPT2_PLAN = {
    "net.transformer.wte": "vocab_embedding",
    "net.lm_head": "vocab_head",
    "net.transformer.h.*.mlp.c_fc": "colwise",
    "net.transformer.h.*.mlp.c_proj": "rowwise",
}
LLAMA_PLAN = {
    "net.model.embed_tokens": "vocab_embedding",
    "net.lm_head": "vocab_head",
    "net.model.layers.*.self_attn.[qkv]_proj": "colwise",
    "net.model.layers.*.self_attn.o_proj": "rowwise",
    "net.model.layers.*.mlp.gate_proj": "colwise",
    "net.model.layers.*.mlp.up_proj": "colwise",
    "net.model.layers.*.mlp.down_proj": "rowwise",
}


@pytest.mark.parametrize(
    ("family", "plan"),
    [("hfplan_gpt2", GPT2_PLAN), ("hfplan_llama_tied_labels", LLAMA_PLAN)],
    ids=["gpt2-conv1d", "llama-tied-hf-loss"],
)
@pytest.mark.world_size(2)
def test_glob_plan_on_transformers_models_matches_single_process(dist_pool, family, plan):
    pytest.importorskip("transformers")
    kwargs = {"tensor_parallel_size": 2}
    results = dist_pool(2).run(
        fit_and_record, family, strategy_kwargs=kwargs, devices=2, steps=STEPS, global_batch=GLOBAL_BATCH, tp_plan=plan
    )
    ref = fit_and_record(family, steps=STEPS, global_batch=GLOBAL_BATCH)
    for result in results:
        assert_matches_reference(
            result, ref, loss_rtol=LOSS_RTOL, grad_rel=GRAD_REL, update_rel=UPDATE_REL, skip=NOISE_DRIVEN
        )
        # the planned layers really are split: at least their half of the weights is gone
        sharded = sum(v.numel() for k, v in ref["state"].items() if any(s in k for s in ("mlp", "wte", "embed_tokens")))
        assert result["local_numel"] <= ref["local_numel"] - sharded // 2 + 64  # + vocab padding slack


def _suggested_plan_step(distributed: bool, discovered: bool = False) -> dict:
    """One forward/backward of a block list whose attention-like region discovery cannot split,
    under the explicit plan its error suggests (t=2), or under discovery, which keeps that region
    whole itself (``discovered``), or in one process."""
    import torch

    from tests.unit.test_tp_discovery import HeadSumThenMLPNet, suggested_plan

    torch.manual_seed(0)
    net = HeadSumThenMLPNet()
    inputs = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(1))
    if distributed:
        import torch.distributed as dist

        from lightning_ptdp.tensor_parallel import TPGroup, apply_explicit_plan, apply_tensor_parallel
        from lightning_ptdp.tensor_parallel.consolidate import full_gradients

        tp = TPGroup(dist.group.WORLD, dist.get_world_size(), dist.get_rank())
        if discovered:
            apply_tensor_parallel(net, tp, sequence_parallel=False, probe=lambda: net(inputs))
        else:
            apply_explicit_plan(net, suggested_plan(HeadSumThenMLPNet(), 2), tp)
    loss = net(inputs).square().mean()
    loss.backward()
    grads = full_gradients(net) if distributed else {n: p.grad for n, p in net.named_parameters()}
    rows = {name: getattr(net.layers[0], name).weight.shape[0] for name in ("q", "up")}
    return {"loss": loss.item(), "grads": grads, "rows": rows}


@pytest.mark.parametrize("discovered", [False, True], ids=["suggested-plan", "kept-whole-by-discovery"])
@pytest.mark.world_size(2)
def test_the_plan_a_discovery_error_suggests_runs_and_matches_one_process(dist_pool, discovered):
    from tests.fit_utils import relative_error

    ref = _suggested_plan_step(False)
    for result in dist_pool(2).run(_suggested_plan_step, True, discovered):
        assert result["loss"] == pytest.approx(ref["loss"], rel=LOSS_RTOL)
        # the MLP really is split (half of its 16 rows on each rank), the attention-like region is whole
        assert result["rows"] == {"q": 8, "up": 8}
        for name, expected in ref["grads"].items():
            assert relative_error(result["grads"][name], expected, expected) <= GRAD_REL, name
