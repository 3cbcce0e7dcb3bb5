"""The admin JSON API for policy versions and the decisions about them (eval gate, promotions,
refusals, automatic rollbacks)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from sqlalchemy import select
from sqlalchemy.orm import Session as OrmSession

from datapool.models import PolicyEvent, PolicyVersion
from datapool.queries import _iso, active_policy_version
from gateway.errors import OpenAIError
from gateway.routes.admin import _read, require_admin

router = APIRouter(prefix="/api/policy", dependencies=[Depends(require_admin)])

ACTIONS = "^(publish|promote|refuse|rollback|eval)$"


def _version(row: PolicyVersion, names: dict[int, str]) -> dict[str, Any]:
    return {"id": row.id, "name": row.name, "base_model": row.base_model, "kind": row.kind, "path": row.path,
            "parent": names.get(row.parent_id) if row.parent_id is not None else None, "status": row.status,
            "created_at": _iso(row.created_at), "stats": dict(row.stats or {})}


def list_versions(db: OrmSession) -> dict[str, Any]:
    rows = list(db.scalars(select(PolicyVersion).order_by(PolicyVersion.created_at, PolicyVersion.id)))
    names = {r.id: r.name for r in rows}
    active = active_policy_version(db)
    return {"data": [_version(r, names) for r in rows], "active": active.name if active else None}


def list_events(db: OrmSession, *, version: str | None, action: str | None, limit: int) -> dict[str, Any] | None:
    q = (select(PolicyEvent, PolicyVersion.name).outerjoin(PolicyVersion, PolicyVersion.id == PolicyEvent.version_id)
         .order_by(PolicyEvent.created_at.desc(), PolicyEvent.id.desc()).limit(limit))
    if version is not None:
        if db.scalars(select(PolicyVersion.id).where(PolicyVersion.name == version)).first() is None:
            return None
        q = q.where(PolicyVersion.name == version)
    if action is not None:
        q = q.where(PolicyEvent.action == action)
    return {"data": [{"id": e.id, "version": name, "action": e.action, "actor": e.actor, "reason": e.reason,
                      "metrics": dict(e.metrics or {}), "created_at": _iso(e.created_at)}
                     for e, name in db.execute(q)]}


@router.get("/versions")
async def versions(request: Request) -> dict[str, Any]:
    """Every policy version, oldest first, and the name the `policy` alias serves (null: the base)."""
    return await _read(request, list_versions)


@router.get("/events")
async def events(request: Request, version: str | None = None,
                 action: str | None = Query(None, pattern=ACTIONS),
                 limit: int = Query(100, ge=1, le=1000)) -> dict[str, Any]:
    """Decisions about versions, newest first: publish, eval, promote, refuse, rollback, with the
    actor (trainer, eval-gate, live-monitor, admin), the reason and the numbers behind it."""
    found = await _read(request, list_events, version=version, action=action, limit=limit)
    if found is None:
        raise OpenAIError(404, f"no policy version {version!r}", code="version_not_found", param="version")
    return found
