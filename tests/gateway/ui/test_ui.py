"""The admin UI's server side without a browser: every admin route is behind the login, CSRF,
labels reaching the trainer (lease, samples, scorer), filters and the streamed export."""

from __future__ import annotations

import io
import json
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session as OrmSession

from base.errors import FilterError, LabelError
from datapool import browse, labels
from datapool.db import make_engine
from datapool.models import Judgement, Label, Turn
from gateway.app import create_app
from base.settings import Settings
from tests.support.admin_ui import PUBLIC, admin_routes, csrf_of, login
from tests.support.ui_seed import TOOL_WORD, seed
from datapool import leases as lease

def fill(path: str) -> str:
    return re.sub(r"\{(\w+)(:[^}]*)?\}", lambda m: "jsonl" if m.group(1) == "fmt" else "x", path)


@pytest.fixture
def app_and_ids(database_url: str, tmp_path: Path) -> Iterator[tuple[TestClient, dict[str, str], str]]:
    engine = make_engine(database_url)
    ids = seed(engine)
    engine.dispose()
    settings = Settings(upstream_url="http://127.0.0.1:9/v1", database_url=database_url, admin_token="tok-123",
                        admin_password="pw-456", data_dir=tmp_path / "data")
    with TestClient(create_app(settings)) as client:
        yield client, ids, database_url


def test_every_admin_route_needs_a_login(app_and_ids: Any) -> None:
    client, _, _ = app_and_ids
    routes = admin_routes(client.app)
    # the enumeration really sees the admin surface (a regression here would make the test vacuous)
    assert {("GET", "/admin/sessions"), ("POST", "/admin/turns/{turn_id}/labels"), ("GET", "/api/sessions"),
            ("POST", "/api/policy/promote"), ("GET", "/admin/export.{fmt}")} <= set(routes)
    assert len(routes) >= 25
    forged = {"nextstate_admin": "eyJ1IjoiYWxpY2UiLCJjIjoieCJ9.forged.sig"}
    for method, path in routes:
        if (method, path) in PUBLIC:
            continue
        url = fill(path)
        for cookies in ({}, forged):
            client.cookies.clear()
            for k, v in cookies.items():
                client.cookies.set(k, v)
            r = client.request(method, url, follow_redirects=False)
            ok = r.status_code in (401, 403) or (
                r.status_code == 303 and r.headers["location"].startswith("/admin/login"))
            assert ok, f"{method} {path} answered {r.status_code} without a login"
        r = client.request(method, url, headers={"Authorization": "Bearer wrong"}, follow_redirects=False)
        assert r.status_code in (303, 401, 403), f"{method} {path} took a wrong bearer token"
    client.cookies.clear()
    # static files are public, and only they are
    assert client.get("/admin/static/htmx.min.js").status_code == 200
    assert client.get("/admin/login").status_code == 200


