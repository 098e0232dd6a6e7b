"""``ptdp doctor``: a preflight before a big run, one OK / WARN / FAIL line per check.

    ptdp doctor -t 8 -p 4 -c 2 -e 4 --devices 8 --num-nodes 16   # + this layout; --json for machines
    torchrun --nproc_per_node=8 -m lightning_ptdp.tools.doctor -e 8 --bench   # + collectives (nccl)

Checks: Python, torch (>= 2.11) and packages; CUDA, GPUs, peer access / NVLink; NCCL, gloo and slow
NCCL variables; the launcher against devices x num_nodes; the layout and its groups (layout_checks).
Exit code 0 when nothing FAILs. Checks return :class:`Check`; only :func:`main` prints.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import sys
from dataclasses import asdict, dataclass, field
from typing import Callable, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from lightning_ptdp.core.flops import device_peak_flops
from lightning_ptdp.tools.checks import FAIL, OK, WARN, Check
from lightning_ptdp.tools.interconnect import (
    AXIS_OPS,
    BenchRow,
    format_benchmark,
    format_size,
    nvidia_smi_nvlink_pairs,
    parse_bytes,
    run_launched_benchmark,
    run_local_benchmark,
)
from lightning_ptdp.tools.launch_checks import (  # noqa: F401  (part of the doctor's checks)
    LAUNCH_VARIABLES,
    check_launch,
    check_nccl_env,
    env_int,
    under_slurm,
)
from lightning_ptdp.tools.layout_checks import check_groups, check_layout, layout_dims  # noqa: F401

MIN_PYTHON = (3, 10)


@dataclass(frozen=True)
class Requirement:
    distribution: str
    minimum: str
    module: str
    needed_for: str
    required: bool
    install: str


REQUIREMENTS: tuple[Requirement, ...] = (
    Requirement(
        "torch",
        "2.11",
        "torch",
        "everything",
        True,
        'pip install "torch>=2.11" (the CUDA build from pytorch.org on GPUs)',
    ),
    Requirement("lightning", "2.5", "lightning", "the strategy", True, 'pip install "lightning>=2.5"'),
    Requirement("torchmetrics", "1.4", "torchmetrics", "metrics", True, 'pip install "torchmetrics>=1.4"'),
    Requirement(
        "jsonargparse",
        "4.39",
        "jsonargparse",
        "ptdp fit/validate/test/predict",
        False,
        'pip install "jsonargparse[signatures]>=4.39"',
    ),
    Requirement(
        "triton",
        "3.2",
        "triton",
        "the Triton kernels (kernels='auto' falls back to torch)",
        False,
        'pip install -e ".[triton]"',
    ),
    Requirement("hydra-core", "1.3", "hydra", "python -m recipes.train", False, 'pip install -e ".[hydra]"'),
    Requirement("wandb", "0.17", "wandb", "logger=wandb", False, 'pip install -e ".[wandb]"'),
)


def _release(version: str) -> tuple[int, ...]:
    """(2, 11, 0) from "2.11.0+cu128" or "2.11.0a0+git1234": the numeric release part."""
    match = re.match(r"\d+(\.\d+)*", version)
    return tuple(int(part) for part in match.group(0).split(".")) if match else ()


def _installed_version(distribution: str) -> Optional[str]:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def check_python(version_info: Sequence[int] = tuple(sys.version_info[:3])) -> Check:
    found = ".".join(map(str, version_info[:3]))
    if tuple(version_info[:2]) < MIN_PYTHON:
        return Check("python", FAIL, f"{found} < 3.10", "use Python 3.10 or newer")
    return Check("python", OK, f"{found} ({platform.system()} {platform.machine()})")


def check_requirement(
    req: Requirement,
    version_of: Callable[[str], Optional[str]] = _installed_version,
    module_found: Callable[[str], bool] = lambda name: importlib.util.find_spec(name) is not None,
) -> Check:
    """A package's version against the project's minimum; missing optional extras only WARN. The
    module is looked up, not imported (importing wandb takes seconds)."""
    bad = FAIL if req.required else WARN
    version = version_of(req.distribution)
    if version is None or not module_found(req.module):
        state = "not installed" if version is None else f"{version} installed but `{req.module}` is not importable"
        return Check(req.distribution, bad, f"{state} (needed for {req.needed_for})", req.install)
    if _release(version) < _release(req.minimum):
        return Check(req.distribution, bad, f"{version} < {req.minimum} (needed for {req.needed_for})", req.install)
    extra = ""
    if req.distribution == "torch":
        extra = f", CUDA {torch.version.cuda}" if torch.version.cuda else ", CPU build"
    return Check(req.distribution, OK, f"{version} (>= {req.minimum}){extra}")


def check_cuda(available: bool, device_count: int, cuda_build: Optional[str]) -> Check:
    """No CUDA is a WARN, not a FAIL: CPU runs over gloo are supported (and tested)."""
    if not available:
        why = "this torch is a CPU build" if cuda_build is None else f"torch has CUDA {cuda_build} but sees no GPU"
        fix = (
            "for GPU runs install the CUDA build of torch (pytorch.org); check nvidia-smi and "
            "CUDA_VISIBLE_DEVICES. CPU-only runs (gloo) need nothing more"
        )
        return Check("cuda", WARN, f"not available ({why}): CPU-only runs", fix)
    return Check("cuda", OK, f"CUDA {cuda_build}, {device_count} GPU(s) visible")


def check_gpu(index: int, name: str, total_memory: int, capability: tuple[int, int]) -> Check:
    """One GPU: memory, compute capability, bf16 support and whether its peak FLOP/s is known."""
    detail = f"{name}, {total_memory / 2**30:.1f} GiB, sm_{capability[0]}{capability[1]}"
    fixes, status = [], OK
    try:
        detail += f", peak bf16 {device_peak_flops(name) / 1e12:.0f} TFLOP/s"
    except ValueError:
        status = WARN
        detail += ", peak FLOP/s unknown"
        fixes.append("pass PTDPThroughput(peak_flops=<FLOP/s>) for MFU (flops.PEAK_TFLOPS lacks this GPU)")
    if capability < (8, 0):
        status = WARN
        detail += ", no bf16"
        fixes.append("use precision='16-mixed' with on_nonfinite='ignore' (bf16 needs sm_80 or newer)")
    return Check(f"gpu{index}", status, detail, "; ".join(fixes))


def check_topology(gpu_count: int, no_peer_access: Sequence[tuple[int, int]], nvlinks: Optional[int]) -> Check:
    """Peer access between every pair of GPUs; tensor-parallel traffic without it goes via the host."""
    if gpu_count < 2:
        return Check("topology", OK, f"{gpu_count} GPU(s): no GPU-to-GPU links to check")
    links = "" if nvlinks is None else f"; NVLink on {nvlinks} of {gpu_count * (gpu_count - 1) // 2} pairs"
    if no_peer_access:
        pairs = ", ".join(f"{i}<->{j}" for i, j in no_peer_access)
        return Check(
            "topology",
            WARN,
            f"no peer access between GPUs {pairs}{links}",
            "check `nvidia-smi topo -m` and IOMMU/ACS settings; keep TP groups on GPUs with peer access",
        )
    return Check("topology", OK, f"peer access between all {gpu_count} GPUs{links}")


def check_backends(cuda: bool, nccl: bool, gloo: bool, nccl_version: Optional[str]) -> list[Check]:
    """NCCL is needed on GPUs, gloo on CPUs; a build without torch.distributed can do neither."""
    if not dist.is_available():
        return [
            Check(
                "backends",
                FAIL,
                "torch.distributed is not available in this build",
                "install a torch build with distributed support (the pytorch.org wheels have it)",
            )
        ]
    if nccl:
        nccl_check = Check("nccl", OK, f"available (NCCL {nccl_version})" if nccl_version else "available")
    elif cuda:
        nccl_check = Check(
            "nccl",
            FAIL,
            "this torch has no NCCL: GPU runs cannot use backend 'nccl'",
            "install the CUDA build of torch from pytorch.org (Linux wheels include NCCL)",
        )
    else:
        nccl_check = Check("nccl", OK, "not in this build (CPU-only: gloo is used)")
    gloo_check = (
        Check("gloo", OK, "available")
        if gloo
        else Check(
            "gloo",
            WARN if cuda else FAIL,
            "not in this build: CPU runs cannot start",
            "install a torch build with gloo (the pytorch.org wheels have it)",
        )
    )
    return [nccl_check, gloo_check]


def check_benchmark(backend: str, world_size: int, rows: Sequence[BenchRow]) -> Check:
    """Summarise the largest size of each collective; gloo numbers measure the host, not the fabric."""
    largest = {(row.group, row.op): row for row in rows}  # rows are in increasing size per op
    summary = ", ".join(
        f"{op if group == 'world' else f'{group} {op}'} {row.busbw_gbps:.2f}" for (group, op), row in largest.items()
    )
    detail = f"{backend}, {world_size} ranks, busbw GB/s at {format_size(max(r.size_bytes for r in rows))}: {summary}"
    if backend == "gloo":
        return Check(
            "collectives", WARN, detail, "gloo on CPU measures the host; run under torchrun on the GPUs for nccl"
        )
    return Check("collectives", OK, detail)


# ---------------------------------------------------------------- report and command line
@dataclass
class Report:
    checks: list[Check]
    benchmark: list[BenchRow] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        return 1 if any(c.status == FAIL for c in self.checks) else 0

    def counts(self) -> dict[str, int]:
        return {s: sum(c.status == s for c in self.checks) for s in (OK, WARN, FAIL)}

    def as_dict(self) -> dict:
        return {
            "exit_code": self.exit_code,
            "summary": self.counts(),
            "checks": [asdict(c) for c in self.checks],
            "benchmark": [asdict(r) for r in self.benchmark],
        }

    def text(self) -> str:
        lines = [
            f"{c.status:<5} {c.name:<13} {c.detail}" + (f"  -> fix: {c.fix}" if c.fix else "") for c in self.checks
        ]
        if self.benchmark:
            lines += ["", format_benchmark(self.benchmark)]
        counts = self.counts()
        verdict = "fix the FAIL lines before launching" if counts[FAIL] else "ready to launch"
        return "\n".join(
            lines
            + ["", f"{len(self.checks)} checks: {counts[OK]} OK, {counts[WARN]} WARN, {counts[FAIL]} FAIL; {verdict}"]
        )


def probe_gpus() -> list[Check]:
    """check_gpu for every visible GPU, and check_topology between them (no-op without CUDA)."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    checks = []
    for i in range(count):
        props = torch.cuda.get_device_properties(i)
        checks.append(check_gpu(i, props.name, props.total_memory, (props.major, props.minor)))
    if count:
        missing = [
            (i, j) for i in range(count) for j in range(i + 1, count) if not torch.cuda.can_device_access_peer(i, j)
        ]
        checks.append(check_topology(count, missing, nvidia_smi_nvlink_pairs()))
    return checks


