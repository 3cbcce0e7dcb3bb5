"""The proxy routes: Chat Completions and Completions, OpenAI's Responses API and Anthropic's
Messages API, each also mounted under ``/s/{session_id}`` so a base_url can carry the session;
the models list, a stored Response, and Anthropic's token count. The proxy itself, one call
from request to captured turn, is gateway.serving."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from base.errors import CallError, RequestError
from datapool import queries
from base.vocab import WireFormat
from gateway.auth import require_api_key, tenant_of
from gateway.formats import messages_to_chat
from gateway.replies import responses_object
from gateway.pool import in_pool
from gateway.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    CountTokensRequest,
    MessagesRequest,
    ResponsesRequest,
    parse_body,
    read_body,
)
from gateway.serving import proxy, sent_arguments
from gateway.state import gateway_of
from gateway.upstream import POLICY_ALIAS
from vllm_client.tokenizer import tokenize

router = APIRouter()

_Handler = Callable[..., Awaitable[Any]]


def _inline(schema: dict[str, Any]) -> dict[str, Any]:
    """A pydantic JSON schema with its $defs inlined (the models here are not recursive)."""
    defs = schema.pop("$defs", {})

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return walk(dict(defs[ref.removeprefix("#/$defs/")]))
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    return walk(schema)


def body_schema(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` documenting a body the route reads itself (raw, size-limited, unknown
    fields passed through), so the OpenAPI schema and fuzzers know its shape."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": _inline(model.model_json_schema())}}}}


SESSION_PREFIX = "/s/{session_id}"
_KEYED = [Depends(require_api_key)]


def proxy_route(method: str, path: str, *, body: type[BaseModel] | None = None,
                ) -> Callable[[_Handler], _Handler]:
    """Registers a handler at *path* and again under ``/s/{session_id}`` (the session carried in
    the base_url), so no proxy route exists at one of the two, behind the API key check; *body*:
    the request body the handler reads itself, documented in the OpenAPI schema."""
    def register(handler: _Handler) -> _Handler:
        for full in (path, SESSION_PREFIX + path):
            router.add_api_route(full, handler, methods=[method], dependencies=_KEYED,
                                 openapi_extra=body_schema(body) if body is not None else None)
        return handler

    return register


@proxy_route("GET", "/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    gw = gateway_of(request)
    groups = await gw.upstreams.groups()
    now = int(time.time())
    data = [{"id": g, "object": "model", "created": now, "owned_by": "nextstate"} for g in groups]
    policy = gw.upstreams.policy_model
    if policy is not None:
        active = gw.upstreams.active_version
        data.append(
            {
                "id": POLICY_ALIAS,
                "object": "model",
                "created": now,
                "owned_by": "nextstate",
                "root": active.name if active else policy,
                "parent": policy,
            }
        )
    return {"object": "list", "data": data}


@proxy_route("POST", "/v1/chat/completions", body=ChatCompletionRequest)
async def chat_completions(request: Request, session_id: str | None = None) -> Response:
    return await proxy(request, WireFormat.CHAT, session_id, tenant=tenant_of(request))


@proxy_route("POST", "/v1/completions", body=CompletionRequest)
async def completions(request: Request, session_id: str | None = None) -> Response:
    return await proxy(request, WireFormat.COMPLETIONS, session_id, tenant=tenant_of(request))


@proxy_route("POST", "/v1/responses", body=ResponsesRequest)
async def responses(request: Request, session_id: str | None = None) -> Response:
    """OpenAI's Responses API (what the OpenAI Agents SDK and Codex speak)."""
    return await proxy(request, WireFormat.RESPONSES, session_id, tenant=tenant_of(request))


@proxy_route("POST", "/v1/messages", body=MessagesRequest)
async def messages(request: Request, session_id: str | None = None) -> Response:
    """Anthropic's Messages API (what Anthropic's SDKs and Claude Code speak)."""
    return await proxy(request, WireFormat.MESSAGES, session_id, tenant=tenant_of(request))


@proxy_route("GET", "/v1/responses/{response_id}")
async def get_response(request: Request, response_id: str, session_id: str | None = None) -> dict[str, Any]:
    """A stored Response, read back from the pool (any replica answers it)."""
    gw = gateway_of(request)
    t = await in_pool(gw.engine, queries.turn_by_response_id, response_id, tenant_of(request))
    if t is None or t.response is None:
        raise RequestError(404, f"Response with id '{response_id}' not found.", param="response_id")
    usage = t.usage or {}
    request_echo = {k: v for k, v in (t.request.get("params") or {}).items()
                    if k in ("previous_response_id", "metadata", "temperature", "top_p", "user")}
    return responses_object(t.response, request_echo, t.model, int(usage.get("prompt_tokens") or 0),
                            int(usage.get("completion_tokens") or 0), int(t.created_at.timestamp()))


@proxy_route("POST", "/v1/messages/count_tokens", body=CountTokensRequest)
async def count_tokens(request: Request, session_id: str | None = None) -> Response:
    """Anthropic's token count: vLLM's own /tokenize of the translated chat (exact), or
    LiteLLM's estimate for other providers. Nothing is stored."""
    gw = gateway_of(request)
    body = parse_body(await read_body(request, gw.settings.max_body_bytes), CountTokensRequest)
    chat = await sent_arguments(gw, messages_to_chat({**body, "max_tokens": 1}))
    target = await gw.upstreams.resolve(body["model"])
    if not target.white_box:
        import litellm  # imported by the Router that reaches this provider already

        return JSONResponse({"input_tokens": litellm.token_counter(model=target.served_name,
                                                                   messages=chat["messages"])})
    try:
        found = await tokenize(gw.http, target.api_base or "", target.served_name,
                                          messages=chat["messages"], tools=chat.get("tools"), api_key=target.api_key)
    except CallError as exc:
        if exc.status_code is None and exc.__cause__ is not None:
            raise RequestError(502, f"upstream {target.group} unreachable: {type(exc.__cause__).__name__}") from exc
        if exc.status_code is None:
            raise RequestError(502, f"upstream {target.group} gave no token count: {exc.detail[:500]}") from exc
        raise RequestError(exc.status_code if exc.status_code < 500 else 502, exc.detail[:2000]) from exc
    return JSONResponse({"input_tokens": found.count})
