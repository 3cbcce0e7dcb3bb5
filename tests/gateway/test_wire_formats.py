"""The Responses and Messages APIs end to end: the official `openai`, `openai-agents` and
`anthropic` clients → gateway process → real vLLM (SmolLM2) → real pool.

The reference for "what the SDK parses" is vLLM itself: the same request translated to chat the
way the gateway translates it, sent to vLLM directly (greedy), and its reply or stream turned
into the client's wire format by the same translators. vLLM's native /v1/responses is not the
reference: it has no token ids and its own defaults (docs/wire-formats.md).
"""

from __future__ import annotations

import json
import re
import uuid
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest
from openai import OpenAI
from openai._models import construct_type
from openai.types.responses import Response, ResponseStreamEvent

from gateway.formats import messages_to_chat, responses_to_chat
from gateway.replies import MessagesReply, ResponsesReply
from tests.support.vllm_servers import RunningVLLM
from tests.support.processes import GatewayProcess, free_port, wait_for

MAX_TOKENS = 12
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
WEATHER_ANTHROPIC = {"name": "get_weather", "description": "Current weather in a city",
                     "input_schema": WEATHER["parameters"]}


def run_id() -> str:
    return uuid.uuid4().hex[:8]


def oai(base_url: str) -> OpenAI:
    return OpenAI(base_url=base_url, api_key="not-needed", max_retries=0)


def claude(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key="not-needed", max_retries=0)


def _ids_out(node: Any) -> Any:
    """Ids the gateway and vLLM mint at random (response, item and tool-call ids, times) removed."""
    if isinstance(node, dict):
        return {k: _ids_out(v) for k, v in node.items()
                if k not in ("id", "item_id", "call_id", "created_at", "sequence_number")}
    if isinstance(node, list):
        return [_ids_out(v) for v in node]
    return node


def _vllm_chat(vllm: RunningVLLM, chat: dict[str, Any]) -> dict[str, Any]:
    body = {**chat, "model": "smollm2", "return_token_ids": True, "logprobs": True, "stream": False}
    r = httpx.post(f"{vllm.base_url}/chat/completions", json=body, timeout=120)
    r.raise_for_status()
    return r.json()


def _vllm_events(vllm: RunningVLLM, chat: dict[str, Any], reply: Any) -> list[dict[str, Any]]:
    """vLLM's own chat stream for *chat*, translated by *reply*: the reference event sequence."""
    body = {**chat, "model": "smollm2", "return_token_ids": True, "logprobs": True, "stream": True}
    raw = b""
    with httpx.stream("POST", f"{vllm.base_url}/chat/completions", json=body, timeout=120) as r:
        for part in r.iter_bytes():
            raw += part
    out: list[bytes] = []
    for event in raw.split(b"\n\n"):
        data = event.removeprefix(b"data: ").strip()
        if not data:
            continue
        out += reply.end() if data == b"[DONE]" else reply.chunk(json.loads(data))
    return [json.loads(e.split(b"\ndata: ", 1)[1]) for e in out]


