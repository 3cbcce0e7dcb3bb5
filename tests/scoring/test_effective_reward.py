"""``turns.effective_reward`` (migration 0010) is the reward the pool computes for a turn — a
person's override in force (the turn's, else its session's), else its judgement's reward —
after any sequence of writes: judgements scored by the scorer's own aggregation, feedback,
labels set, withdrawn, tagged and untagged on turns and sessions, judgements dead-lettered and
retried through the sweep's path, outcomes, new turns, deleted judgements and sessions. Checked
against both the SQL the UI computed before (``datapool.browse.computed_reward``) and the
trainer's Python path (``labels.reward_overrides`` over ``Judgement.reward``), on SQLite and
PostgreSQL; and the migration's backfill of a pool written before it."""

from __future__ import annotations

import math
import uuid
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

from alembic import command
from hypothesis import HealthCheck
from hypothesis import settings as hsettings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)
from sqlalchemy import delete, select, text
from sqlalchemy.orm import Session as OrmSession

from datapool import judgements, labels
from datapool.browse import computed_reward
from datapool.db import alembic_config, make_engine
from datapool.models import Judgement, Label, Session, Turn, Vote
from scoring.score import aggregate

JUDGE = SimpleNamespace(name="prop-judge", prompt_version=None)
T0 = datetime(2026, 3, 1, tzinfo=UTC)


def add_turn(db: OrmSession, session_id: str, n: int) -> str:
    tid = str(uuid.uuid4())
    db.add(Turn(id=tid, session_id=session_id, turn_type="main", endpoint="chat", status="ok",
                created_at=T0 + timedelta(seconds=n), model="m", capture="black-box",
                request={"messages": [{"role": "user", "content": f"q{n}"}]},
                response={"choices": [{"index": 0, "message": {"role": "assistant", "content": "a"}}]},
                next_state={"messages": [{"role": "user", "content": "thanks"}]}))
    db.flush()
    return tid


def mismatches(engine: Any) -> list[tuple[str, Any, Any, Any]]:
    """Turns whose stored reward differs from the SQL or the Python computation."""
    with OrmSession(engine) as db:
        rows = db.execute(select(Turn.id, Turn.effective_reward, computed_reward(), Judgement.reward)
                          .outerjoin(Judgement, Judgement.turn_id == Turn.id)).all()
        overrides = labels.reward_overrides(db, [r[0] for r in rows])
    out = []
    for tid, stored, sql, judged in rows:
        python = overrides.get(tid, judged)
        if not (_same(stored, sql) and _same(stored, python)):
            out.append((tid, stored, sql, python))
    return out


def _same(a: float | None, b: float | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and math.isclose(a, b, abs_tol=1e-12))


