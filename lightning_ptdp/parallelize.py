"""The ordered entry point that turns an ordinary model into its PTD-P shard on this rank.

The order is fixed, each step its own function:
  1. tensor parallel  rewrite Linear/Embedding weights into per-rank shards before the
                      pipeline split moves modules between stages.
  2. kernels          route attention and Linear->GeLU to Triton after TP, so each rank's kernel
                      sees its own heads and bias shard (DESIGN.md had kernels first).
  3. pipeline split   cut the (sharded) model into p*v chunks.
  4. recompute        wrap whole blocks after TP, so a recomputed forward replays TP collectives.
  5. data parallel    last: it wraps the final per-rank parameters (ZeRO shards them over dp).
"""

from __future__ import annotations

import logging

import torch
from torch.distributed.device_mesh import DeviceMesh

from lightning_ptdp.config import ParallelConfig
from lightning_ptdp.kernels import apply_kernels
from lightning_ptdp.mesh import ParallelDims
from lightning_ptdp.sharding import apply_data_parallel

log = logging.getLogger(__name__)

_NOT_YET = "is not implemented yet in lightning-ptdp {version}; {fix}"


def check_implemented(config: ParallelConfig) -> None:
    """Raise NotImplementedError for a valid setting whose implementation has not landed yet."""
    from lightning_ptdp import __version__

    pending = {
        "tensor_parallel_size": (config.tensor_parallel_size > 1, "use tensor_parallel_size=1"),
        "pipeline_parallel_size": (config.pipeline_parallel_size > 1, "use pipeline_parallel_size=1"),
        "micro_batch_size": (config.micro_batch_size is not None, "leave micro_batch_size=None"),
        "zero_stage": (config.zero_stage != 0, "use zero_stage=0"),
        "activation_checkpointing": (config.activation_checkpointing is not None, "leave it None"),
    }
    for name, (requested, fix) in pending.items():
        if requested:
            value = getattr(config, name)
            raise NotImplementedError(f"{name}={value!r} " + _NOT_YET.format(version=__version__, fix=fix))


def parallelize(
    module: torch.nn.Module, *, config: ParallelConfig, dims: ParallelDims, mesh: DeviceMesh
) -> torch.nn.Module:
    """Apply steps 1-5 above and return the module Lightning should train on this rank."""
    check_implemented(config)
    log.info("parallelize: (pp=%d, dp=%d, tp=%d), zero_stage=%d", dims.pp, dims.dp, dims.tp, config.zero_stage)
    report = apply_kernels(module, config.kernels)
    log.info("kernels: %s", report.summary())
    return apply_data_parallel(module, mesh["dp"])
