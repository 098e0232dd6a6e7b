"""MoE and data-parallel idioms of real models, as plain torch, at d2-e2 against one process: experts
called on rows grouped by expert (a count per expert as JetMoE, equal blocks as Llama 4), the MoE
layer only in the second block, a stacked-parameter table no step calls (kept whole), and parameters
no loss reaches (a sparse-attention indexer feeding only top-k indices, an unused head), which
DDP must neither wait for nor give a gradient."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

H, N_EXPERTS, TOP_K = 8, 4, 2
TOL = 1e-5  # fp32: the same arithmetic up to summation order
STEPS = 2


class GroupedExperts(nn.Module):
    """Experts stacked [n, ...], each applied to its block of rows: sizes given (a list of counts),
    or n equal blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(N_EXPERTS, H, 2 * H) / H**0.5)
        self.w2 = nn.Parameter(torch.randn(N_EXPERTS, 2 * H, H) / H**0.5)

    def forward(self, rows: torch.Tensor, sizes: list[int] | None = None) -> torch.Tensor:
        if sizes is None:  # [n * C, H]: n equal blocks
            blocks = rows.view(self.w1.shape[0], -1, rows.shape[-1])
            return torch.bmm(F.silu(torch.bmm(blocks, self.w1)), self.w2).view(-1, rows.shape[-1])
        parts = rows.split(sizes)
        return torch.cat([F.silu(part @ self.w1[e]) @ self.w2[e] for e, part in enumerate(parts)])


class GroupedMoE(nn.Module):
    """Top-2 routing; ``style`` 'counts': each (token, expert) row sorted by expert with a count per
    expert (JetMoE); 'blocks': every token to every expert, weighted by its routing score (Llama 4)."""

    def __init__(self, style: str) -> None:
        super().__init__()
        self.style = style
        self.router = nn.Linear(H, N_EXPERTS, bias=False)
        self.experts = GroupedExperts()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, H)
        logits = self.router(tokens)
        top, chosen = logits.topk(TOP_K, dim=-1)
        if self.style == "blocks":
            scores = torch.full_like(logits, float("-inf")).scatter(1, chosen, top).sigmoid()  # [N, n]
            routed = tokens.repeat(N_EXPERTS, 1) * scores.t().reshape(-1, 1)
            return self.experts(routed).view(N_EXPERTS, -1, H).sum(0).view_as(x)
        flat = chosen.reshape(-1)
        order = flat.argsort(stable=True)
        token = order // TOP_K
        sizes = torch.bincount(flat, minlength=N_EXPERTS).tolist()
        out = self.experts(tokens[token], sizes) * top.softmax(-1).reshape(-1)[order, None]
        return torch.zeros_like(tokens).index_add(0, token, out).view_as(x)


