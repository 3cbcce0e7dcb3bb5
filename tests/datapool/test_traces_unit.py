"""The span attributes of a stored turn (datapool.traces), for the shapes the Phoenix test does not
send: tool calls and their results, a completions prompt list, a failed call, a black-box provider,
content left off. tests/datapool/test_traces.py sends real turns to a real receiver."""

from __future__ import annotations

import json
import uuid
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from datapool.db import utcnow
from datapool.records import TurnRecord
from base.settings import Settings
from datapool.traces import span_id_of, trace_id_of, traces, turn_attributes


def _record(**kw: Any) -> TurnRecord:
    base: dict[str, Any] = dict(id=uuid.uuid4().hex, created_at=utcnow(), endpoint="chat", status="ok",
                                model="policy", capture="white-box", request={"messages": [], "params": {}},
                                policy_version="v3", upstream_model="smollm2")
    return TurnRecord(**(base | kw))


def test_tool_calls_and_results_in_the_conventions_shape() -> None:
    record = _record(request={"messages": [
        {"role": "developer", "content": [{"type": "text", "text": "Use tools."}]},
        {"role": "user", "content": [{"type": "text", "text": "weather?"}, {"type": "image_url", "image_url": {"url": "data:x"}}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "rainy"}],
        "tools": [{"type": "function", "function": {"name": "get_weather"}}], "params": {"stop": "END", "n": 2}},
        response={"id": "chatcmpl-9", "model": "v3", "choices": [
            {"index": 0, "finish_reason": "tool_calls", "message": {"role": "assistant", "content": None,
                                                                   "reasoning_content": "think", "tool_calls": [
                {"id": "c2", "function": {"name": "get_weather", "arguments": "not json"}}]}}]},
        usage={"prompt_tokens": 40, "completion_tokens": 7})
    a = turn_attributes(record, "s1", content=True)
    assert json.loads(a["gen_ai.system_instructions"]) == [{"type": "text", "content": "Use tools."}]
    inputs = json.loads(a["gen_ai.input.messages"])
    assert inputs[0] == {"role": "user", "parts": [{"type": "text", "content": "weather?"}, {"type": "image_url"}]}
    assert inputs[1]["parts"] == [{"type": "tool_call", "id": "c1", "name": "get_weather", "arguments": {"city": "Paris"}}]
    assert inputs[2] == {"role": "tool", "parts": [{"type": "tool_call_response", "id": "c1", "response": "rainy"}]}
    assert json.loads(a["gen_ai.output.messages"]) == [{"role": "assistant", "finish_reason": "tool_calls", "parts": [
        {"type": "reasoning", "content": "think"},
        {"type": "tool_call", "id": "c2", "name": "get_weather", "arguments": "not json"}]}]
    assert json.loads(a["gen_ai.tool.definitions"]) == record.request["tools"]
    assert a["gen_ai.request.stop_sequences"] == ["END"] and a["gen_ai.request.choice.count"] == 2
    assert a["gen_ai.response.finish_reasons"] == ["tool_calls"] and a["gen_ai.response.id"] == "chatcmpl-9"
    assert (a["gen_ai.usage.input_tokens"], a["gen_ai.usage.output_tokens"]) == (40, 7)
    assert a["gen_ai.provider.name"] == "vllm" and a["nextstate.policy.version"] == "v3"


def test_completions_black_box_error_and_no_content() -> None:
    record = _record(endpoint="completions", capture="black-box", policy_version=None,
                     upstream_model="anthropic/claude-x", status="error", request={"prompt": ["a", "b"], "params": {}},
                     error={"code": "context_length_exceeded", "message": "too long"}, tenant="acme",
                     redaction={"counts": {"email": 2}})
    a = turn_attributes(record, "s2", content=True)
    assert a["gen_ai.operation.name"] == "text_completion" and a["gen_ai.provider.name"] == "anthropic"
    assert [m["parts"][0]["content"] for m in json.loads(a["gen_ai.input.messages"])] == ["a", "b"]
    assert a["error.type"] == "context_length_exceeded" and a["nextstate.tenant"] == "acme"
    assert a["nextstate.redacted.email"] == 2 and "nextstate.policy.version" not in a
    bare = turn_attributes(record, "s2", content=False)
    assert not any(k in bare for k in ("gen_ai.input.messages", "gen_ai.output.messages", "gen_ai.system_instructions"))
    assert turn_attributes(_record(policy_version=None, upstream_model="gpt-4o", capture="black-box"), None,
                           content=False)["gen_ai.provider.name"] == "openai"


@given(st.text(min_size=1, max_size=64))
def test_ids_are_valid_and_the_gateways_turn_id_is_its_trace_id(turn_id: str) -> None:
    assert 0 < trace_id_of(turn_id) < 2**128 and 0 < span_id_of(turn_id) < 2**64
    hex_id = uuid.uuid4().hex
    assert f"{trace_id_of(hex_id):032x}" == hex_id


def test_off_by_default_and_needs_no_package_then() -> None:
    assert traces(Settings(), "gateway") is None
