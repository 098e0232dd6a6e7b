"""litgpt's and torchtitan's model families at tiny sizes, each as ids -> logits (benchmarks/sweep_libraries.py).

litgpt: one named config per architecture signature (``SIGNATURE``: the Config fields that change modules or
code paths), shrunk by ``LITGPT_SHRINK`` with per-layer lists cut to the tiny depth; no per-family code.
torchtitan: every package of ``torchtitan.models`` with a builder in ``TITAN`` (its own layer builders at the
zoo's shape), or a reason in ``TITAN_EXCLUDED``. ``register`` puts each family in REAL_FAMILIES under
``tests.models.TINY`` + name, where ``build_model`` (and so ``fit_and_record``) finds it.
"""

from __future__ import annotations

import collections
import functools
import types
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from tests.real_models import HEADS, HIDDEN, KV_HEADS, SEQ, VOCAB, CausalSDPA

LAYERS, FFN = 2, 64  # a block per stage at p=2
LITGPT, TITAN_PREFIX = "litgpt:", "torchtitan:"
# where a config holds a value (not None, not 0), it takes this one; sizes stay divisible by 2 for t=2, c=2
LITGPT_SHRINK = {
    "block_size": SEQ,
    "n_layer": LAYERS,
    "n_embd": HIDDEN,
    "n_head": HEADS,
    "vocab_size": VOCAB,
    "padded_vocab_size": VOCAB,
    "intermediate_size": FFN,
    "moe_intermediate_size": FFN,
    "n_expert": 4,
    "n_expert_per_token": 2,
    "sliding_window_size": SEQ // 2,  # shorter than the context: the window masks something
}
# the Config fields that change the modules built or the code path taken (their kind, not their size)
SIGNATURE = (
    "mlp_class_name",
    "norm_class_name",
    "norm_qk",
    "norm_qk_type",
    "post_attention_norm",
    "post_mlp_norm",
    "parallel_residual",
    "shared_attention_norm",
    "attn_bias",
    "bias",
    "lm_head_bias",
    "scale_embeddings",
    "gelu_approximate",
    "sliding_window_size",
    "sliding_window_indices",
    "attention_logit_softcapping",
    "final_logit_softcapping",
    "attention_scores_scalar",
    "rope_adjustments",
    "rope_indices",
    "rope_local_base_freq",
    "n_expert",
    "norm_1",
    "norm_2",
)
PER_LAYER = ("sliding_window_indices", "rope_indices")


