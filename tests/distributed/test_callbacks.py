"""PTDPThroughput and StragglerDetector in real Trainer runs: 2 gloo ranks, and single process.

Throughput figures are checked against an independent clock (a callback that timestamps the
same hooks) and against the paper's formula written out here, not by calling flops.py again.
"""

from __future__ import annotations

import logging
import time
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml
from lightning.pytorch.loggers import CSVLogger

from lightning_ptdp.callbacks import PTDPThroughput, StragglerDetector, StragglerWarning
from recipes.data import MarkovDataModule
from tests.fit_utils import SEQ, VOCAB, quiet_trainer
from tests.models import build_model

LOCAL_BATCH = 4
EVERY = 3
STEPS = 6
PEAK = 1e12  # a made-up peak, so MFU is checkable on CPU
# The independent clock runs just before the callback in the same hooks, so it reads perf_counter
# microseconds earlier at both ends of a window; windows last tens of milliseconds.
CLOCK_RTOL = 0.05
SLEEP_S = 0.2


def datamodule(steps: int, replicas: int) -> MarkovDataModule:
    return MarkovDataModule(
        vocab_size=VOCAB,
        seq_length=SEQ,
        batch_size=LOCAL_BATCH,
        shuffle=False,
        train_tokens=(steps + 1) * LOCAL_BATCH * replicas * (SEQ + 1),
        val_tokens=4 * (SEQ + 1),
    )


def gpt_flops(batch: int, s: int, l: int, h: int, v: int, recompute: bool) -> float:
    """The paper's Eq. 3 (recompute) or its 72-form (model FLOPs), as closed forms."""
    if recompute:
        return 96 * batch * s * l * h**2 * (1 + s / (6 * h) + v / (16 * l * h))
    return 72 * batch * s * l * h**2 * (1 + s / (6 * h) + v / (12 * l * h))


class WindowClock(L.Callback):
    """perf_counter at every batch end (listed before the callback under test)."""

    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.ends.append(time.perf_counter())


def fit_with_throughput(log_root: str, devices: int, peak_flops, **callback_kwargs) -> dict:
    from lightning_ptdp import PTDPStrategy

    L.seed_everything(0, verbose=False)
    throughput = PTDPThroughput(log_every_n_steps=EVERY, peak_flops=peak_flops, **callback_kwargs)
    clock = WindowClock()
    logger = CSVLogger(log_root, name="throughput", version=0)
    strategy = PTDPStrategy() if devices > 1 else "auto"
    trainer = quiet_trainer(
        devices=devices,
        strategy=strategy,
        max_steps=STEPS,
        callbacks=[clock, throughput],
        logger=logger,
        log_every_n_steps=1,
    )
    trainer.fit(build_model("gpt"), datamodule(STEPS, devices))
    return {
        "metrics": throughput.last_metrics,
        "window": throughput.last_window,
        "formula": throughput.flops_formula,
        "dp": throughput.data_parallel_size,
        "ends": clock.ends,
        "progress_bar": {k: float(v) for k, v in trainer.progress_bar_metrics.items()},
        "log_dir": logger.log_dir,
    }


def check_throughput(result: dict, *, dp: int, devices: int, recompute: bool, peak) -> None:
    window, metrics = result["window"], result["metrics"]
    # the last window: EVERY batches of (LOCAL_BATCH, SEQ) on each of dp replicas
    assert result["dp"] == dp
    assert window["batches"] == EVERY and window["samples"] == EVERY * LOCAL_BATCH * dp
    assert window["tokens"] == EVERY * LOCAL_BATCH * SEQ * dp
    ends = result["ends"]
    assert window["seconds"] == pytest.approx(ends[STEPS - 1] - ends[STEPS - 1 - EVERY], rel=CLOCK_RTOL)
    seconds = window["seconds"]
    assert metrics["tokens_per_sec"] == pytest.approx(window["tokens"] / seconds, rel=1e-12)
    assert metrics["samples_per_sec"] == pytest.approx(window["samples"] / seconds, rel=1e-12)
    flops = gpt_flops(window["samples"], SEQ, l=2, h=32, v=VOCAB, recompute=recompute)
    assert window["flops"] == pytest.approx(flops, rel=1e-12)
    assert metrics["tflops_per_device"] == pytest.approx(flops / seconds / devices / 1e12, rel=1e-12)
    if peak is None:
        assert "mfu" not in metrics
    else:
        assert metrics["mfu"] == pytest.approx(metrics["tflops_per_device"] * 1e12 / peak, rel=1e-12)
    for name, value in metrics.items():
        assert result["progress_bar"][f"throughput/{name}"] == pytest.approx(value, rel=1e-6)


