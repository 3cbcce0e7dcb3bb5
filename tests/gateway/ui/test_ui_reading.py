"""Reading a session (issue 18): markdown rendered and sanitised (property test over hostile
strings, and through the real page), the per-turn side panel (settings, tools, usage, latency,
finish warning, wire format), the token view collapsed with its legend, every pool state
rendering its panel, and the annotation queue's question and count."""

from __future__ import annotations

import html
import re
import uuid
from collections.abc import Iterator
from datetime import datetime, timezone
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import given, settings, strategies as st
from sqlalchemy.orm import Session as OrmSession

from datapool.db import make_engine
from datapool.models import Judgement, Session, Turn, Vote
from base.settings import Settings
from base.vocab import CaptureKind, JudgementStatus, SessionMode, SessionSource, TurnKind, TurnStatus
from gateway.app import create_app
from gateway.ui import facts, markup
from tests.support.admin_ui import csrf_of
from tests.support.ui_fill import UNICODE, TurnSpec, write_session


class Html(HTMLParser):
    """Every start tag with its attributes, as a browser's tokenizer would see them."""

    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, list[tuple[str, str | None]]]] = []
        self.feed(text)
        self.close()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, attrs))

    handle_startendtag = handle_starttag


def scheme(url: str) -> str | None:
    """The URL's scheme as a browser reads it (entities decoded, whitespace and controls dropped)."""
    cleaned = re.sub(r"[\x00-\x20\x7f]", "", html.unescape(url)).lower()
    m = re.match(r"([a-z][a-z0-9+.-]*):", cleaned)
    return m.group(1) if m else None


def assert_inert(out: str, allowed: set[str] = markup.TAGS | {"div"}) -> None:
    """No tag outside the allow-list, no event handler or style attribute, no URL of a scheme
    that runs or embeds something."""
    for tag, attrs in Html(out).tags:
        assert tag in allowed, (tag, out)
        for name, value in attrs:
            assert not name.startswith("on") and name not in ("style", "srcdoc", "formaction"), (name, out)
            if name in ("href", "src", "action", "xlink:href") and value is not None:
                assert scheme(value) in (None, "http", "https", "mailto"), (value, out)
    assert "<script" not in out.lower() and "<iframe" not in out.lower()


HOSTILE = ["<script>alert(1)</script>", "<script src=//e.vil/x.js></script>", "<img src=x onerror=alert(1)>",
           "<svg onload=alert(1)>", '<a href="javascript:alert(1)">x</a>', "[x](javascript:alert(1))",
           "[x](JaVaScRiPt:alert(1))", "[x](&#106;avascript:alert(1))", "[x](java\tscript:alert(1))",
           "![i](javascript:alert(1))", "[d](data:text/html;base64,PHNjcmlwdD4=)", "<iframe src=x>",
           '<div style="background:url(javascript:x)">', "onerror=", "onclick=\"x()\"", " javascript:",
           "<style>*{}</style>", "<form action=javascript:x><button>", "<math><mi xlink:href=javascript:x>",
           "<!-- <script> -->", "<![CDATA[<script>]]>", "&lt;script&gt;", "<a href='vbscript:x'>v</a>",
           "<object data=x>", "<embed src=x>", "<base href=//e.vil>", "<meta http-equiv=refresh content=0>",
           "[ok](https://example.com \"t\")", "<https://example.com>", "<mailto:a@b.c>"]
MARKDOWN = ["# ", "## ", "* ", "1. ", "> ", "```", "```html\n", "`", "**", "_", "~~", "|", "-|-", "\n", "\n\n",
            "    ", "[", "]", "(", ")", "<", ">", "\"", "'", "=", "&", "#", ";", ":"]
pieces = st.lists(st.one_of(st.sampled_from(HOSTILE), st.sampled_from(MARKDOWN), st.text(max_size=8)), max_size=24)


@settings(max_examples=400, deadline=None)
@given(pieces)
def test_markdown_output_never_holds_executable_content(parts: list[str]) -> None:
    assert_inert(str(markup.markdown("".join(parts))))


@given(st.text(max_size=200))
def test_plain_text_is_escaped_whole(text: str) -> None:
    out = str(markup.plain(text))
    assert_inert(out, {"div"})
    if text:
        inner = out.removeprefix('<div class="text plain">').removesuffix("</div>")
        assert html.unescape(inner) == text  # nothing lost, nothing added


