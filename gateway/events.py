"""A streamed reply as the gateway writes it: Starlette's StreamingResponse without its task group.

On the ASGI spec uvicorn speaks (2.3), Starlette runs each stream in an anyio task group with a
second task that waits for the client to hang up, and cancels the stream when it does: a task
group, two tasks and their cancel scopes per stream, a tenth of the gateway's CPU on a short
streamed reply (benchmarks/gateway/README.md). :class:`EventStream` writes the same bytes in the
request's own task and watches for the hang-up with one plain asyncio task, which cancels the
request's task as the task group would: the body's generator sees the same CancelledError (or
GeneratorExit, when the hang-up comes while a write is under way) at the same places, so
gateway.serving._Call._relay records the turn as cancelled and closes the upstream's connection
as before.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping

from starlette.responses import Response
from starlette.types import Receive, Scope, Send


async def _hang_up(receive: Receive) -> None:
    """Returns once the client has disconnected (what Starlette's listen_for_disconnect waits for)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class EventStream(Response):
    """The bytes of *body* as a ``text/event-stream`` reply, with StreamingResponse's headers."""

    media_type = "text/event-stream"

    def __init__(self, body: AsyncIterator[bytes], status_code: int = 200,
                 headers: Mapping[str, str] | None = None):
        self.body_iterator = body
        self.status_code = status_code
        self.background = None
        self.init_headers(headers)  # no `body` attribute: no content-length, as StreamingResponse
        self.started = False  # the reply's head was sent (gateway.serving.serve_proxy asks)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        assert task is not None
        state = {"writing": True, "hung_up": False}

        def cancel_on_hang_up(watch: asyncio.Future[None]) -> None:
            if state["writing"] and not watch.cancelled() and watch.exception() is None:
                state["hung_up"] = True
                task.cancel()

        watch = asyncio.ensure_future(_hang_up(receive))
        watch.add_done_callback(cancel_on_hang_up)
        body = self.body_iterator
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            self.started = True
            async for chunk in body:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not state["hung_up"]:
                raise  # cancelled from outside (the server shutting down): not ours to end
            task.uncancel()  # the client's hang-up ends the reply, as the task group's cancel scope did
        finally:
            state["writing"] = False
            watch.cancel()
            aclose = getattr(body, "aclose", None)
            if aclose is not None:
                await aclose()  # a generator stopped at a write: GeneratorExit there, as when collected
