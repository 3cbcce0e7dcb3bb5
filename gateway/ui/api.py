"""The admin JSON API's write side and more reads: labels, the annotation queue, export,
promote and rollback. Same auth as the rest of /api (admin token, or the UI's session + CSRF)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from datapool import browse, labels
from gateway.app import gateway_of
from gateway.errors import OpenAIError
from gateway.protocol import parse_body, read_body
from gateway.ui import actions
from gateway.ui.auth import Admin, require_api
from gateway.ui.pages import export_response

router = APIRouter(prefix="/api", dependencies=[Depends(require_api)])


class LabelRequest(BaseModel):
    kind: str
    value: Any = None
    author: str | None = None  # who decided; default: the caller (the token is "token")


class PromoteRequest(BaseModel):
    name: str
    reason: str | None = None


class RollbackRequest(BaseModel):
    to: str | None = None
    reason: str | None = None


async def _body(request: Request, model: type[BaseModel]) -> Any:
    raw = await read_body(request, gateway_of(request).settings.max_body_bytes)
    return model.model_validate(parse_body(raw, model, invalid_status=422))


def _author(admin: Admin, given: str | None) -> str:
    return f"{given} (via {admin.name})" if given and admin.via == "bearer" else admin.name


@router.post("/turns/{turn_id}/labels")
async def label_turn(request: Request, turn_id: str, admin: Admin = Depends(require_api)) -> dict[str, Any]:
    """Label a turn: {"kind": thumb|override|exclude|correction|tag|note, "value": ...}."""
    body = await _body(request, LabelRequest)
    return await actions.add_label(gateway_of(request), kind=body.kind, value=body.value,
                                   author=_author(admin, body.author), turn_id=turn_id)


@router.post("/sessions/{session_id}/labels")
async def label_session(request: Request, session_id: str, admin: Admin = Depends(require_api)) -> dict[str, Any]:
    """Label every turn of a session at once (a turn's own label of a kind wins)."""
    body = await _body(request, LabelRequest)
    return await actions.add_label(gateway_of(request), kind=body.kind, value=body.value,
                                   author=_author(admin, body.author), session_id=session_id)


@router.get("/turns/{turn_id}/labels")
async def turn_labels(request: Request, turn_id: str) -> dict[str, Any]:
    """A turn's labels in force (its own, its session's, merged) and its label history."""
    found = await actions.read(gateway_of(request), lambda db: labels.for_turns(db, [turn_id]))
    if turn_id not in found:
        raise OpenAIError(404, f"no turn {turn_id!r}", code="turn_not_found")
    return found[turn_id]


@router.get("/queue")
async def annotation_queue(request: Request, limit: int = Query(50, ge=1, le=500)) -> dict[str, Any]:
    """Unlabeled judged turns, contested first (split votes, feedback vs judges, teacher gap)."""
    items = await actions.read(gateway_of(request), browse.queue, limit=limit)
    return {"data": [i | {"created_at": i["created_at"].isoformat()} for i in items]}


@router.get("/export")
async def export(request: Request, format: str = Query("jsonl", pattern="^(jsonl|parquet)$")) -> StreamingResponse:
    """The turns the filters select (same parameters as the UI's session list), streamed."""
    try:
        f = browse.Browse.from_params(request.query_params)
    except browse.FilterError as exc:
        raise OpenAIError(400, str(exc), code="invalid_filter") from exc
    return export_response(request, f, format)


@router.post("/policy/promote")
async def promote(request: Request, admin: Admin = Depends(require_api)) -> dict[str, Any]:
    """Make a version the `policy` alias (loading it into every vLLM first); "base" for the base."""
    body = await _body(request, PromoteRequest)
    return await actions.promote(gateway_of(request), body.name, f"admin:{admin.name}", body.reason)


@router.post("/policy/rollback")
async def rollback(request: Request, admin: Admin = Depends(require_api)) -> dict[str, Any]:
    """Roll back from the active version to the previous one, or to {"to": name}."""
    body = await _body(request, RollbackRequest)
    return await actions.rollback(gateway_of(request), body.to, f"admin:{admin.name}", body.reason)
