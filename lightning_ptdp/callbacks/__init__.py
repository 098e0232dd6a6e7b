"""Lightning callbacks for PTD-P training: throughput/MFU and straggler detection."""

from lightning_ptdp.callbacks.straggler import StragglerDetector, StragglerWarning, find_stragglers
from lightning_ptdp.callbacks.throughput import PTDPThroughput

__all__ = ["PTDPThroughput", "StragglerDetector", "StragglerWarning", "find_stragglers"]
