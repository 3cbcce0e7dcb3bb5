"""The judgements page: scoring that is waiting or ended without a reward (pending, dead, tie,
unparsable) with its reason and last error, and retry, one or all dead ones, through the path
the sweep re-queues with (``datapool.judgements.mark_pending``, then the Enqueuer). And the
judges page: how far each judge agrees with people's labels, the hint gate's acceptance rate,
and what both did to training."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

from fastapi import APIRouter, Depends, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from sqlalchemy.orm import Session as OrmSession

from datapool import judgements, reliability
from base.vocab import JudgementStatus
from gateway import actions
from gateway.auth import require_ui
from base.errors import RequestError
from gateway.pool import in_pool
from gateway.state import gateway_of
from gateway.ui.pages import env, render

env.filters["combine_offset"] = lambda query, offset: {**query, "offset": max(0, offset)}
router = APIRouter(prefix="/admin", include_in_schema=False, dependencies=[Depends(require_ui)])
PAGE = 100


def _status(value: str | None) -> str:
    status = value or JudgementStatus.DEAD
    if status not in judgements.SHOWN:
        raise RequestError(400, f"status must be one of {', '.join(judgements.SHOWN)}", param="status")
    return status


def _offset(value: str | None) -> int:
    try:
        return max(0, int(value or 0))
    except ValueError:
        raise RequestError(400, "offset must be a whole number", param="offset") from None


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit}"
    return f"{max(seconds, 0):.0f} s"


@router.get("/judgements")
async def judgements_page(request: Request) -> HTMLResponse:
    params = request.query_params
    status, offset = _status(params.get("status")), _offset(params.get("offset"))
    reason = params.get("reason") or None

    def run(db: OrmSession) -> dict[str, Any]:
        rows, total = judgements.browse_judgements(db, status=status, dead_reason=reason, limit=PAGE, offset=offset)
        return {"rows": rows, "total": total, "counts": judgements.status_counts(db),
                "reasons": judgements.dead_reasons(db)}

    found = await in_pool(gateway_of(request).engine, run)
    retried = params.get("retried")
    here = {k: v for k, v in (("status", status), ("reason", reason)) if v}
    return render(request, "judgements.html", state=status, reason=reason, offset=offset, page=PAGE, age=_age,
                  retryable=status in judgements.RETRYABLE, here=here, urlencode=urlencode,
                  retried=int(retried) if retried and retried.isdigit() else None, **found)


@router.get("/judgements/dead-count")
async def dead_count(request: Request) -> HTMLResponse:
    """The nav's dead-letter badge (loaded by htmx on every page)."""
    n = await in_pool(gateway_of(request).engine, judgements.dead_count)
    badge = f' <span class="badge dead" title="dead-lettered judgements">{n}</span>' if n else ""
    return HTMLResponse(badge)


def _after(request: Request, status: str, reason: str | None, queued: list[str]) -> Response:
    query = {k: v for k, v in (("status", status), ("reason", reason)) if v} | {"retried": str(len(queued))}
    return RedirectResponse("/admin/judgements?" + urlencode(query), status_code=303)


@router.post("/judgements/retry")
async def retry_all(request: Request) -> Response:
    """Re-queue every dead judgement matching the page's filter (its reason, if one is chosen)."""
    form = await request.form()
    reason = str(form.get("reason") or "") or None
    queued = await actions.retry_judgements(gateway_of(request), status=JudgementStatus.DEAD, dead_reason=reason)
    return _after(request, JudgementStatus.DEAD, reason, queued)


@router.post("/judgements/{turn_id}/retry")
async def retry_one(request: Request, turn_id: str) -> Response:
    form = await request.form()
    back = str(form.get("status") or JudgementStatus.DEAD)
    queued = await actions.retry_judgements(gateway_of(request), turn_ids=[turn_id])
    if not queued:
        raise RequestError(404, f"no dead, tie or unparsable judgement for turn {turn_id!r}", code="not_found")
    return _after(request, back if back in judgements.SHOWN else JudgementStatus.DEAD,
                  str(form.get("reason") or "") or None, queued)


@router.get("/judges")
async def judges_page(request: Request) -> HTMLResponse:
    """Whether to trust the judge: agreement with people's labels per judge and prompt version,
    the hint gate's acceptance, and what both did to training (``datapool.reliability``)."""
    found = await in_pool(gateway_of(request).engine, reliability.summary)
    return render(request, "judges.html", pct=_pct, **found)


def _pct(part: int, whole: int) -> str:
    return f"{part / whole:.0%}" if whole else "–"
