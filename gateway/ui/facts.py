"""What the session page's side panel and the annotation queue show about one turn: the
request's sampling settings, its ``tools``, usage, latency, finish reasons with a warning for
truncated replies, the wire format and capture kind; and a request's user question.

Everything here reads the turn view of :func:`datapool.queries.turn_view` and tolerates any
shape the pool can hold (missing request keys, no usage, an error turn, odd JSON)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

# the settings a reader looks for first, in this order; shown as "not set" when absent
MAIN_SETTINGS = ("temperature", "top_p", "max_tokens", "max_completion_tokens", "stop", "tool_choice",
                 "response_format", "stream")
# request keys that are not settings (or have their own place in the panel)
NOT_SETTINGS = frozenset({"model", "messages", "tools", "functions", "prompt"})
# longer JSON values go into a collapsible block
INLINE_LIMIT = 80
WARN_FINISH = {"length": "Truncated: the reply stopped at the token limit{limit}.",
               "content_filter": "Filtered: the upstream's content filter cut the reply."}
WIRE_FORMATS = {"chat": "Chat Completions", "responses": "Responses API", "messages": "Anthropic Messages",
                "completions": "Completions"}


@dataclass
class Setting:
    name: str
    text: str  # the value as one short line
    block: str | None = None  # pretty JSON when the value is too long for a line


@dataclass
class Facts:
    settings: list[Setting] = field(default_factory=list)
    unset: list[str] = field(default_factory=list)
    tools: list[str] = field(default_factory=list)  # the tools' names
    tools_json: str | None = None
    usage: list[tuple[str, Any]] = field(default_factory=list)
    usage_source: str | None = None  # None: the upstream's usage; else where the counts came from
    latency_ms: float | None = None
    finish: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    wire_format: str = "chat"
    wire_label: str = "Chat Completions"
    endpoint: str | None = None
    capture: str | None = None
    turn_type: str | None = None
    status: str | None = None


def _json(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent, default=str, sort_keys=indent is not None)


def _setting(name: str, value: Any) -> Setting:
    if isinstance(value, str):
        text = value if len(value) <= INLINE_LIMIT else value[:INLINE_LIMIT] + "…"
        return Setting(name, text, None if len(value) <= INLINE_LIMIT else value)
    if value is None or isinstance(value, (bool, int, float)):
        return Setting(name, _json(value))
    line = _json(value)
    if len(line) <= INLINE_LIMIT:
        return Setting(name, line)
    return Setting(name, line[:INLINE_LIMIT] + "…", _json(value, indent=2))


def _tool_name(tool: Any) -> str:
    if not isinstance(tool, dict):
        return "?"
    fn = tool.get("function") if isinstance(tool.get("function"), dict) else tool
    return str(fn.get("name") or tool.get("type") or "?")


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _usage(t: dict[str, Any]) -> tuple[list[tuple[str, Any]], str | None]:
    usage = t.get("usage") if isinstance(t.get("usage"), dict) else None
    if usage:
        prompt = _int(usage.get("prompt_tokens", usage.get("input_tokens")))
        completion = _int(usage.get("completion_tokens", usage.get("output_tokens")))
        rows: list[tuple[str, Any]] = [("prompt", prompt), ("completion", completion)]
        total = _int(usage.get("total_tokens"))
        if total is None and prompt is not None and completion is not None:
            total = prompt + completion
        rows.append(("total", total))
        pd = usage.get("prompt_tokens_details") if isinstance(usage.get("prompt_tokens_details"), dict) else {}
        cd = usage.get("completion_tokens_details") if isinstance(usage.get("completion_tokens_details"), dict) else {}
        if _int(pd.get("cached_tokens")):
            rows.append(("cached prompt", pd["cached_tokens"]))
        if _int(cd.get("reasoning_tokens")):
            rows.append(("reasoning", cd["reasoning_tokens"]))
        return [(k, v) for k, v in rows if v is not None], None
    prompt_ids, ids = t.get("prompt_token_ids"), t.get("token_ids")
    if isinstance(prompt_ids, list) or isinstance(ids, list):
        rows = [("prompt", len(prompt_ids) if isinstance(prompt_ids, list) else None),
                ("completion", len(ids) if isinstance(ids, list) else None)]
        return [(k, v) for k, v in rows if v is not None], "counted from the captured token ids"
    return [], None


def turn_facts(t: dict[str, Any]) -> Facts:
    """The side panel's facts about the turn view *t*."""
    request = t.get("request") if isinstance(t.get("request"), dict) else {}
    f = Facts(latency_ms=t.get("latency_ms"), wire_format=str(t.get("wire_format") or "chat"),
              endpoint=t.get("endpoint"), capture=t.get("capture"), turn_type=t.get("turn_type"),
              status=t.get("status"))
    f.wire_label = WIRE_FORMATS.get(f.wire_format, f.wire_format)
    for name in MAIN_SETTINGS:
        if name in request:
            f.settings.append(_setting(name, request[name]))
        elif name != "max_completion_tokens":  # one of the two token limits is enough to list as unset
            f.unset.append(name)
    if "max_completion_tokens" in request and "max_tokens" in f.unset:
        f.unset.remove("max_tokens")
    f.settings += [_setting(k, v) for k, v in request.items() if k not in MAIN_SETTINGS and k not in NOT_SETTINGS]
    tools = request.get("tools") or request.get("functions")
    if isinstance(tools, list) and tools:
        f.tools = [_tool_name(x) for x in tools]
        f.tools_json = _json(tools, indent=2)
    f.usage, f.usage_source = _usage(t)
    response = t.get("response") if isinstance(t.get("response"), dict) else None
    choices = (response or {}).get("choices") or []
    reasons = [c.get("finish_reason") for c in choices if isinstance(c, dict)] or \
        ([response.get("finish_reason")] if response else [])
    f.finish = [str(r) for r in reasons if r]
    limit = request.get("max_completion_tokens", request.get("max_tokens"))
    for reason in dict.fromkeys(f.finish):
        if reason in WARN_FINISH:
            f.warnings.append(WARN_FINISH[reason].format(limit=f" (max tokens {limit})" if limit is not None else ""))
    return f


def question(messages: Any) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """The request's question — its last user message — and the messages after it (for a
    tool turn: the assistant's calls and the tool results the reply answers)."""
    msgs = [m for m in messages if isinstance(m, dict)] if isinstance(messages, list) else []
    for i in range(len(msgs) - 1, -1, -1):
        if msgs[i].get("role") == "user":
            return msgs[i], msgs[i + 1:]
    return None, msgs[-1:]
