"""Tiny configs of real third-party model families, each as a plain ids -> logits network.

The library must train these as users bring them: Hugging Face transformers (Llama, Mistral,
GPT-2, GPT-NeoX), litgpt (Llama-style grouped-query and Pythia-style configs) and torchtitan's
llama3. Shapes match the zoo (vocab 64, hidden 32, 4 heads; 4 layers, so p=2 v=2 has a block per chunk) so every test's data fits.
Imports are inside the builders: collecting tests never pays for transformers' import.
"""

from __future__ import annotations

import functools
import types

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, HIDDEN, HEADS, KV_HEADS, LAYERS, FFN, SEQ = 64, 32, 4, 2, 4, 64, 32


class HFCausalLM(nn.Module):
    """A transformers model as ids -> logits (no cache, as in training)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, use_cache=False).logits


def _hf(config_cls: str, model_cls: str, attention: str = "sdpa", **kwargs) -> nn.Module:
    import transformers

    config = getattr(transformers, config_cls)(**kwargs)
    config._attn_implementation = attention
    return HFCausalLM(getattr(transformers, model_cls)(config))


def hf_llama(tied: bool = False, attention: str = "sdpa") -> nn.Module:
    return _hf(
        "LlamaConfig",
        "LlamaForCausalLM",
        attention,
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=SEQ,
        tie_word_embeddings=tied,
    )


def hf_mistral() -> nn.Module:
    return _hf(
        "MistralConfig",
        "MistralForCausalLM",
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=SEQ,
        sliding_window=None,
    )


def hf_gpt2(attention: str = "sdpa") -> nn.Module:
    return _hf(
        "GPT2Config",
        "GPT2LMHeadModel",
        attention,
        vocab_size=VOCAB,
        n_embd=HIDDEN,
        n_layer=LAYERS,
        n_head=HEADS,
        n_positions=SEQ,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )


def hf_neox() -> nn.Module:
    return _hf(
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        max_position_embeddings=SEQ,
        rotary_pct=0.5,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )


def _litgpt(**kwargs) -> nn.Module:
    from litgpt import GPT, Config

    shape = dict(block_size=SEQ, vocab_size=VOCAB, padded_vocab_size=VOCAB, n_layer=LAYERS, n_head=HEADS, n_embd=HIDDEN)
    return GPT(Config(**{**shape, **kwargs}))


def litgpt_llama() -> nn.Module:
    return _litgpt(
        n_query_groups=KV_HEADS,
        intermediate_size=FFN,
        mlp_class_name="LLaMAMLP",
        norm_class_name="RMSNorm",
        bias=False,
        rotary_percentage=1.0,
        parallel_residual=False,
    )


def litgpt_moe(layers: int = 2) -> nn.Module:
    """litgpt's LLaMAMoE: a router Linear and a ModuleList of LLaMAMLP experts (4, top-2)."""
    return _litgpt(
        n_query_groups=KV_HEADS,
        intermediate_size=FFN,
        mlp_class_name="LLaMAMoE",
        n_expert=4,
        n_expert_per_token=2,
        moe_intermediate_size=FFN,
        norm_class_name="RMSNorm",
        bias=False,
        rotary_percentage=1.0,
        parallel_residual=False,
        n_layer=layers,
    )


def litgpt_pythia() -> nn.Module:
    return _litgpt(
        n_query_groups=HEADS,
        intermediate_size=4 * HIDDEN,
        mlp_class_name="GptNeoxMLP",
        norm_class_name="LayerNorm",
        bias=True,
        rotary_percentage=0.25,
        parallel_residual=True,
    )


class CausalSDPA(nn.Module):
    """torchtitan's inner-attention interface on plain causal SDPA: its language models accept
    only flex/varlen attention, whose compiled kernels and block masks would cost a CPU test
    minutes; everything around the inner attention (fused per-KV-group wqkv, complex RoPE,
    ModuleDict layers) stays torchtitan's own."""

    def forward(self, q, k, v, *, attention_masks=None, scale=None, enable_gqa=False, **kwargs):  # (B, L, N, H)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=scale, enable_gqa=enable_gqa
        )
        return out.transpose(1, 2)


