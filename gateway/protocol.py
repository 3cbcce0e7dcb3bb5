"""The OpenAI wire format the gateway checks before forwarding.

Only what the gateway relies on is validated; every other field passes through untouched
(``extra="allow"``), so new upstream parameters work without a gateway release.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gateway.errors import OpenAIError

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


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    prompt: str | list[str] | list[int] | list[list[int]]
    stream: bool = False
    n: int = Field(default=1, ge=1, le=128)
    logprobs: int | None = None


def parse_body(raw: bytes, schema: type[BaseModel]) -> dict[str, Any]:
    """Decode and check a request body; returns the JSON object as the client sent it."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise OpenAIError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from exc
    if not isinstance(body, dict):
        raise OpenAIError(400, "request body must be a JSON object", code="invalid_request")
    try:
        schema.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise OpenAIError(
            400, f"invalid request: {where}: {first['msg']}", code="invalid_request", param=where or None
        ) from exc
    bad = CONTROL_PARAMS.intersection(body)
    if bad:
        raise OpenAIError(
            400, f"parameter not allowed through the gateway: {', '.join(sorted(bad))}", param=min(bad)
        )
    return body
