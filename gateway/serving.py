"""The proxy: one agent call, from the client's request to the captured turn. `proxy` parses
the body in the client's wire format (Chat Completions, Completions, OpenAI's Responses,
Anthropic's Messages; the last two translated to Chat Completions upstream by gateway.formats
and back by gateway.replies), resolves the session and the upstream, and hands both to a
`_Call`, which sends it upstream (vLLM for the white-box policy, LiteLLM for any other
provider), relays the reply and hands the record to the capture writer. `serve_proxy` routes
those POSTs here without FastAPI's per-request overhead (gateway.app.GatewayApp calls it first);
gateway.routes.openai declares the same routes for the OpenAPI schema and the session-prefixed
paths."""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, NoReturn

import aiohttp
from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel
from starlette.types import ASGIApp, Receive, Scope, Send

from datapool import queries
from datapool.db import utcnow
from datapool.records import TurnRecord
from base.errors import NextstateError, RequestError
from base.jsonfast import dumps as _dumps
from base.jsonfast import loads
from base.settings import ClientProfile
from base.vocab import Endpoint, TurnStatus, WireFormat
from gateway.auth import accepted_tenant
from gateway.budget import HEADER as BUDGET_HEADER
from gateway.budget import fit as fit_budget
from gateway.classify import Texts, session_of, turn_kind_of
from gateway.clients import recognise
from gateway.errors import CONTEXT_LENGTH_EXCEEDED, from_upstream, openai_error, respond, unavailable, unexpected
from gateway.events import EventStream
from gateway.formats import SENT_ARGUMENTS, load_translators, messages_to_chat, responses_to_chat
from gateway.pool import in_pool
from gateway.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    MessagesRequest,
    ResponsesRequest,
    parse_body,
    read_body,
    receive_body,
)
from gateway.replies import MessagesReply, Reply, ResponsesReply
from gateway.recording import (
    Accumulator,
    ClientWants,
    SSEvent,
    request_record,
    sse_events,
    strip_for_client,
    white_box_body,
)
from gateway.state import Gateway, gateway_of
from gateway.tenants import scoped_session_id
from gateway.upstream import Target


_SCHEMAS: dict[str, type[BaseModel]] = {"chat": ChatCompletionRequest, "completions": CompletionRequest}
_PATHS = {"chat": "/chat/completions", "completions": "/completions"}
# the client's path -> the wire format it speaks; Responses and Messages go upstream as chat
_FORMATS = {"/chat/completions": WireFormat.CHAT, "/completions": WireFormat.COMPLETIONS,
            "/responses": WireFormat.RESPONSES, "/messages": WireFormat.MESSAGES}
_JSON = {"Content-Type": "application/json"}

_PROXY_PATH = re.compile(r"^(?:/s/([^/]+))?/v1(" + "|".join(map(re.escape, _FORMATS)) + ")$")


# the routes without a session in the path, looked up before the pattern is tried
_PLAIN_ROUTES: dict[str, tuple[str, str | None]] = {f"/v1{path}": (fmt, None) for path, fmt in _FORMATS.items()}


def proxy_route(scope: Scope) -> tuple[str, str | None] | None:
    """(wire format, session named in the path) of a POST to a proxy route, else None."""
    if scope["type"] != "http" or scope["method"] != "POST":
        return None
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root):]
    plain = _PLAIN_ROUTES.get(path)
    if plain is not None:
        return plain
    match = _PROXY_PATH.match(path)
    return None if match is None else (_FORMATS[match[2]], match[1])


