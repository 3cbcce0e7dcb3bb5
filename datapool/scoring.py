"""Turning a turn and its next state into signal: votes, reward, hint, teacher logprobs.

Everything here is idempotent. Each vote has a dedupe key, so a scoring task delivered twice,
or killed half-way and run again, asks the judge only for the votes still missing and never
stores one twice. The pool, not the broker, remembers what must be scored: a judgement row in
state ``pending`` exists before a task is sent, and the sweeper re-sends stale ones.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

import httpx
from sqlalchemy import Engine, and_, exists, select, update
from sqlalchemy.orm import Session as OrmSession

from datapool.db import chunked, dialect_insert
from datapool.labels import correction_for
from datapool.judge import Judge, Vote, choose_hint, tally
from datapool.models import Judgement, Session, Turn
from datapool.models import Vote as VoteRow
from datapool.queries import turn_view
from datapool.teacher import TeacherError, teacher_logprobs, teacher_messages

log = logging.getLogger("nextstate.scoring")


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


def mark_pending(db: OrmSession, turn_ids: Iterable[str]) -> list[str]:
    """Record that these turns must be (re)scored; returns them. Call inside the transaction that
    made them ready, then send the tasks after it commits."""
    ids = list(dict.fromkeys(turn_ids))
    now = utcnow()
    # one multi-row upsert per chunk (the capture writer marks a batch's worth at a time); the
    # ids are distinct, so no row is upserted twice in one statement
    for chunk in chunked(ids):
        rows = [{"turn_id": tid, "status": "pending", "attempts": 0, "enqueued_at": now, "updated_at": now}
                for tid in chunk]
        stmt = dialect_insert(db)(Judgement).values(rows)
        db.execute(stmt.on_conflict_do_update(
            index_elements=["turn_id"], set_={"status": "pending", "enqueued_at": now, "updated_at": now}))
    return ids


@dataclass(frozen=True)
class TeacherConfig:
    api_base: str  # vLLM …/v1 serving the policy's versions
    api_key: str | None = None


def effective_next_state(db: OrmSession, turn: Turn, session: Session) -> dict[str, Any] | None:
    """The turn's next state with explicit signals folded in; None while nothing followed yet."""
    state: dict[str, Any] = dict(turn.next_state or {})
    feedback = db.scalars(
        select(VoteRow).where(VoteRow.turn_id == turn.id, VoteRow.kind == "feedback").order_by(VoteRow.id)
    ).all()
    if feedback:
        state["feedback"] = [{"value": v.value, "text": v.hint} for v in feedback]
    if not state.get("messages") and (session.ended_at is not None or session.outcome is not None):
        state["end"] = True
    if session.outcome is not None:
        state["outcome"] = session.outcome
    ready = state.get("messages") or state.get("feedback") or state.get("end")
    return state if ready else None


def _store_vote(engine: Engine, turn_id: str, judge: Judge, index: int, vote: Vote) -> None:
    with OrmSession(engine) as db, db.begin():
        stmt = dialect_insert(db)(VoteRow).values(
            turn_id=turn_id, kind="prm", dedupe_key=f"prm:{judge.name}:{judge.prompt_version}:{index}",
            judge=judge.name, prompt_version=judge.prompt_version, vote_index=index, value=vote.value,
            rationale=vote.rationale or None, hint=vote.hint, raw=vote.raw, created_at=utcnow())
        db.execute(stmt.on_conflict_do_nothing())


class JudgeError(Exception):
    """A judge (or the teacher) could not be asked; the task is retried."""


