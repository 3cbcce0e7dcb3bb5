"""The house's layers (docs/architecture.md): the import-linter contracts in pyproject.toml hold,
and the module import graph has no cycle, counting imports inside functions too; the tests share
helpers through tests/support and fixtures through conftest.py, never by importing each other."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parent.parent
# the shipped packages, top to bottom (pyproject.toml's [tool.importlinter] root_packages)
PACKAGES = tuple(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["root_packages"])


def _graph() -> grimp.ImportGraph:
    # grimp reads every import statement, the ones inside functions ("deferred") included
    return grimp.build_graph(*PACKAGES, include_external_packages=False, cache_dir=None)


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected components of more than one module (and self-imports)."""
    edges = {m: graph.find_modules_directly_imported_by(m) for m in graph.modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in edges[v]:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(edges)))
    for module in sorted(edges):
        if module not in index:
            visit(module)
    return found


def test_import_contracts_hold() -> None:
    lint = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run([str(lint), "--config", str(ROOT / "pyproject.toml"), "--no-cache"], cwd=ROOT,
                            capture_output=True, text=True, timeout=300, env={"PYTHONPATH": str(ROOT), "PATH": ""})
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout


def test_no_import_cycles_deferred_imports_included() -> None:
    graph = _graph()
    assert "gateway.routes.openai" in graph.modules and "scoring.worker" in graph.modules
    assert _cycles(graph) == []


def test_cycle_finder_finds_a_cycle() -> None:
    # the check above could pass by finding nothing at all; on a graph with a cycle it must not
    graph = grimp.ImportGraph()
    for m in ("a", "a.x", "a.y", "a.z"):
        graph.add_module(m)
    graph.add_import(importer="a.x", imported="a.y")
    graph.add_import(importer="a.y", imported="a.x")
    graph.add_import(importer="a.z", imported="a.x")
    assert _cycles(graph) == [["a.x", "a.y"]]


def test_every_package_is_in_a_layer() -> None:
    """A new top-level package must be placed in the layers contract, or no rule would cover it;
    and every package that setuptools ships is one the contract knows."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]
    layers = config["importlinter"]["contracts"][0]["layers"]
    named = {m.strip().split(".")[0] for layer in layers for part in layer.split("|") for m in part.split(":")}
    assert named == set(PACKAGES)
    shipped = {pattern.rstrip("*") for pattern in config["setuptools"]["packages"]["find"]["include"]}
    assert shipped - {"migrations"} == set(PACKAGES)
    on_disk = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests", "migrations", "benchmarks", "examples"}
    assert on_disk == set(PACKAGES)


def test_routers_never_import_the_app() -> None:
    graph = _graph()
    importers = graph.find_modules_that_directly_import("gateway.app")
    assert importers == {"nextstate.gateway_server"}  # only the server that serves it (gateway, up)


def test_nothing_shipped_imports_the_tests() -> None:
    """tests.support (PostgreSQL, Redis, processes, a fake upstream) is for tests/ and benchmarks/
    and is not installed: no shipped module may import anything under tests/."""
    graph = grimp.build_graph(*PACKAGES, "tests", include_external_packages=False, cache_dir=None)
    assert "tests.support.pg" in graph.modules
    importers = graph.find_downstream_modules("tests", as_package=True)
    assert {m for m in importers if not m.startswith("tests.")} == set()


# a module named in a string: `python -c "from tests.x.test_y import f"`, a `tests.x.test_y:f` spec
_TEST_MODULE_NAMED = re.compile(r"\btests(?:\.\w+)*\.(?:test_\w+|conftest)\b")


def _is_test_module(module: str) -> bool:
    last = module.rsplit(".", 1)[-1]
    return last.startswith("test_") or last == "conftest"


def _imported(path: Path, tree: ast.AST) -> Iterator[str]:
    """Every module *path* imports, anywhere in it (in functions too), and every `from m import x`
    as m.x as well (x may be a module)."""
    package = list(path.relative_to(ROOT).parent.parts)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join([*package[:len(package) - node.level + 1], *([node.module] if node.module else [])]) \
                if node.level else node.module or ""
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


def test_no_test_module_imports_a_test_module_or_a_conftest() -> None:
    """What tests share lives in tests/support (plain helpers, data) or in a conftest.py (fixtures,
    which pytest hands over without an import); a test module is pytest's to collect, not another
    module's to import (an import runs its module-level code again, under another name)."""
    found: set[str] = set()
    for folder in ("tests", "benchmarks"):
        for path in (ROOT / folder).rglob("*.py"):
            if path == Path(__file__).resolve():
                continue  # the check's own examples below
            tree = ast.parse(path.read_text(), str(path))
            where = path.relative_to(ROOT)
            found |= {f"{where} imports {m}" for m in _imported(path, tree)
                      if m.startswith("tests.") and _is_test_module(m)}
            found |= {f"{where} names {m.group(0)}" for node in ast.walk(tree)
                      if isinstance(node, ast.Constant) and isinstance(node.value, str)
                      for m in _TEST_MODULE_NAMED.finditer(node.value)}
    assert sorted(found) == []


def test_the_check_finds_a_test_module_imported_or_named() -> None:
    source = ("from tests.gateway.ui.test_ui import login\nfrom tests.gateway.ui import test_ui\n"
              "def f():\n    import tests.conftest\n    return 'from tests.gateway.test_policy_push import g'\n")
    path = ROOT / "tests" / "gateway" / "x.py"
    tree = ast.parse(source)
    assert {m for m in _imported(path, tree) if _is_test_module(m)} == {
        "tests.gateway.ui.test_ui", "tests.conftest"}
    assert _TEST_MODULE_NAMED.findall(source.split("return")[1]) == ["tests.gateway.test_policy_push"]
