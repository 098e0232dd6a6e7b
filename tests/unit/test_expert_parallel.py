"""Expert parallelism's refusals, each before any step, and its discovery on models that are not
MoE-shaped: no process group (the distributed equivalence is tests/distributed/test_expert_parallel.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from lightning_ptdp import ParallelConfig
from lightning_ptdp.core.dims import ParallelDims
from lightning_ptdp.expert_parallel import EPGroup, ExpertDiscoveryError, apply_expert_parallel, find_experts
from lightning_ptdp.expert_parallel.discovery import stacked_experts


class StackedExperts(nn.Module):
    """Experts stacked as [n, ...], called with tokens-per-expert counts (not top-k per token);
    ``mix``: every output row also takes the mean of all rows (not experts applied block by block)."""

    def __init__(self, n: int = 4, hidden: int = 8, mix: bool = False) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(n, hidden, hidden))
        self.mix = mix

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        out = torch.cat([rows @ w for rows, w in zip(x.split(counts.tolist()), self.w)])
        return out + x.mean(0) if self.mix else out


class CountsMoE(nn.Module):
    """Rows grouped by expert with a count per expert, but mixed across blocks: not experts."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = StackedExperts(mix=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, torch.tensor([2, 2, 0, 0]))


def test_expert_parallel_size_must_divide_the_data_parallel_ranks():
    config = ParallelConfig(expert_parallel_size=3)
    with pytest.raises(ValueError, match=r"expert_parallel_size=3 does not divide data_parallel_size=4.*in 1, 2, 4"):
        ParallelDims.from_config(config, world_size=4)
    with pytest.raises(ValueError, match=r"expert_parallel_size=0 must be >= 1"):
        ParallelConfig(expert_parallel_size=0)


def test_a_model_without_moe_layers_is_refused():
    net = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    with pytest.raises(ExpertDiscoveryError, match=r"expert_parallel_size=2, but the model has no mixture-of-experts"):
        apply_expert_parallel(net, EPGroup(None, 2, 0), lambda: net(torch.randn(2, 8)))


def test_routing_that_is_not_top_k_per_token_is_refused_naming_the_module():
    """The refusal names the module, the call (arguments) and the user's source line making it."""
    net = CountsMoE()
    call = r"'experts' .*called at .*test_expert_parallel\.py:\d+ with \(float32\[4, 8\], int64\[4\]\).*top-k"
    grouped = r".*taken as rows grouped by expert: moving expert 0's rows moved rows outside its block"
    with pytest.raises(ExpertDiscoveryError, match=call + r".*ep_plan=\{'experts': 'dense'\}" + grouped):
        find_experts(net, lambda: net(torch.randn(4, 8)))


def test_experts_the_probe_never_called_are_refused():
    net = CountsMoE()
    with pytest.raises(ExpertDiscoveryError, match=r"'experts' \(4 experts stacked\) was not called by the probe"):
        find_experts(net, lambda: None)


def test_expert_parallel_size_must_divide_the_experts():
    from tests.real_models import moe_hf

    net = moe_hf("hf_mixtral")
    ids = torch.randint(0, 64, (2, 8))
    with pytest.raises(
        ExpertDiscoveryError, match=r"expert_parallel_size=3 does not divide the 4 experts .*in \[1, 2, 4\]"
    ):
        apply_expert_parallel(net, EPGroup(None, 3, 0), lambda: net(ids))


def test_stacked_experts_are_found_in_every_transformers_moe_family():
    from tests.real_models import MOE_HF, moe_hf

    for family in MOE_HF:
        net = moe_hf(family)
        sites, lists = find_experts(net, lambda: net(torch.randint(0, 64, (2, 8))))
        assert lists == [] and [s.name for s in sites] == [f"model.model.layers.{i}.mlp.experts" for i in range(2)], (
            family
        )
        assert all((s.num_experts, s.top_k) == (4, 2) for s in sites), family


