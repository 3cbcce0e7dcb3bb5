"""The pool's side of scoring: which turns must be scored, and the signals people and programs post.

The pool, not the broker, remembers what must be scored: a judgement row in state ``pending``
exists before a task is sent (:func:`mark_pending`, called in the transaction that made the
turn ready), and :func:`sweep` re-sends stale ones. The workers (``scoring``) read
:func:`effective_next_state` and record failures here; the gateway records feedback, outcomes
and session ends here and sends the returned turn ids with ``datapool.queue.Enqueuer``.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Engine, and_, bindparam, exists, func, select, text, update
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session as OrmSession

from datapool.db import UTCDateTime, as_utc, pg_array, utcnow
from datapool.models import Judgement, Session, Turn
from datapool.models import Vote as VoteRow
from base.vocab import DeadReason, JudgementStatus, TurnKind, TurnStatus, VoteKind


def mark_pending(db: OrmSession, turn_ids: Iterable[str]) -> list[str]:
    """Record that these turns must be (re)scored; returns them. Call inside the transaction that
    made them ready, then send the tasks after it commits."""
    ids = list(dict.fromkeys(turn_ids))
    if not ids:
        return ids
    now = utcnow()
    # the capture writer marks a batch's worth at a time: one statement whose text never changes,
    # not a multi-row VALUES that SQLAlchemy compiled anew for every batch (~30 µs per turn marked,
    # benchmarks/gateway/README.md); the ids are distinct, so no row is upserted twice
    if db.get_bind().dialect.name == "postgresql":
        db.execute(_MARK_PENDING_PG, {"ids": pg_array(ids), "status": JudgementStatus.PENDING, "now": now})
        return ids
    rows = [{"turn_id": tid, "status": JudgementStatus.PENDING, "attempts": 0, "retries": 0, "enqueued_at": now,
             "updated_at": now} for tid in ids]
    db.execute(_MARK_PENDING_SQLITE, rows)
    return ids


_MARK_PENDING_PG = text(
    "INSERT INTO judgements (turn_id, status, attempts, retries, enqueued_at, updated_at) "
    "SELECT u.id, :status, 0, 0, :now, :now FROM unnest(CAST(:ids AS varchar[])) WITH ORDINALITY AS u(id, n) "
    "ORDER BY u.n ON CONFLICT (turn_id) DO UPDATE SET status = :status, dead_reason = NULL, enqueued_at = :now, "
    "updated_at = :now"
).bindparams(bindparam("now", type_=UTCDateTime()))
_mark_sqlite = sqlite_insert(Judgement)
_MARK_PENDING_SQLITE = _mark_sqlite.on_conflict_do_update(
    index_elements=["turn_id"], set_={"status": _mark_sqlite.excluded.status, "dead_reason": None,
                                      "enqueued_at": _mark_sqlite.excluded.enqueued_at,
                                      "updated_at": _mark_sqlite.excluded.updated_at})


def effective_next_state(db: OrmSession, turn: Turn, session: Session) -> dict[str, Any] | None:
    """The turn's next state with explicit signals folded in; None while nothing followed yet."""
    state: dict[str, Any] = dict(turn.next_state or {})
    feedback = db.scalars(
        select(VoteRow).where(VoteRow.turn_id == turn.id, VoteRow.kind == VoteKind.FEEDBACK).order_by(VoteRow.id)
    ).all()
    if feedback:
        state["feedback"] = [{"value": v.value, "text": v.hint} for v in feedback]
    if not state.get("messages") and (session.ended_at is not None or session.outcome is not None):
        state["end"] = True
    if session.outcome is not None:
        state["outcome"] = session.outcome
    ready = state.get("messages") or state.get("feedback") or state.get("end")
    return state if ready else None


def mark_dead(engine: Engine, turn_id: str, error: str, reason: str = DeadReason.ERROR) -> None:
    """Dead-letter a turn's judgement: *reason* (a vocab.DeadReason) for /metrics and the API,
    and the error, prefixed with the reason, in last_error."""
    with OrmSession(engine) as db, db.begin():
        db.execute(update(Judgement).where(Judgement.turn_id == turn_id).values(
            status=JudgementStatus.DEAD, dead_reason=reason, last_error=f"{reason}: {error}"[:4000],
            updated_at=utcnow()))


