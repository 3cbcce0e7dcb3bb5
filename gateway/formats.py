"""The OpenAI Responses API and the Anthropic Messages API, spoken over Chat Completions.

A `/v1/responses` or `/v1/messages` call is translated to a Chat Completions request on its way
to the upstream (for vLLM with ``return_token_ids`` and ``logprobs``, as every chat call), and
the reply, whole or streamed, is translated back event by event. The pool stores the chat view
(messages, tools, reply, tool calls, exact token ids), so stitching, next states, the judge and
the trainer see one shape whatever the client spoke; ``turns.wire_format`` says which it was.

Requests are translated by LiteLLM's own adapters (``LiteLLMAnthropicMessagesAdapter`` and
``LiteLLMCompletionResponsesConfig``), imported at the first such request, in a worker thread
(LiteLLM takes seconds of CPU to import; a gateway that serves Chat Completions alone never does). The replies are
translated back by gateway.replies. docs/wire-formats.md lists what is written here and why.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import gc
import json
import os
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable
from types import SimpleNamespace
from typing import Any

from cachetools import TTLCache

from base.errors import RequestError

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
    _skip_replay_check_without_reasoning_blocks()
    # about a million objects that live as long as the process: out of the collector's
    # generations, or every full collection walks them all (hundreds of ms on the event loop)
    gc.freeze()
    return SimpleNamespace(anthropic=LiteLLMAnthropicMessagesAdapter(), responses=LiteLLMCompletionResponsesConfig,
                           BadRequestError=litellm.BadRequestError)

_LOADING = threading.Lock()

# Set while messages_to_chat translates a request none of whose messages holds a thinking or
# redacted_thinking block (see _skip_replay_check_without_reasoning_blocks).
_NO_REASONING_BLOCKS: contextvars.ContextVar[bool] = contextvars.ContextVar("no_reasoning_blocks", default=False)
_REASONING_BLOCKS = frozenset({"thinking", "redacted_thinking"})


def _has_reasoning_blocks(messages: Any) -> bool:
    """Whether any message's content holds a block LiteLLM's adapter may strip as another
    provider's encrypted reasoning (``thinking``, ``redacted_thinking``)."""
    if not isinstance(messages, list):
        return True  # not the shape looked at here: let LiteLLM decide
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list) and any(isinstance(b, dict) and b.get("type") in _REASONING_BLOCKS
                                             for b in content):
            return True
    return False


def _skip_replay_check_without_reasoning_blocks() -> None:
    """LiteLLM's Messages adapter asks, for every request, whether the route ends in OpenAI's
    Responses API (its provider registry and model-cost map: about a sixth of the gateway's CPU per
    /v1/messages call), only to choose between the messages as sent and the messages with
    encrypted reasoning blocks stripped. Without a thinking or redacted_thinking block the two are
    the same messages, so the answer changes nothing: while messages_to_chat translates such a
    request, the check answers "keep" at once. With one, LiteLLM's own check runs as before."""
    from litellm.llms.anthropic.messages.adapters import transformation

    check = transformation._keeps_encrypted_reasoning_for_responses
    if getattr(check, "skips_without_reasoning_blocks", False):
        return

    @functools.wraps(check)
    def keeps(*args: Any, **kwargs: Any) -> bool:
        return True if _NO_REASONING_BLOCKS.get() else check(*args, **kwargs)

    keeps.skips_without_reasoning_blocks = True  # type: ignore[attr-defined]
    transformation._keeps_encrypted_reasoning_for_responses = keeps


def _load_once() -> None:
    with _LOADING:  # one thread imports; the others wait for it, then find it done
        _litellm()


async def load_translators() -> None:
    """Import LiteLLM's request translators, if not yet, in a worker thread: the import takes
    seconds of CPU, through which the event loop goes on serving the other requests."""
    if not _litellm.cache_info().currsize:
        await asyncio.to_thread(_load_once)


# Responses request fields that are not sampling parameters: the gateway handles them itself.
_RESPONSES_OWN = frozenset({"model", "input", "previous_response_id", "store", "stream", "include",
                            "background", "conversation", "prompt_cache_key", "safety_identifier",
                            "service_tier", "truncation", "stream_options"})
# Responses fields LiteLLM translates; any other field passes through to the upstream as is.
_RESPONSES_KNOWN = frozenset({"instructions", "tools", "tool_choice", "parallel_tool_calls", "text",
                              "reasoning", "max_output_tokens", "temperature", "top_p", "user",
                              "metadata", "top_logprobs", "prompt", "max_tool_calls"})


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
                if sent is not None and arguments_object(sent) == arguments_object(fn.get("arguments") or ""):
                    fn["arguments"] = sent


SENT_ARGUMENTS = _SentArguments()


def messages_to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """An Anthropic Messages request as a Chat Completions request (LiteLLM's adapter)."""
    adapter = _litellm().anthropic
    token = _NO_REASONING_BLOCKS.set(not _has_reasoning_blocks(body.get("messages")))
    try:
        chat, _ = adapter.translate_anthropic_to_openai(body, custom_llm_provider=_PROVIDER)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise RequestError(400, f"invalid request: {type(exc).__name__}: {exc}", code="invalid_request") from exc
    finally:
        _NO_REASONING_BLOCKS.reset(token)
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


def arguments_object(raw: str) -> Any:
    """A tool call's arguments text as the object it encodes; ``{}`` for anything else."""
    try:
        value = json.loads(raw) if raw else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
