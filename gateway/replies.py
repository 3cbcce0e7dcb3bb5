"""The replies of the OpenAI Responses API and the Anthropic Messages API, written from the
upstream's Chat Completions reply, whole or event by event.

Their requests are translated on the way in by gateway.formats. Replies are translated here, on
plain dicts: LiteLLM's reply translators take its pydantic ``ModelResponse`` objects (one per
streamed chunk, more CPU per event than the whole relay) and know nothing of vLLM's token ids or
stop strings. docs/wire-formats.md lists what is written here and why.
"""

from __future__ import annotations

import json
import time
from typing import Any

from base.errors import RequestError
from base.jsonfast import dumps
from gateway.errors import anthropic_error
from gateway.formats import SENT_ARGUMENTS, arguments_object, new_id

# What a Response object echoes back from its request.
_RESPONSES_ECHO = ("instructions", "max_output_tokens", "metadata", "parallel_tool_calls",
                   "previous_response_id", "temperature", "tool_choice", "tools", "top_p", "user",
                   "text", "reasoning", "store")


def _usage_counts(obj: dict[str, Any], acc_usage: dict[str, Any] | None) -> tuple[int, int]:
    u = obj.get("usage") or acc_usage or {}
    return int(u.get("prompt_tokens") or 0), int(u.get("completion_tokens") or 0)


class Reply:
    """One reply in the client's wire format: the whole object, or its stream of events.

    The upstream's Chat Completions reply (a whole object, or chunk by chunk) goes in; the
    client's bytes come out. Subclasses write each format's objects and events.
    """

    media = "application/json"

    def __init__(self, model: str, request: dict[str, Any], reply_id: str):
        self.model = model
        self.request = request
        self.id = reply_id
        self.created = int(time.time())
        self.started = False
        self.text: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}  # chat tool-call index -> {id, name, arguments}
        self.finish: str | None = None
        self.stop: Any = None  # vLLM's `stop_reason`: the stop string (or token id) that ended it
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.usage: dict[str, Any] | None = None

    # -- whole -------------------------------------------------------------------------------

    def whole(self, obj: dict[str, Any]) -> dict[str, Any]:
        choice = (obj.get("choices") or [{}])[0]
        msg = choice.get("message") or {}
        if msg.get("content"):
            self.text.append(msg["content"])
        for i, call in enumerate(msg.get("tool_calls") or ()):
            fn = call.get("function") or {}
            self.calls[i] = {"id": call.get("id") or new_id("call"), "name": fn.get("name") or "",
                             "arguments": fn.get("arguments") or ""}
        self.finish = choice.get("finish_reason")
        self.stop = choice.get("stop_reason")
        self.prompt_tokens, self.completion_tokens = _usage_counts(obj, None)
        if not self.completion_tokens and choice.get("token_ids"):
            self.completion_tokens = len(choice["token_ids"])
        if not self.prompt_tokens and obj.get("prompt_token_ids"):
            self.prompt_tokens = len(obj["prompt_token_ids"])
        return self.final()

    def final(self) -> dict[str, Any]:
        raise NotImplementedError

    # -- streamed ------------------------------------------------------------------------------

    def chunk(self, obj: dict[str, Any]) -> list[bytes]:
        """The client's events for one upstream chunk."""
        out: list[bytes] = []
        if obj.get("prompt_token_ids") and not self.prompt_tokens:
            self.prompt_tokens = len(obj["prompt_token_ids"])
        if obj.get("usage"):
            self.prompt_tokens, self.completion_tokens = _usage_counts(obj, None)
            self.usage = obj["usage"]
        if not self.started:
            self.started = True
            out += self.begin()
        for choice in obj.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue
            if choice.get("token_ids") and not self.usage:
                self.completion_tokens += len(choice["token_ids"])
            delta = choice.get("delta") or {}
            if delta.get("content"):
                self.text.append(delta["content"])
                out += self.text_delta(delta["content"])
            for call in delta.get("tool_calls") or ():
                idx = call.get("index", len(self.calls))
                fn = call.get("function") or {}
                slot = self.calls.get(idx)
                if slot is None:
                    slot = self.calls[idx] = {"id": call.get("id") or new_id("call"),
                                              "name": fn.get("name") or "", "arguments": ""}
                    out += self.call_start(idx, slot)
                if fn.get("arguments"):
                    slot["arguments"] += fn["arguments"]
                    out += self.call_delta(idx, slot, fn["arguments"])
            if choice.get("finish_reason") is not None:
                self.finish = choice["finish_reason"]
                self.stop = choice.get("stop_reason")
        return out

    def end(self) -> list[bytes]:
        """The closing events, once the upstream's stream is over."""
        out = [] if self.started else self.begin()
        self.started = True
        return out + self.close()

    def begin(self) -> list[bytes]:
        raise NotImplementedError

    def text_delta(self, text: str) -> list[bytes]:
        raise NotImplementedError

    def call_start(self, idx: int, slot: dict[str, Any]) -> list[bytes]:
        raise NotImplementedError

    def call_delta(self, idx: int, slot: dict[str, Any], delta: str) -> list[bytes]:
        raise NotImplementedError

    def close(self) -> list[bytes]:
        raise NotImplementedError

    def error_event(self, error: RequestError) -> bytes:
        raise NotImplementedError



