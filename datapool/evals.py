"""Held-out replies of the eval gate (``eval_replies``): written where the gate evaluates a
version, read by the admin UI's version-vs-version page."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, Engine, bindparam, select, update
from sqlalchemy.orm import Session as OrmSession

from datapool.db import utcnow
from datapool.models import EvalReply
from datapool.sessions import history_hash


def prompt_hash(messages: Sequence[dict[str, Any]]) -> str:
    """The key that finds the same held-out prompt across versions: the canonical history hash
    that stitches sessions (``datapool.sessions``), so a prompt matches itself whatever null
    fields, content parts or tool-call ids a client's spelling of it carries."""
    return history_hash(messages)


def rehash(conn: Connection, *, chunk: int = 500) -> tuple[int, int]:
    """Recompute every stored held-out reply's ``prompt_hash`` from its stored prompt (migration
    0011 runs it when the hash changed form; so does ``nextstate db rehash``). Reads in chunks
    ordered by id; returns (rows read, rows whose hash changed)."""
    table = EvalReply.__table__
    seen = changed = 0
    last = 0
    while True:
        rows = conn.execute(select(table.c.id, table.c.prompt, table.c.prompt_hash)
                            .where(table.c.id > last).order_by(table.c.id).limit(chunk)).all()
        if not rows:
            return seen, changed
        last = rows[-1].id
        seen += len(rows)
        fresh = [{"b_id": r.id, "b_hash": h} for r in rows if (h := prompt_hash(r.prompt or [])) != r.prompt_hash]
        if fresh:
            conn.execute(update(table).where(table.c.id == bindparam("b_id")).values(prompt_hash=bindparam("b_hash")),
                         fresh)
        changed += len(fresh)


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
