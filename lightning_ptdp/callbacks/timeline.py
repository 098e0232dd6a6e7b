"""PipelineTimeline: the measured schedule of one training step, as a picture and a trace; under e > 1
also the step's all-to-all traffic between ep ranks as a heatmap, ``<name>_traffic.png``.

Every rank's pipeline engine records when each microbatch's forward (F), backward (B), or under
zero-bubble input-backward (I) and weight-backward (W) ran. For the chosen step rank 0 gathers the
spans and writes ``<name>.png`` (one row per pipeline rank of dp replica 0, tp rank 0; the title, also
the PNG's tEXt "Title", gives the measured bubble: idle / busy, mean over pipeline ranks, what the
paper's (p-1)/m estimates) and ``<name>.json`` (a Chrome trace of every rank).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any, Optional, Union

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_ptdp.callbacks.experts import traffic_matrices
from lightning_ptdp.callbacks.png import Canvas

_COMM = (150, 80, 190)  # data-parallel gradient buckets, a strip under the compute
_EXCHANGE = (20, 150, 160)  # expert parallelism's all-to-all token exchanges (forward), a strip above it
_COLORS = {
    "F": [(66, 110, 200), (120, 160, 235)],
    "B": [(60, 160, 90), (130, 205, 150)],
    "I": [(60, 160, 90), (130, 205, 150)],
    "W": [(230, 150, 60), (245, 190, 120)],
}
_WIDTH, _LEFT, _TOP, _ROW = 1400, 80, 44, 34


class PipelineTimeline(pl.Callback):
    """Write the measured pipeline schedule of training batch ``step`` (0 = the first) to ``dirpath``."""

    def __init__(
        self, *, step: int = 2, dirpath: Union[str, Path] = "pipeline_timeline", name: Optional[str] = None
    ) -> None:
        if step < 0:
            raise ValueError(f"PipelineTimeline(step={step}) must be >= 0 (the index of a training batch)")
        self.step, self.dirpath, self.name = step, Path(dirpath), name
        self.bubble: Optional[float] = None
        """The measured bubble (idle / busy, mean over pipeline ranks) once the step was recorded."""
        self.paths: list[Path] = []
        self._seen = 0

    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        index, self._seen = self._seen, self._seen + 1
        if index != self.step:
            return
        strategy = trainer.strategy
        experts = getattr(strategy, "expert_report", None)
        traffic = traffic_matrices(trainer, experts.stats, pl_module.device) if experts is not None else {}
        if trainer.is_global_zero and traffic:
            self.dirpath.mkdir(parents=True, exist_ok=True)
            path = self.dirpath / f"{self.name or f'pipeline_step{self.step}'}_traffic.png"
            path.write_bytes(draw_traffic(sum(traffic.values()), f"step {self.step}: all-to-all bytes, sender row"))
            self.paths.append(path)
        engine = getattr(strategy, "pipeline", None)
        if engine is None or engine.timeline is None:
            if not traffic:
                rank_zero_warn(
                    "PipelineTimeline records pipeline schedules (pipeline_parallel_size > 1) and expert traffic "
                    "(expert_parallel_size > 1): this run has neither"
                )
            return
        coords = strategy.parallel_dims.coordinates(trainer.global_rank)
        timeline = engine.timeline
        experts = getattr(strategy, "expert_report", None)
        exchanges = [("A", -1, -1, start, end) for start, end in experts.stats.spans] if experts else []
        mine = {
            "rank": trainer.global_rank,
            **coords,
            "start": timeline.start + timeline.wall_offset,
            "end": timeline.end + timeline.wall_offset,
            "busy": timeline.busy,
            "spans": [
                (s.kind, s.stage, s.microbatch, s.start + timeline.wall_offset, s.end + timeline.wall_offset)
                for s in timeline.spans
            ],
            "comm": [
                (s.kind, s.stage, s.microbatch, s.start + timeline.wall_offset, s.end + timeline.wall_offset)
                for s in timeline.comm
            ]
            + [
                (kind, stage, mb, start + timeline.wall_offset, end + timeline.wall_offset)
                for kind, stage, mb, start, end in exchanges
            ],
            "exposed_comm": timeline.exposed_comm,
        }
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        rows = sorted((r for r in everyone if r["dp"] == 0 and r["tp"] == 0), key=lambda r: r["pp"])
        self.bubble = statistics.mean((r["end"] - r["start"] - r["busy"]) / r["busy"] for r in rows if r["busy"] > 0)
        config = strategy.parallel_config
        microbatches = max((s[2] for r in rows for s in r["spans"]), default=-1) + 1
        title = (
            f"step {self.step}: bubble {self.bubble:.1%} (idle/busy), p={len(rows)} v={config.virtual_pipeline_size} "
            f"m={microbatches} {config.pipeline_schedule}"
        )
        if trainer.is_global_zero:
            self.dirpath.mkdir(parents=True, exist_ok=True)
            stem = self.name or f"pipeline_step{self.step}"
            png, trace = self.dirpath / f"{stem}.png", self.dirpath / f"{stem}.json"
            png.write_bytes(draw(rows, title))
            trace.write_text(json.dumps(chrome_trace(everyone, title)))
            self.paths += [png, trace]


# Not matplotlib: the built-in writer (png.py) draws exact span colours that tests read back pixel by pixel,
# and needs nothing on GPU images or cluster nodes; the Chrome trace beside it is the interactive view.
def draw(rows: list[dict], title: str) -> bytes:
    """PNG bytes: one row per pipeline rank; F blue, B green, W orange, later chunks lighter."""
    t0 = min(r["start"] for r in rows)
    span = max(r["end"] for r in rows) - t0 or 1.0
    scale = (_WIDTH - _LEFT - 10) / span
    canvas = Canvas(_WIDTH, _TOP + _ROW * len(rows) + 16)
    canvas.text(8, 10, title, scale=2)
    for row, record in enumerate(rows):
        y = _TOP + row * _ROW
        canvas.text(8, y + 10, f"rank {record['pp']}", scale=2)
        canvas.rect(
            _LEFT + int((record["start"] - t0) * scale),
            y + 4,
            _LEFT + int((record["end"] - t0) * scale),
            y + _ROW - 4,
            (235, 235, 235),
        )
        stages = sorted({s[1] for s in record["spans"]})
        for kind, stage, microbatch, start, end in record["spans"]:
            shade = _COLORS[kind][min(stages.index(stage), 1)]
            x0, x1 = (
                _LEFT + int((start - t0) * scale),
                _LEFT + max(int((end - t0) * scale), int((start - t0) * scale) + 1),
            )
            canvas.rect(x0, y + 4, x1, y + _ROW - 4, shade)
            label = f"{kind}{microbatch}"
            if x1 - x0 >= 4 * 2 * len(label) + 4:
                canvas.text(x0 + 3, y + 12, label, color=(255, 255, 255), scale=2)
        for kind, _, _, start, end in record.get("comm", []):
            x0, x1 = (
                _LEFT + int((start - t0) * scale),
                _LEFT + max(int((end - t0) * scale), int((start - t0) * scale) + 1),
            )
            top = y + 4 if kind == "A" else y + _ROW - 7  # exchanges above, dp buckets below
            color = _EXCHANGE if kind == "A" else _COMM
            canvas.rect(min(x0, _WIDTH - 2), top, min(x1, _WIDTH - 1), top + 3, color)  # past the step: cut
    canvas.text(
        _LEFT,
        _TOP + _ROW * len(rows) + 4,
        "F forward  B backward (I input, W weight)  lighter: later chunk  grey: idle  purple strip: dp gradients"
        "  teal strip: expert all-to-all",
        scale=1,
    )
    return canvas.png(title)


_CELL = 56


def draw_traffic(matrix, title: str) -> bytes:
    """PNG bytes: one cell per (sender row, receiver column) of ep ranks, white (none) to dark red
    (the busiest link), each cell's MiB written in it."""
    size = matrix.shape[0]
    top = max(float(matrix.max()), 1.0)
    heading = f"{title}, busiest link {top / 2**20:.2f} MiB"
    canvas = Canvas(max(_LEFT + _CELL * size + 10, 12 * len(heading) + 16), _TOP + _CELL * size + 24)
    canvas.text(8, 10, heading, scale=2)
    for i in range(size):
        canvas.text(8, _TOP + i * _CELL + _CELL // 2 - 4, f"ep {i}", scale=2)
        canvas.text(_LEFT + i * _CELL + 8, _TOP + _CELL * size + 6, f"ep {i}", scale=2)
        for j in range(size):
            share = float(matrix[i, j]) / top
            color = (255 - int(95 * share), 255 - int(225 * share), 255 - int(225 * share))
            x, y = _LEFT + j * _CELL, _TOP + i * _CELL
            canvas.rect(x + 1, y + 1, x + _CELL - 1, y + _CELL - 1, color)
            canvas.text(x + 4, y + _CELL // 2 - 3, f"{float(matrix[i, j]) / 2**20:.2f}", scale=1)
    return canvas.png(title)


def idle_spans(record: dict) -> list[tuple[float, float]]:
    """The gaps of the step in which this rank ran no forward or backward."""
    gaps, cursor = [], record["start"]
    for _, _, _, start, end in sorted(record["spans"], key=lambda s: s[3]):
        if start > cursor:
            gaps.append((cursor, start))
        cursor = max(cursor, end)
    if record["end"] > cursor:
        gaps.append((cursor, record["end"]))
    return gaps


def chrome_trace(records: list[dict], title: str) -> dict:
    """Chrome trace events: process = global rank, thread = pipeline stage (chunk)."""
    t0 = min(r["start"] for r in records)
    events: list[dict] = [
        {
            "name": "process_name",
            "ph": "M",
            "pid": r["rank"],
            "args": {"name": f"rank {r['rank']} (pp {r['pp']}, dp {r['dp']}, tp {r['tp']})"},
        }
        for r in records
    ]
    for record in records:
        for kind, stage, microbatch, start, end in record["spans"]:
            events.append(
                {
                    "name": f"{kind}{microbatch}",
                    "cat": kind,
                    "ph": "X",
                    "pid": record["rank"],
                    "tid": stage,
                    "ts": (start - t0) * 1e6,
                    "dur": (end - start) * 1e6,
                    "args": {"microbatch": microbatch, "stage": stage},
                }
            )
        for kind, stage, _, start, end in record.get("comm", []):
            events.append(
                {
                    "name": "all-to-all" if kind == "A" else f"dp grads (chunk {stage})",
                    "cat": "comm",
                    "ph": "X",
                    "pid": record["rank"],
                    "tid": "ep comm" if kind == "A" else "dp comm",
                    "ts": (start - t0) * 1e6,
                    "dur": (end - start) * 1e6,
                }
            )
        for start, end in idle_spans(record):
            events.append(
                {
                    "name": "idle",
                    "cat": "idle",
                    "ph": "X",
                    "pid": record["rank"],
                    "tid": "idle",
                    "ts": (start - t0) * 1e6,
                    "dur": (end - start) * 1e6,
                }
            )
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"title": title}}
