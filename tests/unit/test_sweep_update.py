"""`python -m benchmarks.sweep_transformers --update whole.json` puts the cells it reran in place of the
whole sweep's and says so: which cells, at which code, beside the whole run's own code line."""

from __future__ import annotations

import pytest


def _record(code: str | None, cells: dict, layouts=("d2", "t2"), steps=3) -> dict:
    record = {
        "date": "2026-11-27",
        "command": "python -m benchmarks.sweep_transformers",
        "registered": 2,
        "layouts": list(layouts),
        "steps": steps,
        "minutes": 84.0,
        "pools_started": 1,
        "transformers": "5",
        "torch": "2",
        "cpu": "cpu",
        "families": {
            name: {
                "class": name,
                "moe": False,
                "cells": {k: {"outcome": o, "reason": "", "seconds": 1.0} for k, o in c.items()},
            }
            for name, c in cells.items()
        },
    }
    return record if code is None else {**record, "code": code}


def test_an_update_replaces_the_cells_it_reran_and_lists_them(tmp_path):
    from benchmarks.sweep_transformers import SECTION, counts, merged, render

    base = _record(None, {"a": {"d2": "ok", "t2": "mismatch"}, "b": {"d2": "ok", "t2": "warned"}})
    results = tmp_path / "RESULTS.md"
    results.write_text(f"<!-- section:{SECTION} -->\n## x\n\n- Code: commit base123.\n<!-- /section:{SECTION} -->\n")
    update = {**_record("commit new456", {"a": {"t2": "ok"}}, layouts=("t2",)), "date": "2026-11-28", "minutes": 2.0}
    record = merged(base, update, results)
    assert record["code"] == "commit base123"  # the whole run's, read from the section it wrote
    assert {n: {k: c["outcome"] for k, c in f["cells"].items()} for n, f in record["families"].items()} == {
        "a": {"d2": "ok", "t2": "ok"},
        "b": {"d2": "ok", "t2": "warned"},
    }
    assert counts({**record, "layouts": ["d2", "t2"]})["t2"]["ok"] == 1
    assert record["updates"][0]["cells"] == ["a t2"] and base["families"]["a"]["cells"]["t2"]["outcome"] == "mismatch"
    assert "- Updated 2026-11-28: 1 cells rerun at commit new456" in render({**record, "counts": counts(record)})


def test_an_update_of_other_steps_or_layouts_than_the_whole_sweep_is_refused():
    from benchmarks.sweep_transformers import merged

    base = _record("commit a", {"a": {"d2": "ok"}}, layouts=("d2",))
    with pytest.raises(SystemExit, match="covering the rerun layouts"):
        merged(base, _record("commit b", {"a": {"t2": "ok"}}, layouts=("t2",)), None)
    with pytest.raises(SystemExit, match="of as many steps"):
        merged(base, _record("commit b", {"a": {"d2": "ok"}}, layouts=("d2",), steps=1), None)
