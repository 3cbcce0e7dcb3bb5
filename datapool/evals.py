"""Held-out replies of the eval gate (``eval_replies``): written where the gate evaluates a
version, read by the admin UI's version-vs-version page."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Engine, select
from sqlalchemy.orm import Session as OrmSession

from datapool.db import utcnow
from datapool.models import EvalReply


def prompt_hash(messages: Sequence[dict[str, Any]]) -> str:
    """The key that finds the same held-out prompt across versions."""
    return hashlib.sha256(json.dumps(list(messages), sort_keys=True, ensure_ascii=False,
                                     default=str).encode()).hexdigest()


def record_replies(engine: Engine, version: str, prompts: Sequence[list[dict[str, Any]]], replies: Sequence[str],
                   scores: Sequence[float | None]) -> None:
    """Store *version*'s reply and score for each held-out prompt, in one transaction."""
    now = utcnow()
    with OrmSession(engine) as db, db.begin():
        db.add_all(EvalReply(version=version, prompt_hash=prompt_hash(p), prompt=list(p), reply=r, score=s,
                             created_at=now) for p, r, s in zip(prompts, replies, scores))


def replies_of(db: OrmSession, version: str, limit: int = 500) -> dict[str, dict[str, Any]]:
    """*version*'s newest reply to each held-out prompt, by prompt hash."""
    out: dict[str, dict[str, Any]] = {}
    rows = db.scalars(select(EvalReply).where(EvalReply.version == version)
                      .order_by(EvalReply.created_at.desc(), EvalReply.id.desc()).limit(limit * 4))
    for r in rows:
        if r.prompt_hash not in out and len(out) < limit:
            out[r.prompt_hash] = {"prompt": list(r.prompt or []), "reply": r.reply, "score": r.score,
                                  "created_at": r.created_at}
    return out


def evaluated_versions(db: OrmSession) -> list[str]:
    """Every name with stored held-out replies (policy versions, and the base model the gate
    evaluated as the active side)."""
    return sorted(v for v in db.scalars(select(EvalReply.version).distinct()) if v)
