"""Tenants: which client keys belong to whom, and what a tenant's key may see.

A client key belongs to a tenant when the settings say so (``tenant_keys``: key -> tenant) or the
admin API issued it (``POST /api/tenants/{tenant}/keys``; the pool keeps only its hash). A request
with such a key is that tenant's: the sessions it opens carry the tenant and live under ids of
their own (``<tenant>~<session id>``), so no other tenant's request can add to them. The same key
as the bearer token of ``/api`` sees only its tenant's sessions, turns, judgements, labels and
exports; routes that are not about one tenant's data (policy changes, key management) are the
admin's alone. The admin token sees everything.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import time
import uuid
from typing import Any

from fastapi import Request
from sqlalchemy import Engine, select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session as OrmSession

from datapool import audit
from datapool.db import utcnow
from datapool.models import ApiKey, Session, Turn
from base.settings import TENANT_NAME, Settings
from base.vocab import AuditAction
from base.errors import RequestError

SEPARATOR = "~"  # between a tenant and its own session id; not in any tenant name
REFRESH_S = 5.0  # how stale another replica's view of issued keys may be


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def scoped_session_id(tenant: str | None, session_id: str | None) -> str | None:
    """The pool's id of a tenant's session: its own id under the tenant's name."""
    if tenant is None or session_id is None:
        return session_id
    scoped = f"{tenant}{SEPARATOR}{session_id}"
    # sessions.id holds 128 characters: a long id is kept as its hash
    return scoped if len(scoped) <= 128 else f"{tenant}{SEPARATOR}{hashlib.sha256(session_id.encode()).hexdigest()}"


class KeyRing:
    """Client keys: the settings' (``api_keys`` without a tenant, ``tenant_keys``) and those the
    admin API issued, read from the pool at most every :data:`REFRESH_S` seconds."""

    def __init__(self, settings: Settings, engine: Engine):
        self.engine = engine
        self.plain = [k.encode() for k in settings.api_keys]
        self.configured = {key_hash(k): t for k, t in settings.tenant_keys.items()}
        self.issued: dict[str, str] = {}  # key hash -> tenant
        self._read_at = float("-inf")
        self._lock = asyncio.Lock()

    def _load(self) -> dict[str, str]:
        with OrmSession(self.engine) as db:
            return {h: t for h, t in db.execute(select(ApiKey.key_hash, ApiKey.tenant)
                                                 .where(ApiKey.revoked_at.is_(None)))}

    async def refresh(self, *, force: bool = False) -> None:
        if not force and time.monotonic() - self._read_at < REFRESH_S:
            return
        async with self._lock:
            if not force and time.monotonic() - self._read_at < REFRESH_S:
                return
            try:
                self.issued = await asyncio.to_thread(self._load)
            except SQLAlchemyError:
                pass  # the pool is away: the keys known last time stay valid
            self._read_at = time.monotonic()

    async def lookup(self, key: str | None) -> tuple[bool, str | None]:
        """(accepted, tenant) for a client's key; every request is accepted while no key exists."""
        await self.refresh()
        if not (self.plain or self.configured or self.issued):
            return True, None
        if not key:
            return False, None
        given = key.encode()
        if any(hmac.compare_digest(given, k) for k in self.plain):
            return True, None
        h = key_hash(key)
        tenant = self.configured.get(h) or self.issued.get(h)
        return tenant is not None, tenant

    async def tenant_of(self, key: str) -> str | None:
        """The tenant of a tenant key, else None."""
        return await self.tenant_of_hash(key_hash(key))

    async def tenant_of_hash(self, h: str) -> str | None:
        """The tenant of the tenant key whose hash is *h* (a UI login keeps only that), else None:
        a revoked key ends the logins made with it."""
        await self.refresh()
        return self.configured.get(h) or self.issued.get(h)


def issue(db: OrmSession, tenant: str, actor: str) -> dict[str, Any]:
    """A new key for *tenant*: the key itself is in the answer and nowhere else."""
    key = "nsk-" + uuid.uuid4().hex + uuid.uuid4().hex
    row = ApiKey(id=uuid.uuid4().hex, tenant=tenant, key_hash=key_hash(key), created_at=utcnow(), created_by=actor)
    db.add(row)
    audit.record(db, actor, AuditAction.KEY_ISSUE, tenant, {"key_id": row.id})
    return {"id": row.id, "tenant": tenant, "key": key, "created_at": row.created_at.isoformat()}


