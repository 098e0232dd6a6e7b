"""`python -m benchmarks.run_all --cpu --quick` runs every CPU benchmark at tiny sizes, so the one
command that regenerates benchmarks/RESULTS.md cannot rot; it writes only into a temporary file."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.results import RESULTS, code_version, paired_ratio, stats, write_section
from tests.matrix import FULL

ROOT = Path(__file__).resolve().parents[2]
# the sections the default suite runs (a process group of 2 and of 4 ranks, each contender alternated,
# the allocator's figures); every section under PTDP_FULL_MATRIX=1 (compile alone is a third of the run)
CORE = ("dp", "tp", "pipeline", "memory")


def _spreads(node) -> list[dict]:
    """Every {"median", "min", "max"} dict inside a JSON value."""
    found = []
    if isinstance(node, dict):
        if {"median", "min", "max"} <= node.keys():
            found.append(node)
        for value in node.values():
            found += _spreads(value)
    elif isinstance(node, list):
        for value in node:
            found += _spreads(value)
    return found


@pytest.mark.slow
def test_quick_run_writes_every_section_with_medians_and_spreads(tmp_path):
    from benchmarks.run_all import SECTIONS

    ran = list(SECTIONS) if FULL else [name for name in SECTIONS if name in CORE]
    only = [] if FULL else ["--only", ",".join(ran)]
    repository_results = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    results = tmp_path / "RESULTS.md"
    results.write_text("# Benchmark results\n\n<!-- section:gpu-suite -->\nGPU figures\n<!-- /section:gpu-suite -->\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.run_all",
            "--cpu",
            "--quick",
            "--results",
            str(results),
            "--json",
            str(tmp_path / "run_all.json"),
            *only,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((tmp_path / "run_all.json").read_text())
    assert json.loads(proc.stdout) == record
    assert record["info"]["quick"] and record["info"]["torch"] and "cores visible" in record["info"]["cpu"]
    assert list(record["sections"]) == ran
    text = results.read_text()
    assert "<!-- section:gpu-suite -->\nGPU figures\n<!-- /section:gpu-suite -->" in text  # others' sections kept
    assert all((f"<!-- section:{name} -->" in text) == (name in ran) for name in SECTIONS)
    # the whole run's summary: a subset leaves it alone (written: test_a_whole_run_writes_its_summary)
    assert ("<!-- section:cpu-run -->" in text and "minutes" in text) == FULL
    for name, result in record["sections"].items():
        spreads = _spreads(result)
        assert spreads, name
        assert all(s["min"] <= s["median"] <= s["max"] for s in spreads), name
        section = text.split(f"<!-- section:{name} -->")[1].split(f"<!-- /section:{name} -->")[0]
        assert "Hardware:" in section and "python -m benchmarks.run_all --cpu --quick" in section, name
        assert "Written by `benchmarks/run_all.py`" in section, name
    # contenders alternated over repeated rounds
    assert record["sections"]["dp"]["tokens_per_s"]["ptdp"]["n"] == 2
    assert record["sections"]["tp"]["ratio_ptdp_over_model_parallel_strategy"]["n"] == 2
    assert all(row["interleaved_cut_of_1f1b_bubble"]["n"] == 2 for row in record["sections"]["pipeline"]["rows"])
    # the collective count agrees with Megatron's, backward re-gather of the SP input shards included
    assert all(c["agrees"] for c in record["sections"]["tp"]["collectives_per_layer_and_microbatch"].values())
    # memory measured from the allocator: positive, at least the model state's formula, peak above rest
    for row in record["sections"]["memory"]["rows"]:
        assert row["allocator_at_rest_over_ptdp_formula"]["min"] >= 0.99, row
        assert row["allocator_peak_in_step"]["median"] > row["allocator_at_rest"]["median"], row
    assert (ROOT / "benchmarks" / "RESULTS.md").read_text() == repository_results  # never the repository's file


def test_stats_and_paired_ratio():
    assert stats([3.0, 1.0, 2.0]) == {"values": [3.0, 1.0, 2.0], "median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    ratio = paired_ratio([2.0, 4.0], [1.0, 4.0])
    assert ratio["median"] == 1.5 and ratio["min"] == 1.0 and ratio["max"] == 2.0 and ratio["of_medians"] == 1.2


def test_write_section_replaces_its_own_and_keeps_the_rest(tmp_path):
    path = tmp_path / "R.md"
    write_section("a", "## A\nold", path=path)
    write_section("gpu-suite", "## GPU\nkept", path=path)
    write_section("a", "## A\nnew", path=path)
    text = path.read_text()
    assert "new" in text and "old" not in text and "## GPU" in text and "kept" in text
    assert text.index("## A") < text.index("## GPU")
    # a stale second copy of a section (an older script wrote it elsewhere) goes on the next write
    path.write_text(text + "\n<!-- section:a -->\n## A\nstale\n<!-- /section:a -->\n")
    write_section("a", "## A\nnewer", path=path)
    text = path.read_text()
    assert text.count("<!-- section:a -->") == 1 and "newer" in text and "stale" not in text and "kept" in text


def test_each_section_records_the_commit_it_ran_on(tmp_path):
    path = tmp_path / "R.md"
    write_section("a", "## A\n\n- Sizes: s", commit="commit 0123abcd", path=path)
    write_section("b", "## B\nA paragraph.", path=path)  # no commit given: the checkout's, now
    text = path.read_text()
    assert "## A\n\n- Code: commit 0123abcd.\n- Sizes: s" in text  # one list under the heading
    assert f"## B\n\n- Code: {code_version()}.\n\nA paragraph." in text


def test_code_version_counts_changed_code_not_written_results(tmp_path):
    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True)

    git("init", "-q")
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "RESULTS.md").write_text("# r\n")
    (tmp_path / "code.py").write_text("x = 1\n")
    git("add", ".")
    git("commit", "-q", "-m", "c")
    clean = code_version(tmp_path)
    assert clean.startswith("commit ") and "uncommitted" not in clean
    (tmp_path / "benchmarks" / "RESULTS.md").write_text("# r\nfigures\n")  # what a run writes is not code
    assert code_version(tmp_path) == clean
    (tmp_path / "code.py").write_text("x = 2\n")
    assert code_version(tmp_path) == f"{clean} plus uncommitted changes to 1 files"
    assert code_version(tmp_path / "nowhere").startswith("unknown")


def test_every_results_section_names_its_commit():
    text = RESULTS.read_text()
    sections = re.findall(r"<!-- section:([\w-]+) -->\n(.*?)<!-- /section:\1 -->", text, re.DOTALL)
    assert sections
    missing = [name for name, body in sections if not re.search(r"^- Code: (commit [0-9a-f]{7,}|unknown)", body, re.M)]
    assert not missing, f"RESULTS.md sections without the commit their figures came from: {missing}"
    outside = re.sub(r"<!-- section:([\w-]+) -->.*?<!-- /section:\1 -->", "", text, flags=re.DOTALL)
    assert "None yet" not in outside, "RESULTS.md still says no GPU figures exist next to the GPU section"


def test_a_whole_run_writes_its_summary(monkeypatch, tmp_path):
    """Every section run (each stood in for here; the quick run above runs them), the summary names each
    with its time; the pools are opened one at a time, each closed."""
    from benchmarks import run_all

    opened = []

    class Pool:
        def __init__(self, world_size: int) -> None:
            self.world_size, self.closed = world_size, False
            assert all(pool.closed for pool in opened), "two pools open at once"
            opened.append(self)

        def close(self) -> None:
            self.closed = True

    monkeypatch.setattr("lightning_ptdp.testing.DistributedPool", Pool)
    monkeypatch.setattr(
        run_all, "run_section", lambda name, quick, pools: {"elapsed_s": 61.0, "load_average_after": (0, 0, 0)}
    )
    monkeypatch.setattr(run_all, "section_markdown", lambda name, result, info, command: f"## {name}\n")
    results = tmp_path / "R.md"
    assert run_all.main(["--cpu", "--quick", "--results", str(results)]) == 0
    text = results.read_text()
    summary = text.split("<!-- section:cpu-run -->")[1].split("<!-- /section:cpu-run -->")[0]
    assert "python -m benchmarks.run_all --cpu --quick`" in summary and " minutes " in summary
    assert all(f"{name} 61 s" in summary and f"<!-- section:{name} -->" in text for name in run_all.SECTIONS)
    assert sorted(pool.world_size for pool in opened) == sorted({s[3] for s in run_all.SECTIONS.values()} - {1})
    assert all(pool.closed for pool in opened)


def test_quick_without_results_writes_nothing(monkeypatch):
    from benchmarks import run_all

    written = []
    monkeypatch.setattr(run_all, "write_section", lambda *a, **k: written.append(a))
    monkeypatch.setattr(
        run_all, "run_section", lambda name, quick, pools: {"elapsed_s": 0.0, "load_average_after": (0, 0, 0)}
    )
    assert run_all.main(["--cpu", "--quick", "--only", "overhead"]) == 0
    assert written == []
