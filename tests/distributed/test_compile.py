"""torch.compile under every layout, against one compiled process (CPU inductor).

``PTDPStrategy(compile=True)`` compiles each block's forward after ptdp's rewrites; a user's own
``block.compile()`` before fit, and ``torch.compile(lightning_module)``, are covered too.
"""

from __future__ import annotations

from typing import Callable

import pytest

from tests.fit_utils import assert_ranks_match_reference, fit_and_record
from tests.matrix import sampled
from tests.shares import check_moe_share, check_share, expected_moe_shares, expected_shares

STEPS, GLOBAL_BATCH = 3, 8
# fp32. Inductor fuses differently for a rank's local shapes than for the whole model, so values
# differ by round-off in the order of the sums (measured: losses ~1e-7 relative, gradients ~5e-7
# of their norm), the same budget as the eager equivalence tests; weights 1e-3 of the update (Adam
# turns round-off on near-zero gradients into visible updates, see test_real_models.py).
LOSS_RTOL, GRAD_REL, UPDATE_REL = 1e-5, 1e-5, 1e-3
INDUCTOR = {"backend": "inductor"}
MICRO = {"micro_batch_size": 2}
# (strategy arguments, devices); what each rank holds is checked against the share the layout gives
# (tests/shares.py, as the conformance matrix does)
LAYOUTS = {
    "d2": ({}, 2),
    "t2": ({"tensor_parallel_size": 2}, 2),
    "t2-sp": ({"tensor_parallel_size": 2, "sequence_parallel": True}, 2),
    "p2": ({"pipeline_parallel_size": 2, **MICRO, "pipeline_schedule": "1f1b"}, 2),
    "p2-v2": ({"pipeline_parallel_size": 2, "virtual_pipeline_size": 2, **MICRO}, 2),
    "zero1": ({"zero_stage": 1}, 2),
    "zero2": ({"zero_stage": 2}, 2),
    "zero3": ({"zero_stage": 3}, 2),
    "t2-p2": ({"tensor_parallel_size": 2, "pipeline_parallel_size": 2, **MICRO, "pipeline_schedule": "1f1b"}, 4),
    "t2-sp-full-recompute": (
        {"tensor_parallel_size": 2, "sequence_parallel": True, "activation_checkpointing": "full"},
        2,
    ),
    "t2-selective-recompute": ({"tensor_parallel_size": 2, "activation_checkpointing": "selective"}, 2),
}
OVERRIDES = {"num_layers": 4}  # p=2 v=2 needs a block per chunk
_REFERENCES: dict[tuple[str, bool], dict] = {}


def compiled_reference(family: str, inner: bool = False) -> dict:
    """One process, every block compiled with inductor before fit, or (``inner``) the network compiled
    whole; computed once per case."""
    if (family, inner) not in _REFERENCES:
        how = {"compile_inner": True} if inner else {"compile_blocks": INDUCTOR}
        _REFERENCES[family, inner] = fit_and_record(
            family, steps=STEPS, global_batch=GLOBAL_BATCH, model_overrides=OVERRIDES, **how
        )
    return _REFERENCES[family, inner]


def _without_orig_mod(result: dict) -> dict:
    """Names with the ``_orig_mod.`` of a module compiled whole dropped: torch's state-dict helpers
    (ZeRO 2/3's full state dict) drop it, the module's own state_dict keeps it."""
    renamed = {}
    for key in ("initial", "state", "first_grads"):
        values = result[key]
        renamed[key] = values if not values else {k.replace("._orig_mod", ""): v for k, v in values.items()}
    return {**result, **renamed}


# dynamo's reasons for the only breaks a case may have: the user's own compile around ptdp's full
# recompute under TP (parallel/compile.py warns), and the end of a chunk under PP (the network compiled whole)
CHECKPOINT_BREAK = ("Mutating a variable from outside the scope of this HOP",)
CHUNK_END_BREAK = ("_ChunkDone", "super().__init__")


def _check(
    results: list[dict], ref: dict, check_held: Callable[[dict], None], allowed_breaks: tuple[str, ...] = ()
) -> None:
    """``check_held``: what a rank must hold; ``allowed_breaks``: the graph-break reasons this case may
    have (every other one fails)."""
    results, ref = [_without_orig_mod(r) for r in results], _without_orig_mod(ref)
    assert_ranks_match_reference(results, ref, loss_rtol=LOSS_RTOL, grad_rel=GRAD_REL, update_rel=UPDATE_REL)
    for result in results:
        check_held(result)
        assert result["compiled_graphs"] >= 1, "no graph was compiled: the run trained eagerly"
        unexpected = [r for r in result["graph_breaks"] if not any(a in r for a in allowed_breaks)]
        assert unexpected == [], result["graph_breaks"]  # dynamo's own count