def test_markdown_renders_what_people_write() -> None:
    out = str(markup.markdown("# Plan\n\nRun **this**:\n\n```python\nprint('<b>hi</b>')\n```\n\n"
                              "| a | b |\n|---|---|\n| 1 | 2 |\n\n* one\n* two\n\n[docs](https://example.com)\n"
                              "line one\nline two\n\n![chart](https://example.com/c.png)"))
    assert "<h1>Plan</h1>" in out and "<strong>this</strong>" in out
    assert "<pre><code>print('&lt;b&gt;hi&lt;/b&gt;')" in out  # code shown, its HTML as text
    assert "<table>" in out and "<td>2</td>" in out and "<li>one</li>" in out
    assert '<a href="https://example.com" rel="noopener noreferrer nofollow">docs</a>' in out
    assert "line one<br>" in out  # single newlines are line breaks, as models mean them
    # an image is a link, never loaded
    assert "<img" not in out
    assert '<a href="https://example.com/c.png" rel="noopener noreferrer nofollow">[image: chart]</a>' in out
    # raw HTML is shown as text, not dropped and not run
    raw = str(markup.markdown('<img src=x onerror="alert(1)"> and <b>bold?</b>'))
    assert '&lt;img src=x onerror="alert(1)"&gt;' in raw and "&lt;b&gt;" in raw
    # past the limit: plain escaped text
    big = str(markup.markdown("# not a heading <b>\n" * (markup.MARKDOWN_LIMIT // 10)))
    assert big.startswith('<div class="text plain">') and "<h1>" not in big and "&lt;b&gt;" in big


def test_facts_of_a_full_request_and_of_an_empty_one() -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
             {"type": "function", "function": {"name": "search"}}]
    f = facts.turn_facts({
        "request": {"model": "m", "messages": [], "temperature": 0.2, "top_p": 0.9, "max_completion_tokens": 32,
                    "stop": ["\n\n"], "tool_choice": "auto", "stream": True, "seed": 7, "tools": tools,
                    "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": {
                        "type": "object", "properties": {"city": {"type": "string"}, "temp": {"type": "number"}}}}}},
        "response": {"choices": [{"finish_reason": "length"}, {"finish_reason": "stop"}]},
        "usage": {"prompt_tokens": 40, "completion_tokens": 32, "completion_tokens_details": {"reasoning_tokens": 5}},
        "latency_ms": 1234.5, "wire_format": "responses", "capture": "white-box", "endpoint": "chat"})
    shown = {s.name: s for s in f.settings}
    assert list(shown)[:7] == ["temperature", "top_p", "max_completion_tokens", "stop", "tool_choice",
                               "response_format", "stream"]
    assert shown["temperature"].text == "0.2" and shown["stream"].text == "true" and shown["stop"].text == '["\\n\\n"]'
    assert shown["seed"].text == "7"  # other settings follow the main ones
    assert shown["response_format"].block and '"city"' in shown["response_format"].block  # long: collapsible
    assert f.unset == [] and f.tools == ["get_weather", "search"] and '"get_weather"' in (f.tools_json or "")
    assert f.usage == [("prompt", 40), ("completion", 32), ("total", 72), ("reasoning", 5)]
    assert f.finish == ["length", "stop"] and f.wire_label == "Responses API"
    assert f.warnings == ["Truncated: the reply stopped at the token limit (max tokens 32)."]

    empty = facts.turn_facts({"request": {"messages": []}, "response": None, "usage": None,
                              "token_ids": [1, 2, 3], "prompt_token_ids": None, "wire_format": None})
    assert empty.settings == [] and "temperature" in empty.unset and "max_tokens" in empty.unset
    assert empty.usage == [("completion", 3)] and empty.usage_source == "counted from the captured token ids"
    assert empty.finish == [] and empty.warnings == [] and empty.tools == [] and empty.wire_format == "chat"
    # whatever the pool holds: odd shapes give facts, not errors
    odd = facts.turn_facts({"request": None, "response": {"choices": [None, "x"]}, "usage": {"prompt_tokens": "?"}})
    assert odd.settings == [] and odd.usage == [] and odd.finish == []


def test_question_is_the_last_user_message() -> None:
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "first"},
            {"role": "assistant", "content": "a"}, {"role": "user", "content": "What is the weather?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c1"}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    q, since = facts.question(msgs)
    assert q is not None and q["content"] == "What is the weather?" and [m["role"] for m in since] == ["assistant", "tool"]
    assert facts.question([{"role": "system", "content": "s"}]) == (None, [{"role": "system", "content": "s"}])
    assert facts.question(None) == (None, [])


# ------------------------------------------------------------------------------------------
# through the real page


