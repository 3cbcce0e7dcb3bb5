"""Bad input and security: fuzzing the OpenAPI schema, hostile bodies and session ids, credentials
on every route, and no secret in the pool or the logs.

The upstream is tests/support/upstream.py (fast, fixed reply), so the fuzzer's hundreds of valid
requests do not queue behind the shared vLLM; the gateway, PostgreSQL, Redis and the Celery
worker are the real processes.
"""

from __future__ import annotations

import http.client
import json
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
import yaml
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from sqlalchemy import inspect, text
from starlette.routing import Route

from datapool.db import make_engine, upgrade
from base.settings import Settings
from tests.support.upstream import UpstreamProcess
from tests.support.processes import GatewayProcess, WorkerProcess, wait_for
from tests.support.redis_server import unique_queue

LIMIT = 65536


def openai_error(resp: httpx.Response | Any, status: int | None = None) -> dict[str, Any]:
    """The OpenAI error body of a response, checked for shape (and status, if given)."""
    if status is not None:
        assert resp.status_code == status, (resp.status_code, resp.text[:500])
    body = resp.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and {"param", "code"} <= set(err)
    return err


def anthropic_error(resp: httpx.Response | Any, status: int | None = None) -> dict[str, Any]:
    """The Anthropic error body (`/v1/messages`), checked for shape (and status, if given)."""
    if status is not None:
        assert resp.status_code == status, (resp.status_code, resp.text[:500])
    body = resp.json()
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
    return err


class Gateway(GatewayProcess):
    """A gateway process given time to start: on two cores shared with other suites and vLLM,
    importing LiteLLM and migrating the pool has taken over 90 s."""

    def start(self, timeout: float = 300.0) -> "Gateway":
        super().start(timeout)
        return self


@pytest.fixture(scope="module")
def fast_upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpstreamProcess]:
    with UpstreamProcess(tmp_path_factory.mktemp("up") / "upstream.log") as up:
        yield up


def _open(upstream: UpstreamProcess, d: Path) -> Gateway:
    models = upstream.model_list(d / "models.yaml")
    return Gateway(d, database_url=f"sqlite:///{d / 'pool.db'}", model_list=models,
                   env={"NEXTSTATE_MAX_BODY_BYTES": str(LIMIT)})


