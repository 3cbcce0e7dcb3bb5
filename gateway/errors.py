"""Errors on the wire: every error a request meets is answered here, once, in the client's dialect.

The errors themselves, with the status and code each one means, are ``base.errors``; this
module only writes them out:

- OpenAI's ``{"error": {"message", "type", "param", "code"}}`` on the OpenAI surfaces
  (``/v1/chat/completions``, ``/v1/completions``, ``/v1/responses``) and the JSON API;
- Anthropic's ``{"type": "error", "error": {"type", "message"}}`` under ``/v1/messages``
  (``count_tokens`` included), an upstream failure as ``529 overloaded_error`` as Anthropic's
  own API answers it;
- a page of its own where one is registered for the path (``error_page``: the admin UI).

:func:`install` registers the handlers; ``gateway.serving.serve_proxy``, which answers the
proxy routes before FastAPI's handlers could, calls :func:`respond` and :func:`unexpected` itself.
A stream that fails once its reply has begun writes the same bodies as events (``openai_error``,
``anthropic_error``).
"""

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

from base.errors import NextstateError, RequestError

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

# Anthropic's Messages API, with or without the session in the base_url (/s/{id}/v1/messages)
_ANTHROPIC_PATH = re.compile(r"/v1/messages(?:/|$)")


def _anthropic(request: Request) -> bool:
    return bool(_ANTHROPIC_PATH.search(request.url.path))


def _page_for(request: Request) -> ErrorPage | None:
    for prefix, page in getattr(request.app.state, "error_pages", {}).items():
        if request.url.path.startswith(prefix):
            return page
    return None


#: seconds a client is told to wait (Retry-After) while its vLLM upstream is down or reloading
RETRY_AFTER_S = 2


def unavailable(upstream: str, why: str) -> RequestError:
    """503 with Retry-After: the upstream is down or restarting, the client should come back."""
    return RequestError(503, f"upstream {upstream} {why}; try again in {RETRY_AFTER_S} s", code="upstream_unavailable",
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
                  headers: Mapping[str, str] | None = None) -> RequestError:
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
        return RequestError(400, message, code=CONTEXT_LENGTH_EXCEEDED, param=prompt_param, headers=headers)
    return RequestError(status, message, code=code if isinstance(code, str) else None,
                       param=param if isinstance(param, str) else None, headers=headers)


# --- the dialects ---------------------------------------------------------------------------


def openai_error(exc: NextstateError) -> dict[str, Any]:
    """The ``error`` object of OpenAI's error body (what a chat stream's error event carries too)."""
    status = exc.status
    kind = _TYPES.get(status) or ("invalid_request_error" if 400 <= status < 500 else "api_error")
    return {"message": str(exc), "type": kind, "param": exc.param, "code": exc.code}


_ANTHROPIC_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 413: "request_too_large", 422: "invalid_request_error",
    429: "rate_limit_error", 529: "overloaded_error",
}
_CONTEXT = re.compile(r"maximum context length is (\d+) tokens.*?(\d+) (?:input )?tokens|"
                      r"prompt \(length (\d+)\) is longer than the maximum model length of (\d+)|"
                      r"maximum model length is (\d+).*?(\d+) tokens", re.S | re.I)


def context_length(message: str) -> tuple[int | None, int | None] | None:
    """(prompt tokens, maximum) when an upstream message says the context length was passed."""
    m = _CONTEXT.search(message)
    if m is None:
        if "context length" in message.lower() or "maximum model length" in message.lower():
            return None, None
        return None
    g = m.groups()
    if g[0]:
        return int(g[1]), int(g[0])
    if g[2]:
        return int(g[2]), int(g[3])
    return int(g[5]), int(g[4])


def anthropic_error(error: NextstateError) -> tuple[int, dict[str, Any]]:
    """An error as Anthropic's API writes it: ``{"type": "error", "error": {type, message}}``;
    an upstream that is down or failing is ``529 overloaded_error``, as Anthropic's own is, and
    a prompt over the context window reads ``prompt is too long: N tokens > M maximum``."""
    status, kind, message = error.status, None, str(error)
    if error.code == CONTEXT_LENGTH_EXCEEDED:
        kind = "invalid_request_error"
        prompt, limit = context_length(message) or (None, None)
        message = (f"prompt is too long: {prompt} tokens > {limit} maximum" if prompt and limit
                   else f"prompt is too long: {message}")
    elif status in (502, 503, 504):
        status, kind = 529, "overloaded_error"
    elif status >= 500:
        status, kind = 500, "api_error"
    kind = kind or _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return status, {"type": "error", "error": {"type": kind, "message": message}}


def render(exc: NextstateError, *, anthropic: bool = False) -> JSONResponse:
    """*exc* as a response in OpenAI's dialect, or Anthropic's, with the headers it carries."""
    headers = dict(exc.headers) if isinstance(exc, RequestError) else {}
    if anthropic:
        status, body = anthropic_error(exc)
    else:
        status, body = exc.status, {"error": openai_error(exc)}
        if status == 401:
            headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse(body, status_code=status, headers=headers or None)


def respond(request: Request, exc: NextstateError) -> Response:
    """The answer to a request that raised *exc*: the page registered for its path, else JSON in
    the dialect of its path. A layer's own error that is not the client's fault (500) is logged."""
    if exc.status >= 500 and not isinstance(exc, RequestError):
        log.error("%s on %s %s: %s", type(exc).__name__, request.method, request.url.path, exc)
    page = _page_for(request)
    if page is not None:
        return page(request, exc.status, str(exc), None)
    return render(exc, anthropic=_anthropic(request))


def install(app: FastAPI) -> None:
    @app.exception_handler(NextstateError)
    async def _nextstate_error(request: Request, exc: NextstateError) -> Response:
        return respond(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> Response:
        return respond(request, RequestError(400, _describe(exc.errors()), code="invalid_request"))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        return respond(request, RequestError(exc.status_code, str(exc.detail)))

    app.state.error_pages = {}

    app.exception_handler(Exception)(unexpected)


async def unexpected(request: Request, exc: Exception) -> Response:
    """A bug: logged with a request id that the answer repeats (never the traceback), as a page
    where one is registered for the path (``error_page``), else JSON in its dialect."""
    request_id = uuid.uuid4().hex[:16]
    log.error("unexpected error, request id %s: %s %s", request_id, request.method, request.url.path,
              exc_info=exc)
    page = _page_for(request)
    message = f"internal error (request id {request_id})"
    response = (page(request, 500, message, request_id) if page
                else render(RequestError(500, message, code="internal_error"), anthropic=_anthropic(request)))
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
