"""vLLM's tokenizer through its one client, vllm_client.tokenizer.tokenize / detokenize, over both
HTTP clients its callers use (the gateway's aiohttp session, the workers' httpx), against the
real vLLM: the count is the prompt a chat completion sees, errors carry the server's status and
message, and no answer at all is status None (what the judge and the teacher retry)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import httpx
import pytest

from base.errors import CallError
from vllm_client.tokenizer import detokenize, tokenize

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "The weather in a city.",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(params=["aiohttp", "httpx"])
async def http(request: pytest.FixtureRequest) -> AsyncIterator[Any]:
    if request.param == "aiohttp":
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            yield session
    else:
        async with httpx.AsyncClient(timeout=120) as client:
            yield client


async def test_chat_count_is_the_prompt_a_completion_sees(vllm_server: Any, http: Any) -> None:
    for tools in (None, TOOLS):
        found = await tokenize(http, vllm_server.base_url, "smollm2", messages=MESSAGES, tools=tools)
        async with httpx.AsyncClient(timeout=120) as raw:
            r = await raw.post(f"{vllm_server.base_url}/chat/completions", json={
                "model": "smollm2", "messages": MESSAGES, "max_tokens": 1, "temperature": 0,
                **({"tools": tools} if tools else {})})
        assert found.count == len(found.tokens) == r.json()["usage"]["prompt_tokens"]
        assert found.max_model_len == 8192  # the window the judge fits its prompt to


async def test_text_round_trip_and_token_strings(vllm_server: Any, http: Any) -> None:
    text = "The quick brown fox."
    found = await tokenize(http, vllm_server.base_url, "smollm2", prompt=text, return_token_strs=True)
    assert found.token_strs is not None and len(found.token_strs) == len(found.tokens) > 3
    assert "".join(found.token_strs).replace("Ġ", " ") == text  # no special tokens added
    assert await detokenize(http, vllm_server.base_url, "smollm2", found.tokens) == text
    empty = await tokenize(http, vllm_server.base_url, "smollm2", prompt="")
    assert empty.tokens == [] and empty.max_model_len == 8192


async def test_errors_carry_the_servers_status_and_message(vllm_server: Any, http: Any) -> None:
    with pytest.raises(CallError) as info:
        await tokenize(http, vllm_server.base_url, "no-such-model", messages=MESSAGES)
    assert info.value.status_code == 404
    assert "The model `no-such-model` does not exist" in info.value.detail
    assert str(info.value).startswith(f"{vllm_server.base_url.removesuffix('/v1')}/tokenize answered 404: ")
    # nothing listens: no status, so the callers retry
    with pytest.raises(CallError, match=r"request to http://127.0.0.1:9/tokenize failed") as info:
        await tokenize(http, "http://127.0.0.1:9/v1", "smollm2", prompt="hi")
    assert info.value.status_code is None


async def test_a_prompt_or_messages_not_both() -> None:
    async with httpx.AsyncClient() as http:
        with pytest.raises(ValueError, match="one of the two"):
            await tokenize(http, "http://127.0.0.1:9/v1", "m", prompt="x", messages=MESSAGES)
        with pytest.raises(ValueError, match="one of the two"):
            await tokenize(http, "http://127.0.0.1:9/v1", "m")
