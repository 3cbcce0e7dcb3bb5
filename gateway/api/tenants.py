"""The admin JSON API for tenants' client keys: issue one (shown once), list, revoke. The admin's
alone: a tenant's own key is refused here (gateway.tenants)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from base.settings import TENANT_NAME
from gateway import tenants
from gateway.auth import Admin, require_api
from base.errors import RequestError
from gateway.pool import in_pool
from gateway.state import gateway_of

router = APIRouter(prefix="/api/tenants", dependencies=[Depends(require_api)])


def _tenant(tenant: str) -> str:
    if not TENANT_NAME.match(tenant):
        raise RequestError(400, "tenant name: 1-64 letters, digits, . _ - (a letter or digit first)", param="tenant")
    return tenant


@router.post("/{tenant}/keys")
async def issue_key(request: Request, tenant: str, admin: Admin = Depends(require_api)) -> JSONResponse:
    """A new client key for *tenant*. The key is in this answer only; the pool keeps its hash."""
    gw = gateway_of(request)
    issued = await in_pool(gw.engine, tenants.issue, _tenant(tenant), admin.name, write=True)
    await gw.keys.refresh(force=True)  # this replica knows it at once; others within REFRESH_S
    return JSONResponse(issued, status_code=201)


@router.get("/{tenant}/keys")
async def list_keys(request: Request, tenant: str) -> dict[str, Any]:
    """The keys issued to *tenant* (never the keys themselves)."""
    return {"data": await in_pool(gateway_of(request).engine, tenants.list_keys, _tenant(tenant))}


@router.delete("/{tenant}/keys/{key_id}")
async def revoke_key(request: Request, tenant: str, key_id: str, admin: Admin = Depends(require_api)
                     ) -> dict[str, Any]:
    gw = gateway_of(request)
    if not await in_pool(gw.engine, tenants.revoke, _tenant(tenant), key_id, admin.name, write=True):
        raise RequestError(404, f"no active key {key_id!r} of tenant {tenant!r}", code="key_not_found")
    await gw.keys.refresh(force=True)
    return {"id": key_id, "tenant": tenant, "revoked": True}
