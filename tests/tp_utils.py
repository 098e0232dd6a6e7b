"""One forward/backward of a zoo model, tensor-parallel on the pool's ranks or whole in-process."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from lightning_ptdp.testing import CollectiveCounter
from tests.models import build_model

VOCAB, SEQ, BATCH = 64, 32, 4


def _net(family: str, overrides: dict) -> torch.nn.Module:
    torch.manual_seed(0)
    module = build_model(family, **overrides)
    return module.gpt if family == "gpt" else module.net


def token_batch(vocab: int = VOCAB) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def reference_step(family: str, overrides: dict | None = None, inputs: torch.Tensor | None = None) -> dict[str, Any]:
    """``inputs``: token ids replacing the batch's own (the targets stay)."""
    net = _net(family, overrides or {})
    batch_inputs, targets = token_batch((overrides or {}).get("vocab_size", VOCAB))
    inputs = batch_inputs if inputs is None else inputs
    loss = F.cross_entropy(net(inputs).flatten(0, 1), targets.flatten())
    loss.backward()
    grads = {n: p.grad.clone() for n, p in net.named_parameters()}
    return {"loss": loss.item(), "grads": grads, "state": {k: v.clone() for k, v in net.state_dict().items()}}


def tp_step(
    family: str,
    sequence_parallel: bool,
    overrides: dict | None = None,
    count: bool = False,
    kernels: str = "torch",
    inputs: torch.Tensor | None = None,
    compile_backend: str | None = None,
) -> dict[str, Any]:
    """``compile_backend``: compile every block's forward after the rewrites with fullgraph=True
    (any graph break is an error), and report dynamo's own graph-break count."""
    import torch.distributed as dist

    from lightning_ptdp.parallel.grad_sums import sum_partial_over_tp
    from lightning_ptdp.tensor_parallel import TPGroup, apply_tensor_parallel
    from lightning_ptdp.tensor_parallel.consolidate import full_gradients, full_state_dict
    from lightning_ptdp.tensor_parallel.state_dict_hooks import run_save_hooks

    net = _net(family, overrides or {})
    batch_inputs, targets = token_batch((overrides or {}).get("vocab_size", VOCAB))
    inputs = batch_inputs if inputs is None else inputs
    tp = TPGroup(dist.group.WORLD, dist.get_world_size(), dist.get_rank())
    report = apply_tensor_parallel(net, tp, sequence_parallel=sequence_parallel, probe=lambda: net(inputs))
    from lightning_ptdp.kernels import apply_kernels

    kernel_report = apply_kernels(net, kernels)
    kernel_calls = _count_kernel_calls() if kernels != "torch" else {}
    if compile_backend is not None:
        import torch._dynamo
        from torch._dynamo.utils import counters

        from lightning_ptdp.config import CompileConfig
        from lightning_ptdp.parallel.compile import apply_compile

        torch._dynamo.reset()
        counters.clear()
        apply_compile(net, CompileConfig(backend=compile_backend, fullgraph=True))
    state = run_save_hooks(net, full_state_dict(net))  # as a full checkpoint: the model's own keys
    counter = CollectiveCounter() if count else None
    if counter:
        counter.start()
    with AttentionHeads() as heads:
        logits = net(inputs)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    forward_counts = dict(counter.counts) if counter else {}
    loss.backward()
    backward_counts = counter.stop() if counter else {}
    sum_partial_over_tp(net, report.partial_grad_params, tp)
    local_shapes = {n: tuple(p.shape) for n, p in net.named_parameters()}
    return {
        "loss": loss.item(),
        "grads": full_gradients(net),
        "state": state,
        "local_shapes": local_shapes,
        "report": report.summary(),
        "kernel_report": [*kernel_report.attention, *kernel_report.bias_gelu],
        "kernel_calls": kernel_calls,
        "logits_local_vocab": logits.shape[-1],
        "attention_heads": heads.seen,
        "forward_counts": forward_counts,
        "backward_counts": {k: v - forward_counts.get(k, 0) for k, v in backward_counts.items()},
        **(_dynamo_counts() if compile_backend is not None else {}),
    }


