"""The audit log: who did what to the pool or the policy, when (``audit_log``).

:func:`record` adds a row to the caller's transaction, so the entry exists exactly when the
action it records committed. Actors: ``token`` (the admin token), ``tenant:<name>`` (a tenant's
key), the UI login's name, ``cli:<os user>`` (the command line).
"""

from __future__ import annotations

import getpass
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session as OrmSession

from datapool.db import iso
from datapool.models import AuditEntry


def record(db: OrmSession, actor: str, action: str, target: str | None, details: dict[str, Any] | None = None) -> None:
    """Add an audit row to *db*'s transaction."""
    db.add(AuditEntry(actor=actor, action=action, target=target, details=dict(details or {})))


def cli_actor() -> str:
    """The actor of a command run from a shell: ``cli:<os user>``."""
    try:
        return f"cli:{getpass.getuser()}"
    except (KeyError, OSError):
        return "cli:unknown"


def entries(db: OrmSession, *, action: str | None = None, limit: int = 100, before_id: int | None = None
            ) -> list[dict[str, Any]]:
    """The newest entries first (*before_id*: older than that id, to page)."""
    q = select(AuditEntry).order_by(AuditEntry.id.desc()).limit(limit)
    if action is not None:
        q = q.where(AuditEntry.action == action)
    if before_id is not None:
        q = q.where(AuditEntry.id < before_id)
    return [{"id": e.id, "at": iso(e.created_at), "actor": e.actor, "action": e.action, "target": e.target,
             "details": dict(e.details or {})} for e in db.scalars(q)]
