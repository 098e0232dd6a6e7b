"""Gradient all-reduces are built from the parameter list, identical on every rank, whatever each
rank's backward reached: a parameter one rank never uses must neither hang nor corrupt the sum."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.fit_utils import relative_error
from tests.models import Llama, LlamaBlock, ZooConfig

MARK, MARKED_TOKEN, BATCH, SEQ = 100.0, 63, 4, 32
GRAD_REL = 1e-5  # fp32, the same arithmetic up to summation order (test_tensor_parallel.py)


class MarkedTokenBias(nn.Module):
    """Adds its bias only at marked tokens, and skips the work when it holds none (as an MoE skips
    an expert no token was routed to): under sequence parallelism a rank whose part of the
    sequence has no marked token never uses the bias, and gets no gradient for it."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.full((dim,), 0.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        marked = x[..., 0] > MARK / 2
        if not bool(marked.any()):
            return x
        return x + marked.unsqueeze(-1) * self.bias


class MarkedBlock(LlamaBlock):
    def __init__(self, cfg: ZooConfig) -> None:
        super().__init__(cfg)
        self.marked = MarkedTokenBias(cfg.hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return super().forward(self.marked(x), cos, sin)


def _model_and_batch() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """Llama with 1 KV head (replicated over t=2), the marked token's embedding carrying MARK, and
    marked tokens only in the first quarter of the sequence (rank 0's part under SP at t=2)."""
    torch.manual_seed(0)
    cfg = ZooConfig(num_kv_heads=1)
    net = Llama(cfg)
    net.layers = nn.ModuleList(MarkedBlock(cfg) for _ in range(cfg.num_layers))
    with torch.no_grad():
        net.tok_embeddings.weight[MARKED_TOKEN, 0] = MARK
    tokens = torch.randint(0, MARKED_TOKEN, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    tokens[:, 2 : SEQ // 4] = MARKED_TOKEN
    return net, tokens[:, :-1], tokens[:, 1:]


def one_step(tensor_parallel: bool) -> dict:
    """Forward and backward once; under TP + SP the strategy's gradient sums, then full gradients."""
    net, inputs, targets = _model_and_batch()
    if tensor_parallel:
        import torch.distributed as dist

        from lightning_ptdp.parallel.grad_sums import sum_partial_over_tp
        from lightning_ptdp.tensor_parallel import TPGroup, apply_tensor_parallel
        from lightning_ptdp.tensor_parallel.consolidate import full_gradients

        tp = TPGroup(dist.group.WORLD, dist.get_world_size(), dist.get_rank())
        report = apply_tensor_parallel(net, tp, sequence_parallel=True, probe=lambda: net(inputs))
    F.cross_entropy(net(inputs).flatten(0, 1), targets.flatten()).backward()
    if not tensor_parallel:
        return {name: p.grad for name, p in net.named_parameters()}
    used = [name for name, p in net.named_parameters() if name.endswith("marked.bias") and p.grad is not None]
    sum_partial_over_tp(net, report.partial_grad_params, tp)
    return {"used_here": used, "grads": full_gradients(net)}


@pytest.mark.world_size(2)
def test_a_parameter_one_rank_never_uses_gets_the_single_process_gradient(dist_pool):
    ref = one_step(tensor_parallel=False)
    assert all(ref[f"layers.{i}.marked.bias"].abs().sum() > 0 for i in range(2))
    results = dist_pool(2).run(one_step, True, timeout=180)
    assert results[0]["used_here"] == ["layers.0.marked.bias", "layers.1.marked.bias"]
    assert results[1]["used_here"] == []  # rank 1's half of the sequence holds no marked token
    for rank, result in enumerate(results):
        assert result["grads"].keys() == ref.keys()
        for name, expected in ref.items():
            err = relative_error(result["grads"][name], expected, expected)
            assert err <= GRAD_REL, f"rank {rank}: gradient of {name}: relative error {err:.2e}"


def average_by_placement() -> dict:
    """Two placements on a toy model: the dense ones averaged by a wrapper (untouched here), the
    weight's placement averaged by the owner itself over its own group (here: the world)."""
    import torch.distributed as dist

    from lightning_ptdp.parallel.gradients import DENSE, ReduceGroup, StepGradients

    net = nn.Linear(2, 2)
    rank, world = dist.get_rank(), dist.get_world_size()
    for param in net.parameters():
        param.grad = torch.full_like(param, float(rank + 1))
    owner = StepGradients(
        net,
        groups={
            DENSE: ReduceGroup(group=dist.group.WORLD, size=world, rank=rank, wrapped=True),
            "pair": ReduceGroup(group=dist.group.WORLD, size=world, rank=rank),
        },
        placements={"weight": "pair"},
        on_nonfinite="ignore",
    )
    owner.finish(list(net.parameters()), loss=None, step=0)
    return {"weight": net.weight.grad, "bias": net.bias.grad}


@pytest.mark.world_size(2)
def test_each_placement_averages_over_its_own_group(dist_pool):
    """A new kind of parameter (experts, context-parallel ranks) is one ``ReduceGroup`` entry."""
    weight_mean = (1.0 + 2.0) / 2  # ranks hold 1 and 2: exact in fp32
    for rank, got in enumerate(dist_pool(2).run(average_by_placement)):
        assert torch.equal(got["weight"], torch.full((2, 2), weight_mean))
        assert torch.equal(got["bias"], torch.full((2,), float(rank + 1)))  # the wrapper's: left alone


def test_a_placement_without_a_group_is_refused():
    from lightning_ptdp.parallel.gradients import DENSE, ReduceGroup, StepGradients

    with pytest.raises(ValueError, match=r"placements \['experts'\] have no ReduceGroup; groups has \['dense'\]"):
        StepGradients(
            nn.Linear(2, 2), groups={DENSE: ReduceGroup(group=None, size=1)}, placements={"weight": "experts"}
        )