def test_materialised_reward_follows_every_kind_of_write(database_url: str) -> None:
    engine = make_engine(database_url)
    reward = st.one_of(st.none(), st.sampled_from([-1.0, 1.0, 0.0, 0.5]),
                       st.floats(-1, 1, allow_nan=False, allow_subnormal=False))
    idx = st.integers(0, 100)

    class Writes(RuleBasedStateMachine):
        @initialize()
        def fresh_pool(self) -> None:
            with OrmSession(engine) as db, db.begin():
                db.execute(delete(Session))  # cascades to turns, judgements, votes, labels
                self.sessions = [f"s{i}-{uuid.uuid4().hex[:6]}" for i in range(2)]
                for i, sid in enumerate(self.sessions):
                    db.add(Session(id=sid, source="header", created_at=T0 + timedelta(minutes=i)))
                db.flush()
                self.turns = [add_turn(db, sid, 10 * i + j) for i, sid in enumerate(self.sessions) for j in range(2)]
            self.n = 100

        def _turn(self, i: int) -> str:
            return self.turns[i % len(self.turns)]

        def _session(self, i: int) -> str:
            return self.sessions[i % len(self.sessions)]

        @rule(i=idx, votes=st.lists(st.sampled_from([1, -1, 0, None]), min_size=1, max_size=3))
        def judge_scores(self, i: int, votes: list[int | None]) -> None:
            """The scorer's path: pending, its votes stored, then aggregated into the judgement."""
            tid = self._turn(i)
            with OrmSession(engine) as db, db.begin():
                judgements.mark_pending(db, [tid])
                db.execute(delete(Vote).where(Vote.turn_id == tid, Vote.kind == "prm"))
                for k, v in enumerate(votes):
                    db.add(Vote(turn_id=tid, kind="prm", dedupe_key=f"prm:{JUDGE.name}::{k}", judge=JUDGE.name,
                                vote_index=k, value=v, raw=None if v is not None else "??"))
            aggregate(engine, tid, JUDGE, None, hint_gate=False)

        @rule(i=idx, value=st.sampled_from([1, -1]))
        def user_feedback(self, i: int, value: int) -> None:
            tid = self._turn(i)
            with OrmSession(engine) as db, db.begin():
                judgements.record_feedback(db, turn_id=tid, response_id=None, value=value, text=None)
            aggregate(engine, tid, JUDGE, None, hint_gate=False)

        @rule(i=idx, value=reward, on_session=st.booleans())
        def override(self, i: int, value: float | None, on_session: bool) -> None:
            """Set (or, with None, withdraw) a reward override on a turn or a whole session."""
            target = {"session_id": self._session(i)} if on_session else {"turn_id": self._turn(i)}
            with OrmSession(engine) as db, db.begin():
                labels.add_label(db, kind="override", value=value, author="prop", **target)

        @rule(i=idx, kind=st.sampled_from(["tag", "untag", "thumb", "exclude", "note"]), on_session=st.booleans())
        def other_label(self, i: int, kind: str, on_session: bool) -> None:
            value = {"tag": "bad-tool", "untag": "bad-tool", "thumb": -1, "exclude": True, "note": "n"}[kind]
            target = {"session_id": self._session(i)} if on_session else {"turn_id": self._turn(i)}
            with OrmSession(engine) as db, db.begin():
                labels.add_label(db, kind=kind, value=value, author="prop", **target)

        @rule(i=idx, fail=st.booleans())
        def dead_then_retried(self, i: int, fail: bool) -> None:
            """Dead-lettered (or a transient failure), then re-queued by the judgements page's retry."""
            tid = self._turn(i)
            with OrmSession(engine) as db, db.begin():
                judgements.mark_pending(db, [tid])
            if fail:
                judgements.record_failure(engine, tid, "boom")
            judgements.mark_dead(engine, tid, "boom")
            with OrmSession(engine) as db, db.begin():
                assert judgements.retry(db, turn_ids=[tid]) == [tid]

        @rule(i=idx, outcome=st.sampled_from([0.0, 1.0, -1.0]))
        def outcome(self, i: int, outcome: float) -> None:
            with OrmSession(engine) as db, db.begin():
                judgements.apply_outcome(db, self._session(i), outcome, "verifier")

        @rule(i=idx)
        def new_turn(self, i: int) -> None:
            """A turn captured into a session that may already carry an override."""
            with OrmSession(engine) as db, db.begin():
                self.n += 1
                self.turns.append(add_turn(db, self._session(i), self.n))

        @rule(i=idx)
        def judgement_deleted(self, i: int) -> None:
            with OrmSession(engine) as db, db.begin():
                db.execute(delete(Judgement).where(Judgement.turn_id == self._turn(i)))

        @rule(i=idx)
        def session_deleted(self, i: int) -> None:
            if len(self.sessions) < 2:
                return
            sid = self.sessions.pop(i % len(self.sessions))
            with OrmSession(engine) as db, db.begin():
                gone = set(db.scalars(select(Turn.id).where(Turn.session_id == sid)))
                db.execute(delete(Session).where(Session.id == sid))
            self.turns = [t for t in self.turns if t not in gone]

        @invariant()
        def stored_equals_computed(self) -> None:
            assert mismatches(engine) == []

    try:
        run_state_machine_as_test(Writes, settings=hsettings(
            max_examples=25, stateful_step_count=20, deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]))
    finally:
        engine.dispose()


