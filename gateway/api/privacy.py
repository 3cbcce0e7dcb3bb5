"""The admin JSON API for forgetting and the audit log: ``POST /api/forget`` (the admin, or a
tenant's key for its own tenant's data) and ``GET /api/audit`` (the admin's alone)."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from pydantic import BaseModel, ConfigDict, Field, model_validator

from base.errors import RequestError, PublishError
from datapool import audit, forget as forgetting
from publishing.publish import rollback_tainted
from base.vocab import AuditAction
from gateway.auth import Admin, require_api
from gateway.pool import in_pool, in_thread
from gateway.protocol import read_model
from gateway.state import gateway_of
from vllm_client.http import policy_servers

router = APIRouter(prefix="/api", dependencies=[Depends(require_api)])

FLUSH_TIMEOUT_S = 30.0


class ForgetRequest(BaseModel):
    """Exactly one of ``session_id``, ``tenant``, ``user`` (the requests' end-user id)."""

    model_config = ConfigDict(extra="forbid")

    session_id: str | None = Field(default=None, min_length=1, max_length=128)
    tenant: str | None = Field(default=None, min_length=1, max_length=64)
    user: str | None = Field(default=None, min_length=1, max_length=256)
    dry_run: bool = False
    taint: bool = False

    @model_validator(mode="after")
    def _one_target(self) -> "ForgetRequest":
        if sum(v is not None for v in (self.session_id, self.tenant, self.user)) != 1:
            raise ValueError("name exactly one of session_id, tenant, user")
        return self


@router.post("/forget")
async def forget(request: Request, admin: Admin = Depends(require_api)) -> dict[str, Any]:
    """Delete a session's, a tenant's or an end user's turns and everything keyed to them (once
    this gateway's captured turns are written), and their records in this machine's idle spool
    files; report the versions that learned from them; with ``taint``, mark those versions
    never to be served again and roll the policy back off a tainted active version. A tenant's key forgets within its own tenant only, and may
    not taint (versions are shared)."""
    gw = gateway_of(request)
    body = await read_model(request, ForgetRequest, gw.settings.max_body_bytes, invalid_status=400)
    if admin.tenant is not None:
        if body.taint:
            raise RequestError(403, "tainting versions needs the admin token, not a tenant's key",
                              code="admin_only", param="taint")
        if body.tenant is not None and body.tenant != admin.tenant:
            raise RequestError(404, f"no tenant {body.tenant!r}", code="tenant_not_found", param="tenant")
    # what this gateway captured and has not written yet goes first, so the forget finds it
    # (other replicas: POST /api/capture/flush on each before, or forget again after)
    try:
        await asyncio.wait_for(gw.writer.flushed(), FLUSH_TIMEOUT_S)
    except TimeoutError:
        pass  # the pool is slow or away; the report's counts are what it holds now
    report = await in_thread(
        forgetting.forget, gw.engine, session_id=body.session_id, tenant=body.tenant, end_user=body.user,
        actor=admin.name, within_tenant=admin.tenant, dry_run=body.dry_run, taint=body.taint,
        spool_dir=gw.settings.resolved_spool_dir)
    if report["active_tainted"] and not body.dry_run:
        try:
            done = await in_thread(rollback_tainted, gw.engine, policy_servers(gw.settings),
                                   actor=admin.name)
            report["rollback"] = {"active": (done["active"] or {}).get("name") if done else None,
                                  "rolled_back": list(done["rolled_back"]) if done else []}
        except PublishError as exc:  # the data is gone either way; say what is left to do
            report["rollback"] = {"error": str(exc)}
    return report


@router.get("/audit")
async def audit_log(request: Request, action: AuditAction | None = None,
                    limit: int = Query(100, ge=1, le=1000),
                    before_id: int | None = Query(None, ge=1, le=2**63 - 1)) -> dict[str, Any]:
    """Who did what, newest first: forget, taint, promote, rollback, expire, key_issue, key_revoke."""
    rows = await in_pool(gateway_of(request).engine, audit.entries, action=action, limit=limit, before_id=before_id)
    return {"data": rows}
