"""Batches from the pool: lease scored turns, ack them once the step that used them committed.

PostgreSQL: candidate judgements are locked ``FOR UPDATE SKIP LOCKED``, so trainers running at
once never take the same turn. SQLite: the lease transaction takes the database's write lock
first (an UPDATE of the run row), which serialises lessees the same way. A lease not acked by
its expiry (the trainer died) is handed out again; an acked one never is, so within a run
every turn is trained on exactly once.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Engine, exists, func, or_, select, update
from sqlalchemy.orm import Session as OrmSession

from base.errors import NotFound
from datapool import labels
from datapool.db import dialect_insert, utcnow
from datapool.models import Judgement, Session, TrainingLease, TrainingRun, TrainingStep, Turn
from base.vocab import RunStatus, SessionMode, TurnKind, TurnStatus


@dataclass(frozen=True)
class Filters:
    """Which scored turns a run trains on."""

    since: datetime | None = None
    until: datetime | None = None
    min_abs_reward: float | None = None
    capture: str | None = None  # "white-box" | "black-box"
    task_id: str | None = None
    needs_teacher: bool = False  # OPD: only hinted turns with teacher logprobs
    # session modes to train on; "eval" sessions are never trained on, whatever is asked
    modes: tuple[str, ...] = (SessionMode.ONLINE.value, SessionMode.OFFLINE.value)
    # people's labels the turn must carry, all of them (datapool.labels.FILTERS or "tag:NAME");
    # turns a person excluded are never leased, whatever is asked
    labels: tuple[str, ...] = ()
    # only turns no other run has trained on yet (acked there): periodic runs, e.g. a CronJob
    # of the veRL backend, each train on what arrived since the last one
    new_only: bool = False


def start_run(engine: Engine, *, objective: str, backend: str, config: dict[str, Any],
              base_version: str | None) -> str:
    run_id = uuid.uuid4().hex
    with OrmSession(engine) as db, db.begin():
        db.add(TrainingRun(id=run_id, objective=objective, backend=backend, config=config, status=RunStatus.RUNNING,
                           base_version=base_version, created_at=utcnow()))
    return run_id


def resume_run(engine: Engine, run_id: str) -> TrainingRun:
    """Continue a run whose trainer died: its unacked leases are released at once."""
    with OrmSession(engine) as db, db.begin():
        run = db.get(TrainingRun, run_id)
        if run is None:
            raise NotFound(f"no training run {run_id!r}")
        _release(db, run_id)
        run.status = RunStatus.RUNNING
        db.expunge(run)
        return run


def release_unacked(engine: Engine, run_id: str) -> None:
    """Give the run's leased turns that no step recorded back to the pool now (a round that
    failed before its step was recorded: they are trained again)."""
    with OrmSession(engine) as db, db.begin():
        _release(db, run_id)


def _release(db: OrmSession, run_id: str) -> None:
    db.execute(update(TrainingLease).where(TrainingLease.run_id == run_id, TrainingLease.acked_at.is_(None))
               .values(expires_at=utcnow()))


def _candidates(run_id: str, filters: Filters, now: datetime) -> Any:
    q = (select(Judgement.turn_id).join(Turn, Turn.id == Judgement.turn_id)
         .where(Judgement.reward.is_not(None) | Judgement.teacher_logprobs.is_not(None),
                Turn.turn_type == TurnKind.MAIN, Turn.status == TurnStatus.OK,
                Turn.request[("expired_at",)].as_string().is_(None)))  # retention took its content
    if filters.needs_teacher:
        q = q.where(Judgement.teacher_logprobs.is_not(None))
    else:
        q = q.where(Judgement.reward.is_not(None))
    if filters.since:
        q = q.where(Turn.created_at >= filters.since)
    if filters.until:
        q = q.where(Turn.created_at < filters.until)
    if filters.min_abs_reward is not None:
        q = q.where(func.abs(Judgement.reward) >= filters.min_abs_reward)
    if filters.capture:
        q = q.where(Turn.capture == filters.capture)
    if filters.task_id:
        q = q.where(exists().where(Session.id == Turn.session_id, Session.task_id == filters.task_id))
    modes = [m for m in filters.modes if m != SessionMode.EVAL]
    q = q.where(exists().where(Session.id == Turn.session_id, Session.mode.in_(modes)))
    q = q.where(~labels.excluded(Turn.id, Turn.session_id), labels.all_of(filters.labels, Turn.id, Turn.session_id))
    if filters.new_only:
        trained = exists().where(TrainingLease.turn_id == Judgement.turn_id, TrainingLease.run_id != run_id,
                                 TrainingLease.acked_at.is_not(None))
        q = q.where(~trained)
    taken = exists().where(TrainingLease.run_id == run_id, TrainingLease.turn_id == Judgement.turn_id,
                           or_(TrainingLease.acked_at.is_not(None), TrainingLease.expires_at > now))
    return q.where(~taken).order_by(Turn.created_at, Turn.id)


def lease(engine: Engine, run_id: str, *, limit: int, lease_s: float = 600.0,
          filters: Filters = Filters()) -> list[str]:
    """Up to ``limit`` turn ids for the run's next batch, leased for ``lease_s`` seconds."""
    now = utcnow()
    with OrmSession(engine) as db, db.begin():
        dialect = db.get_bind().dialect.name
        # take the write lock first on SQLite; on PostgreSQL this only touches the run's own row
        db.execute(update(TrainingRun).where(TrainingRun.id == run_id).values(status=RunStatus.RUNNING))
        q = _candidates(run_id, filters, now).limit(limit)
        if dialect == "postgresql":
            q = q.with_for_update(of=Judgement, skip_locked=True)
        ids = list(db.scalars(q))
        insert = dialect_insert(db)
        expires = now + timedelta(seconds=lease_s)
        for tid in ids:
            stmt = insert(TrainingLease).values(run_id=run_id, turn_id=tid, leased_at=now, expires_at=expires)
            db.execute(stmt.on_conflict_do_update(index_elements=["run_id", "turn_id"],
                                                  set_={"leased_at": now, "expires_at": expires}))
        return ids


