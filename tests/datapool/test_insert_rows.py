"""datapool.db.insert_rows: the capture writer's turns, continuations and new sessions go into
PostgreSQL by COPY; every stored value must be what ``db.execute(insert(table), rows)`` stores."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import delete, insert, select, text
from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.orm import Session as OrmSession

from base.vocab import SessionMode, TurnStatus
from datapool.db import insert_rows, make_engine, pg_array
from datapool.models import Session, Turn, TurnContinuation

_turns, _sessions, _continuations = Turn.__table__, Session.__table__, TurnContinuation.__table__

# text as agents send it: quotes, backslashes, tabs and newlines (COPY's own escapes), any script
_text = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=30)
_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53)
    | st.floats(allow_nan=False, allow_infinity=False) | _text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_text, inner, max_size=4),
    max_leaves=12,
)
_when = st.datetimes(min_value=datetime(2000, 1, 1), max_value=datetime(2100, 1, 1),
                     timezones=st.sampled_from([timezone.utc, timezone(timedelta(hours=5, minutes=30))]))


def _rows(engine: Any, session_id: str, turn: dict[str, Any], continuation: dict[str, Any],
          session: dict[str, Any], by_copy: bool) -> tuple[Any, ...]:
    """Insert the three rows (fresh ids) one way or the other; read them back."""
    turn_id = uuid.uuid4().hex
    sid = f"{session_id}-{int(by_copy)}"
    put = (lambda db, table, rows: insert_rows(db, table, rows)) if by_copy else (
        lambda db, table, rows: db.execute(insert(table), rows))
    with OrmSession(engine) as db, db.begin():
        put(db, _sessions, [dict(session, id=sid)])
        put(db, _turns, [dict(turn, id=turn_id, session_id=sid)])
        put(db, _continuations, [dict(continuation, turn_id=turn_id)])
    with OrmSession(engine) as db:
        s = db.execute(select(_sessions).where(_sessions.c.id == sid)).one()._asdict()
        t = db.execute(select(_turns).where(_turns.c.id == turn_id)).one()._asdict()
        c = db.execute(select(_continuations).where(_continuations.c.turn_id == turn_id)).one()._asdict()
        db.execute(delete(_sessions).where(_sessions.c.id == sid))
        db.commit()
    for row, key in ((s, "id"), (t, "id"), (t, "session_id"), (c, "turn_id")):
        row.pop(key)
    return s, t, c


@pytest.fixture(scope="module")
def pg_engine(module_db_url: str) -> Any:
    engine = make_engine(module_db_url)
    yield engine
    engine.dispose()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(request=_json, response=_json | st.none(), usage=st.dictionaries(_text, st.integers(0, 10**6), max_size=3),
       ids=st.none() | st.lists(st.integers(0, 2**31 - 1), max_size=6),
       logprobs=st.none() | st.lists(st.floats(-100, 0), max_size=6),
       latency=st.none() | st.floats(0, 1e6), text=_text, when=_when, answered=st.none() | st.booleans())
def test_rows_by_copy_are_the_rows_an_insert_stores(pg_engine: Any, request: Any, response: Any, usage: Any,
                                                     ids: Any, logprobs: Any, latency: Any, text: str,
                                                     when: datetime, answered: Any) -> None:
    turn = {"parent_turn_id": None, "turn_type": "main", "endpoint": "chat", "wire_format": "chat",
            "status": TurnStatus.OK, "created_at": when, "model": text or "m", "upstream_model": text,
            "policy_version": None, "capture": "white-box", "request": {"messages": request},
            "response": response, "next_state": None, "prompt_token_ids": ids, "token_ids": ids,
            "logprobs": logprobs, "latency_ms": latency, "usage": usage, "error": None,
            "redaction": None, "link_hash": text[:64], "response_id": text, "edit": None}
    continuation = {"hash": uuid.uuid4().hex, "choice_index": -3, "created_at": when, "answered": answered,
                    "system_free": answered}
    # no `mode`: the column's default comes with the rows, as SQLAlchemy's insert gives it
    session = {"source": "inferred", "task_id": text or None, "group_id": None, "created_at": when,
               "updated_at": when, "metadata": {"k": text}, "client": None, "tenant": None}
    by_insert = _rows(pg_engine, "s", turn, continuation, session, by_copy=False)
    by_copy = _rows(pg_engine, "s", turn, continuation, session, by_copy=True)
    assert by_copy == by_insert
    assert by_copy[0]["mode"] == SessionMode.ONLINE


def test_a_rejected_row_is_sqlalchemys_error_and_sqlite_inserts(pg_engine: Any, tmp_path: Any) -> None:
    """A row the database refuses raises what an insert raises (the writer splits its batch on
    it); on SQLite the rows are inserted as before."""
    row = {"hash": "h", "turn_id": "no-such-turn", "choice_index": 0}
    with pytest.raises(IntegrityError) as caught, OrmSession(pg_engine) as db, db.begin():
        insert_rows(db, _continuations, [row])
    assert isinstance(caught.value, DBAPIError) and "COPY" in str(caught.value.statement)
    from datapool.db import upgrade

    url = f"sqlite:///{tmp_path / 'pool.db'}"
    upgrade(url)
    engine = make_engine(url)
    try:
        now = datetime.now(timezone.utc)
        with OrmSession(engine) as db, db.begin():
            insert_rows(db, _sessions, [{"id": "s", "source": "inferred", "created_at": now, "updated_at": now,
                                         "metadata": {}}])
        with OrmSession(engine) as db:
            assert db.execute(select(_sessions.c.mode)).scalar_one() == SessionMode.ONLINE
    finally:
        engine.dispose()


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(texts=st.lists(_text | st.sampled_from(["NULL", "null", "", " ", "{}", "a,b", '"', "\\", "{\"x\"}"]),
                      max_size=12),
       numbers=st.lists(st.integers(-(2**63), 2**63 - 1), max_size=12))
def test_an_array_parameter_is_the_list_it_was_made_of(pg_engine: Any, texts: list[str], numbers: list[int]) -> None:
    """datapool.db.pg_array: the writer's ids, hashes and lock keys as one PostgreSQL array text each; what
    PostgreSQL reads back is the list, element for element (quotes, backslashes, braces, commas, the word
    NULL, empty strings, any script; bigints to their bounds)."""
    with pg_engine.connect() as db:
        got_texts = db.execute(text("SELECT CAST(:a AS varchar[])"), {"a": pg_array(texts)}).scalar_one()
        got_numbers = db.execute(text("SELECT CAST(:a AS bigint[])"), {"a": pg_array(numbers)}).scalar_one()
    assert got_texts == texts and got_numbers == numbers