def _kind(value: Any) -> Any:
    """A field's value as structure: flags and names as they are, a size as whether it is set, a per-layer
    list as the set of its values, a dict as its keys."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (int, float)):
        return bool(value)
    if isinstance(value, list):
        return tuple(sorted(set(value)))
    return tuple(sorted(value)) if isinstance(value, dict) else repr(value)


def _attention(config: Any) -> tuple[str, bool, bool]:
    """(heads per key/value: mha, gqa or mqa; head_size = n_embd / n_head; full rotary)."""
    groups = "mha" if config.n_query_groups == config.n_head else "mqa" if config.n_query_groups == 1 else "gqa"
    return groups, config.head_size * config.n_head == config.n_embd, config.rotary_percentage == 1.0


def litgpt_signature(config: Any) -> tuple:
    return tuple((name, _kind(getattr(config, name))) for name in SIGNATURE) + _attention(config)


@functools.cache
def litgpt_architectures() -> dict[str, tuple[str, int]]:
    """name -> (what sets it apart, how many named configs share its signature): the first named config
    of each signature in litgpt.config.configs."""
    from litgpt.config import Config, configs

    groups: dict[tuple, list[str]] = collections.defaultdict(list)
    for entry in configs:
        groups[litgpt_signature(Config(**entry))].append(entry["name"])
    out = {}
    for signature, names in groups.items():
        named = dict(signature[: len(SIGNATURE)])
        shown = [f"{k}={v}" for k, v in named.items() if v not in (None, False, True, "default", "none")]
        shown += [f"{k}" for k, v in named.items() if v is True and k not in ("norm_1", "norm_2")]
        groups_kind, square, full_rotary = signature[len(SIGNATURE) :]
        shown += [groups_kind] + ([] if square else ["head_size != n_embd/n_head"])
        shown += [] if full_rotary else ["partial rotary"]
        out[names[0]] = (", ".join(shown), len(names))
    return out


def _per_layer(values: list, layers: int) -> list:
    """Each distinct value in first-appearance order, cycled to ``layers``: every kind of layer stays."""
    distinct = list(dict.fromkeys(values))
    return [distinct[i % len(distinct)] for i in range(layers)]


def litgpt_tiny_config(name: str) -> Any:
    from litgpt.config import Config, configs

    entry = next(c for c in configs if c["name"] == name)
    full = Config(**entry)
    tiny = {key: value for key, value in LITGPT_SHRINK.items() if getattr(full, key, None)}
    groups, square, _ = _attention(full)
    tiny["n_query_groups"] = {"mha": HEADS, "gqa": KV_HEADS, "mqa": 1}[groups]
    tiny["head_size"] = HIDDEN // HEADS * (1 if square else 2)
    tiny |= {key: _per_layer(getattr(full, key), LAYERS) for key in PER_LAYER if getattr(full, key)}
    return Config(**{**entry, **tiny})


def litgpt_model(name: str) -> nn.Module:
    from litgpt import GPT

    return GPT(litgpt_tiny_config(name))


class CausalSDPAWithLSE(CausalSDPA):
    """CausalSDPA, and where the model asks for an epilogue on (out, lse) (gpt-oss's attention sinks), each
    query row's log-sum-exp of its scaled causal scores beside it, as torchtitan's varlen backend gives."""

    def forward(self, q, k, v, *, out_transform=None, scale=None, enable_gqa=False, **kwargs):  # (B, L, N, H)
        out = super().forward(q, k, v, scale=scale, enable_gqa=enable_gqa)
        if out_transform is None:
            return out
        k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
        scores = torch.einsum("blnh,bmnh->bnlm", q, k) * (scale if scale is not None else q.shape[-1] ** -0.5)
        causal = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool, device=q.device).tril()
        lse = scores.masked_fill(~causal, float("-inf")).logsumexp(dim=-1)  # (B, N, L)
        return out_transform(out, lse.transpose(1, 2))


class _NoBFloat16(TorchFunctionMode):
    """``tensor.bfloat16()`` leaves the tensor as it is: torchtitan's GroupedExperts cast rows and weights to
    bf16 inside, whose one rounding an fp32 comparison at 1e-5 cannot take (tests/real_models.py)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.bfloat16:
            return args[0]
        return func(*args, **(kwargs or {}))


def _experts_in_model_dtype(self, *args, **kwargs):
    with _NoBFloat16():
        return type(self).forward(self, *args, **kwargs)


def _grouped_mm_loop(self, *, A: torch.Tensor, B_t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm(A, B_t, offs=offs)`` as one matmul per expert (it has no fp64 kernel); rows past
    the last offset are zero."""
    out, start = A.new_zeros(A.shape[0], B_t.shape[-1]), 0
    for expert, end in enumerate(offs.tolist()):
        out[start:end] = A[start:end] @ B_t[expert]
        start = end
    return out


def _on_plain_torch(model: nn.Module) -> nn.Module:
    """torchtitan's model with its inner attention on plain causal SDPA (its flex and varlen backends
    compile kernels or need CUDA) and its grouped expert GEMMs in the model's dtype; bound methods, so a
    deepcopy of a block calls its own copy."""
    model.init_states()  # torchtitan allocates first, then initialises
    for module in list(model.modules()):
        if hasattr(module, "inner_attention"):
            module.inner_attention = CausalSDPAWithLSE()
        if hasattr(module, "_grouped_mm"):  # GroupedExperts and its subclasses
            module.forward = types.MethodType(_experts_in_model_dtype, module)
            module._grouped_mm = types.MethodType(_grouped_mm_loop, module)
    return model


def _decoder(model_class: type, layers: list, norm: Any = None, **extra) -> nn.Module:
    """A torchtitan decoder at the zoo's vocabulary and width around ``layers``."""
    from torchtitan.models.common import Embedding, Linear, RMSNorm

    config = model_class.Config(
        dim=HIDDEN,
        vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=HIDDEN),
        norm=norm or RMSNorm.Config(normalized_shape=HIDDEN),
        lm_head=Linear.Config(in_features=HIDDEN, out_features=VOCAB),
        layers=layers,
        **extra,
    )
    return _on_plain_torch(config.build())


