"""Activation bytes per block and rank under tensor and sequence parallelism (t=2), sharded
through ``parallelize``, beside Korthikanti et al. 2022 (benchmarks/bench_activation.py)."""

from __future__ import annotations

import pytest

from benchmarks.bench_activation import formula_bytes, measure

MODEL = dict(vocab_size=64, seq_length=128, num_layers=3, num_heads=4, hidden_size=64, dropout=0.1)
BATCH, TP = 2, 2
SHAPE = dict(s=MODEL["seq_length"], b=BATCH, h=MODEL["hidden_size"], a=MODEL["num_heads"], t=TP)
FP32_EAGER_CPU = dict(act_bytes=4, mask_bytes=4, attention_dropout=False)
# LayerNorm's saved mean and rstd (16sb bytes, under 0.5% of a row here) are the only bytes outside
# the paper's terms; 1% bounds them.
LN_STATS_REL = 0.01
# Everything the paper counts is split by SP (LayerNorm statistics too), so t=1 / (t, SP) should be t
# up to round-off of the layout; 5% still tells "split" (2.0) from TP alone (1.5-1.6 at these sizes).
SP_SPLIT_REL = 0.05

pytestmark = pytest.mark.world_size(TP)


def _saved(pool, t: int, sp: bool, recompute: str | None) -> int:
    per_rank = pool.run(measure, t, sp, recompute, "math", MODEL, BATCH)
    assert len(set(per_rank)) == 1, per_rank  # the same shard shape on every rank
    return per_rank[0]


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_recompute_orders_saved_bytes_under_tensor_parallelism(dist_pool, sequence_parallel):
    pool = dist_pool(TP)
    saved = {mode: _saved(pool, TP, sequence_parallel, mode) for mode in (None, "selective", "full")}
    assert saved[None] > saved["selective"] > saved["full"]
    # full recompute keeps the block input only: the rank's 1/t sequence shard under SP
    input_bytes = 4 * BATCH * MODEL["seq_length"] * MODEL["hidden_size"]
    assert saved["full"] == (input_bytes // TP if sequence_parallel else input_bytes)
    for mode in (None, "selective"):  # SP: region inputs kept as their 1/t shard, as the paper counts
        formula = formula_bytes(**SHAPE, sp=sequence_parallel, recompute=mode, **FP32_EAGER_CPU)
        assert formula <= saved[mode] <= formula * (1 + LN_STATS_REL), mode


@pytest.mark.parametrize("recompute", [None, "selective"])
def test_sequence_parallelism_divides_saved_bytes_by_t(dist_pool, recompute):
    pool = dist_pool(TP)
    ratio = _saved(pool, 1, False, recompute) / _saved(pool, TP, True, recompute)
    assert ratio == pytest.approx(TP, rel=SP_SPLIT_REL)
