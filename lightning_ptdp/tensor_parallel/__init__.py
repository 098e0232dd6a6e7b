"""Tensor (and sequence) parallelism by automatic, structural module rewrite."""

from lightning_ptdp.tensor_parallel.apply import (
    TPReport,
    apply_explicit_plan,
    apply_tensor_parallel,
    tensor_parallel_plan,
)
from lightning_ptdp.tensor_parallel.collectives import TPGroup
from lightning_ptdp.tensor_parallel.discovery import TPDiscoveryError
from lightning_ptdp.tensor_parallel.logits import VocabParallelLogits
from lightning_ptdp.tensor_parallel.whole_regions import PartialSplitWarning

__all__ = [
    "PartialSplitWarning",
    "TPGroup",
    "TPReport",
    "TPDiscoveryError",
    "VocabParallelLogits",
    "apply_explicit_plan",
    "apply_tensor_parallel",
    "tensor_parallel_plan",
]
