"""Explicit signals from clients: feedback on a reply."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request

from datapool.judgements import record_feedback
from gateway.auth import require_api_key, tenant_of
from base.errors import RequestError
from gateway.pool import in_pool, in_thread
from gateway.protocol import FeedbackRequest, read_model
from gateway.state import gateway_of

router = APIRouter()


@router.post("/v1/feedback", dependencies=[Depends(require_api_key)])
@router.post("/s/{session_id}/v1/feedback", dependencies=[Depends(require_api_key)])
async def feedback(request: Request) -> dict[str, Any]:
    """Thumbs up/down and/or text on a reply, by the response `id` the client received or by the
    turn id (`X-Turn-Id` header of the reply). 404 for an unknown id, 422 for a bad body."""
    gw = gateway_of(request)
    body = await read_model(request, FeedbackRequest, gw.settings.max_body_bytes)
    stored = await in_pool(gw.engine, record_feedback, write=True, turn_id=body.turn_id,
                           response_id=body.response_id, value=body.value, text=body.text,
                           tenant=tenant_of(request))
    if stored is None:
        which = f"turn {body.turn_id!r}" if body.turn_id else f"response {body.response_id!r}"
        raise RequestError(404, f"no {which} in the pool (capture is write-behind: retry shortly "
                               "if the reply just arrived)", code="not_found")
    vote_id, turn_id = stored
    await in_thread(gw.enqueuer.send, [turn_id])
    return {"object": "feedback", "id": vote_id, "turn_id": turn_id}