class IndexedMixing(nn.Module):
    """Each token adds the mean of the half of the sequence an indexer scores highest: the indexer's
    scores leave only as top-k indices, so its weights get no gradient (DeepSeek-V3.2's)."""

    def __init__(self) -> None:
        super().__init__()
        self.indexer = nn.Linear(H, 1)
        self.mlp = nn.Linear(H, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = self.indexer(x).squeeze(-1).topk(x.shape[1] // 2, dim=-1).indices  # [B, T/2]
        kept = x.gather(1, keep.unsqueeze(-1).expand(-1, -1, H))
        return x + torch.tanh(self.mlp(x)) + kept.mean(1, keepdim=True)


class PassQueries(nn.Module):
    """One learned query per later pass over the blocks, [passes, 2, H] (stacked like experts)."""

    def __init__(self) -> None:
        super().__init__()
        self.query = nn.Parameter(torch.randn(3, 2, H))

    def forward(self, states: torch.Tensor, index: int) -> torch.Tensor:
        return torch.softmax(self.query[index] @ states.transpose(-1, -2), dim=-1) @ states


class Net(nn.Module):
    """A dense block, then an MoE block; a vision head and a per-pass query table [passes, 2, H]
    (stacked like experts) that no text step calls."""

    def __init__(self, style: str) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([IndexedMixing(), GroupedMoE(style)])
        self.vision_head = nn.Linear(H, H)
        self.queries = PassQueries()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x


def loss_of(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def train_against_one_process(style: str) -> dict:
    """On each of 2 ranks: experts split over e = 2, DDP over d = 2 (split experts left to it
    averaged here: each one's gradient sums both ranks' tokens, so the mean over d halves it)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_ptdp.data_parallel import apply_data_parallel
    from lightning_ptdp.expert_parallel import EPGroup, apply_expert_parallel

    torch.manual_seed(0)
    net = Net(style)
    whole = copy.deepcopy(net)
    batch = torch.randn(4, 6, H)
    rank = dist.get_rank()
    mine = batch[2 * rank : 2 * rank + 2]
    report = apply_expert_parallel(net, EPGroup(dist.group.WORLD, 2, rank), lambda: net(mine))
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    ddp = apply_data_parallel(net, mesh, ignore=report.expert_params, probe=lambda: loss_of(net(mine)))
    plain = apply_data_parallel(nn.Linear(H, H), mesh, probe=lambda: None)  # no graph to read: DDP's default
    shard = report.sites["blocks.1.experts"]
    experts = set(report.expert_params)
    ours, theirs = torch.optim.SGD(net.parameters(), lr=0.1), torch.optim.SGD(whole.parameters(), lr=0.1)
    losses, grad_errors, no_grad = [], [], set()
    for _ in range(STEPS):
        loss = loss_of(ddp(mine))
        loss.backward()
        reference = loss_of(whole(batch))
        reference.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append((total.item() / 2, reference.item()))
        wholes = dict(whole.named_parameters())
        for name, param in net.named_parameters():
            ref = wholes[name].grad
            if param.grad is None or ref is None:
                no_grad.add(name) if param.grad is None and ref is None else grad_errors.append((name, "None"))
                continue
            if name in experts:
                param.grad /= 2
                ref = ref[list(shard.mine)]
            grad_errors.append((name, ((param.grad - ref).norm() / ref.norm().clamp_min(1e-12)).item()))
        ours.step(), theirs.step(), ours.zero_grad(), whole.zero_grad()
    return {
        "losses": losses,
        "grad_errors": grad_errors,
        "no_grad": sorted(no_grad),
        "sites": sorted(report.sites),
        "find_unused": (ddp.find_unused_parameters, plain.find_unused_parameters),
        "queries": tuple(net.queries.query.shape),
    }


@pytest.mark.parametrize("style", ["counts", "blocks"])
def test_grouped_experts_and_params_without_grad_train_as_one_process(dist_pool, style):
    for result in dist_pool(2).run(train_against_one_process, style):
        assert result["sites"] == ["blocks.1.experts"]  # the table no step calls is kept whole
        assert result["queries"] == (3, 2, H)
        assert result["find_unused"] == (True, False)
        expected = ["blocks.0.indexer.bias", "blocks.0.indexer.weight", "queries.query", "vision_head.bias"]
        assert result["no_grad"] == sorted([*expected, "vision_head.weight"])
        for ours, reference in result["losses"]:
            assert ours == pytest.approx(reference, rel=TOL)
        bad = [(name, error) for name, error in result["grad_errors"] if error == "None" or error > TOL]
        assert not bad, bad


class LoopedExperts(nn.Module):
    """Stacked experts run in a loop over the experts the batch hit, each read by an int from ``.item()``
    (LongCat-Flash's eager loop): a rank whose tokens miss an expert reads none of its weights that step."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(H, N_EXPERTS)
        self.experts = nn.Parameter(torch.randn(N_EXPERTS, H, H) / H**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, H)
        probs = self.router(flat).softmax(-1)
        choice, out = probs.argmax(-1), torch.zeros_like(flat)
        for expert in choice.unique():
            rows = (choice == expert).nonzero().squeeze(1)
            e = int(expert.item())
            out = out.index_add(0, rows, (flat[rows] @ self.experts[e]) * probs[rows, e, None])
        return (flat + out).square().mean()


def looped_batches(rank: int) -> list[torch.Tensor]:
    """Tokens routed by their marked feature: step 1 reaches every expert on both ranks; step 2 on rank 0
    reaches expert 0 only."""
    generator = torch.Generator().manual_seed(rank)
    experts = [torch.arange(8) % N_EXPERTS, torch.zeros(8, dtype=torch.long) if rank == 0 else torch.arange(8) % 4]
    return [torch.randn(8, H, generator=generator) * 0.1 + 5 * F.one_hot(e, H).float() for e in experts]


def train_looped_experts() -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_ptdp.data_parallel.ddp import apply_data_parallel

    torch.manual_seed(0)
    net = LoopedExperts()
    with torch.no_grad():  # the router reads the marked feature
        net.router.weight.copy_(torch.eye(N_EXPERTS, H) * 10)
    whole = copy.deepcopy(net)
    rank = dist.get_rank()
    mine, other = looped_batches(rank), looped_batches(1 - rank)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    ddp = apply_data_parallel(net, mesh, probe=lambda: net(mine[0]))
    errors = []
    for step in range(2):
        ddp(mine[step]).backward()
        ((whole(mine[step]) + whole(other[step])) / 2).backward()
        for (name, param), ref in zip(net.named_parameters(), whole.parameters()):
            errors.append((name, ((param.grad - ref.grad).norm() / ref.grad.norm()).item()))
        net.zero_grad(), whole.zero_grad()
    return {"find_unused": ddp.find_unused_parameters, "errors": errors}


def test_experts_a_later_step_may_not_reach_turn_on_ddps_search(dist_pool):
    """Without the search, DDP waits for the experts' gradient on rank 0 in step 2 while rank 1 reduces it:
    the collectives mismatch and gloo aborts the process."""
    for result in dist_pool(2).run(train_looped_experts):
        assert result["find_unused"]
        assert all(error <= TOL for _, error in result["errors"]), result["errors"]


def exchange_with_an_idle_rank() -> dict:
    """Every token of both ranks routed to expert 0 (rank 0's): rank 1 receives no row, and its experts'
    compute, like a loop over the experts a batch hit, returns zeros with no graph behind them."""
    import torch.distributed as dist

    from lightning_ptdp.expert_parallel.exchange import EPGroup, ExpertShard, exchange
    from lightning_ptdp.expert_parallel.placement import Placement

    rank = dist.get_rank()
    experts = torch.randn(2, H, H, generator=torch.Generator().manual_seed(0))
    mine = experts[rank].clone().requires_grad_()
    hidden = torch.randn(4, H, generator=torch.Generator().manual_seed(1 + rank)).requires_grad_()
    shard = ExpertShard(num_experts=2, ep=EPGroup(dist.group.WORLD, 2, rank), placement=Placement.contiguous(2, 2))

    def compute(rows: torch.Tensor, slots: torch.Tensor, ones: torch.Tensor) -> torch.Tensor:
        return rows @ mine if rows.shape[0] else torch.zeros_like(rows.detach())  # nothing hit: no graph

    out = exchange(hidden, torch.zeros(4, 1, dtype=torch.long), torch.ones(4, 1), shard=shard, compute=compute)
    out.sum().backward()  # both exchanges' backwards run on both ranks, or rank 0 waits forever
    expected = torch.ones(4, H) @ experts[0].T
    return {"rows": out.shape[0], "error": ((hidden.grad - expected).norm() / expected.norm()).item()}


@pytest.mark.world_size(2)
def test_a_rank_that_receives_no_rows_still_runs_the_exchanges_backward(dist_pool):
    for result in dist_pool(2).run(exchange_with_an_idle_rank):
        assert result["rows"] == 4 and result["error"] <= TOL
