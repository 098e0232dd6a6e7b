"""Lightning's collective hooks of PTDPStrategy on the (pp, dp, tp) world: samplers and logged values
follow the dp group (tp and pp ranks of one replica hold the same data), decisions the world."""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.utilities.distributed import _distributed_is_initialized, _sync_ddp_if_available
from lightning.pytorch.strategies import ParallelStrategy
from typing_extensions import override


class WorldCollectives(ParallelStrategy):
    """Mixed into PTDPStrategy; ``_device_mesh`` is set by its ``setup_environment``."""

    _device_mesh: Any = None
    _dp_group: Optional[tuple[Any, int]] = None

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Replicas are the dp ranks: all tp and pp ranks of one replica read the same samples."""
        dp = self.device_mesh["dp"]  # PTDPStrategy.device_mesh: a clear error before setup_environment
        return {"num_replicas": dp.size(), "rank": dp.get_local_rank()}

    @override
    def reduce(
        self, tensor: Union[torch.Tensor, Any], group: Optional[Any] = None, reduce_op: Optional[Any] = "mean"
    ) -> Union[torch.Tensor, Any]:
        """Reduce a logged value over the dp group (tp/pp ranks of one replica hold the same value).
        Decisions reduce over the world (``reduce_boolean_decision``); ``broadcast`` is from a global rank."""
        if not isinstance(tensor, torch.Tensor):
            return tensor
        if group is None and self._device_mesh is not None:
            if self._dp_group is None:
                dp = self.device_mesh["dp"]  # PTDPStrategy.device_mesh: a clear error before setup_environment
                self._dp_group = (dp.get_group(), dp.size())
            group, members = self._dp_group
            if members == 1:  # any reduction over one replica is the value itself: no barrier, no all-reduce
                return tensor
        return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """One decision for the whole world (not per dp group): ModelCheckpoint's top-k update and
        file names, EarlyStopping's stop; every rank must then join the same save."""
        if not _distributed_is_initialized():
            return decision
        flag = torch.tensor(int(decision), device=self.root_device)
        dist.all_reduce(flag, op=dist.ReduceOp.SUM)
        return bool(flag == self.world_size) if all else bool(flag)

    @override
    def barrier(self, name: Optional[str] = None) -> None:
        if not _distributed_is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]
