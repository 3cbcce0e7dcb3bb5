"""Resampling a captured turn on the policy server, and whether that server has room for it
(shadow siblings, ``scoring.siblings``).

- :func:`server_load` reads vLLM's Prometheus ``/metrics`` (at the server's root):
  ``vllm:num_requests_running`` and ``vllm:num_requests_waiting``, summed over their label sets.
- :func:`sample_from_ids` asks ``/v1/completions`` for *n* replies to the exact prompt token ids
  of a captured turn (``prompt`` as a list of ids, so nothing is re-rendered or re-tokenized),
  with ``return_token_ids`` and ``logprobs: 0``: each reply's token ids and the log-prob of
  each sampled token, the behaviour log-probs a white-box turn carries.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import httpx

from base.errors import CallError
from vllm_client.http import AsyncHTTP, post_json, server_root

_METRIC = re.compile(r"^(vllm:num_requests_(?:running|waiting))(?:\{[^}]*\})?\s+([0-9.eE+-]+)\s*$", re.M)


@dataclass(frozen=True)
class Load:
    running: float
    waiting: float


def parse_load(text: str) -> Load:
    """Running and waiting requests from a ``/metrics`` page (0 for a metric it lacks)."""
    totals = {"vllm:num_requests_running": 0.0, "vllm:num_requests_waiting": 0.0}
    for name, value in _METRIC.findall(text):
        totals[name] += float(value)
    return Load(running=totals["vllm:num_requests_running"], waiting=totals["vllm:num_requests_waiting"])


async def server_load(http: httpx.AsyncClient, base: str, *, api_key: str | None = None) -> Load:
    """The requests *base* (…/v1) is running and has waiting now. Raises :class:`CallError`."""
    url = f"{server_root(base)}/metrics"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = await http.get(url, headers=headers)
    except httpx.HTTPError as exc:
        raise CallError(f"request to {url} failed: {exc!r}", url=url, detail=repr(exc)) from exc
    if response.status_code >= 400:
        raise CallError.answered(url, response.status_code, response.text[:200])
    return parse_load(response.text)


@dataclass(frozen=True)
class Reply:
    """One resampled reply: its text, token ids, each token's log-prob, and why it stopped."""

    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None


def _reply(choice: dict[str, Any], url: str) -> Reply:
    ids = choice.get("token_ids")
    lps = (choice.get("logprobs") or {}).get("token_logprobs")
    if not isinstance(ids, list) or not isinstance(lps, list) or len(ids) != len(lps):
        raise CallError.unexpected(url, f"a choice without token_ids and their logprobs: {str(choice)[:200]}")
    return Reply(text=choice.get("text") or "", token_ids=[int(t) for t in ids],
                 logprobs=[float(x) if x is not None else 0.0 for x in lps], finish_reason=choice.get("finish_reason"))


async def sample_from_ids(http: AsyncHTTP, base: str, model: str, prompt_ids: list[int], *, n: int,
                          max_tokens: int, temperature: float = 1.0, top_p: float | None = None,
                          seed: int | None = None, api_key: str | None = None) -> list[Reply]:
    """*n* replies of *model* to *prompt_ids* on the vLLM at *base* (…/v1). Raises
    :class:`CallError` (a 404: *model* is not loaded there)."""
    body: dict[str, Any] = {"model": model, "prompt": list(prompt_ids), "n": n, "max_tokens": max_tokens,
                            "temperature": temperature, "logprobs": 0, "return_token_ids": True}
    if top_p is not None:
        body["top_p"] = top_p
    if seed is not None:
        body["seed"] = seed
    url = f"{base.rstrip('/')}/completions"
    answer = await post_json(http, url, body, api_key=api_key)
    choices = sorted(answer.get("choices") or [], key=lambda c: c.get("index", 0))
    if len(choices) != n:
        raise CallError.unexpected(url, f"asked for {n} replies, got {len(choices)}")
    return [_reply(c, url) for c in choices]


async def score_from_ids(http: AsyncHTTP, base: str, model: str, prompt_ids: list[int], response_ids: list[int], *,
                         api_key: str | None = None) -> list[float]:
    """The log-prob *model* on the vLLM at *base* (…/v1) gives each of *response_ids* after *prompt_ids*
    and the response tokens before it (``prompt_logprobs`` over the concatenation, one generated
    token). Raises :class:`CallError` (a 404: *model* is not loaded there)."""
    if not prompt_ids or not response_ids:
        raise ValueError("score_from_ids needs a prompt and a response")
    url = f"{base.rstrip('/')}/completions"
    answer = await post_json(http, url, {"model": model, "prompt": list(prompt_ids) + list(response_ids),
                                         "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0}, api_key=api_key)
    try:
        entries = answer["choices"][0]["prompt_logprobs"]
    except (KeyError, IndexError, TypeError):
        raise CallError.unexpected(url, f"a reply without choices[0].prompt_logprobs: {str(answer)[:200]}") from None
    if not isinstance(entries, list) or len(entries) != len(prompt_ids) + len(response_ids):
        raise CallError.unexpected(url, f"{len(entries) if isinstance(entries, list) else entries!r} prompt_logprobs "
                                        f"for {len(prompt_ids)} + {len(response_ids)} tokens")
    out = []
    for position, token in enumerate(response_ids, start=len(prompt_ids)):
        entry = entries[position] or {}
        info = entry.get(str(token)) if isinstance(entry, dict) else None
        value = info.get("logprob") if isinstance(info, dict) else info
        if not isinstance(value, (int, float)):
            raise CallError.unexpected(url, f"prompt_logprobs[{position}] has no log-prob for token {token}")
        out.append(float(value))
    return out