def _nccl_version() -> Optional[str]:
    try:
        return ".".join(map(str, torch.cuda.nccl.version()))
    except (AttributeError, RuntimeError, TypeError):
        return None


def default_devices(env: Mapping[str, str], gpus: int) -> tuple[int, int]:
    """(devices, num_nodes) when not given: the launcher's, else every visible GPU (or 1) on 1 node."""
    if under_slurm(env) and "SLURM_NTASKS_PER_NODE" in env:
        return env_int(env, "SLURM_NTASKS_PER_NODE") or 1, env_int(env, "SLURM_NNODES") or 1
    per_node, world = env_int(env, "LOCAL_WORLD_SIZE"), env_int(env, "WORLD_SIZE")
    if per_node and world and world % per_node == 0:
        return per_node, world // per_node
    return max(gpus, 1), 1


def run_checks(args: argparse.Namespace, env: Mapping[str, str] = os.environ) -> Report:
    """Every check in order (and the benchmark with ``args.bench``); nothing is printed."""
    cuda = torch.cuda.is_available()
    gpus = torch.cuda.device_count() if cuda else 0
    devices, num_nodes = default_devices(env, gpus)
    devices = devices if args.devices is None else args.devices
    num_nodes = num_nodes if args.num_nodes is None else args.num_nodes
    checks = [
        check_python(),
        *(check_requirement(req) for req in REQUIREMENTS),
        check_cuda(cuda, gpus, torch.version.cuda),
        *probe_gpus(),
        *check_backends(
            cuda,
            dist.is_available() and dist.is_nccl_available(),
            dist.is_available() and dist.is_gloo_available(),
            _nccl_version() if cuda else None,
        ),
        check_nccl_env(env, num_nodes),
        check_launch(env, devices, num_nodes),
        *check_layout(
            args.tensor_parallel_size,
            args.pipeline_parallel_size,
            args.data_parallel_size,
            devices,
            num_nodes,
            gpus,
            expert_parallel_size=args.expert_parallel_size,
            context_parallel_size=args.context_parallel_size,
        ),
    ]
    report = Report(checks)
    if args.bench:
        _add_benchmark(report, args, env)
    return report


