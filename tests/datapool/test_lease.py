"""Which scored turns a run leases: session modes (eval sessions are never trained on)."""

from __future__ import annotations

import uuid
from datetime import datetime, timezone

from sqlalchemy.orm import Session as OrmSession

from datapool.db import make_engine
from datapool.models import Judgement, Session, Turn
from datapool.leases import Filters, lease, start_run


def _seed(url: str) -> dict[str, str]:
    """One scored main turn in a session of each mode; returns mode -> turn id."""
    engine = make_engine(url)
    ids = {}
    with OrmSession(engine) as db, db.begin():
        for mode in ("online", "offline", "eval"):
            sid, tid = f"s-{mode}", str(uuid.uuid4())
            db.add(Session(id=sid, source="header", mode=mode))
            db.flush()
            db.add(Turn(id=tid, session_id=sid, endpoint="chat", status="ok", capture="white-box",
                        created_at=datetime.now(timezone.utc), model="smollm2",
                        request={"messages": [{"role": "user", "content": mode}]}))
            db.flush()
            db.add(Judgement(turn_id=tid, status="scored", reward=1.0, prm_reward=1.0, attempts=1))
            ids[mode] = tid
    engine.dispose()
    return ids


def _leased(url: str, filters: Filters) -> set[str]:
    engine = make_engine(url)
    run_id = start_run(engine, objective="rl", backend="local", config={}, base_version=None)
    got = set(lease(engine, run_id, limit=10, filters=filters))
    engine.dispose()
    return got


def test_eval_sessions_are_never_leased(database_url: str) -> None:
    ids = _seed(database_url)
    assert _leased(database_url, Filters()) == {ids["online"], ids["offline"]}
    assert _leased(database_url, Filters(modes=("offline",))) == {ids["offline"]}
    # asking for eval explicitly still does not train on it
    assert _leased(database_url, Filters(modes=("eval", "online"))) == {ids["online"]}


def test_new_only_skips_turns_an_earlier_run_trained_on(database_url: str) -> None:
    from datapool.leases import ack

    ids = _seed(database_url)
    engine = make_engine(database_url)
    first = start_run(engine, objective="rl", backend="local", config={}, base_version=None)
    got = lease(engine, first, limit=10)
    assert set(got) == {ids["online"], ids["offline"]}
    with OrmSession(engine) as db, db.begin():
        ack(db, first, [ids["online"]], step=1)  # the offline turn stays leased, unacked
    engine.dispose()
    # a later run: the acked turn is not new; the one only leased (never trained) still is
    assert _leased(database_url, Filters(new_only=True)) == {ids["offline"]}
    assert _leased(database_url, Filters()) == {ids["online"], ids["offline"]}
