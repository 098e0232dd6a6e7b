"""The planner's rules for a layout's values: each returns or raises the value, the rule and a fix."""

from __future__ import annotations

from lightning_ptdp.planner.models import ModelSize

RECOMPUTE_CHOICES = (None, "selective", "full")


def hsdp_reason(shard: int | None, zero_stage: int, replicas: int, e: int) -> str | None:
    """Why HSDP with groups of ``shard`` replicas does not apply (None when it does, or is off)."""
    if shard is None:
        return None
    if isinstance(shard, bool) or not isinstance(shard, int) or shard < 1 or replicas % shard:
        fits = ", ".join(str(k) for k in range(1, replicas + 1) if replicas % k == 0)
        return (
            f"data_parallel_shard_size={shard!r} must divide the {replicas} data-parallel ranks; choose one of {fits}"
        )
    if zero_stage < 2 or e > 1:
        return (
            f"data_parallel_shard_size={shard} is HSDP, FSDP2's: it needs zero_stage 2 or 3 (got {zero_stage}) "
            f"and expert_parallel_size=1 (got {e}); change those or leave it unset"
        )
    return None


def expert_parallel_reason(model: ModelSize, d: int, e: int) -> str | None:
    """Why e-way expert parallelism cannot split this model at d data-parallel ranks (None when it can)."""
    if e == 1:
        return None
    if not model.num_experts:
        return (
            f"expert_parallel_size={e} needs a mixture of experts, but the model is dense (num_experts=None); "
            "use expert_parallel_size=1"
        )
    if model.num_experts % e or d % e:
        fits = [k for k in range(1, d + 1) if d % k == 0 and model.num_experts % k == 0]
        return (
            f"expert_parallel_size={e} must divide num_experts={model.num_experts} and the data-parallel size "
            f"d={d} (each rank holds whole experts; expert ranks are carved out of the dp ones); choose one of "
            f"{', '.join(map(str, fits))}"
        )
    return None


def context_parallel_reason(model: ModelSize, c: int, e: int = 1) -> str | None:
    """Why c-way context parallelism cannot split this model's sequences (None when it can)."""
    if c > 1 and e > 1:
        return (
            f"context_parallel_size={c} with expert_parallel_size={e}: the planner does not model the two together "
            "yet (ptdp runs them: the experts are carved out of the d x c ranks); estimate one of the two"
        )
    if model.seq_length % (2 * c):
        fits = [k for k in range(1, 65) if model.seq_length % (2 * k) == 0]
        return (
            f"context_parallel_size={c}: seq_length={model.seq_length} is not divisible by 2c = {2 * c} (each rank "
            f"holds two of 2c equal chunks); choose c in {fits[:8]}"
        )
    return None


def check_options(recompute: object, sequence_parallel: object, zero_stage: object, memory_fraction: object) -> None:
    if recompute not in RECOMPUTE_CHOICES:
        raise ValueError(f"activation_checkpointing={recompute!r} is not one of {RECOMPUTE_CHOICES}; choose one")
    if isinstance(zero_stage, bool) or zero_stage not in (0, 1, 2, 3) or not isinstance(sequence_parallel, bool):
        raise ValueError(
            f"zero_stage must be 0, 1, 2 or 3 and sequence_parallel True or False, "
            f"got zero_stage={zero_stage!r}, sequence_parallel={sequence_parallel!r}"
        )
    if (
        isinstance(memory_fraction, bool)
        or not isinstance(memory_fraction, (int, float))
        or not 0 < memory_fraction <= 1
    ):
        raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction!r}")


def check_imbalance(value: object) -> None:
    """``expert_imbalance`` is a number >= 1: the busiest rank's rows over the mean."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 1.0:
        raise ValueError(
            f"expert_imbalance={value!r} must be a number >= 1.0: the busiest expert-parallel rank's routed rows "
            "over the mean (ExpertLoad logs it as moe/rank_imbalance); use 1.0 for balanced routing"
        )
