"""Session stitching and next states, written through the real pool (SQLite and PostgreSQL)."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta, timezone
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session as OrmSession

from datapool.db import make_engine
from datapool.models import Session, Turn
from datapool.records import TurnRecord
from datapool.sessions import canonical_message, link_candidates
from datapool.sessions import Stitcher

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def _record(messages: list[dict[str, Any]], reply: dict[str, Any], at: int, **kw: Any) -> TurnRecord:
    return TurnRecord(
        id=uuid.uuid4().hex,
        created_at=T0 + timedelta(seconds=at),
        endpoint="chat",
        status=kw.pop("status", "ok"),
        model="m",
        capture="white-box",
        request={"messages": messages, "params": {}},
        response={"id": "x", "choices": [{"index": 0, "message": reply, "finish_reason": "stop"}]},
        **kw,
    )


def _conversation(tag: str) -> list[TurnRecord]:
    """Three turns of one conversation, the way an agent resends its growing history."""
    sys_msg = {"role": "system", "content": f"conversation {tag}"}
    u1 = {"role": "user", "content": "hi"}
    a1 = {"role": "assistant", "content": "hello"}
    u2 = {"role": "user", "content": "what is 2+2?"}
    a2 = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": '{"e":"2+2"}'}}]}
    tool = {"role": "tool", "tool_call_id": "c1", "content": "4"}
    a3 = {"role": "assistant", "content": "4"}
    # the client echoes the reply back with SDK noise: null fields, text as parts
    a1_echo = {"role": "assistant", "content": [{"type": "text", "text": "hello"}], "refusal": None}
    a2_echo = dict(a2, content="", audio=None)
    return [
        _record([sys_msg, u1], a1, 0),
        _record([sys_msg, u1, a1_echo, u2], a2, 1),
        _record([sys_msg, u1, a1_echo, u2, a2_echo, tool], a3, 2),
    ]


def _write(url: str, *batches: list[TurnRecord]) -> None:
    engine = make_engine(url)
    for batch in batches:
        with OrmSession(engine) as db, db.begin():
            Stitcher(db).write(batch)
    engine.dispose()


def _turns(url: str) -> list[Turn]:
    engine = make_engine(url)
    with OrmSession(engine) as db:
        rows = db.scalars(select(Turn).order_by(Turn.created_at)).all()
        db.expunge_all()
    engine.dispose()
    return list(rows)


def test_canonical_form_ignores_sdk_noise() -> None:
    plain = {"role": "assistant", "content": "hello"}
    noisy = {"role": "assistant", "content": [{"type": "text", "text": "hello"}], "refusal": None, "audio": None}
    assert canonical_message(plain) == canonical_message(noisy)
    assert canonical_message(plain) != canonical_message({"role": "assistant", "content": "hello!"})
    msgs = [{"role": "user", "content": "a"}, plain, {"role": "user", "content": "b"}, plain]
    assert [i for i, _ in link_candidates(msgs)] == [3, 1]


def test_inferred_conversation_is_one_session_with_next_states(database_url: str) -> None:
    t1, t2, t3 = _conversation("one")
    _write(database_url, [t1, t2, t3])
    turns = _turns(database_url)
    assert len({t.session_id for t in turns}) == 1
    by_id = {t.id: t for t in turns}
    assert by_id[t2.id].parent_turn_id == t1.id and by_id[t3.id].parent_turn_id == t2.id
    assert by_id[t1.id].next_state["messages"] == [{"role": "user", "content": "what is 2+2?"}]
    assert by_id[t2.id].next_state["messages"] == [{"role": "tool", "tool_call_id": "c1", "content": "4"}]
    assert by_id[t2.id].next_state["turn_id"] == t3.id
    assert by_id[t3.id].next_state is None


def test_unrelated_conversations_are_separate_sessions(database_url: str) -> None:
    a, b = _conversation("a"), _conversation("b")
    _write(database_url, [a[0], b[0]], [b[1], a[1]], [a[2], b[2]])
    sessions: dict[str, set[str]] = {}
    for t in _turns(database_url):
        sessions.setdefault(t.session_id, set()).add(t.id)
    assert set(map(frozenset, sessions.values())) == {frozenset(r.id for r in a), frozenset(r.id for r in b)}


def test_child_written_before_parent_is_adopted(database_url: str) -> None:
    # another replica (or a replayed spool) may write turn 2 before turn 1
    t1, t2, t3 = _conversation("late")
    _write(database_url, [t3], [t2], [t1])
    turns = _turns(database_url)
    assert len({t.session_id for t in turns}) == 1
    by_id = {t.id: t for t in turns}
    assert by_id[t1.id].next_state["turn_id"] == t2.id
    assert by_id[t2.id].next_state["turn_id"] == t3.id
    engine = make_engine(database_url)
    with OrmSession(engine) as db:
        assert db.scalar(select(Session.id)) == turns[0].session_id  # merged sessions removed
        assert len(db.scalars(select(Session)).all()) == 1
    engine.dispose()


def test_rewriting_is_idempotent(database_url: str) -> None:
    t1, t2, t3 = _conversation("again")
    _write(database_url, [t1, t2], [t1, t2, t3], [t3])
    assert len(_turns(database_url)) == 3


def test_explicit_session_and_side_turns(database_url: str) -> None:
    t1, t2, t3 = _conversation("named")
    for t in (t1, t2, t3):
        t.session_id, t.session_source = "sess-42", "header"
    side = _record([{"role": "user", "content": "summarise"}], {"role": "assistant", "content": "ok"}, 1,
                   session_id="sess-42", session_source="header", turn_type="side")
    # an agent that rewrote its history still continues its latest turn in a named session
    rewritten = _record([{"role": "user", "content": "compacted"}, {"role": "assistant", "content": "4"},
                         {"role": "user", "content": "thanks"}], {"role": "assistant", "content": "bye"}, 3,
                        session_id="sess-42", session_source="header")
    _write(database_url, [t1, side, t2, t3, rewritten])
    by_id = {t.id: t for t in _turns(database_url)}
    assert {t.session_id for t in by_id.values()} == {"sess-42"}
    assert by_id[t1.id].next_state["turn_id"] == t2.id  # the side turn did not take it
    assert by_id[side.id].turn_type == "side" and by_id[side.id].next_state is None
    assert by_id[t3.id].next_state == {"turn_id": rewritten.id, "messages": [{"role": "user", "content": "thanks"}]}


def test_failed_turn_is_not_continued(database_url: str) -> None:
    t1, t2, _ = _conversation("err")
    t1.status, t1.response, t1.error = "error", None, {"message": "upstream down"}
    _write(database_url, [t1, t2])
    by_id = {t.id: t for t in _turns(database_url)}
    assert by_id[t1.id].next_state is None
    assert by_id[t2.id].parent_turn_id is None
