"""The admin JSON API's turns list: the admin UI's turns view (``/admin/turns``) as JSON, with the
same query parameters (filters, ``sort``, ``order``, ``status``, ``offset``) and ``limit``."""

from __future__ import annotations

import dataclasses
from typing import Any

from fastapi import APIRouter, Depends, Query, Request

from datapool import browse
from datapool.db import iso
from gateway.auth import require_api
from gateway.pool import in_pool
from gateway.state import gateway_of
from gateway.tenants import tenant_of_request

router = APIRouter(prefix="/api", dependencies=[Depends(require_api)])


@router.get("/turns")
async def list_turns(request: Request, limit: int = Query(50, ge=1, le=500)) -> dict[str, Any]:
    """One row per turn across sessions, newest first unless ``sort``/``order`` say otherwise;
    ``has_more`` tells whether ``offset + limit`` names another page."""
    f, p = browse.Browse.from_params(request.query_params), browse.TurnPage.from_params(request.query_params)
    if (tenant := tenant_of_request(request)) is not None:
        f = dataclasses.replace(f, tenant=tenant)
    rows, more = await in_pool(gateway_of(request).engine, browse.turns_page, f, p, limit=limit)
    return {"object": "list", "data": [{**r, "created_at": iso(r["created_at"])} for r in rows],
            "offset": p.offset, "has_more": more}
