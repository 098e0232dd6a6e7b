"""Run ``Trainer.fit`` on a zoo model and record what the equivalence tests compare.

Module-level functions, so the same code runs in the single-process reference (in the test
process) and on every rank of a ``DistributedPool``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import lightning as L
import torch
from torch.utils.data import DataLoader, DistributedSampler

from lightning_ptdp.data_parallel.zero1 import local_optimizer
from lightning_ptdp.testing import quiet_trainer
from recipes.data import MarkovDataModule
from tests.models import build_model
from tests.shares import held_dims

VOCAB, SEQ = 64, 32


class LossRecorder(L.Callback):
    """Per-step training loss, reduced over data-parallel replicas (the global-batch mean), and
    the gradients of the first step as the optimizer sees them (after any dp reduction)."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.first_grads: dict[str, torch.Tensor] = {}

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if not self.first_grads:
            from lightning_ptdp.expert_parallel import gather_experts
            from lightning_ptdp.tensor_parallel.consolidate import full_gradients

            grads = gather_experts(pl_module, full_gradients(pl_module))  # split experts whole again
            self.first_grads = {name: g.detach().cpu().clone() for name, g in grads.items()}

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs["loss"].detach()
        self.losses.append(float(trainer.strategy.reduce(loss, reduce_op="mean")))


def zoo_data(batch_size: int, train_tokens: int, val_tokens: int) -> MarkovDataModule:
    """The embedded corpus at the zoo models' vocabulary and context, in order (no shuffle)."""
    return MarkovDataModule(
        vocab_size=VOCAB,
        seq_length=SEQ,
        batch_size=batch_size,
        shuffle=False,
        train_tokens=train_tokens,
        val_tokens=val_tokens,
    )


def strategy_from(strategy_kwargs: dict | None) -> Any:
    """PTDPStrategy(**kwargs), or Lightning's default single-process strategy for ``None``."""
    from lightning_ptdp import PTDPStrategy

    return PTDPStrategy(**strategy_kwargs) if strategy_kwargs is not None else "auto"


def use_distributed_order(datamodule: MarkovDataModule, seed: int) -> None:
    """Make a single-process run read samples in the order Lightning's DistributedSampler gives
    the union of all replicas: a training loader is always shuffled with ``randperm(seed + epoch)``
    when distributed, and that permutation does not depend on the number of replicas."""

    def train_dataloader() -> DataLoader:
        sampler = DistributedSampler(datamodule.train_set, num_replicas=1, rank=0, shuffle=True, seed=seed)
        return DataLoader(datamodule.train_set, batch_size=datamodule.batch_size, sampler=sampler, drop_last=True)

    datamodule.train_dataloader = train_dataloader


