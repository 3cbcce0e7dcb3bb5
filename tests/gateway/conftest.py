"""Fixtures of the gateway tests that run one gateway process per module in front of the suite's
vLLM: on a SQLite pool, then on a PostgreSQL one (a module that needs another gateway defines
its own ``gateway``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.processes import GatewayProcess
from tests.support.vllm_servers import RunningVLLM


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def pool_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """An empty pool for the module's gateway (it migrates it), on each database in turn."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path_factory.mktemp('pool') / 'pool.db'}"
        return
    from tests.support.pg import fresh_database

    url, drop = fresh_database(request.getfixturevalue("pg_admin_dsn"))
    yield url
    drop()


@pytest.fixture(scope="module")
def gateway(pool_url: str, vllm_server: RunningVLLM, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[GatewayProcess]:
    """`nextstate gateway` on :func:`pool_url`, in front of the suite's vLLM."""
    with GatewayProcess(tmp_path_factory.mktemp("gw"), database_url=pool_url,
                        upstream_url=vllm_server.base_url) as gw:
        yield gw