@pytest.mark.world_size(2)
def test_throughput_on_two_ranks_counts_the_global_batch(dist_pool, tmp_path):
    results = dist_pool(2).run(fit_with_throughput, str(tmp_path), 2, PEAK)
    for result in results:
        check_throughput(result, dp=2, devices=2, recompute=False, peak=PEAK)
        assert "72*B*s*l*h^2" in result["formula"] and "l=2, h=32, V=64" in result["formula"]
        assert "x 2 data-parallel replicas" in result["formula"] and "/ 2 devices" in result["formula"]
    # rank 0's CSV holds every metric at the logging steps, and the formula as a hyperparameter
    log_dir = Path(results[0]["log_dir"])
    rows = (log_dir / "metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    for name in ("tokens_per_sec", "samples_per_sec", "tflops_per_device", "mfu"):
        column = header.index(f"throughput/{name}")
        logged = [row.split(",") for row in rows[1:] if row.split(",")[column]]
        assert [int(row[header.index("step")]) for row in logged] == [EVERY, 2 * EVERY]
    hparams = yaml.safe_load((log_dir / "hparams.yaml").read_text())
    assert hparams["throughput/flops_formula"] == results[0]["formula"]


@pytest.mark.world_size(2)
def test_throughput_single_process_without_a_peak_skips_mfu_and_says_so(tmp_path):
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    rank_zero_logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    rank_zero_logger.addHandler(handler)
    try:
        result = fit_with_throughput(str(tmp_path), 1, None)
    finally:
        rank_zero_logger.removeHandler(handler)
    check_throughput(result, dp=1, devices=1, recompute=False, peak=None)
    notes = [message for message in seen if "MFU is not logged" in message]
    assert notes == [
        "PTDPThroughput: MFU is not logged on cpu (no peak known); pass PTDPThroughput(peak_flops=...) "
        "in FLOP/s to log it"
    ]


@pytest.mark.world_size(2)
def test_throughput_with_recompute_uses_the_papers_equation_3(tmp_path):
    result = fit_with_throughput(str(tmp_path), 1, PEAK, activation_recompute=True)
    check_throughput(result, dp=1, devices=1, recompute=True, peak=PEAK)
    assert "96*B*s*l*h^2" in result["formula"] and "Eq. 3" in result["formula"]


class NoConfig(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(SEQ, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0].float()).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.world_size(2)
def test_a_model_without_dimensions_fails_before_training_naming_the_arguments():
    trainer = quiet_trainer(devices=1, max_steps=1, callbacks=[PTDPThroughput()])
    with pytest.raises(
        ValueError,
        match=r"PTDPThroughput needs the model's num_layers, hidden_size, vocab_size .* "
        r"or give NoConfig a `model_config`",
    ):
        trainer.fit(NoConfig(), datamodule(1, 1))


# --------------------------------------------------------------------------- stragglers


class SlowRank(L.Callback):
    """Sleeps on one rank, before the detector's marks see it: at every batch start (a slow data
    loader) or after the model's forward (a slow device). The model's training_step logs with
    sync_dist=True, so the other rank waits for it inside training_step, not only in backward."""

    def __init__(self, rank: int, seconds: float, where: str) -> None:
        self.rank, self.seconds, self.where = rank, seconds, where

    def on_train_start(self, trainer, pl_module) -> None:
        if self.where == "forward" and trainer.global_rank == self.rank:
            # registered before the detector's hooks, so it runs inside the detector's window
            pl_module.gpt.register_forward_hook(lambda *_: time.sleep(self.seconds) if pl_module.training else None)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.where == "batch" and trainer.global_rank == self.rank:
            time.sleep(self.seconds)


def fit_with_a_slow_rank(slow_rank: int, where: str) -> dict:
    from lightning_ptdp import PTDPStrategy

    L.seed_everything(0, verbose=False)
    detector = StragglerDetector(every_n_steps=EVERY)
    trainer = quiet_trainer(
        devices=2, strategy=PTDPStrategy(), max_steps=STEPS, callbacks=[SlowRank(slow_rank, SLEEP_S, where), detector]
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(build_model("gpt"), datamodule(STEPS, 2))
    return {
        "messages": [str(w.message) for w in caught if issubclass(w.category, StragglerWarning)],
        "seconds": detector.last_seconds_per_step,
        "stragglers": [s.rank for s in detector.last_stragglers],
        "hosts": detector.hostnames,
    }


@pytest.mark.parametrize("where", ["batch", "forward"])
@pytest.mark.world_size(2)
def test_the_slow_rank_is_named_and_the_waiting_rank_is_not(dist_pool, where):
    results = dist_pool(2).run(fit_with_a_slow_rank, 1, where)
    for result in results:
        assert result["stragglers"] == [1]
        slow, fast = result["seconds"][1], result["seconds"][0]
        assert slow >= SLEEP_S
        # rank 0 waits for rank 1 in every collective, but waiting is not its own work
        assert fast < SLEEP_S / 2
    warned, silent = results[0]["messages"], results[1]["messages"]
    assert silent == []  # only rank 0 warns
    assert len(warned) == STEPS // EVERY
    host = results[0]["hosts"][1]
    assert warned[-1].startswith(f"straggler: rank 1 (host {host}) spent ")
    assert f"over the last {EVERY} steps" in warned[-1] and "seconds per step by rank: 0: " in warned[-1]


def fit_with_timeline(dirpath: str) -> dict:
    """p=2, v=2, m=4 interleaved 1F1B; the timeline of the second training step."""
    import json as _json

    from lightning_ptdp import PTDPStrategy
    from lightning_ptdp.callbacks import PipelineTimeline
    from lightning_ptdp.callbacks.png import read_png
    from tests.fit_utils import zoo_data

    L.seed_everything(0, verbose=False)
    callback = PipelineTimeline(step=1, dirpath=dirpath)
    strategy = PTDPStrategy(pipeline_parallel_size=2, virtual_pipeline_size=2, micro_batch_size=1)
    trainer = quiet_trainer(devices=2, strategy=strategy, max_steps=3, callbacks=[callback])
    trainer.fit(build_model("gpt", num_layers=4), zoo_data(4, 4 * 4 * (SEQ + 1), SEQ + 1))
    result = {"bubble": callback.bubble, "paths": [str(p) for p in callback.paths]}
    if trainer.is_global_zero:
        width, height, texts, rows = read_png(Path(dirpath, "pipeline_step1.png").read_bytes())
        result.update(width=width, height=height, title=texts.get("Title"), rows=rows)
        result["trace"] = _json.loads(Path(dirpath, "pipeline_step1.json").read_text())
    return result


@pytest.mark.world_size(2)
def test_pipeline_timeline_draws_the_measured_schedule(dist_pool, tmp_path):
    from lightning_ptdp.callbacks.timeline import _COLORS, _ROW, _TOP

    results = dist_pool(2).run(fit_with_timeline, str(tmp_path))
    assert results[0]["bubble"] == results[1]["bubble"] > 0.0  # tiny CPU model: overhead-dominated, can exceed 1
    first = results[0]
    assert first["title"] == f"step 1: bubble {first['bubble']:.1%} (idle/busy), p=2 v=2 m=4 interleaved_1f1b"
    assert first["height"] == _TOP + 2 * _ROW + 16
    for pp in range(2):  # each rank's row shows forwards and backwards of both its chunks
        row = first["rows"][_TOP + pp * _ROW + _ROW // 2]
        pixels = {tuple(row[i : i + 3]) for i in range(0, len(row), 3)}
        assert {*_COLORS["F"], *_COLORS["B"]} <= pixels, f"rank {pp}'s row misses a kind of span"
    events = [e for e in first["trace"]["traceEvents"] if e["ph"] == "X"]
    for rank, stages in ((0, {0, 2}), (1, {1, 3})):
        mine = [e for e in events if e["pid"] == rank]
        assert {e["tid"] for e in mine if e["cat"] != "idle"} == stages
        # 4 microbatches x 2 chunks, each one forward and one backward, none overlapping
        assert sorted(e["name"] for e in mine if e["cat"] == "F") == sorted(f"F{m}" for m in range(4) for _ in range(2))
        assert sum(e["cat"] == "B" for e in mine) == 8
        spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in mine)
        assert all(a[1] <= b[0] + 1e-3 for a, b in zip(spans, spans[1:]))  # compute and idle never overlap
        assert any(e["cat"] == "idle" for e in mine)


def fit_with_consistency(
    strategy_kwargs: dict, corrupt: str | None, corrupt_rank: int, family: str = "nanogpt"
) -> dict:
    """Train 4 steps with the check every 2 steps; optionally nudge one parameter's last bit on
    one rank after step 3, as a missed all-reduce or a flaky host would."""
    from lightning_ptdp import PTDPStrategy
    from lightning_ptdp.callbacks import ReplicaConsistency, ReplicaDivergence
    from tests.fit_utils import zoo_data

    class Corrupt(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if corrupt and trainer.global_step == 3 and trainer.global_rank == corrupt_rank:
                param = dict(pl_module.named_parameters())[corrupt]
                with torch.no_grad():
                    flat = param.view(-1)
                    flat[0] = torch.nextafter(flat[0], torch.tensor(float("inf")))

    L.seed_everything(0, verbose=False)
    check = ReplicaConsistency(every_n_steps=2)
    trainer = quiet_trainer(
        devices=4, strategy=PTDPStrategy(**strategy_kwargs), max_steps=4, callbacks=[Corrupt(), check]
    )
    try:
        trainer.fit(build_model(family), zoo_data(4, 5 * 8 * (SEQ + 1), SEQ + 1))
    except ReplicaDivergence as error:
        return {"error": str(error), "checks": check.checks}
    return {"error": None, "checks": check.checks}


@pytest.mark.world_size(4)
def test_replica_consistency_names_the_first_diverged_parameter(dist_pool):
    p2d2 = {"pipeline_parallel_size": 2, "micro_batch_size": 2}
    clean = dist_pool(4).run(fit_with_consistency, p2d2, None, 0)
    assert all(r == {"error": None, "checks": 2} for r in clean)  # replicas and tied copies agree
    # rank 1 is dp replica 1 of stage 0: its copy of a block weight drifts by one ulp
    drift = dist_pool(4).run(fit_with_consistency, p2d2, "net.h.0.c_fc.weight", 1)
    for r in drift:  # every rank stops, naming it (not only the two that hold it)
        assert r["error"] == (
            "step 4: data-parallel replicas: parameter 'net.h.0.c_fc.weight' differs between global ranks 0 and [1]"
        )
    # the last stage's copy of the tied embedding / LM head drifts: named across stages
    tied = dist_pool(4).run(fit_with_consistency, p2d2, "net.lm_head.weight", 3)
    assert (
        "weights tied across pipeline stages: parameter 'net.wte.weight' differs between global ranks 1 and [3]"
        in tied[0]["error"]
    )
