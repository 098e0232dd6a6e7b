"""``python -m recipes.train`` end to end: composition from the command line, training under
Lightning's launcher, a multirun sweep, and an offline wandb run."""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300
TINY_RUN = ["model=tiny", "trainer.log_every_n_steps=1", "trainer.limit_val_batches=2", "data.train_tokens=20000"]


def recipe(*args: str, check: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
    environ = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.run(
        [sys.executable, "-m", "recipes.train", *args],
        cwd=ROOT,
        env=environ,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    if check:
        assert proc.returncode == 0, (
            f"recipes.train {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        )
    return proc


def test_cfg_job_prints_the_composed_config_without_training():
    proc = recipe("model=gpt_1t", "parallel=paper_1t", "--cfg", "job")
    printed = proc.stdout
    assert "num_layers: 128" in printed and "hidden_size: 25600" in printed and "num_heads: 160" in printed
    assert "tensor_parallel_size: 8" in printed and "pipeline_parallel_size: 64" in printed


def test_misspelled_option_and_group_get_hydras_error():
    proc = recipe("model=gpt_2t", "--cfg", "job", check=False)
    assert proc.returncode != 0
    assert "Could not find 'model/gpt_2t'" in proc.stderr and "gpt_1t" in proc.stderr
    proc = recipe("parallell=dp2", "--cfg", "job", check=False)
    assert proc.returncode != 0 and "Could not override 'parallell'" in proc.stderr


def test_trains_on_two_processes_under_lightnings_launcher(tmp_path):
    proc = recipe(*TINY_RUN, "parallel=dp2", "trainer.devices=2", "trainer.max_steps=20", f"hydra.run.dir={tmp_path}")
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["layout"] == {"pp": 1, "dp": 2, "tp": 1, "world_size": 2}
    assert summary["steps"] == 20
    assert summary["train_loss"] < 5.5  # log(256) = 5.55 is the loss of a uniform guess
    assert "final train_loss" in proc.stdout
    assert (Path(summary["checkpoint"]) / ".metadata").is_file()  # a complete sharded checkpoint (the default)
    rows = (tmp_path / "metrics" / "metrics.csv").read_text().splitlines()
    assert "train_loss" in rows[0] and len(rows) > 10
    assert (tmp_path / "train_ddp_process_1.log").is_file()  # rank 1 was re-run into the same folder


def test_multirun_sweep_runs_each_layout_once(tmp_path):
    proc = recipe("-m", *TINY_RUN, "parallel=dp1,dp2", "trainer.max_steps=5", f"hydra.sweep.dir={tmp_path}")
    # Rank 1 of the dp2 job (started by Lightning) must run that job, not launch the sweep again.
    assert (proc.stdout + proc.stderr).count("Launching 2 jobs locally") == 1
    assert "Launching 1 jobs" not in proc.stdout + proc.stderr
    summaries = sorted(tmp_path.glob("*/summary.json"))
    assert [p.parent.name.split("_")[0] for p in summaries] == ["0", "1"]
    layouts = [json.loads(p.read_text())["layout"]["dp"] for p in summaries]
    assert layouts == [1, 2]
    assert (summaries[1].parent / "train_ddp_process_1.log").is_file()  # rank 1 logged into its job's folder
    assert len(list(tmp_path.glob("*/.hydra"))) == 2


def wandb_records(path: Path):
    """Records of a ``.wandb`` transaction log: a 7-byte file header, then 32 KiB blocks of
    chunks with a 7-byte header (crc32, length, kind: 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2

    block, header = 32768, 7
    data, pos, pending = path.read_bytes(), 7, b""
    assert data[:4] == b":W&B"
    while pos + header <= len(data):
        room = block - pos % block
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + header]) if room >= header else (0, 0, 0)
        if kind == 0:  # block padding
            pos += room
            continue
        pending += data[pos + header : pos + header + length]
        pos += header + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def item_key(item) -> str:
    return item.key or "/".join(item.nested_key)


def test_wandb_logger_records_config_and_metrics_offline(tmp_path):
    pytest.importorskip("wandb")
    env = {"WANDB_API_KEY": "", "WANDB_MODE": "", "WANDB_DIR": "", "WANDB_SILENT": "true"}
    recipe(*TINY_RUN, "logger=wandb", "parallel=dp1", "trainer.max_steps=5", f"hydra.run.dir={tmp_path}", env=env)
    (run_log,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    config, history = {}, []
    for record in wandb_records(run_log):
        kind = record.WhichOneof("record_type")
        if kind == "config":
            config.update({item_key(item): json.loads(item.value_json) for item in record.config.update})
        elif kind == "history":
            history.append({item_key(item): json.loads(item.value_json) for item in record.history.item})
    assert config["parallel"]["data_parallel_size"] == 1
    assert config["model"]["num_layers"] == 2
    losses = [row["train_loss"] for row in history if "train_loss" in row]
    assert len(losses) == 5 and all(0.0 < loss < 10.0 for loss in losses)


FAKE_SRUN = """#!/bin/bash
# srun stand-in: skip srun's own options, start SLURM_NTASKS copies of the command on this host.
while [[ "$1" == --* ]]; do shift; done
pids=()
for ((rank = 0; rank < SLURM_NTASKS; rank++)); do
  SLURM_PROCID=$rank SLURM_LOCALID=$rank SLURM_NODEID=0 "$@" &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
exit $status
"""


def test_slurm_template_runs_under_lightnings_slurm_environment(tmp_path):
    """recipes/slurm/train.sbatch as sbatch would run it on a 1-node, 2-task allocation, with srun
    replaced by a stand-in that starts the tasks with SLURM's per-task variables."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "srun").chmod(0o755)
    # a wrapper, not a symlink: a symlink to a venv's python outside the venv starts the base
    # interpreter, without the venv's packages
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (bin_dir / "python").chmod(0o755)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    allocation = {
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NAME": "ptdp-train",
        "SLURM_NNODES": "1",
        "SLURM_NTASKS": "2",
        "SLURM_NTASKS_PER_NODE": "2",
        "SLURM_JOB_NODELIST": "localhost",
        "SLURM_NODELIST": "localhost",
        "SLURM_SUBMIT_DIR": str(ROOT),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RUN_DIR": str(tmp_path / "run"),
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
    }
    cmd = [
        "bash",
        str(ROOT / "recipes/slurm/train.sbatch"),
        *TINY_RUN,
        "parallel=dp2",
        "trainer.max_steps=5",
        "trainer.accelerator=cpu",
        "trainer.precision=32-true",
    ]
    proc = subprocess.run(
        cmd, cwd=tmp_path, env={**os.environ, **allocation}, capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["cluster_environment"] == "SLURMEnvironment"
    assert summary["layout"]["world_size"] == 2 and summary["steps"] == 5
    assert (tmp_path / "run" / "rank0.log").is_file() and (tmp_path / "run" / "rank1.log").is_file()
    assert [p.name for p in (tmp_path / "run").glob("*/config.yaml")] == ["config.yaml"]  # task 0 only
