"""docs/architecture.md's tables stay true to the code: §5 (every interception of the user's model)
names only what exists and every ``_ptdp_*`` attribute the library uses; the Public API table lists
every ``lightning_ptdp`` import the README and the user guide show users."""

from __future__ import annotations

import ast
import importlib
import io
import re
import tokenize
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "lightning_ptdp"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
USER_DOCS = (ROOT / "README.md", ROOT / "docs" / "user_guide.md")
TORCH_ALIASES = {"torch": "torch", "nn": "torch.nn", "F": "torch.nn.functional", "dist": "torch.distributed"}
SPAN = re.compile(r"`([^`]+)`")
DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")
PATH = re.compile(r"[\w/]+\.py")
PTDP_ATTRIBUTE = re.compile(r"_ptdp_\w+")


def section(text: str, heading: str) -> str:
    """The markdown section under ``heading`` (a whole heading line), up to the next ``## `` heading."""
    start = text.index(f"\n{heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else len(text)]


def table_rows(text: str) -> list[list[str]]:
    """The cells of each body row of the markdown tables in ``text`` (header and rule rows left out)."""
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    cells = [[c.strip() for c in re.split(r"(?<!\\)\|", row)[1:-1]] for row in rows]
    return [row for row, nxt in zip(cells, [*cells[1:], None]) if not _is_rule(row) and not _is_header(nxt)]


def _is_rule(row: list[str]) -> bool:
    return all(set(cell) <= {"-", ":"} for cell in row)


def _is_header(next_row: list[str] | None) -> bool:
    return next_row is not None and _is_rule(next_row)


@cache
def code_names() -> frozenset[str]:
    """Every identifier the library's code uses (names, attributes, identifier-like strings), not its comments."""
    names = set()
    for path in PACKAGE.rglob("*.py"):
        for token in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
            if token.type == tokenize.NAME:
                names.add(token.string)
            elif token.type == tokenize.STRING:
                names.update(DOTTED.findall(token.string))
    return frozenset(names)


def defined_in(path: Path) -> set[str]:
    """Functions, classes, methods and assigned names a module defines, at any depth."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            found.update(t.id for t in targets if isinstance(t, ast.Name))
    return found


def resolve_path(name: str) -> Path | None:
    """A path as the table writes it: inside the package, or from the repository root."""
    for base in (PACKAGE, ROOT):
        if (base / name).is_file():
            return base / name
    return None


def exists(dotted: str) -> bool:
    """A torch name resolves in torch; any other name is used by the library's code, every part of it."""
    head, *rest = dotted.split(".")
    if head in TORCH_ALIASES:
        target = importlib.import_module(TORCH_ALIASES[head])
        for part in rest:
            if not hasattr(target, part):
                return False
            target = getattr(target, part)
        return True
    return all(part in code_names() for part in dotted.split("."))


def interception_problems(text: str) -> list[str]:
    """What in the interception table (``text``: section 5) is not true of the code."""
    problems = []
    rows = table_rows(text)
    assert rows and all(len(row) == 4 for row in rows), "section 5's table: mechanism | where | why | lifetime"
    for mechanism, where, *_ in rows:
        module = None
        for span in SPAN.findall(where):
            if PATH.fullmatch(span):
                module = resolve_path(span)
                if module is None:
                    problems.append(f"{span}: no such file (write it from lightning_ptdp/ or the repository root)")
            elif not DOTTED.fullmatch(span):
                problems.append(f"{span}: the where column names files and what they define, nothing else")
            elif module is None:
                problems.append(f"{span}: name its file before it")
            elif span.split(".")[-1] not in defined_in(module):
                problems.append(f"{span}: not defined in {module.relative_to(ROOT)}")
        for span in SPAN.findall(mechanism):
            for dotted in [span] if DOTTED.fullmatch(span) else PTDP_ATTRIBUTE.findall(span):
                if not exists(dotted):
                    problems.append(f"{dotted}: the library's code has no such name")
    return problems


def test_every_name_in_the_interception_table_exists():
    text = section(ARCHITECTURE.read_text(), "## 5. How we intercept the user's model")
    assert interception_problems(text) == []


def test_the_interception_check_fails_on_a_name_that_is_gone():
    header = "| mechanism | where | why | lifetime |\n|---|---|---|---|\n"
    gone = header + "| torchmetrics states copied | `pipeline/engine.py` `_apply_metric_states` | why | each step |\n"
    assert interception_problems(gone) == ["_apply_metric_states: not defined in lightning_ptdp/pipeline/engine.py"]
    moved = header + "| `module.__dict__['_ptdp_nothing']` | `pipeline/nowhere.py` | why | whole run |\n"
    assert interception_problems(moved) == [
        "pipeline/nowhere.py: no such file (write it from lightning_ptdp/ or the repository root)",
        "_ptdp_nothing: the library's code has no such name",
    ]


def test_every_ptdp_attribute_the_library_uses_is_in_section_5():
    """Each ``_ptdp_<name>`` the library sets on (or reads from) an object it was handed is listed."""
    text = section(ARCHITECTURE.read_text(), "## 5. How we intercept the user's model")
    used = {name for name in code_names() if PTDP_ATTRIBUTE.fullmatch(name)}
    assert {"_ptdp_tp", "_ptdp_cp", "_ptdp_ep", "_ptdp_fsdp_root", "_ptdp_state_dict_hooks"} <= used
    assert sorted(name for name in used if f"`{name}`" not in text and f'"{name}"' not in text) == []


def public_api() -> dict[str, str]:
    """Public API table: module -> what it lists."""
    text = section(ARCHITECTURE.read_text(), "## Public API")
    return {row[0].strip("`"): row[1] for row in table_rows(text)}


def shown_imports(text: str) -> set[tuple[str, str]]:
    """(module, name) of every ``lightning_ptdp`` import in the fenced Python blocks of ``text``, and of
    every call written inline as ``lightning_ptdp.module.function(...)``."""
    found = set()
    for block in re.findall(r"```python\n(.*?)```", text, flags=re.S):
        for node in ast.walk(ast.parse(block)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "lightning_ptdp":
                found.update((node.module, alias.name) for alias in node.names)
    for module, name in re.findall(r"`(lightning_ptdp(?:\.\w+)*)\.(\w+)\(", text):
        found.add((module, name))
    return found


def test_the_public_api_lists_every_import_the_user_docs_show():
    listed = public_api()
    shown = set().union(*(shown_imports(path.read_text()) for path in USER_DOCS))
    assert ("lightning_ptdp.parallel.init", "initialize") in shown
    missing = sorted(f"{m}.{n}" for m, n in shown if m not in listed or f"`{n}`" not in listed[m])
    assert missing == [], "list these in docs/architecture.md's Public API table, or stop showing them"
    for module, name in shown:
        assert hasattr(importlib.import_module(module), name), f"the docs show {module}.{name}, which is gone"
