"""The admin JSON API for sessions and their turns: reads, tags, outcomes, ends, judgements, and
flushing the capture queue."""

from __future__ import annotations

import asyncio
from datetime import datetime
from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse
from sqlalchemy import func, select
from sqlalchemy.orm import Session as OrmSession

from datapool import lineage, queries
from datapool.db import as_utc, dialect_insert, utcnow
from datapool.judgements import apply_outcome, end_session, mark_pending
from datapool.models import Session, Turn
from base.vocab import CaptureKind, JudgementStatus, SessionSource, TurnKind
from gateway.auth import require_api
from base.errors import RequestError
from gateway.pool import in_pool, in_thread
from gateway.protocol import SESSION_ID, OutcomeRequest, SessionTags, SessionUpdate, read_model
from gateway.state import gateway_of
from gateway.tenants import tenant_of_request

router = APIRouter(prefix="/api", dependencies=[Depends(require_api)])


async def _read(request: Request, fn: Any, *args: Any, **kwargs: Any) -> Any:
    return await in_pool(gateway_of(request).engine, fn, *args, **kwargs)


async def _found(request: Request, fn: Any, key: str, what: str) -> Any:
    """``fn(db, key)`` from the pool; 404 ``{what}_not_found`` when it finds nothing."""
    found = await _read(request, fn, key)
    if found is None:
        raise RequestError(404, f"no {what} {key!r}", code=f"{what}_not_found")
    return found


def _instant(value: datetime | None, param: str) -> datetime | None:
    """*value* in UTC; a time with no UTC equivalent (year 1 at +14:00) is the client's error, a 400."""
    if value is None:
        return None
    try:
        return as_utc(value)
    except OverflowError as exc:
        raise RequestError(400, f"{param}: {value.isoformat()} is out of range in UTC", param=param) from exc


@router.get("/sessions")
async def list_sessions(
    request: Request,
    limit: int = Query(50, ge=1, le=500),
    cursor: str | None = None,
    task_id: str | None = None,
    capture: CaptureKind | None = None,
    model: str | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
) -> dict[str, Any]:
    """Sessions, newest first. Pass the returned `next_cursor` as `cursor` for the next page."""
    since, until = _instant(since, "since"), _instant(until, "until")
    if cursor:
        try:
            queries.decode_cursor(cursor)
        except ValueError as exc:
            raise RequestError(400, str(exc), param="cursor") from exc
    filters = queries.SessionFilter(task_id=task_id, capture=capture, model=model, since=since, until=until,
                                    tenant=tenant_of_request(request))
    page, next_cursor = await _read(request, queries.list_sessions, limit=limit, cursor=cursor, filters=filters)
    return {"data": page, "next_cursor": next_cursor}


@router.get("/sessions/{session_id}")
async def get_session(request: Request, session_id: str) -> dict[str, Any]:
    """One session with its turns in order."""
    return await _found(request, queries.get_session, session_id, "session")


@router.get("/sessions/{session_id}/lineage")
async def get_lineage(request: Request, session_id: str) -> dict[str, Any]:
    """The policy versions that learned from the session's turns: trained on them (a step used
    one), or inherited from such a version (datapool.lineage)."""
    await _found(request, queries.get_session, session_id, "session")
    return await _read(request, lineage.session_lineage, session_id)


@router.get("/turns/{turn_id}")
async def get_turn(request: Request, turn_id: str) -> dict[str, Any]:
    """One turn (the gateway returns its id in the X-Turn-Id response header)."""
    return await _found(request, queries.get_turn, turn_id, "turn")


async def _session_signal(request: Request, session_id: str, change: Any) -> list[str]:
    """Apply a change to a session and queue its newly scoreable turns; 404 for an unknown id."""
    gw = gateway_of(request)

    def run(db: OrmSession) -> list[str] | None:
        if db.get(Session, session_id) is None:
            return None
        return mark_pending(db, change(db))

    ready = await in_pool(gw.engine, run, write=True)
    if ready is None:
        raise RequestError(404, f"no session {session_id!r}", code="session_not_found")
    await in_thread(gw.enqueuer.send, ready)
    return ready


@router.post("/sessions/{session_id}/outcome")
async def post_outcome(request: Request, session_id: str) -> dict[str, Any]:
    """The session's terminal outcome O (a number; optional `source`). Every scored turn gets the
    integrated reward R_t = O + mean of its votes; turns still without a next state are scored."""
    body = await read_model(request, OutcomeRequest, gateway_of(request).settings.max_body_bytes)
    queued = await _session_signal(request, session_id,
                                   lambda db: apply_outcome(db, session_id, body.outcome, body.source))
    return {"session_id": session_id, "outcome": body.outcome, "queued": queued}


