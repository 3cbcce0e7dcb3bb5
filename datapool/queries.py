"""Read side of the pool: sessions and their turns, as the admin API serves them."""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import func, or_, and_, select
from sqlalchemy.orm import Session as OrmSession

from datapool.db import iso
from datapool.models import Judgement, PolicyEvent, PolicyVersion, Session, ToolCallArguments, Turn, Vote
from base.vocab import SessionMode, TurnKind, VersionKind, VersionStatus


@dataclass(frozen=True)
class SessionFilter:
    task_id: str | None = None
    capture: str | None = None  # "white-box" | "black-box": sessions with such a turn
    model: str | None = None
    since: datetime | None = None
    until: datetime | None = None
    tenant: str | None = None  # only this tenant's sessions (gateway.tenants)


def encode_cursor(created_at: datetime, session_id: str) -> str:
    return base64.urlsafe_b64encode(f"{created_at.isoformat()}|{session_id}".encode()).decode()


def decode_cursor(cursor: str) -> tuple[datetime, str]:
    """Raises ValueError for a cursor this module did not make."""
    try:
        stamp, sid = base64.urlsafe_b64decode(cursor.encode()).decode().split("|", 1)
        return datetime.fromisoformat(stamp), sid
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"invalid cursor {cursor!r}") from exc


def session_summary(s: Session, turn_count: int, sibling_count: int = 0) -> dict[str, Any]:
    """A session's facts. *turn_count* is its own turns (main and side); its shadow siblings
    (``datapool.siblings``: resampled replies no one was sent) are *sibling_count*, apart."""
    return {
        "id": s.id,
        "source": s.source,
        "mode": s.mode,
        "end_reason": s.end_reason,
        "task_id": s.task_id,
        "group_id": s.group_id,
        "created_at": iso(s.created_at),
        "updated_at": iso(s.updated_at),
        "ended_at": iso(s.ended_at),
        "turn_count": turn_count,
        "sibling_count": sibling_count,
        "metadata": s.meta,
        "outcome": s.outcome,
        "outcome_source": s.outcome_source,
        "tenant": s.tenant,
    }


def vote_view(v: Vote) -> dict[str, Any]:
    return {"kind": v.kind, "value": v.value, "rationale": v.rationale, "hint": v.hint,
            "judge": v.judge, "prompt_version": v.prompt_version, "index": v.vote_index,
            "parsed": v.value is not None, "raw": v.raw if v.value is None else None,
            "created_at": iso(v.created_at)}


def judgement_view(j: Judgement | None, votes: list[Vote]) -> dict[str, Any]:
    """A turn's scoring: its votes, process reward r_t, hint, teacher logprobs, integrated reward."""
    if j is None:
        return {"status": None, "votes": [vote_view(v) for v in votes]}
    return {
        "status": j.status,
        "reward": j.reward,
        "prm_reward": j.prm_reward,
        "vote_mean": j.vote_mean,
        "integrated_reward": j.integrated_reward,
        "hint": j.hint,
        "hint_source": j.hint_source,
        "has_teacher_logprobs": j.teacher_logprobs is not None,
        "teacher_logprobs": j.teacher_logprobs,
        "judge": j.judge,
        "prompt_version": j.prompt_version,
        "attempts": j.attempts,
        "retries": j.retries,
        "dead_reason": j.dead_reason,
        "last_error": j.last_error,
        "votes": [vote_view(v) for v in votes],
    }


def turn_view(t: Turn) -> dict[str, Any]:
    response = t.response or {}
    choices = response.get("choices") or []
    first = choices[0] if choices else {}
    message = first.get("message") or {}
    return {
        "id": t.id,
        "session_id": t.session_id,
        "parent_turn_id": t.parent_turn_id,
        "sibling_of": t.sibling_of,
        "edit": t.edit,
        "turn_type": t.turn_type,
        "endpoint": t.endpoint,
        "wire_format": t.wire_format,
        "status": t.status,
        "created_at": iso(t.created_at),
        "model": t.model,
        "upstream_model": t.upstream_model,
        "policy_version": t.policy_version,
        "capture": t.capture,
        "request": t.request,
        "response": None
        if t.response is None
        else {
            "id": response.get("id"),
            "content": message.get("content") if t.endpoint == "chat" else first.get("text"),
            "reasoning_content": message.get("reasoning_content"),
            "tool_calls": message.get("tool_calls"),
            "finish_reason": first.get("finish_reason"),
            "choices": choices,
        },
        "next_state": t.next_state,
        "prompt_token_ids": t.prompt_token_ids,
        "token_ids": t.token_ids,
        "logprobs": t.logprobs,
        "latency_ms": t.latency_ms,
        "usage": t.usage,
        "error": t.error,
        "redaction": t.redaction,
    }


