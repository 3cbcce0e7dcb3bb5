"""Tenants, through a real gateway process: client keys map to tenants (settings and the admin
API), sessions carry their tenant and stay apart (the same session id or the same conversation
from two tenants never joins one session), and every route, API and admin UI, called with one
tenant's key or its UI login on ids of its own, of another tenant or made up (hypothesis), answers
nothing of another tenant's data. The admin token (or login) sees everything, with a tenant
column and filter in the UI."""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from collections.abc import Iterator
from urllib.parse import quote
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from base.settings import Settings
from gateway.tenants import TENANT_PAGES
from gateway.ui import judgements as ui_judgements
from gateway.ui import pages as ui_pages
from tests.support.upstream import UpstreamProcess
from tests.support.processes import GatewayProcess, wait_for

ADMIN_TOKEN = "admin-token-for-tenants"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
CONFIGURED = {"key-acme": "acme", "key-globex": "globex"}


class World:
    """The gateway, each tenant's key, and what each tenant stored (ids and content markers)."""

    def __init__(self, gw: GatewayProcess):
        self.gw = gw
        self.keys: dict[str, str] = {key: tenant for key, tenant in CONFIGURED.items()}
        self.markers: dict[str, str] = {}
        self.sessions: dict[str, list[str]] = {}
        self.turns: dict[str, list[str]] = {}
        self.responses: dict[str, list[str]] = {}
        self.logins: dict[str, httpx.Client] = {}  # tenant -> a UI login with its key (cookie)
        self.csrf: dict[str, str] = {}

    def key_of(self, tenant: str) -> str:
        return next(k for k, t in self.keys.items() if t == tenant)

    def secrets_of(self, tenant: str) -> list[str]:
        """What must never reach another tenant: its marker, session, turn and response ids."""
        return [self.markers[tenant], *self.sessions[tenant], *self.turns[tenant], *self.responses[tenant]]