@router.post("/sessions/{session_id}/end")
async def post_end(request: Request, session_id: str) -> dict[str, Any]:
    """Mark the session ended, so its last turn is scored with the end as its next state."""
    queued = await _session_signal(request, session_id, lambda db: end_session(db, session_id))
    return {"session_id": session_id, "ended": True, "queued": queued}


@router.get("/judgements")
async def list_judgements(
    request: Request,
    status: JudgementStatus | None = None,
    limit: int = Query(100, ge=1, le=1000),
) -> dict[str, Any]:
    """Scoring state of turns, newest change first; `status=dead` lists the dead-lettered ones."""
    return {"data": await _read(request, queries.list_judgements, status=status, limit=limit,
                                tenant=tenant_of_request(request))}


def _summary(db: OrmSession, session: Session) -> dict[str, Any]:
    sibling = Turn.turn_type == TurnKind.SIBLING
    own, siblings = db.execute(select(func.count().filter(~sibling), func.count().filter(sibling))
                               .select_from(Turn).where(Turn.session_id == session.id)).one()
    return queries.session_summary(session, own or 0, siblings or 0)


@router.put("/sessions/{session_id}")
async def put_session(request: Request, session_id: str) -> JSONResponse:
    """Create a session before its agent runs, tagged with its mode, task and group (a rollout
    runner does this, so a black-box agent that only knows its `/s/{id}/v1` base_url needs to
    send no header). Idempotent: an existing session with the same tags is returned as it is
    (200, with its turn count, end and outcome, so a resumed run can skip it); different tags
    are a 409. Created: 201."""
    if not SESSION_ID.match(session_id):
        raise RequestError(400, "session id must be 1-128 characters of letters, digits and . _ : -",
                          param="session_id")
    tags = await read_model(request, SessionTags, gateway_of(request).settings.max_body_bytes)

    def run(db: OrmSession) -> tuple[bool, dict[str, Any] | str]:
        with db.begin():
            now = utcnow()
            created = db.execute(dialect_insert(db)(Session.__table__).values(
                id=session_id, source=SessionSource.PATH, mode=tags.mode, task_id=tags.task_id, group_id=tags.group_id,
                created_at=now, updated_at=now, metadata=tags.metadata,
            ).on_conflict_do_nothing().returning(Session.__table__.c.id)).first() is not None
            session = db.get(Session, session_id)
            assert session is not None
            have = (session.mode, session.task_id, session.group_id)
            if have != (tags.mode, tags.task_id, tags.group_id):
                return False, (f"session {session_id!r} exists with mode={have[0]}, task_id={have[1]}, "
                               f"group_id={have[2]}")
            return created, _summary(db, session)

    created, found = await _read(request, run)
    if isinstance(found, str):
        raise RequestError(409, found, code="session_conflict", param="session_id")
    return JSONResponse(found, status_code=201 if created else 200)


@router.patch("/sessions/{session_id}")
async def patch_session(request: Request, session_id: str) -> dict[str, Any]:
    """Record why a session ended (`end_reason`: timed_out, failed, cancelled), merge
    `metadata` into its own, and with `end: true` (implied by an end_reason) end it, so its
    last turn is scored."""
    body = await read_model(request, SessionUpdate, gateway_of(request).settings.max_body_bytes)

    def change(db: OrmSession) -> list[str]:
        session = db.get(Session, session_id)
        assert session is not None
        if body.metadata:
            session.meta = {**(session.meta or {}), **body.metadata}
        if body.end_reason is not None:
            session.end_reason = body.end_reason
        if body.end or body.end_reason is not None:
            return end_session(db, session_id)
        return []

    queued = await _session_signal(request, session_id, change)
    return {"session_id": session_id, "end_reason": body.end_reason,
            "ended": body.end or body.end_reason is not None, "queued": queued}


@router.post("/capture/flush")
async def post_capture_flush(request: Request, timeout_s: float = Query(30.0, gt=0, le=600)) -> dict[str, Any]:
    """Wait until every turn this gateway process has captured so far is stored (in the pool, or
    in the spool while the pool is down), so a following read sees them. 504 after timeout_s."""
    gw = gateway_of(request)
    try:
        await asyncio.wait_for(gw.writer.flushed(), timeout_s)
    except TimeoutError as exc:
        raise RequestError(504, f"capture not flushed within {timeout_s}s "
                               f"({gw.writer.depth} turns queued)", code="flush_timeout") from exc
    return {"flushed": True, "spooled": gw.writer.spool.waiting}
