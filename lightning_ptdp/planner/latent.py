"""Multi-head latent attention (DeepSeek-V2/V3): the shapes of its projections, for ``ModelSize``.

Queries (through a ``q_lora_rank`` latent, or one projection) and keys/values through a shared
``kv_lora_rank`` latent; each head's query and key are ``qk_nope_head_dim + qk_rope_head_dim`` wide,
its value ``v_head_dim``. The down-projections are whole on every TP rank, the up-projections and the
output split by heads (as Megatron-Core's MLA).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class LatentAttention:
    """A DeepSeek config.json's MLA keys."""

    kv_lora_rank: int
    """Width of the latent the keys and values are projected up from."""
    qk_nope_head_dim: int
    """Per head: the query and key width without rotary positions."""
    qk_rope_head_dim: int
    """Per head: the rotary part of query and key (one rotary key shared by every head)."""
    v_head_dim: int
    """Per head: the value width (what scores x V yields)."""
    q_lora_rank: int | None = None
    """Width of the query latent; None: the queries come from one h x (a * d_qk) projection."""

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "q_lora_rank"):
            value = getattr(self, name)
            if (value is not None or name != "q_lora_rank") and (
                isinstance(value, bool) or not isinstance(value, int) or value <= 0
            ):
                raise ValueError(f"LatentAttention.{name} must be a positive integer, got {value!r}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def linears(self, hidden: int, heads: int, t: int) -> list[tuple[float, float]]:
        """(output width, input width) of each matmul on one of t TP ranks, in the order they run."""
        query = [(self.q_lora_rank, hidden), (heads * self.qk_head_dim / t, self.q_lora_rank)]
        if self.q_lora_rank is None:
            query = [(heads * self.qk_head_dim / t, hidden)]
        key_value = [
            (self.kv_lora_rank + self.qk_rope_head_dim, hidden),
            (heads * (self.qk_nope_head_dim + self.v_head_dim) / t, self.kv_lora_rank),
        ]
        return query + key_value + [(hidden, heads * self.v_head_dim / t)]

    def matrix_parameters(self, hidden: int, heads: int) -> int:
        return int(sum(cols * inner for cols, inner in self.linears(hidden, heads, 1)))

    @property
    def norm_parameters(self) -> int:
        """The RMSNorms on the latents."""
        return self.kv_lora_rank + (self.q_lora_rank or 0)

    @property
    def latent_bytes_per_token(self) -> int:
        """16-bit activation bytes one token keeps of the latents, whole on every TP rank: each latent
        as its norm's input and as the up-projection's input."""
        return 4 * self.norm_parameters
