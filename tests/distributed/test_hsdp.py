"""HSDP (``data_parallel_shard_size``): ZeRO 2-3 sharded within groups of data-parallel ranks and
replicated across them, against one process. FSDP2 takes the 2-D (dp_replicate, dp_shard) mesh:
gradients are reduce-scattered within a group and all-reduced across groups, the same sums as FSDP
over all of d in another order, so ZeRO's fp32 tolerances hold (test_zero.py)."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist

from lightning_ptdp.testing import CollectiveCounter
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


class CollectiveBytes(L.Callback):
    """Bytes this rank hands to FSDP2's collectives in the second step, by the ranks of each group
    (``CollectiveCounter``): all-gather outputs, reduce-scatter inputs and, under HSDP, the all-reduce
    across groups (not ptdp's own over the world). Written to ``folder``/rank.json at the end (a pool
    worker returns only fit_and_record's record)."""

    FSDP = ("all_gather_single", "reduce_scatter_single")

    def __init__(self, folder: str) -> None:
        self.folder, self.counter = folder, CollectiveCounter()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == 1:
            self.counter.start()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx == 1:
            self.counter.stop()
            world = dist.get_world_size()
            counts = {
                f"{name}@{','.join(map(str, ranks))}": n
                for (name, ranks), n in self.counter.by_group.items()
                if name in self.FSDP or (name == "all_reduce" and len(ranks) < world)
            }
            Path(self.folder, f"{dist.get_rank()}.json").write_text(json.dumps(counts))


def _padded_bytes(model: torch.nn.Module, shard: int, names: set[str] | None = None) -> int:
    """fp32 bytes of the parameters (``names`` only), each padded to ``shard`` rows as FSDP2 pads its shards."""
    total = 0
    for name, param in model.named_parameters():
        if names is None or name in names:
            rows = -(-param.shape[0] // shard) * shard
            total += rows * (param.numel() // param.shape[0]) * 4
    return total


@pytest.mark.world_size(4)
def test_hsdp_sends_only_the_gradient_shards_across_groups(dist_pool, tmp_path):
    """Four ranks as two "nodes" of two. ZeRO-3 over all four: every collective spans both nodes. HSDP
    2 x 2: the all-gathers and reduce-scatters stay in a node; across nodes goes one all-reduce of each
    rank's gradient shard, 1/2 of the padded parameters, exactly (the formula, from the shapes)."""
    from tests.models import build_model

    model = build_model("gpt")
    blocks = {n for n, _ in model.named_parameters() if ".blocks." in n}
    counted = {}
    for name, shard in (("fsdp", None), ("hsdp", 2)):
        folder = tmp_path / name
        folder.mkdir()
        kwargs = {"zero_stage": 3, **({"data_parallel_shard_size": shard} if shard else {})}
        dist_pool(4).run(
            fit_and_record, "gpt", strategy_kwargs=kwargs, devices=4, steps=2, callbacks=[CollectiveBytes(str(folder))]
        )
        counted[name] = [json.loads((folder / f"{rank}.json").read_text()) for rank in range(4)]
    node = {0: 0, 1: 0, 2: 1, 3: 1}

    def across(counts: dict[str, int]) -> int:
        return sum(v for k, v in counts.items() if len({node[int(r)] for r in k.split("@")[1].split(",")}) > 1)

    # ZeRO-3 over 4: blocks gathered in forward and again in backward, the rest once; gradients scattered once
    fsdp = 2 * _padded_bytes(model, 4, blocks) + _padded_bytes(model, 4) * 2 - _padded_bytes(model, 4, blocks)
    hsdp = _padded_bytes(model, 2) // 2
    for rank in range(4):
        assert across(counted["fsdp"][rank]) == sum(counted["fsdp"][rank].values()) == fsdp, counted["fsdp"][rank]
        assert across(counted["hsdp"][rank]) == hsdp, counted["hsdp"][rank]
        within = sum(counted["hsdp"][rank].values()) - hsdp
        assert within == 2 * _padded_bytes(model, 2, blocks) + _padded_bytes(model, 2) * 2 - _padded_bytes(
            model, 2, blocks
        )
