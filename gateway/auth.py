"""Who may use the gateway: clients' API keys, and the admin UI and API with protection of every
state change.

Clients (``/v1``, ``/s/{id}/v1``): with ``api_keys`` set, ``Authorization: Bearer <key>``
(:func:`require_api_key`).

Admin auth is configured when ``admin_token`` or ``admin_password`` is set. Then:

* the JSON API (``/api``) takes ``Authorization: Bearer <admin token>`` as before, or the UI's
  session cookie (and then, for a state change, the CSRF token in ``X-CSRF-Token``);
* the UI (``/admin``) takes the session cookie, which ``/admin/login`` issues for the token or
  the password: an itsdangerous-signed, timestamped value (HttpOnly, SameSite=Strict) holding
  the admin's name and a CSRF token. Logging out clears it.
* a tenant's key is a login too: its cookie also holds the tenant and the key's hash, and it sees
  and changes only that tenant's sessions and turns, in the UI (``gateway.tenants.TENANT_PAGES``)
  and the API alike; revoking the key ends it.

Every UI state change (a POST) must carry that CSRF token, in the form field ``csrf_token`` or
the ``X-CSRF-Token`` header (htmx sends it from ``<body hx-headers>``). Without configured
auth the UI still sets an anonymous cookie so the CSRF check applies all the same: another
site cannot make a browser label or promote anything.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from itsdangerous import BadSignature, URLSafeTimedSerializer

from base.errors import CsrfFailed, LoginRequired, RequestError
from gateway.state import Gateway, gateway_of
from gateway.tenants import check_tenant_page, check_tenant_route, key_hash
from base.settings import Settings

COOKIE = "nextstate_admin"
CSRF_FIELD = "csrf_token"
CSRF_HEADER = "x-csrf-token"
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


@dataclass(frozen=True)
class Admin:
    """The person (or program) making an admin request."""

    name: str
    csrf: str | None  # the session's CSRF token; None for bearer-token requests
    via: str  # "cookie" | "bearer" | "open" | "tenant"
    tenant: str | None = None  # a tenant's key or login: only that tenant's data (gateway.tenants)
    key_hash: str | None = None  # a tenant's login: the hash of the key it logged in with


def configured(settings: Settings) -> bool:
    return bool(settings.admin_token or settings.admin_password)


def _serializer(settings: Settings) -> URLSafeTimedSerializer:
    secret = settings.admin_secret or hashlib.sha256(
        b"nextstate-admin-cookie\0" + (settings.admin_token or "").encode() + b"\0"
        + (settings.admin_password or "").encode()).hexdigest()
    return URLSafeTimedSerializer(secret, salt="nextstate-admin-session")


def check_credentials(settings: Settings, given: str) -> bool:
    """The admin token or password, compared in constant time."""
    ok = False
    for expected in (settings.admin_token, settings.admin_password):
        if expected:
            ok |= hmac.compare_digest(given.encode(), expected.encode())
    return ok


def new_session(settings: Settings, name: str, *, tenant: str | None = None,
                tenant_key: str | None = None) -> tuple[str, str]:
    """(cookie value, csrf token) of a fresh session for *name*; with *tenant*, a login of that
    tenant's made with *tenant_key* (the cookie keeps its hash, never the key)."""
    csrf = secrets.token_urlsafe(24)
    data: dict[str, str] = {"u": name, "c": csrf}
    if tenant is not None and tenant_key is not None:
        data |= {"t": tenant, "k": key_hash(tenant_key)}
    return _serializer(settings).dumps(data), csrf


def read_session(request: Request) -> Admin | None:
    raw = request.cookies.get(COOKIE)
    if not raw:
        return None
    settings = gateway_of(request).settings
    try:
        data: Any = _serializer(settings).loads(raw, max_age=settings.admin_session_max_age_s)
    except BadSignature:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("u"), str) or not isinstance(data.get("c"), str):
        return None
    if configured(settings) and data["u"] == "anonymous":
        return None  # a cookie from before auth was configured is no login
    if isinstance(data.get("t"), str) and isinstance(data.get("k"), str):
        return Admin(name=data["u"], csrf=data["c"], via="cookie", tenant=data["t"], key_hash=data["k"])
    return Admin(name=data["u"], csrf=data["c"], via="cookie")


async def _logged_in(request: Request) -> Admin | None:
    """The session cookie's login, if it is still good: a tenant's only while its key is."""
    admin = read_session(request)
    if admin is not None and admin.tenant is not None:
        assert admin.key_hash is not None
        if await gateway_of(request).keys.tenant_of_hash(admin.key_hash) != admin.tenant:
            return None  # the key was revoked (or moved): the login ends with it
    return admin


