"""The reply translators (gateway/replies.py) on varied replies, without a server: a streamed
reply, however vLLM chunks it, must build in each official SDK the same object as the whole
reply; and requests round-trip through LiteLLM's adapters into the chat view the pool keeps."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import pytest
from anthropic.lib.streaming._messages import accumulate_event
from hypothesis import given, settings
from hypothesis import strategies as st
from openai._models import construct_type
from openai.types.responses import Response, ResponseStreamEvent

from base.errors import RequestError
from gateway.errors import anthropic_error, from_upstream
from gateway.formats import messages_to_chat, responses_to_chat
from gateway.replies import MessagesReply, ResponsesReply
from gateway.protocol import MessagesRequest, parse_body

PROMPT = [1, 2, 3, 4, 5]

text_pieces = st.lists(st.text(min_size=1, max_size=6), max_size=6)
arguments = st.dictionaries(st.sampled_from(["city", "unit", "days"]),
                            st.one_of(st.integers(-5, 50), st.text(max_size=8)), max_size=3)
calls = st.lists(st.tuples(st.sampled_from(["get_weather", "add", "search"]), arguments,
                           st.integers(1, 4)), max_size=2)


def _split(s: str, parts: int) -> list[str]:
    size = max(1, -(-len(s) // parts))
    return [s[i:i + size] for i in range(0, len(s), size)] or [""]


def chat_reply(texts: list[str], tool_calls: list[tuple[str, dict[str, Any], int]], finish: str,
               stop: str | None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The same vLLM reply streamed (chunks) and whole."""
    chunks: list[dict[str, Any]] = [{"id": "c", "prompt_token_ids": PROMPT,
                                     "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}]
    n = 0
    for piece in texts:
        chunks.append({"id": "c", "choices": [{"index": 0, "delta": {"content": piece}, "token_ids": [n]}]})
        n += 1
    whole_calls = []
    for i, (name, args, parts) in enumerate(tool_calls):
        raw = json.dumps(args)
        call_id = f"chatcmpl-tool-{i}"
        whole_calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": raw}})
        chunks.append({"id": "c", "choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": i, "id": call_id, "type": "function", "function": {"name": name}}]}, "token_ids": [n]}]})
        n += 1
        for piece in _split(raw, parts):
            chunks.append({"id": "c", "choices": [{"index": 0, "delta": {"tool_calls": [
                {"index": i, "function": {"arguments": piece}}]}, "token_ids": [n]}]})
            n += 1
    chunks.append({"id": "c", "choices": [{"index": 0, "delta": {}, "finish_reason": finish, "stop_reason": stop}]})
    whole = {"id": "c", "prompt_token_ids": PROMPT, "usage": {"prompt_tokens": len(PROMPT), "completion_tokens": n},
             "choices": [{"index": 0, "finish_reason": finish, "stop_reason": stop,
                          "message": {"role": "assistant", "content": "".join(texts) or None,
                                      "tool_calls": whole_calls}}]}
    return chunks, whole


