"""The reference GPT: a plain LightningModule with no parallel code in it.

Pre-LN transformer blocks, attention through ``F.scaled_dot_product_attention``, a
Linear -> GeLU -> Linear MLP with biases, learned or rotary positions, tied or untied LM head,
AdamW with linear warmup and cosine decay, validation perplexity through torchmetrics.
Shape comments: B batch, T sequence, C hidden size, nh heads, hs head size, V vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from functools import partial
from typing import Literal

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
import torchmetrics

from lightning_ptdp.parallel.init import Constant, Init, Normal, initialize, is_on_meta


@dataclass(kw_only=True)
class GPTConfig:
    """Model shape. Defaults are the ``tiny`` CPU size."""

    vocab_size: int = 256
    """V: vocabulary size (tokens are ints in [0, V))."""
    seq_length: int = 64
    """s: maximum sequence length (context window)."""
    num_layers: int = 2
    """l: transformer blocks."""
    num_heads: int = 4
    """a: attention heads."""
    hidden_size: int = 64
    """h: model width; must be divisible by num_heads."""
    ffn_hidden_size: int | None = None
    """MLP width; None means 4 * hidden_size."""
    dropout: float = 0.0
    """Dropout on attention output, MLP output and embeddings."""
    position_embedding: Literal["learned", "rotary"] = "learned"
    """Learned absolute positions (GPT-2) or rotary embeddings applied to q and k."""
    tie_embeddings: bool = True
    """Share the token embedding with the LM head."""
    init_std: float = 0.02
    """Standard deviation of the normal initialisation."""
    init_seed: int | None = None
    """Seed of the initialisation (lightning_ptdp.parallel.init: the same values on any layout); None takes
    torch's seed at construction (``L.seed_everything``)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_length", "num_layers", "num_heads", "hidden_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name}={value!r} must be a positive integer")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"GPTConfig.hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}; "
                "choose a hidden size that is a multiple of the head count"
            )
        if self.ffn_hidden_size is not None and (
            isinstance(self.ffn_hidden_size, bool)
            or not isinstance(self.ffn_hidden_size, int)
            or self.ffn_hidden_size < 1
        ):
            raise ValueError(
                f"GPTConfig.ffn_hidden_size={self.ffn_hidden_size!r} must be a positive integer or None (4 * hidden_size)"
            )
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout={self.dropout} must be in [0, 1)")
        if self.position_embedding not in ("learned", "rotary"):
            raise ValueError(f"GPTConfig.position_embedding={self.position_embedding!r}: use 'learned' or 'rotary'")
        if not isinstance(self.tie_embeddings, bool):
            raise ValueError(f"GPTConfig.tie_embeddings={self.tie_embeddings!r} must be True or False")
        _check_range(
            "GPTConfig.init_std", self.init_std, low=0.0, low_open=True, fix="a small positive value such as 0.02"
        )
        if self.init_seed is not None and (isinstance(self.init_seed, bool) or not isinstance(self.init_seed, int)):
            raise ValueError(f"GPTConfig.init_seed={self.init_seed!r} must be an integer or None (torch's seed)")
        if self.position_embedding == "rotary" and (self.hidden_size // self.num_heads) % 2:
            raise ValueError("rotary position embedding needs an even head size (hidden_size / num_heads)")


@dataclass(kw_only=True)
class OptimConfig:
    """AdamW with linear warmup then cosine decay to ``min_lr_ratio * lr``."""

    lr: float = 3e-3
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    warmup_steps: int = 20
    max_steps: int = 1000
    """Length of the cosine schedule; the LR stays at its minimum afterwards."""
    min_lr_ratio: float = 0.1

    def __post_init__(self) -> None:
        _check_range("OptimConfig.lr", self.lr, low=0.0, low_open=True, fix="a learning rate such as 3e-4")
        _check_range("OptimConfig.weight_decay", self.weight_decay, low=0.0, fix="0 to switch weight decay off")
        if not (isinstance(self.betas, (tuple, list)) and len(self.betas) == 2):
            raise ValueError(f"OptimConfig.betas={self.betas!r} must be two numbers (beta1, beta2), e.g. (0.9, 0.95)")
        for index, beta in enumerate(self.betas):
            _check_range(f"OptimConfig.betas[{index}]", beta, low=0.0, high=1.0, fix="a value such as 0.9 or 0.95")
        for name in ("warmup_steps", "max_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "warmup_steps" else 1):
                least = 0 if name == "warmup_steps" else 1
                raise ValueError(f"OptimConfig.{name}={value!r} must be an integer >= {least}")
        _check_range(
            "OptimConfig.min_lr_ratio",
            self.min_lr_ratio,
            low=0.0,
            high=1.0,
            high_open=False,
            fix="the final LR as a fraction of lr, e.g. 0.1",
        )


def _check_range(
    name: str,
    value: object,
    *,
    low: float,
    high: float = float("inf"),
    low_open: bool = False,
    high_open: bool = True,
    fix: str,
) -> None:
    """Raise unless ``value`` is a real number in the interval (bounds open or closed as given)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok:
        ok = (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    if not ok:
        interval = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
        raise ValueError(f"{name}={value!r} must be a number in {interval}; use {fix}")


def rotary_tables(
    seq_length: int, head_size: int, base: float = 10000.0, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape (T, hs/2) for rotary position embedding."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_size, 2, dtype=torch.float32, device=device) / head_size)
    angles = torch.outer(torch.arange(seq_length, dtype=torch.float32, device=device), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (even, odd) of x (B, nh, T, hs) by position-dependent angles."""
    x1, x2 = x[..., 0::2], x[..., 1::2]  # (B, nh, T, hs/2) each
    rotated = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.head_size = config.hidden_size // config.num_heads
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        B, T, _ = x.shape
        # (B, T, C) -> (B, nh, T, hs); the head count comes from the projection's width
        q = self.query(x).view(B, T, -1, self.head_size).transpose(1, 2)
        k = self.key(x).view(B, T, -1, self.head_size).transpose(1, 2)
        v = self.value(x).view(B, T, -1, self.head_size).transpose(1, 2)
        if rotary is not None:
            cos, sin = rotary[0][:T], rotary[1][:T]
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, C)
        return self.dropout(self.proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc_in = nn.Linear(config.hidden_size, config.ffn_hidden_size)
        self.gelu = nn.GELU()
        self.fc_out = nn.Linear(config.ffn_hidden_size, config.hidden_size)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.fc_out(self.gelu(self.fc_in(x))))  # (B, T, C)


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_attn = nn.LayerNorm(config.hidden_size)
        self.attn = CausalSelfAttention(config)
        self.ln_mlp = nn.LayerNorm(config.hidden_size)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_attn(x), rotary)
        return x + self.mlp(self.ln_mlp(x))