def titan_llama3() -> nn.Module:
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.llama3 import Llama3Model, _build_llama3_layers

    layers = _build_llama3_layers(
        n_layers=LAYERS,
        dim=HIDDEN,
        n_heads=HEADS,
        n_kv_heads=KV_HEADS,
        hidden_dim=FFN,
        fuse_qkv=True,
        rope=ComplexRoPE.Config(dim=HIDDEN // HEADS, max_seq_len=SEQ, theta=10000.0),
        attn_backend="flex",
    )
    config = Llama3Model.Config(
        dim=HIDDEN,
        vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=HIDDEN),
        norm=RMSNorm.Config(normalized_shape=HIDDEN),
        lm_head=Linear.Config(in_features=HIDDEN, out_features=VOCAB),
        layers=layers,
    )
    model = config.build()
    model.init_states()  # torchtitan allocates first, then initialises
    for layer in model.layers.values():
        layer.attention.inner_attention = CausalSDPA()  # its state_dict hooks (wqkv <-> wq/wk/wv) kept
    return model


def _grouped_experts_in_model_dtype(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
    """torchtitan's GroupedExperts forward, the same three GEMMs per expert, in the model's dtype: its
    own casts rows and weights to bf16 inside (whose one rounding of each gradient moves with the
    order EP delivers rows in), which an fp32 comparison at 1e-5 cannot take. Its own forward is checked
    in bf16 within the noise floor (test_bf16.py at d2-e2, test_expert_parallel.py at more layouts)."""
    ends = torch.cumsum(num_tokens_per_expert_E, dim=0).tolist()
    out, start = [], 0
    for expert, end in enumerate(ends):
        rows = x_RD[start:end]
        hidden = F.silu(rows @ self.w1_EFD[expert].T) * (rows @ self.w3_EFD[expert].T)
        out.append(hidden @ self.w2_EDF[expert].T)
        start = end
    return torch.cat(out)


def titan_qwen3_moe(model_dtype_experts: bool = True) -> nn.Module:
    """torchtitan's Qwen3-MoE at the zoo's shape: 4 experts, top-2, in its RoutedExperts (token
    dispatcher + GroupedExperts, whose grouped GEMMs run in bf16 whatever the model's dtype;
    ``model_dtype_experts``: their forward in the model's dtype instead)."""
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.qwen3 import Qwen3Model, _build_qwen3_moe_layers, _qwen3_norm

    head_dim = HIDDEN // HEADS
    layers = _build_qwen3_moe_layers(
        n_layers=2,
        dim=HIDDEN,
        n_heads=HEADS,
        n_kv_heads=KV_HEADS,
        head_dim=head_dim,
        moe_hidden_dim=FFN,
        num_experts=4,
        top_k=2,
        attn_backend="flex",
        moe_comm_backend="standard",
        rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=SEQ, theta=10000.0),
    )
    config = Qwen3Model.Config(
        vocab_size=VOCAB,
        dim=HIDDEN,
        norm=_qwen3_norm(HIDDEN),
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=HIDDEN),
        lm_head=Linear.Config(in_features=HIDDEN, out_features=VOCAB),
        layers=layers,
    )
    model = config.build()
    model.init_states()
    for layer in model.layers.values():
        layer.attention.inner_attention = CausalSDPA()
        if model_dtype_experts:
            experts = layer.moe.routed_experts.inner_experts
            experts.forward = types.MethodType(_grouped_experts_in_model_dtype, experts)
    return model