# --- OpenAI Responses API -------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_responses_match_vllm_event_by_event(gateway: GatewayProcess, vllm_server: RunningVLLM, stream: bool) -> None:
    body = {"model": "smollm2", "instructions": f"You are terse. Run {run_id()}.", "input": "Name three colors.",
            "max_output_tokens": MAX_TOKENS, "temperature": 0}
    chat = responses_to_chat(body, [])
    c = oai(gateway.base_url)
    if stream:
        with c.responses.with_streaming_response.create(**body, stream=True) as raw:
            turn_id = raw.headers["x-turn-id"]
            events = [e.model_dump(mode="json") for e in raw.parse()]
        ref = [construct_type(type_=ResponseStreamEvent, value=e).model_dump(mode="json")  # type: ignore[arg-type]
               for e in _vllm_events(vllm_server, chat, ResponsesReply("smollm2", body))]
        assert [e["type"] for e in events][:3] == ["response.created", "response.in_progress", "response.output_item.added"]
        assert events[-1]["type"] in ("response.completed", "response.incomplete")
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        assert _ids_out(events) == _ids_out(ref)
        final = events[-1]["response"]
        text = final["output"][0]["content"][0]["text"]
    else:
        raw = c.responses.with_raw_response.create(**body)
        turn_id = raw.headers["x-turn-id"]
        parsed = raw.parse()
        ref = construct_type(type_=Response, value=ResponsesReply("smollm2", body).whole(_vllm_chat(vllm_server, chat)))  # type: ignore[arg-type]
        assert _ids_out(parsed.model_dump(mode="json")) == _ids_out(ref.model_dump(mode="json"))
        text, final = parsed.output_text, parsed.model_dump(mode="json")

    direct = _vllm_chat(vllm_server, chat)
    assert text == direct["choices"][0]["message"]["content"]
    stored = gateway.stored_turn(turn_id)
    assert stored["wire_format"] == "responses" and stored["endpoint"] == "chat"
    assert stored["capture"] == "white-box" and stored["response"]["content"] == text
    assert stored["response"]["id"] == final["id"]
    assert stored["token_ids"] == direct["choices"][0]["token_ids"]
    assert stored["prompt_token_ids"] == direct["prompt_token_ids"]
    assert stored["request"]["messages"] == chat["messages"]
    assert final["usage"]["output_tokens"] == len(stored["token_ids"])
    assert final["usage"]["input_tokens"] == len(stored["prompt_token_ids"])


