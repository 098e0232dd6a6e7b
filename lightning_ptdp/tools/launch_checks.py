"""``ptdp doctor``'s launch checks: NCCL variables that slow a run, and the launcher's environment
(torchrun, SLURM, Lightning's own) against devices x num_nodes, before any process group exists."""

from __future__ import annotations

import re
from typing import Mapping, Optional

from lightning_ptdp.tools.checks import FAIL, OK, WARN, Check

LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")
SLURM_INTERACTIVE_NAMES = ("bash", "interactive")  # Lightning ignores SLURM for these job names


def check_nccl_env(env: Mapping[str, str], num_nodes: int) -> Check:
    """NCCL_* (and CUDA_VISIBLE_DEVICES) variables, warning on the ones that switch off fast paths."""
    shown = {k: v for k, v in sorted(env.items()) if k.startswith(("NCCL_", "TORCH_NCCL_", "CUDA_VISIBLE"))}
    listed = ", ".join(f"{k}={v}" for k, v in shown.items()) or "none set (NCCL picks its defaults)"
    slow = [
        f"{k}=1 ({why})"
        for k, why, applies in (
            ("NCCL_P2P_DISABLE", "GPU-to-GPU copies go through the host", True),
            ("NCCL_SHM_DISABLE", "no shared-memory transport", True),
            ("NCCL_IB_DISABLE", "inter-node traffic over TCP sockets", num_nodes > 1),
        )
        if applies and shown.get(k) == "1"
    ]
    if slow:
        return Check(
            "nccl env",
            WARN,
            f"{listed}; slows training: {'; '.join(slow)}",
            "unset these unless a hang was traced to them; NCCL_DEBUG=INFO shows the transports",
        )
    return Check("nccl env", OK, listed)


def env_int(env: Mapping[str, str], key: str) -> Optional[int]:
    match = re.match(r"\d+", env.get(key, ""))  # SLURM writes e.g. SLURM_NTASKS_PER_NODE="4(x2)"
    return int(match.group(0)) if match else None


def under_slurm(env: Mapping[str, str]) -> bool:
    return "SLURM_NTASKS" in env and env.get("SLURM_JOB_NAME") not in SLURM_INTERACTIVE_NAMES


def _slurm_check(env: Mapping[str, str], devices: int, num_nodes: int) -> Check:
    expected = {"SLURM_NTASKS": devices * num_nodes, "SLURM_NNODES": num_nodes, "SLURM_NTASKS_PER_NODE": devices}
    wrong = [f"{k}={env[k]} (want {want})" for k, want in expected.items() if k in env and env_int(env, k) != want]
    where = f"SLURM job {env.get('SLURM_JOB_ID', '?')}, SLURM_PROCID={env.get('SLURM_PROCID', '?')}"
    if wrong:
        return Check(
            "launch",
            FAIL,
            f"{where}: {', '.join(wrong)} for devices={devices} x num_nodes={num_nodes}",
            f"sbatch --nodes={num_nodes} --ntasks-per-node={devices}, or change devices/num_nodes",
        )
    return Check("launch", OK, f"{where}: Lightning reads the ranks from SLURM")


def _process_launch_check(env: Mapping[str, str], devices: int, num_nodes: int, launcher: str) -> Check:
    """torchrun, or variables set by hand: rank, world size and rendezvous must be complete and agree."""
    world = devices * num_nodes
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in env]
    rank, size, port = env_int(env, "RANK"), env_int(env, "WORLD_SIZE"), env_int(env, "MASTER_PORT")
    problems = [f"{k} is not set" for k in missing]
    if size is not None and size != world:
        problems.append(f"WORLD_SIZE={size} but devices x num_nodes = {devices} x {num_nodes} = {world}")
    if rank is not None and size is not None and rank >= size:
        problems.append(f"RANK={rank} must be < WORLD_SIZE={size}")
    if "MASTER_PORT" in env and not (port and 0 < port < 65536 and str(port) == env["MASTER_PORT"]):
        problems.append(f"MASTER_PORT={env['MASTER_PORT']!r} is not a port number")
    shown = ", ".join(f"{k}={env[k]}" for k in LAUNCH_VARIABLES if k in env)
    if problems:
        return Check(
            "launch",
            FAIL,
            f"{launcher}: {'; '.join(problems)} ({shown})",
            f"launch with torchrun --nnodes={num_nodes} --nproc_per_node={devices}, "
            "or set RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT consistently",
        )
    return Check("launch", OK, f"{launcher}: {shown}")


def check_launch(env: Mapping[str, str], devices: int, num_nodes: int) -> Check:
    """Which launcher Lightning will see (SLURM, then torchrun, as Lightning itself checks), and
    whether its world agrees with devices x num_nodes."""
    if under_slurm(env):
        return _slurm_check(env, devices, num_nodes)
    if {"RANK", "GROUP_RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"} <= env.keys():
        return _process_launch_check(env, devices, num_nodes, "torchrun")
    if any(k in env for k in LAUNCH_VARIABLES):
        return _process_launch_check(env, devices, num_nodes, "launch variables set by hand")
    if num_nodes > 1:
        return Check(
            "launch",
            WARN,
            f"num_nodes={num_nodes} but no torchrun or SLURM variables in this shell",
            "start every node with torchrun or srun (see README), or set MASTER_ADDR, MASTER_PORT, NODE_RANK",
        )
    return Check("launch", OK, f"no launcher: Lightning starts the {devices} local process(es) itself")
