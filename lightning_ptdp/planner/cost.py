"""The planner's hardware terms: GEMMs, memory-bound kernels and NCCL collectives on a ``Cluster``.

Every time is latency + work / rate. One constant is fitted: ``GEMM_EFFICIENCY`` (0.741), the share
of the dense bf16 peak a GEMM filling every SM reaches, by least squares on two Table 1 rows
(gpt_1.7b and gpt_1t at their own layouts; the other 8 rows are predictions). Everything else is a
data-sheet or NCCL source figure, named where it is used (docs/architecture.md, "The planner").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lightning_ptdp.planner.models import check_positive

GB = 1e9
GEMM_EFFICIENCY = 0.741
"""Fitted (see the module docstring): achieved / peak FLOP/s of a GEMM with no tile or wave loss."""

# NCCL's tuning model (src/graph/tuning.cc, Simple protocol), seconds.
RING_BASE_LATENCY = 8.4e-6
TREE_HOP_LATENCY = 28e-6  # NVLink and network alike for Tree/Simple
TREE_BANDWIDTH_FACTOR = 0.92 * 0.5  # tree busBw * .92, algorithm bandwidth = busBw * .5


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """GPUs and links. The defaults are the paper's Selene: DGX A100 nodes of 8 x 80 GB A100s
    (NVSwitch), 8 HDR InfiniBand HCAs (200 Gb/s, one per GPU) per node.

    Bandwidths are bytes/s per GPU and direction. A group inside a node runs at
    ``intra_node_bandwidth``; a group spanning nodes at ``k * inter_node_bandwidth`` for its k
    members per node (each drives its own HCA), at most ``intra_node_bandwidth``.
    """

    num_gpus: int
    gpus_per_node: int = 8
    gpu_memory_bytes: float = 80 * GB
    peak_flops: float = 312e12
    """Dense bf16 tensor-core peak of one GPU (A100 data sheet)."""
    gemm_efficiency: float = GEMM_EFFICIENCY
    hbm_bandwidth: float = 2.039e12
    """What memory-bound kernels (norms, softmax, dropout, GeLU, the optimizer) stream at (A100 80 GB data sheet)."""
    num_sms: int = 108
    gemm_tile: tuple[int, int] = (256, 128)
    """Output tile of one thread block: cuBLAS's largest bf16 tile on Ampere (NVIDIA's Matrix
    Multiplication Background guide, tile and wave quantization)."""
    intra_node_bandwidth: float = 240 * GB
    inter_node_bandwidth: float = 25 * GB
    nvlink_hop_latency: float = 3.4e-6
    network_hop_latency: float = 14e-6
    tree_all_reduce: bool = True
    """Whether the collective library uses a tree all-reduce across nodes (NCCL does, unless NCCL_ALGO=Ring)."""
    flash_attention: bool = True
    """Whether attention runs as one fused kernel that keeps no s x s scores (flash or cuDNN SDPA, what
    ``F.scaled_dot_product_attention`` picks for 16-bit inputs on sm80+ GPUs: A100, H100); False: the
    scores are written, softmaxed and kept in memory (eager or math attention, pre-sm80 GPUs, Megatron 2021)."""

    def __post_init__(self) -> None:
        for name in ("num_gpus", "gpus_per_node", "num_sms"):
            check_positive(f"Cluster.{name}", getattr(self, name))
        for name in (
            "gpu_memory_bytes",
            "peak_flops",
            "hbm_bandwidth",
            "intra_node_bandwidth",
            "inter_node_bandwidth",
            "nvlink_hop_latency",
            "network_hop_latency",
        ):
            check_positive(f"Cluster.{name}", getattr(self, name), integer=False)
        if (
            isinstance(self.gemm_efficiency, bool)
            or not isinstance(self.gemm_efficiency, (int, float))
            or not 0 < self.gemm_efficiency <= 1
        ):
            raise ValueError(f"Cluster.gemm_efficiency must be in (0, 1], got {self.gemm_efficiency!r}")
        if not isinstance(self.flash_attention, bool) or not isinstance(self.tree_all_reduce, bool):
            raise ValueError(
                f"Cluster.flash_attention and tree_all_reduce must be True or False, got "
                f"{self.flash_attention!r} and {self.tree_all_reduce!r}"
            )
        if len(self.gemm_tile) != 2 or any(
            isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in self.gemm_tile
        ):
            raise ValueError(f"Cluster.gemm_tile must be two positive integers (rows, columns), got {self.gemm_tile!r}")
        if self.num_gpus > self.gpus_per_node and self.num_gpus % self.gpus_per_node:
            raise ValueError(
                f"Cluster.num_gpus={self.num_gpus} is not a whole number of nodes of "
                f"{self.gpus_per_node} GPUs; use a multiple of gpus_per_node"
            )

    @property
    def num_nodes(self) -> int:
        return max(1, self.num_gpus // self.gpus_per_node)

    @classmethod
    def paper(cls, num_gpus: int, **overrides: object) -> Cluster:
        """Selene as the paper ran it: the defaults, with Megatron 2021's attention, which writes and
        keeps its s x s scores (fused scale-mask-softmax; FlashAttention came in 2022). Table 1's
        comparisons and the fit of ``GEMM_EFFICIENCY`` use it."""
        return cls(num_gpus=num_gpus, **{"flash_attention": False, **overrides})

    @classmethod
    def h100(cls, num_gpus: int, **overrides: object) -> Cluster:
        """DGX H100 nodes: 8 x 80 GB H100 SXM (989 TFLOP/s dense bf16, 3.35 TB/s HBM3, 132 SMs; data
        sheet), NVLink 4 at NCCL's ``SM90_NVLINK_BW`` (20.6 GB/s) x 18 links, one 400 Gb/s NDR HCA
        per GPU. ``gemm_efficiency`` stays the A100 fit: nothing measured on H100 has refitted it."""
        sheet: dict = dict(
            gpu_memory_bytes=80 * GB,
            peak_flops=989e12,
            hbm_bandwidth=3.35e12,
            num_sms=132,
            intra_node_bandwidth=20.6 * 18 * GB,
            inter_node_bandwidth=50 * GB,
        )
        return cls(num_gpus=num_gpus, **{**sheet, **overrides})


# ------------------------------------------------------------------------------------------ compute
def wave_efficiency(rows: float, cols: float, cluster: Cluster, batch: int = 1) -> float:
    """Useful fraction of the tiles x waves a GEMM occupies: a (rows x cols) output is cut into tiles,
    one per SM at a time, so the last wave of tiles and the ragged tile edges run part-empty. The
    better of the two tile orientations (cuBLAS picks its kernel per shape)."""
    best = 0.0
    for tile_rows, tile_cols in (cluster.gemm_tile, cluster.gemm_tile[::-1]):
        tiles = batch * math.ceil(rows / tile_rows) * math.ceil(cols / tile_cols)
        waves = math.ceil(tiles / cluster.num_sms)
        best = max(best, batch * rows * cols / (waves * cluster.num_sms * tile_rows * tile_cols))
    return best


def gemm_seconds(rows: float, cols: float, inner: float, cluster: Cluster, batch: int = 1) -> float:
    """One (rows x inner) @ (inner x cols) bf16 GEMM (``batch`` of them): a roofline, the larger of
    compute at the fitted efficiency and operand traffic at HBM speed, over the wave efficiency."""
    flops = 2.0 * batch * rows * cols * inner
    traffic = 2.0 * batch * (rows * inner + inner * cols + rows * cols)
    roof = max(flops / (cluster.peak_flops * cluster.gemm_efficiency), traffic / cluster.hbm_bandwidth)
    return roof / wave_efficiency(rows, cols, cluster, batch)


def gemm_pass_seconds(rows: float, cols: float, inner: float, cluster: Cluster, batch: int = 1) -> tuple[float, float]:
    """(forward, backward) of a linear layer's GEMM: backward is the input gradient
    (rows x inner) and the weight gradient (inner x cols), each as many FLOPs as the forward."""
    forward = gemm_seconds(rows, cols, inner, cluster, batch)
    backward = gemm_seconds(rows, inner, cols, cluster, batch) + gemm_seconds(inner, cols, rows, cluster, batch)
    return forward, backward


def flash_attention_seconds(flops: float, cluster: Cluster) -> tuple[float, float]:
    """(forward, backward) of a fused attention kernel whose forward runs ``flops`` (QK^T and scores x
    V): compute-bound at the fitted GEMM efficiency, no s x s traffic; the backward computes the
    scores again and four products (dQ, dK, dV, dP): 2.5x the forward, as FlashAttention counts it."""
    forward = flops / (cluster.peak_flops * cluster.gemm_efficiency)
    return forward, 2.5 * forward


def memory_seconds(nbytes: float, cluster: Cluster) -> float:
    """A memory-bound kernel streaming ``nbytes`` through HBM."""
    return nbytes / cluster.hbm_bandwidth


# ------------------------------------------------------------------------------------- collectives
def group_bandwidth(members_per_node: int, spans_nodes: bool, cluster: Cluster) -> float:
    """Bytes/s per rank of a group: NVLink inside a node; across nodes, the HCAs of its members."""
    if not spans_nodes:
        return cluster.intra_node_bandwidth
    return min(cluster.intra_node_bandwidth, members_per_node * cluster.inter_node_bandwidth)


def all_reduce_seconds(nbytes: float, ranks: int, members_per_node: int, cluster: Cluster) -> float:
    """NCCL all-reduce of ``nbytes`` over ``ranks`` with ``members_per_node`` of them per node: the
    faster of ring and tree, each latency + bytes / bandwidth as NCCL's own tuner estimates them."""
    if ranks == 1:
        return 0.0
    nodes = math.ceil(ranks / members_per_node)
    bandwidth = group_bandwidth(members_per_node, nodes > 1, cluster)
    # ring: 2(n-1) steps, 2*nodes of them over the network; each rank sends 2(n-1)/n of the buffer
    net_steps = 2 * nodes if nodes > 1 else 0
    ring_latency = (
        RING_BASE_LATENCY
        + (2 * (ranks - 1) - net_steps) * cluster.nvlink_hop_latency
        + net_steps * cluster.network_hop_latency
    )
    ring = ring_latency + 2 * (ranks - 1) / ranks * nbytes / bandwidth
    # tree: up and down a chain inside each node and a binary tree across nodes
    tree_latency = 2 * ((members_per_node - 1) + math.log2(nodes)) * TREE_HOP_LATENCY
    tree = tree_latency + nbytes / (TREE_BANDWIDTH_FACTOR * bandwidth)
    return min(ring, tree) if cluster.tree_all_reduce else ring


