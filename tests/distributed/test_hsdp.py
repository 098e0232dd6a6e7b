"""HSDP (``data_parallel_shard_size``): ZeRO 2-3 sharded within groups of data-parallel ranks and
replicated across them, against one process. FSDP2 takes the 2-D (dp_replicate, dp_shard) mesh:
gradients are reduce-scattered within a group and all-reduced across groups, the same sums as FSDP
over all of d in another order, so ZeRO's fp32 tolerances hold (test_zero.py)."""

from __future__ import annotations

import pytest

from tests.distributed.test_zero import GLOBAL_BATCH, GRAD_REL, LOSS_RTOL, NOISE_DRIVEN, STEPS, UPDATE_REL
from tests.fit_utils import assert_ranks_match_reference, fit_and_record

CASES = {
    # d4 as 2 groups of 2: each rank holds half of every parameter (stage 3) and of the optimizer state
    "d4-2x2-zero2": ({"zero_stage": 2, "data_parallel_shard_size": 2}, 2),
    "d4-2x2-zero3": ({"zero_stage": 3, "data_parallel_shard_size": 2}, 2),
    # groups of 1 beside TP and PP, whose clipping and tied-weight sums add squares over the shard group:
    # over all of d they would count each replica's whole copy twice
    "t2-d2-2x1": ({"zero_stage": 3, "data_parallel_shard_size": 1, "tensor_parallel_size": 2}, 1),
    "p2-d2-2x1": (
        {"zero_stage": 3, "data_parallel_shard_size": 1, "pipeline_parallel_size": 2, "micro_batch_size": 2},
        1,
    ),
}


@pytest.mark.world_size(4)
@pytest.mark.parametrize("case", list(CASES))
def test_hsdp_matches_single_process(dist_pool, case):
    kwargs, shard = CASES[case]
    tp = kwargs.get("tensor_parallel_size", 1)
    clip = {"gradient_clip_val": 0.01}  # below every step's gradient norm: the clip always acts
    common = {"steps": STEPS, "global_batch": GLOBAL_BATCH, "trainer_kwargs": clip}
    results = dist_pool(4).run(fit_and_record, "gpt", strategy_kwargs=kwargs, devices=4, **common)
    ref = fit_and_record("gpt", **common)
    assert_ranks_match_reference(
        results, ref, loss_rtol=LOSS_RTOL, grad_rel=GRAD_REL, update_rel=UPDATE_REL, skip=NOISE_DRIVEN
    )
    if "pipeline_parallel_size" not in kwargs:  # sharded over the group, not over all of d
        for result in results:
            whole = ref["optimizer_numel"] / tp
            assert whole / shard <= result["optimizer_numel"] * 1.001 <= whole / shard * 1.1
