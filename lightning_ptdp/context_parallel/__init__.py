"""Context parallelism (CP): each sequence split over c ranks, attention gathering keys and values."""

from lightning_ptdp.context_parallel.apply import apply_context_parallel
from lightning_ptdp.context_parallel.layout import CPGroup, check_sequence_length
from lightning_ptdp.context_parallel.tail import SequenceShard

__all__ = ["CPGroup", "SequenceShard", "apply_context_parallel", "check_sequence_length"]
