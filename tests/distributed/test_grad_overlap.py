"""Under pipeline parallelism with d > 1 the dp mean of the gradients starts per chunk, as soon as
the chunk's last backward ran (``overlap_grad_reduce``), and gives what one process gives."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.test_pipeline import GRAD_REL, LOSS_RTOL, NOISE_DRIVEN, UPDATE_REL
from tests.fit_utils import assert_ranks_match_reference, fit_and_record

STEPS, GLOBAL_BATCH = 3, 8
LAYOUT = {"pipeline_parallel_size": 2, "virtual_pipeline_size": 2, "micro_batch_size": 1}


def fit_recording_comm(overlap: bool) -> dict:
    """p=2 v=2 d=2 on 4 ranks: the final weights, and the last step's dp buckets (start, end) with
    the schedule's own start and end."""
    import lightning as L

    from lightning_ptdp import PTDPStrategy
    from tests.fit_utils import SEQ, quiet_trainer, zoo_data
    from tests.models import build_model

    L.seed_everything(0, verbose=False)
    strategy = PTDPStrategy(**LAYOUT, overlap_grad_reduce=overlap, checkpoint_format="full")
    trainer = quiet_trainer(devices=4, strategy=strategy, max_steps=STEPS)
    model = build_model("nanogpt", num_layers=4)
    trainer.fit(model, zoo_data(GLOBAL_BATCH // 2, (STEPS + 1) * GLOBAL_BATCH * (SEQ + 1), 4 * (SEQ + 1)))
    timeline = strategy.pipeline.timeline
    return {
        "state": {k: v.detach().cpu().clone() for k, v in strategy.lightning_module_state_dict().items()},
        "buckets": [(s.stage, s.start, s.end) for s in timeline.comm],
        "start": timeline.start,
        "end": timeline.end,
        "exposed": timeline.exposed_comm,
    }


@pytest.mark.world_size(4)
def test_overlapped_buckets_start_during_the_schedule_and_change_no_value(dist_pool):
    pool = dist_pool(4)
    overlapped = pool.run(fit_recording_comm, True)
    flat = pool.run(fit_recording_comm, False)
    for on, off in zip(overlapped, flat):
        # d=2: each element is a + b either way, then halved: exactly the same values
        assert on["state"].keys() == off["state"].keys()
        assert all(torch.equal(on["state"][k], off["state"][k]) for k in on["state"])
        # one bucket per chunk (v=2), the first started while the schedule still ran
        assert len(on["buckets"]) >= 2 and on["buckets"][0][1] < on["end"]
        # without overlap one bucket, started after the schedule
        assert len(off["buckets"]) == 1 and off["buckets"][0][1] >= off["end"]


@pytest.mark.world_size(4)
def test_overlap_matches_one_process(dist_pool):
    overrides = {"num_layers": 4}
    results = dist_pool(4).run(
        fit_and_record,
        "nanogpt",
        strategy_kwargs=LAYOUT,
        devices=4,
        steps=STEPS,
        global_batch=GLOBAL_BATCH,
        model_overrides=overrides,
    )
    ref = fit_and_record("nanogpt", steps=STEPS, global_batch=GLOBAL_BATCH, model_overrides=overrides)
    assert_ranks_match_reference(
        results, ref, loss_rtol=LOSS_RTOL, grad_rel=GRAD_REL, update_rel=UPDATE_REL, skip=NOISE_DRIVEN
    )
