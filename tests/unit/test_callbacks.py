"""Callback logic without a Trainer: batch shapes, the straggler verdict, argument errors."""

from __future__ import annotations

import pytest
import torch

from lightning_ptdp.callbacks import PTDPThroughput, StragglerDetector, find_stragglers
from lightning_ptdp.callbacks.throughput import batch_shape


@pytest.mark.parametrize(
    ("batch", "shape"),
    [
        (torch.zeros(4, 16, dtype=torch.long), (4, 16)),
        ((torch.zeros(3, 8), torch.zeros(3, 8)), (3, 8)),
        ({"labels": torch.zeros(5), "input_ids": torch.zeros(2, 7)}, (2, 7)),
        ([torch.tensor(1.0), [torch.zeros(6, 9, 4)]], (6, 9)),
    ],
)
def test_batch_shape_finds_the_first_batch_by_sequence_tensor(batch, shape):
    assert batch_shape(batch) == shape


def test_batch_shape_without_a_sequence_tensor_says_what_to_pass():
    with pytest.raises(
        ValueError,
        match=r"found no \(batch, sequence\) tensor in a batch of type tuple; pass "
        r"PTDPThroughput\(batch_shape_fn=lambda batch",
    ):
        batch_shape((torch.zeros(4), "text"))


def test_a_rank_slower_than_the_others_median_is_named():
    found = find_stragglers([1.0, 1.1, 0.9, 2.0], factor=1.5)
    assert [s.rank for s in found] == [3]
    assert found[0].others_median == 1.0 and found[0].slowdown == 2.0


def test_the_median_leaves_the_rank_out_so_two_ranks_work():
    # the median of both (1.5) would hide a rank twice as slow as the other at factor 1.5
    assert [s.rank for s in find_stragglers([1.0, 2.0], factor=1.5)] == [1]
    assert find_stragglers([1.0, 1.4], factor=1.5) == []
    assert find_stragglers([3.0], factor=1.5) == []  # a single rank has nobody to lag behind


def test_several_stragglers_are_all_named():
    assert [s.rank for s in find_stragglers([1, 1, 1, 1, 5, 1, 6, 1], factor=1.5)] == [4, 6]


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (
            lambda: PTDPThroughput(log_every_n_steps=0),
            r"PTDPThroughput\(log_every_n_steps=0\) must be a positive integer",
        ),
        (lambda: PTDPThroughput(peak_flops=-1.0), r"PTDPThroughput\(peak_flops=-1.0\) must be a positive FLOP/s value"),
        (
            lambda: StragglerDetector(every_n_steps=2.5),
            r"StragglerDetector\(every_n_steps=2.5\) must be a positive integer",
        ),
        (
            lambda: StragglerDetector(slowdown_factor=1.0),
            r"StragglerDetector\(slowdown_factor=1.0\) must be a number > 1",
        ),
    ],
)
def test_bad_arguments_are_rejected(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_model_dimensions_come_from_arguments_or_model_config():
    class Config:
        num_layers, hidden_size, vocab_size = 2, 32, 64

    class WithConfig(torch.nn.Module):
        model_config = Config()

    assert PTDPThroughput()._model_dims(WithConfig()) == {"num_layers": 2, "hidden_size": 32, "vocab_size": 64}
    given = PTDPThroughput(num_layers=4, hidden_size=8, vocab_size=10)._model_dims(torch.nn.Linear(1, 1))
    assert given == {"num_layers": 4, "hidden_size": 8, "vocab_size": 10}
    with pytest.raises(
        ValueError,
        match=r"needs the model's hidden_size, vocab_size for the FLOPs count: pass "
        r"PTDPThroughput\(hidden_size=\.\.\., vocab_size=\.\.\.\), or give Linear a "
        r"`model_config` with those fields",
    ):
        PTDPThroughput(num_layers=4)._model_dims(torch.nn.Linear(1, 1))
