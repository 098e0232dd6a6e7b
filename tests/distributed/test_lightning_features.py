"""The Trainer's everyday features under every layout (d2, t2, p2v2, t2p2), each cell compared
with one process: same model, same data, same seed, fp32.

Features that do not interfere share one fit ("train": LearningRateMonitor, clipping by value,
gradient accumulation, a float val_check_interval, limit_train/val_batches, then test and predict
on the same Trainer); the others have a fit each: fast_dev_run, overfit_batches, max_time, and
Trainers one after another on the same module (the same layout again: the model is reused; another
layout: refused with a message saying why, or trained when nothing was cut yet).
"""

from __future__ import annotations

import time
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers.logger import Logger

from tests.fit_utils import relative_error

# fp32. Every layout computes the single-process values up to summation order (dp all-reduce,
# tp partial sums, pipeline microbatch sums): losses agree to ~1e-7 relative (test_pipeline.py,
# test_data_parallel.py measured it), 1e-5 leaves two orders of margin and still catches a missed
# clip or accumulation (those move a loss in the 3rd-4th digit within a step or two). Weights are
# compared against how far training moved them: AdamW divides each step by sqrt(v), which turns
# round-off in tiny gradients into update noise of ~1e-6..2e-4 of the update; 1e-3 keeps margin
# while a lagging or skipped optimizer step is off by ~1e-1 of the update.
LOSS_RTOL = 1e-5
UPDATE_REL = 1e-3
# Fits of 2-3 steps (fast_dev_run, each of several Trainers, every one with a fresh AdamW): AdamW's
# first steps are sign-like (m / sqrt(v) = +-1 per element), so elements whose gradient is round-off
# sized take full steps of random sign, a larger share of a short update. Measured: up to 1.1e-3 of a
# 3-step update (t2 after d2), 1.0e-3 of fast_dev_run's 2 (t2); on another machine of the same kind,
# d2's second Trainer (a fresh AdamW on trained weights) 5.6e-3 alone and 1.2e-2 after the rest of the
# suite had run in the same process (the reference's reduction order follows the process's state).
# A lagging or missing step is off by 1/3 to 1/2 of such an update: 7-10x this bound.
FEW_STEPS_UPDATE_REL = 5e-2
# The later Trainers start a fresh AdamW from weights that already carry that noise, so their losses
# drift further: measured up to 1.2e-5 relative (d2 then t2, third Trainer's last step). A stale
# optimizer or weights not carried over move a loss in the 2nd-3rd digit.
LATER_LOSS_RTOL = 1e-4
# The key projection's bias has an exactly-zero gradient in exact arithmetic (softmax is shift
# invariant per query row): its updates are pure round-off noise, no two summation orders share them.
NOISE_DRIVEN = ("attn.key.bias",)
GLOBAL_BATCH, LAYERS = 8, 4
CLIP_VALUE = 2e-3  # below most gradients' elements at these steps: clipping by value really acts

LAYOUTS = {
    "d2": (2, {}),
    "t2": (2, {"tensor_parallel_size": 2}),
    "p2v2": (2, {"pipeline_parallel_size": 2, "virtual_pipeline_size": 2, "micro_batch_size": 2}),
    "t2p2": (4, {"tensor_parallel_size": 2, "pipeline_parallel_size": 2, "micro_batch_size": 2}),
}
# Another layout for a later Trainer on the same module, and whether it can work there: under tensor
# parallelism the module holds this rank's weight shards, under a pipeline only its stages' layers.
_REBUILD = r"\. Keep .*, or build the model again for the new (layout|one)"
LATER_LAYOUT = {
    "d2": ({"tensor_parallel_size": 2}, None),  # a data-parallel fit cut nothing: TP may rewrite it now
    "t2": (
        {},
        r"already rewritten for tensor_parallel_size=2 by an earlier Trainer .* tensor_parallel_size=1 cannot use it"
        + r"\. Keep tensor_parallel_size=2, or build the model again",
    ),
    "p2v2": (
        {"tensor_parallel_size": 2},
        r"already split for pipeline_parallel_size=2, virtual_pipeline_size=2 by an "
        r"earlier Trainer .* pipeline_parallel_size=1, virtual_pipeline_size=1 cannot use it" + _REBUILD,
    ),
    "t2p2": (
        {"tensor_parallel_size": 2},
        r"already split for pipeline_parallel_size=2, virtual_pipeline_size=1 by an "
        r"earlier Trainer .* pipeline_parallel_size=1, virtual_pipeline_size=1 cannot use it" + _REBUILD,
    ),
}


