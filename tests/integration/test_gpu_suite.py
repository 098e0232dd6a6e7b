"""`python -m benchmarks.gpu --smoke` runs every part of the GPU suite on the CPU interpreter, so
the suite a GPU slot depends on cannot rot between GPU slots."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]


def _suite(tmp_path: Path, *args: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu", "--smoke", "--out", str(tmp_path), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = tmp_path.glob("gpu_suite-smoke-*.json")
    return json.loads(path.read_text())


@pytest.mark.slow
def test_smoke_runs_every_part_and_the_kernels_are_correct(tmp_path):
    results = ROOT / "benchmarks" / "RESULTS.md"
    before = results.read_text()
    record = _suite(tmp_path)
    from benchmarks.gpu.suite import PARTS

    parts = record["parts"]
    assert list(parts) == list(PARTS)
    assert {name: part["status"] for name, part in parts.items()} == dict.fromkeys(PARTS, "ok")
    assert record["device"] and record["torch"] and record["triton"]
    assert record["absent_on_gpu_image_but_imported"] == []  # nothing the GPU image lacks (suite.NOT_ON_GPU_IMAGE)
    correctness = parts["correctness"]
    assert correctness["passed"] and correctness["cases"] == len(correctness["rows"]) > 0
    assert {row["kernel"] for row in correctness["rows"]} == {"flash_attention", "bias_gelu"}
    assert all("fwd_bwd_tflops" in row["triton"] for row in parts["attention"]["rows"])
    assert all("fwd_gbps" in row[name] for row in parts["bias_gelu"]["rows"] for name in ("triton", "eager", "compile"))
    from benchmarks.gpu.training import VARIANTS

    trained = {row["variant"]: row for row in parts["training"]["rows"]}
    assert [v.name for v in VARIANTS] == list(trained)  # every variant ran, compiled ones included
    assert all(row.get("tokens_per_s", 0) > 0 for row in trained.values()), trained  # none failed or skipped
    training = parts["training"]
    # the paper's Eq. 2 plus the final LayerNorm (2h) it leaves out: an untied head would add V*h
    final_norm = 2 * training["model"]["hidden_size"]
    assert {row["parameters_built"] for row in trained.values()} == {training["parameters"] + final_norm}
    assert training["first_losses_agree"], [row["first_loss"] for row in trained.values()]
    assert "## " in Path(record["files"]["markdown"]).read_text()
    assert results.read_text() == before  # a smoke run never writes the repository's RESULTS.md


@pytest.mark.slow
def test_a_part_over_budget_is_recorded_and_the_next_still_runs(tmp_path):
    record = _suite(tmp_path, "--parts", "attention,tuning", "--budget-scale", "0.001")
    assert record["parts"]["attention"]["status"] == "timeout"
    assert "budget" in record["parts"]["attention"]["error"]
    assert "tuning" in record["parts"]


def test_budgets_fit_in_eight_minutes():
    from benchmarks.gpu.suite import PARTS

    assert sum(part.BUDGET_S for part in PARTS.values()) + 20 <= 8 * 60  # 20 s: imports, writing files
