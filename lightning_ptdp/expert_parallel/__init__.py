"""Expert parallelism: the experts of every mixture-of-experts layer split over ranks carved out of
the data-parallel ones, tokens exchanged all-to-all; found from the model, like TP."""

from lightning_ptdp.expert_parallel.apply import (
    EPReport,
    apply_expert_parallel,
    cut_experts,
    expert_shards,
    gather_expert_optimizer_state,
    gather_experts,
    has_split_experts,
)
from lightning_ptdp.expert_parallel.discovery import (
    ExpertCalls,
    ExpertDiscoveryError,
    check_ep_plan,
    find_experts,
    routed_parameters,
)
from lightning_ptdp.expert_parallel.exchange import EPGroup, ExchangeStats, ExpertShard

__all__ = [
    "EPGroup",
    "EPReport",
    "ExchangeStats",
    "ExpertDiscoveryError",
    "ExpertShard",
    "apply_expert_parallel",
    "check_ep_plan",
    "cut_experts",
    "expert_shards",
    "find_experts",
    "ExpertCalls",
    "gather_expert_optimizer_state",
    "gather_experts",
    "has_split_experts",
    "routed_parameters",
]