def ack(db: OrmSession, run_id: str, turn_ids: list[str], step: int) -> None:
    """Mark turns trained; call in the transaction that records the step."""
    db.execute(update(TrainingLease).where(TrainingLease.run_id == run_id, TrainingLease.turn_id.in_(turn_ids),
                                           TrainingLease.acked_at.is_(None))
               .values(acked_at=utcnow(), step=step))


def record_step(engine: Engine, run_id: str, step: int, turn_ids: list[str], metrics: dict[str, Any]) -> None:
    with OrmSession(engine) as db, db.begin():
        db.add(TrainingStep(run_id=run_id, step=step, metrics=metrics, created_at=utcnow()))
        ack(db, run_id, turn_ids, step)


def finish_run(engine: Engine, run_id: str, *, status: str, produced_version: str | None = None) -> None:
    with OrmSession(engine) as db, db.begin():
        db.execute(update(TrainingRun).where(TrainingRun.id == run_id).values(
            status=status, produced_version=produced_version, finished_at=utcnow()))


def available(engine: Engine, run_id: str, filters: Filters) -> int:
    """Scored turns matching *filters* that run *run_id* has not trained on (nor leased) yet."""
    q = _candidates(run_id, filters, utcnow()).subquery()
    with OrmSession(engine) as db:
        return db.scalar(select(func.count()).select_from(q)) or 0


def running_run(engine: Engine, backend: str, match: Callable[[dict[str, Any]], bool]) -> str | None:
    """The newest running run of *backend* whose config *match* accepts (a restarted trainer's run)."""
    with OrmSession(engine) as db:
        runs = db.scalars(select(TrainingRun).where(TrainingRun.status == RunStatus.RUNNING,
                                                    TrainingRun.backend == backend)
                          .order_by(TrainingRun.created_at.desc())).all()
        return next((r.id for r in runs if match(r.config or {})), None)


def last_step(engine: Engine, run_id: str) -> int:
    """The run's newest recorded step (0: none yet)."""
    with OrmSession(engine) as db:
        return db.scalar(select(func.max(TrainingStep.step)).where(TrainingStep.run_id == run_id)) or 0


def step_metrics(engine: Engine, run_id: str) -> list[dict[str, Any]]:
    """The metrics of every recorded step of the run, in no particular order."""
    with OrmSession(engine) as db:
        return [dict(s.metrics or {}) for s in db.scalars(select(TrainingStep).where(TrainingStep.run_id == run_id))]