def set_cookie(response: Any, request: Request, value: str) -> None:
    settings = gateway_of(request).settings
    response.set_cookie(COOKIE, value, max_age=int(settings.admin_session_max_age_s), httponly=True,
                        samesite="strict", secure=request.url.scheme == "https", path="/")


async def _check_csrf(request: Request, admin: Admin) -> None:
    if request.method in SAFE_METHODS:
        return
    given = request.headers.get(CSRF_HEADER)
    if given is None and request.headers.get("content-type", "").startswith(
            ("application/x-www-form-urlencoded", "multipart/form-data")):
        given = (await request.form()).get(CSRF_FIELD)
    if not isinstance(given, str) or not admin.csrf or not hmac.compare_digest(given, admin.csrf):
        raise CsrfFailed()


def _bearer(request: Request) -> str | None:
    return _bearer_of(request.headers)


def _bearer_of(headers: Mapping[str, str]) -> str | None:
    auth = headers.get("authorization", "")
    return auth[7:] if auth[:7].lower() == "bearer " else None


def client_key(headers: Mapping[str, str]) -> str | None:
    """The client's key in *headers* (looked up case-insensitively): a bearer token, or
    Anthropic's ``x-api-key`` header (its SDKs send that)."""
    return _bearer_of(headers) or headers.get("x-api-key")


async def require_api_key(request: Request) -> None:
    """Dependency of the client routes: a known client key (``api_keys``, a tenant's key) as the
    bearer token, when any exists; ``request.state.tenant`` is the key's tenant (or None)."""
    # async: FastAPI runs a plain `def` dependency in a worker thread, a thread hop per request
    request.state.tenant = await accepted_tenant(gateway_of(request), request.headers)


def tenant_of(request: Request) -> str | None:
    """The tenant :func:`require_api_key` found for a client route's request (None: none)."""
    return getattr(request.state, "tenant", None)


async def accepted_tenant(gw: Gateway, headers: Mapping[str, str]) -> str | None:
    """The tenant of the client key in *headers* (None: a key of no tenant, or no key needed);
    401 for a missing or unknown key. gateway.serving.serve_proxy calls it with the gateway at
    hand and keeps the tenant itself, without Starlette's request state."""
    accepted, tenant = await gw.keys.lookup(client_key(headers))
    if not accepted:
        raise RequestError(401, "missing or invalid API key (Authorization: Bearer <key> or x-api-key)",
                          code="invalid_api_key")
    return tenant


async def require_ui(request: Request) -> Admin:
    """Dependency of every /admin route but login and static files."""
    admin = await _logged_in(request)
    if admin is None:
        if configured(gateway_of(request).settings):
            raise LoginRequired()
        admin = Admin(name="anonymous", csrf=None, via="open")  # a cookie is set on the page
        if request.method not in SAFE_METHODS:
            raise CsrfFailed()
    await _check_csrf(request, admin)
    request.state.admin = admin
    if admin.tenant is not None:
        await check_tenant_page(request, admin.tenant, gateway_of(request).engine)
    return admin


async def require_api(request: Request) -> Admin:
    """Dependency of every /api route: the admin token, or the UI's session (with CSRF)."""
    gw = gateway_of(request)
    settings = gw.settings
    token = _bearer(request)
    if token is not None:
        if settings.admin_token and hmac.compare_digest(token.encode(), settings.admin_token.encode()):
            return Admin(name="token", csrf=None, via="bearer")
        tenant = await gw.keys.tenant_of(token)
        if tenant is not None:  # a tenant's key: its own data only
            request.state.admin = Admin(name=f"tenant:{tenant}", csrf=None, via="tenant", tenant=tenant)
            await check_tenant_route(request, tenant, gw.engine)
            return request.state.admin
        if configured(settings):
            raise RequestError(401, "admin API needs Authorization: Bearer <admin token>", code="invalid_admin_token")
    admin = await _logged_in(request)
    if admin is not None:
        try:
            await _check_csrf(request, admin)
        except CsrfFailed:
            raise RequestError(403, "missing or wrong X-CSRF-Token", code="csrf_failed") from None
        if admin.tenant is not None:  # a tenant's UI login: the API as its key would see it
            request.state.admin = admin
            await check_tenant_route(request, admin.tenant, gw.engine)
        return admin
    if configured(settings):
        raise RequestError(401, "admin API needs Authorization: Bearer <admin token>", code="invalid_admin_token")
    return Admin(name="anonymous", csrf=None, via="open")
