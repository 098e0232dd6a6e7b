"""Configuration and mesh-shape errors: each names the value, the rule and the fix."""

from __future__ import annotations

import pytest

from lightning_ptdp import ParallelConfig, ParallelDims, PTDPStrategy


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"tensor_parallel_size": 0}, r"tensor_parallel_size=0 must be >= 1"),
        ({"pipeline_parallel_size": -2}, r"pipeline_parallel_size=-2 must be >= 1"),
        (
            {"tensor_parallel_size": 2.0},
            r"tensor_parallel_size=2.0 must be a positive integer.*did you mean tensor_parallel_size=2",
        ),
        ({"tensor_parallel_size": "2"}, r"tensor_parallel_size='2' must be a positive integer, got str"),
        ({"data_parallel_size": 1.5}, r"data_parallel_size=1.5 must be a positive integer"),
        ({"data_parallel_size": True}, r"data_parallel_size=True must be a positive integer, got bool"),
        ({"virtual_pipeline_size": 0}, r"virtual_pipeline_size=0 must be >= 1"),
        ({"micro_batch_size": 0}, r"micro_batch_size=0 must be >= 1"),
        ({"zero_stage": 4}, r"zero_stage=4 is not one of 0, 1, 2, 3"),
        ({"pipeline_schedule": "1F1B"}, r"pipeline_schedule='1F1B' is not one of 'interleaved_1f1b', '1f1b'"),
        ({"kernels": "cuda"}, r"kernels='cuda' is not one of 'auto', 'triton', 'torch'"),
        ({"activation_checkpointing": "some"}, r"activation_checkpointing='some' is not one of"),
        ({"sequence_parallel": "yes"}, r"sequence_parallel='yes' must be True or False"),
        ({"sequence_parallel": True}, r"sequence_parallel=True needs tensor_parallel_size > 1"),
        ({"virtual_pipeline_size": 2}, r"virtual_pipeline_size=2 needs pipeline_parallel_size > 1"),
        (
            {"virtual_pipeline_size": 2, "pipeline_parallel_size": 2, "pipeline_schedule": "1f1b"},
            r"virtual_pipeline_size=2 needs a schedule that runs several chunks per rank, but pipeline_schedule='1f1b'",
        ),
    ],
)
def test_bad_config_is_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ParallelConfig(**kwargs)
    with pytest.raises(ValueError, match=match):
        PTDPStrategy(**kwargs)


def test_world_size_mismatch_names_sizes_that_fit():
    config = ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2, data_parallel_size=4)
    with pytest.raises(
        ValueError, match=r"= 16, but the world size is 8.*Sizes that fit 8 processes: \(t=1, p=1, d=8\)"
    ):
        ParallelDims.from_config(config, world_size=8)


def test_auto_dp_needs_divisible_world():
    config = ParallelConfig(tensor_parallel_size=4)
    with pytest.raises(
        ValueError,
        match=r"tensor_parallel_size\(4\) \* pipeline_parallel_size\(1\) = 4 does not divide the world size 6",
    ):
        ParallelDims.from_config(config, world_size=6)


def test_auto_dp_fills_the_world():
    dims = ParallelDims.from_config(ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2), world_size=16)
    assert (dims.pp, dims.dp, dims.tp) == (2, 4, 2)


def test_megatron_rank_order_tp_fastest():
    dims = ParallelDims(pp=2, dp=2, tp=2, world_size=8)
    coords = [dims.coordinates(rank) for rank in range(8)]
    assert [c["tp"] for c in coords] == [0, 1, 0, 1, 0, 1, 0, 1]
    assert [c["dp"] for c in coords] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [c["pp"] for c in coords] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_trainer_rejects_bad_world_before_launch():
    import lightning as L

    with pytest.raises(ValueError, match=r"data_parallel_size\(3\) = 3, but the world size is 2"):
        L.Trainer(strategy=PTDPStrategy(data_parallel_size=3), accelerator="cpu", devices=2, logger=False)


def test_registered_by_name():
    import lightning as L

    trainer = L.Trainer(strategy="ptdp", accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    assert isinstance(trainer.strategy, PTDPStrategy)
    assert trainer.strategy.parallel_dims == ParallelDims(pp=1, dp=1, tp=1, world_size=1)


def test_a_shard_size_that_does_not_divide_the_replicas_is_refused_with_the_sizes_that_do():
    config = ParallelConfig(zero_stage=3, data_parallel_shard_size=3, tensor_parallel_size=2)
    with pytest.raises(
        ValueError, match=r"data_parallel_shard_size=3 does not divide data_parallel_size=4: .*in 1, 2, 4$"
    ):
        ParallelDims.from_config(config, world_size=8)
    assert ParallelDims.from_config(config.__class__(zero_stage=3, data_parallel_shard_size=2), world_size=8).shard == 2
