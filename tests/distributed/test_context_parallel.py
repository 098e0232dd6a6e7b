"""Context parallelism against one process: every family, every sequence split over c ranks (alone
and with TP, SP, PP, ZeRO, recompute and compile) gives the single process's losses, first gradients
and final weights, while each block holds only 1/c of the sequence (1/(c*t) under SP)."""

from __future__ import annotations

import pytest
import torch

from tests.fit_utils import SEQ, VOCAB
from tests.matrix import covering
from tests.real_models import MORE_HF
from tests.tolerance import reordered_sum_tolerance

# fp32: the same arithmetic but for the order of sums (keys and values in other chunks, the
# gradient's c shares summed), measured 1e-8..5e-7 relative; 1e-5 as the other equivalence tests.
# A wrong position is not round-off: torchtitan's rotary cache read up to the local length moved
# the attention gradients by 5e-3..1.5e-2 while the loss moved by only 4e-6 at initialisation.
LOSS_RTOL = 1e-5
GRAD_REL = 1e-5
UPDATE_REL = 1e-3  # weights relative to their 3-step update under Adam (test_real_models.py)
STEPS = 3

PIPE = {"pipeline_parallel_size": 2, "micro_batch_size": 2, "pipeline_schedule": "1f1b"}
LAYOUTS = {
    "c2": ({"context_parallel_size": 2}, 2),
    "c4": ({"context_parallel_size": 4}, 4),
    "c2-t2": ({"context_parallel_size": 2, "tensor_parallel_size": 2}, 4),
    "c2-t2-sp": ({"context_parallel_size": 2, "tensor_parallel_size": 2, "sequence_parallel": True}, 4),
    "c2-p2": ({"context_parallel_size": 2, **PIPE}, 4),
    "c2-d2-zero3": ({"context_parallel_size": 2, "zero_stage": 3}, 4),
    "c2-t2-p2": ({"context_parallel_size": 2, "tensor_parallel_size": 2, **PIPE}, 8),
    "c2-p2-d2": ({"context_parallel_size": 2, **PIPE}, 8),  # the pipeline's dp buckets averaged over d x c = 4
}
# every dense family at c2; the layouts on these, which cover learned positions (GPT-2, nanoGPT),
# rotary passed to the blocks (transformers, litgpt, this repository) or read from a buffer in them
# (torchtitan), SDPA and attention written out (eager), fused and GQA projections
CORE = (
    "gpt",
    "llama",
    "nanogpt",
    "nanogpt_eager",
    "hf_llama",
    "hf_llama_eager",
    "hf_gpt2",
    "litgpt_llama",
    "litgpt_pythia",
    "titan_llama3",
)
ALL = (
    *CORE,
    "flat_llama",
    "hf_llama_tied",
    "hf_llama_padded",
    "hf_llama_shifted",
    "nanogpt_documents",
    "hf_gpt2_eager",
    "nanogpt_baddbmm",  # scores in baddbmm with a bias sized from the local keys, heads folded into the batch
    "hf_mistral",
    "hf_neox",
    *MORE_HF,
)
# the dp buckets' average over d x c is no property of a family: three position styles (learned, rotary
# passed to the blocks, rotary read in them) keep the 8-rank cells within the suite's time
FAMILIES_AT = {"c2-p2-d2": ("gpt", "hf_llama", "titan_llama3")}
# every family at c2; the compositions (4 and 8 ranks) on a rotation of CORE (tests/matrix.py);
# FULL_CASES: what PTDP_FULL_MATRIX=1 runs, the cells the documents' tables claim
COMPOSED = {layout: world for layout, (_, world) in LAYOUTS.items() if layout != "c2"}
CASES = [(f, "c2") for f in ALL] + covering(CORE, COMPOSED, pinned=FAMILIES_AT)
FULL_CASES = [(f, "c2") for f in ALL] + covering(CORE, COMPOSED, pinned=FAMILIES_AT, full=True)
_REFERENCES: dict[str, dict] = {}


def _reference(family: str) -> dict:
    from tests.fit_utils import fit_and_record

    if family not in _REFERENCES:
        _REFERENCES[family] = fit_and_record(family, steps=STEPS)
    return _REFERENCES[family]


