"""Explicit signals from clients: feedback on a reply."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Depends, Request
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session as OrmSession

from datapool.scoring import record_feedback
from gateway.app import gateway_of
from gateway.errors import OpenAIError
from gateway.protocol import FeedbackRequest, parse_body, read_body
from gateway.routes.openai import require_api_key

router = APIRouter()


@router.post("/v1/feedback", dependencies=[Depends(require_api_key)])
@router.post("/s/{session_id}/v1/feedback", dependencies=[Depends(require_api_key)])
async def feedback(request: Request) -> dict[str, Any]:
    """Thumbs up/down and/or text on a reply, by the response `id` the client received or by the
    turn id (`X-Turn-Id` header of the reply). 404 for an unknown id, 422 for a bad body."""
    gw = gateway_of(request)
    raw = await read_body(request, gw.settings.max_body_bytes)
    body = FeedbackRequest.model_validate(parse_body(raw, FeedbackRequest, invalid_status=422))

    def store() -> tuple[int, str] | None:
        with OrmSession(gw.engine) as db, db.begin():
            return record_feedback(db, turn_id=body.turn_id, response_id=body.response_id,
                                   value=body.value, text=body.text)

    try:
        stored = await asyncio.to_thread(store)
    except SQLAlchemyError as exc:
        raise OpenAIError(503, f"pool unavailable: {str(exc).splitlines()[0]}") from exc
    if stored is None:
        which = f"turn {body.turn_id!r}" if body.turn_id else f"response {body.response_id!r}"
        raise OpenAIError(404, f"no {which} in the pool (capture is write-behind: retry shortly "
                               "if the reply just arrived)", code="not_found")
    vote_id, turn_id = stored
    await asyncio.to_thread(gw.enqueuer.send, [turn_id])
    return {"object": "feedback", "id": vote_id, "turn_id": turn_id}
