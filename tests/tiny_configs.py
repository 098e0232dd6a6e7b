"""Tiny configs of every transformers causal LM, derived from each config class's defaults.

No per-family code: the defaults' size keys found in ``SHRINK`` take its values, per-layer lists are cut
to the tiny depth, dropouts and routing jitter go to zero, special-token ids are kept inside the tiny
vocabulary and what the defaults leave None is filled by the classes' documented conventions; where a class
rejects that, the shrink keeps the relations it checks. ``exclusion`` gives the reason an architecture is out
of scope (read from its config), or None. Imports of transformers are inside the functions.
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
    "shared_experts_intermediate_size": 64,
    "moe_shared_expert_intermediate_size": 64,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "router_hidden_size": 32,  # a router with its own MLP (ZAYA)
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
    "linear_num_heads": 4,  # Kimi-Linear's delta-rule heads (its defaults: 32 of 128)
    "linear_head_dim": 8,
    "mamba_n_heads": 4,
    "mamba_num_heads": 4,
    "mamba_head_dim": 8,
    "mamba_d_state": 16,
    "state_size": 16,
    "ssm_state_size": 16,
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
LAYER_KEYS = ("num_hidden_layers", "num_layers", "n_layer")
GROUP_COUNT = "n_groups"
LAYER_COUNT = "_layers"  # a count of layers of some kind (num_kv_shared_layers, num_dense_layers)
# MoE keys set in a MoE config even where the defaults leave them None (DOTS-1's shared experts)
MOE_SIZES = ("moe_intermediate_size", "n_shared_experts")
TOP_K_KEYS = ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k")
# (head count, head width) pairs whose product a class may check against the model width
HEAD_PAIRS = (
    ("num_attention_heads", "head_dim"),
    ("num_heads", "head_dim"),
    ("mamba_n_heads", "mamba_head_dim"),
    ("mamba_num_heads", "mamba_head_dim"),
)
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
    backbone = sorted(name for name in getattr(config_class, "__annotations__", {}) if name.startswith("backbone_"))
    if backbone:
        return f"drafter: its inputs are a backbone model's hidden states and key/value cache ({', '.join(backbone)})"
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
    dropout or jitter, special-token ids inside the vocabulary, and what the defaults leave unset filled."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    default = config_class()
    try:
        config = config_class(**_overrides(config_class, default, keep_structure=False))
    except (StrictDataclassError, ValueError):  # the class checks a relation the plain shrink broke
        config = config_class(**_overrides(config_class, default, keep_structure=True))
    _fill_unset(config)
    return config


def _overrides(config_class: type, default: Any, keep_structure: bool) -> dict[str, Any]:
    """The tiny values. ``keep_structure`` (when the class rejected the plain shrink) also keeps the relations
    its validation checks: one layer of each kind in per-layer lists, top-1 routing, head width vs. model width."""
    values = default.to_dict()
    depth = _first_int(default, values, LAYER_KEYS)
    layers = _kept_layers(values, depth, keep_structure)
    alias = {real: name for name, real in getattr(config_class, "attribute_map", {}).items()}  # n_embd: hidden_size
    overrides: dict[str, Any] = {}
    for key, value in values.items():
        known = key in SHRINK or key in MOE_KEYS
        shrunk = _shrunk(key if known else alias.get(key, key), value, depth, layers)
        overrides.update({key: v for v in shrunk.values()})
    if any(overrides.get(key) for key in MOE_KEYS) or overrides.get("moe_intermediate_size"):
        overrides.update({key: MOE_KEYS[key] for key in MOE_KEYS if key in values})
        overrides.update({key: SHRINK[key] for key in MOE_SIZES if key in values and values[key] is None})
    heads = _first_int(default, values, ("num_attention_heads",))
    if heads is not None and _first_int(default, values, ("num_key_value_heads",)) == heads:
        overrides[_real("num_key_value_heads", config_class)] = SHRINK["num_attention_heads"]  # MHA (and MLA)
    if keep_structure:
        overrides.update({key: 1 for key in TOP_K_KEYS if values.get(key) == 1})  # a top-1 router stays so
        overrides.update(_head_widths(values, overrides))
    _sibling_sizes(overrides)
    return overrides


def _real(name: str, config_class: type) -> str:
    return getattr(config_class, "attribute_map", {}).get(name, name)


def _kept_layers(values: dict[str, Any], depth: int | None, each_kind: bool) -> list[int]:
    """The default layers the tiny model keeps: the first ``LAYERS``, or with ``each_kind`` the first layer of
    each kind (its entries in every per-layer list, e.g. linear vs. full attention), then the first others."""
    if not depth:
        return list(range(LAYERS))
    if not each_kind:
        return list(range(min(depth, LAYERS)))
    per_layer = [v for v in values.values() if _is_per_layer(v, depth)]
    kinds = [tuple(entries[i] for entries in per_layer) for i in range(depth)]
    firsts = [i for i in range(depth) if kinds[i] not in kinds[:i]][:LAYERS]
    return sorted(firsts + [i for i in range(depth) if i not in firsts][: LAYERS - len(firsts)])


def _is_per_layer(value: Any, depth: int | None) -> bool:
    """One entry per layer ("layer_types", hybrid patterns); an activation name that happens to have as many
    characters as there are layers ("silu" at 4) is not one."""
    if not isinstance(value, (list, str)) or not depth or len(value) != depth:
        return False
    return not (isinstance(value, str) and value in _activations())


def _activations() -> Any:
    from transformers.activations import ACT2FN

    return ACT2FN


def _shrunk(key: str, value: Any, depth: int | None, layers: list[int]) -> dict[str, Any]:
    if not isinstance(key, str) or isinstance(value, bool) or value is None:
        return {}
    if isinstance(value, dict):
        return _shrunk_dict(key, value, depth, layers)
    if isinstance(value, int):
        return _shrunk_int(key, value, depth)
    if isinstance(value, float) and any(word in key for word in RANDOM_KEYS):
        return {key: 0.0}
    if key.endswith(TOKEN_ID):
        return {key: _in_vocabulary(value)}
    if _is_per_layer(value, depth) and depth > LAYERS:
        kept = [value[i] for i in layers]
        if key in SHRINK:  # a width per layer (Gemma-3n's intermediate_size)
            kept = [SHRINK[key] if isinstance(v, int) and v > 0 else v for v in kept]
        return {key: "".join(kept) if isinstance(value, str) else kept}
    return {}


def _shrunk_int(key: str, value: int, depth: int | None) -> dict[str, Any]:
    if key in SHRINK and value > 0:
        return {key: SHRINK[key]}
    if key in MOE_KEYS and value > 0:
        return {key: MOE_KEYS[key]}
    if key.endswith(TOKEN_ID):
        return {key: _in_vocabulary(value)}
    if key.endswith("_vocab") and value > VOCAB:
        return {key: VOCAB}  # another table indexed by token ids or their hashes (BLT's byte-group hashes)
    if key.endswith(GROUP_COUNT) and value > SHRINK["num_heads"]:
        return {key: 1}  # head groups (Mamba-2's n_groups) must divide the tiny head count
    if key.startswith("num_") and key.endswith(LAYER_COUNT) and depth and LAYERS <= value < depth:
        return {key: value * LAYERS // depth}  # layers of some kind (kv-sharing, dense): as many in proportion
    return {}


def _shrunk_dict(key: str, value: dict, depth: int | None, layers: list[int]) -> dict[str, Any]:
    """A per-layer table keyed by layer index (Gemma-4's per_layer_config, a heterogeneous config's) keeps the
    kept layers, renumbered, each entry shrunk; a sub-config (DBRX's ffn_config) is shrunk as the config is."""
    if value and all(isinstance(k, int) or str(k).isdigit() for k in value):
        kept = {new: _entry(value, old) for new, old in enumerate(layers) if old in value or str(old) in value}
        shrunk = {new: {**v, **_inner(v, depth, layers)} if isinstance(v, dict) else v for new, v in kept.items()}
        return {key: shrunk} if shrunk != value else {}
    inner = _inner(value, depth, layers)
    return {key: {**value, **inner}} if inner else {}


def _entry(table: dict, index: int) -> Any:
    return table[index] if index in table else table[str(index)]


def _inner(value: dict, depth: int | None, layers: list[int]) -> dict[str, Any]:
    return {k: v for item in value.items() for k, v in _shrunk(*item, depth, layers).items()}


def _head_widths(values: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Head widths the defaults tie to the model width (Mamba-2: heads * head_dim = expand * hidden_size) keep
    that ratio at the tiny width."""
    width, tiny_width = values.get("hidden_size"), overrides.get("hidden_size")
    tied = {}
    for heads_key, dim_key in HEAD_PAIRS:
        heads, dim, tiny_heads = values.get(heads_key), values.get(dim_key), overrides.get(heads_key)
        if not all(isinstance(v, int) and v > 0 for v in (width, tiny_width, heads, dim, tiny_heads)):
            continue
        tiny_dim, rest = divmod(heads * dim * tiny_width, width * tiny_heads)
        if not rest and tiny_dim > 0:
            tied[dim_key] = tiny_dim
    return tied


def _sibling_sizes(overrides: dict[str, Any]) -> None:
    """A sub-config's ``<size>_<role>`` (BLT's encoder_config.hidden_size_global) is the ``<role>_config``
    sibling's tiny ``<size>``."""
    subs = {k.removesuffix("_config"): v for k, v in overrides.items() if k.endswith("_config") and isinstance(v, dict)}
    for sub in subs.values():
        for key in list(sub):
            size, _, role = key.rpartition("_")
            if size in SHRINK and isinstance(subs.get(role, {}).get(size), int):
                sub[key] = subs[role][size]


def _fill_unset(config: Any) -> None:
    """What the defaults leave None and the modeling code reads as a number, from the conventions the classes
    document: head_dim = hidden_size / heads, no key/value head count means one per head, no layer types means
    full attention, an empty per-layer-type RoPE table the default RoPE."""
    values = config.to_dict()
    hidden, heads = values.get("hidden_size"), values.get("num_attention_heads")
    if "head_dim" in values and values["head_dim"] is None and isinstance(hidden, int) and isinstance(heads, int):
        config.head_dim = hidden // heads
    if "num_key_value_heads" in values and values["num_key_value_heads"] is None and isinstance(heads, int):
        config.num_key_value_heads = heads
    if "layer_types" in values and values["layer_types"] is None and isinstance(values.get("num_hidden_layers"), int):
        config.layer_types = ["full_attention"] * values["num_hidden_layers"]
    rope = values.get("rope_parameters")
    if rope == {} and values.get("layer_types"):
        theta = {"rope_type": "default", "rope_theta": float(config.default_theta)}
        config.rope_parameters = {layer_type: dict(theta) for layer_type in set(values["layer_types"])}


def _in_vocabulary(value: Any) -> Any:
    if isinstance(value, int):
        return min(value, VOCAB - 1)
    if isinstance(value, list):
        return [min(v, VOCAB - 1) if isinstance(v, int) else v for v in value]
    return value


def _first_int(config: Any, values: dict[str, Any], names: tuple[str, ...]) -> int | None:
    """The first of ``names`` the default config sets to an int; a heterogeneous config refuses a global read of
    a per-layer key (DOTS-3's heads), which is then read from its to_dict."""
    for name in names:
        try:
            value = getattr(config, name, None)
        except RuntimeError:
            value = values.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def build_tiny(model_type: str, **kwargs: Any) -> nn.Module:
    """The architecture at its tiny config, fp32, as ids -> logits (tests/real_models.py's wrapper);
    ``kwargs`` go to ``from_config`` (``experts_implementation``)."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.real_models import HFCausalLM

    return HFCausalLM(AutoModelForCausalLM.from_config(tiny_config(model_type), dtype=torch.float32, **kwargs))
