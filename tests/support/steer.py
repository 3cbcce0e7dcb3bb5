"""A pass-through in front of a real vLLM that makes the replies deterministic, for the real-agent
tests (tests/agents/test_agents.py).

SmolLM2-135M seldom writes a tool call by itself, least of all under a coding agent's long
prompt, and left alone it rambles until the output budget (minutes on two CPU cores); each agent
sets its own request fields (``tool_choice`` among them), so the gateway cannot be asked for a
call through the agent. This upstream sits between the gateway and vLLM and gives each chat
request vLLM's own structured outputs, ``structured_outputs: {"choice": [TEXT]}``, with the TEXT
the test chose for it (``reply(messages)``; None leaves the request alone). vLLM still renders
the prompt, samples (constrained to TEXT), and returns its token ids and logprobs; its hermes
parser turns ``<tool_call>{…}</tool_call>`` into a tool call. Nothing else is changed (but a
``tool_choice`` of "required" or a named tool, which becomes "auto" where a reply is forced): other
routes, and every reply, go through byte for byte, streams chunk by chunk. The gateway records
the request as the agent sent it, white-box.

It also keeps each chat request it saw (``requests``), for the test to report on.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp import web

from tests.support.processes import free_port

# a request's messages -> the text vLLM must write (None: leave the request alone)
Reply = Callable[[list[dict[str, Any]]], "str | None"]
_HOP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "accept-encoding"}


def text_of(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(str(p.get("text") or "") for p in content if isinstance(p, dict))
    return ""


class SteeredVLLM:
    """``with SteeredVLLM(vllm_base_url) as s: s.reply = …; … s.base_url …``."""

    def __init__(self, upstream: str):
        self.upstream = upstream.rstrip("/")  # …/v1
        self.root = self.upstream.removesuffix("/v1")
        self.port = free_port()
        self.reply: Reply | None = None
        self.requests: list[dict[str, Any]] = []  # each chat body, with "steered": the forced text or None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def _steer(self, body: dict[str, Any]) -> str | None:
        messages = body.get("messages")
        if self.reply is None or not isinstance(messages, list) or not messages:
            return None
        return self.reply([m for m in messages if isinstance(m, dict)])

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        assert self._session is not None
        raw = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        if request.method == "POST" and request.path.endswith("/chat/completions"):
            body = json.loads(raw)
            forced = self._steer(body)
            self.requests.append({**body, "steered": forced})
            if forced is not None:
                body["structured_outputs"] = {"choice": [forced]}
                if body.get("tool_choice") not in (None, "auto", "none"):
                    # "required" or a named tool is a constraint of its own (a JSON schema) that
                    # vLLM would put in place of the choice; the forced text decides instead, and
                    # the hermes parser still reads a <tool_call> in it as a call
                    body["tool_choice"] = "auto"
                raw = json.dumps(body).encode()
        async with self._session.request(request.method, self.root + request.path_qs, data=raw or None,
                                         headers=headers) as up:
            out = web.StreamResponse(status=up.status, headers={k: v for k, v in up.headers.items()
                                                                 if k.lower() not in _HOP})
            await out.prepare(request)
            async for chunk in up.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out

    def __enter__(self) -> SteeredVLLM:
        ready = threading.Event()

        def run() -> None:
            loop = self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)

            async def start() -> None:
                self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900))
                app = web.Application(client_max_size=64 * 1024 * 1024)
                app.router.add_route("*", "/{tail:.*}", self._handle)
                self._runner = web.AppRunner(app, access_log=None)
                await self._runner.setup()
                await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
                ready.set()

            loop.run_until_complete(start())
            loop.run_forever()

        self._session: aiohttp.ClientSession | None = None
        self._thread = threading.Thread(target=run, name="steered-vllm", daemon=True)
        self._thread.start()
        if not ready.wait(30):
            raise RuntimeError("the steering upstream did not start")
        return self

    def __exit__(self, *exc: Any) -> None:
        loop = self._loop
        if loop is None:
            return

        async def stop() -> None:
            if self._runner is not None:
                await self._runner.cleanup()
            if self._session is not None:
                await self._session.close()

        asyncio.run_coroutine_threadsafe(stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(30)
