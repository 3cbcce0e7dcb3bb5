"""The admin JSON API for people's labels, the annotation queue and the export. Same auth as the
rest of /api (admin token, or the UI's session + CSRF)."""

from __future__ import annotations

import dataclasses
from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from datapool import browse, labels
from gateway import actions
from gateway.auth import Admin, require_api
from base.errors import RequestError
from gateway.pool import in_pool
from gateway.protocol import read_model
from gateway.state import gateway_of
from gateway.tenants import tenant_of_request

router = APIRouter(prefix="/api", dependencies=[Depends(require_api)])


class LabelRequest(BaseModel):
    kind: str
    value: Any = None
    author: str | None = None  # who decided; default: the caller (the token is "token")


def _author(admin: Admin, given: str | None) -> str:
    return f"{given} (via {admin.name})" if given and admin.via == "bearer" else admin.name


@router.post("/turns/{turn_id}/labels")
async def label_turn(request: Request, turn_id: str, admin: Admin = Depends(require_api)) -> dict[str, Any]:
    """Label a turn: {"kind": thumb|override|exclude|correction|tag|note, "value": ...}."""
    body = await read_model(request, LabelRequest, gateway_of(request).settings.max_body_bytes)
    return await actions.add_label(gateway_of(request), kind=body.kind, value=body.value,
                                   author=_author(admin, body.author), turn_id=turn_id)


@router.post("/sessions/{session_id}/labels")
async def label_session(request: Request, session_id: str, admin: Admin = Depends(require_api)) -> dict[str, Any]:
    """Label every turn of a session at once (a turn's own label of a kind wins)."""
    body = await read_model(request, LabelRequest, gateway_of(request).settings.max_body_bytes)
    return await actions.add_label(gateway_of(request), kind=body.kind, value=body.value,
                                   author=_author(admin, body.author), session_id=session_id)


@router.get("/turns/{turn_id}/labels")
async def turn_labels(request: Request, turn_id: str) -> dict[str, Any]:
    """A turn's labels in force (its own, its session's, merged) and its label history."""
    found = await in_pool(gateway_of(request).engine, labels.for_turns, [turn_id])
    if turn_id not in found:
        raise RequestError(404, f"no turn {turn_id!r}", code="turn_not_found")
    return found[turn_id]


@router.get("/queue")
async def annotation_queue(request: Request, limit: int = Query(50, ge=1, le=500)) -> dict[str, Any]:
    """Unlabeled judged turns, contested first (split votes, feedback vs judges, teacher gap)."""
    items = await in_pool(gateway_of(request).engine, browse.queue, limit=limit, tenant=tenant_of_request(request))
    return {"data": [i | {"created_at": i["created_at"].isoformat()} for i in items]}


@router.get("/export")
async def export(request: Request, format: str = Query("jsonl", pattern="^(jsonl|parquet)$")) -> StreamingResponse:
    """The turns the filters select (same parameters as the UI's session list), streamed."""
    f = browse.Browse.from_params(request.query_params)
    if (tenant := tenant_of_request(request)) is not None:
        f = dataclasses.replace(f, tenant=tenant)
    return actions.export_response(gateway_of(request), f, format)
