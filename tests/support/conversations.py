"""Generated agent conversations with tool loops, and the ways real clients rewrite their history
when they send it again (tests/datapool/test_session_matching.py).

A conversation is first drawn in an abstract form (who said what, which tool was called with
which arguments, which call a result answers); the wire messages of each request are then
rendered from it, each request with its own random choice of rewrites. Whether two histories
are "the same" is decided on the abstract form, independently of the canonical form under test.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from dataclasses import dataclass, field
from typing import Any

Message = dict[str, Any]

# small vocabularies, so that unrelated conversations often open with the same words
WORDS = ["list", "the", "files", "run", "tests", "why", "fix", "it", "ok", "thanks", "é", "\"q\"", "日本"]
TOOLS = ["read", "exec", "web_search", "edit"]
KEYS = ["path", "command", "query", "n", "flag", "items", "opts"]
STAMPS = ["[Thu 2026-11-26 14:03 UTC] ", "[Thu 2026-11-26 14:04 UTC] ", "[Fri 2026-11-27 09:00 UTC] "]


@dataclass
class Call:
    name: str
    args: dict[str, Any]


@dataclass
class Step:
    """One message in abstract form."""

    role: str  # system | user | assistant | tool
    text: str = ""
    calls: list[Call] = field(default_factory=list)  # assistant
    answers: int = -1  # tool: the conversation-wide number of the call it answers
    as_parts: bool = False  # the client sends this text as content parts


def _value(r: random.Random, depth: int = 0) -> Any:
    kind = r.randrange(8 if depth < 2 else 6)
    if kind == 0:
        return r.choice(WORDS)
    if kind == 1:
        return r.randrange(-3, 4)
    if kind == 2:
        return r.choice([0.5, 1.0, 2.0, -1.25, 3.0])  # integral floats are printed as ints by JS
    if kind == 3:
        return r.choice([True, False])
    if kind == 4:
        return None
    if kind == 5:
        return " ".join(r.choice(WORDS) for _ in range(r.randrange(1, 4)))
    if kind == 6:
        return [_value(r, depth + 1) for _ in range(r.randrange(0, 3))]
    return {k: _value(r, depth + 1) for k in r.sample(KEYS, r.randrange(0, 3))}


def _args(r: random.Random) -> dict[str, Any]:
    return {k: _value(r) for k in r.sample(KEYS, r.randrange(0, 4))}


def _text(r: random.Random, lo: int = 1, hi: int = 4) -> str:
    return " ".join(r.choice(WORDS) for _ in range(r.randrange(lo, hi)))


def _user(r: random.Random) -> Step:
    stamp = r.choice(STAMPS) if r.random() < 0.4 else ""
    return Step("user", stamp + _text(r), as_parts=r.random() < 0.2)


def draw_steps(r: random.Random, *, system: str | None = None, rounds: int | None = None) -> list[Step]:
    """A conversation: a system prompt, then user messages each answered after 0-2 tool loops."""
    steps = [Step("system", system if system is not None else _text(r, 1, 3))]
    calls_so_far = 0
    for _ in range(rounds if rounds is not None else r.randrange(1, 4)):
        steps.append(_user(r))
        for _ in range(r.choice([0, 0, 1, 1, 2])):
            calls = [Call(r.choice(TOOLS), _args(r)) for _ in range(r.randrange(1, 4))]
            steps.append(Step("assistant", _text(r, 0, 2), calls=calls))
            order = list(range(len(calls)))
            if r.random() < 0.2:
                r.shuffle(order)  # results may come back in another order than the calls
            for k in order:
                steps.append(Step("tool", _text(r, 1, 3), answers=calls_so_far + k))
            calls_so_far += len(calls)
        steps.append(Step("assistant", _text(r)))
    return steps


def same_history(a: list[Step], b: list[Step]) -> bool:
    """Whether two abstract histories say the same thing (True is not 1; 1.0 is 1)."""
    return len(a) == len(b) and all(_same_step(x, y) for x, y in zip(a, b))


def _same_step(a: Step, b: Step) -> bool:
    return (a.role, a.text, a.answers, len(a.calls)) == (b.role, b.text, b.answers, len(b.calls)) and all(
        x.name == y.name and _same_json(x.args, y.args) for x, y in zip(a.calls, b.calls))


def _same_json(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_json(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same_json(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


# -- the wire form ---------------------------------------------------------------------------------

ID_STYLES = ("vllm", "openai", "index")


def _call_id(r: random.Random, style: str, k: int) -> str:
    if style == "vllm":
        return f"chatcmpl-tool-{r.getrandbits(128):032x}"
    if style == "openai":
        return "call_" + "".join(r.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijkl0123456789") for _ in range(24))
    return f"call_{k}"  # servers that number each message's calls from 0: ids repeat across turns


def _model_args(r: random.Random, args: dict[str, Any]) -> str:
    """Arguments as a model server prints them."""
    return json.dumps(args, ensure_ascii=r.random() < 0.5)


def render(r: random.Random, steps: list[Step], *, id_style: str | None = None) -> list[Message]:
    """The messages as first produced: assistant messages as the model server returned them,
    the rest as the client first sent them."""
    style = id_style or r.choice(ID_STYLES)
    out: list[Message] = []
    ids: list[str] = []
    for s in steps:
        if s.role == "assistant":
            # as vLLM returns it: an empty tool_calls list and a null reasoning_content included
            m: Message = {"role": "assistant", "content": s.text or None, "tool_calls": [], "reasoning_content": None}
            if s.calls:
                calls = []
                for k, c in enumerate(s.calls):
                    ids.append(_call_id(r, style, k))
                    calls.append({"id": ids[-1], "type": "function",
                                  "function": {"name": c.name, "arguments": _model_args(r, c.args)}})
                m["tool_calls"] = calls
            out.append(m)
        elif s.role == "tool":
            out.append({"role": "tool", "tool_call_id": ids[s.answers], "content": s.text})
        else:
            content: Any = [{"type": "text", "text": s.text}] if s.as_parts else s.text
            out.append({"role": s.role, "content": content})
    return out


def _js(value: Any) -> Any:
    # JSON.stringify(JSON.parse(x)): integral floats lose their ".0"
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: _js(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_js(v) for v in value]
    return value


def _map_ids(messages: list[Message], f: Any) -> bool:
    changed = False
    for m in messages:
        for c in m.get("tool_calls") or []:
            new = f(c["id"])
            changed |= new != c["id"]
            c["id"] = new
        if m.get("tool_call_id"):
            m["tool_call_id"] = f(m["tool_call_id"])
    return changed


def _map_args(messages: list[Message], f: Any) -> bool:
    changed = False
    for m in messages:
        for c in m.get("tool_calls") or []:
            fn = c["function"]
            new = f(json.loads(fn["arguments"]))
            changed |= new != fn["arguments"]
            fn["arguments"] = new
    return changed


def _to_parts(r: random.Random, text: str) -> list[dict[str, Any]]:
    cut = r.randrange(len(text) + 1)
    parts = [text[:cut], text[cut:]] if 0 < cut < len(text) and r.random() < 0.5 else [text]
    return [{"type": "text", "text": p} for p in parts]


# Each rewrite changes ``ms`` in place and says whether it changed anything.


def _rw_id_strip(r: random.Random, ms: list[Message]) -> bool:  # OpenClaw
    return _map_ids(ms, lambda i: re.sub(r"[^A-Za-z0-9]", "", i))


def _rw_id_replace(r: random.Random, ms: list[Message]) -> bool:  # clients that mint their own ids
    salt = r.getrandbits(32)
    return _map_ids(ms, lambda i: "toolu_" + hashlib.sha256(f"{salt}{i}".encode()).hexdigest()[:20])


def _rw_args_compact(r: random.Random, ms: list[Message]) -> bool:  # JSON.stringify (OpenClaw)
    return _map_args(ms, lambda a: json.dumps(_js(a), separators=(",", ":"), ensure_ascii=False))


def _rw_args_reorder(r: random.Random, ms: list[Message]) -> bool:  # dict round-trips, pretty printers
    return _map_args(ms, lambda a: json.dumps(dict(reversed(list(a.items()))), indent=r.choice([None, 2]),
                                             ensure_ascii=r.random() < 0.5))


def _rw_content_parts(r: random.Random, ms: list[Message]) -> bool:  # OpenAI SDKs, LangChain
    changed = False
    for m in ms:
        if isinstance(m.get("content"), str) and m["content"]:
            m["content"] = _to_parts(r, m["content"])
            changed = True
    return changed


def _rw_parts_to_string(r: random.Random, ms: list[Message]) -> bool:
    changed = False
    for m in ms:
        if isinstance(m.get("content"), list):
            m["content"] = "".join(p["text"] for p in m["content"])
            changed = True
    return changed


def _rw_cache_control(r: random.Random, ms: list[Message]) -> bool:  # Anthropic-style prompt caching
    changed = False
    for m in ms[-2:]:
        if isinstance(m.get("content"), str) and m["content"]:
            m["content"] = [{"type": "text", "text": m["content"], "cache_control": {"type": "ephemeral"}}]
            changed = True
    return changed


def _rw_null_fields(r: random.Random, ms: list[Message]) -> bool:  # SDK echoes of a reply
    for m in ms:
        if m["role"] == "assistant":
            m.update(refusal=None, audio=None, function_call=None, annotations=None)
            if not m.get("tool_calls"):
                m["tool_calls"] = None
            if not m.get("content"):
                m["content"] = None
        elif m["role"] == "user":
            m["name"] = None
    return any(m["role"] in ("assistant", "user") for m in ms)


def _rw_drop_empty(r: random.Random, ms: list[Message]) -> bool:  # clients that omit empty fields
    changed = False
    for m in ms:
        for k in [k for k, v in m.items() if v is None or v == "" or v == []]:
            del m[k]
            changed = True
    return changed


def _rw_empty_content(r: random.Random, ms: list[Message]) -> bool:  # "" for a null content
    changed = False
    for m in ms:
        if m["role"] == "assistant" and m.get("content", "") is None:
            m["content"] = ""
            changed = True
    return changed


def _rw_add_name(r: random.Random, ms: list[Message]) -> bool:  # tool results named after the tool
    names: dict[str, str] = {}
    for m in ms:
        for c in m.get("tool_calls") or []:
            names[c["id"]] = c["function"]["name"]
        if m["role"] == "tool":
            m["name"] = names.get(m["tool_call_id"], "tool")
        elif m["role"] == "assistant":
            m["name"] = "assistant"
    return any(m["role"] in ("assistant", "tool") for m in ms)


def _rw_drop_type(r: random.Random, ms: list[Message]) -> bool:
    changed = False
    for m in ms:
        for c in m.get("tool_calls") or []:
            changed |= c.pop("type", None) is not None
    return changed


REWRITES = {
    "id_strip": _rw_id_strip,
    "id_replace": _rw_id_replace,
    "args_compact": _rw_args_compact,
    "args_reorder": _rw_args_reorder,
    "content_parts": _rw_content_parts,
    "parts_to_string": _rw_parts_to_string,
    "cache_control": _rw_cache_control,
    "null_fields": _rw_null_fields,
    "drop_empty": _rw_drop_empty,
    "empty_content": _rw_empty_content,
    "add_name": _rw_add_name,
    "drop_type": _rw_drop_type,
}


def rewrite(r: random.Random, messages: list[Message], applied: dict[str, int] | None = None) -> list[Message]:
    """A copy of ``messages`` with a random combination of client rewrites applied; ``applied``
    counts the rewrites that changed something."""
    out = json.loads(json.dumps(messages))  # a deep copy, faster than copy.deepcopy
    names = list(REWRITES)
    r.shuffle(names)
    for name in names[: r.randrange(len(names) + 1)]:
        if REWRITES[name](r, out) and applied is not None:
            applied[name] = applied.get(name, 0) + 1
    return out


@dataclass
class Request:
    """One model call: the messages as the client sent them and the reply it got."""

    messages: list[Message]
    reply: Message
    prefix: int  # how many abstract steps the request holds (the reply is step ``prefix``)


def requests(r: random.Random, steps: list[Step], applied: dict[str, int] | None = None) -> list[Request]:
    """Each model call of the conversation: the history before each assistant step, sent again
    with its own rewrites, and that step's reply as the model server returned it."""
    wire = render(r, steps)
    return [Request(rewrite(r, wire[:i], applied), wire[i], i) for i, s in enumerate(steps) if s.role == "assistant"]
