"""Tests for the PostgreSQL test helpers in ``tests/support/pg.py``."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.support.pg import (
    PG_BIN_ENV,
    SERVICE_URL_ENV,
    ThrowawayPostgres,
    find_pg_bin,
    fresh_database,
    service_dsn,
    throwaway_unavailable_reason,
    to_conninfo,
    with_database,
)

_UNAVAILABLE = throwaway_unavailable_reason()
needs_throwaway = pytest.mark.skipif(
    _UNAVAILABLE is not None, reason=f"cannot run a throwaway PostgreSQL: {_UNAVAILABLE}"
)


def _connect(dsn: str, autocommit: bool = False) -> psycopg.Connection[tuple[Any, ...]]:
    return psycopg.connect(to_conninfo(dsn), connect_timeout=2, autocommit=autocommit)


def _database_exists(admin_dsn: str, name: str) -> bool:
    with _connect(admin_dsn) as conn:
        row = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone()
    return row is not None


def _dbname(dsn: str) -> str:
    return dsn.rsplit("/", 1)[1].split("?", 1)[0]


@pytest.fixture
def cluster() -> Iterator[ThrowawayPostgres]:
    """A started throwaway cluster, destroyed afterwards."""
    with ThrowawayPostgres() as pg:
        yield pg


# --------------------------------------------------------------------------
# Pure helpers
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dsn", "expected"),
    [
        (
            "postgresql+psycopg://postgres@127.0.0.1:5432/postgres",
            "postgresql://postgres@127.0.0.1:5432/postgres",
        ),
        (
            "postgresql+psycopg2://u:p%40ss@db.example:6543/app?sslmode=require",
            "postgresql://u:p%40ss@db.example:6543/app?sslmode=require",
        ),
        ("postgres://u@h/d", "postgresql://u@h/d"),
        ("host=127.0.0.1 dbname=x", "host=127.0.0.1 dbname=x"),
    ],
)
def test_to_conninfo(dsn: str, expected: str) -> None:
    assert to_conninfo(dsn) == expected


def test_with_database_keeps_everything_but_the_name() -> None:
    dsn = "postgresql+psycopg://u:pw@h:1234/old?sslmode=disable"
    assert with_database(dsn, "new_db") == "postgresql+psycopg://u:pw@h:1234/new_db?sslmode=disable"


def test_find_pg_bin_honours_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(PG_BIN_ENV, str(tmp_path))
    with pytest.raises(ValueError, match=PG_BIN_ENV):
        find_pg_bin()

    monkeypatch.delenv(PG_BIN_ENV)
    real = find_pg_bin()
    if real is None:
        pytest.skip("no PostgreSQL binaries on this machine")
    monkeypatch.setenv(PG_BIN_ENV, str(real))
    assert find_pg_bin() == real
    assert (real / "initdb").exists() and (real / "pg_ctl").exists()


def test_service_dsn_honours_env(monkeypatch: pytest.MonkeyPatch) -> None:
    url = "postgresql+psycopg://someone@example.invalid:1/db"
    monkeypatch.setenv(SERVICE_URL_ENV, url)
    assert service_dsn() == url


# --------------------------------------------------------------------------
# Throwaway cluster
# --------------------------------------------------------------------------


@needs_throwaway
def test_committed_data_survives_kill_and_restart() -> None:
    pg = ThrowawayPostgres()
    try:
        pg.start()
        assert pg.running
        assert pg.dsn == f"postgresql+psycopg://postgres@127.0.0.1:{pg.port}/postgres"
        with _connect(pg.dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE survivors (id int PRIMARY KEY, note text)")
            conn.execute("INSERT INTO survivors VALUES (1, 'committed')")

        # A transaction still open at crash time must be rolled back by recovery.
        in_flight = _connect(pg.dsn)
        in_flight.execute("INSERT INTO survivors VALUES (2, 'uncommitted')")

        port = pg.port
        pg.kill()

        assert not pg.running
        # Like a real crash, the lock file is left behind.
        assert (pg.data_dir / "postmaster.pid").exists()
        with pytest.raises(psycopg.OperationalError):
            _connect(pg.dsn).close()
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        with pytest.raises(psycopg.OperationalError):
            in_flight.execute("SELECT 1")
        in_flight.close()

        pg.restart()

        assert pg.port == port
        with _connect(pg.dsn) as conn:
            rows = conn.execute("SELECT id, note FROM survivors ORDER BY id").fetchall()
        assert rows == [(1, "committed")]
        log = pg.log_file.read_text()
        assert "automatic recovery in progress" in log

        base_dir = pg.base_dir
        assert base_dir.is_dir()
    finally:
        pg.destroy()
    assert not base_dir.exists()
    assert not pg.running


@needs_throwaway
def test_stop_and_restart_keep_data(cluster: ThrowawayPostgres) -> None:
    with _connect(cluster.dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE kept (x int)")
        conn.execute("INSERT INTO kept VALUES (42)")

    cluster.stop()
    assert not cluster.running
    assert not (cluster.data_dir / "postmaster.pid").exists()
    with pytest.raises(psycopg.OperationalError):
        _connect(cluster.dsn).close()
    cluster.stop()  # idempotent
    cluster.kill()  # nothing to kill

    cluster.restart()
    with _connect(cluster.dsn) as conn:
        assert conn.execute("SELECT x FROM kept").fetchall() == [(42,)]

    cluster.restart()  # restart while running = stop + start
    assert cluster.running


@needs_throwaway
def test_unix_socket_and_settings(cluster: ThrowawayPostgres) -> None:
    conninfo = f"host={cluster.socket_dir} port={cluster.port} user=postgres dbname=postgres"
    with psycopg.connect(conninfo) as conn:
        assert conn.execute("SHOW fsync").fetchone() == ("off",)
        assert conn.execute("SHOW synchronous_commit").fetchone() == ("on",)
        assert conn.execute("SHOW server_encoding").fetchone() == ("UTF8",)
        assert conn.execute("SELECT current_user").fetchone() == ("postgres",)


@needs_throwaway
def test_create_database(cluster: ThrowawayPostgres) -> None:
    dsn = cluster.create_database("app_db")
    assert dsn == f"postgresql+psycopg://postgres@127.0.0.1:{cluster.port}/app_db"
    with _connect(dsn) as conn:
        assert conn.execute("SELECT current_database()").fetchone() == ("app_db",)


@needs_throwaway
def test_context_manager_destroys() -> None:
    with ThrowawayPostgres() as pg:
        assert pg.running
        base_dir = pg.base_dir
    assert not base_dir.exists()
    assert not pg.running
    pg.destroy()  # idempotent


@needs_throwaway
def test_two_clusters_side_by_side() -> None:
    with ThrowawayPostgres() as a, ThrowawayPostgres() as b:
        assert a.port != b.port
        a.kill()
        with _connect(b.dsn) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)


# --------------------------------------------------------------------------
# fresh_database
# --------------------------------------------------------------------------


def _check_fresh_database(admin_dsn: str) -> None:
    dsn, drop = fresh_database(admin_dsn)
    name = _dbname(dsn)
    assert name.startswith("nextstate_test_")
    assert _database_exists(admin_dsn, name)

    # An open connection must not prevent the drop.
    lingering = _connect(dsn, autocommit=True)
    lingering.execute("CREATE TABLE t (x int)")
    try:
        drop()
    finally:
        lingering.close()
    assert not _database_exists(admin_dsn, name)
    drop()  # idempotent

    other, drop_other = fresh_database(admin_dsn, prefix="custom")
    try:
        assert _dbname(other).startswith("custom_")
        assert _dbname(other) != name
        # a copy of a template holds its tables and rows; writing to the copy leaves it alone
        with _connect(other, autocommit=True) as conn:
            conn.execute("CREATE TABLE t (x int)")
            conn.execute("INSERT INTO t VALUES (1), (2)")
        copy, drop_copy = fresh_database(admin_dsn, template=_dbname(other))
        try:
            with _connect(copy, autocommit=True) as conn:
                assert conn.execute("SELECT sum(x) FROM t").fetchone() == (3,)
                conn.execute("INSERT INTO t VALUES (4)")
            with _connect(other) as conn:
                assert conn.execute("SELECT sum(x) FROM t").fetchone() == (3,)
        finally:
            drop_copy()
    finally:
        drop_other()


def test_fresh_database_on_service() -> None:
    admin = service_dsn()
    if admin is None:
        pytest.skip(
            f"no PostgreSQL service: set {SERVICE_URL_ENV} or run one on 127.0.0.1:5432 "
            "with trust auth for user postgres"
        )
    _check_fresh_database(admin)


@needs_throwaway
def test_fresh_database_on_throwaway(cluster: ThrowawayPostgres) -> None:
    _check_fresh_database(cluster.dsn)