def fit_and_record(
    family: str,
    *,
    strategy_kwargs: dict | None = None,
    devices: int = 1,
    global_batch: int = 8,
    steps: int = 20,
    seed: int = 0,
    model_overrides: dict | None = None,
    tp_plan: dict | None = None,
    trainer_kwargs: dict | None = None,
    accumulate: int = 1,
    callbacks: list | None = None,
    compile_blocks: dict | None = None,
    compile_whole: bool = False,
    compile_inner: bool = False,
    lightning_strategy: str | None = None,
    prepare: Callable[[L.LightningModule], None] | None = None,
) -> dict[str, Any]:
    """Train ``steps`` steps; return per-step losses, first-step gradients, initial and final
    state_dicts (CPU copies).

    ``strategy_kwargs=None`` is the single-process reference (Lightning's default strategy).
    ``compile_blocks``: torch.compile arguments for ``block.compile(...)`` on every block before fit,
    as a user compiles; ``compile_whole``: ``torch.compile(lightning_module)`` as Lightning's guide says;
    ``compile_inner``: the LightningModule's network replaced by ``torch.compile(network)``.
    ``accumulate``: the same global batches in that many equal parts (``accumulate_grad_batches``),
    the same samples in the same order; losses are still one per optimizer step.
    ``lightning_strategy``: one of Lightning's own strategies by name ("ddp"), as a reference.
    ``prepare``: called on the built model before fit (a reference's own conversion, e.g. torchao's float8).
    """
    import torch._dynamo
    from torch._dynamo.utils import counters

    from lightning_ptdp import ParallelConfig, PTDPStrategy

    torch._dynamo.reset()  # compiled code and dynamo's own counts are process-wide: this fit's alone
    counters.clear()
    L.seed_everything(seed, verbose=False)
    model = build_model(family, **(model_overrides or {}))
    if compile_inner:
        name = "gpt" if family == "gpt" else "net"
        setattr(model, name, torch.compile(getattr(model, name), backend="inductor"))
    initial = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    if prepare is not None:
        prepare(model)
    if compile_blocks is not None:
        from lightning_ptdp.core.blocks import find_block_lists

        for _, blocks in find_block_lists(model):
            for block in blocks:
                block.compile(**compile_blocks)
    replicas = 1
    strategy: Any = "auto"
    if lightning_strategy is not None:
        strategy, replicas = lightning_strategy, devices
    if strategy_kwargs is not None:
        layout = {f.name for f in dataclasses.fields(ParallelConfig)}
        config = ParallelConfig(**{k: v for k, v in strategy_kwargs.items() if k in layout})
        replicas = devices // (
            config.tensor_parallel_size * config.pipeline_parallel_size * config.context_parallel_size
        )
        # full: "state" is compared with the whole single-process model, not this rank's pieces
        strategy = PTDPStrategy(**{"checkpoint_format": "full", **strategy_kwargs}, tp_plan=tp_plan)
    if global_batch % (replicas * accumulate):
        raise ValueError(f"global_batch={global_batch} is not {replicas} replicas x {accumulate} equal parts")
    datamodule = zoo_data(
        global_batch // (replicas * accumulate), (steps + 1) * global_batch * (SEQ + 1), 4 * (SEQ + 1)
    )
    if strategy_kwargs is None and lightning_strategy is None:
        use_distributed_order(datamodule, seed)
    recorder = LossRecorder()
    extra = {"accumulate_grad_batches": accumulate} if accumulate > 1 else {}
    trainer = quiet_trainer(
        devices=devices,
        strategy=strategy,
        max_steps=steps,
        callbacks=[recorder, *(callbacks or [])],
        **extra,
        **(trainer_kwargs or {}),
    )
    trainer.fit(torch.compile(model) if compile_whole else model, datamodule)
    state = {k: v.detach().cpu().clone() for k, v in trainer.strategy.lightning_module_state_dict().items()}
    local_numel = sum(_local(p).numel() for p in model.parameters())
    held = {name: (_local(p).numel(), held_dims(_local(p).shape)) for name, p in model.named_parameters()}
    parallelized = getattr(trainer.strategy, "_parallelized", None)
    fused = parallelized.fused_loss if parallelized is not None else None
    # Lightning reports each part's loss divided by ``accumulate``: their sum is the step's loss
    losses = [sum(recorder.losses[i : i + accumulate]) for i in range(0, len(recorder.losses), accumulate)]
    return {
        "losses": losses,
        "first_grads": recorder.first_grads,
        "initial": initial,
        "state": state,
        "local_numel": local_numel,
        "held": held,
        "replicated": replicated_heads(model),
        "optimizer_numel": optimizer_numel(trainer),
        "compiled_graphs": counters["stats"]["unique_graphs"],
        "graph_breaks": dict(counters["graph_break"]),
        "fused_loss": None if fused is None else list(fused.uses),
    }


def replicated_heads(model: torch.nn.Module) -> int:
    """Elements this rank holds beyond its 1/t because a part of fewer heads than t (a key/value head)
    is copied to several ranks, as Megatron copies them: part of the layout's share, read from the layouts."""
    from lightning_ptdp.tensor_parallel.consolidate import split_parameters

    extra = 0.0
    for _, param, dim, layout in split_parameters(model):
        local = _local(param)
        copies = layout.local_replication().double()
        extra += local.numel() // local.shape[dim] * float((1 - 1 / copies).sum())
    return round(extra)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def optimizer_numel(trainer: L.Trainer) -> int:
    """Elements of optimizer state this rank holds (ZeRO-1: its local optimizer's; ZeRO 2/3: shards)."""
    total = 0
    for optimizer in trainer.optimizers:
        local = local_optimizer(optimizer)  # ZeRO-1: torch's ZeroRedundancyOptimizer keeps this rank's share there
        for values in local.state.values():
            total += sum(_local(v).numel() for v in values.values() if torch.is_tensor(v) and v.dim() > 0)
    return total


