"""The public modules (docs/architecture.md, "Public API") import with every name they export, and a
moved module still imports from its old path for one release, with a warning naming the new one."""

import importlib
import sys
from pathlib import Path

import pytest

PUBLIC = (
    "lightning_ptdp",
    "lightning_ptdp.callbacks",
    "lightning_ptdp.parallel.init",
    "lightning_ptdp.tensor_parallel",
    "lightning_ptdp.core.flops",
    "lightning_ptdp.planner",
    "lightning_ptdp.testing",
    "lightning_ptdp.triton_kernels",
)
DOCS = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"


@pytest.mark.parametrize("name", PUBLIC)
def test_public_module_exports_what_it_lists(name):
    module = importlib.import_module(name)
    assert f"`{name}`" in DOCS.read_text(), f"{name} is public: list it in docs/architecture.md"
    for export in getattr(module, "__all__", ()):
        assert hasattr(module, export), f"{name}.__all__ names {export}, which it lacks"


@pytest.mark.parametrize("old_path", ["lightning_ptdp.flops", "lightning_ptdp.tools.flops"])
def test_the_old_flops_paths_warn_and_give_the_same_functions(old_path):
    from lightning_ptdp.core import flops

    sys.modules.pop(old_path, None)
    with pytest.warns(DeprecationWarning, match=rf"{old_path} moved to lightning_ptdp.core.flops"):
        old = importlib.import_module(old_path)
    assert old.gpt_parameter_count is flops.gpt_parameter_count
    assert set(old.__all__) == set(flops.__all__)
