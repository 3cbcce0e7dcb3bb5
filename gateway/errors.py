"""Errors in the client's dialect: OpenAI's ``{"error": {...}}`` body with a fitting status."""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from base.errors import NextstateError

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "timeout_error",
}


log = logging.getLogger("nextstate.gateway")

# path prefix -> renderer of errors as pages of their own (the admin UI registers one):
# page(request, status, message, request_id); request_id only for an unexpected error
ErrorPage = Callable[[Request, int, str, "str | None"], Response]


def _page_for(request: Request) -> ErrorPage | None:
    for prefix, page in getattr(request.app.state, "error_pages", {}).items():
        if request.url.path.startswith(prefix):
            return page
    return None


class OpenAIError(Exception):
    """Raised anywhere in a request; rendered as an OpenAI-shaped error response."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        type: str | None = None,
        headers: Mapping[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.type = type or _TYPES.get(status) or ("invalid_request_error" if 400 <= status < 500 else "api_error")
        self.headers = dict(headers or {})  # e.g. X-Turn-Id when the failed call was recorded as a turn

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        headers = dict(self.headers)
        if self.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        return JSONResponse(self.body(), status_code=self.status, headers=headers or None)


#: seconds a client is told to wait (Retry-After) while its vLLM upstream is down or reloading
RETRY_AFTER_S = 2


def unavailable(upstream: str, why: str) -> OpenAIError:
    """503 with Retry-After: the upstream is down or restarting, the client should come back."""
    return OpenAIError(503, f"upstream {upstream} {why}; try again in {RETRY_AFTER_S} s", code="upstream_unavailable",
                       headers={"Retry-After": str(RETRY_AFTER_S)})


CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # OpenAI's code for a request over the model's context
# How vLLM (and most OpenAI-compatible servers) word it: "This model's maximum context length is
# 8192 tokens. However, your prompt contains 9000 input tokens ..." / "Input length (9000) exceeds
# model's maximum context length (8192)."
_CONTEXT_RE = re.compile(r"maximum context length|context length exceeded|context window|"
                         r"prompt is too long|too many (?:input )?tokens", re.IGNORECASE)


def is_context_overflow(message: str) -> bool:
    return bool(_CONTEXT_RE.search(message))


def from_upstream(status: int, upstream: Any, fallback: str, *, prompt_param: str = "messages",
                  headers: Mapping[str, str] | None = None) -> OpenAIError:
    """An upstream's 4xx error in OpenAI's own shape, whatever dialect the upstream spoke.

    vLLM answers ``{"error": {"type": "BadRequestError", "code": 400, ...}}``; OpenAI's SDKs and
    the agents built on them look for ``invalid_request_error`` and, for a prompt over the
    context window, ``code: context_length_exceeded`` with ``param: messages`` (what agents
    compact their history on). The message is kept as the upstream wrote it."""
    err = upstream.get("error") if isinstance(upstream, dict) else None
    message = (err.get("message") if isinstance(err, dict) else None) or fallback
    if not isinstance(message, str):
        message = str(message)
    code = err.get("code") if isinstance(err, dict) else None
    param = err.get("param") if isinstance(err, dict) else None
    if status == 400 and is_context_overflow(message):
        return OpenAIError(400, message, code=CONTEXT_LENGTH_EXCEEDED, param=prompt_param, headers=headers)
    return OpenAIError(status, message, code=code if isinstance(code, str) else None,
                       param=param if isinstance(param, str) else None, headers=headers)


def install(app: FastAPI) -> None:
    def respond(request: Request, exc: OpenAIError) -> Response:
        page = _page_for(request)
        return page(request, exc.status, exc.message, None) if page else exc.response()

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError) -> Response:
        return respond(request, exc)

    @app.exception_handler(NextstateError)
    async def _domain_error(request: Request, exc: NextstateError) -> Response:
        """A layer's own error, answered with the status and code its class names
        (base.errors); one that is not the client's fault (500) is logged."""
        if exc.status >= 500:
            log.error("%s on %s %s: %s", type(exc).__name__, request.method, request.url.path, exc)
        return respond(request, OpenAIError(exc.status, str(exc), code=exc.code, param=exc.param))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> Response:
        return respond(request, OpenAIError(400, _describe(exc.errors()), code="invalid_request"))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        return respond(request, OpenAIError(exc.status_code, str(exc.detail)))

    app.state.error_pages = {}

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        """A bug: logged with a request id that the answer repeats (never the traceback), as a
        page where one is registered for the path (``error_page``), else OpenAI-shaped JSON."""
        request_id = uuid.uuid4().hex[:16]
        log.error("unexpected error, request id %s: %s %s", request_id, request.method, request.url.path,
                  exc_info=exc)
        page = _page_for(request)
        message = f"internal error (request id {request_id})"
        response = (page(request, 500, message, request_id) if page
                    else OpenAIError(500, message, code="internal_error").response())
        response.headers["X-Request-Id"] = request_id
        return response


def error_page(app: FastAPI, prefix: str, page: ErrorPage) -> None:
    """Render errors under *prefix* with *page* rather than as JSON."""
    app.state.error_pages[prefix] = page


def _describe(errors: Any) -> str:
    parts = []
    for e in errors:
        where = ".".join(str(p) for p in e.get("loc", ()) if p != "body")
        parts.append(f"{where}: {e.get('msg')}" if where else str(e.get("msg")))
    return "invalid request: " + "; ".join(parts)