def test_login_logout_token_password_and_csrf(app_and_ids: Any) -> None:
    client, ids, _ = app_and_ids
    bad = client.post("/admin/login", data={"secret": "nope"}, follow_redirects=False)
    assert bad.status_code == 401 and "Wrong token or password" in bad.text
    assert "nextstate_admin" not in client.cookies
    csrf = login(client, "pw-456", "bob")  # the password works as well as the token
    cookie = client.cookies.get("nextstate_admin")
    assert cookie and "pw-456" not in cookie
    url = f"/admin/turns/{ids['weather_call']}/labels"
    assert client.post(url, data={"kind": "thumb", "value": "1"}).status_code == 403  # no CSRF token
    assert client.post(url, data={"kind": "thumb", "value": "1", "csrf_token": "x" + csrf}).status_code == 403
    r = client.post(url, data={"kind": "thumb", "value": "1", "csrf_token": csrf}, headers={"HX-Request": "true"})
    assert r.status_code == 200 and "▲ thumbs up" in r.text
    r = client.post(url, data={"kind": "thumb", "value": "1"}, headers={"HX-Request": "true", "X-CSRF-Token": csrf})
    assert r.status_code == 200
    # the JSON API takes the session too, with the CSRF header for a change
    api = f"/api/turns/{ids['weather_call']}/labels"
    assert client.post(api, json={"kind": "tag", "value": "x"}).status_code == 403
    r = client.post(api, json={"kind": "tag", "value": "weather"}, headers={"X-CSRF-Token": csrf})
    assert r.status_code == 200 and r.json()["author"] == "bob"
    history = client.get(api).json()["history"]
    assert [(h["kind"], h["author"]) for h in history][:3] == [("thumb", "bob"), ("thumb", "bob"), ("tag", "bob")]
    assert all(h["created_at"] for h in history)
    # a corrected reply re-queues the turn for scoring (the scorer makes it the OPD hint)
    r = client.post(api, json={"kind": "correction", "value": "Ask which city first."}, headers={"X-CSRF-Token": csrf})
    assert r.status_code == 200 and r.json()["queued"] == [ids["weather_call"]]
    with OrmSession(make_engine(app_and_ids[2])) as db:
        assert db.get(Judgement, ids["weather_call"]).status == "pending"
    # bad label values are refused with an OpenAI-shaped error
    r = client.post(api, json={"kind": "override", "value": 7}, headers={"X-CSRF-Token": csrf})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_label"
    r = client.post("/api/turns/nope/labels", json={"kind": "thumb", "value": 1}, headers={"X-CSRF-Token": csrf})
    assert r.status_code == 404
    client.post("/admin/logout", data={"csrf_token": csrf})
    assert client.get("/admin/sessions", follow_redirects=False).status_code == 303
    # the bearer token keeps working for programs, without CSRF
    client.cookies.clear()
    r = client.post(api, json={"kind": "note", "value": "from a script", "author": "ci"},
                    headers={"Authorization": "Bearer tok-123"})
    assert r.status_code == 200 and r.json()["author"] == "ci (via token)"
    assert client.get("/api/sessions", headers={"Authorization": "Bearer tok-123"}).status_code == 200


def test_open_mode_still_checks_csrf(sqlite_url: str, tmp_path: Path) -> None:
    engine = make_engine(sqlite_url)
    ids = seed(engine)
    settings = Settings(upstream_url="http://127.0.0.1:9/v1", database_url=sqlite_url, data_dir=tmp_path / "d")
    with TestClient(create_app(settings)) as client:
        page = client.get("/admin/sessions")
        assert page.status_code == 200 and "nextstate_admin" in client.cookies
        csrf = csrf_of(page.text)
        url = f"/admin/turns/{ids['xss_turn']}/labels"
        assert client.post(url, data={"kind": "exclude", "value": "true"}).status_code == 403
        r = client.post(url, data={"kind": "exclude", "value": "true", "csrf_token": csrf},
                        headers={"HX-Request": "true"})
        assert r.status_code == 200 and "excluded from training" in r.text
        client.cookies.clear()  # a program without a cookie: the open API as before
        assert client.get("/api/sessions").status_code == 200


