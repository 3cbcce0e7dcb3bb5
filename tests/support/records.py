"""Captured turns built in one call, as the gateway's capture hands them to the pool's writer: for
tests (and benchmarks) that write turns through the Stitcher without a gateway in front; and
a case seen in the wild (:func:`openclaw_tool_loop`)."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta, timezone
from typing import Any

from datapool.records import TurnRecord


def turn_record(messages: list[dict[str, Any]], reply: dict[str, Any] | str | None = "ok", *,
                at: datetime | None = None, status: str = "ok", model: str = "m", capture: str = "white-box",
                params: dict[str, Any] | None = None, response_id: str = "chatcmpl-x",
                **fields: Any) -> TurnRecord:
    """A chat turn that sent *messages* and got *reply* (an assistant message, or its text; None:
    no response), created *at* (now by default). A turn whose *status* is not ``ok`` carries the
    error a cancelled call stores unless *fields* give one; *fields* are any other TurnRecord field."""
    message = {"role": "assistant", "content": reply} if isinstance(reply, str) else reply
    response = None if message is None else {
        "id": response_id, "choices": [{"index": 0, "message": message, "finish_reason": "stop"}]}
    if status != "ok":
        fields.setdefault("error", {"message": "client disconnected", "type": status})
    return TurnRecord(id=uuid.uuid4().hex, created_at=at or datetime.now(timezone.utc), endpoint="chat",
                      status=status, model=model, capture=capture,
                      request={"messages": messages, "params": params or {}}, response=response, **fields)


def openclaw_tool_loop() -> list[TurnRecord]:
    """The split seen with OpenClaw: the tool call comes back with its id's dashes removed and
    its arguments re-serialised without spaces, beside a result naming the rewritten id."""
    system = {"role": "system", "content": f"You are a personal assistant. Runtime: {uuid.uuid4().hex}"}
    user = {"role": "user", "content": "[Thu 2026-11-26 14:03 UTC] list the files"}
    call = {"role": "assistant", "content": None, "reasoning_content": None, "tool_calls": [
        {"id": "chatcmpl-tool-82f1a7c0d5e94b6f", "type": "function",
         "function": {"name": "exec", "arguments": '{"command": "ls", "timeout": 10.0}'}}]}
    replayed = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "chatcmpltool82f1a7c0d5e94b6f", "type": "function",
         "function": {"name": "exec", "arguments": '{"command":"ls","timeout":10}'}}]}
    result = {"role": "tool", "tool_call_id": "chatcmpltool82f1a7c0d5e94b6f", "content": "a.txt\nb.txt"}
    answer = {"role": "assistant", "content": "Two files: a.txt and b.txt."}
    at = datetime(2026, 11, 26, tzinfo=timezone.utc)
    return [turn_record([system, user], call, at=at),
            turn_record([system, user, replayed, result], answer, at=at + timedelta(seconds=1))]
