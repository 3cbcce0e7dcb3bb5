"""The session page's branch view (gateway/ui/branches.py): the trajectory graph of a session,
each turn under the turn it continues, with forks, retries, resumed calls, dropped replies,
dropped system prompts and summaries marked.

Sessions are written through the real Stitcher (so the parents are the ones the pool records),
then the page is rendered by the admin UI and read back: one session per pool state, and a
hypothesis property over the generated conversations of tests/support/trajectories.py.
"""

from __future__ import annotations

import random
import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import Engine
from sqlalchemy.orm import Session as OrmSession

from datapool import queries
from datapool.db import make_engine
from datapool.records import TurnRecord
from datapool.sessions import Stitcher
from gateway.ui.branches import graph
from tests.support.conversations import draw_steps, requests
from tests.support.records import turn_record
from tests.support.trajectories import plan
from tests.support.admin_ui import admin_client

T0 = datetime(2026, 11, 28, tzinfo=timezone.utc)
SYSTEM = {"role": "system", "content": "You are a coding agent."}


def _user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def _reply(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


class Session:
    """Records of one conversation, written in order through the Stitcher."""

    def __init__(self, named: bool = False):
        self.key = f"s-{uuid.uuid4().hex[:12]}" if named else None
        self.records: list[TurnRecord] = []
        self.word = uuid.uuid4().hex[:8]  # this session's own words: no two sessions share a history

    def turn(self, messages: list[dict[str, Any]], reply: str | None, *, status: str = "ok",
             turn_type: str = "main") -> TurnRecord:
        r = turn_record(messages, reply, at=T0 + timedelta(seconds=len(self.records)), status=status,
                        model="smollm2", turn_type=turn_type, session_id=self.key,
                        session_source="key" if self.key else None)
        self.records.append(r)
        return r

    @staticmethod
    def after(r: TurnRecord, *more: dict[str, Any]) -> list[dict[str, Any]]:
        """*r*'s messages, its reply, then *more*."""
        return [*r.messages, *r.replies[:1], *more]


@dataclass
class Row:
    turn: str
    depth: int
    parent: str
    marks: list[str]


ROW = re.compile(r'<li class="branch" style="--depth: (\d+)" data-branch-turn="(\w+)" data-parent="(\w*)"'
                 r' data-marks="([^"]*)"')


def branch_rows(page: str) -> list[Row]:
    return [Row(t, int(d), p, m.split(",") if m else []) for d, t, p, m in ROW.findall(page)]


@pytest.fixture
def ui(database_url: str, tmp_path: Path) -> Iterator[tuple[TestClient, Engine]]:
    engine = make_engine(database_url)
    with admin_client(database_url, tmp_path) as client:
        yield client, engine
    engine.dispose()


def _render(ui: tuple[TestClient, Engine], s: Session) -> tuple[str, list[Row]]:
    client, engine = ui
    with OrmSession(engine) as db, db.begin():
        Stitcher(db).write(s.records)
    with OrmSession(engine) as db:
        stored = queries.get_turn(db, s.records[-1].id)
    assert stored is not None
    page = client.get(f"/admin/sessions/{stored['session_id']}")
    assert page.status_code == 200, page.text
    return page.text, branch_rows(page.text)


def _marks(rows: list[Row]) -> dict[str, tuple[str, list[str]]]:
    return {r.turn: (r.parent, r.marks) for r in rows}


def test_a_line_of_turns_each_continuing_the_one_before(ui: tuple[TestClient, Engine]) -> None:
    s = Session()
    a = s.turn([SYSTEM, _user(f"hello {s.word}")], "hi")
    b = s.turn(s.after(a, _user("and then?")), "done")
    page, rows = _render(ui, s)
    assert _marks(rows) == {a.id: ("", ["start"]), b.id: (a.id, [])}
    assert [r.depth for r in rows] == [0, 0]
    assert '<details class="branch-view">' in page  # nothing branches: folded
    assert "in one line" in page


def test_a_fork_is_a_branch_of_the_turn_it_leaves(ui: tuple[TestClient, Engine]) -> None:
    s = Session()
    a = s.turn([SYSTEM, _user(f"plan {s.word}")], "step one")
    b = s.turn(s.after(a, _user("go on")), "step two")
    c = s.turn(s.after(a, _user("no, another way")), "other step")
    d = s.turn(s.after(b, _user("finish")), "finished")
    page, rows = _render(ui, s)
    assert _marks(rows) == {a.id: ("", ["start"]), b.id: (a.id, []), c.id: (a.id, ["fork"]), d.id: (b.id, [])}
    # the fork hangs under the turn it leaves; the line that got the next state goes on unindented
    assert [(r.turn, r.depth) for r in rows] == [(a.id, 0), (c.id, 1), (b.id, 0), (d.id, 0)]
    assert '<details class="branch-view" open>' in page
    # the conversation's turn says which turn it continues, and how
    head = page[page.index(f'id="turn-{c.id}"'):][:1500]
    assert f'continues <a href="#turn-{a.id}">{a.id[:8]}</a>' in head and ">fork</span>" in head


def test_a_retry_of_a_failed_call_and_a_resumed_cancelled_one(ui: tuple[TestClient, Engine]) -> None:
    s = Session()
    a = s.turn([SYSTEM, _user(f"fix {s.word}")], "looking")
    failed = s.turn(s.after(a, _user("and the test?")), None, status="error")
    retried = s.turn(failed.messages, "the test passes")
    cancelled = s.turn(s.after(retried, _user("now the docs")), None, status="cancelled")
    resumed = s.turn([*cancelled.messages, _user("go on")], "docs written")
    _, rows = _render(ui, s)
    assert _marks(rows) == {a.id: ("", ["start"]), failed.id: (a.id, []), retried.id: (failed.id, ["retry"]),
                            cancelled.id: (retried.id, []), resumed.id: (cancelled.id, ["resumed"])}
    assert all(r.depth == 0 for r in rows)


def test_a_reply_the_agent_dropped(ui: tuple[TestClient, Engine]) -> None:
    s = Session()
    a = s.turn([SYSTEM, _user(f"list the files {s.word}")], "I think there are files.")
    b = s.turn([*a.messages, _user("No tool call found. Call a tool.")], "ls")
    _, rows = _render(ui, s)
    assert _marks(rows) == {a.id: ("", ["start"]), b.id: (a.id, ["reply dropped"])}


def test_a_dropped_system_prompt_and_its_return(ui: tuple[TestClient, Engine]) -> None:
    s = Session()
    a = s.turn([SYSTEM, _user(f"rename {s.word}")], "renamed")
    b = s.turn([m for m in s.after(a, _user("quick question")) if m["role"] != "system"], "yes")
    c = s.turn([SYSTEM, *s.after(b, _user("back to work"))], "working")
    _, rows = _render(ui, s)
    assert _marks(rows) == {a.id: ("", ["start"]), b.id: (a.id, ["no system prompt"]),
                            c.id: (b.id, ["system prompt again"])}


def test_a_summary_that_replaced_the_history(ui: tuple[TestClient, Engine]) -> None:
    s = Session(named=True)  # the agent's session key ties the turn after the summary to its session
    a = s.turn([SYSTEM, _user(f"refactor {s.word}")], "refactoring")
    b = s.turn(s.after(a, _user("and the tests")), "tests too")
    summary = s.turn([{"role": "system", "content": "Summarise the conversation."},
                      _user("<conversation>...</conversation>")], "We refactored and tested.", turn_type="side")
    c = s.turn([SYSTEM, _user("Summary: we refactored and tested."), _user("what next?")], "release")
    page, rows = _render(ui, s)
    assert _marks(rows) == {a.id: ("", ["start"]), b.id: (a.id, []), c.id: (b.id, ["summary"])}
    assert summary.id not in {r.turn for r in rows}  # a side call is not on the graph
    assert f"side call {summary.id[:8]}" in page


def test_a_session_that_starts_again(ui: tuple[TestClient, Engine]) -> None:
    s = Session(named=True)
    a = s.turn([SYSTEM, _user(f"first try {s.word}")], None, status="error")
    b = s.turn([SYSTEM, _user(f"something else {s.word}")], "ok")
    page, rows = _render(ui, s)
    assert _marks(rows) == {a.id: ("", ["start"]), b.id: ("", ["new start"])}
    assert "2 starts" in page


# -- the same over generated conversations --------------------------------------------------------

def _plain(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [m for m in messages if m.get("role") != "system"]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(r=st.randoms(use_true_random=False),
       ending=st.sampled_from(["none", "fork", "cancelled and resumed", "reply dropped"]), named=st.booleans())
def test_every_turn_is_drawn_once_under_its_parent_with_how_it_continues(
        module_sqlite_engine: Engine, r: random.Random, ending: str, named: bool) -> None:
    steps = draw_steps(r, system=f"agent run {uuid.uuid4().hex}")
    steps[1].text = f"{uuid.uuid4().hex} {steps[1].text}"
    planned = plan(r, requests(r, steps), ending, f"s-{uuid.uuid4().hex[:12]}" if named else None)
    with OrmSession(module_sqlite_engine) as db, db.begin():
        Stitcher(db).write([p.record for p in planned])
    with OrmSession(module_sqlite_engine) as db:
        stored = queries.get_turn(db, planned[-1].record.id)
        assert stored is not None
        session = queries.get_session(db, stored["session_id"])
    assert session is not None
    g = graph(session["turns"])
    rows = g.rows()
    drawn = [n.id for n, _ in rows]
    assert sorted(drawn) == sorted(p.record.id for p in planned)  # each turn once
    seen: set[str] = set()
    for node, depth in rows:
        assert node.parent_id is None or node.parent_id in seen  # under (after) the turn it continues
        assert depth >= 0
        seen.add(node.id)
    for p in planned:
        node, marks = g.nodes[p.record.id], g.nodes[p.record.id].marks
        assert node.parent_id == (p.parent.id if p.parent else None)
        if p.parent is None:
            assert marks == ["start"]
            continue
        mine, theirs = p.record.messages, p.parent.messages
        if p.parent.status != "ok" and mine == theirs:
            assert "retry" in marks, marks
        if len(_plain(mine)) == len(mine) and len(_plain(theirs)) < len(theirs):
            assert "no system prompt" in marks, marks
        if len(_plain(mine)) < len(mine) and len(_plain(theirs)) == len(theirs):
            assert "system prompt again" in marks, marks
        assert "summary" not in marks and "new start" not in marks, marks  # every link was found
    last, parent = g.nodes[planned[-1].record.id].marks, planned[-1].parent
    if ending == "fork" and parent is not None and parent.id != planned[-2].record.id:
        assert "fork" in last and g.branches
    if ending == "cancelled and resumed":
        assert "resumed" in last and g.branches
    if ending == "reply dropped":
        assert "reply dropped" in last and g.branches


EDGE = re.compile(r'data-branch-turn="(\w+)"[^>]*>(?:(?!</li>)[\s\S])*?data-edge="([\w-]+)"')


def test_a_recovery_pass_and_a_compaction_are_labelled_edges(ui: tuple[TestClient, Engine]) -> None:
    """A tool loop ended by a recovery pass (no system prompt, no tools), in one session with a
    summary inserted before the kept messages and a summarisation side call: each edit is drawn on
    the edge to the turn it continues."""
    s = Session()
    call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "chatcmpl-tool-5e1d", "type": "function", "function": {"name": "exec", "arguments": '{"cmd": "ls"}'}}]}
    a = s.turn([SYSTEM, _user(f"list the files {s.word}")], "")
    a.response["choices"][0]["message"] = call  # type: ignore[index]
    result = {"role": "tool", "tool_call_id": "chatcmpltool5e1d", "content": "a.txt"}
    replayed = {**call, "tool_calls": [{**call["tool_calls"][0], "id": "chatcmpltool5e1d",
                                        "function": {"name": "exec", "arguments": '{"cmd":"ls"}'}}]}
    recovery = s.turn([_user(f"list the files {s.word}"), replayed, result, _user("Answer now, no more tools.")],
                      "There is a.txt.")
    summary = {"role": "user", "content": "Summary of the conversation so far: the user listed the files."}
    inserted = s.turn([SYSTEM, summary, *s.after(recovery, _user("and now?"))], "done")
    side = s.turn([{"role": "system", "content": "Summarise this transcript for the agent."},
                   _user(f"<conversation>\n[user]\nlist the files {s.word}\n[assistant]\nThere is a.txt.\n"
                         "[user]\nand now?\n[assistant]\ndone\n</conversation>")], "Listed files.", turn_type="side")
    page, rows = _render(ui, s)
    assert {r.turn: r.parent for r in rows} == {a.id: "", recovery.id: a.id, inserted.id: recovery.id}
    assert dict(EDGE.findall(page)) == {recovery.id: "recovery", inserted.id: "compaction-insert"}
    assert "⤷ recovery pass" in page and "⤷ summary inserted" in page
    # the side call hangs off the turn whose history it summarised
    item = page[page.index(f'data-branch-turn="{inserted.id}"'):]
    assert f'data-edge="summary" data-side="{side.id}"' in item[:item.index("</li>")]
    assert "summary" not in _marks(rows)[inserted.id][1]  # the edge says it; no bare "summary" mark
