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