def test_override_labels_move_the_ui_filters(database_url: str) -> None:
    """The stored value is what the turns view filters on: an override of a session turns its
    +1 turns into −1 turns for the "negative" filter, and withdrawing it turns them back."""
    from datapool.browse import Browse, TurnPage, turns_page

    engine = make_engine(database_url)
    with OrmSession(engine) as db, db.begin():
        db.add(Session(id="ov", source="header", created_at=T0))
        db.flush()
        tids = [add_turn(db, "ov", n) for n in range(3)]
        for tid in tids:
            db.add(Judgement(turn_id=tid, status="scored", reward=1.0))

    def negative() -> list[str]:
        with OrmSession(engine) as db:
            return sorted(r["id"] for r in turns_page(db, Browse(reward="negative"), TurnPage(), limit=50)[0])

    assert negative() == []
    with OrmSession(engine) as db, db.begin():
        labels.add_label(db, kind="override", value=-1, author="a", session_id="ov")
    assert negative() == sorted(tids)
    with OrmSession(engine) as db, db.begin():
        labels.add_label(db, kind="override", value=0.5, author="a", turn_id=tids[0])  # the turn's own wins
    assert negative() == sorted(tids[1:])
    with OrmSession(engine) as db, db.begin():
        labels.add_label(db, kind="override", value=None, author="a", session_id="ov")
    assert negative() == []
    engine.dispose()


def test_upgrade_backfills_a_pool_written_before_0010(database_url: str) -> None:
    """Downgrade to 0009, write judgements and overrides there (no triggers, no column), upgrade:
    every turn's stored reward is the computed one, and the triggers work from then on."""
    command.downgrade(alembic_config(database_url), "0009")
    engine = make_engine(database_url)
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO sessions (id, source, created_at, updated_at, metadata, mode) "
                          "VALUES ('old', 'header', '2026-03-01 00:00:00', '2026-03-01 00:00:00', '{}', 'online')"))
        for n, (reward, label) in enumerate([(1.0, None), (-1.0, "0.25"), (None, "-1"), (None, None)]):
            conn.execute(text("INSERT INTO turns (id, session_id, turn_type, endpoint, wire_format, status, created_at, "
                              "model, capture, request) VALUES (:id, 'old', 'main', 'chat', 'chat', 'ok', :at, 'm', "
                              "'black-box', '{}')"), {"id": f"old-{n}", "at": f"2026-03-01 00:00:0{n}"})
            if reward is not None:
                conn.execute(text("INSERT INTO judgements (turn_id, status, reward, attempts, retries, updated_at) "
                                  "VALUES (:id, 'scored', :r, 1, 0, '2026-03-01 00:00:00')"), {"id": f"old-{n}", "r": reward})
            if label is not None:
                conn.execute(text("INSERT INTO labels (turn_id, kind, value, author, created_at) VALUES "
                                  "(:id, 'override', :v, 'a', '2026-03-01 00:00:00')"), {"id": f"old-{n}", "v": label})
        conn.execute(text("INSERT INTO labels (session_id, kind, value, author, created_at) VALUES "
                          "('old', 'override', '0.75', 'a', '2026-03-01 00:00:00')"))
    engine.dispose()
    command.upgrade(alembic_config(database_url), "head")
    engine = make_engine(database_url)
    with OrmSession(engine) as db:
        stored = dict(db.execute(select(Turn.id, Turn.effective_reward)).all())
    # the turn's own override, else the session's 0.75 (which outranks the judge's +1)
    assert stored == {"old-0": 0.75, "old-1": 0.25, "old-2": -1.0, "old-3": 0.75}
    assert mismatches(engine) == []
    with OrmSession(engine) as db, db.begin():
        db.execute(delete(Label).where(Label.session_id == "old"))
    with OrmSession(engine) as db:
        assert db.get(Turn, "old-0").effective_reward == 1.0  # the judge's again
    assert mismatches(engine) == []
    engine.dispose()
