"""The gateway application: builds the FastAPI app from its routers; the state lives in
``gateway.state``, the routes in ``gateway.routes`` (proxy, feedback, health), ``gateway.api``
(the JSON admin API) and ``gateway.ui`` (the admin web UI)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from fastapi import FastAPI
from starlette.types import Receive, Scope, Send

from base.settings import Settings, check_admin_exposure
from gateway import api, errors, ui
from gateway.metrics import ProcessReport
from gateway.routes import feedback, health, openai
from gateway.serving import proxy_route, serve_proxy
from gateway.state import running
from gateway.upstream import load_model_list


class GatewayApp(FastAPI):
    """The gateway's FastAPI application, which hands a POST to a proxy route straight to
    gateway.serving.serve_proxy, before FastAPI's and Starlette's layers; anything else (other
    methods, a trailing slash, every other route) goes through FastAPI unchanged."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = proxy_route(scope)
        if route is None:
            await super().__call__(scope, receive, send)
        else:
            await serve_proxy(self, scope, receive, send, route)


def create_app(settings: Settings | None = None, *, processes: ProcessReport | None = None) -> FastAPI:
    """The gateway for *settings* (default: from the environment); raises ValueError for a bad model
    list, and :class:`~base.errors.AdminExposed` for an admin surface open to the network.

    *processes*: the processes a supervisor runs beside this gateway (`nextstate up`), shown in
    /readyz and /metrics."""
    settings = settings or Settings()
    check_admin_exposure(settings)
    model_list, policy_model = (None, settings.policy_model)
    if settings.model_list is not None:
        model_list, listed_policy = load_model_list(settings.model_list)
        policy_model = settings.policy_model or listed_policy

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with running(settings, model_list, policy_model) as gw:
            if processes is not None:
                gw.metrics.watch_processes(processes)
            app.state.gateway = gw
            yield

    app = GatewayApp(
        title="nextstate gateway",
        summary="OpenAI-compatible proxy that captures every call into the datapool.",
        lifespan=lifespan,
        # served by gateway.api.docs behind the admin check instead of FastAPI's open defaults
        docs_url=None, redoc_url=None, openapi_url=None,
    )
    app.state.processes = processes
    errors.install(app)
    app.include_router(openai.router)
    app.include_router(feedback.router)
    api.include(app)
    app.include_router(health.router)
    ui.mount(app)
    return app