async def serve_proxy(app: ASGIApp, scope: Scope, receive: Receive, send: Send, route: tuple[str, str | None]) -> None:
    """A POST to a proxy route (:func:`proxy_route`), answered as `proxy` answers it with no layer
    between: the body read from *receive* itself, no Starlette ``Request`` made unless for an
    error's reply.

    Between the server and a handler, FastAPI's application, Starlette's error, telemetry and
    body-limit middlewares, its router and its dependency solving cost a few hundred
    microseconds of CPU per request, a large share of what the gateway adds to every agent call
    (benchmarks/gateway/README.md). The routes stay declared in gateway.routes.openai, so the
    OpenAPI schema, the fuzzers and the route audit see them; requests take this shorter way to
    the same handler, with the same key check and the same errors in the client's dialect. What
    Starlette's ServerErrorMiddleware does for an unexpected exception is done here too: the
    500 of gateway.errors.unexpected if nothing was sent yet, then the exception raised on to
    the server, which logs it."""
    scope["app"] = app
    started = time.perf_counter()
    response: Response | None = None
    try:
        sent = _Headers(scope["headers"])
        gw: Gateway = app.state.gateway  # type: ignore[attr-defined]
        try:
            tenant = await accepted_tenant(gw, sent)
            raw = await receive_body(receive, gw.settings.max_body_bytes, sent)
            response = await _proxied(gw, sent, raw, started, route[0], route[1], tenant)
        except NextstateError as exc:
            response = respond(Request(scope, receive), exc)
        await response(scope, receive, send)
    except Exception as exc:
        if response is None or not getattr(response, "started", True):
            await (await unexpected(Request(scope, receive), exc))(scope, receive, send)
        raise


class _Headers(dict[str, str]):
    """A request's headers, read once: a dict by lowercased name (the first of a repeated one),
    looked up case-insensitively. Starlette's Headers scans and decodes the raw list on every
    lookup, and a request's session keys, side-turn rules and client profiles make dozens."""

    def __init__(self, raw: list[tuple[bytes, bytes]]):
        super().__init__({k.decode("latin-1").lower(): v.decode("latin-1") for k, v in reversed(raw)})

    def get(self, key: str, default: Any = None) -> Any:  # type: ignore[override]
        return dict.get(self, key.lower(), default)

    def __getitem__(self, key: str) -> str:
        return dict.__getitem__(self, key.lower())

    def __contains__(self, key: object) -> bool:
        return dict.__contains__(self, key.lower() if isinstance(key, str) else key)


def _session(gw: Gateway, headers: _Headers, path_session: str | None, body: dict[str, Any],
             client: ClientProfile | None, texts: Texts) -> tuple[str | None, str | None]:
    keys = gw.settings.session_keys
    return session_of(headers, body, path_session, [*client.session_keys, *keys] if client else keys, texts)


def _turn_type(gw: Gateway, headers: _Headers, body: dict[str, Any], client: ClientProfile | None,
               texts: Texts) -> str:
    rules = gw.settings.side_turn_rules
    return turn_kind_of(headers, body, [*client.side_turn_rules, *rules] if client else rules, texts)


async def _history(gw: Gateway, response_id: str | None, tenant: str | None) -> list[dict[str, Any]]:
    """The conversation a Responses `previous_response_id` continues, from the pool (the tenant's own)."""
    if not response_id:
        return []
    found = await in_pool(gw.engine, queries.conversation_through, response_id, tenant)
    if found is None:
        await gw.writer.flushed()  # this replica may have answered it a moment ago
        found = await in_pool(gw.engine, queries.conversation_through, response_id, tenant)
    if found is None:
        raise RequestError(400, f"Previous response with id '{response_id}' not found.",
                          code="previous_response_not_found", param="previous_response_id")
    return found


async def sent_arguments(gw: Gateway, chat: dict[str, Any]) -> dict[str, Any]:
    """*chat* (a translated Messages request) with the model's own arguments text of each tool
    call this replica did not answer itself, from the pool (gateway.formats._SentArguments).
    With the pool down the call is served all the same, with LiteLLM's rendering."""
    missing = SENT_ARGUMENTS.unknown(chat["messages"])
    if missing and gw.writer.last_db_error is None:  # the capture writer knows when the pool is down
        try:
            found = await in_pool(gw.engine, queries.tool_call_arguments, missing)
        except RequestError:  # the pool went down just now: nothing learnt, not even absence
            return chat
        SENT_ARGUMENTS.learn(found, asked=missing)
        if found:
            SENT_ARGUMENTS.restore(chat["messages"])
    return chat


