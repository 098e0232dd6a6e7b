"""The built wheel, installed into a temporary folder, beside other libraries' top-level ``recipes``
(torchtune has one that fails on import) and ``triton_kernels`` (OpenAI's, vLLM's): it installs only
lightning_ptdp, and the ``ptdp`` command and the kernels work with those stand-ins ahead on the path.
The source is copied first, so building writes nothing into the checkout; no README is read or written
(the copy's pyproject.toml drops its optional ``readme`` field)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("pyproject.toml", "lightning_ptdp", "recipes")
OTHER_LIBRARIES = ("recipes", "triton_kernels")
TIMEOUT_S = 300


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True, timeout=TIMEOUT_S, capture_output=True)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The wheel built from a copy of the sources (no network, this environment's setuptools),
    installed with ``pip install --target``: the folder plays site-packages."""
    before = checkout_status()
    work = tmp_path_factory.mktemp("wheel")
    source = work / "source"
    source.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(ROOT / name, source / name)
    project = source / "pyproject.toml"  # the copy's metadata without the README (optional): none is read or written
    project.write_text(re.sub(r"^readme = .+\n", "", project.read_text(), flags=re.M))
    pip("wheel", "--no-deps", "--no-build-isolation", "--no-index", "--wheel-dir", str(work / "dist"), str(source))
    (wheel,) = (work / "dist").glob("*.whl")
    pip("install", "--no-deps", "--no-index", "--target", str(work / "site"), str(wheel))
    assert checkout_status() == before, "building the wheel wrote into the checkout"
    return work / "site"


def checkout_status() -> str:
    """``git status`` of the checkout (empty outside a git checkout): what a build may not change."""
    proc = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True, check=False)
    return proc.stdout if proc.returncode == 0 else ""


@pytest.fixture(scope="module")
def beside_other_libraries(installed, tmp_path_factory) -> dict[str, str]:
    """An environment whose path puts stand-ins for the other libraries' packages before ours."""
    others = tmp_path_factory.mktemp("other_libraries")
    for name in OTHER_LIBRARIES:
        (others / name).mkdir()
        (others / name / "__init__.py").write_text(f"raise ImportError('{name} of another library')\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(others), str(installed)]), "OMP_NUM_THREADS": "1"}


def run(command: list[str], env: dict[str, str], cwd: Path) -> str:
    """``command`` from outside the checkout (so the repository's own folders are not importable)."""
    proc = subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, (
        f"{' '.join(command)} exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    )
    return proc.stdout


def test_the_wheel_installs_only_lightning_ptdp(installed):
    top_level = {
        path.name for path in installed.iterdir() if path.name != "bin" and not path.name.endswith(".dist-info")
    }
    assert top_level == {"lightning_ptdp"}
    (dist_info,) = installed.glob("*.dist-info")
    assert (dist_info / "top_level.txt").read_text().split() == ["lightning_ptdp"]
    assert {"core", "recipes", "triton_kernels"} <= {path.name for path in (installed / "lightning_ptdp").iterdir()}


def test_ptdp_works_with_other_libraries_recipes_and_triton_kernels_first(installed, beside_other_libraries, tmp_path):
    ptdp = str(installed / "bin" / "ptdp")
    assert "{fit,validate,test,predict" in run([ptdp, "--help"], beside_other_libraries, tmp_path)
    assert "consolidate" in run([ptdp, "checkpoint", "--help"], beside_other_libraries, tmp_path)
    config = run([ptdp, "fit", "--print_config"], beside_other_libraries, tmp_path)  # imports the default classes
    assert "class_path: lightning_ptdp.recipes.gpt.GPTLightningModule" in config
    assert "class_path: lightning_ptdp.recipes.data.MarkovDataModule" in config


def test_the_kernels_import_from_the_package_with_other_libraries_first(installed, beside_other_libraries, tmp_path):
    code = (
        "import lightning_ptdp, lightning_ptdp.kernels\n"
        "from lightning_ptdp.triton_kernels import attention_supported, bias_gelu, flash_attention\n"
        "print(lightning_ptdp.__file__)\n"
    )
    printed = run([sys.executable, "-c", code], beside_other_libraries, tmp_path)
    assert printed.strip() == str(installed / "lightning_ptdp" / "__init__.py")
