"""docs/ARCHITECTURE.md's tree is the import rule: `sidecar/` holds one
package per layer, every module is listed under its layer, a module imports
only its own package or a lower one, and no import cycle exists. Names say
what they hold, sizes stay within the style guide's, and every module says
what it owns and what it must not touch."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "sidecar"
DOC = ROOT / "docs" / "ARCHITECTURE.md"
# `### core: layer 0` opens a layer; `- `name`: ...` lists a module in it.
LAYER = re.compile(r"^### `(\w+)/`: layer (\d+)")
ENTRY = re.compile(r"^- `(\w+)`")
# `- `module.function`: why` under "Long functions" excuses one function.
EXCUSED = re.compile(r"^- `([\w.]+)`: ")
# The style guide: split a module before it passes ~600 lines; no class near
# the size of a module; a function that needs more than a screen is doing
# several things (the anchors have four each over this).
MAX_MODULE_LINES = 600
MAX_CLASS_LINES = 400
MAX_FUNCTION_LINES = 60
# What may sit at sidecar/'s top beside the layer packages.
TOP = {"__init__.py", "__main__.py", "_proto", "py.typed", "__pycache__"}
# Endings that make two names one noun: an inflection or a layer's suffix.
SUFFIXES = ("_store", "_stream", "_log", "ing", "ure", "es", "s")


def tree() -> dict[str, tuple[int, list[str]]]:
    """Layer package -> (its rank, the modules the doc lists under it)."""
    found: dict[str, tuple[int, list[str]]] = {}
    current: list[str] | None = None
    for line in DOC.read_text().splitlines():
        if heading := LAYER.match(line):
            current = []
            found[heading.group(1)] = (int(heading.group(2)), current)
        elif line.startswith("#"):
            current = None
        elif current is not None and (entry := ENTRY.match(line)):
            current.append(entry.group(1))
    return found


def rank() -> dict[str, int]:
    return {package: layer for package, (layer, _) in tree().items()}


def modules() -> dict[str, Path]:
    """Dotted name under sidecar (`domain.engine`, `__main__`) -> file."""
    found: dict[str, Path] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts[0] == "_proto":
            continue
        found[".".join(parts)] = path
    return found


def package_of(module: str) -> str:
    """The layer package a module is in; '' for the top of sidecar/."""
    return module.split(".")[0] if "." in module else ""


def imports(module: str, path: Path, names: set[str]) -> set[str]:
    """The sidecar modules a module imports, at any depth of its code (a
    function-level import counts as much as a top-level one). Importing a
    package's module through the package (`from sidecar.storage import
    store`) counts as importing that module."""
    found: set[str] = set()

    def add(dotted: str) -> None:
        if dotted in names:
            found.add(dotted)

    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            parts = node.module.split(".")
            if parts[0] != "sidecar" or parts[1:2] == ["_proto"]:
                continue
            base = ".".join(parts[1:])
            add(base)
            for alias in node.names:
                add(f"{base}.{alias.name}" if base else alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name.removeprefix("sidecar."))
    return found - {module}


def graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imports(name, path, set(found)) for name, path in found.items()}


def functions(
    tree_: ast.AST, prefix: str = ""
) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    for node in ast.iter_child_nodes(tree_):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield prefix + node.name, node
            yield from functions(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            yield from functions(node, f"{prefix}{node.name}.")


def stem(name: str) -> str:
    name = name.strip("_")
    for suffix in SUFFIXES:
        if name.endswith(suffix) and len(name) > len(suffix) + 2:
            return name[: -len(suffix)]
    return name


def test_sidecar_shows_only_the_layer_packages() -> None:
    entries = {path.name for path in PACKAGE.iterdir()}
    packages = set(tree())
    assert sorted(entries - TOP - packages) == [], "sidecar/ holds more than its layers"
    assert sorted(packages - entries) == [], "docs/ARCHITECTURE.md names missing packages"
    for package in packages:
        assert (PACKAGE / package / "__init__.py").is_file()
        assert not [
            p for p in (PACKAGE / package).iterdir() if p.is_dir() and p.name != "__pycache__"
        ]


def test_every_module_is_listed_under_its_layer() -> None:
    listed = {f"{package}.{name}" for package, (_, names) in tree().items() for name in names}
    present = {name for name in modules() if "." in name and not name.endswith("__init__")}
    assert sorted(present - listed) == [], "add these modules to docs/ARCHITECTURE.md"
    assert sorted(listed - present) == [], "docs/ARCHITECTURE.md lists modules that are gone"


def test_the_layers_are_ranked_bottom_up_once_each() -> None:
    ranks = sorted(rank().values())
    assert ranks == list(range(len(ranks)))


def test_no_module_imports_a_higher_layer() -> None:
    layer = rank()
    # The top of sidecar/ (__init__, __main__) sits above every layer.
    top = len(layer)
    upward = [
        f"{module} imports {target}"
        for module, targets in graph().items()
        for target in sorted(targets)
        if layer.get(package_of(target), top) > layer.get(package_of(module), top)
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
    assert "storage.store" in edges["domain.rooms"]
    assert "domain.engine" in edges["api.service"]
    assert "storage.archive" in edges["api.export"]  # `from sidecar.storage import archive`


def test_no_two_modules_of_a_package_are_one_noun() -> None:
    by_package: dict[str, dict[str, list[str]]] = {}
    for module in modules():
        if "." in module and not module.endswith("__init__"):
            package, name = module.split(".")
            by_package.setdefault(package, {}).setdefault(stem(name), []).append(name)
    pairs = [
        f"{package}: {', '.join(names)}"
        for package, stems in by_package.items()
        for names in stems.values()
        if len(names) > 1
    ]
    assert pairs == []


def test_the_noun_check_sees_a_pair() -> None:
    assert stem("erasing") == stem("erasure") == stem("_erasure")
    assert stem("watches") == stem("watching") == stem("watch")
    assert stem("expiry_store") == stem("expiry")
    assert stem("export_stream") == stem("exports")
    assert stem("partitions") == stem("partition")
    assert stem("store") != stem("index")


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


def excused_functions() -> set[str]:
    text = DOC.read_text().split("## Long functions", 1)[1].split("\n## ", 1)[0]
    return {m.group(1) for line in text.splitlines() if (m := EXCUSED.match(line))}


def test_functions_fit_a_screen_unless_the_doc_says_why() -> None:
    long: set[str] = set()
    for name, path in modules().items():
        for qualified, node in functions(ast.parse(path.read_text())):
            assert node.end_lineno is not None
            if node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES:
                long.add(f"{name}.{qualified}")
    excused = excused_functions()
    assert sorted(long - excused) == [], "split these, or say why in docs/ARCHITECTURE.md"
    assert sorted(excused - long) == [], "docs/ARCHITECTURE.md excuses functions now short"


def test_no_line_is_joined_to_fit_a_size() -> None:
    # `# fmt: skip` on a call folded onto a few lines keeps the formatter
    # from spreading it: a way to pass the size check without splitting.
    joined = [
        f"{name}:{number}"
        for name, path in modules().items()
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if "fmt: skip" in line or "fmt: off" in line
    ]
    assert joined == []


def test_every_module_says_what_it_owns_and_must_not_touch() -> None:
    silent = [
        name
        for name, path in modules().items()
        # Words joined as a paragraph reads them: a phrase may wrap.
        if not all(
            word in " ".join((ast.get_docstring(ast.parse(path.read_text())) or "").split())
            for word in ("Owns", "Must not touch")
        )
    ]
    assert silent == []
