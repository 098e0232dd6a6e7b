"""Shared vocabulary of tensor-parallel discovery: plans, errors and small fx helpers."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from lightning_ptdp.tensor_parallel.feature_norm import FeatureNorm, GatheredModule, HeadSlices
from lightning_ptdp.tensor_parallel.op_semantics import local_edge


def _blocks_glob(block: str) -> str:
    return re.sub(r"\.[^.]+$", ".*", block) if "." in block else "*"


def working_plan_hint(block: str, regions: list[Any], tp_size: int) -> str:
    """The explicit plan that works when discovery splits some of a block's regions but not all:
    the regions it could split and an explicit plan can express, one glob each; the rest stay whole."""
    blocks = _blocks_glob(block)
    # a region with per-head norms needs discovery's gradient sums (an explicit plan has none)
    usable = [r for r in regions if not (r.rewrites_shapes or r.partial or r.prefix or r.gathered)]
    plan = {f"{blocks}.{m}": r.style(m) for r in usable for m in (*r.columns, r.row)}
    if not plan:
        return (
            f"no region of '{block}' can be split without discovery, so keep its blocks whole: "
            f"tensor_parallel_size=1, or a tp_plan that names only the embedding ('vocab_embedding') and the "
            "LM head ('vocab_head')"
        )
    return (
        f"an explicit plan that keeps that region whole on every rank and splits the rest works: "
        f"PTDPStrategy(tensor_parallel_size={tp_size}, tp_plan={plan!r}) (add 'vocab_embedding' and "
        "'vocab_head' entries for the embedding and the LM head)"
    )


def plan_hint(block: str, module: str) -> str:
    """The shortest explicit plan to suggest: one glob over every block of the list."""
    blocks = _blocks_glob(block)
    return (
        f"pass an explicit plan instead, e.g. PTDPStrategy(tensor_parallel_size=2, tp_plan={{'{blocks}.{module}': "
        "'rowwise', ...}), one glob per module of the block, each 'colwise', 'rowwise', 'colwise_fused:3' "
        "(fused q/k/v), 'vocab_embedding' or 'vocab_head'"
    )


class TPDiscoveryError(ValueError):
    """The block's dataflow defeated automatic discovery; the message says where and what to do."""


@dataclass
class Sharded:
    dim: int
    ratio: int  # global size / local size along ``dim``
    bounds: tuple[int, ...] = ()  # a fused column's part boundaries (global), where slicing may cut
    outer: int = 1  # heads folded into the batch, (B*nh, T, hs): ``dim`` holds B blocks, each split over t
    part_ratios: tuple[int, ...] = ()  # each part's own ratio where they differ (a replicated KV head beside q)

    def part_ratio(self, index: int) -> int:
        return self.part_ratios[index] if self.part_ratios else self.ratio

    @property
    def local_width(self) -> int:
        """This rank's size along ``dim`` where the tensor holds fused parts."""
        return self.local_edge(self.bounds[-1])

    def local_edge(self, edge: int) -> int:
        """The local offset of the global part boundary ``edge``: each part before it at its ratio."""
        return local_edge(edge, self.bounds, self.ratio, self.part_ratios)


@dataclass(frozen=True)
class OperandSlice:
    """A whole per-head operand of one call, cut to each rank's heads at run time (ALiBi's bias, a sink)."""

    index: int  # argument leaf
    dim: int
    width: int  # its global size along ``dim``; already 1/t of it at run time (made from a local size): kept
    made_inside: bool  # computed from the region's input: its gradient already reaches f, no second sum
    of_parameters: bool  # computed from the block's parameters alone (summed over tp after backward under SP)
    outer: int = 1  # ``dim`` holds this many blocks, each cut to this rank's heads (ALiBi's (B*nh, 1, T))
    bounds: tuple[int, ...] = ()  # fused parts along ``dim`` (0 ... width): this rank's share of each
    part_ratios: tuple[int, ...] = ()  # each part's ratio where they differ (Sharded.part_ratios)

    def local_width(self, tp_size: int) -> int:
        """Its size along ``dim`` once cut: 1/t, or each fused part at its own ratio."""
        return local_edge(self.width, self.bounds or (0, self.width), tp_size, self.part_ratios)