class MemoryLogger(Logger):
    """Every logged metric with its step, on every rank (loggers usually write on rank 0 only)."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[int, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.records.append((step, {k: float(v) for k, v in metrics.items() if k != "epoch"}))


class SkewedStart(L.Callback):
    """The last rank starts training late: its clock starts ``delay`` after rank 0's, so its own
    Timer would stop a step or more after rank 0's, and every step waits on a collective."""

    def __init__(self, delay: float, pace: float) -> None:
        self.delay, self.pace = delay, pace

    def on_train_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_rank == trainer.world_size - 1:
            time.sleep(self.delay)

    def on_train_batch_end(self, *args: Any) -> None:
        time.sleep(self.pace)  # a few steps per second, so the limit falls after a handful


def _data(strategy_kwargs: dict | None, devices: int, train_batches: int, *, distributed_order: bool = True):
    """The data (each replica's share of the global batch) and the strategy of a layout; ``None``: one process."""
    from tests.fit_utils import strategy_from, use_distributed_order, zoo_data

    replicas = 1
    if strategy_kwargs is not None:
        t, p = strategy_kwargs.get("tensor_parallel_size", 1), strategy_kwargs.get("pipeline_parallel_size", 1)
        replicas = devices // (t * p)
        strategy_kwargs = {"checkpoint_format": "full", **strategy_kwargs}  # state: whole tensors, as one process
    data = zoo_data(GLOBAL_BATCH // replicas, train_batches * GLOBAL_BATCH * 33 + 1, 2 * GLOBAL_BATCH * 33 + 1)
    if strategy_kwargs is None and distributed_order:
        use_distributed_order(data, 0)
    return data, strategy_from(strategy_kwargs)


def _setup(strategy_kwargs: dict | None, devices: int, train_batches: int, *, distributed_order: bool = True):
    from tests.models import build_model

    L.seed_everything(0, verbose=False)
    model = build_model("gpt", num_layers=LAYERS)
    initial = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    return (model, initial, *_data(strategy_kwargs, devices, train_batches, distributed_order=distributed_order))


def _state(trainer: L.Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in trainer.strategy.lightning_module_state_dict().items()}


def features_fit(strategy_kwargs: dict | None, devices: int) -> dict:
    """Two epochs of 8 batches (limit_train_batches of 10), accumulating 2 per step, clipped by
    value, validating twice an epoch on 2 batches; the LR logged every step; then test and predict."""
    from lightning.pytorch.callbacks import LearningRateMonitor

    from tests.fit_utils import LossRecorder, quiet_trainer

    model, initial, data, strategy = _setup(strategy_kwargs, devices, 10)
    recorder, logger = LossRecorder(), MemoryLogger()
    trainer = quiet_trainer(
        devices=devices,
        strategy=strategy,
        max_epochs=2,
        limit_train_batches=8,
        limit_val_batches=2,
        val_check_interval=0.5,
        accumulate_grad_batches=2,
        gradient_clip_val=CLIP_VALUE,
        gradient_clip_algorithm="value",
        logger=logger,
        log_every_n_steps=1,
        callbacks=[recorder, LearningRateMonitor(logging_interval="step")],
    )
    trainer.fit(model, data)
    state = _state(trainer)
    tested = trainer.test(model, data, verbose=False)[0]
    predictions = torch.cat(trainer.predict(model, data.predict_dataloader()))
    return {
        "losses": recorder.losses,
        "logged": logger.records,
        "initial": initial,
        "state": state,
        "global_step": trainer.global_step,
        "tested": tested,
        "predictions": predictions,
    }


def fast_dev_run_fit(strategy_kwargs: dict | None, devices: int) -> dict:
    from tests.fit_utils import LossRecorder, quiet_trainer

    model, initial, data, strategy = _setup(strategy_kwargs, devices, 4)
    recorder = LossRecorder()
    trainer = quiet_trainer(
        devices=devices, strategy=strategy, fast_dev_run=2, limit_val_batches=1.0, callbacks=[recorder]
    )
    trainer.fit(model, data)
    return {
        "losses": recorder.losses,
        "initial": initial,
        "state": _state(trainer),
        "global_step": trainer.global_step,
        "val_loss": float(trainer.callback_metrics["val_loss"]),
    }


def overfit_fit(strategy_kwargs: dict | None, devices: int) -> dict:
    """overfit_batches=2 for 3 epochs: the same 2 batches (no shuffle: Lightning turns it off,
    and its DistributedSampler's replicas interleave, so their union is one process's batch)."""
    from tests.fit_utils import LossRecorder, quiet_trainer

    model, initial, data, strategy = _setup(strategy_kwargs, devices, 6, distributed_order=False)
    recorder = LossRecorder()
    trainer = quiet_trainer(devices=devices, strategy=strategy, overfit_batches=2, max_epochs=3, callbacks=[recorder])
    trainer.fit(model, data)
    return {"losses": recorder.losses, "initial": initial, "state": _state(trainer), "global_step": trainer.global_step}


MAX_TIME_S, SKEW_S, PACE_S = 2.0, 1.0, 0.2


def max_time_fit(strategy_kwargs: dict | None, devices: int, max_steps: int = 1000) -> dict:
    """max_time with the last rank's clock started SKEW_S late: the ranks must still stop at one
    step (Lightning's Timer broadcasts rank 0's decision through the strategy), and soon."""
    from tests.fit_utils import LossRecorder, quiet_trainer

    model, initial, data, strategy = _setup(strategy_kwargs, devices, 40)
    recorder = LossRecorder()
    reference = strategy_kwargs is None  # one process: exactly the steps the ranks made
    callbacks = [recorder] if reference else [recorder, SkewedStart(SKEW_S, PACE_S)]
    trainer = quiet_trainer(
        devices=devices,
        strategy=strategy,
        max_time=None if reference else {"seconds": MAX_TIME_S},
        max_epochs=None,
        max_steps=max_steps,
        callbacks=callbacks,
    )
    start = time.monotonic()
    trainer.fit(model, data)
    return {
        "losses": recorder.losses,
        "initial": initial,
        "state": _state(trainer),
        "global_step": trainer.global_step,
        "seconds": time.monotonic() - start,
    }


def later_trainers_fit(strategy_kwargs: dict | None, devices: int, later: tuple | None = None) -> dict:
    """A fit, a second Trainer with the same layout on the same module (it continues from the
    module's weights with a fresh optimizer), then a third with another layout (``later``: its
    strategy kwargs and the refusal expected, None where it must train)."""
    from tests.fit_utils import LossRecorder, quiet_trainer

    model, initial, _, _ = _setup(strategy_kwargs, devices, 4)
    layouts = [strategy_kwargs, strategy_kwargs] + ([later[0]] if later is not None else [])
    runs = []
    for run, kwargs in enumerate(layouts):
        data, strategy = _data(kwargs, devices, 4)
        recorder = LossRecorder()
        trainer = quiet_trainer(devices=devices, strategy=strategy, max_steps=3, callbacks=[recorder])
        if run == 2 and later[1] is not None:
            with pytest.raises(ValueError, match=later[1]):
                trainer.fit(model, data)
            assert recorder.losses == [], "a step ran before the refusal"
            break
        trainer.fit(model, data)
        runs.append({"losses": recorder.losses, "state": _state(trainer)})
    return {"initial": initial, "runs": runs}


_references: dict[Any, dict] = {}


def reference(fn: Any, *args: Any) -> dict:
    """One process's run, computed once per test session (every layout compares with it)."""
    key = (fn.__name__, *args)
    if key not in _references:
        _references[key] = fn(None, 1, *args)
    return _references[key]


def assert_losses(actual: list[float], expected: list[float], what: str, rtol: float = LOSS_RTOL) -> None:
    assert len(actual) == len(expected) > 0, f"{what}: {len(actual)} losses where one process has {len(expected)}"
    torch.testing.assert_close(
        torch.tensor(actual), torch.tensor(expected), rtol=rtol, atol=0.0, msg=lambda m: f"{what}: losses {m}"
    )


def assert_weights(state: dict, ref_state: dict, initial: dict, what: str, update_rel: float = UPDATE_REL) -> None:
    assert state.keys() == ref_state.keys(), what
    for name, expected in ref_state.items():
        if name.endswith(NOISE_DRIVEN):
            continue
        err = relative_error(state[name], expected, expected - initial[name])
        assert err <= update_rel, f"{what}: weight {name} is off by {err:.1e} of its update (> {update_rel:.0e})"


def _run(dist_pool, layout: str, fn: Any, *args: Any) -> list[dict]:
    devices, kwargs = LAYOUTS[layout]
    return dist_pool(devices).run(fn, kwargs, devices, *args, timeout=300)


def _params(*layouts: str) -> list:
    return [pytest.param(LAYOUTS[name][0], name, id=name) for name in layouts]


ALL = _params(*LAYOUTS)


@pytest.mark.parametrize(("devices", "layout"), ALL)
def test_features_in_one_fit_then_test_and_predict(dist_pool, devices, layout):
    ref = reference(features_fit)
    assert ref["global_step"] == 8 and len(ref["losses"]) == 16  # 2 epochs x 8 batches, 2 per step
    lrs = {step: m["lr-AdamW/pg1"] for step, m in ref["logged"] if "lr-AdamW/pg1" in m}
    assert len(lrs) == 8 and len(set(lrs.values())) >= 6  # logged every step; warmup and decay change it
    assert sum("val_loss" in m for _, m in ref["logged"]) == 4  # val_check_interval=0.5: twice an epoch
    for rank, result in enumerate(_run(dist_pool, layout, features_fit)):
        what = f"{layout} rank {rank}"
        assert result["global_step"] == ref["global_step"], what
        assert_losses(result["losses"], ref["losses"], what)
        assert [step for step, _ in result["logged"]] == [step for step, _ in ref["logged"]], what
        for (step, got), (_, expected) in zip(result["logged"], ref["logged"]):
            assert got.keys() == expected.keys(), f"{what} step {step}"
            for name, value in expected.items():
                if name.startswith("lr-"):
                    assert got[name] == value, f"{what} step {step}: {name} {got[name]} != {value}"
                else:
                    assert got[name] == pytest.approx(value, rel=LOSS_RTOL), f"{what} step {step}: {name}"
        assert_weights(result["state"], ref["state"], ref["initial"], what)
        assert result["tested"] == pytest.approx(ref["tested"], rel=LOSS_RTOL), what
        replicas = devices // (
            LAYOUTS[layout][1].get("tensor_parallel_size", 1) * LAYOUTS[layout][1].get("pipeline_parallel_size", 1)
        )
        # predict splits samples over replicas without repeats (rank r of d: every d-th sample)
        expected = ref["predictions"][(rank % replicas) :: replicas] if replicas > 1 else ref["predictions"]
        assert torch.equal(result["predictions"], expected), what


