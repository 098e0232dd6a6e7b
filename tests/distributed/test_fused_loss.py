"""The fused head and loss, on by default, under every layout that changes the head or the tail:
TP's vocabulary-parallel head (with and without SP), CP's cut tail, the pipeline's last stage,
ZeRO-1 and ZeRO-3 and plain d2, each against one process with no fusion, on three loss idioms: a tied nanoGPT
with F.cross_entropy, transformers' own loss on padded labels, and label smoothing with ignored
targets in the step. Tolerances: test_tensor_parallel's (fp32, 1e-5 for losses and gradients);
fusion only reorders sums of rows (tests/unit/test_fused_loss.py).

A loss that ignores some targets is a mean over the counted tokens. TP and CP compute the one
process's mean (CP sums the counts over its ranks); data-parallel replicas and pipeline microbatches
each take their own mean and average those, as Lightning's DDP does, which differs from one process
when their counts differ. There, the fused run is held to the same layout unfused.
"""

from __future__ import annotations

import lightning as L
import pytest

from lightning_ptdp.parallel import chunked_loss
from lightning_ptdp.parallel.fused_loss import CROSS_ENTROPY
from tests.fit_utils import assert_matches_reference, assert_ranks_match_reference, fit_and_record

LOSS_RTOL, GRAD_REL = 1e-5, 1e-5
UPDATE_REL = 1e-3  # weights relative to their 3-step update under Adam (test_context_parallel's)
STEPS, GLOBAL_BATCH = 3, 8
NOISE_DRIVEN = ("attn.key.bias",)

LAYOUTS = {
    "d2": {},
    "t2": {"tensor_parallel_size": 2},
    "t2-sp": {"tensor_parallel_size": 2, "sequence_parallel": True},
    "c2": {"context_parallel_size": 2},
    "p2": {"pipeline_parallel_size": 2, "micro_batch_size": 2},
    "d2-zero1": {"zero_stage": 1},
    "d2-zero3": {"zero_stage": 3},
}
FAMILIES = ["nanogpt_dict_tied", "hf_llama_padded", "hf_llama_smoothed"]
COUNTS_TARGETS = ("hf_llama_padded", "hf_llama_smoothed")  # targets of -100: a mean over the counted ones
OWN_MEANS = ("d2", "p2", "d2-zero1", "d2-zero3")  # each replica or microbatch its own mean

_references: dict[str, dict] = {}


class SmallChunks(L.Callback):
    """In the ranks' processes for one fit: chunks by Liger-Kernel's rule alone (these tiny logits would
    be one chunk), so the collectives of TP's loss run chunk by chunk, in forward and backward."""

    def setup(self, trainer, pl_module, stage) -> None:
        self.floor, chunked_loss.MIN_CHUNK_LOGITS = chunked_loss.MIN_CHUNK_LOGITS, 0

    def teardown(self, trainer, pl_module, stage) -> None:
        chunked_loss.MIN_CHUNK_LOGITS = self.floor


def _reference(family: str) -> dict:
    if family not in _references:
        _references[family] = fit_and_record(family, steps=STEPS, global_batch=GLOBAL_BATCH)
    return _references[family]


def _fit(pool, family: str, layout: dict, fused_loss=None) -> list[dict]:
    kwargs = {**layout, "fused_loss": fused_loss}
    return pool(2).run(
        fit_and_record,
        family,
        strategy_kwargs=kwargs,
        devices=2,
        steps=STEPS,
        global_batch=GLOBAL_BATCH,
        callbacks=[SmallChunks()],
    )


CELLS = [(family, layout) for family in FAMILIES for layout in LAYOUTS]


@pytest.mark.parametrize("family, layout", CELLS)
def test_the_fused_loss_trains_as_one_process_unfused(dist_pool, family, layout):
    results = _fit(dist_pool, family, LAYOUTS[layout])
    if family in COUNTS_TARGETS and layout in OWN_MEANS:  # rank by rank against the same layout unfused
        unfused = _fit(dist_pool, family, LAYOUTS[layout], fused_loss=False)
        assert all(r["fused_loss"] is None for r in unfused)
        for fused, plain in zip(results, unfused):
            assert_matches_reference(
                fused, plain, loss_rtol=LOSS_RTOL, grad_rel=GRAD_REL, update_rel=UPDATE_REL, skip=NOISE_DRIVEN
            )
    else:
        assert_ranks_match_reference(
            results,
            _reference(family),
            loss_rtol=LOSS_RTOL,
            grad_rel=GRAD_REL,
            update_rel=UPDATE_REL,
            skip=NOISE_DRIVEN,
        )
    holders = [r["fused_loss"] for r in results if r["fused_loss"]]  # under PP the last stage holds the head
    assert holders and all(uses == [CROSS_ENTROPY] for uses in holders), holders


def test_fused_loss_false_leaves_the_head_alone(dist_pool):
    results = _fit(dist_pool, "hf_llama_smoothed", LAYOUTS["t2"], fused_loss=False)
    assert_ranks_match_reference(
        results, _reference("hf_llama_smoothed"), loss_rtol=LOSS_RTOL, grad_rel=GRAD_REL, update_rel=UPDATE_REL
    )
    assert all(r["fused_loss"] is None for r in results)


def test_fused_loss_true_is_refused_where_the_step_reads_the_logits_otherwise(dist_pool):
    with pytest.raises(
        Exception, match=r"fused_loss=True: the logits of 'net.model.lm_head' were used by cross_entropy, argmax"
    ):
        _fit(dist_pool, "hf_llama_accuracy", LAYOUTS["d2"], fused_loss=True)


def test_a_step_that_also_reads_the_logits_trains_as_one_process(dist_pool):
    """The loss fused, the accuracy's argmax on logits computed as the head would: today's result."""
    results = _fit(dist_pool, "hf_llama_accuracy", LAYOUTS["t2"])
    assert_ranks_match_reference(
        results, _reference("hf_llama_accuracy"), loss_rtol=LOSS_RTOL, grad_rel=GRAD_REL, update_rel=UPDATE_REL
    )
    assert all(r["fused_loss"] == [CROSS_ENTROPY, "argmax"] for r in results)
