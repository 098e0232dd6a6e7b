"""Data-parallel axis: replication with DDP (ZeRO-0, ddp.py), ZeRO-1's sharded optimizer state
(zero1.py, torch's ZeroRedundancyOptimizer) and ZeRO 2-3 with FSDP2 (zero.py)."""

from lightning_ptdp.data_parallel.ddp import apply_data_parallel
from lightning_ptdp.data_parallel.zero import apply_zero
from lightning_ptdp.data_parallel.zero1 import shard_optimizer_states

__all__ = ["apply_data_parallel", "apply_zero", "shard_optimizer_states"]
