"""The "Works with" tables are the conformance matrices', as tests/works_with.py renders them into
README.md and docs/user_guide.md (`python .ci/works_with.py` writes them)."""

import pytest

from tests.works_with import BLOCKS, README, ROOT, USER_GUIDE, render_context, render_dense_and_moe, render_sweep


@pytest.mark.parametrize("block", BLOCKS, ids=lambda block: block.name)
def test_each_document_holds_its_rendered_block(block):
    held = block.held(block.path.read_text())
    assert held == block.rendered(), f"run `python .ci/works_with.py` and commit {block.path.name}"


def test_the_readme_keeps_the_dense_and_moe_tables_and_the_sweep_and_the_guide_the_context_parallel_ones():
    assert [(b.path, b.render) for b in BLOCKS] == [
        (README, render_dense_and_moe),
        (README, render_sweep),
        (USER_GUIDE, render_context),
    ]


def test_the_sweep_counts_are_the_recorded_sweep_s():
    """The README's counts are the per-layout table of RESULTS.md's sweep section, rows and all."""
    text = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    section = text[text.index("<!-- section:sweep_transformers -->") :]
    rendered = render_sweep()
    for row in (line for line in rendered.splitlines() if line.startswith("| ")):
        assert row in section
    assert {line.split(" | ")[0] for line in rendered.splitlines() if line.startswith("| ")} >= {"| layout", "| t2"}


def ok_rows(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("| ") and " ok " in line]


def test_every_matrix_cell_is_a_row_entry():
    from tests.distributed.test_real_models import LAYOUTS, MATRIX_FAMILIES

    rows = ok_rows(render_dense_and_moe().split("Mixture-of-experts families")[0])
    assert len(rows) == len(MATRIX_FAMILIES)
    assert all(row.count(" ok ") == len(LAYOUTS) for row in rows)


def test_every_moe_case_is_an_ok_cell():
    from tests.distributed.test_expert_parallel import FULL_CASES as CASES
    from tests.works_with import titan_bf16_layouts

    moe = render_dense_and_moe().split("Mixture-of-experts families")[1]
    assert sum(row.count(" ok ") for row in ok_rows(moe)) == len(CASES) + len(titan_bf16_layouts())


def test_every_context_parallel_case_is_an_ok_cell():
    from tests.distributed.test_context_parallel import EXTRA_FAMILIES, EXTRAS, MOE_FAMILIES, MOE_LAYOUTS
    from tests.distributed.test_context_parallel import FULL_CASES as CASES

    cells = sum(row.count(" ok ") for row in ok_rows(render_context()))
    assert cells == len(CASES) + len(EXTRAS) * len(EXTRA_FAMILIES) + len(MOE_LAYOUTS) * len(MOE_FAMILIES)
