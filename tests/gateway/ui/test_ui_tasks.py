"""Tasks people do in the admin UI, done in a real headless Chromium (Debian's `chromium`, driven
by Playwright) against a gateway process on real PostgreSQL (issue 18):

1. among 200 sessions, find the three −1 turns of today through the turns view's filters and
   label one (the label is in the pool);
2. open a dead judgement in /admin/judgements, read its reason and last error, retry it: it is
   re-queued the way the sweep re-queues (pending in the pool, its task on the broker);
3. share a filtered URL: open it in a fresh browser context, log in with the admin token, and
   see the same filtered rows.

No model server is needed: the sessions are written as the gateway and the scorer leave them.
"""

from __future__ import annotations

import sqlite3
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session as OrmSession

from datapool import judgements
from datapool.models import Judgement, Label, Session, Turn
from tests.support.browser import require_chromium
from tests.support.processes import GatewayProcess

TOKEN = "tasks-token-" + uuid.uuid4().hex[:6]
DEAD_ERROR = "judge timed out after 60 s (attempt 3 of 3)"

require_chromium()  # skips this module, saying why, without Playwright or chromium


def seed(module_engine: Any) -> dict[str, Any]:
    """200 sessions of two main turns over the last six days: judged +1, unjudged, seven −1
    turns (three of them today), and one judgement dead-lettered by the scorer's own calls."""
    now = datetime.now(UTC).replace(microsecond=0)
    today = now.replace(hour=0, minute=0, second=0)
    span = now - today  # today so far: today's sessions are spread over it
    out: dict[str, Any] = {"today_bad": [], "old_bad": [], "today": today}
    with OrmSession(module_engine) as db, db.begin():
        for s in range(200):
            # sessions 0-19 today, the rest one to six days back
            at = today + span * (s + 1) / 22 if s < 20 else now - timedelta(days=1 + (s % 6), minutes=s)
            sid = f"task-{s:03d}-{uuid.uuid4().hex[:4]}"
            db.add(Session(id=sid, source="header", mode="online", created_at=at, updated_at=at))
            db.flush()
            for j in range(2):
                tid = str(uuid.uuid4())
                db.add(Turn(id=tid, session_id=sid, turn_type="main", endpoint="chat", status="ok",
                            created_at=at + timedelta(seconds=j), model="smollm2", upstream_model="smollm2",
                            capture="black-box", latency_ms=100.0 + s, usage={"prompt_tokens": 20, "completion_tokens": 5},
                            request={"messages": [{"role": "user", "content": f"task {s} step {j}"}]},
                            response={"choices": [{"index": 0, "finish_reason": "stop",
                                                   "message": {"role": "assistant", "content": f"reply {s}.{j}"}}]},
                            next_state={"messages": [{"role": "user", "content": "ok"}]}))
                db.flush()
                bad = (s in (3, 11, 17) and j == 1) or (s in (40, 77, 123, 190) and j == 0)
                if bad:
                    out["today_bad" if s < 20 else "old_bad"].append(tid)
                if bad or (s + j) % 3:
                    db.add(Judgement(turn_id=tid, status="scored", reward=-1.0 if bad else 1.0, prm_reward=-1.0 if bad else 1.0,
                                     attempts=1, judge="test-judge"))
                elif s == 51 and j == 0:
                    out["dead"], out["dead_session"] = tid, sid
    # the scorer's path to a dead letter: pending, a transient failure, then out of retries
    with OrmSession(module_engine) as db, db.begin():
        judgements.mark_pending(db, [out["dead"]])
    judgements.record_failure(module_engine, out["dead"], "judge timed out after 60 s (attempt 2 of 3)")
    judgements.mark_dead(module_engine, out["dead"], DEAD_ERROR, reason="retries_exhausted")
    return out


@pytest.fixture(scope="module")
def data(module_engine: Any) -> dict[str, Any]:
    return seed(module_engine)