class GPT(nn.Module):
    """Token ids (B, T) -> logits (B, T, V)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.token_embedding = nn.Embedding(config.vocab_size, config.hidden_size)
        if config.position_embedding == "learned":
            self.position_embedding = nn.Embedding(config.seq_length, config.hidden_size)
        else:
            # on the CPU even under a meta-device context: a table cannot be recomputed from nothing
            cos, sin = rotary_tables(config.seq_length, config.hidden_size // config.num_heads, device="cpu")
            self.register_buffer("rotary_cos", cos, persistent=False)
            self.register_buffer("rotary_sin", sin, persistent=False)
        self.dropout = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.ln_final = nn.LayerNorm(config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.token_embedding.weight
        self.init_seed = config.init_seed if config.init_seed is not None else torch.initial_seed()
        self._init_plan = self._plan_init()
        if not is_on_meta(self):  # on the meta device (configure_model under ptdp) each rank fills its shards
            initialize(self)

    def _plan_init(self) -> dict[str, Init]:
        """Normal(0, init_std) weights, zero biases, unit norms; output projections get
        std / sqrt(2 * num_layers) as in GPT-2, so the residual stream does not grow with depth."""
        std, plan = self.config.init_std, {}
        for name, module in self.named_modules():
            prefix = f"{name}." if name else ""
            if isinstance(module, (nn.Linear, nn.Embedding)):
                is_output_projection = name.endswith(("attn.proj", "mlp.fc_out"))
                scale = 1.0 / math.sqrt(2 * self.config.num_layers) if is_output_projection else 1.0
                plan.setdefault(f"{prefix}weight", Normal(std * scale))
                if getattr(module, "bias", None) is not None:
                    plan[f"{prefix}bias"] = Constant(0.0)
            elif isinstance(module, nn.LayerNorm):
                plan[f"{prefix}weight"], plan[f"{prefix}bias"] = Constant(1.0), Constant(0.0)
        return plan

    def init_rule(self, name: str) -> Init:
        """How parameter ``name`` starts (lightning_ptdp.parallel.init: equal values on every layout)."""
        return self._init_plan[name]

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        if T > self.config.seq_length:
            raise ValueError(f"sequence of length {T} is longer than GPTConfig.seq_length={self.config.seq_length}")
        x = self.token_embedding(idx)  # (B, T, C)
        rotary = None
        if self.config.position_embedding == "learned":
            x = x + self.position_embedding(torch.arange(T, device=idx.device))
        else:
            rotary = (self.rotary_cos, self.rotary_sin)
        x = self.dropout(x)
        for block in self.blocks:
            x = block(x, rotary)
        return self.lm_head(self.ln_final(x))  # (B, T, V)


def cosine_with_warmup(step: int, *, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    """LR multiplier: linear warmup to 1, cosine decay to ``min_lr_ratio`` at ``max_steps``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class GPTLightningModule(L.LightningModule):
    """Next-token prediction on batches of (input ids, target ids), each (B, T)."""

    def __init__(
        self, model: GPTConfig | None = None, optim: OptimConfig | None = None, *, deferred_init: bool = False
    ) -> None:
        """``deferred_init``: build the GPT in ``configure_model``, where a strategy may place it on the
        meta device (ptdp then materialises only each rank's shards: models too big for one rank)."""
        super().__init__()
        self.model_config = model or GPTConfig()
        self.optim_config = optim or OptimConfig()
        self.save_hyperparameters({"model": asdict(self.model_config), "optim": asdict(self.optim_config)})
        self.gpt = None if deferred_init else GPT(self.model_config)
        self.val_nll = torchmetrics.MeanMetric()

    def configure_model(self) -> None:
        if self.gpt is None:
            self.gpt = GPT(self.model_config)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.gpt(idx)

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        inputs, targets = batch
        logits = self(inputs)  # (B, T, V)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        loss = self.loss(batch)
        self.val_nll.update(loss, weight=batch[1].numel())
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("test_loss", self.loss(batch), sync_dist=True)

    def predict_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """Greedy next-token ids (B, T) for each position of the inputs."""
        return self(batch[0]).argmax(dim=-1)

    def on_validation_epoch_end(self) -> None:
        self.log("val_perplexity", torch.exp(self.val_nll.compute()), prog_bar=True)
        self.val_nll.reset()

    def configure_optimizers(self):
        cfg = self.optim_config
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr,
            betas=cfg.betas,
        )
        multiplier = partial(
            cosine_with_warmup, warmup_steps=cfg.warmup_steps, max_steps=cfg.max_steps, min_lr_ratio=cfg.min_lr_ratio
        )
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