def record_failure(engine: Engine, turn_id: str, error: str) -> None:
    """A transient failure that will be retried: counted in retries, kept in last_error."""
    with OrmSession(engine) as db, db.begin():
        db.execute(update(Judgement).where(Judgement.turn_id == turn_id).values(
            retries=Judgement.retries + 1, last_error=error[:4000], updated_at=utcnow()))


def apply_outcome(db: OrmSession, session_id: str, outcome: float, source: str | None) -> list[str]:
    """Set a session's outcome and the integrated reward R_t = O + mean votes of its scored turns.
    Returns the turns that now have a next state to be scored (those without one before)."""
    session = db.get(Session, session_id)
    assert session is not None
    session.outcome, session.outcome_source, session.outcome_at = outcome, source, utcnow()
    judged = select(Judgement.turn_id).join(Turn, Turn.id == Judgement.turn_id).where(
        Turn.session_id == session_id)
    db.execute(update(Judgement).where(Judgement.turn_id.in_(judged), Judgement.vote_mean.is_not(None))
               .values(integrated_reward=Judgement.vote_mean + outcome, updated_at=utcnow()))
    return unscored_last_turns(db, session_id)


def unscored_last_turns(db: OrmSession, session_id: str) -> list[str]:
    """Main turns of the session with no next state and no finished judgement."""
    return list(db.scalars(select(Turn.id).where(
        Turn.session_id == session_id, Turn.turn_type == TurnKind.MAIN, Turn.status == TurnStatus.OK,
        Turn.next_state.is_(None),
        ~exists().where(and_(Judgement.turn_id == Turn.id, Judgement.status.not_in((JudgementStatus.WAITING,)))))))


def end_session(db: OrmSession, session_id: str) -> list[str]:
    session = db.get(Session, session_id)
    assert session is not None
    if session.ended_at is None:
        session.ended_at = utcnow()
    return unscored_last_turns(db, session_id)


@dataclass
class SweepResult:
    ended_sessions: int
    requeue: list[str]


def sweep(engine: Engine, *, idle_timeout_s: float, requeue_after_s: float) -> SweepResult:
    """Periodic safety net: end idle sessions, and find scoring work whose task was lost
    (broker down or restarted, worker killed) so it can be sent again."""
    now = utcnow()
    with OrmSession(engine) as db, db.begin():
        idle = db.scalars(select(Session.id).where(
            Session.ended_at.is_(None), Session.updated_at < now - timedelta(seconds=idle_timeout_s))).all()
        ready: list[str] = []
        for sid in idle:
            ready += end_session(db, sid)
        # turns whose next state arrived while nothing recorded it (e.g. before workers existed)
        ready += list(db.scalars(select(Turn.id).where(
            Turn.next_state.is_not(None), Turn.turn_type == TurnKind.MAIN, Turn.status == TurnStatus.OK,
            ~exists().where(Judgement.turn_id == Turn.id)).limit(1000)))
        stale = list(db.scalars(select(Judgement.turn_id).where(
            Judgement.status == JudgementStatus.PENDING,
            Judgement.enqueued_at < now - timedelta(seconds=requeue_after_s)).limit(1000)))
        requeue = mark_pending(db, ready + stale)
    return SweepResult(len(idle), requeue)


def record_feedback(db: OrmSession, *, turn_id: str | None, response_id: str | None, value: int | None,
                    text: str | None, tenant: str | None = None) -> tuple[int, str] | None:
    """Store a person's feedback as a vote of its own kind; returns (vote id, turn id), or None
    when no turn has that id (or it is not *tenant*'s). The turn is then (re)scored: the rating
    outranks the judges and the text is a hint candidate."""
    if turn_id is not None:
        turn = db.get(Turn, turn_id)
    else:
        turn = db.scalars(select(Turn).where(Turn.response_id == response_id)
                          .order_by(Turn.created_at).limit(1)).first()
    if turn is None or db.scalar(select(Session.tenant).where(Session.id == turn.session_id)) != tenant:
        return None
    row = VoteRow(turn_id=turn.id, kind=VoteKind.FEEDBACK, dedupe_key=f"feedback:{uuid.uuid4().hex}", judge="user",
                  vote_index=0, value=value, hint=text, created_at=utcnow())
    db.add(row)
    db.flush()
    mark_pending(db, [turn.id])
    return row.id, turn.id


