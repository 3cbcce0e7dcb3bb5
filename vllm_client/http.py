"""vLLM server URLs, the errors of every call to a vLLM server, and one JSON POST over either
HTTP client (the gateway's aiohttp session or an httpx client)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import aiohttp
import httpx

from base.errors import CallError
from base.settings import Settings


def server_root(url: str) -> str:
    """``http://host:port`` of an OpenAI base ``http://host:port/v1`` (a URL without ``/v1`` is
    returned as it is, without a trailing slash)."""
    url = url.strip().rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def openai_base(url: str) -> str:
    """The OpenAI base of a vLLM server: ``http://host:port/v1`` (``/v1`` appended if missing)."""
    url = url.strip().rstrip("/")
    return url if url.endswith("/v1") else f"{url}/v1"


def openai_bases(urls: Sequence[str]) -> list[str]:
    """:func:`openai_base` of each, duplicates dropped, order kept."""
    return list(dict.fromkeys(openai_base(u) for u in urls))


def response_text(resp: httpx.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return f"HTTP {resp.status_code}: {resp.text[:500]}"
    if isinstance(body, dict):
        for key in ("error", "detail", "message"):
            if body.get(key):
                err = body[key]
                return f"HTTP {resp.status_code}: {err.get('message', err) if isinstance(err, dict) else err}"
    return f"HTTP {resp.status_code}: {json.dumps(body)[:500]}"



def policy_servers(settings: Settings) -> list[str]:
    """The servers a version must be loaded into when none are named: the policy server
    (upstream_url, else the local vLLM) and the teacher replica (teacher_url) if set."""
    return openai_bases([settings.local_vllm_url, *([settings.teacher_url] if settings.teacher_url else [])])



AsyncHTTP = aiohttp.ClientSession | httpx.AsyncClient


def error_detail(body: Any, text: str) -> str:
    """The message of an error body (OpenAI's ``{"error": {"message"}}``, FastAPI's ``detail``),
    else the raw text."""
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return err["message"]
        if isinstance(err, str):
            return err
        if isinstance(body.get("detail"), str):
            return body["detail"]
        return json.dumps(body)[:500]
    return text.strip()[:500] or "(empty body)"


async def post_json(http: AsyncHTTP, url: str, payload: dict[str, Any], *, api_key: str | None = None,
                    timeout_s: float | None = None) -> dict[str, Any]:
    """POST *payload* to a vLLM endpoint; its JSON object answer. Raises :class:`CallError`
    (with the status and the server's message for an error answer). *timeout_s*: this call's
    total time, else the client's own timeouts."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        if isinstance(http, aiohttp.ClientSession):
            extra = {"timeout": aiohttp.ClientTimeout(total=timeout_s)} if timeout_s else {}
            async with http.post(url, json=payload, headers=headers, **extra) as resp:
                status, text = resp.status, await resp.text(errors="replace")
        else:
            extra = {"timeout": timeout_s} if timeout_s else {}
            response = await http.post(url, json=payload, headers=headers, **extra)
            status, text = response.status_code, response.text
    except (TimeoutError, aiohttp.ClientError, httpx.HTTPError) as exc:
        raise CallError(f"request to {url} failed: {exc!r}", url=url, detail=repr(exc)) from exc
    try:
        body = json.loads(text)
    except ValueError:
        body = None
    if status >= 400:
        raise CallError.answered(url, status, error_detail(body, text))
    if body is None:
        raise CallError.unexpected(url, f"answered with non-JSON: {text[:200]!r}")
    if not isinstance(body, dict):
        raise CallError.unexpected(url, f"answered with {type(body).__name__}, expected an object")
    return body