class KeywordExperts(nn.Module):
    """A router and a ModuleList of experts, each called with a keyword argument."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(8, 2)
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(expert(input=x) for expert in self.experts)


def test_a_module_list_of_experts_is_found_beside_its_router():
    from tests.models import MoEFeedForward

    net = MoEFeedForward(8, 16)
    sites, lists = find_experts(net, lambda: net(torch.randn(3, 8)))
    assert sites == [] and [(s.name, s.experts_attr, s.num_experts) for s in lists] == [("", "experts", 4)]
    plain = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))  # no router Linear with one output per expert
    assert find_experts(plain, lambda: None) == ([], [])


def test_module_list_experts_called_otherwise_than_on_their_rows_are_refused():
    net = KeywordExperts()
    with pytest.raises(ExpertDiscoveryError, match=r"expert 0 of '' was called with 0 positional and \['input'\]"):
        find_experts(net, lambda: net(torch.randn(3, 8)))


def test_transformers_ep_plan_is_a_logged_cross_check():
    from lightning_ptdp.expert_parallel.discovery import ep_plan_cross_check
    from tests.models import MoEFeedForward
    from tests.real_models import moe_hf

    net = moe_hf("hf_mixtral")
    sites, _ = find_experts(net, lambda: net(torch.randint(0, 64, (2, 8))))
    names = [s.name for s in sites]
    assert ep_plan_cross_check(net, names) == (
        "expert parallel: transformers' base_model_ep_plan names the same 2 experts modules"
    )
    assert "discovery found ['layers.0.mlp.experts']" in ep_plan_cross_check(net, names[:1])
    assert ep_plan_cross_check(MoEFeedForward(8, 16), [""]) is None  # no transformers plan: nothing to compare


def test_stacked_experts_built_on_meta_are_found_without_running_them():
    """On the meta device the experts' forward (nonzero, bincount) cannot run: discovery records
    their call and answers rows like the input, so the rest of the forward goes on."""
    from lightning_ptdp.probe import side_effects_muted
    from tests.real_models import moe_hf

    with torch.device("meta"):
        net = moe_hf("hf_mixtral")
    with side_effects_muted(net):  # as the strategy's probe runs (a value read from meta is 0)
        sites, _ = find_experts(net, lambda: net(torch.randint(0, 64, (2, 8), device="meta")))
    assert [(s.num_experts, s.top_k) for s in sites] == [(4, 2), (4, 2)]
    assert all("forward" not in s.module.__dict__ for s in sites)  # the stand-in is gone again


def test_module_list_experts_built_on_meta_are_found_each_called_on_its_balanced_rows():
    """A ModuleList layer picks each expert's rows by value (``torch.where`` of the routing mask),
    which meta has not: under the probe's mode the mask's rows are the balanced share, 1 / experts
    of the tokens' k choices, so the census sees every expert called on [N, H] rows."""
    from lightning_ptdp.probe import side_effects_muted
    from tests.models import MoEFeedForward

    with torch.device("meta"):
        net = MoEFeedForward(8, 16)  # 4 experts, top-2
    shapes = []
    for expert in net.experts:
        expert.register_forward_hook(lambda m, args, out: shapes.append(tuple(args[0].shape)))
    with side_effects_muted(net):
        _, lists = find_experts(net, lambda: net(torch.randn(6, 8, device="meta")))
    assert [(site.name, site.num_experts) for site in lists] == [("", 4)]
    assert shapes == [(3, 8)] * 4  # 6 tokens x 2 choices / 4 experts


def test_pretrained_reads_per_expert_files_into_stacked_experts_only_for_its_experts(tmp_path):
    """transformers saves Mixtral as its Hub checkpoints are: one w1/w2/w3 per expert under
    'block_sparse_moe'. Read backwards through the model's own conversions, experts [2, 4) of the
    stacked gate_up_proj are w1 and w3 of experts 2 and 3 concatenated, and only their files are read."""
    from lightning_ptdp.parallel.pretrained import FileKeys, PerExpert, WeightSource
    from tests.real_models import moe_hf

    net = moe_hf("hf_mixtral").model
    net.save_pretrained(tmp_path)
    source = WeightSource(str(tmp_path))
    keys = FileKeys(net, source.keys())
    assert "model.layers.0.block_sparse_moe.experts.3.w1.weight" in source.keys()
    assert keys.find("model.layers.0.mlp.gate.weight") == "model.layers.0.block_sparse_moe.gate.weight"
    assert keys.find("model.embed_tokens.weight") == "model.embed_tokens.weight"
    gate_up = keys.find("model.layers.0.mlp.experts.gate_up_proj")
    head = "model.layers.0.block_sparse_moe.experts.{i}"
    assert gate_up == PerExpert((f"{head}.w1.weight", f"{head}.w3.weight"), 0)
    assert keys.find("model.layers.1.mlp.experts.down_proj") == PerExpert(
        ("model.layers.1.block_sparse_moe.experts.{i}.w2.weight",), 0
    )
    stacked = net.model.layers[0].mlp.experts.gate_up_proj
    assert source.shape(gate_up) == tuple(stacked.shape)
    read: list[str] = []
    whole = source._whole
    source._whole = lambda key: read.append(key) or whole(key)
    assert torch.equal(source.read(gate_up, (2, 0, 0), (2, *stacked.shape[1:])), stacked[2:4].detach())
    assert sorted(read) == sorted(f"{head.format(i=i)}.{w}.weight" for i in (2, 3) for w in ("w1", "w3"))
    assert keys.find("model.layers.0.mlp.experts.nothing") is None