def test_labels_change_what_the_trainer_sees(database_url: str) -> None:
    engine = make_engine(database_url)
    ids = seed(engine)

    def leased(**kw: Any) -> set[str]:
        run = lease.start_run(engine, objective="rl", backend="local", config={}, base_version=None)
        return set(lease.lease(engine, run, limit=100, filters=lease.Filters(**kw)))

    before = leased()
    assert ids["weather_call"] in before and ids["eval_turn"] not in before
    with OrmSession(engine) as db, db.begin():
        labels.add_label(db, kind="exclude", value=True, author="t", turn_id=ids["weather_call"])
        labels.add_label(db, kind="exclude", value=True, author="t", session_id=ids["xss"])
        labels.add_label(db, kind="thumb", value=1, author="t", turn_id=ids["offline_0"])
        labels.add_label(db, kind="tag", value="good", author="t", session_id=ids["weather"])
    after = leased()
    assert after == before - {ids["weather_call"], ids["xss_turn"]}
    assert leased(labels=("thumb-up",)) == {ids["offline_0"]}
    assert leased(labels=("tag:good",)) == {ids["weather_reply"]}
    assert leased(labels=("unlabeled",)) == after - {ids["offline_0"], ids["weather_reply"]}
    # a turn's own label wins over its session's; null withdraws
    with OrmSession(engine) as db, db.begin():
        labels.add_label(db, kind="exclude", value=False, author="t", turn_id=ids["xss_turn"])
        labels.add_label(db, kind="exclude", value=None, author="t", turn_id=ids["weather_call"])
    assert leased() == before

    # an override replaces the judge's reward in the trainer's samples
    from trainer.samples import load_samples

    with OrmSession(engine) as db, db.begin():
        labels.add_label(db, kind="override", value=-0.5, author="t", turn_id=ids["offline_0"])
        labels.add_label(db, kind="override", value=0.25, author="t", session_id=ids["weather"])
    with OrmSession(engine) as db:
        got = {s.turn_id: s.reward for s in load_samples(db, [ids["offline_0"], ids["offline_1"],
                                                                ids["weather_reply"]])}
    assert got == {ids["offline_0"]: -0.5, ids["offline_1"]: -1.0, ids["weather_reply"]: 0.25}
    with pytest.raises(LabelError):
        lease.lease(engine, "r", limit=1, filters=lease.Filters(labels=("bogus",)))
    engine.dispose()


def test_correction_becomes_the_opd_hint_with_teacher_logprobs(pg_url: str, vllm_server: Any,
                                                              teacher_server: Any) -> None:
    """A person's corrected reply outranks the judges' hints and the user's feedback text; the
    scorer computes the turn's teacher logprobs under it on the real teacher replica."""
    import httpx

    from scoring.judge import PythonJudge
    from scoring.score import TeacherConfig, score_turn
    from trainer.samples import load_samples

    root = vllm_server.base_url.removesuffix("/v1")
    engine = make_engine(pg_url)
    ids = seed(engine, lambda text: httpx.post(f"{root}/tokenize", json={
        "model": "smollm2", "prompt": text, "add_special_tokens": False}, timeout=30).json()["tokens"])
    tid = ids["xss_turn"]  # its feedback vote carries a hint of its own
    judge, teacher = PythonJudge("tests.support.judges:verdict"), TeacherConfig(api_base=teacher_server.base_url)
    score_turn(engine, tid, judge, 1, teacher)
    with OrmSession(engine) as db:
        j = db.get(Judgement, tid)
        first = (j.hint, list(j.teacher_logprobs or []))
    assert first[0] == "the user disagreed" and first[1]
    with OrmSession(engine) as db, db.begin():
        labels.add_label(db, kind="correction", value="It is 4.", author="t", turn_id=tid)
    score_turn(engine, tid, judge, 1, teacher)
    with OrmSession(engine) as db:
        j = db.get(Judgement, tid)
        assert (j.hint, j.hint_source) == ("It is 4.", "label")
        assert j.teacher_logprobs and len(j.teacher_logprobs) == len(db.get(Turn, tid).token_ids)
        assert j.teacher_logprobs != first[1]  # recomputed under the correction
        (sample,) = load_samples(db, [tid])
    assert sample.teacher_logprobs == j.teacher_logprobs
    engine.dispose()


