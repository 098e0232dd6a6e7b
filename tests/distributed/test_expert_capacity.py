"""Expert capacity (``expert_capacity_factor``, opt-in): what it promises, at d2-e2 on transformers'
Mixtral. It changes the result by design, so the oracle is its promise, not one process: no expert
takes more than its capacity of a rank's (token, expert) rows, the rows kept are those of the largest
routing weights, and a token whose rows were all dropped gets nothing from the experts (its layer
output is the residual path's)."""

from __future__ import annotations

import pytest

FACTOR = 0.5  # half an even share: rows must be dropped whatever the routing


def fit_with_capacity() -> dict:
    import torch

    from lightning_ptdp.expert_parallel.exchange import capacity, within_capacity
    from tests.fit_utils import fit_and_record

    checks: list[dict] = []

    def hook(module, args, output) -> None:
        if not module.training or "_ptdp_experts" not in module.__dict__:  # the split experts' training calls
            return
        hidden, index, weight = args[:3]
        n = module.num_experts * 2  # this rank holds n/e = half of them
        limit = capacity(index.numel(), n, FACTOR)
        kept = within_capacity(index.reshape(-1), weight.reshape(-1), n, limit)
        per_expert = torch.bincount(index.reshape(-1)[kept], minlength=n)
        tokens = torch.zeros(index.shape[0], dtype=torch.bool)
        tokens[kept // index.shape[1]] = True
        zero_rows = (output == 0).all(dim=-1)
        checks.append(
            {
                "limit": limit,
                "most": int(per_expert.max()),
                "kept": int(kept.numel()),
                "routed": index.numel(),
                "dropped_tokens_zero": bool(zero_rows[~tokens].all()),
                "kept_tokens_nonzero": bool((~zero_rows[tokens]).all()),
                "dropped_tokens": int((~tokens).sum()),
            }
        )

    import lightning.pytorch as L

    class Hooks(L.Callback):
        def setup(self, trainer, pl_module, stage) -> None:
            for name, module in pl_module.named_modules():
                if name.endswith("mlp.experts"):
                    module.register_forward_hook(hook)

        def on_train_batch_end(self, trainer, *args) -> None:
            stats = trainer.strategy.expert_report.stats
            checks.append({"exchanged": {k: v.tolist() for k, v in stats.tokens_per_expert.items()}})

    result = fit_and_record(
        "hf_mixtral",
        strategy_kwargs={"expert_parallel_size": 2, "expert_capacity_factor": FACTOR},
        devices=2,
        steps=2,
        callbacks=[Hooks()],
    )
    return {"checks": checks, "losses": result["losses"]}


@pytest.mark.world_size(2)
def test_no_expert_takes_more_than_its_capacity_and_dropped_tokens_keep_their_residual(dist_pool):
    results = dist_pool(2).run(fit_with_capacity)
    for result in results:
        calls = [c for c in result["checks"] if "limit" in c]
        steps = [c["exchanged"] for c in result["checks"] if "exchanged" in c]
        layers = len(steps[0])
        assert len(steps) == 2 and layers >= 1 and len(calls) == 2 * layers  # each MoE layer once a step
        for call in calls:
            assert call["most"] <= call["limit"] and call["kept"] < call["routed"]  # rows were dropped
            assert call["dropped_tokens_zero"] and call["kept_tokens_nonzero"]
        dropped = sum(call["dropped_tokens"] for call in calls)
        assert dropped > 0  # some token lost both its experts: its output above was checked zero
        # what the exchange sent each expert is what the capacity rule keeps: the rule ran inside it
        for step, layer_calls in zip(steps, (calls[:layers], calls[layers:])):
            for counts, call in zip((step[name] for name in sorted(step)), layer_calls):
                assert max(counts) <= call["limit"] and sum(counts) == call["kept"]
        assert all(loss == loss for loss in result["losses"])  # finite


@pytest.mark.world_size(2)
def test_capacity_is_refused_for_experts_called_on_rows_grouped_by_expert(dist_pool):
    from tests.fit_utils import fit_and_record

    with pytest.raises(Exception, match=r"expert_capacity_factor=1.0: the experts of '.*' are called on rows already"):
        dist_pool(2).run(
            fit_and_record,
            "moe_llama",
            strategy_kwargs={"expert_parallel_size": 2, "expert_capacity_factor": 1.0},
            devices=2,
            steps=1,
        )