def titan_llama3() -> nn.Module:
    """Llama 3: fused per-KV-group wqkv, complex RoPE (tests/real_models.py's, at 4 layers)."""
    from tests.real_models import titan_llama3 as build

    return _on_plain_torch(build())


def titan_qwen3(moe: bool = False) -> nn.Module:
    """Qwen3: per-head q/k norms, head_dim apart from dim/heads, tied embeddings (or Qwen3-MoE, untied)."""
    from torchtitan.models.common import CosSinRoPE
    from torchtitan.models.qwen3 import Qwen3Model, _build_qwen3_layers, _build_qwen3_moe_layers, _qwen3_norm

    head_dim = 2 * HIDDEN // HEADS
    shape = dict(n_layers=LAYERS, dim=HIDDEN, n_heads=HEADS, n_kv_heads=KV_HEADS, head_dim=head_dim)
    rope = CosSinRoPE.Config(dim=head_dim, max_seq_len=SEQ, theta=1000000.0)
    if moe:
        extra = dict(moe_hidden_dim=FFN, num_experts=4, top_k=2, moe_comm_backend="standard")
        layers = _build_qwen3_moe_layers(**shape, **extra, attn_backend="flex", rope=rope)
    else:
        layers = _build_qwen3_layers(**shape, hidden_dim=FFN, attn_backend="flex", rope=rope)
    return _decoder(Qwen3Model, layers, _qwen3_norm(HIDDEN), enable_weight_tying=not moe)


def titan_qwen3_moe() -> nn.Module:
    """Qwen3-MoE: Qwen3's attention, RoutedExperts (token dispatcher and GroupedExperts), softmax top-2 of 4."""
    return titan_qwen3(moe=True)


def titan_deepseek_v3() -> nn.Module:
    """DeepSeek-V3: multi-head latent attention (low-rank q and kv, a rope part apart), a dense first layer,
    then MoE with shared experts and a sigmoid router, YaRN-scaled complex RoPE."""
    from torchtitan.models.common import ComplexRoPE
    from torchtitan.models.deepseek_v3 import DeepSeekV3Model, _build_dsv3_layers

    rope_dim = 8
    layers = _build_dsv3_layers(
        n_layers=LAYERS,
        n_dense_layers=1,
        dim=HIDDEN,
        n_heads=HEADS,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=rope_dim,
        v_head_dim=8,
        mscale=0.70,
        dense_hidden_dim=FFN,
        moe_hidden_dim=FFN,
        num_experts=4,
        num_shared_experts=1,
        router_top_k=2,
        router_score_func="sigmoid",
        attn_backend="flex",
        moe_comm_backend="standard",
        non_blocking_capacity_factor=None,
        rope=ComplexRoPE.Config(
            dim=rope_dim,
            max_seq_len=SEQ,
            theta=10000.0,
            scaling="yarn",
            rope_factor=40.0,
            beta_fast=32.0,
            beta_slow=1.0,
            original_seq_len=SEQ // 2,
        ),
    )
    return _decoder(DeepSeekV3Model, layers, mtp_layers=[])


def titan_gpt_oss() -> nn.Module:
    """gpt-oss: attention sinks (a per-head rescale by the scores' log-sum-exp), biased q/k/v and output,
    alternating sliding windows (128: wider than the context here), MoE with biased clamped-SwiGLU experts."""
    from torchtitan.models.common import CosSinRoPE
    from torchtitan.models.gpt_oss import GptOssModel, _build_gptoss_layers, _make_gptoss_attn_config

    head_dim = HIDDEN // HEADS
    rope = CosSinRoPE.Config(dim=head_dim, max_seq_len=SEQ, theta=150000.0)
    common = dict(attn_backend="flex", rope=rope)
    layers = _build_gptoss_layers(
        dim=HIDDEN,
        n_layers=LAYERS,
        hidden_dim=FFN,
        num_experts=4,
        top_k=2,
        load_balance_coeff=1e-3,
        moe_comm_backend="standard",
        **common,
    )
    for layer_id, layer in enumerate(layers):  # its layer builder leaves heads at 64 of 64: the zoo's instead
        window = layer.attention.sliding_window_size
        layer.attention = _make_gptoss_attn_config(
            dim=HIDDEN,
            layer_id=layer_id,
            n_heads=HEADS,
            n_kv_heads=KV_HEADS,
            head_dim=head_dim,
            sliding_window_size=window,
            **common,
        )
    return _decoder(GptOssModel, layers)