def axis_groups(args: argparse.Namespace, world_size: int) -> dict[str, list[list[int]]]:
    """The ep and cp groups of the layout on the benchmark's ``world_size`` ranks (none where it does not fit)."""
    try:
        dims = layout_dims(
            args.tensor_parallel_size,
            args.pipeline_parallel_size,
            args.data_parallel_size,
            world_size,
            args.expert_parallel_size,
            args.context_parallel_size,
        )
    except ValueError:
        return {}
    return {axis: dims.group_ranks(axis) for axis in AXIS_OPS if getattr(dims, axis) > 1}


def _add_benchmark(report: Report, args: argparse.Namespace, env: Mapping[str, str]) -> None:
    launched = "WORLD_SIZE" in env and "RANK" in env
    world_size = int(env["WORLD_SIZE"]) if launched else args.bench_ranks
    groups = axis_groups(args, world_size)
    try:
        if launched:
            backend, rows = run_launched_benchmark(args.bench_bytes, args.bench_iters, groups)
        else:
            backend = "gloo"
            rows = run_local_benchmark(world_size, args.bench_bytes, args.bench_iters, axis_groups=groups)
    except Exception as err:  # any failure of the group or a collective is the finding
        report.checks.append(
            Check(
                "collectives",
                FAIL,
                f"{type(err).__name__}: {err}".strip(),
                "run with NCCL_DEBUG=INFO (GPUs) and check MASTER_ADDR/MASTER_PORT reachability",
            )
        )
        return
    report.benchmark = rows
    report.checks.append(check_benchmark(backend, world_size, rows))
    sizes = {"ep": args.expert_parallel_size, "cp": args.context_parallel_size}
    wanted = [axis for axis in AXIS_OPS if sizes[axis] > 1]
    if set(wanted) - set(groups):
        report.checks.append(
            Check(
                "axis collectives",
                WARN,
                f"the layout does not fit the {world_size} benchmark ranks: no {', '.join(wanted)} groups measured",
                "pass --bench-ranks equal to a world size the layout fits (or launch with that many)",
            )
        )


