"""Model shapes the planner knows by name: the rows of Table 1 of Narayanan et al. 2021, GPT-3 175B
and Mixtral-8x7B."""

from __future__ import annotations

from dataclasses import dataclass, replace

from lightning_ptdp.planner.latent import LatentAttention


def check_positive(name: str, value: object, *, integer: bool = True) -> None:
    """Raise ValueError unless ``value`` is a positive int (or number when ``integer=False``); bools refused."""
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)) or value <= 0:
        raise ValueError(f"{name} must be a positive {'integer' if integer else 'number'}, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class ModelSize:
    """A decoder-only transformer's shape. The defaults are the paper's GPT: vocabulary 51,200
    (padded), context 2,048, multi-head attention, a 4h GeLU MLP with biases, learned positions and
    an LM head tied to the embedding. Llama-style models set ``num_kv_heads`` (grouped-query
    attention), ``ffn_hidden_size`` with ``gated_mlp`` (SwiGLU: three matrices), no biases, rotary
    positions (``learned_positions=False``) and often an untied head (``from_hf_config``)."""

    num_layers: int
    hidden_size: int
    num_heads: int
    vocab_size: int = 51_200
    seq_length: int = 2_048
    num_kv_heads: int | None = None
    """Key/value heads (grouped-query attention); None: ``num_heads``."""
    ffn_hidden_size: int | None = None
    """The MLP's inner width; None: ``4 * hidden_size``."""
    gated_mlp: bool = False
    biases: bool = True
    learned_positions: bool = True
    tied_embeddings: bool = True
    num_experts: int | None = None
    """Mixture of experts: MLPs per layer, each ``ffn_hidden_size`` wide, behind a router Linear;
    None: one dense MLP."""
    experts_per_token: int | None = None
    """k: the experts each token runs (top-k routing); needed with ``num_experts``."""
    shared_ffn_size: int = 0
    """A dense shared expert's width beside the routed ones (Qwen2-MoE, DeepSeek); 0: none."""
    dense_layers: int = 0
    """A mixture of experts whose first layers have one dense MLP instead (DeepSeek's first_k_dense_replace)."""
    dense_layer_ffn_size: int | None = None
    """Those dense layers' MLP width; None: ``ffn_hidden_size``."""
    latent_attention: LatentAttention | None = None
    """Multi-head latent attention (DeepSeek-V2/V3); None: grouped-query attention by ``num_kv_heads``."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_heads", "vocab_size", "seq_length"):
            check_positive(f"ModelSize.{name}", getattr(self, name))
        for name in ("num_kv_heads", "ffn_hidden_size", "num_experts", "experts_per_token", "dense_layer_ffn_size"):
            if getattr(self, name) is not None:
                check_positive(f"ModelSize.{name}", getattr(self, name))
        if (self.num_experts is None) != (self.experts_per_token is None) or (
            self.num_experts is not None and self.experts_per_token > self.num_experts
        ):
            raise ValueError(
                f"ModelSize.num_experts={self.num_experts} and experts_per_token={self.experts_per_token}: a "
                "mixture of experts needs both, with experts_per_token <= num_experts (top-k routing); a dense "
                "model leaves both None"
            )
        if self.dense_layers and (
            not self.num_experts or isinstance(self.dense_layers, bool) or not 0 < self.dense_layers < self.num_layers
        ):
            raise ValueError(
                f"ModelSize.dense_layers={self.dense_layers!r} needs a mixture of experts (num_experts) and "
                f"0 <= dense_layers < num_layers={self.num_layers}: the first layers of an MoE model that are dense"
            )
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"ModelSize.hidden_size={self.hidden_size} is not divisible by "
                f"num_heads={self.num_heads}; use a multiple of the head count"
            )
        if self.num_heads % self.kv_heads:
            raise ValueError(
                f"ModelSize.num_heads={self.num_heads} is not a multiple of num_kv_heads={self.kv_heads}; "
                "grouped-query attention shares each key/value head among a whole number of query heads"
            )

    @property
    def kv_heads(self) -> int:
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def ffn_size(self) -> int:
        return 4 * self.hidden_size if self.ffn_hidden_size is None else self.ffn_hidden_size

    @property
    def is_paper_gpt(self) -> bool:
        """The paper's layer (Eq. 2 and its FLOPs formula hold exactly)."""
        return (
            self.kv_heads == self.num_heads
            and self.ffn_size == 4 * self.hidden_size
            and not self.gated_mlp
            and self.biases
            and self.learned_positions
            and self.tied_embeddings
            and self.num_experts is None
            and self.latent_attention is None
        )

    def describe(self) -> str:
        """One line: the shape and the parameter count."""
        heads = f"{self.num_heads} heads" + (f" ({self.kv_heads} kv)" if self.kv_heads != self.num_heads else "")
        heads += f" (latent kv {self.latent_attention.kv_lora_rank})" if self.latent_attention else ""
        mlp = f"ffn {self.ffn_size}{' gated' if self.gated_mlp else ''}"
        if self.num_experts is not None:
            mlp += f" x {self.num_experts} experts, top-{self.experts_per_token}"
            mlp += f" (+ shared {self.shared_ffn_size})" if self.shared_ffn_size else ""
            mlp += f", first {self.dense_layers} dense" if self.dense_layers else ""
        head = "tied" if self.tied_embeddings else "untied"
        return (
            f"{self.num_layers} layers, hidden {self.hidden_size}, {heads}, {mlp}, vocab {self.vocab_size}, "
            f"seq {self.seq_length}, {head} head: {self.parameters / 1e9:.2f}B parameters"
            + (f" ({self.active_parameters / 1e9:.2f}B active per token)" if self.num_experts else "")
        )

    def tensor_parallel_reason(self, t: int) -> str | None:
        """Why t-way tensor parallelism cannot split this model (None when it can)."""
        sizes = {"num_heads": self.num_heads, "num_kv_heads": self.kv_heads, "hidden_size": self.hidden_size}
        if self.dense_ffn_size:  # tensor parallelism splits the dense MLP (or shared expert), not routed experts
            sizes["shared_ffn_size" if self.num_experts else "ffn_hidden_size"] = self.dense_ffn_size
        if self.dense_layers:
            sizes["dense_layer_ffn_size"] = self.dense_layer.ffn_size
        bad = {name: n for name, n in sizes.items() if n % t}
        if not bad:
            return None
        common = [k for k in range(1, self.num_heads + 1) if all(n % k == 0 for n in sizes.values())]
        found = ", ".join(f"{name}={n}" for name, n in bad.items())
        return (
            f"tensor_parallel_size={t} does not divide {found} (each rank takes whole heads and equal "
            f"slices); choose one of {', '.join(map(str, common))}"
        )

    @property
    def qk_head_dim(self) -> int:
        """Width of one head's query and key (what QK^T contracts over)."""
        return self.latent_attention.qk_head_dim if self.latent_attention else self.hidden_size // self.num_heads

    @property
    def v_head_dim(self) -> int:
        """Width of one head's value (what scores x V yields)."""
        return self.latent_attention.v_head_dim if self.latent_attention else self.hidden_size // self.num_heads

    def attention_linears(self, t: int = 1) -> list[tuple[float, float]]:
        """(output width, input width) of the attention's matmuls on one of t TP ranks."""
        if self.latent_attention:
            return self.latent_attention.linears(self.hidden_size, self.num_heads, t)
        return [(self.qkv_width / t, self.hidden_size), (self.hidden_size, self.hidden_size / t)]

    @property
    def dense_layer(self) -> ModelSize:
        """The shape of the first ``dense_layers`` layers: one dense MLP, no experts."""
        width = self.dense_layer_ffn_size or self.ffn_hidden_size
        moe = dict(num_experts=None, experts_per_token=None, shared_ffn_size=0, dense_layers=0)
        return replace(self, **moe, ffn_hidden_size=width, dense_layer_ffn_size=None)

    @property
    def attention_flops_per_key(self) -> int:
        """Forward FLOPs of QK^T and scores x V per (query, key) pair, every head: 2a(d_qk + d_v), 4h for whole heads."""
        return 2 * self.num_heads * (self.qk_head_dim + self.v_head_dim)

    @property
    def qkv_width(self) -> int:
        """Width of the query, key and value attention takes, together (MLA: after the up-projections)."""
        if self.latent_attention:
            return self.num_heads * (2 * self.qk_head_dim + self.v_head_dim)
        return self.hidden_size + 2 * self.kv_heads * (self.hidden_size // self.num_heads)

    def _mlp(self, width: int) -> int:
        return (3 if self.gated_mlp else 2) * self.hidden_size * width

    def _layer_matrices(self, mlps: int) -> int:
        h = self.hidden_size
        router = h * self.num_experts if self.num_experts else 0
        attention = sum(cols * inner for cols, inner in self.attention_linears())
        return int(attention) + mlps * self._mlp(self.ffn_size) + self._mlp(self.shared_ffn_size) + router

    @property
    def layer_matrix_parameters(self) -> int:
        """Weights of one layer's matmuls: QKV, attention output, the MLP's two (or three) matrices
        (every expert's, the router's and a shared expert's in a mixture of experts)."""
        return self._layer_matrices(self.num_experts or 1)

    @property
    def active_layer_matrix_parameters(self) -> int:
        """The matmul weights one token runs through in a layer: in a mixture of experts its k experts."""
        return self._layer_matrices(self.experts_per_token or 1)

    @property
    def moe_layers(self) -> int:
        """Layers with routed experts (all but the first ``dense_layers``; 0: a dense model)."""
        return self.num_layers - self.dense_layers if self.num_experts else 0

    def _layer_parameters(self) -> int:
        h, f = self.hidden_size, self.ffn_size
        norms = 4 * h if self.biases else 2 * h  # two LayerNorms (weight + bias) or RMSNorms (weight)
        norms += self.latent_attention.norm_parameters if self.latent_attention else 0
        biases = (self.qkv_width + h + f * (2 if self.gated_mlp else 1) + h) if self.biases else 0
        return self.layer_matrix_parameters + biases + norms

    @property
    def parameters(self) -> int:
        """Counted term by term as Eq. 2 counts the paper's GPT (exactly Eq. 2 there; final norm left out)."""
        h, dense = self.hidden_size, self.dense_layers
        layers = (self.num_layers - dense) * self._layer_parameters()
        layers += dense * self.dense_layer._layer_parameters() if dense else 0
        embeddings = self.vocab_size * h * (1 if self.tied_embeddings else 2)
        positions = self.seq_length * h if self.learned_positions else 0
        return layers + embeddings + positions

    @property
    def active_matrix_parameters(self) -> int:
        """The matmul weights one token runs through, every layer's (a mixture of experts: its k experts)."""
        dense = self.dense_layers * self.dense_layer.layer_matrix_parameters if self.dense_layers else 0
        return (self.num_layers - self.dense_layers) * self.active_layer_matrix_parameters + dense

    @property
    def active_parameters(self) -> int:
        """Parameters one token uses (a mixture of experts: its k experts' of each layer's)."""
        return self.parameters - self.moe_layers * (self.layer_matrix_parameters - self.active_layer_matrix_parameters)

    @property
    def expert_parameters(self) -> int:
        """The routed experts' weights (every layer's, every expert's): what expert parallelism splits."""
        return self.moe_layers * self.num_experts * self._mlp(self.ffn_size) if self.num_experts else 0

    @property
    def dense_ffn_size(self) -> int:
        """The width of the MLP tensor parallelism splits: the whole MLP, or a shared expert's."""
        return self.shared_ffn_size if self.num_experts else self.ffn_size

    @property
    def split_activation_sbh(self) -> float:
        """Activation bytes per layer that tensor parallelism splits, in units of s*b*h (24 for the
        paper's GPT: Q, K, V 6, attention-output input 2, GeLU input 8, second-MLP input 8); a
        SwiGLU keeps its gate and up outputs (4f) and the second matmul's input (2f)."""
        attention = 2 * self.qkv_width + 2 * self.num_heads * self.v_head_dim  # Q, K, V and the output's input
        return (attention + (6 if self.gated_mlp else 4) * self.dense_ffn_size) / self.hidden_size

    @property
    def whole_activation_sbh(self) -> float:
        """Activation bytes per layer, in units of s*b*h, beyond Korthikanti's 10sbh that tensor
        parallelism leaves whole on each rank: MLA's latents (``LatentAttention``); 0 otherwise."""
        if not self.latent_attention:
            return 0.0
        return self.latent_attention.latent_bytes_per_token / self.hidden_size

    @property
    def expert_activation_sbh(self) -> float:
        """Activation bytes per layer of the routed experts, in units of s*b*h: each token's k rows
        in (2h each), and the MLP's (4f, or 6f gated); kept whole by tensor parallelism (0: dense)."""
        if not self.num_experts:
            return 0.0
        per_row = 2 * self.hidden_size + (6 if self.gated_mlp else 4) * self.ffn_size
        return self.experts_per_token * per_row / self.hidden_size

    @classmethod
    def from_hf_config(cls, config: dict | str, *, seq_length: int | None = None) -> ModelSize:
        """The shape of a Hugging Face transformers ``config.json`` (a dict or a path to the file):
        Llama, Mistral, Qwen2, GPT-2, GPT-NeoX, Mixtral, Qwen-MoE and DeepSeek (latent attention) style
        keys. ``seq_length`` defaults to the
        config's ``max_position_embeddings`` (``n_positions``) capped at 4,096."""
        if not isinstance(config, dict):
            import json
            from pathlib import Path

            config = json.loads(Path(config).read_text())
        return _from_hf_config(cls, config, seq_length)


@dataclass(frozen=True)
class PaperConfiguration:
    """One row of Table 1 of Narayanan et al. 2021 (weak scaling on 80 GB A100s, 8 per node)."""

    model: ModelSize
    parameters_billions: float
    tensor_parallel_size: int
    pipeline_parallel_size: int
    num_gpus: int
    global_batch_size: int
    achieved_tflops_per_gpu: float


# Table 1 of the paper (also Megatron-LM's 2021 documentation); V = 51,200 and s = 2,048 for all rows.
# name: (parameters in billions, heads, hidden, layers, t, p, GPUs, batch, TFLOP/s per GPU)
_TABLE_1_ROWS = {
    "gpt_1.7b": (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    "gpt_3.6b": (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    "gpt_7.5b": (7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    "gpt_18.4b": (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    "gpt_39.1b": (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    "gpt_76.1b": (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    "gpt_145.6b": (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    "gpt_310.1b": (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    "gpt_529.6b": (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    "gpt_1t": (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
}
TABLE_1: dict[str, PaperConfiguration] = {
    name: PaperConfiguration(ModelSize(num_layers=row[3], hidden_size=row[2], num_heads=row[1]), row[0], *row[4:])
    for name, row in _TABLE_1_ROWS.items()
}

GPT3_175B = ModelSize(num_layers=96, hidden_size=12288, num_heads=96)
"""GPT-3 175B with the paper's vocabulary (51,200) and context (2,048): 174.6B parameters by Eq. 2."""

MIXTRAL_8X7B = ModelSize(
    num_layers=32,
    hidden_size=4096,
    num_heads=32,
    vocab_size=32_000,
    seq_length=4_096,
    num_kv_heads=8,
    ffn_hidden_size=14_336,
    gated_mlp=True,
    biases=False,
    learned_positions=False,
    tied_embeddings=False,
    num_experts=8,
    experts_per_token=2,
)
"""Mixtral-8x7B (mistralai/Mixtral-8x7B-v0.1's config.json) at 4,096 tokens: 46.70B parameters, 12.88B active."""

LLAMA3_8B_128K = ModelSize(
    num_layers=32,
    hidden_size=4096,
    num_heads=32,
    vocab_size=128_256,
    seq_length=131_072,
    num_kv_heads=8,
    ffn_hidden_size=14_336,
    gated_mlp=True,
    biases=False,
    learned_positions=False,
    tied_embeddings=False,
)
"""Llama-3-8B (meta-llama/Meta-Llama-3-8B's config.json) at 131,072 tokens, the long-context example."""

MODELS: dict[str, ModelSize] = {
    **{name: row.model for name, row in TABLE_1.items()},
    "gpt3_175b": GPT3_175B,
    "mixtral_8x7b": MIXTRAL_8X7B,
    "llama3_8b_128k": LLAMA3_8B_128K,
}
"""Every name ``model_size`` (hence ``plan``, ``estimate`` and ``ptdp plan``) accepts."""


def model_size(model: str | ModelSize) -> ModelSize:
    """A ``ModelSize`` as is, or the sizes of a known name ("gpt_1.7b" ... "gpt_1t", "gpt3_175b", "mixtral_8x7b",
    "llama3_8b_128k")."""
    if isinstance(model, ModelSize):
        return model
    key = str(model).strip().lower().replace("-", "_")
    if key not in MODELS:
        raise ValueError(f"unknown model {model!r}: pass a ModelSize(...) or one of the names {', '.join(MODELS)}")
    return MODELS[key]


_GATED_ACTIVATIONS = ("silu", "swish", "swiglu", "geglu")


def _from_hf_config(cls: type[ModelSize], config: dict, seq_length: int | None) -> ModelSize:
    def first(*keys: str, default: object = None) -> object:
        return next((config[k] for k in keys if config.get(k) is not None), default)

    required = {
        "num_layers": ("num_hidden_layers", "n_layer", "num_layers"),
        "hidden_size": ("hidden_size", "n_embd", "d_model"),
        "num_heads": ("num_attention_heads", "n_head"),
        "vocab_size": ("vocab_size",),
    }
    values = {name: first(*keys) for name, keys in required.items()}
    missing = [f"{name} ({' or '.join(required[name])})" for name, v in values.items() if v is None]
    if missing:
        raise ValueError(
            f"config.json has no {', '.join(missing)}; ptdp plan reads decoder-only transformers configs "
            "(Llama, Mistral, Qwen2, GPT-2, GPT-NeoX): pass layers,hidden,heads[,vocab,seq] instead"
        )
    activation = str(first("hidden_act", "activation_function", default="gelu")).lower()
    model_type = str(config.get("model_type", "")).lower()
    gated = activation in _GATED_ACTIVATIONS or model_type in ("llama", "mistral", "qwen2", "qwen3", "gemma")
    context = first("max_position_embeddings", "n_positions", "n_ctx", default=2048)
    experts = first("num_local_experts", "num_experts", "n_routed_experts")
    extra: dict = {}  # a mixture of experts' keys, multi-head latent attention's
    if experts:  # Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek keys; the experts' own width where it differs
        shared = first("n_shared_experts", default=0) * first("moe_intermediate_size", default=0)
        extra = dict(
            num_experts=experts,
            experts_per_token=first("num_experts_per_tok", "moe_topk", default=2),
            shared_ffn_size=first("shared_expert_intermediate_size", default=shared),
        )
        if first("first_k_dense_replace"):  # DeepSeek: the first k layers dense, intermediate_size wide
            extra.update(dense_layers=config["first_k_dense_replace"], dense_layer_ffn_size=first("intermediate_size"))
        gated = True
    if config.get("kv_lora_rank"):  # DeepSeek-V2/V3: multi-head latent attention
        keys = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "q_lora_rank")
        extra["latent_attention"] = LatentAttention(**{key: config.get(key) for key in keys})
    return cls(
        **extra,
        **values,
        seq_length=seq_length or min(int(context), 4096),
        num_kv_heads=first("num_key_value_heads"),
        ffn_hidden_size=first("moe_intermediate_size", "intermediate_size", "n_inner", "ffn_dim")
        if experts
        else first("intermediate_size", "n_inner", "ffn_dim"),
        gated_mlp=gated,
        biases=bool(first("attention_bias", "mlp_bias", "use_bias", default=not gated)),
        learned_positions=model_type in ("gpt2", "gpt_bigcode", "opt") or "n_positions" in config,
        tied_embeddings=bool(config.get("tie_word_embeddings", True)),
    )