# --------------------------------------------------------------------------------------------
# the admin's view of scoring: what is waiting, what failed, and re-queueing it

SHOWN = (JudgementStatus.PENDING, JudgementStatus.DEAD, JudgementStatus.TIE, JudgementStatus.UNPARSABLE)
RETRYABLE = (JudgementStatus.DEAD, JudgementStatus.TIE, JudgementStatus.UNPARSABLE)


def _utc(value: datetime | None) -> datetime | None:
    return as_utc(value) if value is not None else None


def status_counts(db: OrmSession) -> dict[str, int]:
    """How many judgements are in each of the states the judgements page shows."""
    rows = db.execute(select(Judgement.status, func.count()).where(Judgement.status.in_(SHOWN))
                      .group_by(Judgement.status)).all()
    found = {str(s): int(n) for s, n in rows}
    return {str(s): found.get(str(s), 0) for s in SHOWN}


def dead_count(db: OrmSession) -> int:
    return int(db.scalar(select(func.count()).select_from(Judgement)
                         .where(Judgement.status == JudgementStatus.DEAD)) or 0)


def dead_reasons(db: OrmSession) -> list[str]:
    return sorted(str(r) for r in db.scalars(select(Judgement.dead_reason).distinct()
                                             .where(Judgement.dead_reason.is_not(None))))


def browse_judgements(db: OrmSession, *, status: str, dead_reason: str | None = None, limit: int = 100,
                      offset: int = 0) -> tuple[list[dict[str, Any]], int]:
    """Judgements in *status* (and with *dead_reason*), least recently changed first (the oldest
    problem on top), with their turn's session; and how many match in all."""
    where = [Judgement.status == status]
    if dead_reason:
        where.append(Judgement.dead_reason == dead_reason)
    total = int(db.scalar(select(func.count()).select_from(Judgement).where(*where)) or 0)
    q = (select(Judgement, Turn.session_id, Turn.created_at, Turn.model)
         .join(Turn, Turn.id == Judgement.turn_id).where(*where)
         .order_by(Judgement.updated_at, Judgement.turn_id).limit(limit).offset(offset))
    now = utcnow()
    out = []
    for j, session_id, turn_at, model in db.execute(q).all():
        changed = _utc(j.updated_at)
        out.append({"turn_id": j.turn_id, "session_id": session_id, "model": model, "status": j.status,
                    "dead_reason": j.dead_reason, "last_error": j.last_error, "retries": j.retries or 0,
                    "attempts": j.attempts or 0, "turn_at": _utc(turn_at), "updated_at": changed,
                    "enqueued_at": _utc(j.enqueued_at),
                    "age_s": (now - changed).total_seconds() if changed is not None else None})
    return out, total


def retry(db: OrmSession, *, turn_ids: Iterable[str] | None = None, status: str = JudgementStatus.DEAD,
          dead_reason: str | None = None) -> list[str]:
    """Re-queue judgements that ended without a reward, as the sweep does (:func:`mark_pending`):
    the given turns (if in a retryable state), or every one in *status* (and *dead_reason*).
    Returns the turn ids to send with the Enqueuer after the transaction commits."""
    where = [Judgement.status.in_(RETRYABLE)]
    if turn_ids is not None:
        where.append(Judgement.turn_id.in_(list(turn_ids)))
    else:
        where.append(Judgement.status == status)
        if dead_reason:
            where.append(Judgement.dead_reason == dead_reason)
    return mark_pending(db, db.scalars(select(Judgement.turn_id).where(*where).order_by(Judgement.updated_at)))