def list_sessions(
    db: OrmSession, *, limit: int, cursor: str | None, filters: SessionFilter
) -> tuple[list[dict[str, Any]], str | None]:
    """Newest first; returns the page and the cursor of the next one (None at the end)."""
    sibling = Turn.turn_type == TurnKind.SIBLING
    counts = (
        select(Turn.session_id, func.count().filter(~sibling).label("n"), func.count().filter(sibling).label("k"))
        .group_by(Turn.session_id)
        .subquery()
    )
    q = (select(Session, func.coalesce(counts.c.n, 0), func.coalesce(counts.c.k, 0))
         .outerjoin(counts, counts.c.session_id == Session.id))
    if filters.task_id:
        q = q.where(Session.task_id == filters.task_id)
    if filters.tenant is not None:
        q = q.where(Session.tenant == filters.tenant)
    if filters.since:
        q = q.where(Session.created_at >= filters.since)
    if filters.until:
        q = q.where(Session.created_at < filters.until)
    turn_conds = []
    if filters.capture:
        turn_conds.append(Turn.capture == filters.capture)
    if filters.model:
        turn_conds.append(or_(Turn.model == filters.model, Turn.upstream_model == filters.model))
    if turn_conds:
        q = q.where(select(Turn.id).where(Turn.session_id == Session.id, *turn_conds).exists())
    if cursor:
        at, sid = decode_cursor(cursor)
        q = q.where(or_(Session.created_at < at, and_(Session.created_at == at, Session.id < sid)))
    rows = db.execute(q.order_by(Session.created_at.desc(), Session.id.desc()).limit(limit + 1)).all()
    page = [session_summary(s, n, k) for s, n, k in rows[:limit]]
    next_cursor = encode_cursor(rows[limit - 1][0].created_at, rows[limit - 1][0].id) if len(rows) > limit else None
    return page, next_cursor


def _judged(db: OrmSession, turns: list[Turn]) -> list[dict[str, Any]]:
    ids = [t.id for t in turns]
    judgements = {j.turn_id: j for j in db.scalars(select(Judgement).where(Judgement.turn_id.in_(ids)))}
    votes: dict[str, list[Vote]] = {}
    for v in db.scalars(select(Vote).where(Vote.turn_id.in_(ids)).order_by(Vote.id)):
        votes.setdefault(v.turn_id, []).append(v)
    return [turn_view(t) | {"judgement": judgement_view(judgements.get(t.id), votes.get(t.id, []))}
            for t in turns]


def get_session(db: OrmSession, session_id: str) -> dict[str, Any] | None:
    s = db.get(Session, session_id)
    if s is None:
        return None
    turns = list(db.scalars(
        select(Turn).where(Turn.session_id == session_id).order_by(Turn.created_at, Turn.id)
    ).all())
    # shadow siblings (datapool.siblings) are no part of the session's history: listed apart
    shown = [t for t in turns if t.turn_type != TurnKind.SIBLING]
    shadow = [t for t in turns if t.turn_type == TurnKind.SIBLING]
    return session_summary(s, len(shown), len(shadow)) | {"turns": _judged(db, shown), "siblings": _judged(db, shadow)}


def active_policy_version(db: OrmSession) -> PolicyVersion | None:
    """The version the `policy` alias serves (None: the base model). Gateways, the publisher
    and the trainer all read it here, so they never disagree."""
    return db.scalars(
        select(PolicyVersion)
        .where(PolicyVersion.status == VersionStatus.ACTIVE, PolicyVersion.kind != VersionKind.BASE)
        .order_by(PolicyVersion.created_at.desc(), PolicyVersion.id.desc())
        .limit(1)
    ).first()


def get_turn(db: OrmSession, turn_id: str) -> dict[str, Any] | None:
    t = db.get(Turn, turn_id)
    return _judged(db, [t])[0] if t else None


def list_judgements(db: OrmSession, *, status: str | None, limit: int,
                    tenant: str | None = None) -> list[dict[str, Any]]:
    q = select(Judgement).order_by(Judgement.updated_at.desc()).limit(limit)
    if status:
        q = q.where(Judgement.status == status)
    if tenant is not None:
        q = q.where(Judgement.turn_id.in_(select(Turn.id).join(Session, Session.id == Turn.session_id)
                                          .where(Session.tenant == tenant)))
    return [{"turn_id": j.turn_id, "status": j.status, "reward": j.reward, "attempts": j.attempts,
             "retries": j.retries, "dead_reason": j.dead_reason, "last_error": j.last_error, "updated_at": iso(j.updated_at)} for j in db.scalars(q)]


# --------------------------------------------------------------------------------------------
# policy versions and the decisions about them


def _version_row(row: PolicyVersion, names: dict[int, str]) -> dict[str, Any]:
    return {"id": row.id, "name": row.name, "base_model": row.base_model, "kind": row.kind, "path": row.path,
            "parent": names.get(row.parent_id) if row.parent_id is not None else None, "status": row.status,
            "created_at": iso(row.created_at), "stats": dict(row.stats or {})}


