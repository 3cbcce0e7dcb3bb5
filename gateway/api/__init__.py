"""The JSON admin API under ``/api``: sessions and judgements, labels, the queue and export,
policy versions, tenants' keys, forgetting and the audit log, and the API's docs (/docs, /redoc, /openapi.json). Every route takes the admin token or an admin UI login (``gateway.auth``)."""

from __future__ import annotations

from fastapi import FastAPI

from gateway.api import docs, labels, policy, privacy, sessions, tenants, turns


def include(app: FastAPI) -> None:
    """Add every /api router to *app*."""
    app.include_router(sessions.router)
    app.include_router(policy.router)
    app.include_router(labels.router)
    app.include_router(turns.router)
    app.include_router(tenants.router)
    app.include_router(privacy.router)
    app.include_router(docs.router)
