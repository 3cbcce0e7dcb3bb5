"""The house's layers (docs/architecture.md): the import-linter contracts in pyproject.toml hold,
and the module import graph has no cycle, counting imports inside functions too."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("nextstate", "gateway", "trainer", "datapool")


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
    assert "gateway.routes.openai" in graph.modules and "datapool.scoring.worker" in graph.modules
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


def test_every_pool_module_is_in_a_layer() -> None:
    """A new module under datapool/ must be placed in the contract, or no rule would cover it."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"][0]
    named = {m.strip() for layer in config["layers"] for part in layer.split("|") for m in part.split(":")}
    modules = {f"datapool.{p.stem}" for p in (ROOT / "datapool").glob("*.py") if p.stem != "__init__"}
    assert modules - named == set()
    assert "datapool.scoring" in named


def test_routers_never_import_the_app() -> None:
    graph = _graph()
    importers = graph.find_modules_that_directly_import("gateway.app")
    assert importers == {"nextstate.gateway_server"}  # only the server that serves it (gateway, up)


def test_nothing_that_serves_or_trains_imports_the_test_support() -> None:
    """nextstate.testing (PostgreSQL, Redis, processes, a fake upstream) is for tests/ and benchmarks/."""
    graph = _graph()
    assert "nextstate.testing.pg" in graph.modules
    assert graph.find_downstream_modules("nextstate.testing", as_package=True) == set()
