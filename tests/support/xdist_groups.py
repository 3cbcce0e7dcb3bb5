"""`make test` on two pytest-xdist workers, a group of modules at a time (docs/testing.md).

Every module that uses the shared vLLM servers (``vllm_server``, ``teacher_server``, directly or
through another fixture) is in one group, run in order on one worker: one pair of servers is
started, and no two tests change their adapters at once. A module on the servers marked
``pytest.mark.xdist_group(NAME)`` (pytest-xdist's marker) is in a server group of its own instead,
``vllm-servers-NAME``, whose worker starts a server of its own: the real agents' long runs beside
the rest of the server tests, on a third worker. Every other module is a group of its own, run
whole on whichever worker is free, so its module-scoped fixtures are made once, unless it is marked
``xdist_group(NAME)`` too: then the modules so marked run one after another on one worker (the
modules that start vLLM servers of their own, so that no two of them hold memory at once). The
server groups and the marked groups, the longest, are handed out first, so that no worker is left
with one of them at the end.

Which fixtures a test uses is known only once the workers have collected, and the scheduling runs
in the controller, which does not collect: each worker writes the module-to-group map to the file
named by ``NEXTSTATE_TEST_GROUPS`` (set by the controller before the workers start, so they
inherit it), and the controller's scheduler reads it when it splits the collection into scopes.
(pytest-xdist's own ``--dist loadgroup`` suffixes node ids in a way pytest 9.2 no longer honours,
so every test became its own scope.)

A pytest plugin: ``tests/conftest.py`` registers this module (``register``).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

SERVER_FIXTURES = {"vllm_server", "teacher_server"}
SERVER_GROUP = "vllm-servers"
ENV = "NEXTSTATE_TEST_GROUPS"


def register(config: pytest.Config) -> None:
    """Make this module a plugin of *config* (from a conftest's ``pytest_configure``: that hook is
    historic, so this module's own ``pytest_configure`` runs at once)."""
    config.pluginmanager.register(sys.modules[__name__], "nextstate-xdist-groups")


def module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def _own_group(item: pytest.Item) -> str | None:
    marker = item.get_closest_marker("xdist_group")
    if marker is None:
        return None
    return str(marker.args[0] if marker.args else marker.kwargs.get("name", "default"))


def groups(items: list[pytest.Item]) -> dict[str, str]:
    """module path -> its group: SERVER_GROUP (or SERVER_GROUP-NAME for a module marked
    ``xdist_group(NAME)``) for a module with any test on the servers; else NAME for a marked
    module, or the module itself."""
    modules = {module_of(item.nodeid) for item in items}
    on_servers: dict[str, str] = {}
    marked: dict[str, str] = {}
    for item in items:
        own = _own_group(item)
        if set(getattr(item, "fixturenames", ())) & SERVER_FIXTURES:
            on_servers[module_of(item.nodeid)] = f"{SERVER_GROUP}-{own}" if own else SERVER_GROUP
        elif own:
            marked[module_of(item.nodeid)] = own
    return {m: on_servers.get(m) or marked.get(m) or m for m in modules}


def group_uses(items: list[pytest.Item], item: pytest.Item, fixture: str) -> bool:
    """Whether a test in *item*'s group (every test, in a run without groups) uses *fixture*:
    a worker starts the teacher ahead only for a group that will take it."""
    if not os.environ.get(ENV):
        return any(fixture in getattr(i, "fixturenames", ()) for i in items)
    by_module = groups(items)
    group = by_module[module_of(item.nodeid)]
    return any(fixture in getattr(i, "fixturenames", ()) and by_module[module_of(i.nodeid)] == group
               for i in items)


def is_grouped_run(config: pytest.Config) -> bool:
    return getattr(config.option, "dist", "no") == "loadgroup" and bool(getattr(config.option, "numprocesses", 0))


def pytest_configure(config: pytest.Config) -> None:
    """In the controller of a grouped run: name the file the workers write the groups to."""
    if is_grouped_run(config) and not hasattr(config, "workerinput"):
        os.environ[ENV] = str(Path(tempfile.mkdtemp(prefix="nextstate-test-groups-")) / "groups.json")


def pytest_unconfigure(config: pytest.Config) -> None:
    path = os.environ.pop(ENV, None) if not hasattr(config, "workerinput") else None
    if path:
        shutil.rmtree(Path(path).parent, ignore_errors=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In a worker of a grouped run: write the groups (each worker collects the same tests)."""
    path = os.environ.get(ENV)
    if path and hasattr(config, "workerinput"):
        tmp = Path(f"{path}.{config.workerinput['workerid']}")
        tmp.write_text(json.dumps(groups(items)))
        tmp.replace(path)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: absent without it
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if not is_grouped_run(config):
        return None
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        """LoadScope with a module's group as its scope (the module when the map lacks it); the
        server and marked groups, the longest, are handed out before any other."""

        _groups: dict[str, str] | None = None

        def _assign_work_unit(self, node: Any) -> None:
            # a scope that is not a module's path is a group (groups())
            for scope in [s for s in self.workqueue if not s.endswith(".py")][::-1]:
                self.workqueue.move_to_end(scope, last=False)
            super()._assign_work_unit(node)

        def _split_scope(self, nodeid: str) -> str:
            if self._groups is None:
                path = os.environ.get(ENV)
                self._groups = json.loads(Path(path).read_text()) if path and Path(path).exists() else {}
            module = module_of(nodeid)
            return self._groups.get(module, module)

    return GroupScheduling(config, log)