@dataclass
class RegionPlan:
    """One column-parallel -> row-parallel region of a block (attention or MLP)."""

    columns: list[str]
    row: str
    input_node: str
    is_attention: bool = False
    blocks: dict[str, int] = field(default_factory=dict)
    units: dict[str, int] = field(default_factory=dict)
    unit_size: dict[str, int] = field(default_factory=dict)
    parts: dict[str, tuple[int, ...]] = field(default_factory=dict)  # unequal fused parts' units
    part_sizes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # their unit sizes, where they differ
    paired_parts: dict[str, int] = field(default_factory=dict)
    """Columns split as this many equal fused parts because an op pairs their heads across those parts
    (a chunk of the heads into halves later combined: DIFF attention): found by a failed propagation."""
    partial: list[str] = field(default_factory=list)  # modules with weights applied to local heads
    # norms over all heads, and modules with per-head parameters: each rank its slice (feature_norm.py)
    feature_norms: dict[str, FeatureNorm | HeadSlices | GatheredModule] = field(default_factory=dict)
    rewrites_shapes: bool = False  # a shape argument names a global size (only discovery rewrites it)
    operand_slices: dict[Any, list[OperandSlice]] = field(default_factory=dict)
    """Call site -> the whole per-head operands each rank slices (ALiBi's bias, a sink's logits)."""
    sharded_outputs: dict[int, int] = field(default_factory=dict)
    """Extra block outputs still head-sharded (index -> dim): gathered when read (extra_outputs.py)."""
    cut_parameters: list[str] = field(default_factory=list)
    """Parameters (paths) of two or more dims cut to this rank's share where a call reads them (a
    depthwise conv's weight): held as that share (``stored_cuts``), else whole and named in the warning."""
    stored_cuts: dict[str, tuple[int, tuple[int, ...], tuple[int, ...]]] = field(default_factory=dict)
    """Cut parameters each rank holds as its share alone: path -> (dim, fused part bounds, their ratios)."""
    sharded_sites: dict[Any, tuple[int, int]] = field(default_factory=dict)
    """Call site -> (dim, global / local size) of its head-sharded result: a Python check of that result's
    whole shape against the global one still passes (replay.GlobalShape)."""
    prefix: list[str] = field(default_factory=list)
    """What runs on the entered input before the columns (a low-rank down-projection and its norm): module or parameter
    paths, whole on every rank, their gradients summed over tp (each rank's holds its heads' part)."""
    gathered: list[str] = field(default_factory=list)
    """The prefix's Linears split by output features and gathered (layers.GatheredColumnLinear)."""
    inner_rows: list[str] = field(default_factory=list)
    """Linears reading the sharded features whose reduced output the region reads again (a scan's x_proj):
    row shards whose sum every rank then holds whole (layers.InnerRowParallelLinear)."""

    def reset_propagation(self) -> None:
        """Forget what following the sharded dim found (before following it again)."""
        self.feature_norms.clear()
        self.partial.clear()
        self.operand_slices.clear()
        self.sharded_outputs.clear()
        self.sharded_sites.clear()
        self.cut_parameters.clear()
        self.rewrites_shapes = False

    def style(self, name: str) -> str:
        """The explicit-plan style of one of this region's Linears."""
        if name == self.row:
            return "rowwise"
        if name in self.inner_rows:
            return "rowwise_inner"
        if name in self.parts:
            return "colwise_fused:" + "|".join(map(str, self.parts[name]))
        return "colwise" if self.blocks[name] == 1 else f"colwise_fused:{self.blocks[name]}"


@dataclass
class KeptWhole:
    """Linears of one region discovery could not split: whole on every rank, and why."""

    linears: list[str]
    reason: str


@dataclass
class BlockPlan:
    """The traced graph of one block (shape arguments already rewritten) and its regions."""

    graph: fx.Graph
    regions: list[RegionPlan]
    replicated: list[str] = field(default_factory=list)
    """Linears no region holds (their output reaches no Linear): whole on every rank."""
    kept_whole: list[KeptWhole] = field(default_factory=list)
    """Regions left whole on every rank because discovery could not split them (the rest is split)."""
    gates: list[str] = field(default_factory=list)
    """Linears no region holds whose output is as wide as the block's hidden state (a gate on the
    stream): split by output features and gathered (layers.StreamGateLinear)."""
    failed_leaves: list[str] = field(default_factory=list)
    """Leaf modules with parameters (recorded as one call) some pairing's region failed at, or that run
    whole on gathered features: recorded op by op, they may split (apply._opened_plan)."""
    sequence_bound: str = ""
    """Why, under SP, the block runs on the whole sequence though it splits every region: code outside
    the regions reads a region's input (a MoE's router and routed experts beside a shared expert),
    and its size reads, which no graph records, may mean either length."""


def ancestry(node: fx.Node) -> set[fx.Node]:
    """``node`` and every node it is computed from."""
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen


def _shape(node: Any) -> tuple[int, ...] | None:
    meta = node.meta.get("tensor_meta") if isinstance(node, fx.Node) else None
    return tuple(meta.shape) if meta is not None and hasattr(meta, "shape") else None


def _call_name(node: fx.Node) -> str:
    if node.op == "call_method":
        return node.target
    return getattr(node.target, "__name__", str(node.target))


def callable_of(node: fx.Node) -> Any:
    """What a recorded call_function or call_method node calls (a method as its ``torch.Tensor`` function)."""
    return getattr(torch.Tensor, node.target) if node.op == "call_method" else node.target


def _shape_args(node: fx.Node) -> tuple[list, bool]:
    """The shape arguments of view/reshape as a list, and whether they came packed in one tuple."""
    rest = (
        list(node.args[1:])
        if node.op == "call_method" or _call_name(node) in ("reshape", "expand", "broadcast_to")
        else []
    )
    if len(rest) == 1 and isinstance(rest[0], (tuple, list)):
        return list(rest[0]), True
    return rest, False