def hf_from(path: str) -> nn.Module:
    """A transformers model loaded from ``save_pretrained`` files (weights known before fit)."""
    from transformers import AutoModelForCausalLM

    return HFCausalLM(AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa"))


def hf_config_of(path: str) -> nn.Module:
    """The same architecture from the folder's config alone (its weights come from the strategy)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    config._attn_implementation = "sdpa"
    return HFCausalLM(AutoModelForCausalLM.from_config(config))


# More transformers families, each with an idiom of its own: fused q | k | v cut by slicing and a
# fused gate_up (Phi-3), per-KV-group fused q/k/v broadcast to the query heads (Falcon), q/k/v
# biases (Qwen2), per-head q/k norms (Qwen3), scaled embeddings (Gemma), learned positions and
# ReLU MLP (OPT), partial rotary (StableLM), unparameterised norms (OLMo), q/k RMSNorms over all
# heads (OLMo-2), eager attention (Gemma-2, GPT-J).
MORE_HF = {
    "hf_phi3": ("Phi3Config", "Phi3ForCausalLM", dict(num_key_value_heads=KV_HEADS, pad_token_id=0)),
    "hf_falcon": ("FalconConfig", "FalconForCausalLM", dict(new_decoder_architecture=True, num_kv_heads=KV_HEADS)),
    "hf_qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_key_value_heads=KV_HEADS)),
    "hf_qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(num_key_value_heads=KV_HEADS, head_dim=HIDDEN // HEADS)),
    "hf_gemma": ("GemmaConfig", "GemmaForCausalLM", dict(num_key_value_heads=KV_HEADS, head_dim=HIDDEN // HEADS)),
    "hf_opt": ("OPTConfig", "OPTForCausalLM", dict(ffn_dim=FFN, word_embed_proj_dim=HIDDEN, dropout=0.0)),
    "hf_stablelm": ("StableLmConfig", "StableLmForCausalLM", dict(num_key_value_heads=KV_HEADS)),
    "hf_olmo": ("OlmoConfig", "OlmoForCausalLM", dict(num_key_value_heads=KV_HEADS)),
    "hf_olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(num_key_value_heads=KV_HEADS)),
    # eager attention written out (matmul, softmax, matmul), softcapping, alternating sliding windows
    "hf_gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(num_key_value_heads=KV_HEADS, head_dim=HIDDEN // HEADS, attention="eager"),
    ),
    # eager attention returning its weights from the block, parallel attention and MLP
    "hf_gptj": (
        "GPTJConfig",
        "GPTJForCausalLM",
        dict(n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, rotary_dim=4, n_positions=SEQ, attention="eager"),
    ),
}


def _zoo_hf(config_cls: str, model_cls: str, layers: int = LAYERS, **extra) -> nn.Module:
    """A transformers family at the zoo's shape (vocab, hidden, heads, MLP width, context)."""
    return _hf(
        config_cls,
        model_cls,
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=layers,
        num_attention_heads=HEADS,
        max_position_embeddings=SEQ,
        **extra,
    )


def more_hf(family: str) -> nn.Module:
    config_cls, model_cls, extra = MORE_HF[family]
    return _zoo_hf(config_cls, model_cls, **extra)


# Mixture-of-experts families, each with its experts stacked as [n_experts, ...] tensors whose forward
# takes top-k routing per token: 4 experts, 2 per token, no token dropping. Qwen2-MoE adds a dense
# shared expert behind a sigmoid gate; Qwen3-MoE per-head q/k norms; OLMoE q/k norms over all heads.
MOE_HF = {
    "hf_mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, router_jitter_noise=0.0)),
    "hf_qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(num_experts=4, moe_intermediate_size=FFN, shared_expert_intermediate_size=FFN, decoder_sparse_step=1),
    ),
    "hf_qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(num_experts=4, moe_intermediate_size=FFN, head_dim=HIDDEN // HEADS, decoder_sparse_step=1),
    ),
    # transformers' default experts implementation is grouped_mm; OLMoE runs the eager loop instead
    "hf_olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=4, experts_implementation="eager")),
}


