"""The README's main job, end to end: Lightning's launcher, torchrun, and learning the corpus."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
JOB_TIMEOUT_S = 600


def run_job(cmd: list[str], out_dir: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return json.loads((out_dir / "summary.json").read_text())


def test_main_job_learns_the_corpus_under_lightning_launcher(tmp_path):
    """``python -m recipes.quickstart``: Lightning's launcher starts rank 1 itself."""
    summary = run_job(
        [
            sys.executable,
            "-m",
            "recipes.quickstart",
            "--devices",
            "2",
            "--max-steps",
            "200",
            "--out-dir",
            str(tmp_path),
        ],
        tmp_path,
    )
    assert summary["layout"] == {"pp": 1, "dp": 2, "tp": 1, "world_size": 2}
    assert summary["steps"] == 200
    # The corpus' entropy rate is the floor; the bound is 90% of the way from context-free guessing.
    assert summary["entropy_floor"] < summary["val_loss"] < summary["loss_bound"]
    # a sharded checkpoint (the default): it puts together on one process into the plain model's weights
    from lightning_ptdp.checkpoint.command import consolidated_state_dict

    weights = consolidated_state_dict(summary["checkpoint"])
    assert "gpt.token_embedding.weight" in weights and "gpt.blocks.0.attn.query.weight" in weights
    assert all(v.isfinite().all() for v in weights.values() if v.is_floating_point())
    assert "train_loss" in Path(summary["metrics_csv"]).read_text().splitlines()[0]


def test_main_job_under_torchrun(tmp_path):
    """Processes created externally (torchrun): the strategy must not launch its own."""
    summary = run_job(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            "recipes.quickstart",
            "--devices",
            "2",
            "--max-steps",
            "20",
            "--out-dir",
            str(tmp_path),
        ],
        tmp_path,
    )
    assert summary["layout"] == {"pp": 1, "dp": 2, "tp": 1, "world_size": 2}
    assert summary["steps"] == 20