def _events(reply: Any, chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[bytes] = []
    for c in chunks:
        out += reply.chunk(c)
    out += reply.end()
    parsed = []
    for e in out:
        head, data = e.split(b"\ndata: ", 1)
        event = json.loads(data)
        assert head == b"event: " + event["type"].encode() and e.endswith(b"\n\n")
        parsed.append(event)
    return parsed


def _ids_out(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _ids_out(v) for k, v in node.items() if k not in ("id", "item_id", "created_at", "sequence_number")}
    if isinstance(node, list):
        return [_ids_out(v) for v in node]
    return node


replies = st.tuples(text_pieces, calls, st.sampled_from(["stop", "length", "tool_calls"]),
                    st.sampled_from([None, "END"]))


@settings(max_examples=150, deadline=None)
@given(reply=replies)
def test_messages_stream_builds_the_whole_message(reply: tuple[Any, ...]) -> None:
    chunks, whole = chat_reply(*reply)
    request = {"model": "m", "max_tokens": 9, "messages": [], "stop_sequences": ["END"]}
    events = _events(MessagesReply("m", request, "msg_1"), chunks)
    snapshot = None
    bufs: dict[int, bytes] = {}
    for e in events:
        snapshot = accumulate_event(event=e, current_snapshot=snapshot, json_bufs=bufs)  # type: ignore[arg-type]
    expected = MessagesReply("m", request, "msg_1").whole(whole)
    assert snapshot is not None
    got = snapshot.model_dump(mode="json", exclude_none=True)
    want = anthropic._models.construct_type(type_=anthropic.types.Message, value=expected).model_dump(  # type: ignore[attr-defined]
        mode="json", exclude_none=True)
    assert got == want
    assert [e["type"] for e in events][-2:] == ["message_delta", "message_stop"]
    texts, tool_calls, finish, stop = reply
    assert expected["stop_reason"] == ("tool_use" if tool_calls else "max_tokens" if finish == "length"
                                       else "stop_sequence" if stop == "END" else "end_turn")
    assert [b["input"] for b in expected["content"] if b["type"] == "tool_use"] == [a for _, a, _ in tool_calls]


@settings(max_examples=150, deadline=None)
@given(reply=replies)
def test_responses_stream_ends_with_the_whole_response(reply: tuple[Any, ...]) -> None:
    chunks, whole = chat_reply(*reply)
    request = {"model": "m", "input": "hi"}
    events = _events(ResponsesReply("m", request, "resp_1"), chunks)
    parsed = [construct_type(type_=ResponseStreamEvent, value=e) for e in events]  # type: ignore[arg-type]
    assert [type(p).__name__ for p in parsed] and all(p.type == e["type"] for p, e in zip(parsed, events))  # type: ignore[union-attr]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    expected = ResponsesReply("m", request, "resp_1").whole(whole)
    final = events[-1]
    assert final["type"] == ("response.incomplete" if reply[2] == "length" else "response.completed")
    want = construct_type(type_=Response, value=expected).model_dump(mode="json")  # type: ignore[arg-type]
    got = construct_type(type_=Response, value=final["response"]).model_dump(mode="json")  # type: ignore[arg-type]
    assert _ids_out(got) == _ids_out(want)
    # text deltas add up to the text, argument deltas to the arguments
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == "".join(reply[0])
    args = [e["arguments"] for e in events if e["type"] == "response.function_call_arguments.done"]
    assert [json.loads(a) for a in args] == [a for _, a, _ in reply[1]]


def test_non_object_arguments_are_an_empty_input_in_both() -> None:
    """vLLM's guided decoding can write a bare JSON string as a tool's arguments."""
    chunks, whole = chat_reply([], [("get_weather", {}, 1)], "tool_calls", None)
    for c in chunks:
        for choice in c["choices"]:
            for call in choice["delta"].get("tool_calls") or ():
                if "arguments" in call.get("function", {}):
                    call["function"]["arguments"] = '"Paris"'
    whole["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] = '"Paris"'
    events = _events(MessagesReply("m", {}, "msg_1"), chunks)
    assert not [e for e in events if e.get("delta", {}).get("type") == "input_json_delta"]
    assert MessagesReply("m", {}, "msg_1").whole(whole)["content"][0]["input"] == {}


# --- requests --------------------------------------------------------------------------------


def test_messages_request_becomes_the_chat_the_pool_keeps() -> None:
    chat = messages_to_chat({
        "model": "m", "max_tokens": 5, "system": "Be brief.", "stop_sequences": ["X"], "top_k": 3,
        "metadata": {"user_id": "u1"},
        "messages": [{"role": "user", "content": "hi"},
                     {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "add", "input": {"a": 1}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "2"}]}],
        "tools": [{"name": "add", "input_schema": {"type": "object"}}]})
    assert chat["messages"][0] == {"role": "system", "content": "Be brief."}
    assert chat["messages"][2]["tool_calls"][0]["id"] == "t1" and "thinking_blocks" not in chat["messages"][2]
    assert chat["messages"][3] == {"role": "tool", "tool_call_id": "t1", "content": "2"}
    assert chat["stop"] == ["X"] and chat["max_tokens"] == 5 and chat["top_k"] == 3 and chat["user"] == "u1"


def test_a_system_message_mid_conversation_is_accepted_and_kept_in_place() -> None:
    """Claude Code's first request, with Anthropic's mid-conversation-tool-changes beta, carries a
    `role: "system"` message inside `messages`; refusing it cost every run one failed call."""
    raw = json.dumps({"model": "m", "max_tokens": 5, "system": "S0", "messages": [
        {"role": "user", "content": "hi"},
        {"role": "system", "content": [{"type": "text", "text": "Tools changed: grep is gone."}]},
        {"role": "user", "content": "go on"}]}).encode()
    chat = messages_to_chat(parse_body(raw, MessagesRequest))
    assert [m["role"] for m in chat["messages"]] == ["system", "user", "user", "user"]
    assert "Tools changed: grep is gone." in json.dumps(chat["messages"][2])
    with pytest.raises(RequestError) as refused:  # any other role is still the client's error
        parse_body(raw.replace(b'"role": "system", "content": [', b'"role": "tool", "content": ['), MessagesRequest)
    assert refused.value.status == 400


def test_responses_request_continues_the_stored_history() -> None:
    history = [{"role": "system", "content": "old"}, {"role": "user", "content": "hi"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}]}]
    chat = responses_to_chat({"model": "m", "input": [{"type": "function_call_output", "call_id": "c1", "output": "2"}],
                              "seed": 7, "store": False, "previous_response_id": "resp_x"}, history)
    assert chat["messages"] == history + [{"role": "tool", "tool_call_id": "c1", "content": "2"}]
    assert chat["seed"] == 7 and "store" not in chat and "previous_response_id" not in chat
    with_instructions = responses_to_chat({"model": "m", "input": "more", "instructions": "new"}, history)
    assert with_instructions["messages"][0] == {"role": "system", "content": "new"}
    assert with_instructions["messages"][1:] == history[1:] + [{"role": "user", "content": "more"}]


