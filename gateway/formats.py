"""The OpenAI Responses API and the Anthropic Messages API, spoken over Chat Completions.

A `/v1/responses` or `/v1/messages` call is translated to a Chat Completions request on its way
to the upstream (for vLLM with ``return_token_ids`` and ``logprobs``, as every chat call), and
the reply, whole or streamed, is translated back event by event. The pool stores the chat view
(messages, tools, reply, tool calls, exact token ids), so stitching, next states, the judge and
the trainer see one shape whatever the client spoke; ``turns.wire_format`` says which it was.

Requests are translated by LiteLLM's own adapters (``LiteLLMAnthropicMessagesAdapter`` and
``LiteLLMCompletionResponsesConfig``), imported at the first such request (LiteLLM takes seconds
of CPU to import; a gateway that serves Chat Completions alone never does). Replies are
translated here, on plain dicts: LiteLLM's reply translators take its pydantic ``ModelResponse``
objects (one per streamed chunk, more CPU per event than the whole relay) and know nothing of
vLLM's token ids or stop strings.
docs/wire-formats.md lists what is written here and why.
"""

from __future__ import annotations

import functools
import json
import os
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable
from types import SimpleNamespace
from typing import Any

from cachetools import TTLCache

from base.errors import RequestError
from base.vocab import WireFormat
from gateway.errors import anthropic_error

_PROVIDER = "hosted_vllm"


