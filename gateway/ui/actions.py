"""The admin's state changes, shared by the UI and the JSON API: labels, promote, rollback."""

from __future__ import annotations

import asyncio
from typing import Any

from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session as OrmSession

from datapool import labels
from datapool.scoring import mark_pending
from gateway.app import Gateway
from gateway.errors import OpenAIError


def _unavailable(exc: SQLAlchemyError) -> OpenAIError:
    return OpenAIError(503, f"pool unavailable: {str(exc).splitlines()[0]}")


async def read(gw: Gateway, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Run ``fn(db, ...)`` in a worker thread with a session of its own."""
    def run() -> Any:
        with OrmSession(gw.engine) as db:
            return fn(db, *args, **kwargs)

    try:
        return await asyncio.to_thread(run)
    except SQLAlchemyError as exc:
        raise _unavailable(exc) from exc


async def add_label(gw: Gateway, *, kind: str, value: Any, author: str, turn_id: str | None = None,
                    session_id: str | None = None) -> dict[str, Any]:
    """Store a label. A corrected reply re-queues the turn, so the scorer makes it the turn's
    hint and computes teacher logprobs under it. Raises OpenAIError 400 / 404 / 503."""
    def run() -> tuple[dict[str, Any], list[str]]:
        with OrmSession(gw.engine) as db, db.begin():
            row = labels.add_label(db, kind=kind, value=value, author=author, turn_id=turn_id,
                                   session_id=session_id)
            queued = mark_pending(db, [turn_id]) if kind == "correction" and turn_id else []
            return labels.label_dict(row), queued

    try:
        label, queued = await asyncio.to_thread(run)
    except labels.LabelError as exc:
        raise OpenAIError(400, str(exc), param="value", code="invalid_label") from exc
    except LookupError as exc:
        raise OpenAIError(404, str(exc).strip("'\""), code="not_found") from exc
    except SQLAlchemyError as exc:
        raise _unavailable(exc) from exc
    if queued:
        await asyncio.to_thread(gw.enqueuer.send, queued)
    return label | {"queued": queued}


def vllm_urls(gw: Gateway) -> list[str]:
    """The servers a version must be loaded into: the policy upstream and the teacher replica."""
    from trainer.policy_cli import default_vllm_urls

    return default_vllm_urls(gw.settings)


async def _policy_change(run: Any, failed_code: str) -> dict[str, Any]:
    """Run a promote/rollback in a worker thread; its errors in the API's dialect."""
    from trainer.publish import PublishError, VersionNotFound

    try:
        return await asyncio.to_thread(run)
    except VersionNotFound as exc:
        raise OpenAIError(404, str(exc), code="version_not_found") from exc
    except PublishError as exc:
        raise OpenAIError(409, str(exc), code=failed_code) from exc
    except SQLAlchemyError as exc:
        raise _unavailable(exc) from exc


async def promote(gw: Gateway, name: str, actor: str, reason: str | None = None) -> dict[str, Any]:
    """Make version *name* (or ``base``) the `policy` alias: loaded into every vLLM first."""
    from trainer.publish import activate

    def run() -> dict[str, Any]:
        previous = _active_name(gw)
        # trainer.publish writes the promote event in the same transaction as the switch
        active = activate(gw.engine, name, vllm_urls(gw), actor=actor, reason=reason)
        return {"active": active["name"] if active else None, "previous": previous}

    return await _policy_change(run, "promote_failed")


async def rollback(gw: Gateway, to: str | None, actor: str, reason: str | None = None) -> dict[str, Any]:
    """Roll the policy back (to the previous version, or to *to*)."""
    from trainer.publish import rollback as do_rollback

    def run() -> dict[str, Any]:
        result = do_rollback(gw.engine, vllm_urls(gw), to=to or None, actor=actor, reason=reason)
        active = result["active"]["name"] if result.get("active") else None
        return {"active": active, "rolled_back": list(result.get("rolled_back", []))}

    return await _policy_change(run, "rollback_failed")


def _active_name(gw: Gateway) -> str | None:
    from datapool.queries import active_policy_version

    with OrmSession(gw.engine) as db:
        row = active_policy_version(db)
        return row.name if row else None
