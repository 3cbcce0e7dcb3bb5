"""The admin's state changes and exports, shared by the web UI (``gateway.ui``) and the JSON API
(``gateway.api``): labels, promote, rollback, the export stream."""

from __future__ import annotations

from typing import Any

from fastapi.responses import StreamingResponse
from sqlalchemy.orm import Session as OrmSession

from datapool import browse, export, judgements, labels
from publishing import publish
from vllm_client.http import policy_servers
from datapool.judgements import mark_pending
from base.vocab import LabelKind
from base.errors import RequestError
from gateway.pool import in_pool, in_thread
from gateway.state import Gateway


async def add_label(gw: Gateway, *, kind: str, value: Any, author: str, turn_id: str | None = None,
                    session_id: str | None = None) -> dict[str, Any]:
    """Store a label. A corrected reply re-queues the turn, so the scorer makes it the turn's
    hint and computes teacher logprobs under it. Raises LabelError (400), NotFound (404) or
    RequestError (503: the pool is down)."""
    def run(db: OrmSession) -> tuple[dict[str, Any], list[str]]:
        row = labels.add_label(db, kind=kind, value=value, author=author, turn_id=turn_id,
                               session_id=session_id)
        queued = mark_pending(db, [turn_id]) if kind == LabelKind.CORRECTION and turn_id else []
        return labels.label_dict(row), queued

    label, queued = await in_pool(gw.engine, run, write=True)
    if queued:
        await in_thread(gw.enqueuer.send, queued)
    return label | {"queued": queued}


async def promote(gw: Gateway, name: str, actor: str, reason: str | None = None) -> dict[str, Any]:
    """Make version *name* (or ``base``) the `policy` alias: loaded into every vLLM first.
    Raises a PublishError (409, VersionTainted's own code; VersionNotFound 404), changing nothing."""
    def run() -> dict[str, Any]:
        # one read of the pool, the servers switched, one transaction that records it all
        switched = publish.promote(gw.engine, name, policy_servers(gw.settings), actor=actor, reason=reason)
        return {"active": switched.active["name"] if switched.active else None, "previous": switched.previous}

    return await in_thread(run)


async def rollback(gw: Gateway, to: str | None, actor: str, reason: str | None = None) -> dict[str, Any]:
    """Roll the policy back (to the previous version, or to *to*); raises as :func:`promote`."""
    def run() -> dict[str, Any]:
        result = publish.rollback(gw.engine, policy_servers(gw.settings), to=to or None, actor=actor,
                                  reason=reason)
        active = result["active"]["name"] if result.get("active") else None
        return {"active": active, "rolled_back": list(result.get("rolled_back", []))}

    return await in_thread(run)


def export_response(gw: Gateway, f: browse.Browse, fmt: str) -> StreamingResponse:
    """The turns *f* selects, streamed as JSONL or Parquet (an attachment)."""
    if fmt == "jsonl":
        body, media = export.jsonl(gw.engine, f), "application/x-ndjson"
    elif fmt == "parquet":
        body, media = export.parquet(gw.engine, f), "application/vnd.apache.parquet"
    else:
        raise RequestError(400, f"format {fmt!r}: use jsonl or parquet", param="format")
    return StreamingResponse(body, media_type=media,
                             headers={"Content-Disposition": f'attachment; filename="nextstate-turns.{fmt}"'})


async def retry_judgements(gw: Gateway, **which: Any) -> list[str]:
    """Re-queue judgements (``datapool.judgements.retry``: the turns given, or all in a state) the
    way the sweep does: pending in the pool first, then the tasks sent. Returns the turn ids."""
    queued = await in_pool(gw.engine, lambda db: judgements.retry(db, **which), write=True)
    if queued:
        await in_thread(gw.enqueuer.send, queued)
    return queued
