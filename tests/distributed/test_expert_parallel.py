"""Expert parallelism against one process: transformers MoE families trained with their experts
split over e ranks of the data-parallel ones give the single process's losses, first gradients and
final weights, each rank holding only n_experts / e experts."""

from __future__ import annotations

import pytest

from tests.matrix import covering, sampled
from tests.real_models import MOE_FAMILIES
from tests.shares import EXPERT, check_moe_share, expected_moe_shares

LOSS_RTOL = 1e-5  # fp32, the same arithmetic up to summation order (test_real_models.py)
GRAD_REL = 1e-5
UPDATE_REL = 1e-3  # weights relative to their update under Adam (test_real_models.py)
STEPS = 3

LAYOUTS = {
    "t2": ({"tensor_parallel_size": 2}, 2),  # experts whole on both ranks (Megatron's expert TP size 1)
    "d2-e2": ({"expert_parallel_size": 2}, 2),
    "d4-e2": ({"expert_parallel_size": 2}, 4),
    "d4-e4": ({"expert_parallel_size": 4}, 4),
    "t2-d2-e2": ({"expert_parallel_size": 2, "tensor_parallel_size": 2}, 4),
    "t2-sp-d2-e2": ({"expert_parallel_size": 2, "tensor_parallel_size": 2, "sequence_parallel": True}, 4),
    "d4-e2-zero1": ({"expert_parallel_size": 2, "zero_stage": 1}, 4),
    "d2-e2-zero3": ({"expert_parallel_size": 2, "zero_stage": 3}, 2),
    "d4-e2-zero2": ({"expert_parallel_size": 2, "zero_stage": 2}, 4),
    "d4-e2-zero3": ({"expert_parallel_size": 2, "zero_stage": 3}, 4),
    "d2-e2-recompute": ({"expert_parallel_size": 2, "activation_checkpointing": "full"}, 2),
    "p2-d2-e2": (
        {"expert_parallel_size": 2, "pipeline_parallel_size": 2, "micro_batch_size": 2, "pipeline_schedule": "1f1b"},
        4,
    ),
    "t2-p2-d2-e2": (
        {
            "expert_parallel_size": 2,
            "tensor_parallel_size": 2,
            "pipeline_parallel_size": 2,
            "micro_batch_size": 2,
            "pipeline_schedule": "1f1b",
        },
        8,
    ),
}
_REFERENCES: dict[tuple, dict] = {}


def _reference(family: str, trainer_kwargs: dict | None = None) -> dict:
    from tests.fit_utils import fit_and_record

    key = (family, tuple(sorted((trainer_kwargs or {}).items())))
    if key not in _REFERENCES:
        _REFERENCES[key] = fit_and_record(family, steps=STEPS, trainer_kwargs=trainer_kwargs)
    return _REFERENCES[key]


def _check(results: list[dict], ref: dict, strategy_kwargs: dict, devices: int) -> None:
    """Equal to one process, and each rank holds 1/e of the experts (whole experts: rows of stacked
    tensors, or n/e modules of a ModuleList), the experts being most of the model; under PP each
    stage its own layers' experts; of the rest what the layout gives (tests/shares.py: under TP the
    dense matrices split t ways but the routers)."""
    from tests.fit_utils import assert_ranks_match_reference

    assert_ranks_match_reference(results, ref, loss_rtol=LOSS_RTOL, grad_rel=GRAD_REL, update_rel=UPDATE_REL)
    full = {name: n for name, (n, _) in ref["held"].items()}
    experts = sum(n for name, n in full.items() if EXPERT in name)
    assert experts > 0.5 * sum(full.values())  # the experts are most of the model: the split matters
    expected = expected_moe_shares(ref["held"], strategy_kwargs, devices)
    for result in results:
        check_moe_share(result, expected)


# every family at each 2-rank layout; the 4- and 8-rank ones on a rotation of them (tests/matrix.py);
# FULL_CASES: what PTDP_FULL_MATRIX=1 runs, the cells the documents' tables claim
WORLDS = {layout: world for layout, (_, world) in LAYOUTS.items()}
CASES = covering(sorted(MOE_FAMILIES), WORLDS)
FULL_CASES = covering(sorted(MOE_FAMILIES), WORLDS, full=True)