def relative_error(actual: torch.Tensor, expected: torch.Tensor, scale: torch.Tensor) -> float:
    """||actual - expected|| / ||scale||: error measured against a meaningful size, not per element."""
    return float((actual.double() - expected.double()).norm() / scale.double().norm().clamp_min(1e-30))


ROUNDOFF_FACTOR = 4.0
"""A layout's fp32 run and the one-process fp32 run are two roundings of one computation; each lies
about the one-process fp64 run's distance from it (``roundoff_floor``), so their distance from each
other is at most about twice that (sqrt(2) for independent roundings); 4 leaves a margin."""


FP64_RECHECK = 1e-6
"""An fp32 difference beyond the tolerances is round-off, not a defect, where the same layout run in fp64
equals one process run in fp64 within the fp32 tolerances times this. fp64 rounds 2**29 (5.4e8) times
finer than fp32, so a round-off difference shrinks far below 1e-6 of its size; a defect (a wrong
position, mask or reduction, a lost cast) does not shrink with the precision."""


def roundoff_floor(ref: dict, ref64: dict) -> dict:
    """How far fp32 round-off alone moves the one-process run from the same run in fp64: per-step
    loss (relative), first-step gradient (relative to its norm) and final weight (relative to its
    update), each as ``assert_matches_reference`` measures a layout. An ill-conditioned model (Adam
    on gradients that cancel) shows a large floor here whatever the layout."""
    losses = [abs(a - b) / max(abs(b), 1e-30) for a, b in zip(ref["losses"], ref64["losses"])]
    grads = {
        n: relative_error(g, ref64["first_grads"][n], ref64["first_grads"][n]) for n, g in ref["first_grads"].items()
    }
    weights = {
        n: relative_error(w, ref64["state"][n], ref64["state"][n].double() - ref64["initial"][n].double())
        for n, w in ref["state"].items()
        if w.is_floating_point()
    }
    return {"losses": losses, "grads": grads, "weights": weights}


def _bound(given: float, floor: Optional[dict], kind: str, key: Any) -> float:
    """The tolerance ``given``, or ``ROUNDOFF_FACTOR`` times the model's own round-off floor where larger."""
    if floor is None:
        return given
    value = floor[kind].get(key, 0.0) if kind != "losses" else max(floor["losses"])
    return max(given, ROUNDOFF_FACTOR * value)


def noise_only(grad: torch.Tensor) -> bool:
    """A whole tensor whose gradient is round-off (a separate key bias): nothing to compare."""
    return bool(grad.abs().max() < 1e-6)


def round_off_driven(grad: torch.Tensor) -> torch.Tensor:
    """Elements whose gradient is zero in exact arithmetic and round-off in practice (a key
    bias: softmax is shift invariant per query row): at most 1e-6 of the tensor's largest. Adam
    divides such noise by its own root mean square, so their updates are noise of full size."""
    return grad.abs() <= 1e-6 * grad.abs().max()


FUSED_QKV_BIAS = "attn.c_attn.bias"
"""nanoGPT's / GPT-2's fused attention bias: the q, k and v biases in thirds, in that order."""


