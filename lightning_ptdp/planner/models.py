"""Model shapes the planner knows by name: the rows of Table 1 of Narayanan et al. 2021 and GPT-3 175B."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_ptdp.tools.flops import gpt_parameter_count


def check_positive(name: str, value: object, *, integer: bool = True) -> None:
    """Raise ValueError unless ``value`` is a positive int (or number when ``integer=False``); bools refused."""
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)) or value <= 0:
        raise ValueError(f"{name} must be a positive {'integer' if integer else 'number'}, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class ModelSize:
    """A GPT's shape; defaults are the paper's vocabulary (51,200, padded) and context (2,048)."""

    num_layers: int
    hidden_size: int
    num_heads: int
    vocab_size: int = 51_200
    seq_length: int = 2_048

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_heads", "vocab_size", "seq_length"):
            check_positive(f"ModelSize.{name}", getattr(self, name))
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"ModelSize.hidden_size={self.hidden_size} is not divisible by "
                f"num_heads={self.num_heads}; use a multiple of the head count"
            )

    @property
    def parameters(self) -> int:
        return gpt_parameter_count(self.num_layers, self.hidden_size, self.vocab_size, self.seq_length)


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


# Table 1 of the paper (also the Megatron-LM README of 2021); V = 51,200 and s = 2,048 for all rows.
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

MODELS: dict[str, ModelSize] = {**{name: row.model for name, row in TABLE_1.items()}, "gpt3_175b": GPT3_175B}
"""Every name ``model_size`` (hence ``plan``, ``estimate`` and ``ptdp plan``) accepts."""


def model_size(model: str | ModelSize) -> ModelSize:
    """A ``ModelSize`` as is, or the sizes of a known name ("gpt_1.7b" ... "gpt_1t", "gpt3_175b")."""
    if isinstance(model, ModelSize):
        return model
    key = str(model).strip().lower().replace("-", "_")
    if key not in MODELS:
        raise ValueError(f"unknown model {model!r}: pass a ModelSize(...) or one of the names {', '.join(MODELS)}")
    return MODELS[key]
