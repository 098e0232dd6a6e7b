"""The code base's shape, held by tests: one home per concern, imports only downward, short modules.

Layers, lowest first (docs/architecture.md draws them). A module imports from its own layer or
below; the parallelism axes (layer 1: tensor_parallel, pipeline, data_parallel, expert_parallel,
context_parallel) never import each other: what they share lives in layer 0.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "lightning_ptdp"

LAYERS: dict[str, int] = {
    # 0: the foundation, knows no parallelism technique: mesh and dims, block finder, flat collectives
    "config": 0,
    "core": 0,
    "faults": 0,
    "testing": 0,
    "flops": 0,  # deprecated path of core.flops
    "meta_routing": 0,  # balanced routing on meta, for any step on meta
    "triton_kernels": 0,  # the kernels and their torch references
    # 1: the parallelism axes, side by side
    "tensor_parallel": 1,
    "pipeline": 1,
    "data_parallel": 1,
    "expert_parallel": 1,
    "context_parallel": 1,
    # 2: what combines an axis with state: kernels, checkpoints
    "kernels": 2,
    "checkpoint": 2,
    # 3: the composition: the fixed order, gradients, initial values, recompute, compile
    "parallel": 3,
    # 4: Lightning's side
    "strategy": 4,
    "probe": 4,
    "callbacks": 4,
    # 5: commands and the package's front door
    "tools": 5,
    "planner": 5,
    "": 5,
}
AXES = {name for name, level in LAYERS.items() if level == 1}  # every axis, so a new one has no hole
MAX_LINES, MAX_STRATEGY_LINES, MAX_DOCSTRING_LINES = 500, 500, 8
OUTSIDE_MARKERS = ("DESIGN" + ".md", ".." + "/shared")  # split so this file does not match itself


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def layer_of(module: str) -> tuple[str, int]:
    """The most specific LAYERS entry covering ``module`` (a dotted name inside lightning_ptdp)."""
    parts = module.split(".") if module else []
    for end in range(len(parts), -1, -1):
        key = ".".join(parts[:end])
        if key in LAYERS:
            return key, LAYERS[key]
    raise AssertionError(f"lightning_ptdp.{module} has no layer: add it to LAYERS")


def imports_of(path: Path, module: str) -> set[str]:
    """lightning_ptdp modules ``path`` imports, lazily or not, relative to the package."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
            names += [node.module] if node.module != "lightning_ptdp" else []  # `from pkg import module`
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        known = _modules()
        for name in names:
            if name == "lightning_ptdp" or name.startswith("lightning_ptdp."):
                inner = name.removeprefix("lightning_ptdp").lstrip(".")
                if inner in known:
                    out.add(inner)
    return out


def violations(edges: dict[str, set[str]]) -> list[str]:
    found = []
    for module, targets in sorted(edges.items()):
        home, level = layer_of(module)
        for target in sorted(targets):
            their_home, their_level = layer_of(target)
            axis, their_axis = home.split(".")[0], their_home.split(".")[0]
            if their_level > level:
                found.append(f"{module} (layer {level}) imports {target} (layer {their_level}): upward")
            elif level == 1 and axis != their_axis and {axis, their_axis} <= AXES:
                found.append(f"{module} imports {target}: sideways between parallelism axes")
    return found


def test_layers_are_whole_folders():
    """A layer is a folder (or a single top-level module): the tree shows the layers."""
    assert [key for key in LAYERS if "." in key] == []
    for name in _modules():
        assert name.split(".")[0] in LAYERS, f"lightning_ptdp.{name} has no layer: add its folder to LAYERS"


def test_no_module_imports_upward_or_sideways():
    edges = {name: imports_of(path, name) for name, path in _modules().items()}
    assert sum(len(t) for t in edges.values()) > 50  # the walk sees the package's imports
    assert violations(edges) == []


def mutual_imports(edges: dict[str, set[str]]) -> list[str]:
    """Pairs of modules that import each other (lazily, or for type checking, too); a package and
    its own submodules (``pipeline`` re-exporting ``pipeline.engine``) do not count."""

    def family(a: str, b: str) -> bool:
        return a.startswith(f"{b}.") or b.startswith(f"{a}.")

    return sorted(
        f"{a} <-> {b}"
        for a, targets in edges.items()
        for b in targets
        if a < b and a in edges.get(b, ()) and not family(a, b)
    )


def test_no_two_modules_import_each_other():
    edges = {name: imports_of(path, name) for name, path in _modules().items()}
    assert mutual_imports(edges) == []
    assert mutual_imports({"probe": {"strategy"}, "strategy": {"probe"}}) == ["probe <-> strategy"]
    assert mutual_imports({"pipeline": {"pipeline.engine"}, "pipeline.engine": {"pipeline"}}) == []


def test_the_layer_check_fails_on_a_violation():
    assert violations({"pipeline.engine": {"tensor_parallel.layers"}}) == [
        "pipeline.engine imports tensor_parallel.layers: sideways between parallelism axes"
    ]
    assert violations({"context_parallel.tail": {"tensor_parallel.logits"}}) == [
        "context_parallel.tail imports tensor_parallel.logits: sideways between parallelism axes"
    ]
    assert violations({"core.comm": {"checkpoint.full"}}) == [
        "core.comm (layer 0) imports checkpoint.full (layer 2): upward"
    ]
    assert violations({"strategy": {"tensor_parallel.apply", "config"}}) == []


@pytest.mark.parametrize("name", sorted(_modules()))
def test_modules_are_short_with_short_docstrings(name):
    path = _modules()[name]
    lines = len(path.read_text().splitlines())
    limit = MAX_STRATEGY_LINES if name == "strategy" else MAX_LINES
    assert lines <= limit, f"{path.relative_to(ROOT)} has {lines} lines; split it (limit {limit})"
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    assert len(doc.strip().splitlines()) <= MAX_DOCSTRING_LINES, (
        f"{path.relative_to(ROOT)}: module docstring of {len(doc.strip().splitlines())} lines; "
        f"keep it to {MAX_DOCSTRING_LINES} and move the rest to docs/architecture.md"
    )


def test_nothing_refers_to_files_outside_the_repository():
    tracked = [p for p in ROOT.rglob("*") if p.suffix in {".py", ".md", ".yaml", ".toml"} and ".git" not in p.parts]
    offenders = [
        str(p.relative_to(ROOT))
        for p in tracked
        if "venv" not in p.parts and any(marker in p.read_text() for marker in OUTSIDE_MARKERS)
    ]
    assert offenders == []


def classes_sharing_a_name(paths: dict[str, Path]) -> dict[str, list[str]]:
    """Class names defined (at any depth) in more than one place among ``paths``, with where."""
    where: dict[str, list[str]] = {}
    for name, path in paths.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                where.setdefault(node.name, []).append(f"{name}:{node.lineno}")
    return {cls: places for cls, places in where.items() if len(places) > 1}


def test_no_two_classes_share_a_name(tmp_path):
    """One name, one class: a reader (or a traceback) naming a class means one thing."""
    assert classes_sharing_a_name(_modules()) == {}
    (tmp_path / "a.py").write_text("class Shard:\n    pass\n")
    (tmp_path / "b.py").write_text("def f():\n    class Shard:\n        pass\n")
    found = classes_sharing_a_name({"a": tmp_path / "a.py", "b": tmp_path / "b.py"})
    assert found == {"Shard": ["a:1", "b:2"]}