@pytest.fixture
def client(database_url: str, tmp_path: Path) -> Iterator[tuple[TestClient, Any]]:
    engine = make_engine(database_url)
    settings_ = Settings(upstream_url="http://127.0.0.1:9/v1", database_url=database_url, data_dir=tmp_path / "d")
    with TestClient(create_app(settings_)) as c:
        yield c, engine
    engine.dispose()


EVIL_REPLY = ("Here is the plan:\n\n```js\nalert('<b>x</b>')\n```\n\n<script>window.__xss = 1</script>\n"
              "[click](javascript:window.__xss=2) <img src=x onerror=\"window.__xss=3\"> **done**")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def write_turn(engine: Any, *, request: dict[str, Any], reply: dict[str, Any] | None, finish: str = "stop",
               wire_format: str = "chat", usage: dict[str, Any] | None = None, judged: bool = False,
               capture: str = CaptureKind.BLACK_BOX, latency_ms: float | None = 812.0) -> tuple[str, str]:
    sid, tid = "read-" + uuid.uuid4().hex[:10], str(uuid.uuid4())
    now = datetime.now(timezone.utc).replace(microsecond=0)
    with OrmSession(engine) as db, db.begin():
        db.add(Session(id=sid, source=SessionSource.HEADER, mode=SessionMode.ONLINE, created_at=now, updated_at=now))
        db.flush()
        db.add(Turn(id=tid, session_id=sid, turn_type=TurnKind.MAIN, endpoint="chat", wire_format=wire_format,
                    status=TurnStatus.OK if reply else TurnStatus.ERROR, created_at=now, model="smollm2",
                    upstream_model="smollm2", capture=capture, request=request,
                    response={"id": "chatcmpl-1", "choices": [{"index": 0, "finish_reason": finish, "message": {
                        "role": "assistant", **reply}}]} if reply else None,
                    error=None if reply else {"error": {"message": "upstream said no"}},
                    latency_ms=latency_ms, usage=usage))
        db.flush()
        if judged:
            db.add(Judgement(turn_id=tid, status=JudgementStatus.SCORED, reward=1.0, prm_reward=1.0, judge="j"))
            db.add(Vote(turn_id=tid, kind="prm", dedupe_key=f"prm:{tid}", judge="j", prompt_version="v1",
                        vote_index=0, value=1, rationale="fine"))
    return sid, tid


def turn_html(page: str, tid: str) -> str:
    start = page.index(f'<article class="turn" id="turn-{tid}"')
    return page[start: page.index("</article>", start)]


def test_session_page_shows_settings_tools_usage_and_a_truncation_warning(client: tuple[TestClient, Any]) -> None:
    c, engine = client
    request = {"model": "smollm2", "messages": [{"role": "user", "content": "Plan the **trip**."}],
               "temperature": 0.3, "top_p": 0.95, "max_tokens": 48, "stop": ["END"], "tool_choice": "auto",
               "response_format": {"type": "json_object"}, "stream": True, "tools": TOOLS}
    sid, tid = write_turn(engine, request=request, reply={"content": EVIL_REPLY}, finish="length",
                          wire_format="responses", usage={"prompt_tokens": 21, "completion_tokens": 48, "total_tokens": 69})
    page = c.get(f"/admin/sessions/{sid}").text
    turn = turn_html(page, tid)
    panel = turn[turn.index('data-testid="turn-panel"'):]
    for shown in ("<dt>temperature</dt><dd><code>0.3</code>", "<dt>top_p</dt><dd><code>0.95</code>",
                  "<dt>max_tokens</dt><dd><code>48</code>", "<dt>stop</dt><dd><code>[&#34;END&#34;]</code>",
                  "<dt>tool_choice</dt><dd><code>auto</code>", "<dt>stream</dt><dd><code>true</code>",
                  "<dt>response_format</dt><dd><code>{&#34;type&#34;: &#34;json_object&#34;}</code>",
                  "prompt <b>21</b> · completion <b>48</b> · total <b>69</b>", "812 ms", "Responses API",
                  "black-box", "tools (1): get_weather"):
        assert shown in panel, shown
    assert '<details class="tools" data-testid="tools">' in panel and "Weather for a city" in panel  # schema, collapsed
    assert '<span class="neg">length</span>' in panel
    warning = re.search(r'<p class="warn" role="alert" data-testid="finish-warning">([^<]*)</p>', turn)
    assert warning and "Truncated" in warning.group(1) and "max tokens 48" in warning.group(1)
    # the user's markdown and the reply's are rendered; the reply's HTML is inert text
    assert "Plan the <strong>trip</strong>." in page
    assert "<pre><code>alert('&lt;b&gt;x&lt;/b&gt;')" in turn and "<strong>done</strong>" in turn
    assert "&lt;script&gt;window.__xss = 1&lt;/script&gt;" in turn
    assert_no_active_content(page)


