"""The admin UI on a phone and in dark mode, in Debian's chromium (Playwright): at 390x844 no
page scrolls sideways (tables become stacked cards, the turn's side panel moves below its
content); with ``prefers-color-scheme: dark`` the pages are dark; on a wide screen the side
panel sits beside the content. A gateway process on real PostgreSQL with the fill pool (every
turn state); no vLLM is needed (token texts fall back to ids).

Screenshots go to tests/artifacts/ (git-ignored); the ones in docs/ui/ were taken from here."""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.orm import Session as OrmSession

from datapool import leases as lease
from datapool.db import make_engine, upgrade
from datapool.models import Judgement, Session, Turn, Vote
from base.vocab import CaptureKind, JudgementStatus
from tests.support.pg import fresh_database
from tests.support.browser import require_chromium
from tests.support.processes import GatewayProcess
from tests.support.ui_fill import CONTENTS, TurnSpec, every_state, write_session
from tests.support import REPO

ARTIFACTS = REPO / "tests" / "artifacts"
PHONE = {"width": 390, "height": 844}
WIDE = {"width": 1280, "height": 900}

require_chromium()  # skips this module, saying why, without Playwright or chromium


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {
        "type": "string", "enum": ["C", "F"]}}, "required": ["city"]}}}
REPLY = ("It is **light drizzle** in Oslo, 7 °C. For the week:\n\n| day | sky | °C |\n|---|---|---|\n"
         "| Mon | drizzle | 7 |\n| Tue | cloudy | 9 |\n\nTo check it yourself:\n\n```python\n"
         "import httpx\nprint(httpx.get('https://api.example.com/weather', params={'city': 'Oslo'}).json())\n```\n"
         "<script>alert('never runs')</script>")