def test_filters_search_and_counts(database_url: str) -> None:
    engine = make_engine(database_url)
    ids = seed(engine)

    def find(**kw: Any) -> set[str]:
        with OrmSession(engine) as db:
            page, _ = browse.sessions_page(db, browse.Browse.from_params(kw), limit=100, cursor=None)
            return {s["id"] for s in page}

    every = find()
    assert len(every) == 8
    assert find(q=TOOL_WORD) == {ids["weather"]}  # only in a tool result
    assert find(q="parcel sunny") == {ids["weather"]}
    assert find(mode="eval") == {ids["eval"]}
    assert find(reward="tie") == {ids["eval"]}
    assert find(reward="unscored") == {ids["unscored"]}
    assert find(capture="black-box") == {ids["eval"]}
    assert find(model="gpt-4o-mini") == {ids["eval"]}
    assert find(turn_type="side") == {ids["weather"]}
    assert len(find(task_id="task-7")) == 4 == len(find(policy_version="v-seed"))
    assert len(find(reward="negative", mode="offline")) == 2
    with OrmSession(engine) as db:
        c = browse.counts(db, browse.Browse(mode="offline"))
    assert c == {"sessions": 4, "turns": 4, "positive": 2, "negative": 2, "neutral": 0, "tie": 0, "unscored": 0,
                 "siblings": 0}
    # cursor pages cover everything once
    seen: list[str] = []
    cursor = None
    with OrmSession(engine) as db:
        while True:
            page, cursor = browse.sessions_page(db, browse.Browse(), limit=3, cursor=cursor)
            seen += [s["id"] for s in page]
            if cursor is None:
                break
    assert len(seen) == len(set(seen)) == 8
    with pytest.raises(FilterError, match="mode"):
        browse.Browse.from_params({"mode": "weird"})
    engine.dispose()


