"""docs/ARCHITECTURE.md's table of rooms is the import rule: every module of
sidecar/ is in exactly one layer, imports only its own layer or lower ones,
and no import cycle exists. Sizes stay within the style guide's."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "sidecar"
ROW = re.compile(r"^\| (\d+) \| ([a-z ]+) \| (.+) \|$")
# The style guide: split a module before it passes ~600 lines; no class near
# the size of a module.
MAX_MODULE_LINES = 600
MAX_CLASS_LINES = 400


def layers() -> dict[str, int]:
    """Module -> layer, from the table in docs/ARCHITECTURE.md."""
    found: dict[str, int] = {}
    for line in (ROOT / "docs" / "ARCHITECTURE.md").read_text().splitlines():
        row = ROW.match(line)
        if row is None:
            continue
        for name in re.findall(r"`([\w]+)`", row.group(3)):
            assert name not in found, f"{name} is listed twice"
            found[name] = int(row.group(1))
    return found


def modules() -> dict[str, Path]:
    return {path.stem: path for path in sorted(PACKAGE.glob("*.py"))} | {
        "__main__": PACKAGE / "__main__.py"
    }


def imports(path: Path, names: set[str]) -> set[str]:
    """The sidecar modules a module imports, at any depth of its code (a
    function-level import counts as much as a top-level one)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            parts = node.module.split(".")
            if parts[0] != "sidecar":
                continue
            if len(parts) == 1:
                found.update(alias.name for alias in node.names if alias.name in names)
            elif parts[1] in names:
                found.add(parts[1])
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "sidecar" and len(parts) > 1 and parts[1] in names:
                    found.add(parts[1])
    return found - {path.stem}


def graph() -> dict[str, set[str]]:
    found = modules()
    names = set(found) - {"__init__"}
    return {name: imports(path, names) for name, path in found.items() if name != "__init__"}


def test_every_module_is_in_exactly_one_layer() -> None:
    listed = layers()
    present = set(modules()) - {"__init__"}
    assert sorted(present - set(listed)) == [], "add these modules to docs/ARCHITECTURE.md"
    assert sorted(set(listed) - present) == [], "docs/ARCHITECTURE.md lists modules that are gone"


def test_no_module_imports_a_higher_layer() -> None:
    layer = layers()
    upward = [
        f"{module} (layer {layer[module]}) imports {target} (layer {layer[target]})"
        for module, targets in graph().items()
        for target in sorted(targets)
        if layer[target] > layer[module]
    ]
    assert upward == []


def test_there_is_no_import_cycle() -> None:
    edges = graph()
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        if module in path:
            pytest.fail("import cycle: " + " -> ".join((*path[path.index(module) :], module)))
        if module in done:
            return
        for target in sorted(edges[module]):
            visit(target, (*path, module))
        done.add(module)

    for module in sorted(edges):
        visit(module, ())


def test_the_checks_see_a_real_import() -> None:
    # The checks above pass vacuously if parsing finds no edges.
    edges = graph()
    assert "store" in edges["engine"]
    assert "engine" in edges["service"]


def test_modules_and_classes_stay_within_the_style_guides_sizes() -> None:
    too_big: list[str] = []
    for name, path in modules().items():
        text = path.read_text()
        if len(text.splitlines()) > MAX_MODULE_LINES:
            too_big.append(f"{name}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                assert node.end_lineno is not None
                size = node.end_lineno - node.lineno + 1
                if size > MAX_CLASS_LINES:
                    too_big.append(f"{name}.{node.name}: {size} lines")
    assert too_big == []


def test_every_module_says_what_it_owns() -> None:
    silent = [
        name
        for name, path in modules().items()
        if name != "__main__" and not ast.get_docstring(ast.parse(path.read_text()))
    ]
    assert silent == []
