"""Tiny configs of every transformers causal LM, derived from each config class's defaults.

No per-family code: the defaults' size keys found in ``SHRINK`` take its values, per-layer lists are cut
to the tiny depth, dropouts and routing jitter go to zero and special-token ids are kept inside the tiny
vocabulary. ``exclusion`` gives the reason an architecture is out of scope (read from its config), or None.
Imports of transformers are inside the functions: collecting tests never pays for them.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from tests.fit_utils import SEQ, VOCAB

LAYERS = 2  # a block per stage at p=2
# generic size keys, set wherever a config's default holds a positive int there (an alias such as
# GPT-2's n_embd for hidden_size counts once); sizes stay divisible by 2 for t=2 and c=2
SHRINK = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": LAYERS,
    "num_layers": LAYERS,
    "num_attention_heads": 4,
    "num_heads": 4,
    "num_key_value_heads": 2,
    "num_kv_heads": 2,
    "multi_query_group_num": 2,
    "head_dim": 8,
    "d_head": 8,
    "rotary_dim": 4,  # partial rotary (GPT-J, CodeGen): half the head
    "kv_channels": 8,
    "max_position_embeddings": SEQ,
    "n_positions": SEQ,
    "n_ctx": SEQ,
    "max_seq_len": SEQ,
    "ffn_dim": 64,
    "n_inner": 64,
    "ffn_hidden_size": 64,
    "decoder_ffn_dim": 64,
    "d_inner": 64,
    "vocab_size_per_layer_input": VOCAB,
    "unpadded_vocab_size": VOCAB,
    # mixture of experts (and MOE_KEYS: 4 experts, 2 per token)
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "shared_intermediate_size": 64,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 0,  # every layer holds experts: a p=2 stage holds half of them
    "decoder_sparse_step": 1,
    "moe_layer_end_index": LAYERS - 1,
    # multi-head latent attention (DeepSeek-style): head_dim, the rope part, is the no-rope part's width
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 8,
    "index_n_heads": 4,
    "index_head_dim": 16,
    # linear attention and state-space layers
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "mamba_n_heads": 4,
    "mamba_head_dim": 8,
    "mamba_d_state": 16,
    "state_size": 16,
}
# an architecture's expert count and top-k, set even where its defaults leave them None (DeepSeek-V2's top-k)
MOE_KEYS = {
    "num_local_experts": 4,
    "num_experts": 4,
    "n_routed_experts": 4,
    "moe_num_experts": 4,
    "num_experts_per_tok": 2,
    "num_experts_per_token": 2,
    "moe_topk": 2,
    "moe_k": 2,
}
RANDOM_KEYS = ("dropout", "pdrop", "drop_rate", "layerdrop", "jitter")  # zeroed: training must be deterministic
TOKEN_ID = ("_token_id", "_token_index")
MULTIMODAL_PARTS = ("vision", "audio", "vq", "image", "speech")


def causal_lm_names() -> dict[str, str]:
    """model_type -> class name of every architecture transformers registers for AutoModelForCausalLM."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def exclusion(model_type: str) -> str | None:
    """Why the architecture is not a decoder-only text model (from its config class), or None."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    config_class = CONFIG_MAPPING[model_type]
    if getattr(config_class, "is_encoder_decoder", False) or _default_flag(config_class, "is_encoder_decoder"):
        return "encoder-decoder: its causal LM is the decoder half, which reads an encoder's states"
    if model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        return "bidirectional encoder family (a masked-LM encoder run with is_decoder=True)"
    parts = [name for name in getattr(config_class, "sub_configs", {}) if any(p in name for p in MULTIMODAL_PARTS)]
    if parts:
        text = f"{model_type}_text"
        also = f"; its text model is swept as {text}" if text in causal_lm_names() else ""
        return f"multimodal: {', '.join(sorted(parts))} sub-configs{also}"
    return None


def _default_flag(config_class: type, name: str) -> bool:
    try:
        return bool(getattr(config_class(), name, False))
    except Exception:  # noqa: BLE001 - a default that does not build is reported by tiny_config
        return False


def tiny_config(model_type: str) -> Any:
    """The config class's defaults with ``SHRINK``'s sizes, per-layer lists cut to ``LAYERS``, no
    dropout or jitter, and special-token ids inside the vocabulary."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    default = config_class()
    values = default.to_dict()
    depth = _first_int(default, ("num_hidden_layers", "num_layers", "n_layer"))
    alias = {real: name for name, real in getattr(config_class, "attribute_map", {}).items()}  # n_embd: hidden_size
    overrides: dict[str, Any] = {}
    for key, value in values.items():
        known = key in SHRINK or key in MOE_KEYS
        shrunk = _shrunk(key if known else alias.get(key, key), value, depth)
        overrides.update({key: v for v in shrunk.values()})
    if any(overrides.get(key) for key in MOE_KEYS):
        overrides.update({key: MOE_KEYS[key] for key in MOE_KEYS if key in values})
    heads = _first_int(default, ("num_attention_heads",))
    if heads is not None and _first_int(default, ("num_key_value_heads",)) == heads:  # MHA (and MLA) stay so
        overrides[_real("num_key_value_heads", config_class)] = SHRINK["num_attention_heads"]
    return config_class(**overrides)


def _real(name: str, config_class: type) -> str:
    return getattr(config_class, "attribute_map", {}).get(name, name)


def _shrunk(key: str, value: Any, depth: int | None) -> dict[str, Any]:
    if not isinstance(key, str) or isinstance(value, bool) or value is None:
        return {}
    if isinstance(value, dict):
        return _shrunk_dict(key, value, depth)
    if key in SHRINK and isinstance(value, int) and value > 0:
        return {key: SHRINK[key]}
    if key in MOE_KEYS and isinstance(value, int) and value > 0:
        return {key: MOE_KEYS[key]}
    if isinstance(value, float) and any(word in key for word in RANDOM_KEYS):
        return {key: 0.0}
    if key.endswith(TOKEN_ID):
        return {key: _in_vocabulary(value)}
    if isinstance(value, (list, str)) and depth and depth > LAYERS and len(value) == depth:
        return {key: value[:LAYERS]}  # one entry per layer ("layer_types", hybrid patterns)
    return {}


def _shrunk_dict(key: str, value: dict, depth: int | None) -> dict[str, Any]:
    """A per-layer table keyed by layer index (Gemma-4's per_layer_config) keeps the tiny depth's layers;
    a sub-config (DBRX's ffn_config) or parameter group is shrunk as the config is."""
    if value and all(isinstance(k, int) or str(k).isdigit() for k in value):
        kept = {k: v for k, v in value.items() if int(k) < LAYERS}
        return {key: kept} if len(kept) < len(value) else {}
    inner = {k: v for item in value.items() for k, v in _shrunk(*item, depth).items()}
    return {key: {**value, **inner}} if inner else {}


def _in_vocabulary(value: Any) -> Any:
    if isinstance(value, int):
        return min(value, VOCAB - 1)
    if isinstance(value, list):
        return [min(v, VOCAB - 1) if isinstance(v, int) else v for v in value]
    return value


def _first_int(config: Any, names: tuple[str, ...]) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def build_tiny(model_type: str) -> nn.Module:
    """The architecture at its tiny config, fp32, as ids -> logits (tests/real_models.py's wrapper)."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.real_models import HFCausalLM

    return HFCausalLM(AutoModelForCausalLM.from_config(tiny_config(model_type), dtype=torch.float32))