async def proxy(request: Request, fmt: str, path_session: str | None, *, tenant: str | None) -> Response:
    """The reply to a proxied call for the client key's *tenant* (None for none), as FastAPI's
    routes (gateway.routes.openai) call it; `serve_proxy` calls `_proxied` with the body it read."""
    gw = gateway_of(request)
    started = time.perf_counter()
    raw = await read_body(request, gw.settings.max_body_bytes)
    return await _proxied(gw, _Headers(request.scope["headers"]), raw, started, fmt, path_session, tenant)


async def _proxied(gw: Gateway, sent: _Headers, raw: bytes, started: float, fmt: str, path_session: str | None,
                   tenant: str | None) -> Response:
    """The reply to the call of body *raw* with headers *sent* (`proxy`), begun at *started*
    (``time.perf_counter``)."""
    reply: Reply | None = None
    if fmt in (WireFormat.RESPONSES, WireFormat.MESSAGES):
        await load_translators()
    if fmt == WireFormat.RESPONSES:
        asked = parse_body(raw, ResponsesRequest)
        body = responses_to_chat(asked, await _history(gw, asked.get("previous_response_id"), tenant))
        reply = ResponsesReply(asked["model"], asked)
    elif fmt == WireFormat.MESSAGES:
        asked = parse_body(raw, MessagesRequest)
        body = await sent_arguments(gw, messages_to_chat(asked))
        reply = MessagesReply(asked["model"], asked)
    else:
        body = parse_body(raw, _SCHEMAS[fmt])
    endpoint = Endpoint.COMPLETIONS if fmt == WireFormat.COMPLETIONS else Endpoint.CHAT
    texts = Texts(body.get("messages"))  # what the client, session and side-turn rules read, found once
    client = recognise(gw.client_profiles, sent, body, fmt, texts)
    session_id, source = _session(gw, sent, path_session, body, client, texts)
    session_id = scoped_session_id(tenant, session_id)  # a tenant's sessions are its own
    turn_type = _turn_type(gw, sent, body, client, texts)
    target = await gw.upstreams.resolve(body["model"])
    record = TurnRecord(
        id=uuid.uuid4().hex,
        created_at=utcnow(),
        endpoint=endpoint,
        status=TurnStatus.OK,
        model=body["model"],
        capture="white-box" if target.white_box else "black-box",
        request=request_record(endpoint, body),
        session_id=session_id,
        session_source=source,
        task_id=sent.get("x-task-id"),
        group_id=sent.get("x-group-id"),
        turn_type=turn_type,
        session_done=sent.get("x-session-done", "").strip().lower() in ("1", "true", "yes"),
        upstream_model=target.served_name,
        policy_version=target.policy_version,
        wire_format=fmt,
        tenant=tenant,
        client=client.name if client else None,
    )
    if reply is not None and asked.get("previous_response_id"):
        record.request["params"]["previous_response_id"] = asked["previous_response_id"]
    headers = {"X-Turn-Id": record.id}
    if session_id:
        headers["X-Session-Id"] = session_id
    if target.white_box and target.api_base and (gw.settings.fit_output_budget or gw.settings.default_output_budget):
        budget = await fit_budget(gw.http, body, api_base=target.api_base, served_name=target.served_name,
                                  api_key=target.api_key, default=gw.settings.default_output_budget or None,
                                  fit=gw.settings.fit_output_budget, share=gw.settings.fit_output_share)
        if budget is not None:
            record.request["output_budget"] = budget.record()
            headers[BUDGET_HEADER] = budget.header()
    call = _Call(gw, endpoint, body, target, record, started, headers, reply, len(raw))
    if target.white_box:
        return await call.vllm()
    return await call.litellm()