@pytest.mark.parametrize(
    "family, layout", [pytest.param(f, lay, marks=pytest.mark.world_size(LAYOUTS[lay][1])) for f, lay in CASES]
)
def test_expert_parallel_matches_single_process(dist_pool, family, layout):
    from tests.fit_utils import fit_and_record

    strategy_kwargs, devices = LAYOUTS[layout]
    results = dist_pool(devices).run(
        fit_and_record, family, strategy_kwargs=strategy_kwargs, devices=devices, steps=STEPS
    )
    _check(results, _reference(family), strategy_kwargs, devices)


@pytest.mark.world_size(2)
def test_gradient_clipping_takes_the_norm_over_every_expert(dist_pool):
    """A clip small enough to act on every step: the norm must include the other ranks' experts."""
    from tests.fit_utils import fit_and_record

    clip = {"gradient_clip_val": 0.05}
    results = dist_pool(2).run(
        fit_and_record,
        "hf_mixtral",
        strategy_kwargs={"expert_parallel_size": 2},
        devices=2,
        steps=STEPS,
        trainer_kwargs=clip,
    )
    _check(results, _reference("hf_mixtral", clip), {"expert_parallel_size": 2}, 2)


def fit_with_expert_load(dirpath: str) -> dict:
    """Mixtral at d2 e2, 2 steps, with ExpertLoad and PipelineTimeline (its traffic heatmap of step 1);
    beside them each step's tokens per expert on this rank, by layer, counted here from each router's
    logits (its top-k taken again), not from the exchange."""
    import functools
    from pathlib import Path

    import lightning.pytorch as L
    import torch

    from lightning_ptdp.callbacks import ExpertLoad, PipelineTimeline
    from lightning_ptdp.callbacks.png import read_png
    from tests.fit_utils import fit_and_record

    load = ExpertLoad()
    timeline = PipelineTimeline(step=1, dirpath=dirpath)
    logged: list[dict] = []
    traffic: list[dict] = []
    chosen: list[dict[str, torch.Tensor]] = []
    in_step: list[bool] = []

    def count(name: str, router: torch.nn.Module, args: tuple, output: tuple) -> None:
        if in_step:  # output: (logits, weights, indices); the indices are not read
            top = torch.topk(output[0], router.top_k, dim=-1).indices
            chosen[-1][name] = chosen[-1].get(name, 0) + torch.bincount(top.flatten(), minlength=router.num_experts)

    class Logged(L.Callback):
        def setup(self, trainer, pl_module, stage) -> None:
            for name, module in pl_module.named_modules():
                if name.endswith("mlp.gate"):
                    module.register_forward_hook(functools.partial(count, name))

        def on_train_batch_start(self, *args) -> None:  # not setup's probe forward
            chosen.append({})
            in_step.append(True)

        def on_train_batch_end(self, trainer, *args) -> None:
            logged.append(dict(load.metrics))
            traffic.append({k: v.tolist() for k, v in load.traffic.items()})
            in_step.clear()

    fit_and_record(
        "hf_mixtral",
        strategy_kwargs={"expert_parallel_size": 2},
        devices=2,
        steps=2,
        callbacks=[load, Logged(), timeline],
    )
    heatmap = [Path(p) for p in timeline.paths if p.name.endswith("_traffic.png")]
    return {
        "history": [{k: v.tolist() for k, v in step.items()} for step in load.history],
        "logged": logged,
        "traffic": traffic,
        "chosen": [{k: v.tolist() for k, v in step.items()} for step in chosen],
        "heatmap": read_png(heatmap[0].read_bytes())[3] if heatmap else None,
    }


