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


def test_a_section_reads_back_as_the_record_it_was_rendered_from(tmp_path):
    """Where the record behind the table was not kept, ``--update`` reads it from the table itself."""
    from benchmarks.results import write_section
    from benchmarks.sweep_transformers import SECTION, from_section, load_base, merged, render, stored_record

    base = _record("commit base123", {"a": {"d2": "ok", "t2": "warned"}, "b": {"d2": "refused"}})
    base["families"]["a"]["cells"]["t2"]["reason"] = "keeps x | y whole"
    update = {**_record("commit new456", {"b": {"d2": "ok"}}, layouts=("d2",)), "date": "2026-11-28"}
    record = merged(base, update, None)
    results = write_section(SECTION, render(record), commit=record["code"], path=tmp_path / "RESULTS.md")
    back = load_base(stored_record(results), results)
    assert back["families"]["a"]["cells"]["t2"] == {"outcome": "warned", "reason": "keeps x | y whole", "seconds": 0.0}
    assert back["updates"][0]["code"] == "commit new456" and len(back["updates"][0]["cells"]) == 1
    again = write_section(
        SECTION, render(from_section(results.read_text())), commit=back["code"], path=tmp_path / "2.md"
    )
    assert again.read_text() == results.read_text()
