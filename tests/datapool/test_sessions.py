"""Session stitching and next states, written through the real pool (SQLite and PostgreSQL)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from sqlalchemy import event, select
from sqlalchemy.orm import Session as OrmSession

from datapool.db import make_engine
from datapool.models import Session, Turn
from datapool.records import TurnRecord
from datapool.canonical import canonical_message, link_candidates
from datapool.sessions import Stitcher
from tests.support.records import turn_record

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def _record(messages: list[dict[str, Any]], reply: dict[str, Any], at: int, **kw: Any) -> TurnRecord:
    return turn_record(messages, reply, at=T0 + timedelta(seconds=at), response_id="x", **kw)


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


def _write(url: str, *batches: list[TurnRecord]) -> list[tuple[int, list[str]]]:
    """Each batch in a transaction of its own; (turns written, turns made ready) per batch."""
    engine = make_engine(url)
    out = []
    for batch in batches:
        with OrmSession(engine) as db, db.begin():
            stitcher = Stitcher(db)
            out.append((stitcher.write(batch), stitcher.ready))
    engine.dispose()
    return out


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


# --- one batch holding turns that link to each other: stitched as if written one at a time ---


def _sessions(url: str) -> list[Session]:
    engine = make_engine(url)
    with OrmSession(engine) as db:
        rows = db.scalars(select(Session)).all()
        db.expunge_all()
    engine.dispose()
    return list(rows)


def _assert_one_conversation(turns: dict[str, Turn], conv: list[TurnRecord]) -> None:
    t1, t2, t3 = (turns[r.id] for r in conv)
    assert t1.session_id == t2.session_id == t3.session_id
    assert (t1.parent_turn_id, t2.parent_turn_id, t3.parent_turn_id) == (None, t1.id, t2.id)
    assert t1.next_state == {"turn_id": t2.id, "messages": [{"role": "user", "content": "what is 2+2?"}]}
    assert t2.next_state == {"turn_id": t3.id, "messages": [{"role": "tool", "tool_call_id": "c1", "content": "4"}]}
    assert t3.next_state is None


def test_child_before_parent_in_one_batch(database_url: str) -> None:
    conv = _conversation("reversed")
    [(written, ready)] = _write(database_url, conv[::-1])
    assert written == 3 and sorted(ready) == sorted(r.id for r in conv[:2])
    _assert_one_conversation({t.id: t for t in _turns(database_url)}, conv)
    assert len(_sessions(database_url)) == 1  # the sessions the children started were merged away


def test_batch_adopts_a_stored_orphan_while_linking_its_own_turns(database_url: str) -> None:
    # turn 3 came first (another replica); turns 1 and 2 arrive together, and turn 2 must both
    # continue turn 1 of its own batch and adopt turn 3 from the pool
    conv = _conversation("mixed")
    _write(database_url, [conv[2]], conv[:2])
    _assert_one_conversation({t.id: t for t in _turns(database_url)}, conv)
    assert len(_sessions(database_url)) == 1


def test_many_conversations_in_one_batch(database_url: str) -> None:
    convs = [_conversation(f"c{i}") for i in range(30)]
    # the way concurrent agents interleave: every first turn, then every second, then every third
    batch = [conv[k] for k in range(3) for conv in convs]
    [(written, ready)] = _write(database_url, batch)
    assert written == 90 and len(ready) == 60
    turns = {t.id: t for t in _turns(database_url)}
    for conv in convs:
        _assert_one_conversation(turns, conv)
    sessions = {s.id: s for s in _sessions(database_url)}
    assert len(sessions) == 30
    session = sessions[turns[convs[0][2].id].session_id]
    assert session.source == "inferred"
    # SQLite hands times back without their zone
    assert session.updated_at.replace(tzinfo=None) == (T0 + timedelta(seconds=2)).replace(tzinfo=None)


def _with_choices(record: TurnRecord, *replies: dict[str, Any]) -> TurnRecord:
    assert record.response is not None
    record.response["choices"] = [{"index": i, "message": m, "finish_reason": "stop"} for i, m in enumerate(replies)]
    return record


@pytest.mark.parametrize("children_first", [False, True])
def test_children_of_each_choice_continue_one_parent(database_url: str, children_first: bool) -> None:
    q = [{"role": "user", "content": "name a colour"}]
    red, blue = {"role": "assistant", "content": "red"}, {"role": "assistant", "content": "blue"}
    parent = _with_choices(_record(q, red, 0), red, blue)
    on_red = _record([*q, red, {"role": "user", "content": "why red?"}], {"role": "assistant", "content": "warm"}, 1)
    on_blue = _record([*q, blue, {"role": "user", "content": "why blue?"}], {"role": "assistant", "content": "calm"}, 2)
    batch = [on_blue, on_red, parent] if children_first else [parent, on_red, on_blue]
    [(_, ready)] = _write(database_url, batch)
    turns = {t.id: t for t in _turns(database_url)}
    assert turns[on_red.id].parent_turn_id == turns[on_blue.id].parent_turn_id == parent.id
    assert len({t.session_id for t in turns.values()}) == 1 and len(_sessions(database_url)) == 1
    # the red child gives the next state: it is written first, or, when the parent adopts both,
    # created first
    assert turns[parent.id].next_state == {"turn_id": on_red.id, "messages": [{"role": "user", "content": "why red?"}]}
    assert ready == [parent.id]


def test_retried_request_children_link_to_the_earliest_copy(database_url: str) -> None:
    q = [{"role": "user", "content": "hi"}]
    a = {"role": "assistant", "content": "hello"}
    first, retry = _record(q, a, 0), _record(q, a, 1)  # same request, same reply
    child = _record([*q, a, {"role": "user", "content": "bye"}], {"role": "assistant", "content": "bye"}, 2)
    other = _record([*q, a, {"role": "user", "content": "again"}], {"role": "assistant", "content": "ok"}, 3)
    [(written, ready)] = _write(database_url, [retry, first, child, other])
    assert written == 4
    turns = {t.id: t for t in _turns(database_url)}
    assert turns[child.id].parent_turn_id == turns[other.id].parent_turn_id == first.id
    assert turns[first.id].next_state["turn_id"] == child.id and turns[retry.id].next_state is None
    assert ready == [first.id]


def test_same_record_twice_in_one_batch(database_url: str) -> None:
    t1, t2, t3 = _conversation("twice")
    results = _write(database_url, [t1, t1, t2], [t2, t3, t3])
    assert [written for written, _ in results] == [2, 1]
    _assert_one_conversation({t.id: t for t in _turns(database_url)}, [t1, t2, t3])


def test_session_done_mid_batch(database_url: str) -> None:
    a, b = _conversation("done"), _conversation("open")
    for r in a:
        r.session_id, r.session_source = "sess-done", "header"
    a[1].session_done = True
    [(_, ready)] = _write(database_url, [a[0], b[0], a[1], b[1]])
    # a[1] ends its session, so it is scored without waiting for a next state
    assert ready == [a[0].id, a[1].id, b[0].id]
    ended = {s.id: s.ended_at is not None for s in _sessions(database_url)}
    assert ended.pop("sess-done") and not any(ended.values())


def test_statements_per_batch_do_not_grow_with_the_batch(database_url: str) -> None:
    engine = make_engine(database_url)
    counts = []
    for n in (5, 40):
        convs = [_conversation(f"{n}-{i}") for i in range(n)]
        statements = 0

        def count(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
            nonlocal statements
            # scoring.mark_pending marks each ready turn with a statement of its own
            statements += not statement.startswith("INSERT INTO judgements")

        event.listen(engine, "before_cursor_execute", count)
        for k in range(3):
            with OrmSession(engine) as db, db.begin():
                Stitcher(db).write([conv[k] for conv in convs])
        event.remove(engine, "before_cursor_execute", count)
        counts.append(statements)
    engine.dispose()
    assert counts[0] == counts[1] <= 30