@dataclass(eq=False)
class _Call:
    """One proxied call: sends it upstream, relays the reply, hands the record to capture."""

    gw: Gateway
    endpoint: str
    body: dict[str, Any]
    target: Target
    record: TurnRecord
    started: float
    headers: dict[str, str]
    # a Responses or Messages reply: translated back from chat, stored under the client's id
    reply: Reply | None = None
    request_bytes: int = 0  # the request's size as sent: what its turn holds in the writer's queue

    def __post_init__(self) -> None:
        self.stream = bool(self.body.get("stream"))
        self.acc = Accumulator(self.endpoint, self.target.white_box)
        self.label = self.record.wire_format or self.endpoint
        if self.reply is not None:
            self.acc.id = self.reply.id

    # -- finishing --------------------------------------------------------------------------

    def _finish(self, status_code: int, *, status: str = "ok", error: dict[str, Any] | None = None,
                captured: bool = True) -> None:
        elapsed = time.perf_counter() - self.started
        self.gw.metrics.observe(self.gw.metrics.request_seconds, elapsed, self.label, str(status_code))
        r = self.record
        r.status = status
        r.error = error
        r.latency_ms = round(elapsed * 1000, 3)
        if captured and (self.acc.choices or status == TurnStatus.OK):
            c = self.acc.result()
            r.response, r.usage = c.response, c.usage
            r.prompt_token_ids, r.token_ids, r.logprobs = c.prompt_token_ids, c.token_ids, c.logprobs
        self.gw.writer.submit(r, self.request_bytes)

    def _fail(self, status_code: int, message: str, *, code: str | None = None,
              upstream: Any = None, error: RequestError | None = None) -> RequestError:
        """Record the call as an error turn; returns the error to answer with, which carries the
        turn's id (X-Turn-Id) like every reply whose call was recorded."""
        err = error or RequestError(status_code, message, code=code)
        err.headers.update(self.headers)
        detail = openai_error(err) | {"status": err.status}
        if upstream is not None:
            detail["upstream"] = upstream
        self._finish(err.status, status=TurnStatus.ERROR, error=detail, captured=False)
        return err

    def _observe_upstream(self) -> None:
        metrics = self.gw.metrics
        metrics.observe(metrics.upstream_seconds, time.perf_counter() - self.started, self.target.group)

    # -- vLLM: OpenAI wire format, relayed as sent ---------------------------------------------

    async def vllm(self) -> Response:
        resp = await self._post()
        t = self.target  # the replica that took it (_post)
        self._observe_upstream()
        if resp.status >= 400:
            await self._upstream_error(resp)
        wants = ClientWants.of(self.endpoint, self.body)
        if self.stream:
            return self._streamed(sse_events(resp.content.iter_any()), wants, (TimeoutError, aiohttp.ClientError),
                                  resp)
        try:
            raw = await resp.read()
        except TimeoutError as exc:
            raise self._fail(504, f"upstream {t.group} timed out mid-response") from exc
        except aiohttp.ClientError as exc:
            raise self._fail(502, f"upstream {t.group} failed mid-response: {exc}") from exc
        finally:
            resp.release()
        try:
            obj = loads(raw)
        except ValueError as exc:
            raise self._fail(502, f"upstream {t.group} sent invalid JSON") from exc
        self.acc.feed(obj)
        self._finish(resp.status)
        if self.reply is not None:
            return _Whole(_dumps(self.reply.whole(obj)), resp.status, self.headers)
        if not wants.everything:
            strip_for_client(obj, wants)
            raw = _dumps(obj)
        return _Whole(raw, resp.status, self.headers)

    async def _post(self, *, failover: bool = True) -> aiohttp.ClientResponse:
        """The call sent to the target's vLLM. A server that refuses the connection (it died or is
        restarting) is marked down; one that refuses, resets or drops it before any answer has the
        call sent to another replica of the model group where there is one (a completion has no
        effect beyond its answer, and none came). Otherwise the client is told when to come back
        (503 + Retry-After)."""
        t = self.target
        url = f"{t.api_base}{_PATHS[self.endpoint]}"
        auth = {"Authorization": f"Bearer {t.api_key}"} if t.api_key else {}
        data = _dumps(white_box_body(self.endpoint, self.body, t.served_name))
        watch = self.gw.vllm_watch
        try:
            if watch is not None:
                watch.refuse(t.api_base, t.served_name, t.group)
        except RequestError as err:
            raise self._fail(err.status, err.message, error=err) from None
        try:
            return await self.gw.http.post(url, data=data, headers={**auth, **_JSON})
        except TimeoutError as exc:
            raise self._fail(504, f"upstream {t.group} timed out: {type(exc).__name__}") from exc
        except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError) as exc:  # refused, reset, dropped
            if watch is not None and isinstance(exc, aiohttp.ClientConnectorError):
                watch.mark_down(t.api_base)
            # no answer came: whatever the server got died with it (a completion has no other effect)
            if failover and (other := await self._another_replica()) is not None:
                self.target = other
                self.record.upstream_model, self.record.policy_version = other.served_name, other.policy_version
                return await self._post(failover=False)
            err = unavailable(t.group, f"is unreachable ({type(exc).__name__})")
            raise self._fail(err.status, err.message, error=err) from exc
        except aiohttp.ClientError as exc:
            raise self._fail(502, f"upstream {t.group} unreachable: {type(exc).__name__}: {exc}") from exc

    async def _another_replica(self) -> Target | None:
        """Another vLLM of the target's model group, one the watch does not see down, or None
        (a group of one)."""
        try:
            other = await self.gw.upstreams.resolve(self.record.model, avoid=self.target.api_base)
        except RequestError:
            return None
        return other if other.white_box and other.api_base != self.target.api_base else None

    async def _upstream_error(self, resp: aiohttp.ClientResponse) -> NoReturn:
        try:
            raw = await resp.read()
        except (TimeoutError, aiohttp.ClientError):
            raw = b""
        finally:
            resp.release()
        try:
            upstream = loads(raw)
        except ValueError:
            upstream = raw.decode(errors="replace")[:2000]
        fallback = f"upstream {self.target.group} answered HTTP {resp.status}"
        active = self.gw.upstreams.active_version
        if (resp.status == 404 and self.gw.vllm_watch is not None and active is not None and not active.full
                and self.target.served_name == active.name):
            # a restarted vLLM that has not got the active version yet: the watch loads it
            self.gw.vllm_watch.mark_loading(self.target.api_base)
            err = unavailable(self.target.group, f"restarted and is loading the active version {active.name}")
            raise self._fail(err.status, err.message, upstream=upstream, error=err)
        # a 4xx is about the request: its status and message go back in OpenAI's shape (a prompt
        # over the context window as `context_length_exceeded`); a 5xx is the upstream's failure
        if resp.status < 500:
            err = from_upstream(resp.status, upstream, fallback,
                                prompt_param="messages" if self.endpoint == "chat" else "prompt")
        else:
            err = from_upstream(502, upstream, fallback)
            err.code = err.param = None
        # a Responses or Messages client gets it in its own dialect (the context overflow as
        # Anthropic words it on /v1/messages): gateway.errors renders it
        raise self._fail(err.status, err.message, upstream=upstream, error=err)

    def _streamed(self, arrivals: AsyncIterator[list[SSEvent]], wants: ClientWants,
                  failures: tuple[type[Exception], ...], resp: aiohttp.ClientResponse | None = None) -> Response:
        """The client's stream of the upstream's chat events (see _relay)."""
        events = _AsSent(self.acc, wants) if self.reply is None else _Translated(self.acc, self.reply)
        return EventStream(self._relay(arrivals, events, failures, resp),
                           status_code=resp.status if resp is not None else 200,
                           headers={**self.headers, "Cache-Control": "no-cache"})

    async def _relay(self, arrivals: AsyncIterator[list[SSEvent]], events: _Events,
                     failures: tuple[type[Exception], ...], resp: aiohttp.ClientResponse | None,
                     ) -> AsyncIterator[bytes]:
        """The upstream's chat stream to the client, event by event in the client's wire format;
        the turn is recorded once the stream ends, fails (one of *failures*) or the client hangs
        up. *resp*: vLLM's response, whose connection is reused or closed at the end."""
        status, error = "ok", None
        ended = False  # the upstream's reply read to its end: its connection can be reused
        try:
            async for arrived in arrivals:
                # the events that arrived together leave together: one write
                out = [b for raw, data in arrived for b in events.event(raw, data)]
                if out:
                    yield b"".join(out)
            ended = True
            if not events.done and events.error is None:
                events.done = True
                if closing := events.close():
                    yield b"".join(closing)
        except failures as exc:
            status = "error"
            reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            err = RequestError(502, f"upstream {self.target.group} failed mid-stream: {reason}")
            error = openai_error(err)
            yield events.error_event(err)
        except (asyncio.CancelledError, GeneratorExit):
            # a chat client that hangs up once each of its n choices has its finish reason got the
            # whole reply, though not the usage or [DONE] behind it (an agent acting on a tool call
            # at once); a completions request may hold several prompts, so there only [DONE] tells
            whole = self.endpoint == Endpoint.CHAT and self.acc.finished(int(self.body.get("n") or 1))
            if not events.done and not whole:
                status, error = "cancelled", {"message": "client disconnected", "type": "cancelled"}
            raise
        finally:
            if resp is not None and ended:
                resp.release()
            elif resp is not None:
                resp.close()  # closing the connection is what cancels the request upstream
            if status == "ok" and events.error is not None:
                status, error = "error", events.error
            self._finish(200, status=status, error=error)

    # -- other providers: through the LiteLLM Router ---------------------------------------------

    async def litellm(self) -> Response:
        import litellm  # imported with the Router that reaches this provider (gateway.upstream)

        router = self.gw.upstreams.router
        assert router is not None
        params = {k: v for k, v in self.body.items() if k != "model"}
        call = router.acompletion if self.endpoint == "chat" else router.atext_completion
        try:
            result = await call(model=self.target.group, **params)
        except litellm.Timeout as exc:
            raise self._fail(504, f"upstream {self.target.group} timed out: {exc}") from exc
        except litellm.APIConnectionError as exc:
            raise self._fail(502, f"upstream {self.target.group} unreachable: {type(exc).__name__}: {exc}") from exc
        except litellm.ContextWindowExceededError as exc:
            raise self._fail(400, f"upstream {self.target.group}: {exc}", error=RequestError(
                400, f"upstream {self.target.group}: {exc}", code=CONTEXT_LENGTH_EXCEEDED,
                param="messages" if self.endpoint == "chat" else "prompt")) from exc
        except Exception as exc:  # LiteLLM's exceptions carry the provider's status
            status = getattr(exc, "status_code", None) or 502
            raise self._fail(status if status in (400, 404, 422, 429) else 502,
                             f"upstream {self.target.group}: {exc}") from exc
        self._observe_upstream()
        if not self.stream:
            obj = result.model_dump(mode="json", exclude_none=True)
            self.acc.feed(obj)
            self._finish(200)
            return _Whole(_dumps(obj if self.reply is None else self.reply.whole(obj)), 200, self.headers)
        # LiteLLM's exceptions from a provider's stream are many; each is the upstream's failure
        return self._streamed(_litellm_events(result), ClientWants(logprobs=True, token_ids=True), (Exception,))


