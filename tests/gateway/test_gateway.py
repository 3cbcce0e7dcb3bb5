"""The gateway end to end: the official `openai` client → gateway process → real vLLM (SmolLM2)
→ real pool (SQLite and PostgreSQL)."""

from __future__ import annotations

import copy
import json
import uuid
from typing import Any

import httpx
import pytest
from openai import OpenAI

from tests.support.vllm_servers import RunningVLLM
from tests.support.processes import GatewayProcess, wait_for

MAX_TOKENS = 12


def client(base_url: str, **kw: Any) -> OpenAI:
    return OpenAI(base_url=base_url, api_key=kw.pop("api_key", "not-needed"), max_retries=0, **kw)


def session(gw: GatewayProcess, session_id: str) -> dict[str, Any]:
    r = httpx.get(f"{gw.url}/api/sessions/{session_id}", timeout=5)
    r.raise_for_status()
    return r.json()


def direct(vllm: RunningVLLM, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(f"{vllm.base_url}{path}", json=body, timeout=120)
    r.raise_for_status()
    return r.json()


def vllm_root(vllm: RunningVLLM) -> str:
    return vllm.base_url.removesuffix("/v1")


def unique_user(text: str) -> list[dict[str, Any]]:
    # a unique system prompt keeps every test's conversation apart from every other's
    return [{"role": "system", "content": f"You are a terse assistant. Run {uuid.uuid4().hex[:8]}."},
            {"role": "user", "content": text}]


# --- exact capture -----------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_chat_reply_and_token_ids_match_vllm(gateway: GatewayProcess, vllm_server: RunningVLLM, stream: bool) -> None:
    messages = unique_user("Name three colors.")
    ref = direct(vllm_server, "/chat/completions", {
        "model": "smollm2", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0,
        "return_token_ids": True, "logprobs": True})
    c = client(gateway.base_url)
    if stream:
        with c.chat.completions.with_streaming_response.create(
            model="smollm2", messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True
        ) as raw:
            turn_id = raw.headers["x-turn-id"]
            content = "".join(ch.choices[0].delta.content or "" for ch in raw.parse() if ch.choices)
    else:
        raw = c.chat.completions.with_raw_response.create(
            model="smollm2", messages=messages, max_tokens=MAX_TOKENS, temperature=0)
        turn_id = raw.headers["x-turn-id"]
        content = raw.parse().choices[0].message.content

    assert content == ref["choices"][0]["message"]["content"]
    stored = gateway.stored_turn(turn_id)
    assert stored["capture"] == "white-box" and stored["status"] == "ok"
    assert stored["response"]["content"] == content
    assert stored["token_ids"] == ref["choices"][0]["token_ids"]
    assert stored["prompt_token_ids"] == ref["prompt_token_ids"]
    # a separate request may be batched differently; bf16 logits then differ in the last bits
    # (exact equality with what vLLM returned for the same request: test_client_sees_...)
    ref_lp = [t["logprob"] for t in ref["choices"][0]["logprobs"]["content"]]
    assert stored["logprobs"] == pytest.approx(ref_lp, abs=0.25)
    assert stored["usage"]["completion_tokens"] == len(stored["token_ids"])
    assert stored["policy_version"] == "smollm2"
    # the prompt ids are vLLM's own rendering of these messages with the chat template
    rendered = httpx.post(f"{vllm_root(vllm_server)}/tokenize", json={
        "model": "smollm2", "messages": messages, "add_generation_prompt": True}, timeout=30).json()
    assert stored["prompt_token_ids"] == rendered["tokens"]
    text = httpx.post(f"{vllm_root(vllm_server)}/detokenize", json={
        "model": "smollm2", "tokens": stored["prompt_token_ids"]}, timeout=30).json()["prompt"]
    assert messages[1]["content"] in text and text.rstrip().endswith("assistant")


def test_client_sees_exactly_what_vllm_sends(gateway: GatewayProcess, vllm_server: RunningVLLM) -> None:
    """The gateway asks vLLM for token ids and logprobs; a client that did not ask sees none."""
    body = {"model": "smollm2", "messages": unique_user("Say hi."), "max_tokens": 6, "temperature": 0}
    ref = direct(vllm_server, "/chat/completions", body)
    got = httpx.post(f"{gateway.base_url}/chat/completions", json=body, timeout=120).json()
    for key in ("id", "created"):
        ref.pop(key), got.pop(key)
    assert got == ref

    # a client that asks for them gets them, as vLLM gave them — the very values the pool keeps
    body |= {"logprobs": True, "return_token_ids": True}
    raw = httpx.post(f"{gateway.base_url}/chat/completions", json=body, timeout=120)
    got = raw.json()
    stored = gateway.stored_turn(raw.headers["x-turn-id"])
    assert stored["prompt_token_ids"] == got["prompt_token_ids"]
    assert stored["token_ids"] == got["choices"][0]["token_ids"]
    assert stored["logprobs"] == [t["logprob"] for t in got["choices"][0]["logprobs"]["content"]]


def _events(resp: httpx.Response) -> list[Any]:
    out = []
    for block in resp.text.split("\n\n"):
        if block.startswith("data: "):
            data = block[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def _kinds(events: list[Any]) -> tuple[list[Any], str]:
    """A stream's events as the kinds of event it sent, in order, and its text. vLLM sends several
    tokens in one event when its API server falls behind the engine (a loaded machine), so two
    identical requests may be cut into events differently: each event less its text, less the
    fields that differ between requests, and a run of such equal events counted as one."""
    kinds: list[Any] = []
    text = ""
    for event in events:
        if isinstance(event, dict):
            event = {k: copy.deepcopy(v) for k, v in event.items() if k not in ("id", "created")}
            delta = event["choices"][0]["delta"]
            text += delta.get("content") or ""
            event["choices"][0]["delta"] = {**delta, "content": "" if delta.get("content") is not None else None}
        if not kinds or kinds[-1] != event:
            kinds.append(event)
    return kinds, text


def test_stream_is_what_vllm_sends(gateway: GatewayProcess, vllm_server: RunningVLLM) -> None:
    """The gateway's events are vLLM's, field for field, with the token ids and logprobs it asked
    for nulled; that each upstream event is one client event is test_stream_relay.py's."""
    body = {"model": "smollm2", "messages": unique_user("Count to five."), "max_tokens": 10,
            "temperature": 0, "stream": True}
    ref = _events(httpx.post(f"{vllm_server.base_url}/chat/completions", json=body, timeout=120))
    got = _events(httpx.post(f"{gateway.base_url}/chat/completions", json=body, timeout=120))
    assert len(got) > 3 and got[-1] == "[DONE]"
    kinds, text = _kinds(ref)
    assert _kinds(got) == (kinds, text) and text
    # the reference's kinds of event: its role, its tokens, the last with the finish reason, [DONE]
    assert len(kinds) == 4


def test_completions_endpoint_captures_token_ids(gateway: GatewayProcess, vllm_server: RunningVLLM) -> None:
    prompt = f"The capital of France is ({uuid.uuid4().hex[:6]})"
    ref = direct(vllm_server, "/completions", {"model": "smollm2", "prompt": prompt, "max_tokens": 5,
                                               "temperature": 0, "return_token_ids": True})
    raw = client(gateway.base_url).completions.with_raw_response.create(
        model="smollm2", prompt=prompt, max_tokens=5, temperature=0)
    assert raw.parse().choices[0].text == ref["choices"][0]["text"]
    stored = gateway.stored_turn(raw.headers["x-turn-id"])
    assert stored["endpoint"] == "completions"
    assert stored["token_ids"] == ref["choices"][0]["token_ids"]
    assert stored["prompt_token_ids"] == ref["choices"][0]["prompt_token_ids"]
    assert len(stored["logprobs"]) == len(stored["token_ids"])


def test_models_lists_upstream_and_policy_alias(gateway: GatewayProcess) -> None:
    models = {m.id: m for m in client(gateway.base_url).models.list().data}
    # vLLM also lists LoRA adapters other tests loaded into the same server
    assert {"smollm2", "policy"} <= set(models)
    assert models["policy"].model_extra["root"] == "smollm2"
    reply = client(gateway.base_url).chat.completions.create(
        model="policy", messages=unique_user("Hi"), max_tokens=2)
    assert reply.model == "smollm2"


# --- sessions and next states ------------------------------------------------------------------


def test_tool_call_round_trip_sets_next_state(gateway: GatewayProcess) -> None:
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}}]
    c = client(gateway.base_url)
    messages: list[Any] = unique_user("What is the weather in Paris?")
    raw = c.chat.completions.with_raw_response.create(
        model="smollm2", messages=messages, tools=tools, max_tokens=100, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    first = raw.parse().choices[0].message
    assert first.tool_calls and first.tool_calls[0].function.name == "get_weather"
    json.loads(first.tool_calls[0].function.arguments)  # well-formed arguments
    tool_result = {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "18 C, sunny"}
    messages += [first, tool_result]  # the SDK's own message object, as agents append it
    raw2 = c.chat.completions.with_raw_response.create(
        model="smollm2", messages=messages, tools=tools, max_tokens=20, temperature=0)

    t1 = gateway.stored_turn(raw.headers["x-turn-id"])
    t2 = gateway.stored_turn(raw2.headers["x-turn-id"])
    assert t1["response"]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert t2["session_id"] == t1["session_id"] and t2["parent_turn_id"] == t1["id"]
    t1 = gateway.stored_turn(t1["id"])
    assert t1["next_state"] == {"turn_id": t2["id"], "messages": [tool_result]}


def test_three_turns_without_header_are_one_session(gateway: GatewayProcess) -> None:
    c = client(gateway.base_url)
    messages: list[Any] = unique_user("Hello!")
    ids = []
    for follow_up in ("Tell me more.", "Thanks, bye."):
        raw = c.chat.completions.with_raw_response.create(model="smollm2", messages=messages, max_tokens=8)
        ids.append(raw.headers["x-turn-id"])
        messages += [raw.parse().choices[0].message, {"role": "user", "content": follow_up}]
    raw = c.chat.completions.with_raw_response.create(model="smollm2", messages=messages, max_tokens=8)
    ids.append(raw.headers["x-turn-id"])
    # an unrelated conversation with the same opening user message
    other = c.chat.completions.with_raw_response.create(model="smollm2", messages=unique_user("Hello!"),
                                                        max_tokens=8)

    stored = [gateway.stored_turn(i) for i in ids]
    sid = stored[0]["session_id"]
    s = wait_for(lambda: (s := session(gateway, sid)) and len(s["turns"]) == 3 and s)
    assert [t["id"] for t in s["turns"]] == ids and s["source"] == "inferred"
    assert [t["next_state"]["messages"] for t in s["turns"][:2]] == [
        [{"role": "user", "content": "Tell me more."}], [{"role": "user", "content": "Thanks, bye."}]]
    assert s["turns"][2]["next_state"] is None
    assert gateway.stored_turn(other.headers["x-turn-id"])["session_id"] != sid


def test_session_from_path_and_header(gateway: GatewayProcess) -> None:
    sid = f"path-{uuid.uuid4().hex[:8]}"
    c = client(f"{gateway.url}/s/{sid}/v1")
    raw = c.chat.completions.with_raw_response.create(model="smollm2", messages=unique_user("a"), max_tokens=2)
    assert raw.headers["x-session-id"] == sid
    raw2 = client(gateway.base_url).chat.completions.with_raw_response.create(
        model="smollm2", messages=unique_user("b"), max_tokens=2, extra_headers={"X-Session-Id": sid,
                                                                                   "X-Turn-Type": "side"})
    t1, t2 = gateway.stored_turn(raw.headers["x-turn-id"]), gateway.stored_turn(raw2.headers["x-turn-id"])
    assert t1["session_id"] == t2["session_id"] == sid
    assert t2["turn_type"] == "side"
    assert session(gateway, sid)["source"] == "path"
    assert c.models.list().data  # the other routes exist under the session prefix too


def test_session_list_pages_newest_first(gateway: GatewayProcess) -> None:
    sids = [f"page-{uuid.uuid4().hex[:8]}" for _ in range(3)]
    last = None
    for sid in sids:
        last = client(f"{gateway.url}/s/{sid}/v1").chat.completions.with_raw_response.create(
            model="smollm2", messages=unique_user("x"), max_tokens=1)
    gateway.stored_turn(last.headers["x-turn-id"])
    seen: list[str] = []
    cursor = None
    while True:
        params = {"limit": 2} | ({"cursor": cursor} if cursor else {})
        page = httpx.get(f"{gateway.url}/api/sessions", params=params, timeout=5).json()
        seen += [s["id"] for s in page["data"]]
        cursor = page["next_cursor"]
        if not cursor:
            break
    assert len(seen) == len(set(seen))
    assert [s for s in seen if s in sids] == list(reversed(sids))
    bad = httpx.get(f"{gateway.url}/api/sessions", params={"cursor": "nope"}, timeout=5)
    assert bad.status_code == 400 and "cursor" in bad.json()["error"]["message"]


def test_sampling_parameters_pass_through(gateway: GatewayProcess, vllm_server: RunningVLLM) -> None:
    """n, seed, stop, response_format and fields only vLLM knows (top_k) reach vLLM unchanged."""
    # the same seeded request straight to vLLM and through the gateway must sample the same replies.
    # vLLM's CPU build is not bit-reproducible every time (a sample diverged mid-reply once in CI,
    # at temperature 1.0, on a prompt it had just cached), so a fresh prompt is tried up to 3 times:
    # with the seed or top_k dropped, 24 tokens sampled at temperature 1.0 would practically never match
    contents: list[tuple[list[str], list[str]]] = []
    for _ in range(3):
        body = {"model": "smollm2", "messages": unique_user("List two fruits as JSON."), "max_tokens": 24,
                "temperature": 1.0, "seed": 7, "n": 2, "stop": ["}"], "top_k": 5,
                "response_format": {"type": "json_object"}}
        ref = direct(vllm_server, "/chat/completions", body | {"return_token_ids": True})
        raw = httpx.post(f"{gateway.base_url}/chat/completions", json=body, timeout=120)
        got = raw.json()
        contents.append(([c["message"]["content"] for c in got["choices"]],
                         [c["message"]["content"] for c in ref["choices"]]))
        if contents[-1][0] == contents[-1][1]:
            break
    assert contents[-1][0] == contents[-1][1], contents
    assert len(got["choices"]) == 2 and "}" not in got["choices"][0]["message"]["content"]
    stored = gateway.stored_turn(raw.headers["x-turn-id"])
    assert stored["request"]["params"] | {"model": "smollm2"} == {
        k: v for k, v in body.items() if k != "messages"}
    assert stored["token_ids"] == ref["choices"][0]["token_ids"]
    second = stored["response"]["choices"][1]
    assert second["token_ids"] == ref["choices"][1]["token_ids"]
    assert len(second["logprobs"]) == len(second["token_ids"])


def test_client_hanging_up_mid_stream_is_stored_as_cancelled(gateway: GatewayProcess) -> None:
    body = {"model": "smollm2", "messages": unique_user("Write a long story about the sea."),
            "max_tokens": 300, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{gateway.base_url}/chat/completions", json=body, timeout=120) as r:
        turn_id = r.headers["x-turn-id"]
        lines = r.iter_lines()
        for _ in range(4):
            next(lines)
    # the client is gone after a few chunks; what it got is kept, marked cancelled
    stored = gateway.stored_turn(turn_id)
    assert stored["status"] == "cancelled" and stored["error"]["type"] == "cancelled"
    assert 0 < len(stored["token_ids"]) < 300


def test_an_idle_client_connection_outlives_the_clients_own_idle_limit(gateway: GatewayProcess) -> None:
    """httpx and the OpenAI SDKs keep an idle connection for 5 s and then send on it; a gateway
    that closed it at 5 s too (uvicorn's default) races them. One connection, a request, 6 s
    idle, a second request on the same connection: answered (NEXTSTATE_KEEP_ALIVE_S, 75 s)."""
    import http.client
    import time
    from urllib.parse import urlsplit

    where = urlsplit(gateway.url)
    conn = http.client.HTTPConnection(where.hostname, where.port, timeout=10)
    try:
        sockets = []
        for idle in (6, 0):
            conn.request("GET", "/healthz")  # a connection the server closed fails here (RemoteDisconnected)
            answer = conn.getresponse()
            assert answer.status == 200 and answer.read() == b'{"status":"ok"}'
            sockets.append(conn.sock)
            time.sleep(idle)
        assert sockets[0] is sockets[1] is not None  # the same connection both times
    finally:
        conn.close()