def _fit(dist_pool, family: str, layout: str, allowed_breaks: tuple[str, ...] = (), **extra) -> None:
    """Train ``family`` at ``layout`` and check every rank against one compiled process."""
    strategy_kwargs, devices = LAYOUTS[layout]
    extra["strategy_kwargs"] = {**strategy_kwargs, **extra.get("strategy_kwargs", {})}
    results = dist_pool(devices).run(
        fit_and_record,
        family,
        devices=devices,
        steps=STEPS,
        global_batch=GLOBAL_BATCH,
        model_overrides=OVERRIDES,
        **extra,
    )
    reference = compiled_reference(family, inner=extra.get("compile_inner", False))
    expected = expected_shares(reference["held"], extra["strategy_kwargs"], devices)
    _check(results, reference, lambda result: check_share(result, expected, reference), allowed_breaks)


def _around_full_recompute(layout: str) -> tuple[str, ...]:
    return CHECKPOINT_BREAK if LAYOUTS[layout][0].get("activation_checkpointing") == "full" else ()


@pytest.mark.parametrize(
    "layout", [pytest.param(name, marks=pytest.mark.world_size(spec[1])) for name, spec in LAYOUTS.items()]
)
def test_compiled_layout_matches_one_compiled_process(dist_pool, layout):
    _fit(dist_pool, "gpt", layout, strategy_kwargs={"compile": INDUCTOR})


PIPELINED = ("p2", "p2-v2", "t2-p2")


@pytest.mark.parametrize(  # every layout compiles in the test above; half of them here (all: PTDP_FULL_MATRIX=1)
    "layout", [pytest.param(name, marks=pytest.mark.world_size(spec[1])) for name, spec in sampled(LAYOUTS.items(), 2)]
)
def test_blocks_the_user_compiled_before_fit(dist_pool, layout):
    """``block.compile()`` before ``Trainer.fit``: the setup probes run eagerly, then the blocks
    recompile over ptdp's rewrites."""
    _fit(dist_pool, "nanogpt", layout, _around_full_recompute(layout), compile_blocks=INDUCTOR)


@pytest.mark.world_size(2)
def test_lightning_module_compiled_whole_trains_with_compiled_blocks(dist_pool):
    """Lightning's guide, ``trainer.fit(torch.compile(model))``: Lightning refuses a compiled module
    under other strategies; ptdp puts the module back and compiles each block instead."""
    _fit(dist_pool, "llama", "t2", compile_whole=True)


@pytest.mark.parametrize(
    "layout",
    [
        pytest.param(name, marks=pytest.mark.world_size(spec[1]))
        for name, spec in sampled([item for item in LAYOUTS.items() if item[0] not in PIPELINED], 2)
    ],
)
def test_network_the_user_compiled_whole(dist_pool, layout):
    """``self.net = torch.compile(net)`` in the user's LightningModule: one graph over the network,
    ptdp's embedding, head and blocks inside it."""
    _fit(dist_pool, "llama", layout, _around_full_recompute(layout), compile_inner=True)


@pytest.mark.parametrize(
    "layout", [pytest.param(name, marks=pytest.mark.world_size(LAYOUTS[name][1])) for name in PIPELINED]
)
def test_network_compiled_whole_under_pipeline_breaks_only_where_a_chunk_ends(dist_pool, layout):
    """Under PP the network's forward stops where this rank's chunk ends (an exception dynamo does
    not trace): the same values, with graph breaks there and nowhere else. Compiling per block
    (``compile=``) has none."""
    _fit(dist_pool, "llama", layout, CHUNK_END_BREAK, compile_inner=True)


# the exchange's split sizes are values read back (counts), so ptdp runs it eagerly: one break where each
# MoE layer's block calls it, in code the layers share (dynamo traces it once). Dynamo counts that break
# once in every frame it unwinds from the block to the experts: transformers' checkpointing layer, its
# deprecation wrapper, the decoder layer and the sparse MoE block (Mixtral); the block alone (moe_llama).
EXCHANGE_BREAK = ("Skip calling `torch.compiler.disable()`d function",)
EXCHANGE_BREAKS = {"hf_mixtral": 4, "moe_llama": 1}


@pytest.mark.world_size(2)
@pytest.mark.parametrize("family", ["hf_mixtral", "moe_llama"])
def test_expert_parallel_compiles_around_the_exchange(dist_pool, family):
    """d2 e2 with ``compile=``: attention, norms and the router compiled, the all-to-all and the
    experts it feeds eager; the same values as one process with every block compiled."""
    results = dist_pool(2).run(
        fit_and_record,
        family,
        strategy_kwargs={"expert_parallel_size": 2, "compile": INDUCTOR},
        devices=2,
        steps=STEPS,
        global_batch=GLOBAL_BATCH,
    )
    key = (family, "blocks")
    if key not in _REFERENCES:
        _REFERENCES[key] = fit_and_record(family, steps=STEPS, global_batch=GLOBAL_BATCH, compile_blocks=INDUCTOR)
    ref = _REFERENCES[key]
    expected = expected_moe_shares(ref["held"], {"expert_parallel_size": 2}, 2)
    _check(results, ref, lambda result: check_moe_share(result, expected), EXCHANGE_BREAK)
    for result in results:  # one disabled function broke the graphs (each has its own reason), the exchange
        assert len(result["graph_breaks"]) == 1, result["graph_breaks"]
        assert list(result["graph_breaks"].values()) == [EXCHANGE_BREAKS[family]], result["graph_breaks"]
