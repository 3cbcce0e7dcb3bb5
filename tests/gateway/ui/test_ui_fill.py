"""The read side renders anything the pool can hold (issue #15): a pool with every judgement,
turn and capture state, and hypothesis' random combinations of them; every admin page and
every /api GET route (enumerated from the app, not listed by hand) is requested for every
session and turn, and none answers >= 500. An unexpected error renders the UI's own page."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings, strategies as st

from datapool import browse
from datapool.db import make_engine
from base.settings import Settings
from base.vocab import JudgementStatus
from gateway.app import create_app
from tests.support.admin_ui import admin_routes
from tests.support.ui_fill import every_state, turn_specs, write_session, write_training_states

# query strings the list pages are also asked with: each filter value
VARIANTS = ([f"reward={r}" for r in browse.REWARDS] + [f"capture={c}" for c in browse.CAPTURES]
            + [f"turn_type={t}" for t in browse.TURN_TYPES] + [f"status={s}" for s in JudgementStatus]
            + ["label=labeled", "label=unlabeled", "q=question", "sort=latency", "sort=-reward"])


class Requester:
    """Requests every GET route of the admin surface; counts what it asked for."""

    def __init__(self, client: TestClient) -> None:
        self.client = client
        self.routes = [p for m, p in admin_routes(client.app) if m == "GET" and not p.startswith("/admin/static")
                       and p not in ("/admin/login", "/admin", "/admin/")]
        self.requested: dict[str, int] = {}
        self.pages = 0

    def get(self, route: str, url: str) -> None:
        r = self.client.get(url, follow_redirects=False)
        assert r.status_code < 500, f"{url} answered {r.status_code}: {r.text[:500]}"
        self.requested[route] = self.requested.get(route, 0) + 1
        self.pages += 1

    def session(self, sid: str, turn_ids: list[str]) -> None:
        for route in self.routes:
            params = set(re.findall(r"\{(\w+)", route))
            if params == {"session_id"}:
                self.get(route, route.replace("{session_id}", sid))
            elif params == {"turn_id"}:
                for tid in turn_ids:
                    self.get(route, route.replace("{turn_id}", tid))

    def lists(self) -> None:
        for route in self.routes:
            params = set(re.findall(r"\{(\w+)", route))
            if params == {"fmt"}:
                for fmt in ("jsonl", "parquet"):
                    self.get(route, route.replace("{fmt}", fmt))
            elif params == {"tenant"}:  # a tenant's keys: one with none, and a name never seen
                for tenant in ("acme", "no-such-tenant"):
                    self.get(route, route.replace("{tenant}", tenant))
            elif params == {"run_id"} or params == {"version"}:
                continue  # asked with the pool's runs/versions by the training tests
            elif not params:
                self.get(route, route)
                for q in VARIANTS:
                    self.get(route, f"{route}?{q}")


@pytest.fixture
def client(database_url: str, tmp_path: Path) -> Iterator[tuple[TestClient, str]]:
    settings_ = Settings(upstream_url="http://127.0.0.1:9/v1", database_url=database_url, data_dir=tmp_path / "d")
    with TestClient(create_app(settings_)) as c:
        yield c, database_url


def test_every_page_renders_every_state(client: tuple[TestClient, str]) -> None:
    c, url = client
    engine = make_engine(url)
    written = [write_session(engine, specs) for specs in every_state()]
    engine.dispose()
    req = Requester(c)
    for sid, turn_ids in written:
        req.session(sid, turn_ids)
    req.lists()
    session_routes = [r for r in req.routes if "{session_id}" in r or "{turn_id}" in r]
    # the enumeration sees the session and turn pages of both the UI and the API
    assert {"/admin/sessions/{session_id}", "/api/sessions/{session_id}", "/api/turns/{turn_id}"} <= set(session_routes)
    assert all(req.requested.get(r) for r in req.routes if not re.search(r"\{(run_id|version)", r)), req.requested
    print(f"\nfill test: {len(written)} sessions ({sum(len(t) for _, t in written)} turns), "
          f"{len(req.routes)} GET routes, {req.pages} requests, none >= 500")


def test_training_pages_render_every_state(client: tuple[TestClient, str]) -> None:
    """No runs at all, then runs without steps, of one step, with NaN/inf metrics; versions
    with and without an eval; compared with themselves, with each other, with a missing one."""
    c, url = client
    req = Requester(c)
    training = [r for r in req.routes if r.startswith("/admin/training")]
    for route in training:  # an empty pool
        if "{" not in route:
            req.get(route, route)
    assert "No training run yet" in c.get("/admin/training").text
    assert c.get("/admin/training/runs/nope").status_code == 404
    engine = make_engine(url)
    made = write_training_states(engine)
    engine.dispose()
    for route in training:
        params = set(re.findall(r"\{(\w+)", route))
        if params == {"run_id"}:
            for run in made["runs"]:
                req.get(route, route.replace("{run_id}", run))
        elif not params:
            req.get(route, route)
    names = made["versions"]
    for a in names:
        for b in names:
            r = c.get("/admin/training/compare", params={"a": a, "b": b})
            assert r.status_code == 200, (a, b, r.text[:300])
            req.pages += 1
    for a, b in ((names[0], made["missing"][0]), (made["missing"][0], made["missing"][0])):
        r = c.get("/admin/training/compare", params={"a": a, "b": b})
        assert r.status_code == 404 and "<nav>" in r.text and made["missing"][0] in r.text
    assert {"/admin/training", "/admin/training/runs/{run_id}", "/admin/training/compare"} <= set(training)
    print(f"\ntraining fill test: {len(made['runs'])} runs, {len(names)} versions, {req.pages} requests, none >= 500")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sessions=st.lists(st.lists(turn_specs, min_size=1, max_size=6), min_size=1, max_size=3))
def test_random_combinations_render(client: tuple[TestClient, str], sessions: list[list[Any]]) -> None:
    c, url = client
    engine = make_engine(url)
    written = [write_session(engine, specs) for specs in sessions]
    engine.dispose()
    req = Requester(c)
    for sid, turn_ids in written:
        req.session(sid, turn_ids)
    for route in ("/admin/sessions", "/admin/queue", "/api/judgements", "/api/sessions"):
        if route in req.routes:
            req.get(route, route)


def test_an_unexpected_error_renders_the_ui_error_page(sqlite_url: str, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    from datapool import queries

    def broken(*_: Any, **__: Any) -> Any:
        raise RuntimeError("a bug in the read side")

    monkeypatch.setattr(queries, "get_session", broken)
    settings_ = Settings(upstream_url="http://127.0.0.1:9/v1", database_url=sqlite_url, data_dir=tmp_path / "d")
    with TestClient(create_app(settings_), raise_server_exceptions=False) as c, \
            caplog.at_level(logging.ERROR, logger="nextstate.gateway"):
        r = c.get("/admin/sessions/anything")
        assert r.status_code == 500 and r.headers["content-type"].startswith("text/html")
        rid = r.headers["x-request-id"]
        assert "<nav>" in r.text and rid in r.text and "a bug in the read side" not in r.text
        assert any(rid in rec.getMessage() and rec.exc_info for rec in caplog.records)
        # the JSON API answers in its own dialect, with the same kind of id
        api = c.get("/api/sessions/anything")
        assert api.status_code == 500 and api.json()["error"]["code"] == "internal_error"
        assert api.headers["x-request-id"] in api.json()["error"]["message"]
        # a refused request inside the UI is a page too, not JSON
        bad = c.get("/admin/sessions?reward=sideways")
        assert bad.status_code == 400 and "<nav>" in bad.text and "reward" in bad.text
        assert c.get("/admin/nowhere").status_code == 404
