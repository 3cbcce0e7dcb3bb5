"""The admin web UI at /admin: server-rendered HTML pages (the JSON API is ``gateway.api``)."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlencode

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles

from gateway import errors
from base.errors import CsrfFailed, LoginRequired
from gateway.ui import judgements, pages

STATIC = Path(__file__).parent / "static"


def mount(app: FastAPI) -> None:
    """Add the UI's routes, static files and its two exception handlers to the gateway."""
    @app.exception_handler(LoginRequired)
    async def _login(request: Request, _: LoginRequired) -> Response:
        # the whole URL, query included: a shared link to a filtered view opens that view after the login
        here = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        target = "/admin/login?" + urlencode({"next": here})
        if request.headers.get("hx-request") == "true":
            return Response(status_code=401, headers={"HX-Redirect": target})
        if request.method != "GET":
            return HTMLResponse("<p>Log in first.</p>", status_code=401)
        return RedirectResponse(target, status_code=303)

    @app.exception_handler(CsrfFailed)
    async def _csrf(request: Request, _: CsrfFailed) -> Response:
        return HTMLResponse("<p>Refused: this form is stale or did not come from this site (CSRF check). "
                            "Reload the page and try again.</p>", status_code=403)

    errors.error_page(app, "/admin", pages.error_page)
    app.include_router(pages.public)
    app.include_router(pages.router)
    app.include_router(judgements.router)
    app.mount("/admin/static", StaticFiles(directory=STATIC), name="admin-static")