@functools.cache
def _litellm() -> SimpleNamespace:
    """LiteLLM's request translators, imported once, at the first request that needs them."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no cost-map download at import
    import litellm
    from litellm.llms.anthropic.messages.adapters.transformation import LiteLLMAnthropicMessagesAdapter
    from litellm.responses.litellm_completion_transformation.transformation import (
        LiteLLMCompletionResponsesConfig,
    )

    litellm.suppress_debug_info = True  # its provider lookup prints a banner for a vLLM model name
    return SimpleNamespace(anthropic=LiteLLMAnthropicMessagesAdapter(), responses=LiteLLMCompletionResponsesConfig,
                           BadRequestError=litellm.BadRequestError)

# Responses request fields that are not sampling parameters: the gateway handles them itself.
_RESPONSES_OWN = frozenset({"model", "input", "previous_response_id", "store", "stream", "include",
                            "background", "conversation", "prompt_cache_key", "safety_identifier",
                            "service_tier", "truncation", "stream_options"})
# Responses fields LiteLLM translates; any other field passes through to the upstream as is.
_RESPONSES_KNOWN = frozenset({"instructions", "tools", "tool_choice", "parallel_tool_calls", "text",
                              "reasoning", "max_output_tokens", "temperature", "top_p", "user",
                              "metadata", "top_logprobs", "prompt", "max_tool_calls"})
# What a Response object echoes back from its request.
_RESPONSES_ECHO = ("instructions", "max_output_tokens", "metadata", "parallel_tool_calls",
                   "previous_response_id", "temperature", "tool_choice", "tools", "top_p", "user",
                   "text", "reasoning", "store")


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _clean_message(m: dict[str, Any]) -> dict[str, Any]:
    """A translated message as the chat view keeps it: no None-valued keys (LiteLLM adds
    ``thinking_blocks: None``), no stream ``index`` on replayed tool calls."""
    out = {k: v for k, v in m.items() if v is not None or k == "content"}
    if out.get("tool_calls"):
        out["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in out["tool_calls"]]
    return out


class _SentArguments:
    """The arguments string of each tool call answered on /v1/messages, by id.

    Anthropic clients send a tool call back as a parsed `input` object; LiteLLM writes it out
    again with ``json.dumps``, which need not be the model's own text (spacing, key order, a
    bare string where guided decoding made one). The next prompt should hold the model's own
    tokens, and prefix stitching must find the call it answered, so the model's own string is
    put back. Its source is the pool (``tool_call_arguments``, written with each captured turn),
    so any replica, before or after a restart, finds it: the gateway asks the pool for the ids
    this map does not hold (:meth:`unknown`, :meth:`learn`). The map is a bounded cache in front
    of it that also covers a call whose turn is not written yet.

    Ids the pool did not hold either (history from another provider, a pool emptied since) are
    remembered as absent for ``absent_ttl_s``, so a long conversation of such calls costs one
    lookup per id and interval rather than one per request. The entry expires because "not in
    the pool" can be momentary: another replica may answer a call and write its turn a moment
    after this replica looked.
    """

    def __init__(self, size: int = 65536, absent_ttl_s: float = 30.0,
                 timer: Callable[[], float] = time.monotonic):
        self.size = size
        self.by_id: OrderedDict[str, str] = OrderedDict()
        self.absent: TTLCache[str, bool] = TTLCache(maxsize=size, ttl=absent_ttl_s, timer=timer)

    def remember(self, call_id: str, arguments: str) -> None:
        self.by_id[call_id] = arguments
        if len(self.by_id) > self.size:
            self.by_id.popitem(last=False)

    def learn(self, found: dict[str, str], asked: Iterable[str] = ()) -> None:
        """Remember what the pool *found*; the ids *asked* for that it did not hold are absent."""
        for call_id, arguments in found.items():
            self.remember(call_id, arguments)
        for call_id in asked:
            if call_id not in found:
                self.absent[call_id] = True

    def unknown(self, messages: list[dict[str, Any]]) -> list[str]:
        """The ids of the assistant tool calls in *messages* this map does not hold and the pool
        was not just asked for in vain."""
        return [call["id"] for m in messages if m.get("role") == "assistant" for call in m.get("tool_calls") or ()
                if isinstance(call.get("id"), str) and call["id"] not in self.by_id and call["id"] not in self.absent]

    def restore(self, messages: list[dict[str, Any]]) -> None:
        for m in messages:
            for call in m.get("tool_calls") or ():
                sent = self.by_id.get(call.get("id") or "")
                fn = call.get("function") or {}
                if sent is not None and _arguments(sent) == _arguments(fn.get("arguments") or ""):
                    fn["arguments"] = sent


SENT_ARGUMENTS = _SentArguments()


def messages_to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """An Anthropic Messages request as a Chat Completions request (LiteLLM's adapter)."""
    try:
        chat, _ = _litellm().anthropic.translate_anthropic_to_openai(body, custom_llm_provider=_PROVIDER)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise RequestError(400, f"invalid request: {type(exc).__name__}: {exc}", code="invalid_request") from exc
    chat = dict(chat)
    chat["messages"] = [_clean_message(dict(m)) for m in chat["messages"]]
    if SENT_ARGUMENTS.by_id:
        SENT_ARGUMENTS.restore(chat["messages"])
    return chat


def responses_to_chat(body: dict[str, Any], history: list[dict[str, Any]]) -> dict[str, Any]:
    """A Responses request as a Chat Completions request (LiteLLM's translation of `input`,
    `instructions`, `tools`, `text`...); *history* is the conversation `previous_response_id`
    names, read from the pool, which the new input continues."""
    params = {k: v for k, v in body.items() if k in _RESPONSES_KNOWN}
    lib = _litellm()
    try:
        chat = lib.responses.transform_responses_api_request_to_chat_completion_request(
            model=body["model"], input=body["input"], responses_api_request=params,
            custom_llm_provider=_PROVIDER, stream=bool(body.get("stream")))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise RequestError(400, f"invalid request: {exc}", code="invalid_request", param="input") from exc
    except lib.BadRequestError as exc:
        raise RequestError(400, str(exc.message), code="invalid_request", param="input") from exc
    chat = {k: v for k, v in chat.items() if k not in ("custom_llm_provider", "litellm_metadata")}
    if not chat.get("stream"):
        chat.pop("stream", None)
    messages = [_clean_message(dict(m)) for m in chat["messages"]]
    if history:
        # `instructions` are not carried over from the previous response: this request's own
        # system message, if any, stands where the history's was
        own_system = [m for m in messages if m.get("role") in ("system", "developer")]
        rest = [m for m in messages if m.get("role") not in ("system", "developer")]
        head = [m for m in history if m.get("role") in ("system", "developer")]
        tail = history[len(head):] if history[: len(head)] == head else history
        messages = (own_system or head) + tail + rest
    chat["messages"] = messages
    for k, v in body.items():  # unknown fields pass through
        if k not in _RESPONSES_OWN and k not in _RESPONSES_KNOWN and k not in chat:
            chat[k] = v
    return chat


# --- replies --------------------------------------------------------------------------------------


def _usage_counts(obj: dict[str, Any], acc_usage: dict[str, Any] | None) -> tuple[int, int]:
    u = obj.get("usage") or acc_usage or {}
    return int(u.get("prompt_tokens") or 0), int(u.get("completion_tokens") or 0)


def _arguments(raw: str) -> Any:
    try:
        value = json.loads(raw) if raw else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


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
            + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n")


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
            content.append({"type": "tool_use", "id": c["id"], "name": c["name"], "input": _arguments(c["arguments"])})
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


REPLIES: dict[str, type[Reply]] = {WireFormat.RESPONSES: ResponsesReply, WireFormat.MESSAGES: MessagesReply}


def responses_object(turn_response: dict[str, Any], request: dict[str, Any], model: str,
                     prompt_tokens: int, completion_tokens: int, created: int) -> dict[str, Any]:
    """A stored turn's reply as the Response object `GET /v1/responses/{id}` returns."""
    reply = ResponsesReply(model, request, turn_response.get("id"))
    reply.created = created
    choice = (turn_response.get("choices") or [{}])[0]
    obj = {"choices": [choice], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}}
    return reply.whole(obj)