def test_responses_function_tool_round_trip_by_previous_response_id(gateway: GatewayProcess) -> None:
    """function_call → function_call_output → next turn, the client resending no history: the
    gateway reads it from the pool; the tool output is the first turn's next state."""
    sid = f"resp-{run_id()}"
    c = oai(f"{gateway.url}/s/{sid}/v1")
    # a fixed prompt: SmolLM2 answers a named tool_choice with a call for this one (the session keeps tests apart)
    first = c.responses.create(model="smollm2", instructions="Run abc12345.", input="What is the weather in Paris?",
                               tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
                               max_output_tokens=60, temperature=0)
    calls = [o for o in first.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather"
    json.loads(calls[0].arguments)
    output = {"type": "function_call_output", "call_id": calls[0].call_id, "output": "18 C, sunny"}
    raw = c.responses.with_raw_response.create(model="smollm2", previous_response_id=first.id, input=[output],
                                               tools=[WEATHER], max_output_tokens=20, temperature=0)
    second = raw.parse()
    assert second.previous_response_id == first.id and second.output_text

    t2 = gateway.stored_turn(raw.headers["x-turn-id"])
    t1 = wait_for(lambda: (t := gateway.stored_turn(t2["parent_turn_id"])) and t["next_state"] and t)
    assert t1["response"]["id"] == first.id and t1["session_id"] == t2["session_id"] == sid
    tool_message = {"role": "tool", "tool_call_id": calls[0].call_id, "content": "18 C, sunny"}
    assert t1["next_state"] == {"turn_id": t2["id"], "messages": [tool_message]}
    reply = {"role": "assistant", "content": None, "tool_calls": t1["response"]["tool_calls"]}
    assert t2["request"]["messages"] == t1["request"]["messages"] + [reply, tool_message]
    assert t2["request"]["params"]["previous_response_id"] == first.id
    # GET /v1/responses/{id} reads the stored response back, on any replica
    again = c.responses.retrieve(first.id)
    assert [(o.type, getattr(o, "call_id", None)) for o in again.output] == [("function_call", calls[0].call_id)]


def test_previous_response_id_continuation_is_stitched_without_a_session(gateway: GatewayProcess) -> None:
    c = oai(gateway.base_url)
    first = c.responses.create(model="smollm2", instructions=f"Run {run_id()}.", input="Hello!",
                               max_output_tokens=8, temperature=0)
    raw = c.responses.with_raw_response.create(model="smollm2", previous_response_id=first.id,
                                               input="Tell me more.", max_output_tokens=8, temperature=0)
    t2 = gateway.stored_turn(raw.headers["x-turn-id"])
    assert t2["parent_turn_id"] is not None
    t1 = gateway.stored_turn(t2["parent_turn_id"])
    assert t1["response"]["id"] == first.id and t1["session_id"] == t2["session_id"]
    assert t2["request"]["messages"][-1] == {"role": "user", "content": "Tell me more."}


def test_openai_agents_sdk_default_model_with_a_function_tool(gateway: GatewayProcess) -> None:
    from agents import (Agent, ModelSettings, RunConfig, Runner, function_tool, set_default_openai_api,
                        set_default_openai_client, set_tracing_disabled)
    from openai import AsyncOpenAI

    seen: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        seen.append(city)
        return "18 C, sunny"

    sid = f"agents-{run_id()}"
    set_tracing_disabled(True)
    set_default_openai_api("responses")  # the SDK's default, said out loud
    set_default_openai_client(AsyncOpenAI(base_url=f"{gateway.url}/s/{sid}/v1", api_key="not-needed", max_retries=0),
                              use_for_tracing=False)
    agent = Agent(name="weather", instructions="Run abc12345.", model="smollm2",
                  tools=[get_weather], model_settings=ModelSettings(tool_choice="get_weather", max_tokens=60,
                                                                    temperature=0))
    result = Runner.run_sync(agent, "What is the weather in Paris?", max_turns=4,
                             run_config=RunConfig(tracing_disabled=True))
    assert seen, "the agent called its tool"
    assert result.final_output is not None

    session = wait_for(lambda: (s := httpx.get(f"{gateway.url}/api/sessions/{sid}", timeout=5).json())
                       and len(s.get("turns", [])) >= 2 and s, 20)
    turns = session["turns"]
    assert all(t["wire_format"] == "responses" and t["capture"] == "white-box" for t in turns)
    assert turns[0]["response"]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert turns[1]["parent_turn_id"] == turns[0]["id"]
    assert {"role": "tool", "tool_call_id": turns[0]["response"]["tool_calls"][0]["id"],
            "content": "18 C, sunny"} in turns[0]["next_state"]["messages"]


# --- Anthropic Messages API ---------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
def test_messages_match_vllm_event_by_event(gateway: GatewayProcess, vllm_server: RunningVLLM, stream: bool) -> None:
    body: dict[str, Any] = {"model": "smollm2", "max_tokens": MAX_TOKENS, "system": f"You are terse. Run {run_id()}.",
                            "messages": [{"role": "user", "content": "Name three colors."}], "stop_sequences": ["Purple"]}
    extra = {"temperature": 0}
    chat = messages_to_chat({**body, **extra})
    a = claude(gateway.url)
    if stream:
        with a.messages.with_streaming_response.create(**body, stream=True, extra_body=extra) as raw:
            turn_id = raw.headers["x-turn-id"]
            events = [e.model_dump(mode="json") for e in raw.parse()]
        ref = [anthropic._models.construct_type(type_=anthropic.types.RawMessageStreamEvent, value=e).model_dump(mode="json")  # type: ignore[attr-defined]
               for e in _vllm_events(vllm_server, chat, MessagesReply("smollm2", body))]
        assert _ids_out(events) == _ids_out(ref)
        assert events[0]["type"] == "message_start" and events[-1]["type"] == "message_stop"
        with a.messages.stream(**body, extra_body=extra) as s:  # the SDK's own stream helper
            message = s.get_final_message()
    else:
        raw = a.messages.with_raw_response.create(**body, extra_body=extra)
        turn_id = raw.headers["x-turn-id"]
        message = raw.parse()
        ref_msg = anthropic._models.construct_type(type_=anthropic.types.Message,  # type: ignore[attr-defined]
                                                   value=MessagesReply("smollm2", body).whole(_vllm_chat(vllm_server, chat)))
        assert _ids_out(message.model_dump(mode="json")) == _ids_out(ref_msg.model_dump(mode="json"))
    direct = _vllm_chat(vllm_server, chat)
    stored = gateway.stored_turn(turn_id)
    assert stored["wire_format"] == "messages" and stored["capture"] == "white-box"
    assert message.content[0].text == stored["response"]["content"] == direct["choices"][0]["message"]["content"]  # type: ignore[union-attr]
    assert stored["token_ids"] == direct["choices"][0]["token_ids"]
    assert stored["prompt_token_ids"] == direct["prompt_token_ids"]
    assert message.usage.output_tokens == len(stored["token_ids"])
    ended = direct["choices"][0]
    expected = ("max_tokens" if ended["finish_reason"] == "length"
                else "stop_sequence" if ended.get("stop_reason") == "Purple" else "end_turn")
    assert message.stop_reason == expected
    assert message.stop_sequence == ("Purple" if expected == "stop_sequence" else None)


def _reply_ids_are_vllms(vllm: RunningVLLM, stored: dict[str, Any], direct: dict[str, Any], arguments: str) -> None:
    """The stored prompt ids are vLLM's rendering of the request; the reply ids are the ones vLLM
    generated. A second request may tip a near-tie differently (bf16, other batch), so the reply
    ids are compared exactly when it generated the same call, and detokenized in any case."""
    assert stored["prompt_token_ids"] == direct["prompt_token_ids"]
    again = (direct["choices"][0]["message"].get("tool_calls") or [{}])[0].get("function", {}).get("arguments")
    if again == arguments:
        assert stored["token_ids"] == direct["choices"][0]["token_ids"]
    text = httpx.post(f"{vllm.base_url.removesuffix('/v1')}/detokenize",
                      json={"model": "smollm2", "tokens": stored["token_ids"]}, timeout=30).json()["prompt"]
    assert arguments in text


@pytest.mark.parametrize("stream", [False, True], ids=["create", "stream"])
def test_messages_tool_use_round_trip_with_vllm_ids(gateway: GatewayProcess, vllm_server: RunningVLLM, stream: bool) -> None:
    sid = f"msg-{run_id()}"
    a = claude(f"{gateway.url}/s/{sid}")
    body: dict[str, Any] = {
        # a fixed prompt: SmolLM2 answers a named tool_choice with a call for this one
        "model": "smollm2", "max_tokens": 60, "system": "You are a terse assistant. Run abc12345.",
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": [WEATHER_ANTHROPIC], "tool_choice": {"type": "tool", "name": "get_weather"},
    }
    extra = {"temperature": 0}
    if stream:
        with a.messages.stream(**body, extra_body=extra) as s:
            turn_id = s.response.headers["x-turn-id"]
            message = s.get_final_message()
    else:
        raw = a.messages.with_raw_response.create(**body, extra_body=extra)
        turn_id = raw.headers["x-turn-id"]
        message = raw.parse()
    uses = [b for b in message.content if b.type == "tool_use"]
    assert uses and uses[0].name == "get_weather" and message.stop_reason == "tool_use"

    first = gateway.stored_turn(turn_id)
    assert first["wire_format"] == "messages" and first["capture"] == "white-box"
    call = first["response"]["tool_calls"][0]
    assert call["id"] == uses[0].id
    arguments = call["function"]["arguments"]
    parsed = json.loads(arguments)
    assert uses[0].input == (parsed if isinstance(parsed, dict) else {})  # input is an object, always
    _reply_ids_are_vllms(vllm_server, first, _vllm_chat(vllm_server, messages_to_chat({**body, **extra})), arguments)

    # tool_result in the next request: the round trip, stitched, the result as next state
    body["messages"] += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in message.content]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                                       "content": "18 C, sunny"}]}]
    body.pop("tool_choice")
    body["max_tokens"] = 20
    raw2 = a.messages.with_raw_response.create(**body, extra_body=extra)
    assert raw2.parse().content
    second = gateway.stored_turn(raw2.headers["x-turn-id"])
    assert second["parent_turn_id"] == first["id"] and second["session_id"] == sid
    # the model's own arguments text comes back in the history, though the client sent an object
    assert second["request"]["messages"][2]["tool_calls"][0]["function"]["arguments"] == arguments
    first = wait_for(lambda: (t := gateway.stored_turn(first["id"])) and t["next_state"] and t)
    assert first["next_state"]["messages"] == [{"role": "tool", "tool_call_id": uses[0].id, "content": "18 C, sunny"}]


