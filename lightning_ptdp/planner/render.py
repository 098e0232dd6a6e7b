"""A layout as Trainer arguments, CLI flags and hydra overrides; the ranked table; one layout's breakdown."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_ptdp.planner.cost import GB, Cluster
from lightning_ptdp.planner.estimate import Layout


@dataclass(frozen=True, kw_only=True)
class LayoutArguments:
    """A layout as arguments: strategy, Trainer, and the per-rank dataloader batch size."""

    strategy: dict
    trainer: dict
    per_rank_batch_size: int

    def python(self) -> str:
        strategy = ", ".join(f"{k}={v!r}" for k, v in self.strategy.items())
        trainer = "".join(f", {k}={v!r}" for k, v in self.trainer.items())
        return (
            f"Trainer(strategy=PTDPStrategy({strategy}){trainer})  "
            f"# dataloader batch size per rank: {self.per_rank_batch_size}"
        )

    def cli_flags(self) -> list[str]:
        return self._assignments("--trainer.strategy.", "--trainer.", "--data.")

    def hydra_overrides(self) -> list[str]:  # "++": conf/trainer has no accumulate_grad_batches
        return [
            f"++{item}" if item.startswith("trainer.accumulate") else item
            for item in self._assignments("parallel.", "trainer.", "data.")
        ]

    def _assignments(self, strategy: str, trainer: str, data: str) -> list[str]:
        pairs = [(strategy + k, v) for k, v in self.strategy.items()]
        pairs += [(trainer + k, v) for k, v in self.trainer.items()]
        spelled = [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in pairs]
        return spelled + [f"{data}batch_size={self.per_rank_batch_size}"]


def layout_arguments(layout: Layout, cluster: Cluster) -> LayoutArguments:
    """The strategy and Trainer arguments that run ``layout`` on ``cluster``.

    With pipelining the strategy splits each rank's batch of ``B/d`` into microbatches of
    ``b``; without it, microbatches are Lightning's gradient accumulation of ``m`` batches of ``b``.
    """
    pipelined = layout.pipeline_parallel_size > 1
    strategy: dict = {
        "tensor_parallel_size": layout.tensor_parallel_size,
        "pipeline_parallel_size": layout.pipeline_parallel_size,
        "data_parallel_size": layout.data_parallel_size,
    }
    optional = {
        "expert_parallel_size": layout.expert_parallel_size > 1,
        "context_parallel_size": layout.context_parallel_size > 1,
        "virtual_pipeline_size": layout.virtual_pipeline_size > 1,
        "micro_batch_size": pipelined,
        "sequence_parallel": layout.sequence_parallel,
        "zero_stage": layout.zero_stage > 0,
        "data_parallel_shard_size": layout.data_parallel_shard_size is not None,
        "activation_checkpointing": layout.activation_checkpointing is not None,
        "pipeline_schedule": pipelined and layout.pipeline_schedule != "interleaved_1f1b",
    }
    strategy.update({name: getattr(layout, name) for name, used in optional.items() if used})
    trainer: dict = {
        "devices": min(cluster.num_gpus, cluster.gpus_per_node),
        "num_nodes": max(1, cluster.num_gpus // cluster.gpus_per_node),
    }
    if not pipelined and layout.num_microbatches > 1:
        trainer["accumulate_grad_batches"] = layout.num_microbatches
    per_rank = layout.global_batch_size // layout.data_parallel_size if pipelined else layout.micro_batch_size
    return LayoutArguments(strategy=strategy, trainer=trainer, per_rank_batch_size=per_rank)


def format_plan(layouts: list[Layout], cluster: Cluster, limit: int = 5) -> str:
    """A text table of the best ``limit`` layouts and the arguments that run the best one."""
    if not layouts:
        raise ValueError("format_plan needs at least one layout (plan() raises rather than return none)")
    rows = ["rank    t    p    c    d    e    v    b zero  recompute     m    step s  TFLOP/s/GPU  GB/GPU"]
    for rank, x in enumerate(layouts[:limit], start=1):
        degrees = (
            rank,
            x.tensor_parallel_size,
            x.pipeline_parallel_size,
            x.context_parallel_size,
            x.data_parallel_size,
            x.expert_parallel_size,
            x.virtual_pipeline_size,
            x.micro_batch_size,
            x.zero_stage,
        )
        rows.append(
            "".join(f"{n:>4} " for n in degrees) + f" {x.activation_checkpointing!s:<9} "
            f"{x.num_microbatches:>5} {x.step_time_s:>9.3g} {x.tflops_per_gpu:>12.1f} "
            f"{x.memory_bytes_per_gpu / GB:>7.1f}"
        )
    args = layout_arguments(layouts[0], cluster)
    return "\n".join(
        rows
        + [
            "",
            f"best: {layouts[0].reason}",
            "",
            args.python(),
            "",
            " ".join(args.cli_flags()),
            "",
            " ".join(args.hydra_overrides()),
        ]
    )


def format_layout(x: Layout, cluster: Cluster) -> str:
    """One layout: its degrees, TFLOP/s per GPU, step time and where the time goes."""
    parts = [
        ("compute", x.compute_s),
        ("TP collectives", x.tensor_parallel_comm_s),
        ("EP all-to-alls", x.expert_parallel_comm_s),
        ("CP key/value exchanges", x.context_parallel_comm_s),
        ("pipeline P2P + embedding", x.pipeline_comm_s),
        ("pipeline bubble", x.bubble_s),
        ("DP gradients", x.data_parallel_comm_s),
        ("optimizer", x.optimizer_s),
    ]
    lines = [
        (
            f"t={x.tensor_parallel_size} p={x.pipeline_parallel_size} "
            f"{f'c={x.context_parallel_size} ' if x.context_parallel_size > 1 else ''}d={x.data_parallel_size} "
            f"e={x.expert_parallel_size} v={x.virtual_pipeline_size} b={x.micro_batch_size} m={x.num_microbatches} "
            f"recompute={x.activation_checkpointing} schedule={x.pipeline_schedule} on {cluster.num_gpus} GPUs"
        ),
        (
            f"estimated {x.tflops_per_gpu:.1f} TFLOP/s per GPU, step {x.step_time_s:.3f} s, "
            f"{x.memory_bytes_per_gpu / GB:.1f} GB per GPU"
        ),
    ]
    lines += [f"  {name:<26}{seconds:>10.3f} s  {seconds / x.step_time_s:>6.1%}" for name, seconds in parts]
    args = layout_arguments(x, cluster)
    return "\n".join(lines + ["", args.python()])