def titan_muse_glimmer() -> nn.Module:
    """Muse Glimmer: gain-centred RMSNorms before and after attention and MLP, per-head scaleless q/k norms, a
    sigmoid output gate on attention, NoPE every 4th layer from the last, a soft-capped LM head."""
    from torchtitan.models.muse_glimmer import _muse_glimmer_config

    config = _muse_glimmer_config(
        dim=HIDDEN,
        n_layers=LAYERS,
        n_heads=HEADS,
        n_kv_heads=KV_HEADS,
        head_dim=HIDDEN // HEADS,
        vocab_size=VOCAB,
        max_seq_len=SEQ,
        window_pattern=[2 * SEQ, 0],  # windows wider than the context: plain causal SDPA is exact
        output_multiplier=1.0,
        attn_backend="flex",
    )
    return WithoutSpmdTypes(_on_plain_torch(config.build()))


class WithoutSpmdTypes(nn.Module):
    """A torchtitan model run with torchtitan's SPMD backend set to ``partial_dtensor`` (restored after): Muse
    Glimmer's forward asserts spmd_types placements whenever that backend is on, the default, which needs
    the device mesh torchtitan's trainer sets up."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        from torchtitan.distributed import utils

        previous = utils.get_spmd_backend()
        utils.set_spmd_backend("partial_dtensor")
        try:
            return self.model(tokens)
        finally:
            utils.set_spmd_backend(previous)


TITAN: dict[str, Callable[[], nn.Module]] = {
    "llama3": titan_llama3,
    "qwen3": titan_qwen3,
    "qwen3_moe": titan_qwen3_moe,
    "deepseek_v3": titan_deepseek_v3,
    "gpt_oss": titan_gpt_oss,
    "muse_glimmer": titan_muse_glimmer,
}
TITAN_EXCLUDED = {
    "flux": "a diffusion image model (FLUX), not a language model",
    "kimi_k2_7": "vision-language (Kimi-K2.5): its text decoder is deepseek_v3's build_mla_moe_layers, swept there",
    "qwen3_5": "vision-language, its gated DeltaNet layers need the fla package's Triton kernels (not installed)",
}


def titan_packages() -> list[str]:
    """Every package under torchtitan.models (a new one shows up as excluded until it has a builder)."""
    import pkgutil

    import torchtitan.models

    return sorted(m.name for m in pkgutil.iter_modules(torchtitan.models.__path__) if m.ispkg)


def library_families() -> dict[str, str]:
    """Every family this module builds: name -> description."""
    out = {f"{LITGPT}{name}": f"{what} ({n} configs)" for name, (what, n) in litgpt_architectures().items()}
    return out | {f"{TITAN_PREFIX}{name}": " ".join((TITAN[name].__doc__ or name).split()) for name in TITAN}


def library_exclusions() -> dict[str, str]:
    """torchtitan packages out of scope, with the reason (a package with neither builder nor reason: said)."""
    packages = [p for p in titan_packages() if p not in TITAN and p != "common"]  # common: shared modules
    return {f"{TITAN_PREFIX}{p}": TITAN_EXCLUDED.get(p, "no tiny builder in tests/library_models.py") for p in packages}


def build_library(name: str) -> nn.Module:
    if name.startswith(LITGPT):
        return litgpt_model(name.removeprefix(LITGPT))
    return TITAN[name.removeprefix(TITAN_PREFIX)]()


def register() -> None:
    """Every family in tests.real_models.REAL_FAMILIES as TINY + name (build_model's lookup)."""
    from tests.models import TINY
    from tests.real_models import REAL_FAMILIES

    for name in library_families():
        REAL_FAMILIES.setdefault(TINY + name, functools.partial(build_library, name))
