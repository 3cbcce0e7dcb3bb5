"""The admin UI's turns view: one row per turn across sessions, found by filters, sorted and
paged both ways, its state in the URL, every row a link to an anchor that exists."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from html import unescape
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st
from sqlalchemy.orm import Session as OrmSession

from datapool.db import make_engine
from datapool.models import Judgement, Session, Turn
from base.settings import Settings
from gateway.app import create_app
from tests.support.admin_ui import admin_client

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


def seed_many(url: str, n_sessions: int = 60, bad: int = 3) -> dict[str, Any]:
    """``n_sessions`` sessions of three main turns each; ``bad`` of the turns scored −1, the
    rest +1 or unjudged; latencies and token counts varied."""
    engine = make_engine(url)
    out: dict[str, Any] = {"bad": [], "turns": {}}
    with OrmSession(engine) as db:
        k = 0
        for s in range(n_sessions):
            sid = f"many-{s:03d}"
            db.add(Session(id=sid, source="header", created_at=T0 + timedelta(minutes=s)))
            db.flush()
            for j in range(3):
                tid = str(uuid.uuid4())
                at = T0 + timedelta(minutes=s, seconds=j * 10)
                calls = [{"id": f"c{j}", "type": "function", "function": {"name": "f", "arguments": "{}"}}] * j
                db.add(Turn(id=tid, session_id=sid, turn_type="main", endpoint="chat", status="ok", created_at=at,
                            model="m-a" if s % 2 else "m-b", upstream_model="m", capture="black-box",
                            request={"messages": [{"role": "user", "content": f"question {s} {j}"}]},
                            response={"choices": [{"index": 0, "finish_reason": "length" if j == 2 else "stop",
                                                   "message": {"role": "assistant", "content": "ok",
                                                               **({"tool_calls": calls} if calls else {})}}]},
                            latency_ms=float((k * 37) % 1000), usage={"prompt_tokens": 10 + k, "completion_tokens": (k * 13) % 97}))
                db.flush()
                if k in (7, 50, 101):
                    db.add(Judgement(turn_id=tid, status="scored", reward=-1.0))
                    out["bad"].append(tid)
                elif k % 3 == 0:
                    db.add(Judgement(turn_id=tid, status="scored", reward=1.0))
                out["turns"][tid] = sid
                k += 1
        db.commit()
    engine.dispose()
    return out


@pytest.fixture
def many(database_url: str, tmp_path: Path) -> Iterator[tuple[TestClient, dict[str, Any]]]:
    data = seed_many(database_url)
    with admin_client(database_url, tmp_path) as client:
        yield client, data


def rows(html: str) -> list[str]:
    return re.findall(r'data-turn-row="([^"]+)"', html)


def link(html: str, testid: str) -> str | None:
    m = re.search(rf'data-testid="{testid}" href="([^"]+)"', html)
    return unescape(m.group(1)) if m else None


def test_finds_the_negative_turns_among_many(many: Any) -> None:
    client, data = many
    r = client.get("/admin/turns", params={"reward": "negative"})
    assert r.status_code == 200, r.text
    assert sorted(rows(r.text)) == sorted(data["bad"])
    assert r.text.count("−1.00") + r.text.count("-1.00") >= 3
    api = client.get("/api/turns", params={"reward": "negative"}).json()
    assert sorted(x["id"] for x in api["data"]) == sorted(data["bad"]) and api["has_more"] is False


def test_each_row_links_to_an_anchor_of_its_session(many: Any) -> None:
    client, data = many
    page = client.get("/admin/turns", params={"reward": "negative"}).text
    links = [unescape(h) for h in re.findall(r'class="permalink" href="([^"]+)"', page)]
    assert len(links) == 3
    for href in links:
        path, anchor = href.split("#")
        tid = anchor.removeprefix("turn-")
        assert path == f"/admin/sessions/{data['turns'][tid]}"
        session = client.get(path)
        assert session.status_code == 200
        assert f'id="{anchor}"' in session.text
        assert f'href="#{anchor}"' in session.text  # the visible permalink
        assert f'data-copy-json="/api/turns/{tid}"' in session.text  # copy as JSON
        assert f'data-copy-json="/api/sessions/{path.rsplit("/", 1)[1]}"' in session.text
        assert client.get(f"/api/turns/{tid}").json()["id"] == tid


def test_pages_older_then_newer_and_back(many: Any) -> None:
    client, data = many
    seen: list[str] = []
    url: str | None = "/admin/turns"
    pages = []
    while url:
        html = client.get(url).text
        pages.append((url, rows(html)))
        seen += rows(html)
        assert len(rows(html)) <= 50
        url = link(html, "older")
    assert sorted(seen) == sorted(data["turns"]) and len(seen) == len(set(seen)) == 180
    times = [r for r in seen]
    assert len(pages) == 4
    # newest first: the first row is the last turn written
    last_url, _ = pages[-1]
    html = client.get(last_url).text
    newer = link(html, "newer")
    assert newer is not None and rows(client.get(newer).text) == pages[-2][1]
    assert link(client.get("/admin/turns").text, "newer") is None
    assert times[0] == max(data["turns"], key=lambda t: list(data["turns"]).index(t))


@pytest.mark.parametrize("key,field", [("latency", "latency_ms"), ("tokens", "completion_tokens"), ("reward", "reward")])
def test_sorts_round_trip_through_the_url(many: Any, key: str, field: str) -> None:
    client, _ = many
    html = client.get("/admin/turns").text
    href = unescape(re.search(rf'href="(/admin/turns\?[^"]*)" [^>]*data-sort="{key}"', html).group(1))
    assert parse_qs(urlsplit(href).query)["sort"] == [key]
    desc = client.get(href)
    api = client.get("/api/turns?" + urlsplit(href).query + "&limit=500").json()["data"]
    values = [x[field] for x in api if x[field] is not None]
    assert values == sorted(values, reverse=True) and values
    assert rows(desc.text) == [x["id"] for x in api[:50]]
    # clicking the header again flips the order; the link carries it
    again = unescape(re.search(rf'href="(/admin/turns\?[^"]*)" [^>]*data-sort="{key}"', desc.text).group(1))
    assert parse_qs(urlsplit(again).query)["order"] == ["asc"]
    asc = client.get("/api/turns?" + urlsplit(again).query + "&limit=500").json()["data"]
    values = [x[field] for x in asc if x[field] is not None]
    assert values == sorted(values)


@hsettings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(reward=st.sampled_from(["", "positive", "negative", "unscored"]), status=st.sampled_from(["", "scored", "none"]),
       model=st.sampled_from(["", "m-a", "m-b"]), sort=st.sampled_from(["time", "reward", "latency", "tokens"]),
       order=st.sampled_from(["asc", "desc"]), hours=st.integers(0, 2))
def test_filters_round_trip_through_the_url(many: Any, reward: str, status: str, model: str, sort: str,
                                            order: str, hours: int) -> None:
    """Whatever the filters, the page's links keep them: the older link, the sort headers and
    the form's fields name the same view, and every row meets the filters."""
    client, _ = many
    params = {k: v for k, v in {"reward": reward, "status": status, "model": model, "sort": sort, "order": order,
                                "since": (T0 + timedelta(minutes=20 * hours)).isoformat() if hours else ""}.items() if v}
    r = client.get("/admin/turns", params=params)
    assert r.status_code == 200
    api = client.get("/api/turns", params={**params, "limit": 500}).json()["data"]
    assert rows(r.text) == [x["id"] for x in api[:50]]
    for x in api:
        assert not model or x["model"] == model
        assert reward != "negative" or (x["reward"] or 0) < 0
        assert reward != "positive" or (x["reward"] or 0) > 0
        assert status != "none" or x["judge_status"] is None
        assert not hours or x["created_at"] >= (T0 + timedelta(minutes=20 * hours)).isoformat()[:19]
    older = link(r.text, "older")
    if older:
        q = parse_qs(urlsplit(older).query)
        assert {k: v[0] for k, v in q.items() if k != "offset"} == {k: v for k, v in params.items()
                                                                    if not (k == "sort" and v == "time") and not (k == "order" and v == "desc")}
    for name in ("reward", "status", "model"):
        if params.get(name):
            assert re.search(rf'<option selected>{params[name]}</option>', r.text)


