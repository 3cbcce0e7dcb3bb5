"""Lineage from turns to policy versions, on a real pool (SQLite and PostgreSQL): the versions a
step trained on a turn, those an online run registered after that step, an offline run's
product, and their descendants; not the versions before the step, of other runs, or unrelated."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta, timezone

from sqlalchemy.orm import Session as OrmSession

from datapool.db import make_engine, upgrade
from datapool.leases import ack, start_run
from datapool.lineage import session_lineage, versions_trained_on
from datapool.models import PolicyVersion, TrainingLease, TrainingRun
from datapool.records import TurnRecord
from datapool.sessions import Stitcher
from tests.support.records import turn_record


def _turn(session: str) -> TurnRecord:
    return turn_record([{"role": "user", "content": uuid.uuid4().hex}], capture="black-box", response_id="r",
                       session_id=session, session_source="header")


def test_versions_trained_on_turns(database_url: str) -> None:
    upgrade(database_url)
    engine = make_engine(database_url)
    early, late, untrained, other = (_turn("s-early"), _turn("s-late"), _turn("s-none"), _turn("s-other"))
    with OrmSession(engine) as db, db.begin():
        Stitcher(db).write([early, late, untrained, other])
    online, offline = (start_run(engine, objective="rl", backend="local", config={}, base_version=None)
                       for _ in range(2))
    t0 = datetime.now(timezone.utc)
    with OrmSession(engine) as db, db.begin():
        for run, turns, step in ((online, [early.id], 1), (online, [late.id], 3), (offline, [other.id], 1)):
            db.add_all(TrainingLease(run_id=run, turn_id=t, leased_at=t0, expires_at=t0 + timedelta(minutes=10))
                       for t in turns)
            db.flush()
            ack(db, run, turns, step)
        db.get(TrainingRun, offline).produced_version = "offline-v"

        def version(name: str, minutes: int, parent: PolicyVersion | None = None, **stats: object) -> PolicyVersion:
            v = PolicyVersion(name=name, base_model="b", kind="lora", status="candidate", stats=stats,
                              created_at=t0 + timedelta(minutes=minutes), parent_id=parent.id if parent else None)
            db.add(v)
            db.flush()
            return v

        unrelated = version("unrelated", 0)
        v2 = version("online-step2", 1, run_id=online, step=2)
        v4 = version("online-step4", 2, v2, run_id=online, step=4)
        child = version("child-of-step4", 3, v4, run_id="later-run", step=1)
        version("grandchild", 4, child)
        version("offline-v", 5, unrelated)
    with OrmSession(engine) as db:
        names = lambda turns: {v["name"]: v.get("via") or v["learned"] for v in versions_trained_on(db, turns)}  # noqa: E731
        assert names([early.id]) == {"online-step2": "trained", "online-step4": "trained",
                                     "child-of-step4": "online-step4", "grandchild": "online-step4"}
        assert names([late.id]) == {"online-step4": "trained", "child-of-step4": "online-step4",
                                    "grandchild": "online-step4"}
        assert names([other.id]) == {"offline-v": "trained"}
        assert names([untrained.id]) == {}
        assert session_lineage(db, "s-late")["turns"] == 1
    engine.dispose()
