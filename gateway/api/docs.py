"""The API's own documentation (``/openapi.json``, ``/docs``, ``/redoc``), behind the same check
as ``/api``: with an admin token or password set they need the bearer token or an admin UI login;
without one they are open, as the rest of the admin surface is."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse

from gateway.auth import require_api

router = APIRouter(include_in_schema=False, dependencies=[Depends(require_api)])


@router.get("/openapi.json")
async def openapi(request: Request) -> JSONResponse:
    return JSONResponse(request.app.openapi())


@router.get("/docs")
async def swagger(request: Request) -> HTMLResponse:
    return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{request.app.title} - Swagger UI")


@router.get("/redoc")
async def redoc(request: Request) -> HTMLResponse:
    return get_redoc_html(openapi_url="/openapi.json", title=f"{request.app.title} - ReDoc")