def test_bad_parameters_are_a_clear_400(many: Any) -> None:
    client, _ = many
    for params in ({"sort": "nope"}, {"order": "up"}, {"status": "x"}, {"offset": "-1"}, {"reward": "meh"}):
        r = client.get("/admin/turns", params=params)
        assert r.status_code == 400, params
        assert client.get("/api/turns", params=params).status_code == 400


def session_rows(html: str) -> list[str]:
    return re.findall(r'class="session-row" data-session="([^"]+)"', html)


def test_session_list_pages_both_ways_with_filters_in_the_url(many: Any) -> None:
    client, _ = many
    first = client.get("/admin/sessions", params={"model": "m-a"}).text
    assert 'method="get"' in first and 'hx-push-url="true"' in first
    assert link(first, "newer") is None
    ids1 = session_rows(first)
    assert len(ids1) == 30
    every = client.get("/admin/sessions").text
    ids_all = session_rows(every)
    older = link(every, "older")
    assert older and "cursor=" in older and len(ids_all) == 50
    second = client.get(older).text
    ids2 = session_rows(second)
    assert len(ids2) == 10 and not set(ids2) & set(ids_all) and link(second, "older") is None
    newer = link(second, "newer")
    assert newer and "before=" in newer
    back = client.get(newer).text
    assert session_rows(back) == ids_all
    assert link(back, "newer") is None
    # a filtered URL keeps its filter in the pager links
    filtered_older = link(client.get("/admin/sessions", params={"mode": "online"}).text, "older")
    assert filtered_older is None or "mode=online" in filtered_older
    # an htmx request for the same URL gets the rows alone, for the pushed URL to stay a page
    frag = client.get("/admin/sessions", params={"model": "m-a"}, headers={"HX-Request": "true", "HX-Target": "results"})
    assert "<html" not in frag.text and session_rows(frag.text) == ids1
    # the same URL answers two ways: no cache may serve the fragment for "back"
    assert "HX-Request" in frag.headers["vary"] and frag.headers["cache-control"] == "no-store"
    assert "HX-Request" in client.get("/admin/turns").headers["vary"]
    assert client.get("/admin/sessions", params={"before": "garbage"}).status_code == 400