@pytest.mark.parametrize(("devices", "layout"), ALL)
def test_fast_dev_run(dist_pool, devices, layout):
    ref = reference(fast_dev_run_fit)
    assert ref["global_step"] == 2
    for rank, result in enumerate(_run(dist_pool, layout, fast_dev_run_fit)):
        what = f"{layout} rank {rank}"
        assert result["global_step"] == 2, what
        assert_losses(result["losses"], ref["losses"], what)
        assert result["val_loss"] == pytest.approx(ref["val_loss"], rel=LOSS_RTOL), what
        assert_weights(result["state"], ref["state"], ref["initial"], what, FEW_STEPS_UPDATE_REL)


@pytest.mark.parametrize(("devices", "layout"), ALL)
def test_overfit_batches(dist_pool, devices, layout):
    ref = reference(overfit_fit)
    assert ref["global_step"] == 6 and ref["losses"][2] < ref["losses"][0]  # the same batches, learnt
    for rank, result in enumerate(_run(dist_pool, layout, overfit_fit)):
        what = f"{layout} rank {rank}"
        assert result["global_step"] == 6, what
        assert_losses(result["losses"], ref["losses"], what)
        assert_weights(result["state"], ref["state"], ref["initial"], what)


@pytest.mark.parametrize(("devices", "layout"), ALL)
def test_max_time_stops_every_rank_at_one_step(dist_pool, devices, layout):
    results = _run(dist_pool, layout, max_time_fit)
    steps = {result["global_step"] for result in results}
    assert len(steps) == 1, f"{layout}: ranks stopped at different steps {[r['global_step'] for r in results]}"
    step = steps.pop()
    assert 0 < step < 1000
    # the limit, the skew, a step and the state gather, well within the pool's own timeout
    assert max(r["seconds"] for r in results) < MAX_TIME_S + SKEW_S + 30
    ref = reference(max_time_fit, step)
    for rank, result in enumerate(results):
        what = f"{layout} rank {rank}"
        assert_losses(result["losses"], ref["losses"], what)
        assert_weights(result["state"], ref["state"], ref["initial"], what)


@pytest.mark.parametrize(("devices", "layout"), ALL)
def test_later_trainers_on_the_same_module(dist_pool, devices, layout):
    ref = reference(later_trainers_fit, (None, None))  # one process: three Trainers one after another
    later_kwargs, refusal = LATER_LAYOUT[layout]
    results = _run(dist_pool, layout, later_trainers_fit, (later_kwargs, refusal))
    for rank, result in enumerate(results):
        assert len(result["runs"]) == (2 if refusal is not None else 3)
        for run, got in enumerate(result["runs"]):
            what = f"{layout} rank {rank}, Trainer {run + 1}"
            assert_losses(got["losses"], ref["runs"][run]["losses"], what, LOSS_RTOL if run == 0 else LATER_LOSS_RTOL)
            assert_weights(got["state"], ref["runs"][run]["state"], ref["initial"], what, FEW_STEPS_UPDATE_REL)