def _event(name: str, data: dict[str, Any]) -> bytes:
    return (b"event: " + name.encode() + b"\ndata: "
            + dumps(data) + b"\n\n")


# --- OpenAI Responses -----------------------------------------------------------------------------


class ResponsesReply(Reply):
    """A Response object, or its typed `response.*` events."""

    def __init__(self, model: str, request: dict[str, Any], reply_id: str | None = None):
        super().__init__(model, request, reply_id or new_id("resp"))
        self.seq = 0
        self.msg_id = new_id("msg")
        self.open_text = False  # a message item is open
        self.items: list[dict[str, Any]] = []  # finished output items, in order
        self.open_calls: dict[int, tuple[int, str]] = {}  # chat index -> (output index, item id)

    def _ev(self, kind: str, data: dict[str, Any]) -> bytes:
        data = {"type": kind, **data, "sequence_number": self.seq}
        self.seq += 1
        return _event(kind, data)

    def _message_item(self, status: str) -> dict[str, Any]:
        text = "".join(self.text)
        content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status == "completed" else []
        return {"type": "message", "id": self.msg_id, "status": status, "role": "assistant", "content": content}

    def _call_item(self, slot: dict[str, Any], item_id: str, status: str) -> dict[str, Any]:
        return {"type": "function_call", "id": item_id, "call_id": slot["id"], "name": slot["name"],
                "arguments": slot["arguments"] if status == "completed" else "", "status": status}

    def _status(self) -> str:
        return "incomplete" if self.finish == "length" else "completed"

    def response(self, status: str, output: list[dict[str, Any]]) -> dict[str, Any]:
        req = self.request
        obj: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "background": False, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "model": self.model, "output": output,
            "parallel_tool_calls": req.get("parallel_tool_calls", True),
            "tool_choice": req.get("tool_choice", "auto"), "tools": req.get("tools") or [],
            "text": req.get("text") or {"format": {"type": "text"}},
            "truncation": "disabled", "metadata": req.get("metadata") or {},
            "store": req.get("store", True),
        }
        for key in _RESPONSES_ECHO:
            if key not in obj or key in req:
                obj[key] = req.get(key, obj.get(key))
        if status in ("completed", "incomplete"):
            obj["usage"] = {
                "input_tokens": self.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": self.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": self.prompt_tokens + self.completion_tokens,
            }
        else:
            obj["usage"] = None
        return obj

    def final(self) -> dict[str, Any]:
        output = []
        if self.text:
            output.append(self._message_item("completed"))
        for idx in sorted(self.calls):
            output.append(self._call_item(self.calls[idx], new_id("fc"), "completed"))
        return self.response(self._status(), output)

    def begin(self) -> list[bytes]:
        shell = self.response("in_progress", [])
        return [self._ev("response.created", {"response": shell}),
                self._ev("response.in_progress", {"response": shell})]

    def _close_text(self) -> list[bytes]:
        if not self.open_text:
            return []
        self.open_text = False
        idx = len(self.items)
        text = "".join(self.text)
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        item = self._message_item("completed")
        self.items.append(item)
        where = {"item_id": self.msg_id, "output_index": idx, "content_index": 0}
        return [self._ev("response.output_text.done", {**where, "text": text, "logprobs": []}),
                self._ev("response.content_part.done", {**where, "part": part}),
                self._ev("response.output_item.done", {"output_index": idx, "item": item})]

    def text_delta(self, text: str) -> list[bytes]:
        out = []
        idx = len(self.items)
        if not self.open_text:
            self.open_text = True
            out.append(self._ev("response.output_item.added",
                                {"output_index": idx, "item": self._message_item("in_progress")}))
            out.append(self._ev("response.content_part.added", {
                "item_id": self.msg_id, "output_index": idx, "content_index": 0,
                "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}}))
        out.append(self._ev("response.output_text.delta", {
            "item_id": self.msg_id, "output_index": idx, "content_index": 0, "delta": text, "logprobs": []}))
        return out

    def _close_calls(self) -> list[bytes]:
        out = []
        for cidx, (oidx, item_id) in sorted(self.open_calls.items(), key=lambda kv: kv[1][0]):
            slot = self.calls[cidx]
            item = self._call_item(slot, item_id, "completed")
            out.append(self._ev("response.function_call_arguments.done", {
                "item_id": item_id, "output_index": oidx, "name": slot["name"], "arguments": slot["arguments"]}))
            out.append(self._ev("response.output_item.done", {"output_index": oidx, "item": item}))
            self.items.append(item)
        self.open_calls.clear()
        return out

    def call_start(self, idx: int, slot: dict[str, Any]) -> list[bytes]:
        out = self._close_text()
        oidx = len(self.items) + len(self.open_calls)
        item_id = new_id("fc")
        self.open_calls[idx] = (oidx, item_id)
        out.append(self._ev("response.output_item.added",
                            {"output_index": oidx, "item": self._call_item(slot, item_id, "in_progress")}))
        return out

    def call_delta(self, idx: int, slot: dict[str, Any], delta: str) -> list[bytes]:
        oidx, item_id = self.open_calls[idx]
        return [self._ev("response.function_call_arguments.delta",
                         {"item_id": item_id, "output_index": oidx, "delta": delta})]

    def close(self) -> list[bytes]:
        out = self._close_text() + self._close_calls()
        status = self._status()
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        out.append(self._ev(kind, {"response": self.response(status, list(self.items))}))
        return out

    def error_event(self, error: RequestError) -> bytes:
        return self._ev("error", {"code": error.code, "message": error.message, "param": error.param})


# --- Anthropic Messages ---------------------------------------------------------------------------

class MessagesReply(Reply):
    """An Anthropic Message, or its `message_start` ... `message_stop` events."""

    def __init__(self, model: str, request: dict[str, Any], reply_id: str | None = None):
        super().__init__(model, request, reply_id or new_id("msg"))
        self.block = -1  # index of the open content block, -1 when none is open
        self.block_kind: str | None = None

    def _stop_reason(self) -> tuple[str, str | None]:
        if self.calls:
            return "tool_use", None
        if self.finish == "length":
            return "max_tokens", None
        if isinstance(self.stop, str) and self.stop in (self.request.get("stop_sequences") or ()):
            return "stop_sequence", self.stop
        return "end_turn", None

    def _usage(self) -> dict[str, Any]:
        return {"input_tokens": self.prompt_tokens, "output_tokens": self.completion_tokens,
                "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}

    def final(self) -> dict[str, Any]:
        content: list[dict[str, Any]] = []
        if self.text:
            content.append({"type": "text", "text": "".join(self.text)})
        for idx in sorted(self.calls):
            c = self.calls[idx]
            SENT_ARGUMENTS.remember(c["id"], c["arguments"])
            content.append({"type": "tool_use", "id": c["id"], "name": c["name"], "input": arguments_object(c["arguments"])})
        reason, seq = self._stop_reason()
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": reason, "stop_sequence": seq, "usage": self._usage()}

    def begin(self) -> list[bytes]:
        usage = {**self._usage(), "output_tokens": 0}
        return [_event("message_start", {"type": "message_start", "message": {
            "id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": usage}})]

    def _stop_block(self) -> list[bytes]:
        if self.block_kind is None:
            return []
        self.block_kind = None
        return [_event("content_block_stop", {"type": "content_block_stop", "index": self.block})]

    def text_delta(self, text: str) -> list[bytes]:
        out = []
        if self.block_kind != "text":
            out += self._stop_block()
            self.block += 1
            self.block_kind = "text"
            out.append(_event("content_block_start", {"type": "content_block_start", "index": self.block,
                                                      "content_block": {"type": "text", "text": ""}}))
        out.append(_event("content_block_delta", {"type": "content_block_delta", "index": self.block,
                                                  "delta": {"type": "text_delta", "text": text}}))
        return out

    def call_start(self, idx: int, slot: dict[str, Any]) -> list[bytes]:
        out = self._stop_block()
        self.block += 1
        self.block_kind = f"tool{idx}"
        out.append(_event("content_block_start", {"type": "content_block_start", "index": self.block,
                                                  "content_block": {"type": "tool_use", "id": slot["id"],
                                                                    "name": slot["name"], "input": {}}}))
        return out

    def call_delta(self, idx: int, slot: dict[str, Any], delta: str) -> list[bytes]:
        # A tool_use `input` is a JSON object. vLLM's guided decoding can produce other JSON
        # (SmolLM2 writes a bare string at times); the whole reply then says `input: {}`, and the
        # stream must agree, so arguments are relayed only once they are seen to open an object.
        state = slot.get("relayed")
        if state is None:
            head = slot["arguments"].lstrip()
            if not head:
                return []
            state = slot["relayed"] = head.startswith("{")
            delta = slot["arguments"] if state else ""
        if not state or not delta:
            return []
        return [_event("content_block_delta", {"type": "content_block_delta", "index": self.block,
                                               "delta": {"type": "input_json_delta", "partial_json": delta}})]

    def close(self) -> list[bytes]:
        reason, seq = self._stop_reason()
        for c in self.calls.values():
            SENT_ARGUMENTS.remember(c["id"], c["arguments"])
        return self._stop_block() + [
            _event("message_delta", {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": seq},
                                     "usage": {"output_tokens": self.completion_tokens}}),
            _event("message_stop", {"type": "message_stop"}),
        ]

    def error_event(self, error: RequestError) -> bytes:
        return _event("error", anthropic_error(error)[1])




def responses_object(turn_response: dict[str, Any], request: dict[str, Any], model: str,
                     prompt_tokens: int, completion_tokens: int, created: int) -> dict[str, Any]:
    """A stored turn's reply as the Response object `GET /v1/responses/{id}` returns."""
    reply = ResponsesReply(model, request, turn_response.get("id"))
    reply.created = created
    choice = (turn_response.get("choices") or [{}])[0]
    obj = {"choices": [choice], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}}
    return reply.whole(obj)