def assert_no_active_content(page: str) -> None:
    """The whole page: scripts only the UI's own, no event-handler attributes, no javascript: URLs."""
    for tag, attrs in Html(page).tags:
        a = dict(attrs)
        if tag == "script":
            assert a.get("src") in ("/admin/static/htmx.min.js", "/admin/static/admin.js"), a
        assert tag not in ("iframe", "object", "embed", "img"), (tag, a)
        for name, value in attrs:
            assert not name.startswith("on"), (tag, name, value)
            if name in ("href", "src", "action", "hx-get", "hx-post") and value:
                assert scheme(value) in (None, "http", "https", "mailto"), (tag, name, value)


def test_every_pool_state_renders_its_panel(client: tuple[TestClient, Any]) -> None:
    c, engine = client
    specs = [TurnSpec(settings=False, capture=CaptureKind.BLACK_BOX, content="unicode"),  # 0: no settings
             TurnSpec(content="huge", judgement=None),  # 1: finish length (i % 4 == 1), 60 kB reply
             TurnSpec(content="markdown"),  # 2: no latency (i % 5 == 2)
             TurnSpec(status=TurnStatus.ERROR, judgement=None),  # 3: error, no usage
             TurnSpec(content="tool_calls")]  # 4: tools offered and called
    sid, ids = write_session(engine, specs)
    r = c.get(f"/admin/sessions/{sid}")
    assert r.status_code == 200
    page = r.text
    t0, t1, t2, t3, t4 = (turn_html(page, t) for t in ids)
    assert "none set: the upstream's defaults" in t0 and "not set: temperature, top_p, max_tokens" in t0
    assert "no tools offered" in t0 and "tokens-box" not in t0  # black box: no token view
    assert UNICODE in page  # unicode kept as is
    assert '<div class="msg role-assistant reply long">' in t1 and '<div class="text plain">' in t1  # huge: plain, scrolls
    assert "finish-warning" in t1 and "max tokens 64" in t1
    assert "finish-warning" not in t2 and "<dt>latency</dt><dd>–</dd>" in t2
    assert "&lt;script&gt;x()&lt;/script&gt;" in t2 and "<h1>Heading 2</h1>" in t2
    assert '<pre class="error">' in t3 and "upstream said no" in t3 and ">error</span>" in t3
    assert "not reported" in t3 and '<dd data-testid="finish"><span class="muted">–</span>' in t3
    assert "tools (1): lookup" in t4 and '<span class="fn">lookup</span>' in t4
    # white-box turns: tokens collapsed (no `open`), with the probability legend
    assert '<details class="tokens-box">' in t2 and 'data-testid="token-legend"' in t2 and "p 0.01" in t2
    assert "<details class=\"tokens-box\" open" not in page
    assert_no_active_content(page)


def test_queue_shows_the_question_of_a_tool_turn_and_a_count(client: tuple[TestClient, Any]) -> None:
    c, engine = client
    messages = [{"role": "system", "content": "You help."}, {"role": "user", "content": "Is it raining in Oslo?"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "drizzle, 7 °C"}]
    _, tool_turn = write_turn(engine, request={"model": "smollm2", "messages": messages, "tools": TOOLS},
                              reply={"content": "Yes, light drizzle."}, judged=True)
    _, other = write_turn(engine, request={"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}]},
                          reply={"content": "Hello."}, judged=True)
    page = c.get("/admin/queue").text
    assert re.search(r'data-testid="queue-remaining"[^>]*>2</b> turns left to label', page)
    item = page[page.index(f'id="turn-{tool_turn}"'):]
    item = item[: item.index("</article>")]
    question = item[item.index('data-testid="question"'): item.index('data-testid="since-question"')]
    assert "Is it raining in Oslo?" in question and "drizzle" not in question
    since = item[item.index('data-testid="since-question"'):]
    assert "drizzle, 7 °C" in since and '<span class="fn">get_weather</span>' in since
    assert "Yes, light drizzle." in since  # the reply follows its context
    # labelling one: the count the page re-asks for goes down, and the response tells the page
    csrf = csrf_of(page)
    r = c.post(f"/admin/turns/{other}/labels", data={"kind": "thumb", "value": "1", "csrf_token": csrf},
               headers={"HX-Request": "true"})
    assert r.status_code == 200 and r.headers["hx-trigger"] == "labels-changed"
    assert c.get("/admin/queue/count").text == "1"
    assert re.search(r'data-testid="queue-remaining"[^>]*>1</b> turn left to label', c.get("/admin/queue").text)