def test_count_tokens_is_vllms_prompt_length(gateway: GatewayProcess) -> None:
    a = claude(gateway.url)
    messages = [{"role": "user", "content": f"Count me. {run_id()}"}]
    counted = a.messages.count_tokens(model="smollm2", messages=messages)  # type: ignore[arg-type]
    m = a.messages.create(model="smollm2", max_tokens=4, messages=messages)  # type: ignore[arg-type]
    assert counted.input_tokens == m.usage.input_tokens > 0


# --- errors in each client's dialect -----------------------------------------------------------


def test_bad_input_answers_in_each_routes_dialect(gateway: GatewayProcess) -> None:
    url = gateway.url
    # Chat Completions and Responses: OpenAI's {"error": {...}}
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": "smollm2", "messages": []})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(f"{url}/v1/responses", json={"model": "smollm2"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"
    r = httpx.post(f"{url}/v1/responses", json={"model": "smollm2", "input": "hi", "previous_response_id": "resp_nope"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "previous_response_not_found"
    r = httpx.get(f"{url}/v1/responses/resp_nope")
    assert r.status_code == 404 and "error" in r.json()
    with pytest.raises(Exception) as exc:
        oai(gateway.base_url).responses.create(model="no-such-model", input="hi")
    assert getattr(exc.value, "status_code", None) == 404
    # Messages: Anthropic's {"type": "error", "error": {"type", "message"}}, via its SDK
    a = claude(url)
    cases = [
        ({"model": "smollm2", "messages": [{"role": "user", "content": "hi"}]}, 400, "invalid_request_error", "max_tokens"),
        ({"model": "smollm2", "max_tokens": 4, "messages": [{"role": "robot", "content": "hi"}]}, 400, "invalid_request_error", "role"),
        ({"model": "no-such-model", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}, 404, "not_found_error", "no-such-model"),
        ({"model": "smollm2", "max_tokens": 4, "messages": [{"role": "user", "content": "word " * 9000}]}, 400, "invalid_request_error", "prompt is too long"),
    ]
    for body, status, kind, words in cases:
        r = httpx.post(f"{url}/v1/messages", json=body, timeout=60)
        assert r.status_code == status, r.text
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == kind and words in r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/messages", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError) as bad:
        a.messages.create(model="smollm2", max_tokens=4, messages=[{"role": "user", "content": "word " * 9000}])
    assert re.fullmatch(r"prompt is too long: \d+ tokens > 8192 maximum", bad.value.body["error"]["message"])  # type: ignore[index]
    # the context-length error on the OpenAI routes carries OpenAI's code
    r = httpx.post(f"{url}/v1/responses", json={"model": "smollm2", "input": "word " * 9000, "max_output_tokens": 4}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_upstream_down_is_anthropics_overloaded_error(tmp_path: Any) -> None:
    dead = f"http://127.0.0.1:{free_port()}/v1"
    key = f"sk-{run_id()}"
    with GatewayProcess(tmp_path, database_url=f"sqlite:///{tmp_path / 'pool.db'}", upstream_url=dead,
                        env={"NEXTSTATE_API_KEYS": key}) as gw:
        hi = [{"role": "user", "content": "hi"}]
        # Anthropic's SDK sends its key as x-api-key: accepted like a bearer token, refused in its dialect
        with pytest.raises(anthropic.AuthenticationError) as denied:
            anthropic.Anthropic(base_url=gw.url, api_key="sk-wrong", max_retries=0).messages.create(
                model="smollm2", max_tokens=4, messages=hi)  # type: ignore[arg-type]
        assert denied.value.status_code == 401 and denied.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
        with pytest.raises(anthropic.APIStatusError) as exc:
            anthropic.Anthropic(base_url=gw.url, api_key=key, max_retries=0).messages.create(
                model="smollm2", max_tokens=4, messages=hi)  # type: ignore[arg-type]
        assert exc.value.status_code == 529
        assert exc.value.body["error"]["type"] == "overloaded_error"  # type: ignore[index]
        assert exc.value.response.headers["retry-after"] == "2"
        r = httpx.post(f"{gw.url}/v1/responses", json={"model": "smollm2", "input": "hi"},
                       headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
        assert r.headers["retry-after"] == "2"


# --- black-box upstreams ------------------------------------------------------------------------


def test_black_box_provider_speaks_both_formats(vllm_server: RunningVLLM, tmp_path: Any) -> None:
    """An opaque LiteLLM provider (`openai/...`, here vLLM's OpenAI server) behind both new routes:
    the same replies and events, captured text-only."""
    import yaml

    models = tmp_path / "models.yaml"
    models.write_text(yaml.safe_dump({"model_list": [{"model_name": "provider-model", "litellm_params": {
        "model": "openai/smollm2", "api_base": vllm_server.base_url, "api_key": "sk-unused"}}]}))
    with GatewayProcess(tmp_path, database_url=f"sqlite:///{tmp_path / 'pool.db'}", model_list=models) as gw:
        prompt = f"Say hello. {run_id()}"
        c = oai(gw.base_url)
        raw = c.responses.with_raw_response.create(model="provider-model", input=prompt, max_output_tokens=8,
                                                   temperature=0)
        text = raw.parse().output_text
        streamed = list(c.responses.create(model="provider-model", input=prompt, max_output_tokens=8,
                                           temperature=0, stream=True))
        a = claude(gw.url)
        with a.messages.stream(model="provider-model", max_tokens=8, messages=[{"role": "user", "content": prompt}],
                               extra_body={"temperature": 0}) as s:
            m_turn = s.response.headers["x-turn-id"]
            message = s.get_final_message()
        stored = gw.stored_turn(raw.headers["x-turn-id"])
        m_stored = gw.stored_turn(m_turn)
    assert text and streamed[-1].response.output_text == text
    assert message.content[0].text == text  # type: ignore[union-attr]
    for t, fmt in ((stored, "responses"), (m_stored, "messages")):
        assert t["capture"] == "black-box" and t["wire_format"] == fmt and t["response"]["content"] == text
        assert t["token_ids"] is None and t["prompt_token_ids"] is None


def test_a_tool_calls_own_arguments_come_back_through_another_replica(pg_url: str, tmp_path: Path) -> None:
    """A tool call answered on /v1/messages by one gateway replica and sent back (as an `input`
    object) to another: the second finds the model's own arguments text in the pool, so the next
    prompt holds it and the turn stitches to its parent, also where the text was not a JSON
    object (the client was given `{}`). The upstream answers with the arguments text asked for
    (tests/support/upstream.py), so both spellings are sure to differ from LiteLLM's `json.dumps`."""
    import yaml

    from tests.support.upstream import TOOL_CALL_MARK, UpstreamProcess

    with UpstreamProcess(tmp_path / "upstream.log") as up:
        models = tmp_path / "models.yaml"
        models.write_text(yaml.safe_dump({"model_list": [{"model_name": "fixed", "litellm_params": {
            "model": "hosted_vllm/fixed", "api_base": up.base_url}}]}))
        (tmp_path / "a").mkdir()
        (tmp_path / "b").mkdir()
        with GatewayProcess(tmp_path / "a", database_url=pg_url, model_list=models) as a, \
                GatewayProcess(tmp_path / "b", database_url=pg_url, model_list=models) as b:
            for raw, given in (('{"city":"Paris" ,  "unit": "c"}', {"city": "Paris", "unit": "c"}),
                               ('{"city": "Par', {})):
                body: dict[str, Any] = {"model": "fixed", "max_tokens": 20, "tools": [WEATHER_ANTHROPIC],
                                        "messages": [{"role": "user", "content": TOOL_CALL_MARK + raw}]}
                first_raw = claude(a.url).messages.with_raw_response.create(**body)
                (use,) = [c for c in first_raw.parse().content if c.type == "tool_use"]
                assert use.input == given
                first = a.stored_turn(first_raw.headers["x-turn-id"])
                assert first["response"]["tool_calls"][0]["function"]["arguments"] == raw
                body["messages"] += [
                    {"role": "assistant", "content": [c.model_dump(exclude_none=True) for c in first_raw.parse().content]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18 C"}]}]
                second_raw = claude(b.url).messages.with_raw_response.create(**body)  # the other replica
                second = b.stored_turn(second_raw.headers["x-turn-id"])
                assert second["request"]["messages"][1]["tool_calls"][0]["function"]["arguments"] == raw
                assert second["parent_turn_id"] == first["id"] and second["session_id"] == first["session_id"]