def _tp_styles(family: str) -> dict[str, str]:
    from lightning_ptdp.tensor_parallel import tensor_parallel_plan
    from tests.models import build_model

    net = build_model(family)
    plan = tensor_parallel_plan(net, 2, lambda: net.logits(torch.randint(0, 64, (2, 8))))
    return {name.split(".*.")[-1]: style for name, style, _ in plan.entries if ".*." in name}


def test_tensor_parallel_discovery_keeps_routers_gates_and_routed_experts_whole():
    """At t=2: Qwen2-MoE's shared expert splits as an MLP and its sigmoid gate (a Linear whose
    output reaches no Linear) stays whole; a ModuleList MoE's experts, fed rows picked by the
    routing, stay whole (expert parallelism splits them), its router too; attention splits."""
    qwen = _tp_styles("hf_qwen2_moe")
    assert qwen["mlp.shared_expert.gate_proj"] == "colwise" and qwen["mlp.shared_expert.down_proj"] == "rowwise"
    assert qwen["mlp.shared_expert_gate"] == "replicated" and qwen["self_attn.o_proj"] == "rowwise"
    litgpt = _tp_styles("litgpt_moe")
    assert litgpt["mlp.gate"] == "replicated" and litgpt["attn.proj"] == "rowwise"
    assert {style for name, style in litgpt.items() if ".experts." in name} == {"replicated"}
    assert len([name for name in litgpt if ".experts." in name]) == 4 * 3  # every expert's three Linears