@pytest.fixture(scope="module")
def open_gateway(fast_upstream: UpstreamProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    """No keys: every route reachable without one."""
    with _open(fast_upstream, tmp_path_factory.mktemp("gw")) as gw:
        yield gw


@pytest.fixture(scope="module")
def fuzzed_gateway(fast_upstream: UpstreamProcess, tmp_path_factory: pytest.TempPathFactory
                   ) -> Iterator[GatewayProcess]:
    """The same, for the fuzzer alone: what it POSTs (a tenant's key, say, after which every
    request needs a key) must not change what the other tests of the open gateway see."""
    with _open(fast_upstream, tmp_path_factory.mktemp("fuzzgw")) as gw:
        yield gw


# --- schemathesis over every route of the OpenAPI schema ---------------------------------------


def test_fuzzed_requests_never_5xx_and_errors_speak_openai(fuzzed_gateway: GatewayProcess) -> None:
    """schemathesis generates requests for every operation of the gateway's own OpenAPI schema,
    valid and not; none may get a 5xx, and every 4xx must be an error in the route's dialect
    (Anthropic's on /v1/messages, OpenAI's everywhere else)."""
    schema = schemathesis.openapi.from_url(f"{fuzzed_gateway.url}/openapi.json")
    failures: list[str] = []
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 10

    for operation in operations:
        @given(case=operation.as_strategy())
        @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def check(case: Any) -> None:
            resp = case.call(timeout=30)
            # some routes answer in binary (the admin export's Parquet)
            body = resp.content[:300].decode("utf-8", "replace")
            where = f"{case.method} {case.formatted_path} -> {resp.status_code}: {body}"
            if resp.status_code >= 500:
                failures.append(where)
            elif resp.status_code >= 400:
                anthropic = "/v1/messages" in case.formatted_path
                try:
                    (anthropic_error if anthropic else openai_error)(resp)
                except (AssertionError, ValueError, KeyError, TypeError):
                    failures.append(f"not {'Anthropic' if anthropic else 'OpenAI'}-shaped: " + where)

        check()
    assert not failures, failures[:10]


def test_schema_documents_the_request_bodies(open_gateway: GatewayProcess) -> None:
    # without the body schema the fuzzer could only vary paths and headers
    spec = httpx.get(f"{open_gateway.url}/openapi.json", timeout=10).json()
    for path in ("/v1/chat/completions", "/v1/completions", "/s/{session_id}/v1/chat/completions"):
        body = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert "model" in body["required"]
    assert "messages" in spec["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"][
        "application/json"]["schema"]["properties"]


# --- hostile bodies and session ids ------------------------------------------------------------

OK = {"model": "fixed", "messages": [{"role": "user", "content": "hi"}]}


def _raw(gw: GatewayProcess, method: str, path: str, body: bytes = b"",
         headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    """A request with the path exactly as given (httpx would normalise `..` away)."""
    conn = http.client.HTTPConnection("127.0.0.1", gw.port, timeout=30)
    try:
        conn.request(method, path, body=body, headers={"content-type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


@pytest.mark.parametrize(
    ("name", "body", "status"),
    [
        ("oversized", json.dumps(OK | {"pad": "x" * (LIMIT + 1)}).encode(), 413),
        ("deeply nested", b'{"model":"fixed","messages":[{"role":"user","content":"hi"}],"x":'
                          + b"[" * 20_000 + b"]" * 20_000 + b"}", 400),
        ("invalid UTF-8", b'{"model":"fixed","messages":[{"role":"user","content":"\xff\xfe\xfd"}]}', 400),
        ("lone surrogate", b'{"model":"fixed","messages":[{"role":"user","content":"\\ud800"}]}', 400),
        ("NaN", b'{"model":"fixed","messages":[{"role":"user","content":"hi"}],"temperature":NaN}', 400),
        ("huge n", json.dumps(OK | {"n": 10**12}).encode(), 400),
        ("huger n", json.dumps(OK | {"n": 10**40}).encode(), 400),
        ("negative max_tokens", json.dumps(OK | {"max_tokens": -5}).encode(), 400),
        ("zero max_tokens", json.dumps(OK | {"max_tokens": 0}).encode(), 400),
        ("negative max_completion_tokens", json.dumps(OK | {"max_completion_tokens": -1}).encode(), 400),
        ("not an object", b"[1, 2, 3]", 400),
        ("empty", b"", 400),
        ("truncated", b'{"model": "fixed", "messages": [', 400),
    ],
)
def test_hostile_bodies_get_the_right_status(open_gateway: GatewayProcess, name: str, body: bytes,
                                             status: int) -> None:
    for path in ("/v1/chat/completions", "/s/hostile-body/v1/chat/completions"):
        got, err = _raw(open_gateway, "POST", path, body)
        assert got == status, (name, path, got, err)
        assert set(err) == {"error"} and err["error"]["message"]


def test_streamed_oversized_body_is_refused(open_gateway: GatewayProcess) -> None:
    # no Content-Length: the limit is enforced while reading
    chunks = (b"x" * 8192 for _ in range(LIMIT // 8192 + 2))
    r = httpx.post(f"{open_gateway.base_url}/chat/completions", content=chunks, timeout=30)
    assert openai_error(r, 413)["code"] == "request_too_large"


@pytest.mark.parametrize(
    ("path", "headers", "status"),
    [
        ("/s/../v1/chat/completions", {}, 400),  # sent as is (no client normalising it away)
        ("/s/..%2F..%2Fetc%2Fpasswd/v1/chat/completions", {}, 404),
        ("/s/%2e%2e/v1/chat/completions", {}, 400),
        ("/s/.hidden/v1/chat/completions", {}, 400),
        ("/s/a%00b/v1/chat/completions", {}, 400),
        ("/s/" + "a" * 129 + "/v1/chat/completions", {}, 400),
        ("/s/caf%C3%A9/v1/chat/completions", {}, 400),
        ("/v1/chat/completions", {"x-session-id": "../../etc/passwd"}, 400),
        ("/v1/chat/completions", {"x-session-id": ".."}, 400),
        ("/v1/chat/completions", {"x-turn-type": "sideways"}, 400),
    ],
)
def test_bad_session_ids_are_refused(open_gateway: GatewayProcess, path: str, headers: dict[str, str],
                                     status: int) -> None:
    got, err = _raw(open_gateway, "POST", path, json.dumps(OK).encode(), headers)
    assert got == status, (path, got, err)
    assert set(err) == {"error"} and err["error"]["message"]


def test_unknown_ids_are_404(open_gateway: GatewayProcess) -> None:
    unknown = uuid.uuid4().hex
    for method, path, body in (("GET", f"/api/sessions/{unknown}", None),
                               ("GET", f"/api/turns/{unknown}", None),
                               ("POST", f"/api/sessions/{unknown}/end", None),
                               ("POST", f"/api/sessions/{unknown}/outcome", {"outcome": 1}),
                               ("POST", "/v1/feedback", {"turn_id": unknown, "rating": "up"}),
                               ("POST", "/v1/feedback", {"response_id": unknown, "rating": "down"})):
        r = httpx.request(method, f"{open_gateway.url}{path}", json=body, timeout=30)
        openai_error(r, 404)
    # a session named in the path that does not exist yet is simply started
    r = httpx.post(f"{open_gateway.url}/s/{unknown}/v1/chat/completions", json=OK, timeout=30)
    assert r.status_code == 200 and r.headers["x-session-id"] == unknown


def test_times_out_of_range_are_the_clients_error(open_gateway: GatewayProcess) -> None:
    # year 1 at +14:00 has no UTC equivalent: the fuzzer found a 503 here (the pool's OverflowError)
    for param in ("since", "until"):
        r = httpx.get(f"{open_gateway.url}/api/sessions", params={param: "0001-01-01T00:00:00+14:00"}, timeout=30)
        assert openai_error(r, 400)["param"] == param
    r = httpx.get(f"{open_gateway.url}/api/sessions", params={"since": "2026-11-30T10:00:00+14:00"}, timeout=30)
    assert r.status_code == 200, r.text


def test_rejected_requests_store_nothing(open_gateway: GatewayProcess) -> None:
    # every request above that was refused left no row; the accepted ones did
    import sqlite3

    accepted = httpx.post(f"{open_gateway.base_url}/chat/completions", json=OK, timeout=30)
    assert accepted.status_code == 200
    tid = accepted.headers["x-turn-id"]
    open_gateway.stored_turn(tid)
    db = sqlite3.connect(open_gateway.data_dir / "pool.db")
    try:
        rows = db.execute("SELECT status, request FROM turns").fetchall()
    finally:
        db.close()
    assert all(status == "ok" for status, _ in rows)
    for _, request in rows:
        assert "\\ud800" not in request and "NaN" not in request


# --- credentials on every route ----------------------------------------------------------------

# Routes anyone may call: liveness, readiness and metrics (scraped by infrastructure). The API's
# own description (/docs, /redoc, /openapi.json) is admin-only when a token is set. Anything else, including routes added later, must refuse a caller
# without credentials, or this test fails.
PUBLIC = {"/healthz", "/readyz", "/metrics",
          # the admin UI's login form (it issues the session cookie) and its static files
          "/admin/login", "/admin/static"}
ADMIN_PREFIXES = ("/api", "/admin", "/docs", "/redoc", "/openapi.json")


def _all_routes(routes: Any, prefix: str = "") -> Iterator[tuple[str, Route]]:
    """Every endpoint route with its full path, through included routers at any depth."""
    for r in routes:
        if isinstance(r, (APIRoute, Route)):
            yield prefix + r.path, r
        elif hasattr(r, "original_router"):  # FastAPI's included router
            extra = getattr(getattr(r, "include_context", None), "prefix", "") or ""
            yield from _all_routes(r.original_router.routes, prefix + extra)
        elif hasattr(r, "routes"):  # a Mount
            yield from _all_routes(r.routes, prefix + getattr(r, "path", ""))


def _concrete(path: str) -> str:
    return re.sub(r"\{[^}]+\}", "probe-1", path)


def _refused(resp: httpx.Response) -> bool:
    if resp.status_code in (401, 403):
        return True
    # a browser page may send the visitor to a login form instead
    return resp.status_code in (302, 303, 307) and "login" in resp.headers.get("location", "")


def test_every_route_needs_its_credentials(tmp_path: Path) -> None:
    key, admin = f"sk-route-{uuid.uuid4().hex}", f"admin-route-{uuid.uuid4().hex}"
    url = f"sqlite:///{tmp_path / 'pool.db'}"
    upgrade(url)
    from gateway.app import create_app

    app = create_app(Settings(data_dir=tmp_path, database_url=url, upstream_url="http://127.0.0.1:9/v1",
                              api_keys=[key], admin_token=admin))
    probed = []
    with TestClient(app, follow_redirects=False) as client:
        for full, route in _all_routes(app.routes):
            if full in PUBLIC:
                continue
            for method in sorted((route.methods or set()) - {"HEAD", "OPTIONS"}):
                path = _concrete(full)
                probed.append((method, full))
                for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": key}):
                    r = client.request(method, path, headers=headers, json={})
                    assert _refused(r), (method, full, headers, r.status_code, r.text[:200])
                    if r.status_code == 401 and not full.startswith("/admin"):  # the UI answers in HTML
                        (anthropic_error if "/v1/messages" in full else openai_error)(r)
                is_admin = full.startswith(ADMIN_PREFIXES)
                r = client.request(method, path, headers={"Authorization": f"Bearer {key}"}, json={})
                if is_admin:
                    assert _refused(r), ("an API key must not open an admin route", method, full)
                else:
                    assert r.status_code != 401, (method, full, r.text[:200])
                    r = client.request(method, path, headers={"Authorization": f"Bearer {admin}"}, json={})
                    assert r.status_code == 401, ("the admin token is no API key", method, full)
    # the enumeration really covered the proxy, feedback and admin routes
    paths = {p for _, p in probed}
    assert {"/v1/chat/completions", "/s/{session_id}/v1/completions", "/v1/models", "/v1/feedback",
            "/api/sessions", "/api/turns/{turn_id}", "/v1/responses", "/v1/responses/{response_id}",
            "/s/{session_id}/v1/messages", "/v1/messages/count_tokens", "/docs", "/redoc", "/openapi.json"} <= paths


def test_every_proxy_route_is_also_under_the_session_prefix() -> None:
    # gateway.routes.openai.proxy_route registers each proxy route at /v1/... and at
    # /s/{session_id}/v1/...: the same handler, methods, key check and documented body at both
    from gateway.routes.openai import SESSION_PREFIX, router

    def shape(r: APIRoute) -> tuple[Any, ...]:
        return (frozenset(r.methods), r.endpoint, tuple(d.dependency for d in r.dependencies), repr(r.openapi_extra))

    plain = {r.path: shape(r) for r in router.routes if isinstance(r, APIRoute) and r.path.startswith("/v1/")}
    prefixed = {r.path.removeprefix(SESSION_PREFIX): shape(r) for r in router.routes
                if isinstance(r, APIRoute) and r.path.startswith(SESSION_PREFIX + "/")}
    assert plain == prefixed
    assert len(plain) == 7 and len(router.routes) == 14  # nothing else is on the proxy router


# --- no secret reaches the pool or the logs ------------------------------------------------------


def test_no_secret_in_any_table_or_log(fast_upstream: UpstreamProcess, pg_url: str, redis_url: str,
                                       tmp_path: Path) -> None:
    marker = uuid.uuid4().hex[:12]
    key = f"sk-client-{marker}"
    admin = f"admin-{marker}"
    provider = f"sk-provider-{marker}"
    models = tmp_path / "models.yaml"
    models.write_text(yaml.safe_dump({"model_list": [{"model_name": "fixed", "litellm_params": {
        "model": "hosted_vllm/fixed", "api_base": fast_upstream.base_url,
        "api_key": "os.environ/BENCH_PROVIDER_KEY"}}]}))
    common = {"NEXTSTATE_BROKER_URL": redis_url, "NEXTSTATE_QUEUE": unique_queue(),
              "NEXTSTATE_API_KEYS": key, "NEXTSTATE_ADMIN_TOKEN": admin, "BENCH_PROVIDER_KEY": provider}
    worker_env = common | {"NEXTSTATE_JUDGE_BACKEND": "python", "NEXTSTATE_JUDGE_PYTHON": "tests.support.judges:verdict"}
    with Gateway(tmp_path, database_url=pg_url, model_list=models, env=common) as gw, \
            WorkerProcess(tmp_path, database_url=pg_url, broker_url=redis_url, env=worker_env):
        sent_headers = {"Authorization": f"Bearer {key}", "x-api-key": key, "api-key": key,
                        "OpenAI-Organization": key, "Cookie": f"session={key}"}
        messages: list[Any] = [{"role": "system", "content": f"secret test {marker}"},
                               {"role": "user", "content": "hi"}]
        r1 = httpx.post(f"{gw.base_url}/chat/completions", json={"model": "fixed", "messages": messages},
                        headers=sent_headers, timeout=30)
        assert r1.status_code == 200, r1.text
        messages += [r1.json()["choices"][0]["message"], {"role": "user", "content": "thanks"}]
        r2 = httpx.post(f"{gw.base_url}/chat/completions",
                        json={"model": "fixed", "messages": messages, "stream": True, "user": "u1"},
                        headers=sent_headers | {"X-Session-Done": "1"}, timeout=30)
        assert r2.status_code == 200
        # refused attempts (wrong key, key in the body, key as admin token) are logged nowhere either
        httpx.post(f"{gw.base_url}/chat/completions", json={"model": "fixed", "messages": messages,
                                                             "api_key": key}, headers=sent_headers, timeout=30)
        httpx.get(f"{gw.url}/api/sessions", headers={"Authorization": f"Bearer {key}"}, timeout=30)
        httpx.post(f"{gw.base_url}/chat/completions", json={"model": "fixed", "messages": messages},
                   headers={"Authorization": f"Bearer {admin}"}, timeout=30)
        auth = {"Authorization": f"Bearer {admin}"}
        t1 = r1.headers["x-turn-id"]
        wait_for(lambda: (t := httpx.get(f"{gw.url}/api/turns/{t1}", headers=auth, timeout=5)).status_code == 200
                 and t.json()["judgement"]["status"] == "scored", timeout=90)
    engine = make_engine(pg_url)
    found: list[str] = []
    try:
        with engine.connect() as conn:
            tables = inspect(conn).get_table_names()
            assert {"turns", "sessions", "votes", "judgements"} <= set(tables)
            for table in tables:
                rows = conn.execute(text(f'SELECT t::text FROM "{table}" t')).scalars().all()
                found += [f"{table}: {secret}" for row in rows for secret in (key, admin, provider)
                          if secret in row]
            assert conn.execute(text("SELECT count(*) FROM turns")).scalar_one() >= 2
    finally:
        engine.dispose()
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    logs = [p for p in files if p.suffix == ".log"]
    assert logs, "the gateway and the worker write logs here"
    for p in files:
        data = p.read_bytes()
        found += [f"{p.name}: {s}" for s in (key, admin, provider) if s.encode() in data]
    assert not found, found