def list_keys(db: OrmSession, tenant: str) -> list[dict[str, Any]]:
    return [{"id": k.id, "tenant": k.tenant, "created_at": k.created_at.isoformat(), "created_by": k.created_by,
             "revoked_at": k.revoked_at.isoformat() if k.revoked_at else None}
            for k in db.scalars(select(ApiKey).where(ApiKey.tenant == tenant).order_by(ApiKey.created_at))]


def revoke(db: OrmSession, tenant: str, key_id: str, actor: str) -> bool:
    row = db.get(ApiKey, key_id)
    if row is None or row.tenant != tenant or row.revoked_at is not None:
        return False
    row.revoked_at = utcnow()
    audit.record(db, actor, AuditAction.KEY_REVOKE, tenant, {"key_id": key_id})
    return True


# -- what a tenant's key may see under /api ---------------------------------------------------

#: /api routes a tenant key may call (each filters by tenant); every other /api route is the admin's
TENANT_ROUTES = frozenset({
    ("GET", "/api/sessions"), ("GET", "/api/sessions/{session_id}"), ("PUT", "/api/sessions/{session_id}"),
    ("PATCH", "/api/sessions/{session_id}"), ("POST", "/api/sessions/{session_id}/outcome"),
    ("POST", "/api/sessions/{session_id}/end"), ("POST", "/api/sessions/{session_id}/labels"),
    ("GET", "/api/sessions/{session_id}/lineage"),
    ("GET", "/api/turns"), ("GET", "/api/turns/{turn_id}"), ("GET", "/api/turns/{turn_id}/labels"),
    ("POST", "/api/turns/{turn_id}/labels"), ("GET", "/api/judgements"), ("GET", "/api/queue"),
    ("GET", "/api/export"), ("POST", "/api/capture/flush"), ("POST", "/api/forget"),
    ("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/redoc"),
})


def _owner(engine: Engine, session_id: str | None, turn_id: str | None) -> tuple[bool, str | None]:
    """(found, tenant) of a session, or of a turn's session."""
    with OrmSession(engine) as db:
        if session_id is not None:
            row = db.execute(select(Session.tenant).where(Session.id == session_id)).first()
        else:
            row = db.execute(select(Session.tenant).join(Turn, Turn.session_id == Session.id)
                             .where(Turn.id == turn_id)).first()
    return (row is not None, row[0] if row is not None else None)


#: admin UI routes a tenant's login may use (each shows or changes only its tenant's data); every
#: other page (judgements, judges, training, promote, rollback) is the admin's
TENANT_PAGES = frozenset({
    ("GET", "/admin"), ("GET", "/admin/"), ("POST", "/admin/logout"),
    ("GET", "/admin/sessions"), ("GET", "/admin/sessions/rows"), ("GET", "/admin/sessions/{session_id}"),
    ("POST", "/admin/sessions/{session_id}/labels"), ("POST", "/admin/turns/{turn_id}/labels"),
    ("GET", "/admin/turns"), ("GET", "/admin/queue"), ("GET", "/admin/queue/count"), ("GET", "/admin/export.{fmt}"),
})


async def check_tenant_route(request: Request, tenant: str, engine: Engine) -> None:
    """Refuse a tenant key what is not its tenant's: another route than :data:`TENANT_ROUTES`
    (403), a session or turn of another tenant (404, as if it did not exist)."""
    await _check(request, tenant, engine, TENANT_ROUTES, "this admin API route needs the admin token, not a tenant's key")


async def check_tenant_page(request: Request, tenant: str, engine: Engine) -> None:
    """The same for a tenant's login to the admin UI: only :data:`TENANT_PAGES`, only its own
    sessions and turns."""
    await _check(request, tenant, engine, TENANT_PAGES, "this page is the admin's, not a tenant's")


async def _check(request: Request, tenant: str, engine: Engine, allowed: frozenset[tuple[str, str]],
                 refusal: str) -> None:
    route = request.scope.get("route")
    path = getattr(route, "path", request.url.path)
    method = "GET" if request.method == "HEAD" else request.method
    if (method, path) not in allowed:
        raise RequestError(403, refusal, code="admin_only")
    params = request.path_params
    if "session_id" in params or "turn_id" in params:
        found, owner = await asyncio.to_thread(_owner, engine, params.get("session_id"), params.get("turn_id"))
        if found and owner != tenant:
            what = "session" if "session_id" in params else "turn"
            key = params.get("session_id") or params.get("turn_id")
            raise RequestError(404, f"no {what} {key!r}", code=f"{what}_not_found")


def tenant_of_request(request: Request) -> str | None:
    """The tenant whose data an /api request may see (None: the admin, everything)."""
    admin = getattr(request.state, "admin", None)
    return getattr(admin, "tenant", None)
