"""What one pipeline step ran when on this rank: the spans the engine records, read by the
PipelineTimeline callback and the overlap benchmark."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Span:
    """One forward (F), backward (B), input-backward (I) or weight-backward (W) of one microbatch."""

    kind: str
    stage: int
    microbatch: int
    start: float
    end: float


@dataclass
class StepTimeline:
    """This rank's measured schedule for one step: what ran when, between ``start`` and ``end``."""

    rank: int
    start: float
    end: float
    spans: list[Span] = field(default_factory=list)
    wall_offset: float = 0.0
    """time.time() - time.perf_counter() at the start: spans + offset are comparable across hosts."""
    comm: list[Span] = field(default_factory=list)
    """Data-parallel gradient buckets (kind "D"), from start to arrival: beside compute, not in ``busy``."""
    exposed_comm: float = 0.0
    """Seconds this rank waited for those buckets after the schedule: the communication not hidden,
    plus any wait for a dp replica that was still computing (compare the replicas' timelines)."""

    @property
    def busy(self) -> float:
        return sum(s.end - s.start for s in self.spans)

    @property
    def bubble(self) -> float:
        """Time not computing (waiting on other stages or transfers) over time computing: what
        the paper's (p-1)/m estimates."""
        return (self.end - self.start - self.busy) / self.busy if self.busy > 0 else 0.0

    def max_in_flight(self, stage: int) -> int:
        """Most microbatches whose activations ``stage`` held at once (forwarded, not yet backwarded)."""
        live, peak = 0, 0
        for span in sorted((s for s in self.spans if s.stage == stage), key=lambda s: s.start):
            live += 1 if span.kind == "F" else (-1 if span.kind in ("B", "I") else 0)
            peak = max(peak, live)
        return peak