class _Whole(Response):
    """A whole JSON reply: the status, headers and body Starlette's ``Response(body,
    media_type="application/json", headers=...)`` sends, as the two ASGI messages, without its
    rendering and header steps (a reply's headers here are the gateway's own: never a
    content-length or content-type of their own)."""

    def __init__(self, body: bytes, status_code: int, headers: dict[str, str]):
        self.status_code = status_code
        self.background = None
        self.body = body
        self.raw_headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
        self.raw_headers += ((b"content-length", str(len(body)).encode()), _JSON_TYPE)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        await send({"type": "http.response.body", "body": self.body})


_JSON_TYPE = (b"content-type", b"application/json")


async def _litellm_events(chunks: Any) -> AsyncIterator[list[SSEvent]]:
    """LiteLLM's stream of chunks as the Chat Completions events vLLM would send, one at a time,
    each already parsed: its event's bytes are written once, by the relay, from the object."""
    async for chunk in chunks:
        yield [(b"", chunk.model_dump(mode="json", exclude_none=True))]
    yield [(b"data: [DONE]\n\n", b"[DONE]")]


class _Events:
    """How the events of the upstream's chat stream reach the client (_Call._relay): each upstream event
    fed to the accumulator and turned into the client's bytes."""

    def __init__(self, acc: Accumulator):
        self.acc = acc
        self.done = False  # the reply's end was relayed: complete, whatever the client does next
        self.error: dict[str, Any] | None = None  # an error the upstream reported in the stream

    def event(self, raw: bytes, data: bytes | dict[str, Any] | None) -> list[bytes]:
        """The client's bytes for one upstream event: *raw* as it arrived and its data, as bytes
        or, from a stream LiteLLM parsed already, as the object (its *raw* then empty)."""
        raise NotImplementedError

    def close(self) -> list[bytes]:
        """The closing events when the upstream's stream ended without ``[DONE]``."""
        return []

    def error_event(self, err: RequestError) -> bytes:
        return b"data: " + _dumps({"error": openai_error(err)}) + b"\n\n"