def _data_parallel_size(text: str) -> int | str:
    return text if text == "auto" else int(text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ptdp doctor", description="Preflight checks before a PTD-P run.")
    parser.add_argument("--tensor-parallel-size", "-t", type=int, default=1)
    parser.add_argument("--pipeline-parallel-size", "-p", type=int, default=1)
    parser.add_argument("--data-parallel-size", "-d", type=_data_parallel_size, default="auto")
    parser.add_argument("--expert-parallel-size", "-e", type=int, default=1, help="ranks an MoE layer's experts span")
    parser.add_argument("--context-parallel-size", "-c", type=int, default=1, help="ranks a sequence is cut over")
    parser.add_argument(
        "--devices",
        type=int,
        default=None,
        help="processes per node (default: the launcher's, else the visible GPUs, or 1)",
    )
    parser.add_argument("--num-nodes", type=int, default=None, help="default: the launcher's, else 1")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--bench",
        action="store_true",
        help="benchmark the collectives (nccl-tests bandwidths), with the all-to-all in the ep groups and the "
        "all-gather in the cp groups",
    )
    parser.add_argument("--bench-ranks", type=int, default=2, help="local gloo processes when not launched (default 2)")
    parser.add_argument("--bench-bytes", type=parse_bytes, default=parse_bytes("1M,16M"), help="sizes, e.g. 1M,64M,1G")
    parser.add_argument("--bench-iters", type=int, default=5)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``ptdp doctor [--json] [--bench] [layout flags]``: print the report; 0 if nothing FAILs, else 1.
    Under a launcher only local rank 0 of each node prints."""
    args = build_parser().parse_args(argv)
    report = run_checks(args)
    if os.environ.get("LOCAL_RANK", "0") == "0":
        sys.stdout.write((json.dumps(report.as_dict(), indent=2) if args.json else report.text()) + "\n")
    return report.exit_code


if __name__ == "__main__":
    sys.exit(main())
