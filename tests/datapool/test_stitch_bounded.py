"""Stitching reads a bounded number of stored turns however many share an opening.

Every environment of a rollout, and every request of the gateway's benchmark, starts with the
same messages and often gets the same first reply: thousands of stored turns share one
continuation hash and one request hash. A batch must not read all of them (the capture writer
fell behind the gateway so), and must still link each record as before: to the earliest such
turn of its named session, or of the pool when its session is inferred; a retry to the call
that failed.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session as OrmSession

from datapool.db import make_engine
from datapool.models import Turn
from datapool.records import TurnRecord
from datapool.sessions import Stitcher
from datapool.stitch_reads import KnownTurns
from tests.support.records import turn_record

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
SYSTEM = {"role": "system", "content": "You solve terminal tasks."}
TASK = {"role": "user", "content": "Sort names.txt into sorted.txt."}
CALL = {"role": "assistant", "content": "sort names.txt > sorted.txt"}


def _opening(i: int, session: str | None, status: str = "ok") -> TurnRecord:
    return turn_record([SYSTEM, TASK], CALL if status == "ok" else None, at=T0 + timedelta(seconds=i),
                       status=status, session_id=session)


def _write(engine: Any, records: list[TurnRecord]) -> int:
    """Stitch *records* in one batch; the stored turns the batch read (KnownTurns.known calls)."""
    before = KnownTurns.known
    count = [0]

    def counting(self: KnownTurns, row: Any) -> Any:
        count[0] += 1
        return before(self, row)

    KnownTurns.known = counting  # type: ignore[method-assign]
    try:
        with OrmSession(engine) as db, db.begin():
            Stitcher(db).write(records)
    finally:
        KnownTurns.known = before  # type: ignore[method-assign]
    return count[0]


def _turn(engine: Any, turn_id: str) -> Turn:
    with OrmSession(engine) as db:
        turn = db.get(Turn, turn_id)
        assert turn is not None
        db.expunge(turn)
        return turn


@pytest.mark.parametrize("named", [False, True], ids=["inferred", "named"])
def test_stored_turns_read_per_batch_do_not_grow_with_identical_openings(database_url: str, named: bool) -> None:
    engine = make_engine(database_url)
    reads: dict[int, int] = {}
    stored = 0
    for total in (20, 200):
        openings = [_opening(stored + i, f"env-{stored + i}" if named else None) for i in range(total - stored)]
        for at in range(0, len(openings), 50):
            _write(engine, openings[at:at + 50])
        stored = total
        # the next call of three environments: each continues its own opening (named), or the
        # pool's earliest one (inferred: the same history and reply, nothing else tells them apart)
        sessions = [f"env-{k}" if named else None for k in (0, 7, total - 1)]
        result = {"role": "user", "content": f"exit 0 ({total} stored)"}  # unlike any earlier request
        nexts = [turn_record([SYSTEM, TASK, CALL, result], "done", at=T0 + timedelta(hours=1, seconds=total + k),
                             session_id=s) for k, s in enumerate(sessions)]
        reads[total] = _write(engine, nexts)
        with OrmSession(engine) as db:
            first = db.scalars(select(Turn).order_by(Turn.created_at, Turn.id).limit(1)).one()
            for record, session in zip(nexts, sessions):
                turn = db.get(Turn, record.id)
                assert turn is not None and turn.parent_turn_id is not None
                parent = db.get(Turn, turn.parent_turn_id)
                assert parent is not None
                if named:
                    assert turn.session_id == session == parent.session_id
                else:
                    assert parent.id == first.id and turn.session_id == first.session_id
    engine.dispose()
    assert reads[20] == reads[200], reads  # bounded: 10x the stored openings, the same rows read
    assert reads[200] <= 3 * 4 * 2 + 8


def test_a_retry_finds_the_failed_call_among_many_answered(database_url: str) -> None:
    engine = make_engine(database_url)
    _write(engine, [_opening(i, None) for i in range(60)])
    failed = _opening(100, None, status="cancelled")
    _write(engine, [failed])
    _write(engine, [_opening(i, None) for i in range(101, 160)])
    # the same messages again: a retry of the call that failed, not of any answered one
    retry = turn_record([SYSTEM, TASK], CALL, at=T0 + timedelta(seconds=200))
    loaded = _write(engine, [retry])
    turn = _turn(engine, retry.id)
    assert turn.parent_turn_id == failed.id
    assert loaded <= 16, loaded
    engine.dispose()
