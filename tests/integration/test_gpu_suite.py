"""`python -m benchmarks.gpu --smoke` runs every part of the GPU suite on the CPU interpreter, so
the suite a GPU slot depends on cannot rot between GPU slots."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from benchmarks.gpu import rounds, training  # noqa: E402
from benchmarks.gpu.context import Context  # noqa: E402

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
    (path,) = tmp_path.glob("gpu_suite*-smoke-*.json")
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
    _check_training(parts["training"])
    assert "vs ptdp-torch" in Path(record["files"]["markdown"]).read_text()
    assert results.read_text() == before  # a smoke run never writes the repository's RESULTS.md


def _check_training(part: dict) -> None:
    trained = {row["variant"]: row for row in part["rows"]}
    names = [v.name for v in training.VARIANTS]
    assert list(trained) == [*names[:5], training.AUTO, *names[5:]]  # every variant ran, compiled ones included
    assert all(row.get("tokens_per_s", 0) > 0 for row in trained.values()), trained  # none failed or skipped
    # the paper's Eq. 2 plus the final LayerNorm (2h) it leaves out: an untied head would add V*h
    final_norm = 2 * part["model"]["hidden_size"]
    assert {row["parameters_built"] for row in trained.values()} == {part["parameters"] + final_norm}
    # every run began from the same weights and read the same batches (a ptdp run once read shuffled rows)
    first_losses = [run["first_loss"] for row in trained.values() for run in row["runs"]]
    assert part["first_losses_agree"] and part["batches_agree"] and part["weights_agree"], first_losses
    # the float8 row: held to the same weights and batches, its first loss reported against ptdp+compile's
    float8 = part["float8_first_loss"]
    assert sorted(float8) == ["ptdp+compile+float8", "ptdp+compile+float8-rowwise"]
    for name, first in float8.items():
        assert first["same_input"] and first["relative_gap"] < 1e-2, first
        assert "ratio_vs_bf16" in trained[name]
    # alternated rounds: each variant ran ROUNDS times, the order rotated so that each led one round
    assert part["eager_rounds"] == part["compiled_rounds"] == rounds.ROUNDS
    for name, row in trained.items():
        assert [run["round"] for run in row["runs"]] == list(range(rounds.ROUNDS)), name
        assert row["tokens_per_s_min"] <= row["tokens_per_s"] <= row["tokens_per_s_max"]
    leaders = {run["round"] for row in trained.values() for run in row["runs"] if run["slot"] == 0}
    assert leaders == set(range(rounds.ROUNDS))
    assert {tuple(run["routed"]) for run in trained["ptdp-triton"]["runs"]} == {("attention", "bias_gelu")}
    # off CUDA "auto" routes nothing: the single-kernel runs and ptdp-auto are ptdp-torch's configuration
    assert {
        tuple(run["routed"]) for v in ("ptdp-torch", "ptdp-attention", "ptdp-bias-gelu") for run in trained[v]["runs"]
    } == {()}
    assert trained[training.AUTO]["same_run_as"] == "ptdp-torch"
    assert "ratio_vs_lightning_range" in trained["ptdp-torch"] and "ratio_vs_ptdp_torch" in trained["ptdp-triton"]
    assert part["auto"]["device_class"] is None and part["auto"]["table_routes"] is None
    assert isinstance(part["auto"]["measured_faster"], list)


def test_same_start_flags_another_batch_and_another_seed():
    """The negative controls: rows 2.. (what a shuffling sampler once fed ptdp) or weights from seed 1
    fail the first-loss tolerance, and the batch or weight fingerprint, on the smoke model."""
    ctx = Context(device=torch.device("cpu"), smoke=True, hbm_bytes_per_s=None, peak_flops=None)
    plain = training.VARIANTS[0]
    assert plain.kernels is None

    def run(**start) -> dict:
        return training.fit(ctx, training.SMOKE_MODEL, plain, 2, 3, 1, **start)

    reference = run()
    again = rounds.same_start([reference, run()])
    assert again["first_losses_agree"] and again["batches_agree"] and again["weights_agree"], again
    shifted = rounds.same_start([reference, run(first_row=2)])
    assert not shifted["first_losses_agree"] and not shifted["batches_agree"] and shifted["weights_agree"], shifted
    reseeded = rounds.same_start([reference, run(seed=1)])
    assert not reseeded["first_losses_agree"] and reseeded["batches_agree"] and not reseeded["weights_agree"]


def _runs(ratios: list[float]) -> dict:
    return {"runs": [{"round": i, "tokens_per_s": 100.0 * r} for i, r in enumerate(ratios)]}


@pytest.mark.parametrize(
    ("attention", "bias_gelu", "faster"),
    [
        ([1.02, 1.03, 1.01], [0.99, 1.05, 1.04], ["attention"]),  # faster in every round, or not chosen
        ([1.02, 1.03], [1.05, 1.06], []),  # too few rounds to choose
        ([1.0, 1.01, 1.02], [1.01, 1.02, 1.03], ["bias_gelu"]),  # a tie is not faster
    ],
)
def test_a_kernel_is_faster_only_if_it_won_every_alternated_round(attention, bias_gelu, faster):
    by_name = {"ptdp-torch": _runs([1.0] * 3), "ptdp-attention": _runs(attention), "ptdp-bias-gelu": _runs(bias_gelu)}
    assert rounds.measured_faster(by_name, training.SINGLE_KERNEL) == faster


def test_rotated_rounds_put_each_variant_first_once():
    variants = ["a", "b", "c"]
    assert [rounds.rotated(variants, i) for i in range(3)] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]


def test_the_auto_table_holds_only_what_a_suite_run_measured_faster():
    """lightning_ptdp.kernels.MEASURED_FASTER is filled from the suite's verdicts (benchmarks/results):
    each recorded verdict is the table's entry for its device class, and no entry routes a kernel
    without one."""
    from lightning_ptdp.kernels import MEASURED_FASTER

    verdicts = {}
    for path in sorted((ROOT / "benchmarks" / "results").glob("gpu_suite-*.json")):
        auto = json.loads(path.read_text())["parts"].get("training", {}).get("auto")
        if auto and auto["measured_faster"] is not None:  # runs before the alternated rounds have none
            verdicts[auto["device_class"]] = auto["measured_faster"]
    for device_class, faster in verdicts.items():
        assert sorted(MEASURED_FASTER.get(device_class, ())) == faster, device_class
    for device_class, routes in MEASURED_FASTER.items():
        assert not routes or device_class in verdicts, f"{device_class}: {sorted(routes)} without a suite verdict"


@pytest.mark.slow
def test_a_part_over_budget_is_recorded_and_the_next_still_runs(tmp_path):
    record = _suite(tmp_path, "--parts", "attention,tuning", "--budget-scale", "0.001")
    assert record["parts"]["attention"]["status"] == "timeout"
    assert "budget" in record["parts"]["attention"]["error"]
    assert "tuning" in record["parts"]


def test_budgets_fit_in_eight_minutes():
    from benchmarks.gpu.suite import PARTS

    assert sum(part.BUDGET_S for part in PARTS.values()) + 20 <= 8 * 60  # 20 s: imports, writing files
