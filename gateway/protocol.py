"""The OpenAI wire format the gateway checks before forwarding.

Only what the gateway relies on is validated; every other field passes through untouched
(``extra="allow"``), so new upstream parameters work without a gateway release.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any, Literal, TypeVar

from fastapi import Request
from starlette.requests import ClientDisconnect
from starlette.types import Receive
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from base.vocab import EndReason, SessionMode
from base.jsonfast import loads
from base.errors import RequestError

#: a session id the client may name (header, /s/{id} path, PUT /api/sessions/{id}): no "..", no leading dot
SESSION_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:\-]{0,127}$")

# Parameters that steer LiteLLM itself (where to send the call, with which key). A client must
# not set them: they would redirect the gateway's upstream call or leak into the pool.
CONTROL_PARAMS = frozenset(
    {
        "api_key",
        "api_base",
        "base_url",
        "api_version",
        "custom_llm_provider",
        "litellm_params",
        "extra_headers",
        "metadata_api_key",
        "aws_access_key_id",
        "aws_secret_access_key",
        "vertex_credentials",
    }
)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    messages: list[ChatMessage] = Field(min_length=1)
    stream: bool = False
    n: int = Field(default=1, ge=1, le=128)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    logprobs: bool | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    prompt: str | list[str] | list[int] | list[list[int]]
    stream: bool = False
    n: int = Field(default=1, ge=1, le=128)
    logprobs: int | None = None
    max_tokens: int | None = Field(default=None, ge=1)


class ResponsesRequest(BaseModel):
    """`POST /v1/responses` (OpenAI Responses API)."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    input: str | list[dict[str, Any]]
    instructions: str | list[dict[str, Any]] | None = None
    previous_response_id: str | None = Field(default=None, min_length=1, max_length=256)
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    metadata: dict[str, str] | None = None


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    # "system" mid-conversation: what Claude Code sends with Anthropic's
    # mid-conversation-tool-changes beta (LiteLLM's adapter passes it on as a marked user note)
    role: Literal["user", "assistant", "system"]
    content: str | list[dict[str, Any]]


class MessagesRequest(BaseModel):
    """`POST /v1/messages` (Anthropic Messages API): `max_tokens` is required, as there."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    messages: list[AnthropicMessage] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    system: str | list[dict[str, Any]] | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    stop_sequences: list[str] | None = None
    metadata: dict[str, Any] | None = None


class CountTokensRequest(BaseModel):
    """`POST /v1/messages/count_tokens`: a Messages request without `max_tokens`."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None


def parse_body(raw: bytes, schema: type[BaseModel], *, invalid_status: int = 400) -> dict[str, Any]:
    """Decode and check a request body; returns the JSON object as the client sent it.
    Malformed JSON is a 400; a body that breaks the schema gets ``invalid_status``."""
    try:
        body = loads(raw, parse_constant=_no_constant)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RequestError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from exc
    except RecursionError as exc:
        raise RequestError(400, "request body is nested too deeply", code="invalid_json") from exc
    if not isinstance(body, dict):
        raise RequestError(400, "request body must be a JSON object", code="invalid_request")
    if b"\\ud" in raw or b"\\uD" in raw:
        _no_lone_surrogates(body)
    try:
        schema.model_validate(body)
    except RecursionError as exc:
        raise RequestError(400, "request body is nested too deeply", code="invalid_json") from exc
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise RequestError(
            invalid_status, f"invalid request: {where + ': ' if where else ''}{first['msg']}",
            code="invalid_request", param=where or None,
        ) from exc
    bad = CONTROL_PARAMS.intersection(body)
    if bad:
        raise RequestError(
            400, f"parameter not allowed through the gateway: {', '.join(sorted(bad))}", param=min(bad)
        )
    return body


def _no_constant(name: str) -> Any:
    # NaN and Infinity are not JSON: neither the upstream nor the pool (jsonb) would take them
    raise RequestError(400, f"request body is not valid JSON: {name} is not a JSON number", code="invalid_json")


def _no_lone_surrogates(body: Any) -> None:
    """A \\ud800-style escape alone decodes to a string no UTF-8 encoder takes: refuse it here
    rather than fail upstream or in the pool. Only run when the raw body has such an escape."""
    try:
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        raise RequestError(400, "request body has an unpaired UTF-16 surrogate escape", code="invalid_json") from exc


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 once it passes ``limit`` bytes (declared or streamed)."""
    _check_declared(request.headers.get("content-length"), limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


async def receive_body(receive: Receive, limit: int, headers: Mapping[str, str]) -> bytes:
    """:func:`read_body` of a request no Starlette ``Request`` was made for: its ASGI messages
    read as ``Request.stream`` reads them (a hang-up raises its ClientDisconnect); *headers*: the
    request's, looked up case-insensitively."""
    _check_declared(headers.get("content-length"), limit)
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.request":
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)
        elif message["type"] == "http.disconnect":
            raise ClientDisconnect()


def _check_declared(declared: str | None, limit: int) -> None:
    if declared and declared.isdigit() and int(declared) > limit:
        raise RequestError(413, f"request body of {declared} bytes exceeds the limit of {limit} bytes",
                          code="request_too_large")


def _too_large(limit: int) -> RequestError:
    return RequestError(413, f"request body exceeds the limit of {limit} bytes", code="request_too_large")


class FeedbackRequest(BaseModel):
    """A person's verdict on a reply, named by the response `id` the client got or by turn id."""

    model_config = ConfigDict(extra="forbid")

    response_id: str | None = Field(default=None, min_length=1, max_length=256)
    turn_id: str | None = Field(default=None, min_length=1, max_length=64)
    rating: Literal["up", "down", 1, -1] | None = None
    text: str | None = Field(default=None, min_length=1, max_length=4000)

    @model_validator(mode="after")
    def _one_target_and_something_to_say(self) -> "FeedbackRequest":
        if (self.response_id is None) == (self.turn_id is None):
            raise ValueError("give exactly one of response_id and turn_id")
        if self.rating is None and self.text is None:
            raise ValueError("give a rating (up/down) or text, or both")
        return self

    @property
    def value(self) -> int | None:
        return {"up": 1, "down": -1, 1: 1, -1: -1}.get(self.rating) if self.rating is not None else None


class OutcomeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    outcome: float = Field(allow_inf_nan=False)
    source: str | None = Field(default=None, max_length=256)

    @field_validator("outcome", mode="before")
    @classmethod
    def _number(cls, value: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError("outcome must be a number")
        return value


class SessionTags(BaseModel):
    """What a rollout runner declares about a session before its agent runs (`PUT /api/sessions/{id}`)."""

    model_config = ConfigDict(extra="forbid")

    mode: SessionMode = SessionMode.OFFLINE
    task_id: str | None = Field(default=None, min_length=1, max_length=256)
    group_id: str | None = Field(default=None, min_length=1, max_length=256)
    metadata: dict[str, Any] = Field(default_factory=dict)


class SessionUpdate(BaseModel):
    """`PATCH /api/sessions/{id}`: why it ended, metadata to merge, and whether it has ended."""

    model_config = ConfigDict(extra="forbid")

    end_reason: EndReason | None = None
    metadata: dict[str, Any] | None = None
    end: bool = False


M = TypeVar("M", bound=BaseModel)


async def read_model(request: Request, model: type[M], max_bytes: int, *, invalid_status: int = 422) -> M:
    """The body as *model*: read within *max_bytes* (413), parsed (400), validated (*invalid_status*)."""
    raw = await read_body(request, max_bytes)
    return model.model_validate(parse_body(raw, model, invalid_status=invalid_status))
