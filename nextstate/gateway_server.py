"""The gateway's uvicorn server, as `nextstate gateway` and `nextstate up` run it."""

from __future__ import annotations

import contextlib
from typing import Any

import click
import uvicorn

from base.settings import Settings
from gateway.app import create_app
from gateway.metrics import ProcessReport


def gateway_server(settings: Settings, *, processes: ProcessReport | None = None,
                   own_signals: bool = True) -> uvicorn.Server:
    """The gateway's server for *settings*; ``run()`` serves until SIGINT/SIGTERM (or, without
    *own_signals*, until the caller sets ``should_exit``) and prints `base_url: ...` once the
    socket accepts connections. *processes*: the children `up` supervises, for /readyz and /metrics."""
    try:
        app = create_app(settings, processes=processes)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level="warning",
                            access_log=False, timeout_graceful_shutdown=10,
                            timeout_keep_alive=settings.keep_alive_s)

    class Server(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if self.started:
                click.echo(f"base_url: http://{settings.host}:{settings.port}/v1")

        def capture_signals(self) -> Any:
            # uvicorn re-raises a captured SIGTERM once served, which would end the process
            # before `up` stops its children: `up` handles the signals itself
            return super().capture_signals() if own_signals else contextlib.nullcontext()

    return Server(config)