async def _collect_votes(engine: Engine, judge: Judge, turn_id: str, view: dict[str, Any],
                         state: dict[str, Any], missing: Sequence[int]) -> None:
    async def one(i: int) -> None:
        vote = await judge.vote(view, state, i)
        await asyncio.to_thread(_store_vote, engine, turn_id, judge, i, vote)  # kept even if a sibling fails

    results = await asyncio.gather(*(one(i) for i in missing), return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        raise JudgeError(f"{len(errors)} of {len(missing)} votes failed: {errors[0]!r}") from errors[0]


def score_turn(engine: Engine, turn_id: str, judge: Judge, m: int,
               teacher: TeacherConfig | None = None) -> str:
    """Score one turn; returns the judgement's status. Raises JudgeError to be retried."""
    with OrmSession(engine) as db, db.begin():
        turn = db.get(Turn, turn_id)
        if turn is None:
            return "missing"
        judgement = db.get(Judgement, turn_id) or Judgement(turn_id=turn_id, status="pending", attempts=0)
        db.add(judgement)
        judgement.attempts = (judgement.attempts or 0) + 1
        judgement.updated_at = utcnow()
        if turn.turn_type != "main" or turn.status != "ok":
            judgement.status = "skipped"
            return "skipped"
        session = db.get(Session, turn.session_id)
        assert session is not None
        state = effective_next_state(db, turn, session)
        if state is None:
            judgement.status = "waiting"
            return "waiting"
        have = set(db.scalars(select(VoteRow.vote_index).where(
            VoteRow.turn_id == turn_id, VoteRow.kind == "prm", VoteRow.judge == judge.name,
            VoteRow.prompt_version.is_(None) if judge.prompt_version is None
            else VoteRow.prompt_version == judge.prompt_version)))
        missing = [i for i in range(m) if i not in have]
        view = turn_view(turn)

    if missing:
        asyncio.run(_collect_votes(engine, judge, turn_id, view, state, missing))
    return _aggregate(engine, turn_id, judge, teacher)


def _aggregate(engine: Engine, turn_id: str, judge: Judge, teacher: TeacherConfig | None) -> str:
    with OrmSession(engine) as db, db.begin():
        turn = db.get(Turn, turn_id)
        session = db.get(Session, turn.session_id) if turn else None
        judgement = db.get(Judgement, turn_id)
        assert turn is not None and session is not None and judgement is not None
        votes = db.scalars(select(VoteRow).where(VoteRow.turn_id == turn_id).order_by(VoteRow.id)).all()
        prm = [v for v in votes if v.kind == "prm" and v.judge == judge.name
               and v.prompt_version == judge.prompt_version]
        feedback = [v for v in votes if v.kind == "feedback"]
        t = tally([v.value for v in prm])
        judgement.judge, judgement.prompt_version = judge.name, judge.prompt_version
        judgement.prm_reward = float(t.majority) if t.majority is not None else None
        judgement.vote_mean = t.mean
        rated = [v.value for v in feedback if v.value is not None]
        # a person's rating outranks the judges; the latest rating counts
        judgement.reward = float(rated[-1]) if rated else judgement.prm_reward
        judgement.status = "scored" if rated else t.status
        feedback_hints = [v.hint for v in feedback if v.hint]
        correction = correction_for(db, turn_id)
        if correction:  # a person's corrected reply is the OPD target before any other hint
            hint, source = correction, "label"
        elif feedback_hints:
            hint, source = feedback_hints[-1], "feedback"
        else:
            agreeing = [v.hint for v in prm if v.hint and (t.majority is None or v.value == t.majority)]
            hint, source = choose_hint(agreeing), "prm"
        if hint != judgement.hint:
            judgement.teacher_logprobs = judgement.teacher_prompt_ids = None
        judgement.hint, judgement.hint_source = hint, (source if hint else None)
        judgement.integrated_reward = (session.outcome + t.mean
                                       if session.outcome is not None and t.mean is not None else None)
        need_teacher = (hint and teacher is not None and judgement.teacher_logprobs is None
                        and turn.capture == "white-box" and turn.endpoint == "chat" and turn.token_ids)
        request = dict(turn.request or {})
        token_ids, model = list(turn.token_ids or []), turn.upstream_model
        judgement.last_error = None
        judgement.updated_at = utcnow()
        status = judgement.status

    if need_teacher:
        assert teacher is not None and hint is not None and model is not None
        try:
            result = asyncio.run(_teacher(teacher, model, request, hint, token_ids))
        except (TeacherError, httpx.HTTPError) as exc:
            raise JudgeError(f"teacher logprobs: {exc}") from exc
        with OrmSession(engine) as db, db.begin():
            db.execute(update(Judgement).where(Judgement.turn_id == turn_id, Judgement.hint == hint).values(
                teacher_prompt_ids=result.prompt_token_ids, teacher_logprobs=result.logprobs))
    return status


async def _teacher(cfg: TeacherConfig, model: str, request: dict[str, Any], hint: str,
                   token_ids: list[int]) -> Any:
    async with httpx.AsyncClient(timeout=120) as http:
        return await teacher_logprobs(http, cfg.api_base, model,
                                      teacher_messages(request.get("messages") or [], hint), token_ids,
                                      tools=request.get("tools"), api_key=cfg.api_key)


def mark_dead(engine: Engine, turn_id: str, error: str) -> None:
    with OrmSession(engine) as db, db.begin():
        db.execute(update(Judgement).where(Judgement.turn_id == turn_id).values(
            status="dead", last_error=error[:4000], updated_at=utcnow()))


def record_failure(engine: Engine, turn_id: str, error: str) -> None:
    with OrmSession(engine) as db, db.begin():
        db.execute(update(Judgement).where(Judgement.turn_id == turn_id).values(
            last_error=error[:4000], updated_at=utcnow()))


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
        Turn.session_id == session_id, Turn.turn_type == "main", Turn.status == "ok",
        Turn.next_state.is_(None),
        ~exists().where(and_(Judgement.turn_id == Turn.id, Judgement.status.not_in(("waiting",)))))))


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
            Turn.next_state.is_not(None), Turn.turn_type == "main", Turn.status == "ok",
            ~exists().where(Judgement.turn_id == Turn.id)).limit(1000)))
        stale = list(db.scalars(select(Judgement.turn_id).where(
            Judgement.status == "pending",
            Judgement.enqueued_at < now - timedelta(seconds=requeue_after_s)).limit(1000)))
        requeue = mark_pending(db, ready + stale)
    return SweepResult(len(idle), requeue)



def record_feedback(db: OrmSession, *, turn_id: str | None, response_id: str | None, value: int | None,
                    text: str | None) -> tuple[int, str] | None:
    """Store a person's feedback as a vote of its own kind; returns (vote id, turn id), or None
    when no turn has that id. The turn is then (re)scored: the rating outranks the judges and
    the text is a hint candidate."""
    if turn_id is not None:
        turn = db.get(Turn, turn_id)
    else:
        turn = db.scalars(select(Turn).where(Turn.response_id == response_id)
                          .order_by(Turn.created_at).limit(1)).first()
    if turn is None:
        return None
    row = VoteRow(turn_id=turn.id, kind="feedback", dedupe_key=f"feedback:{uuid.uuid4().hex}", judge="user",
                  vote_index=0, value=value, hint=text, created_at=utcnow())
    db.add(row)
    db.flush()
    mark_pending(db, [turn.id])
    return row.id, turn.id
