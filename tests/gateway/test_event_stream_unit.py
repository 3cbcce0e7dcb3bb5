"""gateway.events.EventStream against Starlette's StreamingResponse, which it replaces on the
proxy's streams: the same messages to the server, and the same end for the body's generator when
the client hangs up (the relay records the turn as cancelled from there); and the proxy routes'
own answer to an unexpected error (gateway.serving.serve_proxy), without FastAPI's middlewares."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.responses import StreamingResponse

from base.settings import Settings
from gateway import serving
from gateway.app import create_app
from gateway.events import EventStream


async def _gen(chunks: list[bytes], log: list[str], pause: asyncio.Event | None = None) -> Any:
    try:
        for c in chunks:
            if pause is not None:
                await pause.wait()
            yield c
        log.append("ended")
    except asyncio.CancelledError:
        log.append("cancelled")
        raise
    except GeneratorExit:
        log.append("closed")
        raise
    finally:
        log.append("finally")


async def _serve(response: Any, hang_up: asyncio.Event | None = None,
                 send_blocks: asyncio.Event | None = None) -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if hang_up is None:
            await asyncio.Event().wait()
        else:
            await hang_up.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if send_blocks is not None and message.get("more_body"):
            await send_blocks.wait()

    await response({"type": "http", "asgi": {"spec_version": "2.3"}}, receive, send)
    return sent


@settings(max_examples=50, deadline=None)
@given(chunks=st.lists(st.binary(min_size=1, max_size=20), max_size=6), status=st.sampled_from([200, 201, 400]),
       headers=st.dictionaries(st.sampled_from(["X-Turn-Id", "X-Session-Id", "Cache-Control", "x-budget"]),
                               st.text("abc0123", min_size=1, max_size=6), max_size=4))
def test_the_same_messages_as_streaming_response(chunks: list[bytes], status: int, headers: dict[str, str]) -> None:
    async def both() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        ours = await _serve(EventStream(_gen(chunks, []), status_code=status, headers=headers))
        theirs = await _serve(StreamingResponse(_gen(chunks, []), status_code=status, headers=headers,
                                                media_type="text/event-stream"))
        return ours, theirs

    ours, theirs = asyncio.run(both())
    assert ours == theirs


def test_a_hang_up_while_the_upstream_is_awaited_cancels_the_generator_and_ends_the_reply() -> None:
    async def run() -> tuple[list[str], list[dict[str, Any]], int]:
        log: list[str] = []
        gate, hang_up = asyncio.Event(), asyncio.Event()
        serving_task = asyncio.ensure_future(_serve(EventStream(_gen([b"a", b"b"], log, gate)), hang_up))
        await asyncio.sleep(0.01)
        hang_up.set()
        sent = await serving_task  # ends normally: the hang-up is the reply's end, not an error
        return log, sent, serving_task.cancelling()

    log, sent, cancelling = asyncio.run(run())
    assert log == ["cancelled", "finally"] and cancelling == 0
    assert [m["type"] for m in sent] == ["http.response.start"]


def test_a_hang_up_during_a_write_closes_the_generator_at_its_yield() -> None:
    async def run() -> tuple[list[str], list[dict[str, Any]]]:
        log: list[str] = []
        hang_up, blocks = asyncio.Event(), asyncio.Event()
        serving_task = asyncio.ensure_future(_serve(EventStream(_gen([b"a", b"b"], log)), hang_up, blocks))
        await asyncio.sleep(0.01)
        hang_up.set()
        return log, await serving_task

    log, sent = asyncio.run(run())
    assert log == ["closed", "finally"]
    assert [m.get("body") for m in sent] == [None, b"a"]


def test_a_cancellation_from_outside_is_not_swallowed() -> None:
    async def run() -> list[str]:
        log: list[str] = []
        serving_task = asyncio.ensure_future(_serve(EventStream(_gen([b"a"], log, asyncio.Event()))))
        await asyncio.sleep(0.01)
        serving_task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await serving_task
        return log

    assert asyncio.run(run()) == ["cancelled", "finally"]


@pytest.mark.parametrize(("path", "dialect"), [("/v1/chat/completions", "openai"), ("/v1/messages", "anthropic"),
                                               ("/s/abc/v1/responses", "openai")])
def test_an_unexpected_error_on_a_proxy_route_is_a_500_in_the_clients_dialect(
        path: str, dialect: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    async def broken(*_: Any, **__: Any) -> Any:
        raise RuntimeError("a bug on the request path")

    monkeypatch.setattr(serving, "_proxied", broken)  # what serve_proxy calls with the body it read
    settings_ = Settings(upstream_url="http://127.0.0.1:9/v1", database_url=f"sqlite:///{tmp_path / 'p.db'}",
                         data_dir=tmp_path / "d")
    with TestClient(create_app(settings_), raise_server_exceptions=False) as c, \
            caplog.at_level(logging.ERROR, logger="nextstate.gateway"):
        r = c.post(path, json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 500
    rid = r.headers["x-request-id"]
    body = r.json()
    if dialect == "anthropic":
        assert body["type"] == "error" and body["error"]["type"] == "api_error" and rid in body["error"]["message"]
    else:
        assert body["error"]["code"] == "internal_error" and rid in body["error"]["message"]
    assert "a bug on the request path" not in r.text
    assert any(rid in rec.getMessage() and rec.exc_info for rec in caplog.records)


@settings(max_examples=200, deadline=None)
@given(path=st.one_of(
    st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/v1/models",
                     "/v1/chat/completions/", "/v1/messages/count_tokens", "/s/abc/v1/messages", "/s//v1/responses",
                     "/s/a/b/v1/chat/completions", "/v1/chat/completions\n", "/api/sessions"]),
    st.builds(lambda a, b: f"/s/{a}/v1/{b}", st.text("ab/.-", max_size=5),
              st.sampled_from(["chat/completions", "completions", "responses", "messages", "models"]))),
    root=st.sampled_from(["", "/gw"]), method=st.sampled_from(["POST", "GET"]))
def test_proxy_route_is_the_route_pattern(path: str, root: str, method: str) -> None:
    """The dict looked up first for the plain routes answers as the pattern alone would."""
    full = root + path
    scope = {"type": "http", "method": method, "path": full, "root_path": root}
    match = serving._PROXY_PATH.match(path) if method == "POST" else None
    assert serving.proxy_route(scope) == (None if match is None else (serving._FORMATS[match[2]], match[1]))
