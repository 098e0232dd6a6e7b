"""``ptdp doctor``'s layout checks: the proposed t, p, d, c, e on devices x num_nodes, validated as the
strategy will, and where each axis's groups fall (within a node or across nodes) with the collective
they run, from the same rank order the meshes use (``ParallelDims.group_ranks``)."""

from __future__ import annotations

from lightning_ptdp.config import ParallelConfig, check_positive_int
from lightning_ptdp.core.dims import ParallelDims
from lightning_ptdp.tools.checks import FAIL, OK, WARN, Check

AXIS_TRAFFIC: dict[str, str] = {
    "tp": "all-reduce every layer",
    "cp": "key/value all-gather every layer",
    "ep": "token all-to-all every MoE layer",
    "dp": "gradient all-reduce / reduce-scatter every step",
    "pp": "activation send/recv every micro-batch",
}
"""Each axis, fastest-varying rank first (Megatron's order, experts carved out of d x c), and what its groups carry."""


def layout_dims(
    tensor_parallel_size: int,
    pipeline_parallel_size: int,
    data_parallel_size: int | str,
    world_size: int,
    expert_parallel_size: int = 1,
    context_parallel_size: int = 1,
) -> ParallelDims:
    """The degrees on ``world_size`` processes, or ValueError with the strategy's own message."""
    config = ParallelConfig(
        tensor_parallel_size=tensor_parallel_size,
        pipeline_parallel_size=pipeline_parallel_size,
        data_parallel_size=data_parallel_size,
        expert_parallel_size=expert_parallel_size,
        context_parallel_size=context_parallel_size,
    )
    return ParallelDims.from_config(config, world_size)


def check_groups(dims: ParallelDims, devices: int) -> Check:
    """Each axis of size > 1: its group size, the rank stride inside a group, and the most nodes one
    group spans (``devices`` processes per node), with the traffic it carries."""
    parts = []
    for axis, traffic in AXIS_TRAFFIC.items():
        groups = dims.group_ranks(axis)
        if len(groups[0]) < 2:
            continue
        nodes = max(len({rank // devices for rank in group}) for group in groups)
        where = "within a node" if nodes == 1 else f"across {nodes} nodes"
        stride = groups[0][1] - groups[0][0]
        parts.append(f"{axis} {len(groups)} x {len(groups[0])} ranks, stride {stride}, {where} ({traffic})")
    return Check("groups", OK, "; ".join(parts) or "one process: no groups")


def check_layout(
    tensor_parallel_size: int,
    pipeline_parallel_size: int,
    data_parallel_size: int | str,
    devices: int,
    num_nodes: int,
    gpus_on_node: int = 0,
    *,
    expert_parallel_size: int = 1,
    context_parallel_size: int = 1,
) -> list[Check]:
    """The proposed (t, p, d, c, e) on devices x num_nodes, validated exactly as the strategy will,
    then its groups."""
    try:
        check_positive_int("devices", devices)
        check_positive_int("num_nodes", num_nodes)
        dims = layout_dims(
            tensor_parallel_size,
            pipeline_parallel_size,
            data_parallel_size,
            devices * num_nodes,
            expert_parallel_size,
            context_parallel_size,
        )
    except ValueError as err:
        return [Check("layout", FAIL, str(err))]
    extra = (f" c={dims.cp}" if dims.cp > 1 else "") + (f" e={dims.ep}" if dims.ep > 1 else "")
    checks = [
        Check(
            "layout",
            OK,
            f"t={dims.tp} p={dims.pp} d={dims.dp}{extra} on {dims.world_size} processes "
            f"(devices={devices} x num_nodes={num_nodes})",
        ),
        check_groups(dims, devices),
    ]
    if devices % dims.tp:
        why = (
            f"t={dims.tp} > {devices} GPUs per node"
            if dims.tp > devices
            else f"t={dims.tp} does not divide devices={devices}"
        )
        checks.append(
            Check(
                "tp placement",
                WARN,
                f"tensor-parallel groups cross nodes: {why}; their all-reduces "
                "(every layer) would run over the network",
                "keep t <= devices and dividing it; span nodes with p or d",
            )
        )
    if gpus_on_node and devices > gpus_on_node:
        checks.append(
            Check(
                "devices",
                FAIL,
                f"devices={devices} but this node has {gpus_on_node} visible GPU(s)",
                "lower devices, or check CUDA_VISIBLE_DEVICES",
            )
        )
    return checks