def moe_hf(family: str, layers: int = 2) -> nn.Module:
    config_cls, model_cls, extra = MOE_HF[family]
    return _zoo_hf(config_cls, model_cls, layers, num_key_value_heads=KV_HEADS, num_experts_per_tok=2, **extra)


FAMILY_NAMES = {
    "hf_llama": "transformers LlamaForCausalLM",
    "hf_llama_tied": "transformers Llama, tied embeddings",
    "hf_mistral": "transformers MistralForCausalLM",
    "hf_gpt2": "transformers GPT2LMHeadModel (Conv1D)",
    "hf_neox": "transformers GPTNeoXForCausalLM",
    "litgpt_llama": "litgpt GPT, Llama-style GQA",
    "litgpt_pythia": "litgpt GPT, Pythia-style",
    "titan_llama3": "torchtitan llama3 (fused per-group wqkv)",
    "gpt": "this repository's recipe GPT",
    "nanogpt": "a nanoGPT-style model (fused c_attn, tied head)",
    "llama": "a Llama-style model (GQA, RMSNorm, SwiGLU)",
    "hf_mixtral": "transformers MixtralForCausalLM (4 experts, top-2)",
    "hf_qwen2_moe": "transformers Qwen2MoeForCausalLM (shared expert)",
    "hf_qwen3_moe": "transformers Qwen3MoeForCausalLM",
    "hf_olmoe": "transformers OlmoeForCausalLM",
    "litgpt_moe": "litgpt GPT, LLaMAMoE (ModuleList of experts)",
    "moe_llama": "a plain PyTorch MoE (ModuleList, empty experts skipped)",
    "titan_qwen3_moe": "torchtitan Qwen3-MoE (RoutedExperts; GroupedExperts' GEMMs in fp32, a test-written forward)",
    "titan_qwen3_moe_bf16": "torchtitan Qwen3-MoE, its own GroupedExperts forward (bf16 GEMMs), bf16-mixed",
    "hf_llama_eager": "transformers Llama, eager attention",
    "hf_gpt2_eager": "transformers GPT-2, eager attention",
    "hf_llama_padded": "transformers Llama, padded batches (attention_mask, labels -100, its own loss)",
    "hf_llama_shifted": "transformers Llama, the shift written in training_step",
    "nanogpt_eager": "a nanoGPT-style model, attention written out (causal `bias` buffer)",
    "nanogpt_baddbmm": "a nanoGPT-style model, scores as `baddbmm(bias, q, k^T)` over heads folded into the batch",
    "nanogpt_documents": "a nanoGPT-style model over packed documents (a block-diagonal mask passed to its blocks)",
    "flat_llama": "a Llama-style LightningModule holding its blocks itself",
    **{family: f"transformers {model_cls}" for family, (_, model_cls, _) in MORE_HF.items()},
}
# every mixture-of-experts family, for the expert-parallel matrix
MOE_FAMILIES = (*MOE_HF, "litgpt_moe", "moe_llama", "titan_qwen3_moe")

REAL_FAMILIES = {
    "hf_llama": hf_llama,
    "hf_llama_tied": lambda: hf_llama(tied=True),
    "hf_llama_eager": lambda: hf_llama(attention="eager"),
    "hf_gpt2_eager": lambda: hf_gpt2(attention="eager"),
    "hf_mistral": hf_mistral,
    "hf_gpt2": hf_gpt2,
    "hf_neox": hf_neox,
    "litgpt_llama": litgpt_llama,
    "litgpt_pythia": litgpt_pythia,
    "titan_llama3": titan_llama3,
    "hf_from": hf_from,
    **{family: functools.partial(more_hf, family) for family in MORE_HF},
    **{family: functools.partial(moe_hf, family) for family in MOE_HF},
    "litgpt_moe": litgpt_moe,
    "titan_qwen3_moe": titan_qwen3_moe,
    "titan_qwen3_moe_bf16": functools.partial(titan_qwen3_moe, model_dtype_experts=False),
}