def test_errors_in_anthropics_dialect() -> None:
    assert anthropic_error(RequestError(502, "down")) == (529, {"type": "error", "error": {
        "type": "overloaded_error", "message": "down"}})
    assert anthropic_error(RequestError(404, "no model"))[1]["error"]["type"] == "not_found_error"
    vllm = ("This model's maximum context length is 8192 tokens. However, your request has 9010 input tokens. "
            "Please reduce the length of the input messages.")
    err = from_upstream(400, {"error": {"message": vllm}}, "fallback")  # how the gateway reads vLLM's 400
    assert err.code == "context_length_exceeded"  # on the OpenAI routes
    assert anthropic_error(err) == (400, {"type": "error", "error": {
        "type": "invalid_request_error", "message": "prompt is too long: 9010 tokens > 8192 maximum"}})
    other = from_upstream(400, {"error": {"message": "temperature must be >= 0"}}, "fallback")
    assert anthropic_error(other) == (400, {"type": "error", "error": {
        "type": "invalid_request_error", "message": "temperature must be >= 0"}})


def test_tool_call_ids_the_pool_lacks_are_not_asked_for_again_until_they_expire() -> None:
    """History from another provider carries tool-call ids no replica answered: the pool is asked
    for each once, then not again while the absence is remembered, and again once it expires
    (another replica may have written the turn since). What the pool holds is restored."""
    from gateway.formats import _SentArguments

    now = [0.0]
    sent = _SentArguments(absent_ttl_s=30.0, timer=lambda: now[0])
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "toolu_a", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
            {"id": "toolu_b", "type": "function", "function": {"name": "f", "arguments": '{"x": 2}'}}]}]
    asked = sent.unknown(messages)
    assert asked == ["toolu_a", "toolu_b"]
    sent.learn({"toolu_a": '{"x":1}'}, asked=asked)  # the pool holds a (the model's own spacing), not b
    sent.restore(messages)
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == '{"x":1}'
    assert messages[1]["tool_calls"][1]["function"]["arguments"] == '{"x": 2}'
    now[0] = 29.0
    assert sent.unknown(messages) == []  # a known, b remembered as absent
    now[0] = 31.0
    assert sent.unknown(messages) == ["toolu_b"]  # b's absence expired: ask again
    sent.learn({"toolu_b": '{"x":2}'}, asked=["toolu_b"])
    assert sent.unknown(messages) == []


# Anthropic content blocks of every kind the adapter translates, reasoning blocks among them
_plain_blocks = st.one_of(
    st.builds(lambda t: {"type": "text", "text": t}, st.text(max_size=12)),
    st.builds(lambda i, n: {"type": "tool_use", "id": f"toolu_{i}", "name": n, "input": {"city": "Paris"}},
              st.integers(0, 3), st.sampled_from(["get_weather", "add"])),
    st.builds(lambda i, t: {"type": "tool_result", "tool_use_id": f"toolu_{i}", "content": t},
              st.integers(0, 3), st.text(max_size=8)),
)
_reasoning_blocks = st.one_of(
    st.builds(lambda t, s: {"type": "thinking", "thinking": t, "signature": s}, st.text(max_size=8),
              st.sampled_from(["sig", "", "litellm_encrypted_reasoning:abc"])),
    st.builds(lambda d: {"type": "redacted_thinking", "data": d},
              st.sampled_from(["opaque", "litellm_encrypted_reasoning:xyz"])),
)
_anthropic_messages = st.lists(
    st.tuples(st.sampled_from(["user", "assistant"]),
              st.one_of(st.text(min_size=1, max_size=12), st.lists(st.one_of(_plain_blocks, _reasoning_blocks),
                                                                  min_size=1, max_size=3))),
    min_size=1, max_size=4)


@settings(max_examples=80, deadline=None)
@given(turns=_anthropic_messages, model=st.sampled_from(["fixed", "policy", "gpt-5.4", "responses/gpt-5"]))
def test_messages_translation_is_litellms_own_with_the_replay_check_skipped(turns: list[Any], model: str) -> None:
    """Without a thinking block the adapter's replay check is answered at once; the chat request
    is the one LiteLLM's own check gives, with and without reasoning blocks in the history."""
    from litellm.llms.anthropic.messages.adapters import transformation

    from gateway import formats

    body = {"model": model, "max_tokens": 8, "messages": [{"role": r, "content": c} for r, c in turns]}
    ours = messages_to_chat(json.loads(json.dumps(body)))
    skipping = transformation._keeps_encrypted_reasoning_for_responses
    assert getattr(skipping, "skips_without_reasoning_blocks", False)
    transformation._keeps_encrypted_reasoning_for_responses = skipping.__wrapped__  # LiteLLM's own
    try:
        theirs = messages_to_chat(json.loads(json.dumps(body)))
    finally:
        transformation._keeps_encrypted_reasoning_for_responses = skipping
    assert ours == theirs
    has_reasoning = any(isinstance(c, list) and any(b["type"] in ("thinking", "redacted_thinking") for b in c)
                        for _, c in turns)
    assert formats._has_reasoning_blocks(body["messages"]) == has_reasoning
