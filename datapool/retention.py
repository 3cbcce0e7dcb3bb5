"""Retention: the raw content of turns older than ``retention_days`` expires.

An expired turn keeps its row and what training history and the dashboards count: id, session,
parent, timestamps, model, policy version, status, latency, usage (token counts), capture kind,
its judgement's rewards and its effective reward, its training leases. Its content goes:
``request`` becomes ``{"expired_at": ...}``; ``response``, ``next_state``, ``prompt_token_ids``,
``token_ids``, ``logprobs``, ``error``, ``redaction``, ``link_hash``, ``response_id`` are nulled;
its judgement's hint and teacher prompt/logprobs and its votes' rationale, hint and raw text are
nulled; its tool-call arguments and continuations are deleted, and a correction label's text is
nulled. The eval gate's stored replies older than the cutoff are deleted. An expired turn has
no tokens, so no training batch takes it again (``datapool.training_view`` needs token ids).

:func:`expire` runs from ``nextstate db expire`` and from the worker's periodic sweep (when
``retention_days`` is set); one transaction per chunk of turns, each with its audit entry.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from sqlalchemy import Engine, delete, select, update
from sqlalchemy.orm import Session as OrmSession

from datapool import audit
from datapool.db import iso, utcnow
from datapool.models import EvalReply, Judgement, Label, ToolCallArguments, Turn, TurnContinuation, Vote
from base.vocab import AuditAction, LabelKind

CHUNK = 500


def _due(db: OrmSession, cutoff: Any, limit: int) -> list[str]:
    return list(db.scalars(select(Turn.id).where(
        Turn.created_at < cutoff, Turn.request[("expired_at",)].as_string().is_(None)).limit(limit)))


def expire(engine: Engine, days: float, *, actor: str, dry_run: bool = False) -> dict[str, Any]:
    """Expire the content of turns created more than *days* ago; returns ``{"cutoff", "turns",
    "eval_replies"}`` (with *dry_run*: what would expire)."""
    if days <= 0:
        raise ValueError("retention_days must be positive")
    now = utcnow()
    cutoff = now - timedelta(days=days)
    total = evals = 0
    with OrmSession(engine) as db:
        if dry_run:
            turns = len(_due(db, cutoff, 10**9))
            return {"cutoff": iso(cutoff), "turns": turns, "dry_run": True,
                    "eval_replies": len(db.scalars(select(EvalReply.id).where(EvalReply.created_at < cutoff)).all())}
    while True:
        with OrmSession(engine) as db, db.begin():
            ids = _due(db, cutoff, CHUNK)
            if not ids:
                break
            db.execute(update(Turn).where(Turn.id.in_(ids)).values(
                request={"expired_at": iso(now)}, response=None, next_state=None, prompt_token_ids=None,
                token_ids=None, logprobs=None, error=None, redaction=None, link_hash=None, response_id=None))
            db.execute(update(Judgement).where(Judgement.turn_id.in_(ids)).values(
                hint=None, teacher_prompt_ids=None, teacher_logprobs=None, teacher_topk_ids=None,
                teacher_topk_logprobs=None, last_error=None))
            db.execute(update(Vote).where(Vote.turn_id.in_(ids)).values(rationale=None, hint=None, raw=None))
            db.execute(update(Label).where(Label.turn_id.in_(ids), Label.kind == LabelKind.CORRECTION).values(value=None))
            db.execute(delete(ToolCallArguments).where(ToolCallArguments.turn_id.in_(ids)))
            db.execute(delete(TurnContinuation).where(TurnContinuation.turn_id.in_(ids)))
            audit.record(db, actor, AuditAction.EXPIRE, f"turns before {iso(cutoff)}", {"turns": len(ids)})
            total += len(ids)
    with OrmSession(engine) as db, db.begin():
        evals = db.execute(delete(EvalReply).where(EvalReply.created_at < cutoff)).rowcount or 0
        if evals:
            audit.record(db, actor, AuditAction.EXPIRE, f"eval replies before {iso(cutoff)}", {"eval_replies": evals})
    return {"cutoff": iso(cutoff), "turns": total, "eval_replies": evals, "dry_run": False}
