"""Liveness, readiness and Prometheus metrics."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import text
from sqlalchemy.exc import SQLAlchemyError

from gateway.state import gateway_of

router = APIRouter()


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """The process is up."""
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(request: Request) -> JSONResponse:
    """The pool answers, every model group has a vLLM deployment that answers (a group of
    replicas serves while one is down: the one down is listed, the gateway stays ready), and
    under `nextstate up` every process it runs is running. 503 (with the reason) when not."""
    gw = gateway_of(request)

    def ping() -> None:
        with gw.engine.connect() as conn:
            conn.execute(text("SELECT 1"))

    checks: dict[str, Any] = {}
    try:
        await asyncio.wait_for(asyncio.to_thread(ping), 5.0)
        checks["pool"] = "ok"
    except (SQLAlchemyError, TimeoutError) as exc:
        checks["pool"] = f"unreachable: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
    checks["upstreams"] = await gw.upstreams.check()
    spool = gw.writer.spool
    checks["spool"] = {"records": spool.waiting, "error": spool.error}
    # how far capture is behind the traffic (it does not make the gateway unready: it still answers,
    # and nothing is lost while the spool takes what memory cannot hold)
    checks["capture"] = {"queued": gw.writer.depth, "spooled": spool.waiting,
                         "oldest_unstored_s": round(gw.writer.oldest_unstored_s(), 3)}
    unserved = gw.upstreams.groups_without_replica(checks["upstreams"])
    if unserved:
        checks["unserved_models"] = unserved
    ready = checks["pool"] == "ok" and not unserved
    processes = request.app.state.processes
    if processes is not None:  # the children of `nextstate up`
        checks["processes"] = {name: _process_check(state) for name, state in processes().items()}
        ready = ready and all(v == "ok" for v in checks["processes"].values())
    return JSONResponse({"status": "ready" if ready else "not ready", "checks": checks},
                        status_code=200 if ready else 503)


def _process_check(state: Mapping[str, Any]) -> str:
    """"ok", or what the process is doing and why: "restarting (killed by SIGKILL; 2 restarts)"."""
    if state.get("state") == "running":
        return "ok"
    if state.get("gave_up"):  # `up` stopped restarting it: "failed: trainer killed by SIGKILL 3 times in a row ..."
        return f"{state.get('state')}: {state['gave_up']}"
    why = [state["last_exit"]] if state.get("last_exit") else []
    if state.get("restarts"):
        why.append(f"{state['restarts']} restarts")
    return f"{state.get('state')}" + (f" ({'; '.join(why)})" if why else "")


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    # the pool collector may query the database: keep that off the event loop
    body = await asyncio.to_thread(generate_latest, gateway_of(request).metrics.registry)
    return Response(body, media_type=CONTENT_TYPE_LATEST)