def _dynamo_counts() -> dict[str, int]:
    """Dynamo's own counts since ``counters.clear()``: graph breaks and graphs compiled."""
    from torch._dynamo.utils import counters

    return {
        "graph_breaks": sum(counters["graph_break"].values()),
        "compiled_graphs": counters["stats"]["unique_graphs"],
    }


def _count_kernel_calls() -> dict[str, int]:
    """Wrap the Triton entry points so the test sees that they really ran (worker process only)."""
    from lightning_ptdp import triton_kernels

    calls: dict[str, int] = {}
    for name in ("flash_attention", "bias_gelu"):
        original = getattr(triton_kernels, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            calls[_name] = calls.get(_name, 0) + 1
            return _original(*args, **kwargs)

        setattr(triton_kernels, name, counted)
    return calls


class AttentionHeads(torch.overrides.TorchFunctionMode):
    """Records the number of query heads of every scaled_dot_product_attention call."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[int] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.scaled_dot_product_attention:
            self.seen.append(args[0].shape[-3])
        return func(*args, **(kwargs or {}))


def fit_token_lm(
    make_model, *, vocab: int, seq: int, t: int, sequence_parallel: bool, **trainer_kwargs: Any
) -> tuple[Any, dict]:
    """Two SGD steps of ``make_model()`` (built after seeding 0) on a fixed token batch, by the Trainer at
    t (one process when 1): the model, and its whole state and the ``PartialSplitWarning`` texts."""
    import warnings

    from torch.utils.data import DataLoader, TensorDataset

    from lightning_ptdp import PTDPStrategy
    from lightning_ptdp.tensor_parallel.consolidate import full_state_dict
    from lightning_ptdp.tensor_parallel.whole_regions import PartialSplitWarning
    from lightning_ptdp.testing import quiet_trainer

    tokens = torch.randint(0, vocab, (8, seq + 1), generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=4)
    strategy = PTDPStrategy(tensor_parallel_size=t, sequence_parallel=sequence_parallel) if t > 1 else "auto"
    trainer = quiet_trainer(devices=t, strategy=strategy, max_steps=2, use_distributed_sampler=False, **trainer_kwargs)
    torch.manual_seed(0)
    model = make_model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", PartialSplitWarning)
        trainer.fit(model, data)
    state = full_state_dict(model) if t > 1 else model.state_dict()
    return model, {
        "state": {k: v.detach().clone() for k, v in state.items()},
        "warnings": [str(w.message) for w in caught if issubclass(w.category, PartialSplitWarning)],
    }


class TokenLM:
    """An embedding, the blocks ``make_blocks()`` builds (one block list, each ``x -> x``) and a head,
    trained by SGD: the model of the plain-torch idiom tests (a LightningModule, built lazily)."""

    def __new__(cls, make_blocks, vocab: int, hidden: int):
        import lightning as L

        class _TokenLM(L.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.emb = torch.nn.Embedding(vocab, hidden)
                self.blocks = torch.nn.ModuleList(make_blocks())
                self.head = torch.nn.Linear(hidden, vocab)

            def training_step(self, batch, batch_idx):
                x = self.emb(batch[0])
                for block in self.blocks:
                    x = block(x)
                    x = x[0] if isinstance(x, (tuple, list)) else x  # a block returning [h, weights]
                return F.cross_entropy(self.head(x).flatten(0, 1), batch[1].flatten())

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.5)

        return _TokenLM()


def t2_runs(dist_pool: Any, fit: Any, sequence_parallel: bool, tol: float) -> list[dict]:
    """Each rank's ``fit(2, sequence_parallel)``, whose whole state is checked against one process's
    ``fit(1, False)`` at ``tol``: the idiom tests then check what each layout split and warned."""
    whole = fit(1, False)
    splits = dist_pool(2).run(fit, 2, sequence_parallel)
    for split in splits:
        assert_same_state(whole, split, tol)
    return splits


def assert_same_state(whole: dict, split: dict, tol: float) -> None:
    """The split run's consolidated state equals one process's, name for name, at ``tol``."""
    assert whole["state"].keys() == split["state"].keys()
    for name, value in whole["state"].items():
        torch.testing.assert_close(split["state"][name], value, rtol=tol, atol=tol * 1e-1, msg=name)
