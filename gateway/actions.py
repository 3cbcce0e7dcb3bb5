"""The admin's state changes and exports, shared by the web UI (``gateway.ui``) and the JSON API
(``gateway.api``): labels, promote, rollback, the export stream."""

from __future__ import annotations

from typing import Any

from fastapi.responses import StreamingResponse
from sqlalchemy.orm import Session as OrmSession

from datapool import browse, export, judgements, labels, versions
from publishing import publish
from vllm_client.http import policy_servers
from datapool.judgements import mark_pending
from base.vocab import LabelKind
from gateway.errors import OpenAIError
from gateway.pool import in_pool, in_thread
from gateway.state import Gateway


async def add_label(gw: Gateway, *, kind: str, value: Any, author: str, turn_id: str | None = None,
                    session_id: str | None = None) -> dict[str, Any]:
    """Store a label. A corrected reply re-queues the turn, so the scorer makes it the turn's
    hint and computes teacher logprobs under it. Raises OpenAIError 400 / 404 / 503."""
    def run(db: OrmSession) -> tuple[dict[str, Any], list[str]]:
        row = labels.add_label(db, kind=kind, value=value, author=author, turn_id=turn_id,
                               session_id=session_id)
        queued = mark_pending(db, [turn_id]) if kind == LabelKind.CORRECTION and turn_id else []
        return labels.label_dict(row), queued

    try:
        label, queued = await in_pool(gw.engine, run, write=True)
    except LookupError as exc:
        raise OpenAIError(404, str(exc).strip("'\""), code="not_found") from exc
    if queued:
        await in_thread(gw.enqueuer.send, queued)
    return label | {"queued": queued}


async def _policy_change(run: Any, failed_code: str) -> dict[str, Any]:
    """Run a promote/rollback in a worker thread; its errors in the API's dialect."""
    try:
        return await in_thread(run)
    except versions.VersionNotFound:
        raise
    except versions.PublishError as exc:  # its own 409, with the code naming the change that failed
        raise OpenAIError(exc.status, str(exc), code=failed_code) from exc


async def promote(gw: Gateway, name: str, actor: str, reason: str | None = None) -> dict[str, Any]:
    """Make version *name* (or ``base``) the `policy` alias: loaded into every vLLM first."""
    def run() -> dict[str, Any]:
        # one read of the pool, the servers switched, one transaction that records it all
        switched = publish.promote(gw.engine, name, policy_servers(gw.settings), actor=actor, reason=reason)
        return {"active": switched.active["name"] if switched.active else None, "previous": switched.previous}

    return await _policy_change(run, "promote_failed")


async def rollback(gw: Gateway, to: str | None, actor: str, reason: str | None = None) -> dict[str, Any]:
    """Roll the policy back (to the previous version, or to *to*)."""
    def run() -> dict[str, Any]:
        result = publish.rollback(gw.engine, policy_servers(gw.settings), to=to or None, actor=actor,
                                  reason=reason)
        active = result["active"]["name"] if result.get("active") else None
        return {"active": active, "rolled_back": list(result.get("rolled_back", []))}

    return await _policy_change(run, "rollback_failed")


def export_response(gw: Gateway, f: browse.Browse, fmt: str) -> StreamingResponse:
    """The turns *f* selects, streamed as JSONL or Parquet (an attachment)."""
    if fmt == "jsonl":
        body, media = export.jsonl(gw.engine, f), "application/x-ndjson"
    elif fmt == "parquet":
        body, media = export.parquet(gw.engine, f), "application/vnd.apache.parquet"
    else:
        raise OpenAIError(400, f"format {fmt!r}: use jsonl or parquet", param="format")
    return StreamingResponse(body, media_type=media,
                             headers={"Content-Disposition": f'attachment; filename="nextstate-turns.{fmt}"'})


async def retry_judgements(gw: Gateway, **which: Any) -> list[str]:
    """Re-queue judgements (``datapool.judgements.retry``: the turns given, or all in a state) the
    way the sweep does: pending in the pool first, then the tasks sent. Returns the turn ids."""
    queued = await in_pool(gw.engine, lambda db: judgements.retry(db, **which), write=True)
    if queued:
        await in_thread(gw.enqueuer.send, queued)
    return queued
