"""The admin JSON API for policy versions: list them and the decisions about them (eval gate,
promotions, refusals, automatic rollbacks), promote and roll back."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from pydantic import BaseModel

from datapool import queries
from base.vocab import PolicyAction
from gateway import actions
from gateway.auth import Admin, require_api
from base.errors import RequestError
from gateway.pool import in_pool
from gateway.protocol import read_model
from gateway.state import gateway_of

router = APIRouter(prefix="/api/policy", dependencies=[Depends(require_api)])


class PromoteRequest(BaseModel):
    name: str
    reason: str | None = None


class RollbackRequest(BaseModel):
    to: str | None = None
    reason: str | None = None


@router.get("/versions")
async def versions(request: Request) -> dict[str, Any]:
    """Every policy version, oldest first, and the name the `policy` alias serves (null: the base)."""
    return await in_pool(gateway_of(request).engine, queries.policy_versions)


@router.get("/events")
async def events(request: Request, version: str | None = None,
                 action: PolicyAction | None = None,
                 limit: int = Query(100, ge=1, le=1000)) -> dict[str, Any]:
    """Decisions about versions, newest first: publish, eval, promote, refuse, rollback, with the
    actor (trainer, eval-gate, live-monitor, admin), the reason and the numbers behind it."""
    found = await in_pool(gateway_of(request).engine, queries.policy_events, version=version, action=action, limit=limit)
    if found is None:
        raise RequestError(404, f"no policy version {version!r}", code="version_not_found", param="version")
    return found


@router.post("/promote")
async def promote(request: Request, admin: Admin = Depends(require_api)) -> dict[str, Any]:
    """Make a version the `policy` alias (loading it into every vLLM first); "base" for the base."""
    body = await read_model(request, PromoteRequest, gateway_of(request).settings.max_body_bytes)
    return await actions.promote(gateway_of(request), body.name, f"admin:{admin.name}", body.reason)


@router.post("/rollback")
async def rollback(request: Request, admin: Admin = Depends(require_api)) -> dict[str, Any]:
    """Roll back from the active version to the previous one, or to {"to": name}."""
    body = await read_model(request, RollbackRequest, gateway_of(request).settings.max_body_bytes)
    return await actions.rollback(gateway_of(request), body.to, f"admin:{admin.name}", body.reason)