def showcase(engine: Any) -> tuple[str, list[str]]:
    """A session as the screenshots show it: a Responses-API client with tools, a markdown reply
    with a table and code, a follow-up cut at the token limit."""
    sid = "s-showcase-" + uuid.uuid4().hex[:6]
    now = datetime.now(timezone.utc).replace(microsecond=0)
    ask = [{"role": "system", "content": "You are a weather assistant. Use the tools."},
           {"role": "user", "content": "Is it raining in **Oslo**? Give me the week too."}]
    call = {"role": "assistant", "content": None, "tool_calls": [{"id": "call_7", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Oslo", "unit": "C"}'}}]}
    result = {"role": "tool", "tool_call_id": "call_7", "content": '{"sky": "drizzle", "c": 7, "week": [7, 9]}'}
    settings = {"temperature": 0.2, "top_p": 0.9, "max_completion_tokens": 256, "tool_choice": "auto",
                "stream": True, "stop": ["</answer>"], "tools": [WEATHER_TOOL]}
    rows = [(ask, call, "tool_calls", None), (ask + [call, result], {"role": "assistant", "content": REPLY}, "stop", None),
            (ask + [call, result, {"role": "assistant", "content": REPLY},
                    {"role": "user", "content": "And the whole month, day by day?"}],
             {"role": "assistant", "content": "Here is the month:\n\n1. Nov 1: drizzle, 6 °C\n2. Nov 2: cloudy, 8"},
             "length", 48)]
    ids = []
    with OrmSession(engine) as db, db.begin():
        db.add(Session(id=sid, source="header", mode="online", created_at=now, updated_at=now, task_id="weather"))
        db.flush()
        for i, (messages, reply, finish, limit) in enumerate(rows):
            text = reply.get("content") or ""
            n = max(2, len(text.split()))
            request = {"model": "smollm2", "messages": messages, **settings,
                       **({"max_completion_tokens": limit} if limit else {})}
            t = Turn(id=str(uuid.uuid4()), session_id=sid, turn_type="main", endpoint="chat", wire_format="responses",
                     status="ok", created_at=now + timedelta(seconds=i), model="smollm2", upstream_model="smollm2",
                     policy_version="v3", capture=CaptureKind.WHITE_BOX, request=request,
                     response={"id": f"resp_{i}", "choices": [{"index": 0, "finish_reason": finish, "message": reply}]},
                     next_state={"messages": [result]} if i == 0 else None,
                     prompt_token_ids=list(range(1, 60)), token_ids=list(range(1000, 1000 + n)),
                     logprobs=[-0.02 - (2.8 if k % 6 == 4 else 0.4 * (k % 3)) for k in range(n)],
                     latency_ms=640.0 + 210 * i,
                     usage={"prompt_tokens": 59 + 40 * i, "completion_tokens": n, "total_tokens": 59 + 40 * i + n})
            db.add(t)
            db.flush()
            for k, v in enumerate((1, 1, -1) if i != 2 else (-1, -1, 0)):
                db.add(Vote(turn_id=t.id, kind="prm", dedupe_key=f"prm:show:{k}", judge="judge", prompt_version="v1",
                            vote_index=k, value=v, rationale="used the tool result" if v > 0 else "cut off"))
            db.add(Judgement(turn_id=t.id, status=JudgementStatus.SCORED, reward=1.0 if i != 2 else -1.0,
                             prm_reward=1.0 if i != 2 else -1.0, vote_mean=0.33 if i != 2 else -0.67, judge="judge"))
            ids.append(t.id)
    return sid, ids


@pytest.fixture(scope="module")
def pool(pg_admin_dsn: str) -> Iterator[dict[str, Any]]:
    url, drop = fresh_database(pg_admin_dsn)
    upgrade(url)
    engine = make_engine(url)
    for specs in every_state()[:-1]:  # every state; not the 200-turn session (the fill test has it)
        write_session(engine, specs)
    # the session the screenshots show: each kind of content, tools, a truncated reply, votes
    sid, ids = write_session(engine, [TurnSpec(content=c, judgement=JudgementStatus.SCORED,
                                               capture=CaptureKind.WHITE_BOX) for c in CONTENTS if c != "huge"])
    show, show_turns = showcase(engine)
    run = lease.start_run(engine, objective="rl", backend="local", config={}, base_version=None)
    turns = lease.lease(engine, run, limit=100)
    for step in range(1, 5):
        lease.record_step(engine, run, step, turns[step - 1: step], {"pg_loss": 0.5 / step, "kl": 0.01 * step})
        time.sleep(0.02)
    lease.finish_run(engine, run, status="done")
    engine.dispose()
    yield {"url": url, "session": sid, "turns": ids, "showcase": show, "showcase_turns": show_turns}
    drop()


@pytest.fixture(scope="module")
def gateway(pool: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    # no admin credential: the UI is open (the gateway is on 127.0.0.1)
    with GatewayProcess(tmp_path_factory.mktemp("layout-gw"), database_url=pool["url"],
                        upstream_url="http://127.0.0.1:9/v1") as gw:
        yield gw


def tab(browser: Any, gateway: GatewayProcess, viewport: dict[str, int], scheme: str = "light") -> Any:
    context = browser.new_context(viewport=viewport, base_url=gateway.url, color_scheme=scheme)
    context.set_default_timeout(30_000)
    page = context.new_page()
    page.js_errors = []
    page.on("pageerror", lambda exc: page.js_errors.append(str(exc)))
    return page


def pages(pool: dict[str, Any]) -> list[str]:
    return ["/admin/sessions", "/admin/turns", f"/admin/sessions/{pool['session']}", "/admin/judgements",
            "/admin/judgements?status=dead", "/admin/training", "/admin/queue"]


def shot(page: Any, name: str, full_page: bool = True) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=full_page)


def luminance(css: str) -> float:
    """Relative luminance (0 black … 1 white) of a computed ``rgb(...)``/``rgba(...)`` colour."""
    r, g, b = (int(x) / 255 for x in re.findall(r"[\d.]+", css)[:3])
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def test_no_page_scrolls_sideways_at_390px(browser: Any, gateway: GatewayProcess, pool: dict[str, Any]) -> None:
    page = tab(browser, gateway, PHONE)
    widths = {}
    for url in pages(pool):
        page.goto(url)
        page.wait_for_load_state("networkidle")
        widths[url] = page.evaluate("document.documentElement.scrollWidth")
        shot(page, "390-" + re.sub(r"\W+", "-", url.strip("/")))
    assert all(w <= PHONE["width"] for w in widths.values()), widths
    # the session list and the turns view are stacked cards, not a table wider than the screen
    page.goto("/admin/turns")
    row = page.locator("tr.turn-row").first
    assert row.evaluate("r => getComputedStyle(r).display") == "flex"
    assert row.bounding_box()["width"] <= PHONE["width"]
    assert "latency" in row.locator("td").nth(6).evaluate("td => getComputedStyle(td, '::before').content")
    # on a session page the side panel is below the content, not beside it
    page.goto(f"/admin/sessions/{pool['session']}")
    turn = page.locator(f"#turn-{pool['turns'][0]}")
    main, side = turn.locator(".turn-main").bounding_box(), turn.get_by_test_id("turn-panel").bounding_box()
    assert side["y"] >= main["y"] + main["height"] - 1 and side["width"] > 300
    assert not page.js_errors


def test_wide_screen_puts_the_panel_beside_the_content(browser: Any, gateway: GatewayProcess,
                                                      pool: dict[str, Any]) -> None:
    page = tab(browser, gateway, WIDE)
    page.goto(f"/admin/sessions/{pool['session']}")
    turn = page.locator(f"#turn-{pool['turns'][1]}")  # finish_reason length: the warning shows
    main, side = turn.locator(".turn-main").bounding_box(), turn.get_by_test_id("turn-panel").bounding_box()
    assert side["x"] >= main["x"] + main["width"] and abs(side["y"] - main["y"]) < 2
    assert main["width"] > 700  # the content has the width, not a narrow column
    assert turn.get_by_test_id("finish-warning").is_visible()
    assert "Truncated" in turn.get_by_test_id("finish-warning").inner_text()
    # tokens collapsed; opening shows the legend
    box = page.locator("details.tokens-box").first
    assert box.get_attribute("open") is None and not page.get_by_test_id("token-legend").first.is_visible()
    box.locator("summary").click()
    assert page.get_by_test_id("token-legend").first.is_visible()
    # the tools schema is collapsed too
    tools = page.get_by_test_id("tools").first
    assert tools.get_attribute("open") is None
    shot(page, "1280-session")
    assert not page.js_errors


@pytest.mark.parametrize("scheme", ["dark", "light"])
def test_colour_scheme_follows_the_system(browser: Any, gateway: GatewayProcess, pool: dict[str, Any],
                                          scheme: str) -> None:
    page = tab(browser, gateway, PHONE, scheme)
    for url in pages(pool):
        page.goto(url)
        page.wait_for_load_state("networkidle")
        body = luminance(page.evaluate("getComputedStyle(document.body).backgroundColor"))
        text = luminance(page.evaluate("getComputedStyle(document.body).color"))
        if scheme == "dark":
            assert body < 0.1 and text > 0.7, (url, body, text)
        else:
            assert body > 0.9 and text < 0.2, (url, body, text)
        # surfaces follow (cards, tables, messages): none stays white on a dark page
        for sel in (".turn", ".msg", "tbody tr", ".filters"):
            el = page.locator(sel).first
            if el.count():
                bg = el.evaluate("e => getComputedStyle(e).backgroundColor")
                if "rgba(0, 0, 0, 0)" not in bg:
                    assert (luminance(bg) < 0.25) == (scheme == "dark"), (url, sel, bg)
        if scheme == "dark":
            shot(page, "dark-390-" + re.sub(r"\W+", "-", url.strip("/")))


@pytest.mark.parametrize("viewport,scheme", [(WIDE, "light"), (PHONE, "light"), (WIDE, "dark"), (PHONE, "dark")])
def test_showcase_session_reads(browser: Any, gateway: GatewayProcess, pool: dict[str, Any],
                                viewport: dict[str, int], scheme: str) -> None:
    """The session the docs' screenshots show (docs/ui/session-*.png are these, copied)."""
    page = tab(browser, gateway, viewport, scheme)
    page.goto(f"/admin/sessions/{pool['showcase']}")
    page.wait_for_load_state("networkidle")
    first, reply, cut = (page.locator(f"#turn-{t}") for t in pool["showcase_turns"])
    assert first.get_by_test_id("settings").inner_text().count("\n") >= 5
    assert "get_weather" in first.get_by_test_id("tools").inner_text()
    assert reply.locator(".md table td").first.inner_text() == "Mon" and reply.locator(".md pre code").count() == 1
    assert "<script>alert('never runs')</script>" in reply.locator(".msg.reply").inner_text()
    assert "max tokens 48" in cut.get_by_test_id("finish-warning").inner_text()
    assert page.evaluate("document.documentElement.scrollWidth") <= viewport["width"]
    reply.locator("details.tokens-box summary").click()
    reply.evaluate("e => e.scrollIntoView({block: 'start'})")
    shot(page, f"session-{viewport['width']}{'-dark' if scheme == 'dark' else ''}", full_page=False)
    assert not page.js_errors



def test_queue_count_goes_down_as_turns_are_labelled(browser: Any, gateway: GatewayProcess,
                                                     pool: dict[str, Any]) -> None:
    page = tab(browser, gateway, WIDE)
    page.goto("/admin/queue")
    count = page.get_by_test_id("queue-remaining")
    before = int(count.inner_text())
    assert before >= 2
    first = page.locator("article.queue-item").first
    assert first.get_by_test_id("question").is_visible()  # the user's question, above the reply
    first.get_by_role("button", name="▲ Good").click()
    first.locator(".badge.pos").wait_for()
    page.wait_for_function(f"document.querySelector('[data-testid=queue-remaining]').innerText === '{before - 1}'")
    assert not page.js_errors


VIEWS = {"sessions": "/admin/sessions", "turns": "/admin/turns?reward=negative",
         "judgements": "/admin/judgements?status=dead", "queue": "/admin/queue", "training": "/admin/training"}


@pytest.mark.parametrize("viewport", [WIDE, PHONE], ids=["1280", "390"])
@pytest.mark.parametrize("view", sorted(VIEWS))
def test_each_view_fits_its_screen(browser: Any, gateway: GatewayProcess, view: str,
                                   viewport: dict[str, int]) -> None:
    """Each list view at a desktop and a phone width: the first screen shows the view's rows, nothing scrolls sideways, no script error. The docs' screenshots of the
    views (docs/ui/VIEW-WIDTH.png) are these: `cp tests/artifacts/view-*.png docs/ui/` after
    `pytest tests/gateway/ui/test_ui_layout.py -k each_view` (then strip the `view-` prefix)."""
    page = tab(browser, gateway, viewport)
    page.goto(VIEWS[view])
    page.wait_for_load_state("networkidle")
    assert page.locator("main tr, main article, main svg").first.is_visible(), f"{view}: nothing listed"
    assert page.evaluate("document.documentElement.scrollWidth") <= viewport["width"]
    shot(page, f"view-{view}-{viewport['width']}", full_page=False)
    assert not page.js_errors