def without_key_third(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` without the key third of a fused q | k | v bias (its gradient is zero in exact
    arithmetic: softmax is shift invariant per query row), anything else whole. The q and v thirds
    are still compared."""
    if not name.endswith(FUSED_QKV_BIAS):
        return tensor
    third = tensor.shape[0] // 3
    if tensor.shape[0] != 3 * third:
        raise ValueError(f"{name} has {tensor.shape[0]} elements, not three equal parts q | k | v")
    return torch.cat([tensor[:third], tensor[2 * third :]])


def assert_matches_reference(
    result: dict, ref: dict, *, loss_rtol: float, grad_rel: float, update_rel: float, skip: tuple = ()
) -> None:
    """Per-step losses element-wise; first-step gradients relative to the gradient's norm; final
    weights relative to how far training moved them (||w - w_ref|| / ||w_ref - w_init||), without
    the elements a round-off gradient drives (``round_off_driven``; only they, not the tensor).
    ``ref["floor"]`` (``roundoff_floor``), where given: each tolerance raised to ``ROUNDOFF_FACTOR``
    times the model's own fp32 round-off where that is larger."""
    assert len(result["losses"]) == len(ref["losses"]) > 0
    floor = ref.get("floor")
    loss_rtol = _bound(loss_rtol, floor, "losses", None)
    losses, expected = (
        torch.tensor(result["losses"], dtype=torch.float64),
        torch.tensor(ref["losses"], dtype=torch.float64),
    )
    worst = float(((losses - expected).abs() / expected.abs().clamp_min(1e-30)).max())
    assert worst <= loss_rtol, (
        f"losses {result['losses']} against one process {ref['losses']}: relative error {worst:.2e} > {loss_rtol:.2e}"
    )
    grads = result["first_grads"] if result["first_grads"] is not None else ref["first_grads"]  # None: checked apart
    assert grads.keys() == ref["first_grads"].keys()
    for name, expected in ref["first_grads"].items():
        expected = without_key_third(name, expected)
        if not name.endswith(skip) and not noise_only(expected):
            err, bound = (
                relative_error(without_key_third(name, grads[name]), expected, expected),
                _bound(grad_rel, floor, "grads", name),
            )
            assert err <= bound, f"gradient of {name}: relative error {err:.2e} > {bound:.2e}"
    for name, expected in ref["state"].items():
        if not name.endswith(skip):
            actual, initial = (
                without_key_third(name, result["state"][name]),
                without_key_third(name, ref["initial"][name]),
            )
            expected = without_key_third(name, expected)
            grad = ref["first_grads"].get(name)
            grad = None if grad is None else without_key_third(name, grad)
            if grad is not None and noise_only(grad):
                continue
            if grad is not None and grad.shape == expected.shape and round_off_driven(grad).any():
                keep = ~round_off_driven(grad)
                actual, expected, initial = actual[keep], expected[keep], initial[keep]
            err, bound = (
                relative_error(actual, expected, expected - initial),
                _bound(update_rel, floor, "weights", name),
            )
            assert err <= bound, f"weight {name}: error {err:.2e} of its update > {bound:.2e}"


def assert_ranks_match_reference(
    results: list[dict], ref: dict, *, loss_rtol: float, grad_rel: float, update_rel: float, skip: tuple = ()
) -> None:
    """Every rank: the reference's losses, and the gradients it holds (a pipeline stage holds its
    own; a weight tied across stages appears under its stage's name); the ranks that return a
    state (rank 0 alone under ZeRO) the reference's final weights. Every gradient is held somewhere."""
    seen, floor = set(), ref.get("floor")
    for result in results:
        state = result["state"] or ref["state"]  # ranks without the full state compare losses and gradients
        assert_matches_reference(
            {**result, "first_grads": None, "state": state},
            ref,
            loss_rtol=loss_rtol,
            grad_rel=grad_rel,
            update_rel=update_rel,
            skip=skip,
        )
        assert state.keys() == ref["state"].keys()
        for name, grad in result["first_grads"].items():
            if name not in ref["first_grads"]:  # a tied weight named by the last stage's module
                name = next(k for k in ref["first_grads"] if torch.equal(ref["initial"][k], result["initial"][name]))
            seen.add(name)
            expected = without_key_third(name, ref["first_grads"][name])
            if not name.endswith(skip) and not noise_only(expected):
                err, bound = (
                    relative_error(without_key_third(name, grad), expected, expected),
                    _bound(grad_rel, floor, "grads", name),
                )
                assert err <= bound, f"gradient of {name}: relative error {err:.2e}"
    assert seen == set(ref["first_grads"]), "some gradients are held by no rank"
    assert any(result["state"] for result in results), "no rank returned the trained weights"