class _AsSent(_Events):
    """Chat Completions or Completions: the events as vLLM sent them, less the fields the client
    did not ask for (ClientWants)."""

    def __init__(self, acc: Accumulator, wants: ClientWants):
        super().__init__(acc)
        self.wants = wants

    def event(self, raw: bytes, data: bytes | dict[str, Any] | None) -> list[bytes]:
        if data is None or data == b"[DONE]":
            self.done = self.done or data == b"[DONE]"
            return [raw]
        if isinstance(data, dict):
            obj = data
            self.acc.feed(obj)
        else:
            try:
                obj = loads(data)
            except ValueError:
                return [raw]
            if not isinstance(obj, dict):
                return [raw]
            self.acc.feed(obj)
            if self.wants.everything:
                return [raw]
        strip_for_client(obj, self.wants)
        return [b"data: " + _dumps(obj) + b"\n\n"]


class _Translated(_Events):
    """Responses or Messages: each chat event translated into the client's events (Reply)."""

    def __init__(self, acc: Accumulator, reply: Reply):
        super().__init__(acc)
        self.reply = reply

    def event(self, raw: bytes, data: bytes | dict[str, Any] | None) -> list[bytes]:
        if data is None:
            return []
        if data == b"[DONE]":
            self.done = True
            return self.reply.end()
        try:
            obj = data if isinstance(data, dict) else loads(data)
        except ValueError:
            return []
        if not isinstance(obj, dict):
            return []
        if isinstance(obj.get("error"), dict) and not obj.get("choices"):
            err = RequestError(502, str(obj["error"].get("message") or "upstream error"))
            self.error = openai_error(err)
            return [self.reply.error_event(err)]
        self.acc.feed(obj)
        return self.reply.chunk(obj)

    def close(self) -> list[bytes]:
        return self.reply.end()

    def error_event(self, err: RequestError) -> bytes:
        return self.reply.error_event(err)