def test_export_streams_and_round_trips(app_and_ids: Any, tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets", reason="reading the export back with HF datasets")
    client, ids, url = app_and_ids
    login(client)
    offline = {ids[f"offline_{i}"] for i in range(4)}
    r = client.get("/admin/export.jsonl", params={"mode": "offline", "reward": "positive"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
    rows = [json.loads(line) for line in r.text.splitlines()]
    assert {x["id"] for x in rows} == {ids["offline_0"], ids["offline_2"]}
    assert all(x["reward"] == 1.0 and x["prompt"][0]["role"] == "user" and x["response"] for x in rows)
    r = client.get("/api/export", params={"format": "parquet", "task_id": "task-7"},
                   headers={"Authorization": "Bearer tok-123"})
    assert r.status_code == 200
    table = pq.read_table(io.BytesIO(r.content))
    assert set(table.column("id").to_pylist()) == offline
    # Hugging Face datasets reads both files; veRL reads `prompt` as chat messages
    (tmp_path / "t.parquet").write_bytes(r.content)
    ds = datasets.load_dataset("parquet", data_files=str(tmp_path / "t.parquet"), split="train",
                               cache_dir=str(tmp_path / "hf"))
    assert set(ds["id"]) == offline and ds[0]["prompt"][0]["content"].startswith("Solve puzzle")
    assert ds[0]["extra_info"]["task_id"] == "task-7" and ds[0]["data_source"] == "nextstate"
    # several row groups when the selection spans batches (streamed, not built whole)
    from datapool import export

    engine = make_engine(url)
    chunks = list(export.parquet(engine, browse.Browse(), batch=3))
    engine.dispose()
    assert len(chunks) >= 4
    meta = pq.ParquetFile(io.BytesIO(b"".join(chunks))).metadata
    assert meta.num_row_groups == 4 and meta.num_rows == 10


_JSON = st.recursive(
    st.none() | st.booleans() | st.floats() | st.integers(min_value=-(2**70), max_value=2**70) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(value=_JSON)
def test_export_json_is_strict_json_of_any_stored_value(value: Any) -> None:
    """The export writes with orjson and falls back to the standard library for what orjson
    refuses (integers past 64 bits): any JSON a client sent reads back with a strict parser,
    equal to what was stored, a float that is not finite as null."""
    from datapool.export import _dumps

    def finite(v: Any) -> Any:
        if isinstance(v, float):
            return v if math.isfinite(v) else None
        if isinstance(v, dict):
            return {k: finite(x) for k, x in v.items()}
        if isinstance(v, list):
            return [finite(x) for x in v]
        return v

    def strict(token: str) -> Any:
        raise ValueError(f"not JSON: {token}")

    assert json.loads(_dumps(value), parse_constant=strict) == finite(value)


def test_label_rows_are_never_rewritten(sqlite_url: str) -> None:
    engine = make_engine(sqlite_url)
    ids = seed(engine)
    with OrmSession(engine) as db, db.begin():
        for v in (1, -1, None):
            labels.add_label(db, kind="thumb", value=v, author="a", turn_id=ids["weather_call"])
    with OrmSession(engine) as db:
        assert [r.value for r in db.query(Label).order_by(Label.id)] == [1, -1, None]
        state = labels.for_turns(db, [ids["weather_call"]])[ids["weather_call"]]
    assert "thumb" not in state["effective"] and len(state["history"]) == 3
    engine.dispose()


def test_train_labels_option() -> None:
    from click.testing import CliRunner

    from nextstate.cli import main

    res = CliRunner().invoke(main, ["train", "--objective", "rl", "--labels", "bogus"])
    assert res.exit_code == 2 and "unknown labels filter 'bogus'" in res.output
    res = CliRunner().invoke(main, ["train", "--help"])
    assert "--labels LABEL" in res.output and "tag:NAME" in res.output


DOC_ROUTES = ("/openapi.json", "/docs", "/redoc")


def test_api_docs_need_the_admin_token_when_one_is_set(app_and_ids: Any) -> None:
    client, _, _ = app_and_ids
    client.cookies.clear()
    for path in DOC_ROUTES:
        assert client.get(path).status_code == 401, path
        assert client.get(path, headers={"Authorization": "Bearer wrong"}).status_code == 401, path
        r = client.get(path, headers={"Authorization": "Bearer tok-123"})
        assert r.status_code == 200, path
    spec = client.get("/openapi.json", headers={"Authorization": "Bearer tok-123"}).json()
    assert "/v1/chat/completions" in spec["paths"] and "/api/sessions" in spec["paths"]
    assert "/openapi.json" not in spec["paths"]  # the docs routes do not document themselves
    login(client)  # a UI login reaches them too: a browser opening /docs after logging in
    assert client.get("/docs").status_code == 200 and client.get("/openapi.json").status_code == 200


def test_api_docs_are_open_without_admin_auth(sqlite_url: str, tmp_path: Path) -> None:
    settings = Settings(upstream_url="http://127.0.0.1:9/v1", database_url=sqlite_url, data_dir=tmp_path / "d")
    with TestClient(create_app(settings)) as client:
        for path in DOC_ROUTES:
            assert client.get(path).status_code == 200, path
        assert "openapi.json" in client.get("/docs").text
        assert client.get("/openapi.json").json()["info"]["title"] == "nextstate gateway"


def _queued_turns(data_dir: Path) -> list[str]:
    """The turn ids of the scoring tasks in the embedded broker (kombu's SQLAlchemy transport)."""
    import sqlalchemy as sa
    engine = sa.create_engine(f"sqlite:///{data_dir / 'broker.sqlite'}")
    try:
        with engine.connect() as c:
            if not sa.inspect(c).has_table("kombu_message"):
                return []  # nothing sent yet
            bodies = [r[0] for r in c.execute(sa.text("select payload from kombu_message"))]
    finally:
        engine.dispose()
    out = []
    for raw in bodies:
        msg = json.loads(raw)
        body = json.loads(__import__("base64").b64decode(msg["body"])) if msg.get("properties", {}).get(
            "body_encoding") == "base64" else msg["body"]
        out.append(body[0][0])
    return out


def test_judgements_page_retry_one_and_all_dead(app_and_ids: Any, tmp_path: Path) -> None:
    from datapool.judgements import mark_dead, record_failure
    client, ids, url = app_and_ids
    engine = make_engine(url)
    record_failure(engine, ids["offline_1"], "judge timed out")
    mark_dead(engine, ids["offline_1"], "HTTP 400 from judge: context too long <b>x</b>", "context_window_exceeded")
    mark_dead(engine, ids["offline_3"], "judge answered 500 three times", "retries_exhausted")
    mark_dead(engine, ids["offline_0"], "judge answered 500 three times", "retries_exhausted")
    csrf = login(client)
    nav = client.get("/admin/judgements/dead-count")
    assert nav.status_code == 200 and ">3<" in nav.text
    assert 'hx-get="/admin/judgements/dead-count"' in client.get("/admin/sessions").text  # in every page's nav
    page = client.get("/admin/judgements?status=dead")
    assert page.status_code == 200
    assert "context_window_exceeded" in page.text and "retries_exhausted" in page.text
    assert "HTTP 400 from judge: context too long &lt;b&gt;x&lt;/b&gt;" in page.text  # last_error, escaped
    assert ids["offline_1"] in page.text and ids["weather_call"] not in page.text
    row = re.search(rf'<tr id="judgement-{ids["offline_1"]}">.*?</tr>', page.text, re.S).group(0)
    assert "<td>1</td>" in row  # its retry count
    # the filter lives in the URL
    one_reason = client.get("/admin/judgements?status=dead&reason=context_window_exceeded").text
    assert ids["offline_1"] in one_reason and ids["offline_3"] not in one_reason
    assert ids["eval_turn"] in client.get("/admin/judgements?status=tie").text
    assert client.get("/admin/judgements?status=bogus").status_code == 400

    # retry needs the CSRF token
    retry_url = f"/admin/judgements/{ids['offline_1']}/retry"
    assert client.post(retry_url, data={}).status_code == 403
    assert client.post("/admin/judgements/retry", data={"csrf_token": "x" + csrf}).status_code == 403
    with OrmSession(engine) as db:
        assert db.get(Judgement, ids["offline_1"]).status == "dead"
    before = _queued_turns(tmp_path / "data")
    r = client.post(retry_url, data={"csrf_token": csrf, "status": "dead"}, follow_redirects=False)
    assert r.status_code == 303 and "retried=1" in r.headers["location"]
    with OrmSession(engine) as db:
        j = db.get(Judgement, ids["offline_1"])
        assert (j.status, j.dead_reason) == ("pending", None) and j.enqueued_at is not None
    assert _queued_turns(tmp_path / "data")[len(before):] == [ids["offline_1"]]  # the task was sent
    assert ">2<" in client.get("/admin/judgements/dead-count").text
    assert client.post(retry_url, data={"csrf_token": csrf}).status_code == 404  # pending now: nothing to retry
    assert ids["offline_1"] in client.get("/admin/judgements?status=pending").text

    # bulk: every dead one matching the filter, and only those
    r = client.post("/admin/judgements/retry", data={"csrf_token": csrf, "reason": "retries_exhausted"})
    assert r.status_code == 200 and "2 judgements re-queued" in r.text
    with OrmSession(engine) as db:
        assert {db.get(Judgement, ids[k]).status for k in ("offline_0", "offline_3")} == {"pending"}
        assert db.get(Judgement, ids["eval_turn"]).status == "tie"  # not dead: untouched
    assert sorted(_queued_turns(tmp_path / "data")[len(before) + 1:]) == sorted([ids["offline_0"], ids["offline_3"]])
    assert client.get("/admin/judgements/dead-count").text == ""
    engine.dispose()


def test_remove_a_tag_from_a_turn_and_a_session(app_and_ids: Any) -> None:
    client, ids, url = app_and_ids
    csrf = login(client)
    hx = {"HX-Request": "true"}
    turn, sid = ids["weather_reply"], ids["weather"]
    engine = make_engine(url)

    def tagged(name: str) -> set[str]:
        with OrmSession(engine) as db:
            page, _ = browse.sessions_page(db, browse.Browse.from_params({"label": f"tag:{name}"}), limit=100,
                                           cursor=None)
            return {s["id"] for s in page}

    turl = f"/admin/turns/{turn}/labels"
    for tag in ("wrong-tool", "keep"):
        assert client.post(turl, data={"kind": "tag", "value": tag, "csrf_token": csrf}, headers=hx).status_code == 200
    assert tagged("wrong-tool") == {sid}
    assert client.post(turl, data={"kind": "untag", "value": "wrong-tool"}, headers=hx).status_code == 403  # CSRF
    r = client.post(turl, data={"kind": "untag", "value": "wrong-tool", "csrf_token": csrf}, headers=hx)
    assert r.status_code == 200 and "#keep" in r.text and "#wrong-tool" not in r.text
    assert 'aria-label="remove tag keep"' in r.text
    assert tagged("wrong-tool") == set() and tagged("keep") == {sid}
    # tagged again later: back (the history keeps every step)
    r = client.post(turl, data={"kind": "tag", "value": "wrong-tool", "csrf_token": csrf}, headers=hx)
    assert "#wrong-tool" in r.text and tagged("wrong-tool") == {sid}
    with OrmSession(engine) as db:
        history = [h["kind"] for h in labels.for_turns(db, [turn])[turn]["history"]]
    assert history == ["tag", "tag", "untag", "tag"]

    # a session's tag: removed from the session; a session tag shown on a turn has no × there
    surl = f"/admin/sessions/{sid}/labels"
    client.post(surl, data={"kind": "tag", "value": "flaky", "csrf_token": csrf}, headers=hx)
    page = client.get(f"/admin/sessions/{sid}").text
    assert 'aria-label="remove tag flaky"' in page and page.count('aria-label="remove tag flaky"') == 1
    r = client.post(surl, data={"kind": "untag", "value": "flaky", "csrf_token": csrf}, headers=hx)
    assert r.status_code == 200 and "#flaky" not in r.text and tagged("flaky") == set()
    engine.dispose()


@pytest.mark.parametrize("kind,value,says", [
    ("tag", "wrong tool", "Tag 'wrong tool' is not allowed: it has a space"),
    ("tag", "-x", "it must start with a letter or digit"),
    ("tag", "x" * 70, "is 70 characters long"),
    ("tag", "", "Type a tag first"),
    ("override", "abc", "The score override must be a number from -1 to 1 (e.g. -0.5), not 'abc'"),
    ("override", "2", "not '2'"),
    ("thumb", "7", "A thumb is 1 (up) or -1 (down), not '7'"),
])
def test_bad_label_input_gets_a_clear_message(app_and_ids: Any, kind: str, value: str, says: str) -> None:
    client, ids, url = app_and_ids
    csrf = login(client)
    turn = ids["weather_call"]
    r = client.post(f"/admin/turns/{turn}/labels", data={"kind": kind, "value": value, "csrf_token": csrf},
                    headers={"HX-Request": "true"})
    assert r.status_code == 200  # the fragment comes back with the message in place
    shown = re.search(r'<p class="error" role="alert">([^<]*)</p>', r.text)
    assert shown and says.replace("'", "&#39;") in shown.group(1)
    # the API answers the same words as an OpenAI-shaped 400; nothing was stored
    api = client.post(f"/api/turns/{turn}/labels", json={"kind": kind, "value": value},
                      headers={"X-CSRF-Token": csrf})
    assert api.status_code == 400 and says in api.json()["error"]["message"]
    engine = make_engine(url)
    with OrmSession(engine) as db:
        assert labels.for_turns(db, [turn])[turn]["history"] == []
    engine.dispose()