def policy_versions(db: OrmSession) -> dict[str, Any]:
    """Every policy version, oldest first, and the name the `policy` alias serves (None: the base)."""
    rows = list(db.scalars(select(PolicyVersion).order_by(PolicyVersion.created_at, PolicyVersion.id)))
    names = {r.id: r.name for r in rows}
    active = active_policy_version(db)
    return {"data": [_version_row(r, names) for r in rows], "active": active.name if active else None}


def policy_events(db: OrmSession, *, version: str | None, action: str | None, limit: int) -> dict[str, Any] | None:
    """Decisions about versions, newest first; None when *version* names no version."""
    q = (select(PolicyEvent, PolicyVersion.name).outerjoin(PolicyVersion, PolicyVersion.id == PolicyEvent.version_id)
         .order_by(PolicyEvent.created_at.desc(), PolicyEvent.id.desc()).limit(limit))
    if version is not None:
        if db.scalars(select(PolicyVersion.id).where(PolicyVersion.name == version)).first() is None:
            return None
        q = q.where(PolicyVersion.name == version)
    if action is not None:
        q = q.where(PolicyEvent.action == action)
    return {"data": [{"id": e.id, "version": name, "action": e.action, "actor": e.actor, "reason": e.reason,
                      "metrics": dict(e.metrics or {}), "created_at": iso(e.created_at)}
                     for e, name in db.execute(q)]}


# --------------------------------------------------------------------------------------------
# what the online trainer reads: its batch's versions, held-out prompts, live rewards


def produced_by(db: OrmSession, turn_ids: Sequence[str]) -> dict[str, str | None]:
    """``{turn id: the policy version that produced it}``."""
    return dict(db.execute(select(Turn.id, Turn.policy_version).where(Turn.id.in_(turn_ids))).all())


def scored_at(db: OrmSession, turn_ids: Sequence[str]) -> dict[str, datetime]:
    """``{turn id: when its judgement last changed}`` (turns with a judgement only)."""
    return {tid: at for tid, at in db.execute(select(Judgement.turn_id, Judgement.updated_at)
                                              .where(Judgement.turn_id.in_(turn_ids))).all() if at is not None}


def eval_session_prompts(db: OrmSession, n: int) -> list[list[dict[str, Any]]]:
    """The first main turn's messages of each of the newest *n* eval sessions (held-out prompts)."""
    prompts: list[list[dict[str, Any]]] = []
    sids = db.scalars(select(Session.id).where(Session.mode == SessionMode.EVAL)
                      .order_by(Session.created_at.desc()).limit(n)).all()
    for sid in sids:
        first = db.scalars(select(Turn).where(Turn.session_id == sid, Turn.turn_type == TurnKind.MAIN)
                           .order_by(Turn.created_at).limit(1)).first()
        if first is not None and (first.request or {}).get("messages"):
            prompts.append(list(first.request["messages"]))
    return prompts


def live_rewards(db: OrmSession, version: str, limit: int) -> list[float]:
    """Rewards of the newest *limit* judged turns served by *version*, eval sessions left out."""
    return [r for r in db.scalars(
        select(Judgement.reward).join(Turn, Turn.id == Judgement.turn_id)
        .where(Turn.policy_version == version, Judgement.reward.is_not(None), Turn.turn_type == TurnKind.MAIN,
               ~select(Session.id).where(Session.id == Turn.session_id, Session.mode == SessionMode.EVAL).exists())
        .order_by(Turn.created_at.desc()).limit(limit))]


def turn_by_response_id(db: OrmSession, response_id: str, tenant: str | None = None) -> Turn | None:
    """The turn whose reply went out under *response_id* (a Responses `resp_...` id, say), if it
    is *tenant*'s (None: a turn of no tenant's)."""
    mine = Session.tenant.is_(None) if tenant is None else Session.tenant == tenant
    return db.scalars(select(Turn).join(Session, Session.id == Turn.session_id)
                      .where(Turn.response_id == response_id, mine).limit(1)).first()


def conversation_through(db: OrmSession, response_id: str, tenant: str | None = None) -> list[dict[str, Any]] | None:
    """The messages of the turn that answered *response_id*, followed by its reply: what a
    Responses client's `previous_response_id` continues. None if no such turn (yet), or if it
    is not *tenant*'s (a tenant continues only its own conversations)."""
    t = turn_by_response_id(db, response_id, tenant)
    if t is None or not t.response or not t.response.get("choices"):
        return None
    reply = dict(t.response["choices"][0].get("message") or {})
    reply = {k: v for k, v in reply.items() if v is not None or k == "content"}
    return list(t.request.get("messages") or []) + [reply]


def tool_call_arguments(db: OrmSession, call_ids: Sequence[str]) -> dict[str, str]:
    """The model's own arguments text of these tool calls (those answered on /v1/messages), by id."""
    rows = db.execute(select(ToolCallArguments.id, ToolCallArguments.arguments)
                      .where(ToolCallArguments.id.in_(list(call_ids)[:1000])))
    return {i: a for i, a in rows}
