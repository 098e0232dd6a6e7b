"""The dry run (planner/meta_run.py) against the real run it predicts: each rank's parameter, gradient
and optimizer-state bytes after two steps equal what the same layout holds on real gloo ranks, a
large model is dry-run without real storage, and bad input is refused with the rule and the fix."""

from __future__ import annotations

import resource

import lightning as L
import pytest
import torch
import torch.nn.functional as F

LAYOUTS = [{}, {"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}, {"zero_stage": 1}, {"zero_stage": 3}]


def tiny_gpt(hidden: int = 32, layers: int = 2, vocab: int = 128):
    """The recipe GPT built in configure_model (on meta under ptdp), with its data."""
    from recipes.data import MarkovDataModule
    from recipes.gpt import GPTConfig, GPTLightningModule, OptimConfig

    torch.manual_seed(0)
    config = GPTConfig(vocab_size=vocab, seq_length=16, num_layers=layers, num_heads=4, hidden_size=hidden)
    model = GPTLightningModule(config, OptimConfig(lr=1e-3, warmup_steps=1, max_steps=4), deferred_init=True)
    data = MarkovDataModule(vocab_size=vocab, seq_length=16, batch_size=2, train_tokens=400, val_tokens=40)
    return model, data


def _bytes(tensor) -> int:
    if tensor is None:
        return 0
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def held_after_two_steps(layout: dict) -> dict:
    """On a real gloo rank: the bytes of this rank's parameters, gradients and optimizer state
    after the second optimizer step, as the dry run counts them."""

    from lightning_ptdp import PTDPStrategy
    from lightning_ptdp.data_parallel.zero1 import local_optimizer
    from lightning_ptdp.testing import quiet_trainer

    class Held(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == 1:
                states = [s for o in trainer.optimizers for s in local_optimizer(o).state.values()]
                self.held = {
                    "parameters": sum(_bytes(p) for p in pl_module.parameters()),
                    "gradients": sum(_bytes(p.grad) for p in pl_module.parameters()),
                    "optimizer": sum(_bytes(v) for s in states for v in s.values() if isinstance(v, torch.Tensor)),
                }

    model, data = tiny_gpt()
    held = Held()
    trainer = quiet_trainer(devices=2, strategy=PTDPStrategy(**layout), max_steps=2, callbacks=[held])
    trainer.fit(model, data)
    return held.held


@pytest.mark.world_size(2)
@pytest.mark.parametrize("layout", LAYOUTS, ids=["d2", "t2", "p2", "d2-zero1", "d2-zero3"])
def test_dry_run_holds_what_the_real_ranks_hold(dist_pool, layout):
    from lightning_ptdp.planner.meta_run import dry_run_layout

    real = dist_pool(2).run(held_after_two_steps, layout)
    report = dry_run_layout(tiny_gpt, layout, world_size=2)
    assert report.refused is None
    for predicted in report.ranks:
        for rank in predicted.like:
            # the same tensors, so the same bytes: exact
            assert (predicted.parameters, predicted.gradients, predicted.optimizer) == (
                real[rank]["parameters"],
                real[rank]["gradients"],
                real[rank]["optimizer"],
            ), f"rank {rank} under {layout}"
    assert report.largest.activations > 0
    if layout.keys() <= {"zero_stage"} and layout.get("zero_stage", 0) < 2:  # d2 under DDP (FSDP2 has no buckets)
        assert report.ranks[0].ddp_buckets == report.ranks[0].gradients  # DDP's own copy of them
        assert report.communication.get("dp", 0) > 0


def test_a_model_larger_than_memory_is_dry_run_without_storage():
    from lightning_ptdp.planner.meta_run import dry_run_layout

    hidden, layers = 1024, 8  # ~100M parameters: 1.6 GB of weights, gradients and Adam state if real
    factory = lambda: tiny_gpt(hidden=hidden, layers=layers, vocab=8192)  # noqa: E731
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    report = dry_run_layout(factory, {}, world_size=1)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    state = report.ranks[0].state
    assert state > 1.2e9  # what a real rank would hold
    assert grown < 0.25 * state, f"the dry run grew the process by {grown / 1e6:.0f} MB for {state / 1e6:.0f} MB"


def _no_training_step():

    return L.LightningModule()


def test_bad_input_is_refused_with_the_rule():
    from lightning_ptdp.planner.fit import dry_run, load_factory

    with pytest.raises(TypeError, match="is not callable"):
        dry_run(42, devices=2)
    with pytest.raises(ValueError, match="is not MODULE:FACTORY"):
        load_factory("no_colon")
    with pytest.raises(ValueError, match="has no 'missing'"):
        load_factory("tests.distributed.test_dry_run:missing")
    with pytest.raises(ValueError, match=r"does not tile the world of 4 ranks.*t \* p \* c \* d == 4"):
        dry_run(tiny_gpt, devices=4, layouts=[{"tensor_parallel_size": 3}])
    with pytest.raises(TypeError, match="defines no training_step"):
        dry_run(_no_training_step, devices=2, layouts=[{}])
    with pytest.raises(ValueError, match=r"the factory _failing_factory raised OSError: no such file; it must build"):
        dry_run(_failing_factory, devices=2, layouts=[{}])


def _failing_factory():
    raise OSError("no such file")


class _SizedByABuffer(L.LightningModule):
    """A step whose slice length is a buffer's value: on meta it reads 0, and the step fails."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.register_buffer("keep", torch.tensor(4))

    def training_step(self, batch, batch_idx):
        kept = batch[0][:, : int(self.keep)]
        return self.proj(kept.repeat(1, 2)).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=4)


def test_a_step_that_needs_values_names_the_buffer_it_read():
    from lightning_ptdp.planner.meta_run import MetaRunError, dry_run_layout

    with pytest.raises(MetaRunError, match=r"__int__ of buffer 'keep' at .*test_dry_run.py:\d+ \(kept = batch"):
        dry_run_layout(_SizedByABuffer, {}, world_size=2)


def test_a_layout_setup_refuses_is_listed_with_its_reason():
    from lightning_ptdp.planner.fit import dry_run, format_dry_run

    reports = dry_run(tiny_gpt, devices=4, layouts=[{"pipeline_parallel_size": 4}, {"tensor_parallel_size": 2}])
    assert reports[0].refused is None and reports[1].refused is not None
    assert "pipeline_parallel_size(4)" in reports[1].refused
    table = format_dry_run(reports)
    assert "refused: " in table and "best: Trainer(strategy=PTDPStrategy(tensor_parallel_size=2)" in table


def test_a_layout_that_does_not_fit_names_the_rank_its_holders_and_one_that_fits():
    from lightning_ptdp.planner.fit import GIB, check_fits
    from lightning_ptdp.planner.meta_run import dry_run_layout

    whole = dry_run_layout(tiny_gpt, {}, world_size=2).largest.peak
    split = dry_run_layout(tiny_gpt, {"zero_stage": 3}, world_size=2).largest.peak
    assert split < whole  # ZeRO-3 divides the state over d: a limit between the two fits only the split ones
    limit = (whole + split) / 2 / GIB
    with pytest.raises(
        ValueError, match=r"rank 0 \(and ranks \[0, 1\]\) would hold .* largest holders: gpt\..*a layout that fits: "
    ):
        check_fits(tiny_gpt, {}, devices=2, device_memory_gb=limit)
    assert check_fits(tiny_gpt, {"zero_stage": 3}, devices=2, device_memory_gb=limit).fits(limit * GIB)


def test_layouts_rank_by_the_cost_models_step_time_over_the_flops_and_collectives_of_the_step():
    from lightning_ptdp.planner.cost import Cluster
    from lightning_ptdp.planner.fit import dry_run, step_seconds
    from lightning_ptdp.planner.meta_run import dry_run_layout

    one = dry_run_layout(tiny_gpt, {}, world_size=1).ranks[0].flops
    # the batch is per rank: a d2 rank does one process's step, a t2 rank half of every matmul (the embedding aside)
    assert dry_run_layout(tiny_gpt, {}, world_size=2).largest.flops == one
    assert dry_run_layout(tiny_gpt, {"tensor_parallel_size": 2}, world_size=2).largest.flops == pytest.approx(
        one / 2, rel=0.1
    )
    cluster = Cluster.h100(2, gpus_per_node=2)
    reports = dry_run(tiny_gpt, devices=2, cluster=cluster)
    times = [step_seconds(r, cluster) for r in reports if r.refused is None]
    assert times == sorted(times) and times[0] > 0
    data_parallel = next(r for r in reports if r.layout == {"tensor_parallel_size": 1, "pipeline_parallel_size": 1})
    assert [c[:3] for c in data_parallel.largest.collectives] == [("dp", "all_reduce", 2)]  # DDP's, timed


def test_a_mask_of_top_k_routing_choices_takes_the_balanced_share_on_meta():
    """An expert loop picks each expert's rows by value; on meta a mask comparing top-k choices with
    expert ids holds 1/n of its elements (balanced routing), any other mask its upper bound."""
    from lightning_ptdp.planner.meta_device import MetaCalls, MetaShapes

    scores = torch.empty(64, 8, device="meta")
    with MetaShapes(MetaCalls()):
        _, chosen = torch.topk(scores, 2)
        token, slot = torch.where(chosen == 3)
        per_expert = [torch.where(mask)[0].shape[0] for mask in F.one_hot(chosen, 8).permute(2, 1, 0)]
        anything = torch.nonzero(scores > 0)
    assert token.shape[0] == 64 * 2 // 8 and per_expert == [16] * 8
    assert anything.shape[0] == 64 * 8


def test_counts_of_top_k_routing_choices_read_as_split_sizes_are_balanced_on_meta():
    """A grouped MoE reads its tokens per expert (a routing mask summed over tokens, or a bincount of
    the choices) with ``tolist`` to cut its rows: on meta the counts hold their balanced values, and
    what is computed from them alone (a cumsum) too; a value nothing routed stays unknown (0, named)."""
    from lightning_ptdp.planner.meta_device import MetaCalls, MetaShapes

    scores = torch.empty(64, 8, device="meta")
    reads = MetaCalls()
    with reads, MetaShapes(reads):
        _, chosen = torch.topk(scores, 2)
        routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, chosen, True)
        summed = routing_map.sum(dim=0).tolist()
        ends = torch.cumsum(torch.bincount(chosen.view(-1), minlength=8), dim=0).tolist()
        pieces = [
            p.shape[0]
            for p in torch.empty(128, 4, device="meta").split(torch.bincount(chosen.view(-1), minlength=8).tolist())
        ]
        unknown = scores.sum().item()
    assert summed == [16] * 8 and ends == [16 * (i + 1) for i in range(8)] and pieces == [16] * 8
    assert unknown == 0 and len(reads.seen) == 1 and "item" in reads.seen[0]


def test_autocast_casts_on_meta_are_the_ones_torch_makes_on_the_cpu():
    """CPU autocast does not touch meta tensors; the dry run asks torch which arguments autocast
    copies and casts those on meta: a matmul's inputs to bf16 (an fp32 weight with bf16 rows too),
    a loss's to fp32, and nothing for an op autocast leaves alone."""
    from lightning_ptdp.planner.meta_device import MetaCalls

    rows = torch.empty(8, 16, device="meta")
    weight = torch.empty(32, 16, device="meta")
    with MetaCalls(), torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = F.linear(rows, weight)
        mixed = F.linear(hidden[:, :16], weight)  # bf16 rows, fp32 weight
        loss = F.cross_entropy(hidden, torch.zeros(8, dtype=torch.long, device="meta"))
        summed = rows + rows
    assert (hidden.dtype, mixed.dtype, loss.dtype, summed.dtype) == (
        torch.bfloat16,
        torch.bfloat16,
        torch.float32,
        torch.float32,
    )
    with MetaCalls():  # autocast off: nothing cast
        assert F.linear(rows, weight).dtype == torch.float32


class _SavesItsInput(torch.autograd.Function):
    """A custom Function (sequence parallelism's Linear is one) that saves its fp32 input: autocast
    casts inside its forward, as temporaries, not the arguments it saves."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        return grad.to(x.dtype) @ weight, None


def _overridable_linear(x, weight):
    from torch.overrides import handle_torch_function, has_torch_function_variadic

    if has_torch_function_variadic(x, weight):
        return handle_torch_function(_overridable_linear, (x, weight), x, weight)
    return _SavesItsInput.apply(x, weight)


def test_autocast_on_meta_casts_inside_a_function_of_another_package_not_its_arguments():
    from lightning_ptdp.planner.meta_device import MetaCalls, MetaShapes

    rows = torch.empty(8, 16, device="meta", requires_grad=True)
    weight = torch.empty(32, 16, device="meta")
    reads = MetaCalls()
    with reads, MetaShapes(reads), torch.autocast("cpu", dtype=torch.bfloat16):
        out = _overridable_linear(rows, weight)
    assert out.dtype == torch.bfloat16  # its matmul cast at dispatch
    x, saved_weight = out.grad_fn.saved_tensors
    assert x.dtype == saved_weight.dtype == torch.float32  # what it saved: its own arguments, uncast


def test_a_mixed_precision_dry_run_holds_the_step_in_bf16_and_the_state_in_fp32():
    """``precision="bf16-mixed"`` runs the dry run's step under the CPU's autocast: the state it
    predicts is fp32's (Lightning's mixed precision keeps fp32 weights), and its activations hold
    each matmul weight's bf16 copy until its backward, as autocast's casts do (fp32's hold none)."""
    from functools import partial

    from lightning_ptdp.planner.meta_run import dry_run_layout

    factory = partial(tiny_gpt, hidden=256)  # matmul activations dominate, as in any real model
    full = dry_run_layout(factory, {}, world_size=2).largest
    mixed = dry_run_layout(factory, {}, world_size=2, precision="bf16-mixed").largest
    assert mixed.state == full.state
    assert full.activations < full.parameters // 2 <= mixed.activations