def fit_and_measure(family: str, strategy_kwargs: dict, devices: int) -> dict:
    """``fit_and_record`` plus the longest sequence any block's forward received."""
    import lightning as L

    from lightning_ptdp.core.blocks import find_block_lists
    from tests.fit_utils import fit_and_record

    seen: set[int] = set()
    head: set[int] = set()

    class Tokens(L.Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            inside = set()
            for _, blocks in find_block_lists(pl_module):
                for block in blocks:  # after ptdp's own hooks: what the block's forward receives
                    block.register_forward_pre_hook(lambda m, args: seen.add(args[0].size(1)))
                    inside |= {id(m) for m in block.modules()}
            for module in pl_module.modules():  # the LM head: a Linear onto the vocabulary, after the blocks
                if isinstance(module, torch.nn.Linear) and module.out_features == VOCAB and id(module) not in inside:
                    module.register_forward_hook(lambda m, args, out: head.add(_held(out).size(1)))

    result = fit_and_record(family, strategy_kwargs=strategy_kwargs, devices=devices, steps=STEPS, callbacks=[Tokens()])
    return {**result, "block_tokens": max(seen), "head_tokens": max(head, default=None)}


def _held(tensor: torch.Tensor) -> torch.Tensor:
    """What this rank holds: a SequenceShard reports the whole sequence's sizes, as in one process; the
    fused loss's uncomputed logits stand on the head's input, whose tokens are the logits' tokens."""
    from lightning_ptdp.context_parallel.tail import SequenceShard
    from lightning_ptdp.parallel.head_logits import HeadLogits

    if isinstance(tensor, HeadLogits):
        tensor = tensor.head_input()
    return tensor.local() if isinstance(tensor, SequenceShard) else tensor


@pytest.mark.parametrize(
    "family, layout", [pytest.param(f, lay, marks=pytest.mark.world_size(LAYOUTS[lay][1])) for f, lay in CASES]
)
def test_context_parallel_matches_single_process(dist_pool, family, layout):
    from tests.fit_utils import assert_ranks_match_reference

    strategy_kwargs, devices = LAYOUTS[layout]
    results = dist_pool(devices).run(fit_and_measure, family, strategy_kwargs, devices)
    assert_ranks_match_reference(
        results, _reference(family), loss_rtol=LOSS_RTOL, grad_rel=GRAD_REL, update_rel=UPDATE_REL
    )
    c = strategy_kwargs["context_parallel_size"]
    sp = strategy_kwargs["tensor_parallel_size"] if strategy_kwargs.get("sequence_parallel") else 1
    assert all(result["block_tokens"] == SEQ // (c * sp) for result in results)
    # the head on this rank's tokens too (TP's vocabulary-parallel head is not a Linear: not seen here)
    heads = {result["head_tokens"] for result in results} - {None}
    assert heads == (set() if "tensor_parallel_size" in strategy_kwargs else {SEQ // c}), heads


EXTRAS = {
    "c2-zero1": {"context_parallel_size": 2, "zero_stage": 1},
    "c2-recompute": {"context_parallel_size": 2, "activation_checkpointing": "full"},
    "c2-selective": {"context_parallel_size": 2, "activation_checkpointing": "selective"},
    "c2-compiled": {"context_parallel_size": 2, "compile": {"backend": "aot_eager"}},
    "c2-zero2": {"context_parallel_size": 2, "zero_stage": 2},
    # inductor's generated C++ against the eager process: fused kernels sum in another order, within
    # the same budget (test_compile.py measured ~1e-7 of the losses, ~5e-7 of the gradients' norm)
    "c2-inductor": {"context_parallel_size": 2, "compile": {"backend": "inductor"}},
}


EXTRA_FAMILIES = ("hf_llama", "gpt")


@pytest.mark.world_size(2)
@pytest.mark.parametrize("layout", EXTRAS)
@pytest.mark.parametrize("family", EXTRA_FAMILIES)
def test_context_parallel_composes(dist_pool, family, layout):
    """ZeRO-1 and ZeRO-2 (optimizer state, and ZeRO-2's gradients, over dp x cp), recompute (the gather
    runs again in backward) and compiled blocks (aot_eager traces forward and backward as inductor does;
    inductor generates the kernels)."""
    from tests.fit_utils import assert_ranks_match_reference

    results = dist_pool(2).run(fit_and_measure, family, EXTRAS[layout], 2)
    assert_ranks_match_reference(
        results, _reference(family), loss_rtol=LOSS_RTOL, grad_rel=GRAD_REL, update_rel=UPDATE_REL
    )
    if "compile" in EXTRAS[layout]:  # compiled for real, the key/value gathers inside the graphs (dynamo's count)
        assert all(r["compiled_graphs"] >= 1 and r["graph_breaks"] == {} for r in results)


def predict_logits(family: str, strategy_kwargs: dict | None, devices: int) -> list:
    """``trainer.predict`` of the logits of 4 batches: what a user receives from it, on this rank."""
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_ptdp.testing import quiet_trainer
    from tests.fit_utils import strategy_from
    from tests.models import build_model

    L.seed_everything(0, verbose=False)
    model = build_model(family)
    model.predict_step = lambda batch, batch_idx: model.logits(batch[0])
    tokens = torch.randint(0, VOCAB, (8, SEQ), generator=torch.Generator().manual_seed(1))
    trainer = quiet_trainer(devices=devices, strategy=strategy_from(strategy_kwargs))
    predictions = trainer.predict(model, DataLoader(TensorDataset(tokens), batch_size=2))
    return [(type(p).__name__, p.detach().cpu().as_subclass(torch.Tensor).clone()) for p in predictions]


@pytest.mark.world_size(2)
@pytest.mark.parametrize("family", ["hf_llama", "nanogpt"])
def test_predicted_logits_are_whole_on_every_rank(dist_pool, family):
    """The logits a step returns leave it whole (gathered on every rank together), so trainer.predict
    gives each rank the single process's logits, plain tensors a rank may use alone."""
    reference = predict_logits(family, None, 1)
    for result in dist_pool(2).run(predict_logits, family, {"context_parallel_size": 2}, 2):
        assert len(result) == len(reference) == 4
        for (kind, logits), (_, expected) in zip(result, reference):
            assert kind == "Tensor" and logits.shape == expected.shape == (2, SEQ, VOCAB)
            # fp32, attention's sums in another order: measured at most 2.7 eps x the largest logit apart
            # (transformers Llama's of ~0.4, nanoGPT's of ~35), also on the small logits
            torch.testing.assert_close(logits, expected, **reordered_sum_tolerance(expected))


# Mixture of experts under context parallelism: the experts are carved out of the d x c ranks holding
# the same parameters (Megatron's order), each rank's MoE layers route its own tokens
MOE_LAYOUTS = {
    "c2-e2": ({"context_parallel_size": 2, "expert_parallel_size": 2}, 2),
    "d2-c2-e4": ({"context_parallel_size": 2, "expert_parallel_size": 4}, 4),
    "c2-t2-e2": ({"context_parallel_size": 2, "tensor_parallel_size": 2, "expert_parallel_size": 2}, 4),
    "c2-e2-zero1": ({"context_parallel_size": 2, "expert_parallel_size": 2, "zero_stage": 1}, 2),
    "c2-e2-zero3": ({"context_parallel_size": 2, "expert_parallel_size": 2, "zero_stage": 3}, 2),
}
MOE_FAMILIES = ("hf_mixtral", "hf_qwen2_moe", "moe_llama", "litgpt_moe", "titan_qwen3_moe")


@pytest.mark.parametrize(
    "family, layout",
    [
        pytest.param(f, lay, marks=pytest.mark.world_size(MOE_LAYOUTS[lay][1]))
        for f, lay in covering(MOE_FAMILIES, {layout: world for layout, (_, world) in MOE_LAYOUTS.items()})
    ],
)
def test_context_and_expert_parallel_match_single_process(dist_pool, family, layout):
    """Equal to one process, each rank holding n_experts / e experts (test_expert_parallel's check)."""
    from tests.distributed.test_expert_parallel import STEPS as MOE_STEPS
    from tests.distributed.test_expert_parallel import _check, _reference
    from tests.fit_utils import fit_and_record

    strategy_kwargs, devices = MOE_LAYOUTS[layout]
    results = dist_pool(devices).run(
        fit_and_record, family, strategy_kwargs=strategy_kwargs, devices=devices, steps=MOE_STEPS
    )
    _check(results, _reference(family), strategy_kwargs, devices)
