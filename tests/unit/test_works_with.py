"""The README's "Works with" table is the conformance matrix's, as tests/works_with.py renders it (`python .ci/works_with.py` writes it)."""

from tests.works_with import README, readme_block, render


def test_readme_holds_the_rendered_table():
    assert readme_block(README.read_text()) == render(), "run `python .ci/works_with.py` and commit README.md"


def test_every_matrix_cell_is_a_row_entry():
    from tests.distributed.test_real_models import LAYOUTS, MATRIX_FAMILIES

    dense = render().split("Mixture-of-experts families")[0]
    rows = [line for line in dense.splitlines() if line.startswith("| ") and not line.startswith("| model")]
    assert len(rows) == len(MATRIX_FAMILIES)
    assert all(row.count(" ok ") == len(LAYOUTS) for row in rows)


def test_every_moe_case_is_an_ok_cell():
    from tests.distributed.test_expert_parallel import CASES

    moe = render().split("Mixture-of-experts families")[1].split("Context parallelism,")[0]
    assert sum(line.count(" ok ") for line in moe.splitlines() if line.startswith("| ") and " ok " in line) == len(
        CASES
    )


def test_every_context_parallel_case_is_an_ok_cell():
    from tests.distributed.test_context_parallel import CASES, EXTRA_FAMILIES, EXTRAS, MOE_FAMILIES, MOE_LAYOUTS

    cp = render().split("Context parallelism,")[1]
    cells = sum(line.count(" ok ") for line in cp.splitlines() if line.startswith("| ") and " ok " in line)
    assert cells == len(CASES) + len(EXTRAS) * len(EXTRA_FAMILIES) + len(MOE_LAYOUTS) * len(MOE_FAMILIES)