@pytest.mark.parametrize("reward", ["", "positive", "negative", "tie", "unscored"])
def test_counts_agree_with_the_rows_for_every_reward_filter(database_url: str, reward: str) -> None:
    """The session list's counts, its rows and the turns view select the same turns, whichever
    reward filter (each count is a query of its own: a filter that breaks one shows here)."""
    from datapool import browse

    data = seed_many(database_url, n_sessions=12)
    engine = make_engine(database_url)
    with OrmSession(engine) as db:
        db.add(Judgement(turn_id=next(t for t in data["turns"] if t not in data["bad"] and db.get(Judgement, t) is None),
                         status="tie"))
        db.commit()
        f = browse.Browse(reward=reward or None)
        c = browse.counts(db, f)
        turns, _ = browse.turns_page(db, f, browse.TurnPage(), limit=1000)
        sessions, _ = browse.sessions_page(db, f, limit=1000, cursor=None)
        every, _ = browse.turns_page(db, browse.Browse(), browse.TurnPage(), limit=1000)
    engine.dispose()
    assert c["turns"] == len(turns) and c["sessions"] == len(sessions) == len({t["session_id"] for t in turns})
    bucket = {"positive": lambda t: (t["reward"] or 0) > 0, "negative": lambda t: (t["reward"] or 0) < 0,
              "tie": lambda t: t["reward"] is None and t["judge_status"] == "tie",
              "unscored": lambda t: t["reward"] is None and t["judge_status"] != "tie"}
    for name, inside in bucket.items():
        want = [t["id"] for t in every if inside(t)]
        if name == reward:
            assert sorted(t["id"] for t in turns) == sorted(want)
        if not reward:
            assert c[name] == len(want), name


def test_wire_format_in_the_api_turns_and_the_export(sqlite_url: str, tmp_path: Path) -> None:
    """Each turn says which API its client spoke, in /api/turns and in both export formats, and
    both select by it."""
    import io
    import json

    import pyarrow.parquet as pq

    engine = make_engine(sqlite_url)
    ids: dict[str, str] = {}
    with OrmSession(engine) as db:
        db.add(Session(id="mixed", source="header", created_at=T0))
        db.flush()
        for i, fmt in enumerate(("chat", "completions", "responses", "messages")):
            ids[fmt] = tid = str(uuid.uuid4())
            completions = fmt == "completions"
            db.add(Turn(id=tid, session_id="mixed", turn_type="main", endpoint="completions" if completions else "chat",
                        wire_format=fmt, status="ok", created_at=T0 + timedelta(seconds=i), model="m",
                        capture="black-box",
                        request={"prompt": "p"} if completions else {"messages": [{"role": "user", "content": "q"}]},
                        response={"choices": [{"index": 0, "text": "a"} if completions else
                                              {"index": 0, "message": {"role": "assistant", "content": "a"}}]}))
        db.commit()
    engine.dispose()
    settings = Settings(upstream_url="http://127.0.0.1:9/v1", database_url=sqlite_url, admin_token="tok-123",
                        data_dir=tmp_path / "data")
    with TestClient(create_app(settings), headers={"Authorization": "Bearer tok-123"}) as client:
        listed = client.get("/api/turns").json()["data"]
        assert {x["id"]: x["wire_format"] for x in listed} == {tid: fmt for fmt, tid in ids.items()}
        assert [x["id"] for x in client.get("/api/turns", params={"wire_format": "messages"}).json()["data"]] == [
            ids["messages"]]
        r = client.get("/api/turns", params={"wire_format": "grpc"})
        assert r.status_code == 400 and "wire_format" in r.json()["error"]["message"]
        lines = client.get("/api/export", params={"format": "jsonl"}).text.splitlines()
        assert {(x := json.loads(line))["id"]: x["extra_info"]["wire_format"] for line in lines} == {
            tid: fmt for fmt, tid in ids.items()}
        r = client.get("/api/export", params={"format": "parquet", "wire_format": "responses"})
        table = pq.read_table(io.BytesIO(r.content)).to_pylist()
        assert [(x["id"], x["extra_info"]["wire_format"]) for x in table] == [(ids["responses"], "responses")]
