"""The planner reads DeepSeek-V3's config.json as the model is: multi-head latent attention, three
dense layers before the MoE ones, a shared expert beside the 256 routed ones. Every expected figure
is written out by hand from the config's shapes."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from lightning_ptdp.planner import Cluster, ModelSize, estimate
from lightning_ptdp.planner.estimate import _layer_seconds, executed_flops
from lightning_ptdp.planner.latent import LatentAttention

# deepseek-ai/DeepSeek-V3's config.json, the keys the planner reads (and two it leaves: moe_layer_freq
# is 1, every layer after the dense ones is MoE; num_nextn_predict_layers is the MTP module, which
# the published 671B leaves out)
DEEPSEEK_V3 = {
    "model_type": "deepseek_v3",
    "hidden_act": "silu",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "moe_layer_freq": 1,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "vocab_size": 129280,
    "max_position_embeddings": 163840,
    "num_nextn_predict_layers": 1,
    "attention_bias": False,
    "tie_word_embeddings": False,
}
H, HEADS, LAYERS, DENSE = 7168, 128, 61, 3
# one layer's MLA matmuls: q down (h x 1536), q up (1536 x 128*192), kv down (h x (512 + 64)), kv up
# (512 x 128*(128 + 128)), output (128*128 x h)
MLA = H * 1536 + 1536 * HEADS * 192 + H * 576 + 512 * HEADS * 256 + HEADS * 128 * H
EXPERT = 3 * H * 2048  # a SwiGLU expert, 2048 wide; the shared expert is one more
MOE_LAYER = MLA + 257 * EXPERT + H * 256  # routed, shared, router
DENSE_LAYER = MLA + 3 * H * 18432
NORMS = 2 * H + 1536 + 512  # two RMSNorms, and one on each latent


def test_deepseek_v3_config_gives_the_published_671b():
    model = ModelSize.from_hf_config(DEEPSEEK_V3)
    embeddings = 2 * 129280 * H  # untied: the embedding and the head
    by_hand = (LAYERS - DENSE) * MOE_LAYER + DENSE * DENSE_LAYER + LAYERS * NORMS + embeddings
    assert model.parameters == by_hand
    # the report gives whole billions (671B total without MTP; 37B activated): the count to the billion
    assert round(model.parameters / 1e9) == 671
    assert int(model.active_parameters / 1e9) == 37  # 37.55B: the head and embedding are in it
    assert model.expert_parameters == (LAYERS - DENSE) * 256 * EXPERT
    # read as full attention over every layer's experts, without the shared one, it was 702B
    plain = replace(model, latent_attention=None, dense_layers=0, dense_layer_ffn_size=None, shared_ffn_size=0)
    assert round(plain.parameters / 1e9) == 702


def test_latent_attention_sets_the_attention_flops_and_the_layer_shapes():
    model = ModelSize.from_hf_config(DEEPSEEK_V3)
    assert (model.qk_head_dim, model.v_head_dim) == (192, 128)
    # QK^T over 192-wide heads and scores x V over 128-wide values, per query-key pair, all heads
    assert model.attention_flops_per_key == 2 * HEADS * (192 + 128)
    assert model.whole_activation_sbh == 4 * (1536 + 512) / H  # each latent: its norm's input, the up-projection's
    s = model.seq_length
    active = (LAYERS - DENSE) * (MLA + 9 * EXPERT + H * 256) + DENSE * DENSE_LAYER  # 8 routed + shared
    forward = 2 * s * active + LAYERS * s * s * 2 * HEADS * 320
    assert executed_flops(model, 1, None)[0] == 3 * forward
    # on t ranks the down-projections stay whole, the up-projections and the output split by heads
    assert model.attention_linears(4) == [
        (1536, H),
        (HEADS * 192 / 4, 1536),
        (576, H),
        (HEADS * 256 / 4, 512),
        (H, HEADS * 128 / 4),
    ]


def test_the_estimate_takes_the_dense_layers_as_their_share_of_the_mean_layer():
    model = ModelSize.from_hf_config(DEEPSEEK_V3)
    cluster = Cluster.h100(2048)
    moe = _layer_seconds(model, 8, 1, "full", True, cluster, 64, 1)
    dense = _layer_seconds(model.dense_layer, 8, 1, "full", True, cluster, 1, 1)  # no experts: e = 1
    assert dense[2] == 0.0 < moe[2]  # no all-to-all in a dense layer
    kwargs = dict(tensor_parallel_size=8, pipeline_parallel_size=1, expert_parallel_size=64, zero_stage=3)
    x = estimate(model, cluster, 2048, sequence_parallel=True, **kwargs)
    mean = [(58 * a + 3 * b) / 61 for a, b in zip(moe, dense)]
    assert x.expert_parallel_comm_s == pytest.approx(x.num_microbatches * LAYERS * mean[2], rel=1e-9)


def test_ptdp_plan_reads_a_deepseek_config(tmp_path, capsys):
    from lightning_ptdp.planner import main

    path = tmp_path / "config.json"
    path.write_text(json.dumps(DEEPSEEK_V3))
    assert main([str(path), "--gpus", "256", "--global-batch-size", "1024", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "128 heads (latent kv 512)" in out and "first 3 dense" in out and "671.03B parameters" in out
    # 61 layers: a pipeline takes p = 1 or 61; 16 bytes per parameter need ZeRO over the d ranks
    args = ["--layout", "t=8,p=1,e=64", "--zero-stage", "3", "--sequence-parallel"]
    assert main([str(path), "--gpus", "2048", "--global-batch-size", "2048", *args]) == 0
    assert "EP all-to-alls" in capsys.readouterr().out


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(kv_lora_rank=0, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128), "kv_lora_rank"),
        (
            dict(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, q_lora_rank=-1),
            "q_lora_rank",
        ),
    ],
)
def test_latent_attention_refuses_a_bad_shape(kwargs, match):
    with pytest.raises(ValueError, match=f"LatentAttention.{match} must be a positive integer"):
        LatentAttention(**kwargs)


def test_dense_layers_need_a_mixture_of_experts():
    with pytest.raises(ValueError, match=r"dense_layers=2 needs a mixture of experts"):
        ModelSize(num_layers=4, hidden_size=64, num_heads=4, dense_layers=2)
