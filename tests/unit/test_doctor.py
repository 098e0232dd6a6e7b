"""``ptdp doctor``: every check as a pure function, the report, the command line, and the collective
benchmark on two forked gloo processes (no process group in this one)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from lightning_ptdp.config import ParallelConfig
from lightning_ptdp.core.dims import ParallelDims
from lightning_ptdp.tools import cli, doctor, interconnect
from lightning_ptdp.tools.doctor import FAIL, OK, WARN, Check
from lightning_ptdp.tools.interconnect import BUS_FACTORS, bench_row, format_size, nvlink_pairs, parse_bytes

TORCHRUN_ENV = {
    "RANK": "3",
    "GROUP_RANK": "1",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "WORLD_SIZE": "4",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500",
}
SLURM_ENV = {
    "SLURM_JOB_ID": "77",
    "SLURM_NTASKS": "16",
    "SLURM_NNODES": "2",
    "SLURM_NTASKS_PER_NODE": "8(x2)",
    "SLURM_PROCID": "0",
    "SLURM_JOB_NAME": "train",
}
# `nvidia-smi topo -m` of a 4-GPU node: GPU0-GPU1 and GPU2-GPU3 on NVLink, the rest over PCIe/SMP.
TOPO_MATRIX = """\
\tGPU0\tGPU1\tGPU2\tGPU3\tNIC0\tCPU Affinity\tNUMA Affinity
GPU0\t X \tNV12\tSYS\tSYS\tPIX\t0-31\t0
GPU1\tNV12\t X \tSYS\tSYS\tPIX\t0-31\t0
GPU2\tSYS\tSYS\t X \tNV12\tSYS\t32-63\t1
GPU3\tSYS\tSYS\tNV12\t X \tSYS\t32-63\t1
NIC0\tPIX\tPIX\tSYS\tSYS\t X
"""


@pytest.fixture
def clean_env(monkeypatch):
    """No launcher or NCCL variables from the shell that runs the tests."""
    for key in list(os.environ):
        if key.startswith(("SLURM_", "NCCL_", "TORCH_NCCL_")) or key in doctor.LAUNCH_VARIABLES + ("GROUP_RANK",):
            monkeypatch.delenv(key)


def statuses(checks: list[Check]) -> dict[str, str]:
    return {c.name: c.status for c in checks}


# ---------------------------------------------------------------- versions and packages
def test_python_version():
    assert doctor.check_python((3, 11, 7)).status == OK
    old = doctor.check_python((3, 9, 18))
    assert old.status == FAIL and "3.9.18 < 3.10" in old.detail and old.fix


def test_installed_packages_meet_the_minimums_here():
    checks = [doctor.check_requirement(req) for req in doctor.REQUIREMENTS]
    required = {req.distribution for req in doctor.REQUIREMENTS if req.required}
    assert {c.name for c in checks if c.status == OK} >= required == {"torch", "lightning", "torchmetrics"}
    torch_check = checks[0]
    assert torch_check.name == "torch" and torch.__version__ in torch_check.detail and "(>= 2.11)" in torch_check.detail


@pytest.mark.parametrize("version, status", [("2.10.2", FAIL), ("2.11.0a0+git6c8c5ad", OK), ("2.13.0+cu128", OK)])
def test_torch_must_be_at_least_2_11(version, status):
    (torch_req,) = [r for r in doctor.REQUIREMENTS if r.distribution == "torch"]
    check = doctor.check_requirement(torch_req, version_of=lambda _: version, module_found=lambda _: True)
    assert check.status == status
    if status == FAIL:
        assert check.detail.startswith("2.10.2 < 2.11") and 'pip install "torch>=2.11"' in check.fix


def test_missing_packages_fail_when_required_and_warn_when_extras():
    by_name = {r.distribution: r for r in doctor.REQUIREMENTS}
    missing = dict(version_of=lambda _: None, module_found=lambda _: False)
    lightning = doctor.check_requirement(by_name["lightning"], **missing)
    assert lightning.status == FAIL and "not installed" in lightning.detail
    for extra, fix in (
        ("hydra-core", '".[hydra]"'),
        ("wandb", '".[wandb]"'),
        ("triton", '".[triton]"'),
        ("jsonargparse", "jsonargparse[signatures]"),
    ):
        check = doctor.check_requirement(by_name[extra], **missing)
        assert check.status == WARN and fix in check.fix
    broken = doctor.check_requirement(by_name["wandb"], version_of=lambda _: "0.20.0", module_found=lambda _: False)
    assert broken.status == WARN and "`wandb` is not importable" in broken.detail
    old = doctor.check_requirement(by_name["hydra-core"], version_of=lambda _: "1.2.0", module_found=lambda _: True)
    assert old.status == WARN and "1.2.0 < 1.3" in old.detail


# ---------------------------------------------------------------- CUDA, GPUs, topology, backends
def test_cuda_absent_is_a_warning_for_cpu_only_use():
    cpu_build = doctor.check_cuda(False, 0, None)
    assert cpu_build.status == WARN and "CPU build" in cpu_build.detail and "pytorch.org" in cpu_build.fix
    assert "sees no GPU" in doctor.check_cuda(False, 0, "12.8").detail
    assert doctor.check_cuda(True, 8, "12.8") == Check("cuda", OK, "CUDA 12.8, 8 GPU(s) visible")


@pytest.mark.parametrize(
    "name, tflops",
    [("NVIDIA H200", 989), ("NVIDIA H100 80GB HBM3", 989), ("NVIDIA H100 PCIe", 756), ("NVIDIA A100-SXM4-80GB", 312)],
)
def test_known_gpus_report_memory_and_peak(name, tflops):
    check = doctor.check_gpu(0, name, 143_771_000_832, (9, 0))
    assert check == Check("gpu0", OK, f"{name}, 133.9 GiB, sm_90, peak bf16 {tflops} TFLOP/s")


def test_unknown_or_old_gpus_warn_with_the_cure():
    nvl = doctor.check_gpu(1, "NVIDIA H200 NVL", 150 * 2**30, (9, 0))
    assert nvl.status == WARN and "peak FLOP/s unknown" in nvl.detail and "peak_flops=" in nvl.fix
    volta = doctor.check_gpu(2, "Tesla V100-SXM2-32GB", 32 * 2**30, (7, 0))
    assert volta.status == WARN and "no bf16" in volta.detail and "16-mixed" in volta.fix and "peak_flops" in volta.fix


def test_probing_gpus_on_this_machine():
    checks = doctor.probe_gpus()
    assert len(checks) == (torch.cuda.device_count() + 1 if torch.cuda.is_available() else 0)


def test_nvlink_pairs_from_nvidia_smi_topology():
    assert nvlink_pairs(TOPO_MATRIX) == 2
    assert nvlink_pairs(TOPO_MATRIX.replace("NV12", "PIX")) == 0
    assert nvlink_pairs("") == 0


def test_topology():
    assert doctor.check_topology(1, [], None).status == OK
    full = doctor.check_topology(4, [], nvlink_pairs(TOPO_MATRIX))
    assert full == Check("topology", OK, "peer access between all 4 GPUs; NVLink on 2 of 6 pairs")
    partial = doctor.check_topology(4, [(0, 3), (1, 2)], None)
    assert partial.status == WARN and "0<->3, 1<->2" in partial.detail and "nvidia-smi topo -m" in partial.fix


def test_backends():
    assert statuses(doctor.check_backends(False, False, True, None)) == {"nccl": OK, "gloo": OK}
    gpu_without_nccl = doctor.check_backends(True, False, True, None)
    assert gpu_without_nccl[0].status == FAIL and "no NCCL" in gpu_without_nccl[0].detail
    assert doctor.check_backends(True, True, True, "2.21.5")[0].detail == "available (NCCL 2.21.5)"
    assert statuses(doctor.check_backends(False, False, False, None))["gloo"] == FAIL
    here = doctor.check_backends(
        torch.cuda.is_available(), torch.distributed.is_nccl_available(), torch.distributed.is_gloo_available(), None
    )
    assert all(c.status == OK for c in here)


def test_nccl_variables():
    assert doctor.check_nccl_env({}, 1) == Check("nccl env", OK, "none set (NCCL picks its defaults)")
    tuned = doctor.check_nccl_env({"NCCL_SOCKET_IFNAME": "ib0", "NCCL_IB_DISABLE": "1", "HOME": "/x"}, 1)
    assert tuned == Check("nccl env", OK, "NCCL_IB_DISABLE=1, NCCL_SOCKET_IFNAME=ib0")  # IB unused on one node
    slow = doctor.check_nccl_env({"NCCL_IB_DISABLE": "1", "NCCL_P2P_DISABLE": "1"}, 2)
    assert slow.status == WARN and "inter-node traffic over TCP" in slow.detail and "through the host" in slow.detail


# ---------------------------------------------------------------- launch environment
def test_no_launcher():
    assert doctor.check_launch({}, 4, 1).status == OK
    nodes = doctor.check_launch({}, 8, 2)
    assert nodes.status == WARN and "num_nodes=2" in nodes.detail and "torchrun or srun" in nodes.fix


def test_torchrun_environment():
    assert doctor.check_launch(TORCHRUN_ENV, 2, 2) == Check(
        "launch",
        OK,
        "torchrun: RANK=3, WORLD_SIZE=4, LOCAL_RANK=1, LOCAL_WORLD_SIZE=2, MASTER_ADDR=10.0.0.1, MASTER_PORT=29500",
    )
    wrong = doctor.check_launch(TORCHRUN_ENV, 8, 2)
    assert wrong.status == FAIL and "WORLD_SIZE=4 but devices x num_nodes = 8 x 2 = 16" in wrong.detail
    assert "--nproc_per_node=8" in wrong.fix


@pytest.mark.parametrize(
    "change, message",
    [
        ({"MASTER_ADDR": None}, "MASTER_ADDR is not set"),
        ({"RANK": "4"}, "RANK=4 must be < WORLD_SIZE=4"),
        ({"MASTER_PORT": "29500x"}, "MASTER_PORT='29500x' is not a port number"),
        ({"MASTER_PORT": "70000"}, "is not a port number"),
    ],
)
def test_broken_launch_variables_fail(change, message):
    env = {k: v for k, v in {**TORCHRUN_ENV, **change}.items() if v is not None}
    check = doctor.check_launch(env, 2, 2)
    assert check.status == FAIL and message in check.detail


def test_hand_set_variables_are_checked_too():
    check = doctor.check_launch({"RANK": "0", "WORLD_SIZE": "2"}, 2, 1)
    assert check.status == FAIL and check.detail.startswith("launch variables set by hand: MASTER_ADDR is not set")


def test_slurm_environment():
    assert doctor.check_launch(SLURM_ENV, 8, 2) == Check(
        "launch", OK, "SLURM job 77, SLURM_PROCID=0: Lightning reads the ranks from SLURM"
    )
    wrong = doctor.check_launch(SLURM_ENV, 4, 4)
    assert wrong.status == FAIL and "SLURM_NNODES=2 (want 4)" in wrong.detail
    assert "SLURM_NTASKS_PER_NODE=8(x2) (want 4)" in wrong.detail and "--ntasks-per-node=4" in wrong.fix
    interactive = doctor.check_launch({**SLURM_ENV, "SLURM_JOB_NAME": "bash"}, 1, 1)  # Lightning ignores SLURM
    assert interactive.detail.startswith("no launcher")


def test_devices_and_nodes_default_to_the_launchers():
    assert doctor.default_devices(TORCHRUN_ENV, 0) == (2, 2)
    assert doctor.default_devices(SLURM_ENV, 8) == (8, 2)
    assert doctor.default_devices({}, 4) == (4, 1) and doctor.default_devices({}, 0) == (1, 1)


# ---------------------------------------------------------------- layout
def parallel_dims_error(t: int, p: int, d, world_size: int) -> str:
    with pytest.raises(ValueError) as info:
        ParallelDims.from_config(
            ParallelConfig(tensor_parallel_size=t, pipeline_parallel_size=p, data_parallel_size=d), world_size
        )
    return str(info.value)


@pytest.mark.parametrize("t, p, d, devices, nodes", [(3, 1, "auto", 8, 1), (2, 2, 3, 4, 2), (4, 4, "auto", 8, 1)])
def test_bad_layouts_fail_with_the_parallel_dims_message(t, p, d, devices, nodes):
    (check,) = doctor.check_layout(t, p, d, devices, nodes)
    assert check == Check("layout", FAIL, parallel_dims_error(t, p, d, devices * nodes))


@pytest.mark.parametrize(
    "t, devices, nodes, message",
    [
        (0, 8, 1, "tensor_parallel_size=0 must be >= 1"),
        (1, 0, 1, "devices=0 must be >= 1"),
        (1, -2, -4, "devices=-2 must be >= 1"),
    ],
)
def test_invalid_values_fail_with_the_config_message(t, devices, nodes, message):
    (check,) = doctor.check_layout(t, 1, "auto", devices, nodes)
    assert check.status == FAIL and message in check.detail


def test_a_paper_layout_passes():
    checks = doctor.check_layout(8, 4, "auto", 8, 16, gpus_on_node=8)
    assert checks == [
        Check("layout", OK, "t=8 p=4 d=4 on 128 processes (devices=8 x num_nodes=16)"),
        Check(
            "groups",
            OK,
            "tp 16 x 8 ranks, stride 1, within a node (all-reduce every layer); "
            "dp 32 x 4 ranks, stride 8, across 4 nodes (gradient all-reduce / reduce-scatter every step); "
            "pp 32 x 4 ranks, stride 32, across 4 nodes (activation send/recv every micro-batch)",
        ),
    ]


def test_context_and_expert_parallel_groups_are_mapped():
    layout, groups = doctor.check_layout(2, 2, "auto", 8, 2, expert_parallel_size=4, context_parallel_size=2)
    assert layout == Check("layout", OK, "t=2 p=2 d=2 c=2 e=4 on 16 processes (devices=8 x num_nodes=2)")
    assert "cp 8 x 2 ranks, stride 2, within a node (key/value all-gather every layer)" in groups.detail
    assert "ep 4 x 4 ranks, stride 2, within a node (token all-to-all every MoE layer)" in groups.detail
    assert "pp 8 x 2 ranks, stride 8, across 2 nodes" in groups.detail
    # an ep group spanning nodes says so: e=4 over d x c = 4 with one process per node
    (_, wide) = doctor.check_layout(1, 1, "auto", 1, 8, expert_parallel_size=4, context_parallel_size=2)
    assert (
        "ep 2 x 4 ranks, stride 1, across 4 nodes" in wide.detail
        and "cp 4 x 2 ranks, stride 1, across 2" in wide.detail
    )


@pytest.mark.parametrize("t, p, c, e", [(2, 2, 2, 4), (1, 2, 4, 2), (2, 1, 1, 2)])
def test_groups_are_the_meshes_groups(t, p, c, e):
    """Each axis's groups hold the ranks whose other mesh coordinates agree (the mesh's rank order);
    an expert group is e ranks of one (pp, tp) slice, consecutive in d x c with cp the faster."""
    dims = doctor.layout_dims(t, p, "auto", 16, e, c)
    for axis in ("pp", "dp", "cp", "tp"):
        others = [name for name in ("pp", "dp", "cp", "tp") if name != axis]
        groups = dims.group_ranks(axis)
        assert sorted(r for g in groups for r in g) == list(range(16)) and len(groups[0]) == getattr(dims, axis)
        for group in groups:
            assert len({tuple(dims.coordinates(r)[o] for o in others) for r in group}) == 1
    for group in dims.group_ranks("ep"):
        coords = [dims.coordinates(r) for r in group]
        assert len({(k["pp"], k["tp"]) for k in coords}) == 1
        flat = [k["dp"] * dims.cp + k["cp"] for k in coords]
        assert len(group) == e and flat == list(range(flat[0], flat[0] + e))


def test_an_expert_degree_that_does_not_divide_fails_with_the_rule():
    (check,) = doctor.check_layout(1, 1, "auto", 4, 1, expert_parallel_size=3)
    assert check.status == FAIL and "expert_parallel_size=3 does not divide data_parallel_size=4" in check.detail


@pytest.mark.parametrize(
    "t, devices, nodes, why", [(16, 8, 4, "t=16 > 8 GPUs per node"), (4, 6, 2, "t=4 does not divide devices=6")]
)
def test_tensor_parallel_groups_crossing_nodes_warn(t, devices, nodes, why):
    layout, groups, placement = doctor.check_layout(t, 1, "auto", devices, nodes)
    assert layout.status == OK and groups.status == OK and placement.status == WARN
    assert why in placement.detail and "cross nodes" in placement.detail and "t <= devices" in placement.fix


def test_more_devices_than_gpus_on_the_node_fails():
    checks = doctor.check_layout(1, 1, "auto", 8, 1, gpus_on_node=4)
    assert statuses(checks) == {"layout": OK, "groups": OK, "devices": FAIL}
    assert doctor.check_layout(1, 1, "auto", 8, 1, gpus_on_node=0)[0].status == OK  # CPU: processes, not GPUs


# ---------------------------------------------------------------- collective benchmark
@pytest.mark.parametrize(
    "op, n, factor",
    [
        ("all_reduce", 8, 1.75),
        ("all_gather", 4, 0.75),
        ("reduce_scatter", 2, 0.5),
        ("all_to_all", 8, 0.875),
        ("send_recv", 8, 1.0),
    ],
)
def test_bus_bandwidth_factors_are_nccl_tests(op, n, factor):
    row = bench_row(op, 2 * 10**9, 0.5, n)  # 2 GB in 0.5 s: algbw 4 GB/s
    assert (row.time_us, row.algbw_gbps) == (500000.0, 4.0)
    assert row.busbw_gbps == pytest.approx(4.0 * factor)


def test_byte_sizes():
    assert parse_bytes("1M, 64K,2G,512") == [512, 65536, 2**20, 2 * 2**30]
    assert [format_size(n) for n in (512, 65536, 3 * 2**19, 2 * 2**30)] == ["512 B", "64 KiB", "1.5 MiB", "2 GiB"]
    with pytest.raises(ValueError, match="'1X' is not a size like 1M"):
        parse_bytes("1M,1X")


def test_collectives_on_two_gloo_processes():
    rows = interconnect.run_local_benchmark(2, [4096, 65536], iters=2, start_method="fork")
    assert [(r.op, r.size_bytes) for r in rows] == [(op, s) for op in BUS_FACTORS for s in (4096, 65536)]
    assert all(r.time_us > 0 and r.busbw_gbps == pytest.approx(r.algbw_gbps * BUS_FACTORS[r.op](2)) for r in rows)
    check = doctor.check_benchmark("gloo", 2, rows)
    assert check.status == WARN and check.detail.startswith("gloo, 2 ranks, busbw GB/s at 64 KiB: all_reduce ")
    assert doctor.check_benchmark("nccl", 2, rows).status == OK


def test_expert_all_to_all_and_context_all_gather_in_their_groups():
    args = doctor.build_parser().parse_args(["-c", "2", "-e", "4", "--bench"])
    groups = doctor.axis_groups(args, 4)
    assert groups == {"ep": [[0, 1, 2, 3]], "cp": [[0, 1], [2, 3]]}
    rows = interconnect.run_local_benchmark(4, [4096], iters=1, start_method="fork", axis_groups=groups)
    by_group = {(r.group, r.op): r for r in rows}
    assert {("ep", "all_to_all"), ("cp", "all_gather")} <= set(by_group) and len(rows) == len(BUS_FACTORS) + 2
    assert by_group["cp", "all_gather"].busbw_gbps == pytest.approx(by_group["cp", "all_gather"].algbw_gbps * 0.5)
    assert by_group["ep", "all_to_all"].busbw_gbps == pytest.approx(by_group["ep", "all_to_all"].algbw_gbps * 0.75)
    detail = doctor.check_benchmark("gloo", 4, rows).detail
    assert ", ep all_to_all " in detail and ", cp all_gather " in detail
    assert "all_to_all     ep" in interconnect.format_benchmark(rows)


def test_bench_measures_the_layouts_groups_or_says_it_could_not(monkeypatch, clean_env):
    seen = {}

    def recorded(world_size, sizes, iters, axis_groups=None):
        seen[world_size] = axis_groups
        return [bench_row("all_reduce", 4096, 1e-3, world_size)]

    monkeypatch.setattr(doctor, "run_local_benchmark", recorded)
    fits = doctor.run_checks(doctor.build_parser().parse_args(["-e", "2", "--bench"]))
    assert seen[2] == {"ep": [[0, 1]]} and "axis collectives" not in statuses(fits.checks)
    too_big = doctor.run_checks(doctor.build_parser().parse_args(["-c", "2", "-e", "4", "--bench"]))
    warning = too_big.checks[-1]
    assert warning.name == "axis collectives" and warning.status == WARN and "--bench-ranks" in warning.fix
    assert "does not fit the 2 benchmark ranks: no ep, cp groups measured" in warning.detail


def test_a_failing_rank_is_reported(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("link down")

    monkeypatch.setattr(interconnect, "benchmark_collectives", broken)  # forked workers inherit it
    with pytest.raises(RuntimeError, match=r"(?s)rank 0: Traceback.*link down.*rank 1: Traceback"):
        interconnect.run_local_benchmark(2, [4096], start_method="fork")
    with pytest.raises(ValueError, match="at least 2 ranks"):
        interconnect.run_local_benchmark(1, [4096])


def test_benchmark_failure_is_a_fail_line(monkeypatch, clean_env):
    def unreachable(*args, **kwargs):
        raise RuntimeError("connection refused")

    monkeypatch.setattr(doctor, "run_local_benchmark", unreachable)
    report = doctor.run_checks(doctor.build_parser().parse_args(["--bench"]))
    assert (
        report.checks[-1] == Check("collectives", FAIL, "RuntimeError: connection refused", report.checks[-1].fix)
        and report.exit_code == 1
    )


# ---------------------------------------------------------------- report and command line
def test_json_report(clean_env, capsys):
    assert doctor.main(["--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["exit_code"] == 0 and report["summary"][FAIL] == 0 and report["benchmark"] == []
    names = [c["name"] for c in report["checks"]]
    assert names[:4] == ["python", "torch", "lightning", "torchmetrics"]
    assert {"cuda", "gloo", "nccl", "nccl env", "launch", "layout"} <= set(names)
    assert all(
        set(c) == {"name", "status", "detail", "fix"} and c["status"] in (OK, WARN, FAIL) for c in report["checks"]
    )
    if not torch.cuda.is_available():
        (cuda,) = [c for c in report["checks"] if c["name"] == "cuda"]
        assert cuda["status"] == WARN


def test_text_report_and_exit_code_on_a_bad_layout(clean_env, capsys):
    assert doctor.main(["-t", "3", "--devices", "8"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert all(line.split()[0] in (OK, WARN, FAIL) for line in lines[:-2]) and lines[-2] == ""
    assert f"FAIL  layout        {parallel_dims_error(3, 1, 'auto', 8)}" in lines
    assert lines[-1].endswith("1 FAIL; fix the FAIL lines before launching")
    assert all("-> fix: " in line for line in lines if line.startswith(WARN))


def test_only_local_rank_zero_prints(clean_env, monkeypatch, capsys):
    monkeypatch.setenv("LOCAL_RANK", "1")
    doctor.main([])
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("argv, code", [(["doctor", "--json"], 0), (["doctor", "-p", "3", "--devices", "4"], 1)])
def test_ptdp_doctor_console_path(clean_env, capsys, argv, code):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == code
    out = capsys.readouterr().out
    if code == 0:
        assert json.loads(out)["exit_code"] == 0
    else:
        assert "FAIL  layout" in out and "does not divide the world size 4" in out


def test_bad_flags_exit_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        doctor.main(["--bench-bytes", "lots"])
    assert exit_info.value.code == 2 and "--bench-bytes" in capsys.readouterr().err
