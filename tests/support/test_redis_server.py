"""Tests for the Redis test helpers in ``tests/support/redis_server.py``."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.support.redis_server import (
    REDIS_SERVER_ENV,
    SERVICE_URL_ENV,
    ThrowawayRedis,
    find_redis_server,
    redis_unavailable_reason,
    service_redis_url,
    unique_queue,
)

_UNAVAILABLE = redis_unavailable_reason()
needs_throwaway = pytest.mark.skipif(
    _UNAVAILABLE is not None, reason=f"cannot run a throwaway Redis: {_UNAVAILABLE}"
)


def _client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=1)


@pytest.fixture
def server() -> Iterator[ThrowawayRedis]:
    with ThrowawayRedis() as srv:
        yield srv


# --------------------------------------------------------------------------
# Pure helpers and configuration
# --------------------------------------------------------------------------


def test_unique_queue() -> None:
    names = {unique_queue() for _ in range(100)}
    assert len(names) == 100
    assert all(n.startswith("nextstate-test-") for n in names)
    assert unique_queue("jobs").startswith("jobs-")


def test_service_url_honours_env(monkeypatch: pytest.MonkeyPatch) -> None:
    url = "redis://example.invalid:1/3"
    monkeypatch.setenv(SERVICE_URL_ENV, url)
    assert service_redis_url() == url


def test_bad_server_env_fails_loudly(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(REDIS_SERVER_ENV, str(tmp_path / "no-such-redis-server"))
    with pytest.raises(ValueError, match=REDIS_SERVER_ENV):
        find_redis_server()
    reason = redis_unavailable_reason()
    assert reason is not None and REDIS_SERVER_ENV in reason


def test_missing_binary_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(REDIS_SERVER_ENV, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert find_redis_server() is None
    reason = redis_unavailable_reason()
    assert reason is not None and "redis-server" in reason
    with pytest.raises(FileNotFoundError, match="redis-server"):
        ThrowawayRedis()


@needs_throwaway
def test_server_env_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    real = find_redis_server()
    assert real is not None
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setenv(REDIS_SERVER_ENV, real)
    assert find_redis_server() == real
    assert redis_unavailable_reason() is None
    with ThrowawayRedis() as srv:
        assert srv.binary == real
        assert _client(srv.url).ping()


# --------------------------------------------------------------------------
# Throwaway server
# --------------------------------------------------------------------------


@needs_throwaway
def test_set_get_and_no_persistence(server: ThrowawayRedis) -> None:
    assert server.running
    assert server.url == f"redis://127.0.0.1:{server.port}/0"
    client = _client(server.url)
    client.set("greeting", "hello")
    assert client.get("greeting") == b"hello"
    assert client.config_get("save") == {"save": ""}
    assert client.config_get("appendonly") == {"appendonly": "no"}
    assert server.base_dir is not None
    assert Path(str(client.config_get("dir")["dir"])).resolve() == server.base_dir.resolve()
    assert client.config_get("bind")["bind"] == "127.0.0.1"
    client.close()


@needs_throwaway
def test_kill_refuses_connections_and_start_comes_back_empty(server: ThrowawayRedis) -> None:
    port = server.port
    client = _client(server.url)
    client.set("k", "v")

    server.kill()

    assert not server.running
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    with pytest.raises(redis.ConnectionError):
        client.get("k")
    with pytest.raises(redis.ConnectionError, match="refused"):
        _client(server.url).ping()
    server.kill()  # idempotent

    server.start()  # same port, nothing persisted
    assert server.port == port and server.running
    assert client.get("k") is None  # redis-py reconnects on its own
    assert server.log_file is not None and server.log_file.exists()
    client.close()


@needs_throwaway
def test_stop_removes_directory_and_is_idempotent() -> None:
    srv = ThrowawayRedis()
    assert not srv.running and srv.log_file is None
    srv.start()
    srv.start()  # no-op while running
    base_dir = srv.base_dir
    assert base_dir is not None and base_dir.is_dir()
    srv.stop()
    assert not srv.running
    assert not base_dir.exists()
    with pytest.raises(redis.ConnectionError):
        _client(srv.url).ping()
    srv.stop()
    srv.kill()

    with srv:  # usable again after stop
        assert _client(srv.url).ping()
    assert not srv.running


@needs_throwaway
def test_taken_port() -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen(1)
        taken = squatter.getsockname()[1]

        # An explicit port that is taken: a clear error with redis-server's log.
        failed = ThrowawayRedis(port=taken)
        with pytest.raises(RuntimeError, match="Address already in use"):
            failed.start()
        assert not failed.running and failed.base_dir is None  # nothing left behind

        # An auto-chosen port taken before start(): another one is picked.
        srv = ThrowawayRedis()
        srv.port = taken
        with srv:
            assert srv.port != taken
            assert _client(srv.url).ping()


@needs_throwaway
def test_two_servers_side_by_side() -> None:
    with ThrowawayRedis() as a, ThrowawayRedis() as b:
        assert a.port != b.port
        _client(a.url).set("who", "a")
        a.kill()
        assert _client(b.url).get("who") is None
        assert _client(b.url).ping()


# --------------------------------------------------------------------------
# Service
# --------------------------------------------------------------------------


def test_service_round_trip() -> None:
    url = service_redis_url()
    if url is None:
        pytest.skip(f"no Redis service: set {SERVICE_URL_ENV} or run one on 127.0.0.1:6379")
    client = _client(url)
    key = unique_queue("nextstate-test-key")
    try:
        client.set(key, "v", ex=60)
        assert client.get(key) == b"v"
    finally:
        client.delete(key)
        client.close()