class MixedFeed(nn.Module):
    """A Linear fed both by a column's output and by a row's: in graph order no column -> row pair."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.back, self.out = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up = self.up(x)
        return x + self.out(up + self.back(up))


def test_a_linear_fed_by_a_column_and_by_a_row_of_that_column_closes_the_region():
    """``back`` reads ``up``'s split features: a row whose reduced output ``out`` reads again beside
    ``up``'s, so it is an inner row (all-reduced, then entered like the region's input) and ``out``
    closes the region; ``back``'s whole output is cut per rank where it meets ``up``'s. The idiom
    trains equal to one process in tests/distributed/test_tp_state_space_mixer.py (Mamba-1's x_proj)."""
    import warnings

    from lightning_ptdp.tensor_parallel import PartialSplitWarning, tensor_parallel_plan

    net = nn.Sequential(nn.Embedding(64, 8), nn.ModuleList([MixedFeed(), MixedFeed()]))
    net.forward = lambda ids: net[1][1](net[1][0](net[0](ids)))  # type: ignore[method-assign]
    probe = lambda: net(torch.randint(0, 64, (2, 8)))  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("error", PartialSplitWarning)
        report = tensor_parallel_plan(net, 2, probe, strict=True)
    styles = {path: style for path, style, _ in report.entries if path.startswith("1.")}
    assert styles == {"1.*.up": "colwise", "1.*.back": "rowwise_inner", "1.*.out": "rowwise"}


def test_a_norm_over_all_heads_is_recognised_by_what_it_computes():
    """OLMo-2 / OLMoE q/k norms: RMSNorm over all heads' features; nn.LayerNorm too; a module that
    only scales by a weight of that size is no norm (TP then refuses it, as before)."""
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

    from lightning_ptdp.tensor_parallel.feature_norm import FeatureNorm, feature_norm_of

    assert feature_norm_of(Olmo2RMSNorm(16, eps=1e-6), 16) == FeatureNorm("rms", 1e-6, 16)
    assert feature_norm_of(nn.LayerNorm(16, eps=1e-5), 16) == FeatureNorm("layer", 1e-5, 16)
    with torch.device("meta"):  # checked on a CPU copy: a model built on meta is recognised too
        on_meta = Olmo2RMSNorm(16, eps=1e-6)
    assert feature_norm_of(on_meta, 16) == FeatureNorm("rms", 1e-6, 16)

    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight, self.eps = nn.Parameter(torch.ones(16)), 1e-6

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.weight

    assert feature_norm_of(Scale(), 16) is None
    assert feature_norm_of(nn.LayerNorm(16), 8) is None  # not over the sharded features


def test_torchtitans_routed_experts_are_found_around_its_grouped_experts():
    """torchtitan nests three candidates holding only stacked weights: the MoE block (its router's
    weight leads with n too), RoutedExperts, and GroupedExperts, called with tokens per expert. The
    innermost one called with top-k routing is the experts module: RoutedExperts, with [B, L, k]
    routing and the tokens-per-expert counts beside it (recomputed for the rows each rank receives)."""
    from tests.models import build_model

    net = build_model("titan_qwen3_moe")
    sites, lists = find_experts(net, lambda: net.logits(torch.randint(0, 64, (2, 8))))
    assert lists == [] and [s.name for s in sites] == [f"net.layers.{i}.moe.routed_experts" for i in range(2)]
    assert all((s.num_experts, s.top_k, s.hidden_dims) == (4, 2, 3) and s.counts is not None for s in sites)


class PerHead(nn.Module):
    """A per-head projection, its weight stacked [heads, ...] and 3D like stacked experts."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 8, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("nh,khd->nkd", x, self.weight).flatten(1)


class HeadsAndExperts(nn.Module):
    """Per-head weights (no experts) beside a MoE whose router is no Linear of one output per
    expert: discovery would take the first for experts and miss the second."""

    def __init__(self) -> None:
        super().__init__()
        self.heads, self.moe = PerHead(), MoEFeedForwardNoRouter()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(self.heads(x))


class MoEFeedForwardNoRouter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scores = nn.Linear(8, 6)  # 4 experts' scores and 2 more outputs: not a plain router
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = self.scores(x)[:, :4].softmax(-1).topk(2)
        out = torch.zeros_like(x)
        for index, expert in enumerate(self.experts):
            rows, slot = torch.where(chosen == index)
            out[rows] += weights[rows, slot, None] * expert(x[rows])
        return out


def test_ep_plan_names_what_discovery_misses_or_mistakes():
    """'dense' keeps a module discovery would take for experts; 'expert_list' names a ModuleList MoE
    whose router discovery does not recognise; the resolved plan decides where it names a module."""
    from lightning_ptdp.core.plans import resolve_plan

    net = HeadsAndExperts()
    with pytest.raises(ExpertDiscoveryError, match=r"experts module 'heads' \(4 experts stacked\) was called at"):
        find_experts(net, lambda: net(torch.randn(3, 8)))
    plan = resolve_plan(net, {"heads": "dense", "m?e": "expert_list"}, "ep_plan")
    sites, lists = find_experts(net, lambda: net(torch.randn(3, 8)), plan)
    assert sites == [] and [(s.name, s.experts_attr, s.num_experts) for s in lists] == [("moe", "experts", 4)]


@pytest.mark.parametrize(
    "plan, e, match",
    [
        ({"moe": "stacked"}, 2, r"ep_plan=\{'moe': 'stacked'\} must be a dict of module path \(or glob\) -> one of"),
        ({"moe": "experts"}, 1, r"ep_plan names modules for expert parallelism: set expert_parallel_size > 1"),
    ],
)
def test_a_bad_ep_plan_is_refused_at_construction(plan, e, match):
    from lightning_ptdp import PTDPStrategy

    with pytest.raises(ValueError, match=match):
        PTDPStrategy(expert_parallel_size=e, ep_plan=plan)


def test_ep_plan_keys_must_match_modules_and_name_the_right_kind():
    from lightning_ptdp.core.plans import resolve_plan

    net = HeadsAndExperts()
    with pytest.raises(ValueError, match=r"ep_plan key 'mo' matches no module of HeadsAndExperts; close paths: moe"):
        resolve_plan(net, {"mo": "experts"}, "ep_plan")
    with pytest.raises(ExpertDiscoveryError, match=r"ep_plan\['moe'\]='experts', but its parameters .* do not all"):
        find_experts(net, lambda: None, {"moe": "experts"})
    with pytest.raises(ExpertDiscoveryError, match=r"ep_plan\['moe.scores'\]='expert_list', but 'moe.scores'"):
        find_experts(net, lambda: None, {"moe.scores": "expert_list"})


def test_a_depthwise_convolution_is_not_taken_for_stacked_experts():
    # a short convolution over the sequence (mamba, linear attention): its weight [C, 1, k] leads with channels
    conv = nn.Conv1d(8, 8, kernel_size=3, groups=8)
    assert stacked_experts(conv) is None
    holder = nn.Module()
    holder.conv = conv
    assert stacked_experts(holder) is None
    experts = nn.Module()  # the model's own module stacking experts stays one
    experts.w = nn.Parameter(torch.zeros(4, 8, 16))
    assert stacked_experts(experts) == 4