def _chat(world: World, tenant: str, content: str, session: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {world.key_of(tenant)}"}
    if session:
        headers["X-Session-Id"] = session
    resp = httpx.post(f"{world.gw.base_url}/chat/completions", headers=headers, timeout=60, json={
        "model": "fixed", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": content}]})
    assert resp.status_code == 200, resp.text
    return resp


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    d = tmp_path_factory.mktemp("tenants")
    with UpstreamProcess(d / "upstream.log") as upstream:
        models = upstream.model_list(d / "models.yaml")
        gw = GatewayProcess(d, database_url=f"sqlite:///{d / 'pool.db'}", model_list=models,
                            env={"NEXTSTATE_ADMIN_TOKEN": ADMIN_TOKEN, "NEXTSTATE_TENANT_KEYS": json.dumps(CONFIGURED)})
        gw.start(timeout=300)
        try:
            w = World(gw)
            issued = httpx.post(f"{gw.url}/api/tenants/initech/keys", headers=ADMIN, timeout=30)
            assert issued.status_code == 201, issued.text
            w.keys[issued.json()["key"]] = "initech"
            for tenant in ("acme", "globex", "initech"):
                w.markers[tenant] = f"MARKER-{tenant}-{uuid.uuid4().hex}"
                turns, responses = [], []
                # the same explicit session id and the same inferred conversation for every tenant
                for content, session in ((f"{w.markers[tenant]} first", "shared-session"),
                                         ("the very same words from everyone", None)):
                    r = _chat(w, tenant, content, session)
                    turns.append(r.headers["x-turn-id"])
                    responses.append(r.json()["id"])
                w.turns[tenant], w.responses[tenant] = turns, responses
            httpx.post(f"{gw.url}/api/capture/flush", headers=ADMIN, timeout=60)
            for tenant in w.markers:
                w.sessions[tenant] = sorted({gw.stored_turn(i, headers=ADMIN, timeout=60)["session_id"]
                                             for i in w.turns[tenant]})
            for tenant in w.markers:
                w.logins[tenant], w.csrf[tenant] = _login(gw, w.key_of(tenant))
            yield w
        finally:
            for client in w.logins.values():
                client.close()
            gw.stop()


def _login(gw: GatewayProcess, secret: str) -> tuple[httpx.Client, str]:
    """A browser's login to the admin UI with *secret*: its cookie jar, and its CSRF token."""
    client = httpx.Client(base_url=gw.url, timeout=30)
    page = client.post("/admin/login", data={"secret": secret}, follow_redirects=True)
    assert page.status_code == 200 and "/admin/sessions" in str(page.url), page.text[:300]
    found = re.search(r'"X-CSRF-Token": "([^"]+)"', page.text)
    assert found, page.text[:500]
    return client, found[1]


def test_sessions_carry_their_tenant_and_never_mix(world: World) -> None:
    seen: dict[str, str] = {}
    for tenant, sessions in world.sessions.items():
        for sid in sessions:
            detail = httpx.get(f"{world.gw.url}/api/sessions/{sid}", headers=ADMIN, timeout=10).json()
            assert detail["tenant"] == tenant
            assert sid not in seen, f"{tenant} and {seen.get(sid)} share session {sid}"
            seen[sid] = tenant
        assert f"{tenant}~shared-session" in sessions
    everything = httpx.get(f"{world.gw.url}/api/sessions", headers=ADMIN, params={"limit": 500}, timeout=10).json()
    assert {s["id"] for s in everything["data"]} >= set(seen)  # the admin sees every tenant's


def test_a_tenant_key_sees_its_own(world: World) -> None:
    for tenant in world.markers:
        headers = {"Authorization": f"Bearer {world.key_of(tenant)}"}
        listed = httpx.get(f"{world.gw.url}/api/sessions", headers=headers, timeout=10).json()
        assert sorted(s["id"] for s in listed["data"]) == world.sessions[tenant]
        exported = httpx.get(f"{world.gw.url}/api/export", headers=headers, timeout=30).text
        assert world.markers[tenant] in exported and len(exported.splitlines()) == len(world.turns[tenant])


def test_a_tenant_cannot_continue_another_tenants_response(world: World) -> None:
    resp = httpx.post(f"{world.gw.base_url}/responses", headers={"Authorization": f"Bearer {world.key_of('globex')}"},
                      timeout=30, json={"model": "fixed", "input": "go on",
                                        "previous_response_id": world.responses["acme"][0]})
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "previous_response_not_found"


def test_tenant_keys_need_an_admin_credential() -> None:
    with pytest.raises(ValueError, match="tenant_keys need admin_token"):
        Settings(tenant_keys={"k": "acme"})
    with pytest.raises(ValueError, match="tenant name"):
        Settings(tenant_keys={"k": "no spaces"}, admin_token="t")


def _ui_routes() -> list[tuple[str, str]]:
    """Every route of the admin UI (login and logout aside)."""
    out = [(method, route.path) for router in (ui_pages.router, ui_judgements.router) for route in router.routes
           for method in getattr(route, "methods", ())]
    out = [(m, p) for m, p in out if p not in ("/admin/logout",) and m != "HEAD"]
    assert len(out) >= 20 and ("GET", "/admin/sessions/{session_id}") in out
    return out


def _routes(world: World) -> list[tuple[str, str]]:
    schema = httpx.get(f"{world.gw.url}/openapi.json", headers=ADMIN, timeout=30).json()
    out = [(method.upper(), path) for path, ops in schema["paths"].items() for method in ops]
    assert len(out) >= 20 and ("GET", "/api/sessions/{session_id}") in out
    return out + _ui_routes()


BODIES = {"labels": {"kind": "thumb", "value": 1}, "outcome": {"outcome": 1.0},
          "feedback": {"value": 1}, "sessions": {"end": True}, "promote": {"name": "x", "confirm": "yes"},
          "rollback": {"confirm": "yes"}}


@pytest.fixture(scope="module")
def routes(world: World) -> list[tuple[str, str]]:
    return _routes(world)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(data=st.data())
def test_no_route_answers_another_tenants_data(world: World, routes: list[tuple[str, str]], data: Any) -> None:
    caller = data.draw(st.sampled_from(sorted(world.markers)), label="caller")
    owner = data.draw(st.sampled_from(sorted(world.markers)), label="owner of the ids")
    method, path = data.draw(st.sampled_from(routes), label="route")
    ids = {"session_id": data.draw(st.sampled_from(world.sessions[owner] + ["shared-session", uuid.uuid4().hex])),
           "turn_id": data.draw(st.sampled_from(world.turns[owner] + [uuid.uuid4().hex])),
           "response_id": data.draw(st.sampled_from(world.responses[owner])),
           "tenant": owner, "key_id": uuid.uuid4().hex, "name": "x", "fmt": "jsonl"}
    url = re.sub(r"\{(\w+)\}", lambda m: str(ids.get(m[1], "x")), path)
    body: dict[str, Any] = next((b for k, b in BODIES.items() if k in path), {})
    if path.endswith("/feedback"):
        body = {"value": 1, **data.draw(st.sampled_from([{"turn_id": ids["turn_id"]},
                                                           {"response_id": ids["response_id"]}]))}
    if "/v1/" in path and method == "POST" and not path.endswith("/feedback"):
        return  # the proxy's calls answer from the model, not the pool (continuations: above)
    # the tenant's key as a bearer token, or its login to the admin UI (cookie, CSRF token)
    login = path.startswith("/admin") or data.draw(st.booleans(), label="through the UI login")
    ui_form = path.startswith("/admin") and method == "POST"
    sender: Any = world.logins[caller] if login else httpx
    headers = {"X-CSRF-Token": world.csrf[caller]} if login else {"Authorization": f"Bearer {world.key_of(caller)}"}
    resp = sender.request(method, f"{world.gw.url}{url}", headers=headers,
                          json=body if method in ("POST", "PUT", "PATCH") and not ui_form else None,
                          data=body if ui_form else None,
                          params={"limit": 500}, timeout=30, follow_redirects=False)
    assert resp.status_code < 500, (method, url, resp.text[:300])
    text = resp.text
    for other in world.markers:
        if other == caller:
            continue
        # an id the caller sent itself may come back (a 404 names it, as for a made-up id)
        sent = url + json.dumps(body)
        leaked = [s for s in world.secrets_of(other) if s in text and s not in sent]
        assert not leaked, (caller, method, url, resp.status_code, leaked)
    about_ids = "{session_id}" in path or "{turn_id}" in path or path.endswith("/feedback")
    if caller != owner and about_ids and method in ("POST", "PUT", "PATCH", "DELETE") and resp.status_code < 400:
        pytest.fail(f"{caller} changed {owner}'s data: {method} {url} -> {resp.status_code} {text[:200]}")
    if path.startswith("/admin") and (method, path) not in TENANT_PAGES:
        assert resp.status_code == 403, (method, url, resp.status_code)  # the admin's pages


def test_a_tenants_ui_login_shows_its_own_sessions_and_turns(world: World) -> None:
    for tenant, ui in world.logins.items():
        sessions = ui.get("/admin/sessions").text
        turns = ui.get("/admin/turns").text
        for sid in world.sessions[tenant]:
            assert f"/admin/sessions/{quote(sid)}" in sessions and f"/admin/sessions/{quote(sid)}" in turns
            page = ui.get(f"/admin/sessions/{quote(sid)}")
            assert page.status_code == 200
            if sid == f"{tenant}~shared-session":
                assert world.markers[tenant] in page.text
        assert f'data-testid="tenant">tenant {tenant}<' in sessions
        assert "/admin/training" not in sessions and 'name="tenant"' not in sessions  # no admin pages, no filter
        # its own `tenant=` cannot widen (or move) its view
        other = next(t for t in world.markers if t != tenant)
        moved = ui.get("/admin/sessions", params={"tenant": other}).text
        assert not any(s in moved for s in world.secrets_of(other)) and world.sessions[tenant][0] in moved
        exported = ui.get("/admin/export.jsonl", params={"tenant": other}).text
        assert world.markers[tenant] in exported and len(exported.splitlines()) == len(world.turns[tenant])


def test_the_admin_ui_shows_every_tenant_with_a_column_and_a_filter(world: World) -> None:
    ui, _ = _login(world.gw, ADMIN_TOKEN)
    with contextlib.closing(ui):
        page = ui.get("/admin/sessions", params={"limit": 500}).text
        assert 'name="tenant"' in page and "<th>Tenant</th>" in page
        for tenant in world.markers:
            assert f"<option >{tenant}</option>" in page or f"<option>{tenant}</option>" in page
            only = ui.get("/admin/sessions", params={"tenant": tenant}).text
            cells = set(re.findall(r'<td class="small" data-tenant>([^<]*)</td>', only))
            assert cells == {tenant}, cells
            turns = ui.get("/admin/turns", params={"tenant": tenant}).text
            assert set(re.findall(r'<td class="small" data-tenant>([^<]*)</td>', turns)) == {tenant}
            assert "<th>Tenant</th>" in turns


def test_revoking_a_key_ends_its_ui_login(world: World) -> None:
    issued = httpx.post(f"{world.gw.url}/api/tenants/umbrella/keys", headers=ADMIN, timeout=30).json()
    ui, _ = _login(world.gw, issued["key"])
    with contextlib.closing(ui):
        assert ui.get("/admin/sessions").status_code == 200
        gone = httpx.delete(f"{world.gw.url}/api/tenants/umbrella/keys/{issued['id']}", headers=ADMIN, timeout=30)
        assert gone.status_code in (200, 204), gone.text
        wait_for(lambda: ui.get("/admin/sessions").status_code == 303, timeout=20)  # to the login page
