"""Parallel degrees -> one named ``DeviceMesh`` with axes (pp, dp, tp), or (pp, dp, cp, tp).

Rank order is Megatron's: tp varies fastest, then cp, then dp, then pp. With devices filled node by
node, the ranks of one TP group are neighbours on a node (NVLink), the pipeline axis spans nodes.
The mesh is returned to the caller and never stored in a module global.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_ptdp.config import ParallelConfig, check_positive_int
from lightning_ptdp.core.shutdown import take_down_groups_at_exit

MESH_DIM_NAMES: tuple[str, ...] = ("pp", "dp", "tp")
CP_MESH_DIM_NAMES: tuple[str, ...] = ("pp", "dp", "cp", "tp")
EXPERT_MESH_DIM_NAMES: tuple[str, ...] = ("pp", "edp", "ep", "tp")


def _factor_suggestions(world_size: int, limit: int = 6) -> str:
    """A few (t, p, d) triples whose product is ``world_size``, smallest t*p first."""
    triples = [
        (t, p, world_size // (t * p))
        for t in range(1, world_size + 1)
        for p in range(1, world_size + 1)
        if world_size % (t * p) == 0
    ]
    triples.sort(key=lambda tpd: (tpd[0] * tpd[1], tpd[0]))
    return ", ".join(f"(t={t}, p={p}, d={d})" for t, p, d in triples[:limit])


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """Resolved degrees; ``pp * dp * cp * tp == world_size`` holds by construction."""

    pp: int
    """Pipeline-parallel degree p."""
    dp: int
    """Data-parallel degree d."""
    tp: int
    """Tensor-parallel degree t."""
    world_size: int
    """Number of processes (devices x nodes)."""
    ep: int = 1
    """Expert-parallel degree e: consecutive dp ranks that split the experts (e divides d)."""
    cp: int = 1
    """Context-parallel degree c: ranks that split each sequence (between tp and dp in rank order)."""
    shard: Optional[int] = None
    """HSDP: ZeRO 2-3 shards within groups of this many consecutive replicas (d x c), replicating
    across groups; None: over all of them."""

    def __post_init__(self) -> None:
        for name in ("pp", "dp", "tp", "world_size", "ep", "cp"):
            check_positive_int(name, getattr(self, name))
        replicas = self.dp * self.cp
        if replicas % self.ep:
            fits = ", ".join(str(e) for e in range(1, replicas + 1) if replicas % e == 0)
            what = f"data_parallel_size={self.dp}" if self.cp == 1 else f"data x context parallel size {replicas}"
            raise ValueError(
                f"expert_parallel_size={self.ep} does not divide {what}: the expert-parallel ranks are carved out "
                f"of the ranks holding the same parameters. Choose expert_parallel_size in {fits}"
            )
        if self.shard is not None and replicas % self.shard:
            fits = ", ".join(str(s) for s in range(1, replicas + 1) if replicas % s == 0)
            what = f"data_parallel_size={self.dp}" if self.cp == 1 else f"data x context parallel size {replicas}"
            raise ValueError(
                f"data_parallel_shard_size={self.shard} does not divide {what}: HSDP shards within equal groups of "
                f"the ranks holding the same parameters. Choose data_parallel_shard_size in {fits}"
            )
        if self.pp * self.dp * self.tp * self.cp != self.world_size:
            cp, rest = (f" * context_parallel_size({self.cp})", "*c") if self.cp > 1 else ("", "")
            fits = self.world_size // self.cp if self.world_size % self.cp == 0 else self.world_size
            raise ValueError(
                f"tensor_parallel_size({self.tp}) * pipeline_parallel_size({self.pp}) * "
                f"data_parallel_size({self.dp}){cp} = {self.pp * self.dp * self.tp * self.cp}, but the world size "
                f"is {self.world_size}; t*p*d{rest} must equal the world size. Sizes that fit {fits} "
                f"processes: {_factor_suggestions(fits)}; or set data_parallel_size='auto'"
            )

    @classmethod
    def from_config(cls, config: ParallelConfig, world_size: int) -> "ParallelDims":
        """Fill in ``data_parallel_size="auto"`` from the world size and validate the product."""
        check_positive_int("world_size", world_size)
        tp, pp, cp = config.tensor_parallel_size, config.pipeline_parallel_size, config.context_parallel_size
        dp = config.data_parallel_size
        if dp == "auto":
            if world_size % (tp * pp * cp) != 0:
                named = f"tensor_parallel_size({tp}) * pipeline_parallel_size({pp})"
                named += f" * context_parallel_size({cp})" if cp > 1 else ""
                raise ValueError(
                    f"{named} = {tp * pp * cp} does not divide the world size {world_size}, so "
                    f"data_parallel_size='auto' has no integer value. Sizes that fit {world_size} processes: "
                    f"{_factor_suggestions(world_size)}"
                )
            dp = world_size // (tp * pp * cp)
        ep, shard = config.expert_parallel_size, config.data_parallel_shard_size
        return cls(pp=pp, dp=dp, tp=tp, world_size=world_size, ep=ep, cp=cp, shard=shard)

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return (self.pp, self.dp, self.tp) if self.cp == 1 else (self.pp, self.dp, self.cp, self.tp)

    def coordinates(self, rank: int) -> dict[str, int]:
        """The (pp, dp, cp, tp) coordinates of a global rank, without building a mesh."""
        inner = self.tp * self.cp
        return {
            "pp": rank // (self.dp * inner),
            "dp": (rank // inner) % self.dp,
            "cp": (rank // self.tp) % self.cp,
            "tp": rank % self.tp,
        }

    def checkpoint_layout(self, config: ParallelConfig) -> dict[str, int]:
        """The layout a checkpoint records, which loading on another layout compares with its own."""
        return dict(
            t=self.tp,
            p=self.pp,
            d=self.dp,
            v=config.virtual_pipeline_size,
            zero=config.zero_stage,
            e=self.ep,
            c=self.cp,
            world_size=self.world_size,
        )

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """Create the (pp, dp, tp) mesh, or (pp, dp, cp, tp) when c > 1 (a collective: every rank calls it)."""
        names = MESH_DIM_NAMES if self.cp == 1 else CP_MESH_DIM_NAMES
        device_type = "cpu" if device_type == "meta" else device_type  # a dry run's ranks (planner/meta_run.py)
        return init_device_mesh(device_type, self.mesh_shape, mesh_dim_names=names)

    def replica_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """The ranks holding the same parameters, over which gradients average and ZeRO shards: dp,
        or dp x cp flattened (Megatron folds cp into the data-parallel gradient group)."""
        if self.cp == 1:
            return mesh["dp"]
        return mesh["dp", "cp"]._flatten("dp_cp")  # torchtitan flattens its dp x cp mesh the same way

    def fsdp_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """What ZeRO 2-3 shard over: the replicas, or as HSDP their (dp_replicate, dp_shard) 2-D view,
        groups of ``shard`` consecutive replicas (FSDP2 replicates over dim 0, shards over dim 1)."""
        replicas = self.replica_mesh(mesh)
        if self.shard is None or self.shard == replicas.size():
            return replicas
        groups = (replicas.size() // self.shard, self.shard)
        return replicas._unflatten(0, groups, ("dp_replicate", "dp_shard"))  # as torchtitan splits its dp

    def build_expert_mesh(self, device_type: str) -> DeviceMesh:
        """The same ranks as (pp, edp, ep, tp), dp = edp x ep with ep the faster: an expert group is e
        consecutive dp ranks (Megatron's order; within a node when t x e fits one), and edp links
        the d / e ranks that hold the same experts (a collective over the world). With context
        parallelism the experts are carved out of the d x c ranks (cp faster), as Megatron's are."""
        ranks = torch.arange(self.world_size).reshape(self.expert_mesh_shape)
        device_type = "cpu" if device_type == "meta" else device_type
        return DeviceMesh(device_type, ranks, mesh_dim_names=EXPERT_MESH_DIM_NAMES)

    @property
    def expert_mesh_shape(self) -> tuple[int, ...]:
        return (self.pp, self.dp * self.cp // self.ep, self.ep, self.tp)

    def group_ranks(self, axis: str) -> list[list[int]]:
        """Every group of ``axis`` (pp, dp, cp, tp, ep, or edp: the experts' data-parallel ranks) as global
        ranks, without a process group: the groups build_mesh and build_expert_mesh form (both lay out
        arange(world_size) row-major)."""
        if axis in ("ep", "edp"):
            names, shape = EXPERT_MESH_DIM_NAMES, self.expert_mesh_shape
        else:
            names, shape = (MESH_DIM_NAMES if self.cp == 1 else CP_MESH_DIM_NAMES), self.mesh_shape
        if axis not in CP_MESH_DIM_NAMES + ("ep", "edp"):
            raise ValueError(f"axis={axis!r} is not one of pp, dp, cp, tp, ep, edp")
        if axis not in names:  # cp when c = 1: one rank a group
            return [[rank] for rank in range(self.world_size)]
        grid = torch.arange(self.world_size).reshape(shape).movedim(names.index(axis), -1)
        return grid.reshape(-1, grid.shape[-1]).tolist()


def init_process_group(cluster_environment: Any, backend: str, timeout: Any, device: torch.device) -> None:
    """Lightning's process-group start; the groups are taken down at exit if the default group was
    created here (not a caller's, e.g. a test pool's, which was already initialized)."""
    from lightning.fabric.utilities.distributed import _init_dist_connection

    kwargs: dict[str, Any] = {"timeout": timeout}
    if device.type != "cpu":
        kwargs["device_id"] = device
    created = not torch.distributed.is_initialized()
    _init_dist_connection(cluster_environment, backend, **kwargs)
    if created:
        take_down_groups_at_exit()
