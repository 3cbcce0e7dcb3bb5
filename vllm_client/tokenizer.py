"""vLLM's tokenizer (``/tokenize`` and ``/detokenize`` at the server's root), async, over either
HTTP client: the gateway's aiohttp session (its request path, where httpx costs several times
the CPU) or an httpx client (the scoring workers)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from base.errors import CallError
from vllm_client.http import AsyncHTTP, post_json, server_root


def _int_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


@dataclass(frozen=True)
class Tokenized:
    """vLLM's ``/tokenize`` answer: the token ids, their count, the server's context window and,
    when asked for, each token's string."""

    tokens: list[int]
    count: int
    max_model_len: int | None
    token_strs: list[str] | None = None


async def tokenize(http: AsyncHTTP, api_base: str, model: str | None, *, prompt: str | None = None,
                   messages: list[dict[str, Any]] | None = None, tools: list[dict[str, Any]] | None = None,
                   return_token_strs: bool = False, api_key: str | None = None,
                   timeout_s: float | None = None) -> Tokenized:
    """``POST {root}/tokenize`` of the server at *api_base* (``…/v1``): a text (*prompt*, without
    special tokens) or a chat (*messages* and *tools*, rendered with the server's chat template
    and its generation prompt, exactly as a chat completion would see them). *model*: the served
    name (a base model or a loaded LoRA adapter). Raises :class:`CallError`."""
    if (prompt is None) == (messages is None):
        raise ValueError("tokenize takes a prompt or messages, one of the two")
    payload: dict[str, Any] = {"model": model} if model else {}
    if prompt is not None:
        payload |= {"prompt": prompt, "add_special_tokens": False}
    else:
        payload |= {"messages": messages, "add_generation_prompt": True}
        if tools:
            payload["tools"] = tools
    if return_token_strs:
        payload["return_token_strs"] = True
    url = f"{server_root(api_base)}/tokenize"
    body = await post_json(http, url, payload, api_key=api_key, timeout_s=timeout_s)
    tokens, strs = body.get("tokens"), body.get("token_strs")
    if not _int_list(tokens):
        raise CallError.unexpected(url, f"answered with no token list: {str(body)[:200]}")
    if return_token_strs and not (isinstance(strs, list) and len(strs) == len(tokens)
                                  and all(isinstance(x, str) for x in strs)):
        raise CallError.unexpected(url, f"answered with no token string for each token: {str(body)[:200]}")
    window = body.get("max_model_len")
    return Tokenized(tokens=list(tokens), count=int(body.get("count", len(tokens))),
                     max_model_len=int(window) if window else None,
                     token_strs=list(strs) if return_token_strs else None)


async def detokenize(http: AsyncHTTP, api_base: str, model: str | None, tokens: Sequence[int], *,
                     api_key: str | None = None, timeout_s: float | None = None) -> str:
    """``POST {root}/detokenize``: the text of *tokens*. Raises :class:`CallError`."""
    payload: dict[str, Any] = {"model": model} if model else {}
    url = f"{server_root(api_base)}/detokenize"
    body = await post_json(http, url, payload | {"tokens": list(tokens)}, api_key=api_key, timeout_s=timeout_s)
    if not isinstance(body.get("prompt"), str):
        raise CallError.unexpected(url, f"answered with no text: {str(body)[:200]}")
    return str(body["prompt"])