@pytest.mark.world_size(2)
def test_expert_load_counts_every_routed_token_and_the_exchange(dist_pool, tmp_path):
    from lightning_ptdp.callbacks.timeline import _CELL, _LEFT, _TOP

    routed = 8 * 32 * 2  # global batch x sequence x top-2: every (token, expert) row, counted once
    hidden, fp32 = 32, 4
    local_rows = routed // 2  # one rank's rows; the most it can send off-rank in a forward, then take back
    results = dist_pool(2).run(fit_with_expert_load, str(tmp_path))
    for index in range(2):
        # the routers' own choices, both ranks' tokens summed, layer by layer (names sort by layer alike)
        chosen = [result["chosen"][index] for result in results]
        by_router = [[a + b for a, b in zip(chosen[0][name], chosen[1][name])] for name in sorted(chosen[0])]
        assert len(by_router) == 2 and all(sum(counts) == routed for counts in by_router)
        worst = max(max(c) / (sum(c) / len(c)) for c in by_router)
        for result in results:
            assert len(result["history"]) == 2 and len(result["logged"]) == 2
            step, logged = result["history"][index], result["logged"][index]
            assert [step[name] for name in sorted(step)] == by_router
            assert logged["moe/imbalance"] == pytest.approx(worst)
            assert 0 < logged["moe/all_to_all_bytes"] <= 2 * len(step) * 2 * local_rows * hidden * fp32
        # the traffic matrix from the routers' choices: rank i sends j the rows routed to j's experts (the
        # first half of them on rank 0), and sends back the rows j routed to i's, forward and backward
        links = [[0.0, 0.0], [0.0, 0.0]]
        layers = sorted(results[0]["traffic"][index])  # the experts modules, in the routers' order
        for name, layer in zip(sorted(chosen[0]), layers):
            half = len(chosen[0][name]) // 2
            to = [[sum(c[name][:half]), sum(c[name][half:])] for c in chosen]  # to[i][j]: rows i routed to j
            for i, j in ((0, 1), (1, 0)):
                links[i][j] += 2 * (to[i][j] + to[j][i]) * hidden * fp32
            link = 2.0 * (to[0][1] + to[1][0]) * hidden * fp32  # at e = 2 a link carries as much each way
            assert results[0]["traffic"][index][layer] == [[0.0, link], [link, 0.0]]
        busiest = max(links[0][1], links[1][0])
        assert results[0]["logged"][index]["moe/busiest_link_bytes"] == busiest
        rows = [sum(sum(c[n][:half]) for c in chosen for n in c), sum(sum(c[n][half:]) for c in chosen for n in c)]
        assert results[0]["logged"][index]["moe/rank_imbalance"] == pytest.approx(max(rows) / (sum(rows) / 2))
    # the heatmap of step 1: the off-diagonal cells red, darker where more bytes went; the diagonal white
    pixels = results[0]["heatmap"]
    assert pixels is not None and results[1]["heatmap"] is None  # rank 0 writes it

    def red(i: int, j: int) -> tuple:
        row = pixels[_TOP + i * _CELL + 4]
        x = 3 * (_LEFT + j * _CELL + _CELL - 6)
        return tuple(row[x : x + 3])

    assert red(0, 0) == red(1, 1) == (255, 255, 255)
    assert red(0, 1) == red(1, 0) == (160, 30, 30)  # the busiest link, darkest


STEPS_PER_EPOCH = 4


