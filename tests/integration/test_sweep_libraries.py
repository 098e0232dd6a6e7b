"""`python -m benchmarks.sweep_libraries` on a fixed sample (a litgpt MoE and torchtitan's Qwen3 at d2 and t2,
1 step), so the sweep over litgpt's and torchtitan's families cannot rot; it writes only into temporary files."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ("litgpt:Mixtral-8x7B-v0.1", "torchtitan:qwen3")


def test_fixed_sample_writes_a_classified_cell_per_family_and_layout(tmp_path):
    from benchmarks.sweep_libraries import SECTION
    from benchmarks.sweep_transformers import OUTCOMES

    results, out = tmp_path / "RESULTS.md", tmp_path / "sweep.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    args = ["--families", ",".join(SAMPLE), "--layouts", "d2,t2", "--quick", "--timeout", "120"]
    command = [sys.executable, "-m", "benchmarks.sweep_libraries", *args, "--out", str(out), "--results", str(results)]
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(out.read_text())
    assert tuple(record["families"]) == SAMPLE and record["pools_started"] >= 1
    assert record["families"][SAMPLE[0]]["moe"] and not record["families"][SAMPLE[1]]["moe"]
    for family in record["families"].values():
        assert set(family["cells"]) == {"d2", "t2"}
        for cell in family["cells"].values():
            assert cell["outcome"] in OUTCOMES and (cell["outcome"] == "ok" or cell["reason"])
    # both train equal to one process at d2 in the conformance matrices (litgpt_moe, titan_llama3's kin)
    assert {f["cells"]["d2"]["outcome"] for f in record["families"].values()} == {"ok"}
    text = results.read_text()
    assert f"<!-- section:{SECTION} -->" in text and "- Code: " in text
    total = sum(n for layout in record["counts"].values() for n in layout.values())
    all_row = next(line for line in text.splitlines() if line.startswith("| all |"))
    assert all_row.endswith(f"| {total} |")
