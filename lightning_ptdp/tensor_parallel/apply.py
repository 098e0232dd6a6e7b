"""Rewrite an ordinary model for tensor (and sequence) parallelism, in place.

Find the block lists (core/blocks.py), capture the first block's real inputs with one probe
forward, record and plan one block per list (discovery.py); then for every block swap its Linears
for column/row shards and run its own forward under the replay (replay.py), one collective at each
region's input (f) and output (g). Split the token embedding and LM head by vocabulary (ties stay
one Parameter). Under SP the blocks run on 1/t of the sequence, and parameters replicated inside
them get partial gradients, listed in the report for ``StepGradients`` to sum over the group.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn

from lightning_ptdp.core.blocks import acts_as, find_block_lists, is_conv1d, token_embedding_and_head
from lightning_ptdp.core.census import BlockInputs
from lightning_ptdp.core.plans import resolve_plan
from lightning_ptdp.tensor_parallel import collectives as C
from lightning_ptdp.tensor_parallel.collectives import TPGroup
from lightning_ptdp.tensor_parallel.discovery import (
    BlockPlan,
    RegionPlan,
    TPDiscoveryError,
    plan_block,
    split_weights,
    trace_block,
)
from lightning_ptdp.tensor_parallel.discovery_types import working_plan_hint
from lightning_ptdp.tensor_parallel.explicit_plan import (
    ColumnParallelConv1D,
    RowParallelConv1D,
    check_styles,
    check_ties,
    rewrite,
)
from lightning_ptdp.tensor_parallel.feature_norm import FeatureNorm, GatheredModule, HeadSlices, shard_feature_norm
from lightning_ptdp.tensor_parallel.layers import (
    ColumnParallelLinear,
    GatheredColumnLinear,
    InnerRowParallelLinear,
    RowParallelLinear,
    ShardLayout,
    StreamGateLinear,
    VocabParallelEmbedding,
    VocabParallelHead,
    hold_share,
    parameter_shard,
)
from lightning_ptdp.tensor_parallel.model_plan import cross_check
from lightning_ptdp.tensor_parallel.recording import OPEN
from lightning_ptdp.tensor_parallel.replay import (
    BlockProgram,
    BlockRuntime,
    RegionEntry,
    install_replay,
    snapshot_args,
)
from lightning_ptdp.tensor_parallel.state_dict_hooks import take_state_dict_hooks
from lightning_ptdp.tensor_parallel.trial import regions_that_fail, runs_on_meta, trial_error
from lightning_ptdp.tensor_parallel.whole_regions import parameters_at, warn_whole_regions

log = logging.getLogger(__name__)


@dataclass
class TPReport:
    """What the rewrite did: one line per module, plus the parameters needing a gradient sum."""

    tp_size: int
    sequence_parallel: bool
    entries: list[tuple[str, str, str]] = field(default_factory=list)
    partial_grad_params: list[tuple[nn.Module, str]] = field(default_factory=list)
    """(module, parameter name): looked up at use time, since ZeRO may replace the Parameter."""

    def summary(self) -> str:
        width = max((len(p) for p, _, _ in self.entries), default=10)
        lines = [f"tensor parallel plan (t={self.tp_size}, sequence_parallel={self.sequence_parallel}):"]
        lines += [f"  {path:<{width}}  {style:<16} {detail}" for path, style, detail in self.entries]
        return "\n".join(lines)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _set_submodule(root: nn.Module, path: str, new: nn.Module) -> None:
    parent, _, child = path.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, new)


@torch.no_grad()
def _shard_block(block: nn.Module, regions: list[RegionPlan], tp: TPGroup, checked: bool = False) -> None:
    """``checked``: the Linears were found to compute F.linear already (a meta copy cannot say so)."""
    for name in (n for region in regions for n in (*region.columns, region.row, *region.inner_rows)):
        linear = block.get_submodule(name)
        if not checked and not is_conv1d(linear) and not acts_as(linear, nn.Linear):
            raise TPDiscoveryError(  # a shard runs F.linear: whatever else that forward does would be lost
                f"tensor parallelism: '{name}' is a {type(linear).__name__} whose own forward does not compute "
                "F.linear(x, weight, bias), which its column/row shard would; keep it an nn.Linear, or pass "
                "tp_plan without it"
            )

    def column(linear: nn.Module, layout: ShardLayout) -> nn.Module:
        return (
            ColumnParallelConv1D(linear, layout, tp, comm=False)
            if is_conv1d(linear)
            else ColumnParallelLinear(linear, layout, tp)
        )

    def row(linear: nn.Module, layout: ShardLayout) -> nn.Module:
        return (
            RowParallelConv1D(linear, layout, tp, comm=False)
            if is_conv1d(linear)
            else RowParallelLinear(linear, layout, tp)
        )

    for region in regions:
        widest = max(region.units.values())
        for col in region.columns:
            parts, sizes = region.parts.get(col, ()), region.part_sizes.get(col, ())
            layout = ShardLayout(region.blocks[col], region.units[col], region.unit_size[col], tp.size, parts, sizes)
            _set_submodule(block, col, column(block.get_submodule(col), layout))
        closing = block.get_submodule(region.row)
        in_features = closing.weight.shape[0] if is_conv1d(closing) else closing.in_features
        _set_submodule(block, region.row, row(closing, ShardLayout(1, widest, in_features // widest, tp.size)))
        for name in region.gathered:
            linear = block.get_submodule(name)
            layout = ShardLayout(1, linear.out_features, 1, tp.size)
            _set_submodule(block, name, GatheredColumnLinear(linear, layout, tp))
        for name in region.inner_rows:  # reads the features contiguously split, as the row does
            linear = block.get_submodule(name)
            _set_submodule(
                block, name, InnerRowParallelLinear(linear, ShardLayout(1, linear.in_features, 1, tp.size), tp)
            )
        for path, (dim, bounds, ratios) in region.stored_cuts.items():  # parameters each rank reads a share of
            owner, _, leaf = path.rpartition(".")
            hold_share(block.get_submodule(owner), leaf, dim, bounds, tp, ratios)


def _install_program(block: nn.Module, plan: BlockPlan, program: BlockProgram, tp: TPGroup, sp: bool) -> None:
    """Give the block's Linears their region entries and run its own forward under the replay.
    Under SP a block keeping a region whole runs on the whole sequence (``runs_whole_sequence``)."""
    whole_sequence = sp and runs_whole_sequence(plan)
    runtime = BlockRuntime(block, program, tp, sp and not whole_sequence)
    for region, entry in zip(plan.regions, runtime.entries):
        # with a prefix, leaves reading the input (columns too) enter it by a hook (``entering``), the others
        # read what the prefix made of it: only the row takes the entry
        inside = region.prefix or region.gathered
        for name in (region.row,) if inside else (*region.columns, region.row):
            block.get_submodule(name).region = entry
    for k, names in program.entering.items():  # leaf modules reading the input of a region with a prefix
        for name in names:
            block.get_submodule(name).register_forward_pre_hook(functools.partial(_enter_input, runtime.entries[k]))
    runtime.watch_leaves(block)
    install_replay(block, runtime, tp if whole_sequence else None)


def _enter_input(entry: RegionEntry, module: nn.Module, args: tuple) -> tuple | None:
    if entry.source is None or not any(a is entry.source for a in args):
        return None
    entered, _ = entry.enter(entry.source)
    return tuple(entered if a is entry.source else a for a in args)


def runs_whole_sequence(plan: BlockPlan) -> bool:
    """A region kept whole must see every token (attention over 1/t of the sequence is another
    function), and so may code outside the regions reading their input (``sequence_bound``): under
    SP such a block gathers the sequence and runs as without SP."""
    return bool(plan.kept_whole or plan.sequence_bound)


def _shard_vocabulary(model: nn.Module, tp: TPGroup, inside_blocks: set[int], report: TPReport) -> None:
    found, head = token_embedding_and_head(model, inside_blocks)
    if found is None:
        return
    emb_path, embedding = found
    vocab = embedding.num_embeddings
    heads = [head] if head is not None else []
    take_state_dict_hooks(model, [emb_path, *(p for p, _ in heads)])
    if not acts_as(embedding, nn.Embedding):
        # its own forward (Gemma scales the lookup) would be lost in the swap: kept whole, exactly
        report.entries.append(
            (emb_path, "replicated", f"{type(embedding).__name__}'s own forward is not a lookup: kept whole")
        )
        for head_path, head in heads:
            if head.weight is not embedding.weight:
                _set_submodule(model, head_path, VocabParallelHead(head, tp))
                report.entries.append((head_path, "vocab_head", "untied"))
        return
    new_embedding = VocabParallelEmbedding(embedding, tp)
    _set_submodule(model, emb_path, new_embedding)
    report.entries.append((emb_path, "vocab_embedding", f"V={vocab} -> {new_embedding.shard.local} rows per rank"))
    if vocab % tp.size:
        log.info(
            "vocabulary %d padded to %d (a multiple of t=%d); padding logits are masked",
            vocab,
            new_embedding.shard.padded_size,
            tp.size,
        )
    for head_path, head in heads:
        tied = head.weight is embedding.weight
        _set_submodule(model, head_path, VocabParallelHead(head, tp, weight=new_embedding.weight if tied else None))
        report.entries.append((head_path, "vocab_head", "tied to the embedding" if tied else "untied"))
    stale = [p for p, m in model.named_modules() if any(w is embedding.weight for w in m.parameters(recurse=False))]
    if stale:  # a tie the split would break: the module would keep training the old, whole weight
        raise TPDiscoveryError(
            f"the token embedding '{emb_path}' shares its weight with {', '.join(stale)}, which is not the LM head "
            f"split with it (the last Linear with {vocab} outputs outside the blocks); untie them, or pass tp_plan "
            "marking the embedding 'vocab_embedding' and each module sharing its weight 'vocab_head'"
        )


@dataclass
class PlannedGroup:
    """The blocks of one list alike in structure and in the code they run (census ``BlockInputs.groups``),
    planned once."""

    indices: list[int]
    plan: BlockPlan
    args: tuple  # the first block's positional inputs at the probe
    program: BlockProgram


def plan_block_lists(
    model: nn.Module, tp_size: int, probe: Callable[[], Any] | BlockInputs, *, strict: bool = False
) -> list[tuple[str, list[nn.Module], list[PlannedGroup]]]:
    """(path, blocks, planned groups) for every block list of ``model``: the plan of a group's first
    block serves every block alike in structure and in the code it ran (census ``BlockInputs.groups``).
    ``probe``: one ordinary forward, or the inputs parallelize already captured with it."""
    block_lists = find_block_lists(model)
    if not block_lists:
        raise TPDiscoveryError(
            "tensor parallelism found no transformer blocks (a ModuleList or Sequential of modules each "
            "holding Linears); pass an explicit plan with tp_plan={'module.path': 'colwise', ...}"
        )
    inputs = probe if isinstance(probe, BlockInputs) else BlockInputs.of_block_lists(model, probe)
    groups = {path: inputs.groups(blocks) for path, blocks in block_lists}
    captured = inputs.of([blocks[g[0]] for path, blocks in block_lists for g in groups[path]])
    planned = []
    for path, blocks in block_lists:
        planned_groups = []
        for indices in groups[path]:
            name, first = _join(path, str(indices[0])), blocks[indices[0]]
            if id(first) not in captured:
                raise TPDiscoveryError(f"the probe forward never called block '{name}'; is it used in forward()?")
            args, kwargs = captured[id(first)]
            recorded, plan, before = _opened_plan([blocks[i] for i in indices], args, kwargs, name, tp_size, strict)
            linears = [m for r in plan.regions for m in (*r.columns, r.row, *r.gathered)] + plan.gates
            held = [p.rpartition(".")[0] for r in plan.regions for p in r.stored_cuts]  # their modules hold shares
            sharded = [".".join(filter(None, (str(i), m))) for i in indices for m in (*linears, *held)]
            take_state_dict_hooks(model, [_join(path, s) for s in sharded])
            planned_groups.append(PlannedGroup(indices, plan, args, BlockProgram.build(recorded.graph, plan, before)))
        planned.append((path, blocks, planned_groups))
    return planned


def apply_tensor_parallel(
    model: nn.Module,
    tp: TPGroup,
    *,
    sequence_parallel: bool,
    probe: Callable[[], Any] | BlockInputs,
    strict: bool = False,
) -> TPReport:
    """Shard ``model`` in place for this rank of ``tp``; ``probe`` runs one ordinary forward.
    ``strict``: refuse a region discovery cannot split instead of keeping it whole with a warning."""
    report = TPReport(tp.size, sequence_parallel)
    inside: set[int] = set()
    for path, blocks, groups in plan_block_lists(model, tp.size, probe, strict=strict):
        for group in groups:
            first = _join(path, str(group.indices[0]))
            if sequence_parallel:
                if not (group.args and isinstance(group.args[0], torch.Tensor)):
                    raise TPDiscoveryError(
                        f"sequence_parallel=True scatters the residual stream where it enters the blocks, as their "
                        f"first positional argument, but block '{first}' is called without one (its hidden states "
                        "passed by keyword); call the blocks as block(hidden, ...), or use sequence_parallel=False"
                    )
                C.check_sequence_divisible(group.args[0].shape[C.SEQ_DIM], tp)
            warn_whole_regions(first, blocks[group.indices[0]], group.plan, tp.size, sequence_parallel)
            for i in group.indices:
                _shard_planned_block(blocks[i], _join(path, str(i)), group, tp, sequence_parallel, report)
                inside.update(id(m) for m in blocks[i].modules())
        if sequence_parallel:
            _enter_sequence_parallel(blocks, tp)
        for group in groups:
            on_shards = sequence_parallel and not runs_whole_sequence(group.plan)
            for block in (blocks[i] for i in group.indices):
                report.partial_grad_params += _partial_gradients(block, group.plan, on_shards)
    _shard_vocabulary(model, tp, inside, report)
    report.entries = cross_check(model, report.entries)
    return report


def _shard_planned_block(
    block: nn.Module, name: str, group: PlannedGroup, tp: TPGroup, sequence_parallel: bool, report: TPReport
) -> None:
    plan = group.plan
    _shard_block(block, plan.regions, tp)
    on_shards = sequence_parallel and not runs_whole_sequence(plan)
    for gate in plan.gates:  # before the replay counts leaf depth
        linear = block.get_submodule(gate)
        layout = ShardLayout(1, linear.out_features, 1, tp.size)
        _set_submodule(block, gate, StreamGateLinear(linear, layout, tp, on_shards=on_shards))
        report.entries.append((_join(name, gate), GATE, _layout_text(block, gate)))
    for region in plan.regions:
        for target, norm in region.feature_norms.items():
            shard_feature_norm(block.get_submodule(target), norm, tp)
    _install_program(block, plan, group.program, tp, sequence_parallel)
    for region in plan.regions:
        for linear in (*region.columns, *region.inner_rows, region.row):
            report.entries.append((_join(name, linear), region.style(linear), _layout_text(block, linear)))
        for linear in region.gathered:
            report.entries.append((_join(name, linear), GATHERED, _layout_text(block, linear)))
    report.entries += _replicated_entries(name, plan)


def _replicated_entries(prefix: str, plan: BlockPlan) -> list[tuple[str, str, str]]:
    """The report's lines for what a block keeps whole: routers and routed experts, regions discovery
    could not split, norms over all heads and modules with per-head parameters."""
    norms = [(name, norm) for region in plan.regions for name, norm in region.feature_norms.items()]
    prefix_paths = [t for region in plan.regions for t in region.prefix]
    return [
        *((_join(prefix, name), "replicated", PREFIX) for name in prefix_paths),
        *((_join(prefix, name), "replicated", WHOLE) for name in plan.replicated),
        *((_join(prefix, name), "replicated", KEPT) for kept in plan.kept_whole for name in kept.linears),
        *((_join(prefix, name), "replicated", _module_text(n)) for name, n in norms),
    ]


WHOLE = "whole on every rank: a router or gate (its output reaches no Linear), or a routed expert"
KEPT = "whole on every rank: a region discovery could not split (the warning says why)"
HEADS = "per-head parameters: each rank holds its heads' slice (the module's others whole, gradients summed over tp)"
GATHERED = "colwise_gathered"  # a prefix's Linear: this rank's output features, all-gathered
GATE = "colwise_gate"  # a gate on the stream outside every region: this rank's output features, all-gathered
PREFIX = "before a region's columns, on its input: whole on every rank, gradients summed over tp"
NORM = "a norm over all heads: its weight whole, each rank its heads' slice, statistics summed over tp"
ON_GATHERED = "over all heads' features: run whole on the gathered features, each rank keeping its share"


def _layout_text(block: nn.Module, name: str) -> str:
    layer = block.get_submodule(name)
    layout = layer.layout
    what = "heads" if layout.unit_size > 1 else "features"
    repl = f", replicated x{layout.replication}" if layout.replication > 1 else ""
    kind = "Conv1D (in, out)" if getattr(layer, "transposed", False) else "Linear"
    return f"{layout.local_units}/{layout.units} {what}{repl} per rank, {kind} weight {tuple(layer.weight.shape)}"


def _module_text(norm: FeatureNorm | HeadSlices | GatheredModule) -> str:
    return NORM if isinstance(norm, FeatureNorm) else ON_GATHERED if isinstance(norm, GatheredModule) else HEADS


def _enter_sequence_parallel(blocks: list[nn.Module], tp: TPGroup) -> None:
    def split_input(module: nn.Module, args: tuple, kwargs: dict):
        return (C.scatter_to_sp_region(args[0], tp), *args[1:]), kwargs

    def gather_output(module: nn.Module, args: tuple, output: Any):
        if isinstance(output, (tuple, list)):  # the hidden states first (a list: [h] + attention weights)
            items = [C.gather_from_sp_region_split_grad(output[0], tp), *output[1:]]
            return items if isinstance(output, list) else tuple(items)
        return C.gather_from_sp_region_split_grad(output, tp)

    blocks[0].register_forward_pre_hook(split_input, with_kwargs=True)
    blocks[-1].register_forward_hook(gather_output)


def _partial_gradients(block: nn.Module, plan: BlockPlan, on_shards: bool) -> list[tuple[nn.Module, str]]:
    """The parameters of ``block`` whose gradient each rank holds a part of: run on 1/t of the
    sequence, every one but the shards'; on the whole sequence, those applied to this rank's heads
    only (per-head q/k norms)."""
    if not on_shards:
        partial = [t for region in plan.regions for t in (*region.partial, *region.prefix)]
        return [p for t in dict.fromkeys(partial) for p in parameters_at(block, t)]
    return [
        (module, name)
        for module in block.modules()
        if not isinstance(module, ColumnParallelLinear)
        for name, _ in module.named_parameters(recurse=False)
        if not (isinstance(module, RowParallelLinear) and name == "weight")
        and parameter_shard(module, name) is None
        and not isinstance(module, InnerRowParallelLinear)  # its bias's gradient is summed by its f already
    ]


def apply_explicit_plan(model: nn.Module, plan: dict[str, str], tp: TPGroup) -> TPReport:
    """``tp_plan={"path or glob": style}`` for models discovery cannot read (explicit_plan.py).
    Styles: "colwise", "colwise_fused:K" (K equal side-by-side parts such as q/k/v),
    "colwise_fused:a|b|c" (parts of a, b, c heads), "rowwise", "vocab_embedding", "vocab_head".
    No sequence parallelism on this path.
    """
    check_styles(plan)
    resolved = resolve_plan(model, plan, "tp_plan")
    check_ties(model, resolved)
    take_state_dict_hooks(model, list(resolved))
    report = TPReport(tp.size, False)
    report.entries.extend(rewrite(model, resolved, tp))
    return report


def tensor_parallel_plan(model: nn.Module, tp_size: int, probe: Callable[[], Any], *, strict: bool = False) -> TPReport:
    """Dry run: the plan ``apply_tensor_parallel`` would choose at ``tp_size``, without changing
    the model or needing a process group (``probe`` runs one ordinary forward)."""
    report = TPReport(tp_size, False)
    for path, blocks, groups in plan_block_lists(model, tp_size, probe, strict=strict):
        for group in groups:
            plan = group.plan
            where = _join(path, "*") if len(groups) == 1 else _join(path, _index_glob(group.indices))
            warn_whole_regions(_join(path, str(group.indices[0])), blocks[group.indices[0]], plan, tp_size)
            for region in plan.regions:
                widest = max(region.units.values())
                for name in (*region.columns, *region.inner_rows, region.row):
                    units = region.units.get(name, widest)
                    unit_size = region.unit_size.get(name, region.unit_size[max(region.units, key=region.units.get)])
                    what = "heads" if unit_size > 1 else "units"
                    copies = max(1, tp_size // min(region.parts.get(name) or (units,)))  # a part of fewer than t
                    repl = f", replicated x{copies}" if copies > 1 else ""
                    detail = f"{max(1, units // tp_size)}/{units} {what}{repl} per rank"
                    report.entries.append((_join(where, name), region.style(name), detail))
                for name in region.gathered:
                    features = blocks[group.indices[0]].get_submodule(name).out_features
                    report.entries.append((_join(where, name), GATHERED, f"{features // tp_size}/{features} features"))
            for name in plan.gates:
                features = blocks[group.indices[0]].get_submodule(name).out_features
                report.entries.append((_join(where, name), GATE, f"{features // tp_size}/{features} features"))
            report.entries += _replicated_entries(where, plan)
    report.entries = cross_check(model, report.entries)
    return report


def _opened_plan(blocks: list[nn.Module], args: tuple, kwargs: dict, name: str, tp_size: int, strict: bool) -> tuple:
    """(recording, plan, its recorded arguments) of the first of ``blocks``; where a region failed at a
    leaf module with parameters (recorded as one call), recorded again with those leaves op by op in
    every block (``recording.OPEN``), kept if that splits more weights. ``strict``: refused if either
    keeps a region whole."""
    call = (blocks[0], args, kwargs)
    recorded = trace_block(*call, name)
    before = snapshot_args(recorded.graph)
    plan = _tried_plan(recorded, name, tp_size, False, call, before)
    leaves = plan.failed_leaves
    _mark_open(blocks, leaves, True)
    if leaves:
        opened = trace_block(*call, name)
        opened_before = snapshot_args(opened.graph)
        opened_plan = _tried_plan(opened, name, tp_size, False, call, opened_before)
        if split_weights(opened, opened_plan) > split_weights(recorded, plan):
            recorded, plan, before = opened, opened_plan, opened_before
        else:
            _mark_open(blocks, leaves, False)
    if strict and plan.kept_whole:
        raise TPDiscoveryError(f"{plan.kept_whole[0].reason}; " + working_plan_hint(name, plan.regions, tp_size))
    return recorded, plan, before


def _mark_open(blocks: list[nn.Module], leaves: list[str], opened: bool) -> None:
    """Mark (or unmark) the leaf modules ``leaves`` of every block to be recorded op by op."""
    for module in (block.get_submodule(leaf) for block in blocks for leaf in leaves):
        module.__dict__.update({OPEN: True}) if opened else module.__dict__.pop(OPEN)


def _tried_plan(recorded: Any, name: str, tp_size: int, strict: bool, call: tuple, before: dict) -> BlockPlan:
    """The block's plan, with each region whose split fails a trial run on meta kept whole (trial.py)."""
    pristine = {n: (n.args, n.kwargs) for n in recorded.graph.nodes}
    plan = plan_block(recorded, name, tp_size, strict=strict)
    if not plan.regions or not runs_on_meta(*call):
        return plan

    def replan(keep: dict[str, str], strict: bool = False) -> BlockPlan:
        for node, (args, kwargs) in pristine.items():
            node.args, node.kwargs = args, kwargs
        return plan_block(recorded, name, tp_size, strict=strict, keep_whole=keep)

    def fails(tried: BlockPlan) -> BaseException | None:
        program = BlockProgram.build(recorded.graph, tried, before)
        return trial_error(lambda block: _split_copy(block, tried, program, tp_size), *call)

    failing = regions_that_fail(plan, fails, replan, name)
    return replan(failing, strict) if failing else plan


def _split_copy(block: nn.Module, plan: BlockPlan, program: BlockProgram, tp_size: int) -> None:
    """Rank 0's split of a meta copy of a block, collectives skipped (meta tensors pass through them)."""
    tp = TPGroup(None, tp_size, 0)
    _shard_block(block, plan.regions, tp, checked=True)
    for region in plan.regions:
        for target, norm in region.feature_norms.items():
            shard_feature_norm(block.get_submodule(target), norm, tp)
    _install_program(block, plan, program, tp, False)


def _index_glob(indices: list[int]) -> str:
    """A group's block indices as one path element: "3" or "{0,1,2}"."""
    return str(indices[0]) if len(indices) == 1 else "{" + ",".join(map(str, indices)) + "}"