def all_gather_seconds(nbytes: float, ranks: int, members_per_node: int, cluster: Cluster) -> float:
    """Ring all-gather (or reduce-scatter) whose full output is ``nbytes``: half an all-reduce's traffic."""
    if ranks == 1:
        return 0.0
    nodes = math.ceil(ranks / members_per_node)
    hop = cluster.network_hop_latency if nodes > 1 else cluster.nvlink_hop_latency
    bandwidth = group_bandwidth(members_per_node, nodes > 1, cluster)
    return RING_BASE_LATENCY + (ranks - 1) * hop + (ranks - 1) / ranks * nbytes / bandwidth


def all_to_all_seconds(nbytes: float, ranks: int, members_per_node: int, cluster: Cluster) -> float:
    """All-to-all of ``nbytes`` per rank, 1/ranks of it to each member (NCCL: grouped sends, every
    peer at once): the share for members in the node over NVLink, the rest over the GPU's own HCA,
    concurrently; one hop of latency."""
    if ranks == 1:
        return 0.0
    share = nbytes / ranks
    inside, outside = (members_per_node - 1) * share, (ranks - members_per_node) * share
    hop = cluster.network_hop_latency if outside else cluster.nvlink_hop_latency
    return RING_BASE_LATENCY + hop + max(inside / cluster.intra_node_bandwidth, outside / cluster.inter_node_bandwidth)


def send_seconds(nbytes: float, across_nodes: bool, cluster: Cluster) -> float:
    """One point-to-point transfer between neighbouring pipeline stages (one link, full duplex)."""
    if across_nodes:
        return cluster.network_hop_latency + nbytes / cluster.inter_node_bandwidth
    return cluster.nvlink_hop_latency + nbytes / cluster.intra_node_bandwidth
