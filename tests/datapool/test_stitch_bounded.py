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


def _plan(db: OrmSession, statement: Any) -> str:
    """The database's plan of *statement*: PostgreSQL's as run (EXPLAIN ANALYZE, actual rows per
    node), SQLite's query plan."""
    from sqlalchemy import text

    compiled = statement.compile(dialect=db.get_bind().dialect, compile_kwargs={"render_postcompile": True})
    conn = db.connection()
    if db.get_bind().dialect.name == "postgresql":
        db.execute(text("SET LOCAL enable_seqscan = off"))  # as on a pool too big to scan
        rows = conn.exec_driver_sql(f"EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF) {compiled}", compiled.params)
        return "\n".join(r[0] for r in rows)
    params = tuple(compiled.params[name] for name in compiled.positiontup or ())
    return "\n".join(r[-1] for r in conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {compiled}", params))


@pytest.mark.parametrize("reader", ["parents", "pairs"])
def test_the_database_reads_an_index_range_per_hash_and_kind(database_url: str, reader: str) -> None:
    """Not only the rows stitching receives: the rows the database itself walks stay few. Each
    hash and kind is one range of ix_turn_continuations_first, in its order, cut at its LIMIT:
    no sort, and no scan of the turns that share the hash."""
    import re

    from datapool.edits import TAIL_INDEX
    from datapool.stitch_reads import KINDS, PARENTS_KEPT, per_hash

    engine = make_engine(database_url)
    openings = [_opening(i, None) for i in range(300)]
    for at in range(0, len(openings), 100):
        _write(engine, openings[at:at + 100])
    from sqlalchemy import func

    from datapool.models import TurnContinuation as TC

    pairs = TC.choice_index <= TAIL_INDEX  # reply pairs and request tails, else continuations
    with OrmSession(engine) as db:  # the key every opening stored: the one a next request looks up
        key, shared = db.execute(select(TC.hash, func.count()).where(pairs if reader == "pairs" else ~pairs)
                                 .group_by(TC.hash).order_by(func.count().desc()).limit(1)).one()
    assert shared >= len(openings)
    if reader == "parents":
        kinds, limit, where = KINDS, PARENTS_KEPT, "TRUE"
    else:
        kinds, limit, where = ((False, False), (False, True)), 64, f"c.choice_index <= {TAIL_INDEX}"
    with OrmSession(engine) as db, db.begin():
        ((statement, params),) = per_hash(db, [key], kinds, limit=limit, latest=reader == "pairs", where=where)
        statement = statement.bindparams(**params)
        rows = db.execute(statement).all()
        plan = _plan(db, statement)
    engine.dispose()
    assert rows and len(rows) <= limit * len(kinds), len(rows)  # found, and cut at the LIMIT
    assert "ix_turn_continuations_first" in plan, plan
    if database_url.startswith("sqlite"):
        assert "TEMP B-TREE" not in plan and re.search(r"SEARCH c USING (COVERING )?INDEX ix_turn_continuations_first"
                                                       r" \(hash=\? AND system_free=\? AND answered=\?\)", plan), plan
    else:
        assert "Sort" not in plan, plan
        walked = [int(n) for n in re.findall(r"Scan(?: Backward)? using ix_turn_continuations_first[^\n]*"
                                             r"\(actual rows=(\d+)", plan)]
        assert walked and max(walked) <= limit, plan  # rows per range (a mean per loop): cut at its LIMIT


def test_continuation_keys_are_copied_from_their_turns_by_the_writer_and_by_migration_0020(
        database_url: str) -> None:
    from alembic import command
    from sqlalchemy import update

    from datapool.db import alembic_config
    from datapool.edits import is_system_free_index
    from datapool.models import TurnContinuation
    from datapool.sessions import rehash

    engine = make_engine(database_url)
    _write(engine, [_opening(i, f"s{i % 3}", status="ok" if i % 4 else "cancelled") for i in range(12)])
    nexts = [turn_record([SYSTEM, TASK, CALL, {"role": "user", "content": f"next {i}"}], "done",
                         at=T0 + timedelta(hours=1, seconds=i), session_id=f"s{i % 3}") for i in range(6)]
    _write(engine, nexts)
    columns = (TurnContinuation.turn_id, TurnContinuation.hash, TurnContinuation.choice_index,
               TurnContinuation.created_at, TurnContinuation.answered, TurnContinuation.system_free)

    def keys() -> set[tuple[Any, ...]]:
        with engine.connect() as conn:
            return {tuple(r) for r in conn.execute(select(*columns))}

    written = keys()
    with engine.connect() as conn:
        turns = {t.id: t for t in conn.execute(select(Turn.id, Turn.created_at, Turn.status))}
    assert any(not r[4] for r in written) and any(r[5] for r in written)  # both kinds are there
    for turn_id, _, index, at, answered, free in written:
        assert (at, answered, free) == (turns[turn_id].created_at, turns[turn_id].status == "ok",
                                        is_system_free_index(index))
    with engine.begin() as conn:  # rows an older gateway wrote: `nextstate db rehash` fills them
        conn.execute(update(TurnContinuation).values(created_at=None, answered=None, system_free=None))
        assert rehash(conn) == (18, 0)
    assert keys() == written
    engine.dispose()  # a pool of 0019: the columns gone; 0020 fills them
    cfg = alembic_config(database_url)
    command.downgrade(cfg, "0019")
    command.upgrade(cfg, "head")
    engine = make_engine(database_url)
    assert keys() == written
    engine.dispose()


def test_a_statement_run_many_times_is_planned_for_the_pool_as_it_is_now(pg_url: str) -> None:
    """A statement run many times (psycopg prepares one on its 5th run) is planned for the pool as
    it is, not as it was: the server's generic plan, made while the pool was empty, scans every
    turn once there are thousands (10 ms for 50 ids at 10,000 turns). make_engine asks for a plan
    per execution; a URL that sets its own options gets the server's default, and the stale plan."""
    from sqlalchemy import text

    types = ", ".join(["varchar"] * 50)
    params = ", ".join(f"${i + 1}" for i in range(50))
    ids = ", ".join(f"'missing-{i}'" for i in range(50))
    engines = {"ours": make_engine(pg_url), "default": make_engine(f"{pg_url}?options=-c%20jit%3Doff")}
    with engines["ours"].begin() as conn:  # an ANALYZE by autovacuum mid-test would re-plan the default's
        conn.execute(text("ALTER TABLE turns SET (autovacuum_enabled = false)"))
    conns = {name: e.connect() for name, e in engines.items()}
    try:
        for conn in conns.values():
            conn.execute(text(f"PREPARE by_ids({types}) AS SELECT id FROM turns WHERE id IN ({params})"))
            for _ in range(8):  # on an empty pool
                conn.execute(text(f"EXECUTE by_ids({ids})")).all()
        for at in range(0, 3000, 500):
            _write(engines["ours"], [_opening(i, None) for i in range(at, at + 500)])
        plans = {name: "\n".join(r[0] for r in conn.execute(text(f"EXPLAIN EXECUTE by_ids({ids})")))
                 for name, conn in conns.items()}
    finally:
        for conn in conns.values():
            conn.close()
        for e in engines.values():
            e.dispose()
    assert "Seq Scan" in plans["default"], plans  # the hazard, with the server's default
    assert "Seq Scan" not in plans["ours"] and "turns_pkey" in plans["ours"], plans
