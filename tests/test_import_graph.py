"""The import graph of ``kvtier`` (engine/) and ``kvtier.io`` (io/): acyclic, one way.

Every module under ``engine/`` and ``io/`` is parsed with :mod:`ast`; every
``import`` and ``from ... import`` counts, wherever it stands: at module level,
inside a function (a lazy import) or under ``if TYPE_CHECKING:``. An edge goes
from a module to the module it names (``from kvtier.io import _files`` names
``kvtier.io._files``; ``from kvtier.io import NVMeTier`` names ``kvtier.io``).
The implicit import of a parent package is not an edge (as in import-linter's
graph), else every package ``__init__`` that re-exports would close a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# source folder -> import name (setup.cfg package_dir)
PACKAGES = {"engine": "kvtier", "io": "kvtier.io"}

# Cycles that exist on purpose and are accepted, as sorted tuples of module names.
KNOWN_CYCLES: frozenset[tuple[str, ...]] = frozenset()


def _module_name(path: Path) -> str:
    folder, *parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join([PACKAGES[folder], *parts])


def _modules() -> dict[str, Path]:
    found = {}
    for folder in PACKAGES:
        for path in sorted((ROOT / folder).rglob("*.py")):
            found[_module_name(path)] = path
    return found


def _resolve(module: str, level: int, importer: str, is_package: bool) -> str:
    """The absolute name of a (possibly relative) ``from`` import's module."""
    if level == 0:
        return module
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, module] if module else base)


def _graph() -> dict[str, set[str]]:
    """Module -> the kvtier modules it imports (any place in its source)."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(node.module or "", node.level, name, is_package)
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.append(sub if sub in modules else base)
            for target in targets:
                # ``import kvtier.io._files`` names its deepest known module
                while target not in modules and "." in target:
                    target = target.rsplit(".", 1)[0]
                if target in modules and target != name:
                    graph[name].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[tuple[str, ...]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[tuple[str, ...]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph[node]):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                components.append(tuple(sorted(component)))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(components)


def _is_engine_private(module: str) -> bool:
    """An engine module (not under kvtier.io) whose own or a parent's name starts with ``_``."""
    parts = module.split(".")
    return parts[:2] != ["kvtier", "io"] and any(part.startswith("_") for part in parts[1:])


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    """The import graph of engine/ and io/."""
    return _graph()


def test_graph_covers_both_packages(graph: dict[str, set[str]]) -> None:
    """The graph holds every module of both packages, and the imports between them."""
    assert "kvtier" in graph
    assert "kvtier.io" in graph
    assert "kvtier.io._tier" in graph
    assert "kvtier.errors" in graph["kvtier.io._tier"]
    assert "kvtier.bench.config" in graph["kvtier.bench.preflight"]  # a subpackage's modules
    edges = sum(len(targets) for targets in graph.values())
    print(f"import graph: {len(graph)} modules, {edges} edges")
    assert edges > len(graph)


def test_cycle_finder_finds_a_cycle() -> None:
    """The cycle finder reports a two-module and a three-module cycle, not a chain."""
    graph = {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c"}, "f": {"a"}}
    assert _cycles(graph) == [("a", "b"), ("c", "d", "e")]


def test_import_graph_has_no_cycles(graph: dict[str, set[str]]) -> None:
    """No module imports, even lazily or for type checking, one that imports it back."""
    assert set(_cycles(graph)) == set(KNOWN_CYCLES)


def test_io_imports_no_engine_private_module(graph: dict[str, set[str]]) -> None:
    """``kvtier.io`` depends on the engine only through public modules (keys, errors)."""
    offending = {
        module: sorted(t for t in targets if _is_engine_private(t))
        for module, targets in graph.items()
        if module.startswith("kvtier.io")
    }
    assert {module: targets for module, targets in offending.items() if targets} == {}
