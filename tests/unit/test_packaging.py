"""What ``pip install`` puts into site-packages, read from pyproject.toml the way setuptools reads it:
one top-level name, lightning_ptdp, holding every folder of the package and the recipes (the
``ptdp`` command's defaults). tests/integration/test_packaging.py builds the wheel and runs it."""

from pathlib import Path

from setuptools.config.pyprojecttoml import read_configuration

import recipes.cli

ROOT = Path(__file__).resolve().parents[2]
CONFIG = read_configuration(ROOT / "pyproject.toml")
SETUPTOOLS = CONFIG["tool"]["setuptools"]


def source_folder(package: str) -> Path:
    """Where setuptools takes ``package`` from: its package-dir entry, else its dotted path."""
    mapped = SETUPTOOLS.get("package-dir", {})
    return ROOT / mapped[package] if package in mapped else ROOT / package.replace(".", "/")


def test_only_lightning_ptdp_is_installed_at_the_top_level():
    top_level = {name.split(".")[0] for name in SETUPTOOLS["packages"] + list(SETUPTOOLS.get("package-dir", {}))}
    assert top_level == {"lightning_ptdp"}, "a generic top-level name (recipes, triton_kernels) would be claimed"
    assert not SETUPTOOLS.get("py-modules"), "a top-level module would be claimed"


def test_every_folder_of_the_package_is_installed():
    folders = {
        ".".join(path.parent.relative_to(ROOT).parts)
        for path in (ROOT / "lightning_ptdp").rglob("*.py")
        if "__pycache__" not in path.parts
    }
    listed = set(SETUPTOOLS["packages"])
    assert folders - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"
    assert {p for p in listed if not any(source_folder(p).glob("*.py"))} == set(), "listed without a folder"


def test_the_ptdp_command_is_the_recipes_cli_under_the_package_name():
    assert CONFIG["project"]["scripts"] == {"ptdp": "lightning_ptdp.recipes.cli:main"}
    assert source_folder("lightning_ptdp.recipes") / "cli.py" == Path(recipes.cli.__file__)
    # the defaults name the package they are in: installed, that is lightning_ptdp.recipes
    assert recipes.cli.DEFAULTS == {
        "model": "recipes.gpt.GPTLightningModule",
        "data": "recipes.data.MarkovDataModule",
    }