def run_moe_epochs(
    devices: int,
    e: int,
    epochs: int,
    save: str | None,
    resume: str | None,
    fmt: str = "sharded",
    family: str = "",
    zero: int = 0,
    layout: dict | None = None,
):
    """``family`` for ``epochs`` epochs on ``devices`` ranks at e (and ``layout``: t, p), d the rest;
    the per-step losses (the global-batch mean)."""
    import lightning as L

    from lightning_ptdp import PTDPStrategy
    from recipes.data import MarkovDataModule
    from tests.fit_utils import LossRecorder, quiet_trainer
    from tests.models import build_model

    L.seed_everything(0, verbose=False)
    model = build_model(family)
    tokens = STEPS_PER_EPOCH * 8 * 33 + 1
    layout = layout or {}
    replicas = devices // (layout.get("tensor_parallel_size", 1) * layout.get("pipeline_parallel_size", 1))
    data = MarkovDataModule(vocab_size=64, seq_length=32, batch_size=8 // replicas, train_tokens=tokens, val_tokens=100)
    strategy = PTDPStrategy(expert_parallel_size=e, checkpoint_format=fmt, zero_stage=zero, **layout)
    recorder = LossRecorder()
    trainer = quiet_trainer(devices=devices, strategy=strategy, max_epochs=epochs, callbacks=[recorder])
    trainer.fit(model, data, ckpt_path=resume)
    if save is not None:
        trainer.save_checkpoint(save)
    return recorder.losses


_UNINTERRUPTED: dict[str, tuple[list, str]] = {}


def uninterrupted(dist_pool, tmp_path_factory, family: str) -> tuple[list, str]:
    """``family`` trained 2 epochs at d2 without EP, what every resumed run must continue: its per-step
    losses and its final checkpoint. Once a session, shared by the MoE resume tests (test_expert_balance.py's too)."""
    if family not in _UNINTERRUPTED:
        end = str(tmp_path_factory.mktemp(f"uninterrupted-{family}") / "end.ckpt")
        _UNINTERRUPTED[family] = (dist_pool(2).run(run_moe_epochs, 2, 1, 2, end, None, family=family)[0], end)
    return _UNINTERRUPTED[family]


@pytest.mark.world_size(2)
@pytest.mark.parametrize(  # sharded: each storage of experts (ModuleList modules; stacked rows: full run); full: one
    ("family", "fmt"), sampled([("moe_llama", "sharded"), ("hf_mixtral", "sharded"), ("hf_mixtral", "full")], 2)
)
def test_checkpoints_resume_with_e_changed(dist_pool, tmp_path, tmp_path_factory, fmt, family):
    """Saved at d2 e2 (each rank writing its experts: rows of stacked tensors, or its modules of a
    ModuleList), resumed at e2, at e1 (every rank holding all experts) and at d4 e4: the losses
    continue as if uninterrupted (fp32: within LOSS_RTOL)."""
    from lightning_ptdp.checkpoint.command import consolidate
    from tests.distributed.test_resume import assert_same_training_state

    path = str(tmp_path / "moe.ckpt")
    whole, end = uninterrupted(dist_pool, tmp_path_factory, family)
    first = dist_pool(2).run(run_moe_epochs, 2, 2, 1, path, None, fmt, family)[0]
    assert first == pytest.approx(whole[:STEPS_PER_EPOCH], rel=LOSS_RTOL)
    if fmt == "sharded":
        saved = consolidate(path)  # put together with no process group: every expert, and its Adam moments
        names = {
            "hf_mixtral": "net.model.model.layers.0.mlp.experts.gate_up_proj",
            "moe_llama": "net.layers.0.moe.experts.3.w1.weight",
        }
        name = names[family]
        assert family != "hf_mixtral" or saved["state_dict"][name].shape[0] == 4
        assert saved["optimizer_states"][0]["state"][name]["exp_avg"].shape == saved["state_dict"][name].shape
    for devices, e in ((2, 2), (2, 1), (4, 4)):  # then the weights and optimizer state at the end, whole
        resumed = str(tmp_path / f"d{devices}-e{e}.ckpt")
        losses = dist_pool(devices).run(run_moe_epochs, devices, e, 2, resumed, path, fmt, family)[0]
        assert losses == pytest.approx(whole[STEPS_PER_EPOCH:], rel=LOSS_RTOL), (devices, e)
        assert_same_training_state(resumed, end, path)


@pytest.mark.world_size(4)
def test_a_moe_checkpoint_resumes_with_t_and_p_changed(dist_pool, tmp_path, tmp_path_factory):
    """Saved at d2 e2 (sharded: each rank its experts), resumed at t2 d2 e2 and at p2 d2 e2 (4 ranks):
    the losses continue as if uninterrupted (fp32: within LOSS_RTOL)."""
    from tests.distributed.test_resume import assert_same_training_state

    path = str(tmp_path / "moe.ckpt")
    whole, end = uninterrupted(dist_pool, tmp_path_factory, "hf_mixtral")
    dist_pool(2).run(run_moe_epochs, 2, 2, 1, path, None, "sharded", "hf_mixtral")
    pipelined = {"pipeline_parallel_size": 2, "micro_batch_size": 2, "pipeline_schedule": "1f1b"}
    for name, layout in (("t2", {"tensor_parallel_size": 2}), ("p2", pipelined)):
        resumed = str(tmp_path / f"{name}.ckpt")
        results = dist_pool(4).run(run_moe_epochs, 4, 2, 2, resumed, path, "sharded", "hf_mixtral", 0, layout)
        losses = next(r for r in results if r)  # under PP the last stage records them
        assert losses == pytest.approx(whole[STEPS_PER_EPOCH:], rel=LOSS_RTOL), layout
        assert_same_training_state(resumed, end, path)  # the weights and optimizer state at the end, whole


def expert_optimizer_state(devices: int, e: int) -> dict:
    """Mixtral at d=devices, e, ZeRO-1, one step: the Adam moments this rank holds, experts and the rest."""
    import lightning as L

    from lightning_ptdp.data_parallel.zero1 import local_optimizer
    from tests.fit_utils import fit_and_record

    held = {"experts": 0, "dense": 0}

    class Count(L.Callback):
        def on_train_end(self, trainer, pl_module) -> None:
            local = local_optimizer(trainer.strategy.optimizers[0])
            names = {id(p): n for n, p in pl_module.named_parameters()}
            for group in local.param_groups:
                for param in group["params"]:
                    kind = "experts" if EXPERT in names[id(param)] else "dense"
                    held[kind] += local.state[param]["exp_avg"].numel()

    kwargs = {"expert_parallel_size": e, "zero_stage": 1}
    fit_and_record("hf_mixtral", strategy_kwargs=kwargs, devices=devices, steps=1, callbacks=[Count()])
    return held


@pytest.mark.world_size(4)
def test_zero1_shards_the_experts_state_over_the_ranks_sharing_them_and_resumes_on_another_layout(
    dist_pool, tmp_path, tmp_path_factory
):
    """d4 e2 ZeRO-1: each rank holds Adam moments for 1/d of the experts (its 1/e of them,
    sharded over the d/e ranks holding them) and 1/d of the rest; saved there (sharded; also full
    under PTDP_FULL_MATRIX=1), resumed at d2 e2 without ZeRO and at d4 e2 ZeRO-1, the losses continue as if uninterrupted."""
    held = dist_pool(4).run(expert_optimizer_state, 4, 2)
    experts, dense = sum(h["experts"] for h in held), sum(h["dense"] for h in held)
    ref = _reference("hf_mixtral")["held"]
    assert experts == sum(n for name, (n, _) in ref.items() if EXPERT in name)  # every expert's moments once
    assert dense == sum(n for name, (n, _) in ref.items() if EXPERT not in name)  # every dense moment once
    # exactly 1/d: torch's greedy split, largest first, of a rank's [gate_up, down] x 2 layers (sizes
    # 2u, 2u, u, u) over the 2 ranks holding the same experts gives each 2u + u
    assert [h["experts"] for h in held] == [experts // 4] * 4
    from tests.distributed.test_resume import assert_same_training_state

    whole, end = uninterrupted(dist_pool, tmp_path_factory, "hf_mixtral")
    for fmt in sampled(("sharded", "full"), 2):  # full files with e changed: test_checkpoints_resume_with_e_changed
        path = str(tmp_path / f"zero1-{fmt}.ckpt")
        first = dist_pool(4).run(run_moe_epochs, 4, 2, 1, path, None, fmt, "hf_mixtral", 1)[0]
        assert first == pytest.approx(whole[:STEPS_PER_EPOCH], rel=LOSS_RTOL)
        for devices, zero in ((4, 1), (2, 0)):  # then the weights and optimizer state at the end, whole
            resumed = str(tmp_path / f"{fmt}-d{devices}-zero{zero}.ckpt")
            losses = dist_pool(devices).run(run_moe_epochs, devices, 2, 2, resumed, path, fmt, "hf_mixtral", zero)[0]
            assert losses == pytest.approx(whole[STEPS_PER_EPOCH:], rel=LOSS_RTOL), (fmt, devices, zero)
            assert_same_training_state(resumed, end, path)


def fit_with_timeline(dirpath: str) -> dict:
    """Mixtral at p2 d2 e2, m=2 (1F1B): the timeline of the second training step on rank 0."""
    import json
    from pathlib import Path

    from lightning_ptdp.callbacks import PipelineTimeline
    from lightning_ptdp.callbacks.png import read_png
    from tests.fit_utils import fit_and_record

    callback = PipelineTimeline(step=1, dirpath=dirpath)
    fit_and_record("hf_mixtral", strategy_kwargs=LAYOUTS["p2-d2-e2"][0], devices=4, steps=2, callbacks=[callback])
    if not callback.paths:
        return {}
    _, _, _, rows = read_png(Path(dirpath, "pipeline_step1.png").read_bytes())
    return {"trace": json.loads(Path(dirpath, "pipeline_step1.json").read_text()), "rows": rows}


@pytest.mark.world_size(4)
def test_pipeline_timeline_shows_the_all_to_all(dist_pool, tmp_path):
    from lightning_ptdp.callbacks.timeline import _EXCHANGE, _ROW, _TOP

    first = dist_pool(4).run(fit_with_timeline, str(tmp_path))[0]
    events = [e for e in first["trace"]["traceEvents"] if e["ph"] == "X" and e["tid"] == "ep comm"]
    # every rank: its stage's one MoE layer, 2 microbatches, a dispatch and a combine each (forward)
    assert sorted({e["pid"] for e in events}) == [0, 1, 2, 3]
    assert all(sum(e["pid"] == rank for e in events) == 4 for rank in range(4))
    assert all(e["name"] == "all-to-all" for e in events)
    for pp in range(2):  # the strip above each pipeline rank's row
        row = first["rows"][_TOP + pp * _ROW + 5]
        assert _EXCHANGE in {tuple(row[i : i + 3]) for i in range(0, len(row), 3)}, pp


@pytest.mark.world_size(2)
def test_a_models_own_load_balancing_loss_sees_each_ranks_tokens_as_under_ddp(dist_pool):
    """Mixtral trained with its own auxiliary load-balancing loss (computed from the router logits of
    the tokens in one forward): at d2 e2 each rank balances its own tokens, as Lightning's DDP at d2
    does; the same losses, first gradients and final weights (fp32: LOSS_RTOL, GRAD_REL, UPDATE_REL)."""
    from tests.fit_utils import fit_and_record

    kwargs = dict(devices=2, steps=STEPS)
    ddp = dist_pool(2).run(fit_and_record, "hf_mixtral_balanced", lightning_strategy="ddp", **kwargs)
    ep = dist_pool(2).run(fit_and_record, "hf_mixtral_balanced", strategy_kwargs={"expert_parallel_size": 2}, **kwargs)
    single = _reference("hf_mixtral_balanced")
    apart = max(abs(a / b - 1) for a, b in zip(ddp[0]["losses"], single["losses"]))
    assert apart > 10 * LOSS_RTOL  # the balancing term sees the batch: a global one would fail the check below
    _check(ep, ddp[0], {"expert_parallel_size": 2}, 2)


@pytest.mark.world_size(2)
@pytest.mark.parametrize(
    "family, plan",
    [
        ("hf_mixtral", {"net.model.model.layers.*.mlp.experts": "experts"}),
        ("moe_llama", {"net.layers.*.moe": "expert_list", "net.layers.*.attention": "dense"}),
    ],
)
def test_an_explicit_ep_plan_trains_as_one_process(dist_pool, family, plan):
    """ep_plan naming the experts (and a module to keep dense) through the strategy: d2 e2 equal to
    one process, as discovery's own choice is."""
    from tests.fit_utils import fit_and_record

    kwargs = {"expert_parallel_size": 2, "ep_plan": plan}
    results = dist_pool(2).run(fit_and_record, family, strategy_kwargs=kwargs, devices=2, steps=STEPS)
    _check(results, _reference(family), kwargs, 2)


# torchtitan's own GroupedExperts forward (its grouped GEMMs cast rows and weights to bf16 whatever the
# model's dtype), bf16-mixed, against the single-process bf16 run within test_bf16.py's noise floor;
# test_bf16.py runs d2-e2
TITAN_BF16_LAYOUTS = ("d4-e4", "t2-d2-e2", "p2-d2-e2")


@pytest.mark.parametrize(
    "layout", [pytest.param(lay, marks=pytest.mark.world_size(LAYOUTS[lay][1])) for lay in TITAN_BF16_LAYOUTS]
)
def test_torchtitan_grouped_experts_in_bf16_within_the_noise_floor(dist_pool, layout):
    """The same check as test_bf16.py's: each step's loss and the final weights within a multiple of
    how far the single-process bf16 run moves when only its rounding order changes."""
    from tests.distributed.test_bf16 import GLOBAL_BATCH, bf16_mismatches, reference
    from tests.distributed.test_bf16 import STEPS as BF16_STEPS
    from tests.fit_utils import fit_and_record

    strategy_kwargs, devices = LAYOUTS[layout]
    family, precision = "titan_qwen3_moe_bf16", "bf16-mixed"
    results = dist_pool(devices).run(
        fit_and_record,
        family,
        strategy_kwargs=strategy_kwargs,
        devices=devices,
        steps=BF16_STEPS,
        global_batch=GLOBAL_BATCH,
        trainer_kwargs={"precision": precision},
    )
    ref, floor, _ = reference(precision, family)
    state = next(result["state"] for result in results if result["state"])
    for result in results:  # every rank reports the global-batch loss
        found = bf16_mismatches({**result, "state": result["state"] or state}, ref, floor)
        assert not found, f"floor: loss {floor['loss']:.1e}, weights {floor['weights']:.1e}; " + "; ".join(found)