@pytest.fixture(scope="module")
def gateway(module_db_url: str, data: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    # no model is called: the upstream is a closed port
    with GatewayProcess(tmp_path_factory.mktemp("tasks-gw"), database_url=module_db_url, upstream_url="http://127.0.0.1:9/v1",
                        env={"NEXTSTATE_ADMIN_TOKEN": TOKEN}) as gw:
        yield gw


def logged_in(browser: Any, gateway: GatewayProcess, who: str, url: str = "/admin/turns") -> tuple[Any, Any]:
    """A fresh context (no cookies) that opens *url*, is sent to the login page, logs in with the
    admin token and lands on *url*."""
    context = browser.new_context(viewport={"width": 1360, "height": 900}, base_url=gateway.url)
    context.set_default_timeout(30_000)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.js_errors = errors
    page.goto(url)
    assert "/admin/login" in page.url
    page.fill("input[name=name]", who)
    page.fill("input[name=secret]", TOKEN)
    page.click("button[type=submit]")
    page.wait_for_url(lambda u: "/admin/login" not in u)
    return context, page


@pytest.fixture(scope="module")
def page(browser: Any, gateway: GatewayProcess) -> Iterator[Any]:
    context, tab = logged_in(browser, gateway, "alice")
    yield tab
    context.close()


def turn_rows(page: Any) -> list[str]:
    rows = page.locator("tr.turn-row")
    return [rows.nth(i).get_attribute("data-turn-row") for i in range(rows.count())]


def wait_rows(page: Any, n: int) -> None:
    page.wait_for_function("n => document.querySelectorAll('tr.turn-row').length === n", arg=n)


def test_find_todays_three_negative_turns_among_200_sessions_and_label_one(
        page: Any, module_engine: Any, data: dict[str, Any]) -> None:
    page.goto("/admin/turns")
    assert len(turn_rows(page)) == 50  # 400 turns: a page of them
    page.select_option("select[name=reward]", "negative")
    page.wait_for_url("**/admin/turns?*reward=negative*")
    wait_rows(page, 7)  # every −1 turn of the week
    page.fill("input[name=since]", data["today"].strftime("%Y-%m-%dT%H:%M"))
    page.locator("input[name=since]").dispatch_event("change")
    page.wait_for_url("**/admin/turns?*since=*")
    wait_rows(page, 3)
    found = turn_rows(page)
    assert sorted(found) == sorted(data["today_bad"])
    assert page.locator("tr.turn-row td.reward.neg").count() == 3
    # open the newest one at its turn, thumb it down with the keyboard and tag it
    target = found[0]
    page.locator(f"tr[data-turn-row='{target}'] a.permalink").click()
    page.wait_for_url(f"**/admin/sessions/*#turn-{target}")
    card = page.locator(f"#turn-{target}")
    assert "focused" in (card.get_attribute("class") or "")
    page.keyboard.press("d")
    card.locator(".badge.neg").first.wait_for()
    with OrmSession(module_engine) as db:
        stored = [(r.kind, r.value, r.author) for r in db.scalars(
            select(Label).where(Label.turn_id == target).order_by(Label.id))]
    assert stored == [("thumb", -1, "alice")]
    # the turns view shows the label, and finds the turn by it
    page.goto(f"/admin/turns?reward=negative&label=thumb-down&since={data['today'].strftime('%Y-%m-%dT%H:%M')}")
    assert turn_rows(page) == [target]
    assert "thumb:-1" in page.locator(f"tr[data-turn-row='{target}']").inner_text()
    assert not page.js_errors


def test_open_a_dead_judgement_read_why_and_retry_it(page: Any, module_engine: Any, data: dict[str, Any],
                                                     gateway: GatewayProcess) -> None:
    dead = data["dead"]
    before = datetime.now(UTC)
    page.goto("/admin/sessions")
    assert page.locator("#dead-count .badge.dead").inner_text() == "1"  # the dead-letter count in the nav
    page.goto("/admin/judgements?status=dead")
    row = page.locator(f"#judgement-{dead}")
    assert "retries_exhausted" in row.inner_text()
    assert row.locator("pre.last-error").inner_text() == f"retries_exhausted: {DEAD_ERROR}"
    assert row.locator("td").nth(4).inner_text() == "1"  # the transient failure before it died
    row.get_by_role("button", name="Retry").click()
    page.wait_for_url("**/admin/judgements?*retried=1*")
    assert "1 judgement re-queued." in page.get_by_role("status").inner_text()
    assert page.locator(f"#judgement-{dead}").count() == 0
    page.wait_for_load_state("networkidle")  # the nav's count has loaded: none dead now
    assert page.locator("#dead-count .badge").count() == 0
    # the pool: pending again, no dead reason, enqueued now — what the sweep's mark_pending writes
    with OrmSession(module_engine) as db:
        j = db.get(Judgement, dead)
        assert (j.status, j.dead_reason) == ("pending", None)
        assert j.enqueued_at is not None and j.enqueued_at.replace(tzinfo=UTC) >= before - timedelta(seconds=1)
    # ... and the scoring task went to the broker (the gateway's embedded one) through the Enqueuer
    broker = gateway.data_dir / "broker.sqlite"
    with sqlite3.connect(broker) as conn:
        payloads = [str(p) for (p,) in conn.execute("SELECT payload FROM kombu_message")]
    assert any(dead in p for p in payloads)
    # the pending judgements page lists it; the sweep would send it again if no worker took it
    page.goto("/admin/judgements?status=pending")
    assert page.locator(f"#judgement-{dead}").count() == 1
    assert dead in judgements.sweep(module_engine, idle_timeout_s=10**9, requeue_after_s=0).requeue


def test_a_shared_filtered_url_opens_the_same_rows_in_a_fresh_context(page: Any, browser: Any,
                                                                      gateway: GatewayProcess) -> None:
    page.goto("/admin/turns")
    page.select_option("select[name=reward]", "positive")
    page.wait_for_url("**/admin/turns?*reward=positive*")
    page.locator("th a[data-sort=latency]").click()  # slowest first
    page.wait_for_url("**/admin/turns?*sort=latency*")
    page.get_by_test_id("older").click()  # the second page
    page.wait_for_url("**/admin/turns?*offset=50*")
    page.wait_for_function("() => document.querySelector('tr.turn-row') !== null")
    shared, rows = page.url, turn_rows(page)
    query = parse_qs(urlsplit(shared).query)
    assert query["reward"] == ["positive"] and query["sort"] == ["latency"] and query["offset"] == ["50"]
    assert len(rows) == 50
    # a colleague: another browser context, not logged in
    path = shared.removeprefix(gateway.url)
    context, other = logged_in(browser, gateway, "bob", path)
    try:
        assert other.url == shared  # the login kept the whole URL
        assert turn_rows(other) == rows
        assert other.locator("select[name=reward]").input_value() == "positive"
        assert not other.js_errors
    finally:
        context.close()
