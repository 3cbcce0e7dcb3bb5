"""Gateways and the pool: black-box capture, replicas sharing PostgreSQL, the database going away."""

from __future__ import annotations

import threading
import uuid
from pathlib import Path
from typing import Any

import httpx
import yaml
from openai import OpenAI
from sqlalchemy import text

from datapool.db import make_engine
from tests.support.vllm_servers import RunningVLLM
from tests.support.pg import ThrowawayPostgres
from tests.support.processes import GatewayProcess, wait_for


def _client(gw: GatewayProcess) -> OpenAI:
    return OpenAI(base_url=gw.base_url, api_key="unused", max_retries=0, timeout=120)


def test_black_box_capture_stores_text_only(vllm_server: RunningVLLM, tmp_path: Path) -> None:
    """An opaque provider (LiteLLM `openai/...`, here pointed at vLLM's OpenAI-compatible server)."""
    model_list = tmp_path / "models.yaml"
    model_list.write_text(yaml.safe_dump({"model_list": [
        {"model_name": "provider-model", "litellm_params": {
            "model": "openai/smollm2", "api_base": vllm_server.base_url,
            "api_key": "os.environ/TEST_PROVIDER_KEY"}},
    ]}))
    with GatewayProcess(tmp_path, database_url=f"sqlite:///{tmp_path / 'pool.db'}", model_list=model_list,
                        env={"TEST_PROVIDER_KEY": "sk-provider-secret-77"}) as gw:
        messages = [{"role": "user", "content": f"Say hello. {uuid.uuid4().hex[:6]}"}]
        raw = _client(gw).chat.completions.with_raw_response.create(
            model="provider-model", messages=messages, max_tokens=8, temperature=0)
        content = raw.parse().choices[0].message.content
        chunks = list(_client(gw).chat.completions.create(
            model="provider-model", messages=messages, max_tokens=8, temperature=0, stream=True))
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        stored = gw.stored_turn(raw.headers["x-turn-id"])
        models = [m.id for m in _client(gw).models.list().data]
    assert streamed == content and content
    assert stored["capture"] == "black-box" and stored["status"] == "ok"
    assert stored["response"]["content"] == content
    assert stored["token_ids"] is None and stored["prompt_token_ids"] is None and stored["logprobs"] is None
    assert stored["policy_version"] is None
    assert models == ["provider-model"]  # no vLLM model, so no `policy` alias
    assert b"sk-provider-secret-77" not in (tmp_path / "pool.db").read_bytes()


def test_two_gateways_sharing_postgres_stitch_one_session(
    vllm_server: RunningVLLM, pg_url: str, tmp_path: Path
) -> None:
    with GatewayProcess(tmp_path / "a", database_url=pg_url, upstream_url=vllm_server.base_url) as a, \
         GatewayProcess(tmp_path / "b", database_url=pg_url, upstream_url=vllm_server.base_url) as b:
        messages: list[Any] = [{"role": "system", "content": f"Replica test {uuid.uuid4().hex[:8]}"},
                               {"role": "user", "content": "Hi"}]
        ids = []
        for i, gw in enumerate((a, b, a, b)):
            raw = _client(gw).chat.completions.with_raw_response.create(
                model="smollm2", messages=messages, max_tokens=6)
            ids.append(raw.headers["x-turn-id"])
            messages += [raw.parse().choices[0].message, {"role": "user", "content": f"More {i}"}]
        turns = [b.stored_turn(i) for i in ids]
        sid = turns[0]["session_id"]
        assert {t["session_id"] for t in turns} == {sid}
        s = wait_for(lambda: (r := httpx.get(f"{a.url}/api/sessions/{sid}", timeout=5).json())
                     and all(t["next_state"] for t in r["turns"][:3]) and r)
        assert [t["id"] for t in s["turns"]] == ids
        assert [t["next_state"]["turn_id"] for t in s["turns"][:3]] == ids[1:]


def test_database_goes_away_mid_traffic(vllm_server: RunningVLLM, pg_cluster: ThrowawayPostgres, tmp_path: Path) -> None:
    """Kill PostgreSQL under load: every request still succeeds, and once it is back the pool
    holds every turn exactly once."""
    gw = GatewayProcess(tmp_path, database_url=pg_cluster.dsn, upstream_url=vllm_server.base_url,
                        env={"NEXTSTATE_SPOOL_RETRY_INTERVAL_S": "0.3"}).start()
    sent: list[str] = []
    failures: list[str] = []
    done = threading.Event()

    def traffic() -> None:
        c = _client(gw)
        i = 0
        while not done.is_set() or i < 30:
            try:
                raw = c.chat.completions.with_raw_response.create(
                    model="smollm2", max_tokens=3,
                    messages=[{"role": "user", "content": f"outage {i} {uuid.uuid4().hex[:6]}"}])
                sent.append(raw.headers["x-turn-id"])
            except Exception as exc:  # noqa: BLE001 - every failure is a test failure
                failures.append(repr(exc))
            i += 1

    worker = threading.Thread(target=traffic)
    try:
        worker.start()
        wait_for(lambda: len(sent) >= 5, timeout=60)
        pg_cluster.kill()
        at_kill = len(sent)
        wait_for(lambda: len(sent) >= at_kill + 8, timeout=60)
        metrics = httpx.get(f"{gw.url}/metrics", timeout=5).text
        spooled = next(float(line.split()[-1]) for line in metrics.splitlines()
                       if line.startswith("nextstate_spool_records "))
        assert spooled > 0
        ready = httpx.get(f"{gw.url}/readyz", timeout=10)
        assert ready.status_code == 503 and ready.json()["checks"]["pool"] != "ok"
        pg_cluster.restart()
        done.set()
        worker.join(120)
    finally:
        done.set()
        gw.stop()
    assert not failures
    assert len(sent) >= 30
    # the gateway stopped cleanly, so everything it captured is in the pool now or was on
    # replay; a fresh gateway on the same data dir replays whatever was left
    with GatewayProcess(tmp_path, database_url=pg_cluster.dsn, upstream_url=vllm_server.base_url) as gw2:
        engine = make_engine(pg_cluster.dsn)

        def counts() -> tuple[int, int] | None:
            with engine.connect() as conn:
                n, distinct = conn.execute(text("SELECT count(*), count(DISTINCT id) FROM turns")).one()
            return (n, distinct) if n >= len(sent) else None

        n, distinct = wait_for(counts, timeout=30)
        with engine.connect() as conn:
            ids = set(conn.scalars(text("SELECT id FROM turns")))
        engine.dispose()
        assert httpx.get(f"{gw2.url}/readyz", timeout=10).status_code == 200
    assert n == distinct == len(sent)
    assert ids == set(sent)
