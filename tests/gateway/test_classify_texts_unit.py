"""The request path's classification (gateway.classify, gateway.clients) finds each message text it
reads once per request (`Texts`), shared by the client profiles, the session keys and the side-turn
rules: for any request, the client, the session and the turn's kind are those the rules gave when
each of them scanned the messages itself (the reference below is that code, as it was)."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from base.errors import RequestError
from base.settings import DEFAULT_SESSION_KEYS, DEFAULT_SIDE_TURN_RULES, ClientProfile, SessionKey, SideTurnRule
from base.vocab import SessionSource, TurnKind
from datapool.edits import summary_shape
from gateway.classify import Texts, first_message, message_text, session_of, turn_kind_of
from gateway.clients import BUILTIN_PROFILES, recognise
from gateway.protocol import SESSION_ID

_SYSTEM_ROLES = ("system", "developer")


# -- the reference: each rule scanning the messages itself ------------------------------------------


def _ref_matches_profile(p: ClientProfile, headers: Mapping[str, str], body: dict[str, Any], fmt: str) -> bool:
    if p.wire_format is not None and p.wire_format != fmt:
        return False
    if p.user_agent is not None and not p.user_agent.search(headers.get("user-agent", "")):
        return False
    if p.header is not None:
        value = headers.get(p.header)
        if value is None or (p.header_pattern is not None and not p.header_pattern.search(value)):
            return False
    if p.system_pattern is not None:
        system = first_message(body.get("messages"), ("system", "developer"))
        if system is None or not p.system_pattern.search(message_text(system)):
            return False
    return True


def _ref_recognise(known: Sequence[ClientProfile], headers: Mapping[str, str], body: dict[str, Any],
                   fmt: str) -> ClientProfile | None:
    return next((p for p in known if _ref_matches_profile(p, headers, body, fmt)), None)


def _ref_key_text(key: SessionKey, headers: Mapping[str, str], body: dict[str, Any]) -> str | None:
    if key.source == "header":
        return headers.get(key.name or "")
    if key.source in ("user", "field"):
        value = body.get("user" if key.source == "user" else key.name or "")
    elif key.source == "metadata":
        metadata = body.get("metadata")
        value = metadata.get(key.name) if isinstance(metadata, dict) else None
    else:
        message = first_message(body.get("messages"), _SYSTEM_ROLES if key.source == "system" else ("user",))
        value = message_text(message) if message is not None else None
    return value if isinstance(value, str) else None


def _ref_session_of(headers: Mapping[str, str], body: dict[str, Any], path_session: str | None,
                    keys: Sequence[SessionKey]) -> tuple[str | None, str | None]:
    if path_session is not None:
        sid, source = path_session, SessionSource.PATH
    elif headers.get("x-session-id"):
        sid, source = headers["x-session-id"], SessionSource.HEADER
    else:
        for key in keys:
            text = _ref_key_text(key, headers, body)
            if not text:
                continue
            if key.pattern is None:
                found: str | None = text.strip()
            else:
                match = key.pattern.search(text)
                found = (match.group(1) if key.pattern.groups else match.group(0)) if match else None
            if found and SESSION_ID.match(found):
                return found, SessionSource.KEY
        return None, None
    if not SESSION_ID.match(sid):
        raise RequestError(400, "bad session id")
    return sid, source


def _ref_rule_matches(rule: SideTurnRule, headers: Mapping[str, str], body: dict[str, Any]) -> bool:
    if rule.header is not None:
        value = headers.get(rule.header)
        if value is None or (rule.header_pattern is not None and not rule.header_pattern.search(value)):
            return False
    if rule.tools is not None and bool(body.get("tools") or body.get("functions")) != rule.tools:
        return False
    messages = body.get("messages")
    messages = messages if isinstance(messages, list) else []
    users = [m for m in messages if isinstance(m, dict) and m.get("role") == "user"]
    if rule.user_messages is not None and len(users) != rule.user_messages:
        return False
    if rule.user_pattern is not None and not (users and rule.user_pattern.search(message_text(users[0]))):
        return False
    if rule.system_pattern is not None:
        system = first_message(messages, _SYSTEM_ROLES)
        if system is None or not rule.system_pattern.search(message_text(system)):
            return False
    return True


def _ref_turn_kind(headers: Mapping[str, str], body: dict[str, Any], rules: Sequence[SideTurnRule]) -> str:
    sent = headers.get("x-turn-type")
    if sent is not None:
        value = sent.strip().lower()
        if value not in (TurnKind.MAIN, TurnKind.SIDE):
            raise RequestError(400, "bad turn type")
        return value
    if any(_ref_rule_matches(rule, headers, body) for rule in rules):
        return TurnKind.SIDE
    if summary_shape(body.get("messages"), bool(body.get("tools") or body.get("functions"))) is not None:
        return TurnKind.SIDE
    return TurnKind.MAIN


# -- requests of every shape the rules look at -------------------------------------------------------

_WORDS = st.sampled_from([
    "You are an agent in the Continue CLI", "You are a helpful assistant that can interact with a computer",
    "You are a personal assistant running inside OpenClaw.", "Runtime: host=a | sessionId=oc-7f3a | model=x",
    "You are now acting as the managed memory extraction subagent",
    "You are a context summarization assistant. Your task is to read a conversation between a user and an "
    "AI assistant", "<conversation>\nUser: hi\nAssistant: hello", "Summarise the conversation above in detail.",
    "User: fix the bug\nAssistant: Fixed in main.py.", "fix the bug", "", "[Mon 2026-11-30 10:00 UTC] hi",
])
_TEXT = st.one_of(_WORDS, st.lists(_WORDS, min_size=1, max_size=3).map("\n".join), st.text(max_size=20))
_PART = st.one_of(st.builds(lambda t: {"type": "text", "text": t}, _TEXT), st.just({"type": "image_url"}),
                  st.just("not a part"))
_CONTENT = st.one_of(_TEXT, st.lists(_PART, max_size=3), st.none(), st.integers())
_MESSAGE = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "developer", "user", "assistant", "tool", 7]),
                           "content": _CONTENT}),
    st.just("not a message"), st.just({}),
)
_MESSAGES = st.one_of(st.lists(_MESSAGE, max_size=6), st.none(), st.just("a string"), st.just({"a": 1}))
_BODY = st.builds(
    lambda messages, tools, user, meta, extra: {
        k: v for k, v in {"messages": messages, "tools": tools, "user": user, "metadata": meta, **extra}.items()
        if v is not None},
    _MESSAGES, st.sampled_from([None, [], [{"type": "function"}]]),
    st.sampled_from([None, '{"session_id": "s-1"}', "  ", 5]),
    st.sampled_from([None, {"sid": "m-1"}, "x"]),
    st.sampled_from([{}, {"prompt_cache_key": "k-9"}, {"functions": [{"name": "f"}]}]),
)
_HEADERS = st.dictionaries(
    st.sampled_from(["user-agent", "x-session-id", "x-turn-type", "session-id", "x-claude-code-session-id",
                     "x-agent"]),
    st.sampled_from(["claude-cli/2.0", "codex_exec/0.5", "QwenCode/1.0", "Python/3.11 aiohttp", "s-42", "main",
                     "side", "bad id!", ""]),
    max_size=4,
)
_OWN_KEYS = [
    SessionKey(source="metadata", name="sid"),  # type: ignore[call-arg]
    SessionKey(source="first_user", pattern=r"User: (\w+)"),  # type: ignore[call-arg]
    SessionKey(source="system", pattern=r"sessionId=(\S+)"),  # type: ignore[call-arg]
    SessionKey(source="field", name="prompt_cache_key"),  # type: ignore[call-arg]
]
_OWN_RULES = [
    SideTurnRule(name="agent-header", header="x-agent", header_pattern=re.compile("side")),  # type: ignore[call-arg]
    SideTurnRule(name="two-users", user_messages=2, user_pattern=re.compile("fix")),  # type: ignore[call-arg]
    SideTurnRule(name="system", system_pattern=re.compile("Continue"), tools=False),  # type: ignore[call-arg]
]


def _outcome(f: Any) -> Any:
    try:
        return f()
    except RequestError as exc:
        return ("error", exc.status)


@settings(max_examples=400, deadline=None)
@given(body=_BODY, headers=_HEADERS, fmt=st.sampled_from(["chat", "responses", "messages", "completions"]),
       path_session=st.sampled_from([None, "p-1"]), own=st.booleans())
def test_the_shared_texts_classify_as_each_rule_scanning_alone(body: dict[str, Any], headers: dict[str, str],
                                                               fmt: str, path_session: str | None,
                                                               own: bool) -> None:
    keys = [*_OWN_KEYS, *DEFAULT_SESSION_KEYS] if own else list(DEFAULT_SESSION_KEYS)
    rules = [*_OWN_RULES, *DEFAULT_SIDE_TURN_RULES] if own else list(DEFAULT_SIDE_TURN_RULES)
    texts = Texts(body.get("messages"))  # one for the whole request, as gateway.serving.proxy shares it
    client = recognise(BUILTIN_PROFILES, headers, body, fmt, texts)
    assert client is _ref_recognise(BUILTIN_PROFILES, headers, body, fmt)
    if client is not None:
        keys, rules = [*client.session_keys, *keys], [*client.side_turn_rules, *rules]
    assert _outcome(lambda: session_of(headers, body, path_session, keys, texts)) == \
        _outcome(lambda: _ref_session_of(headers, body, path_session, keys))
    assert _outcome(lambda: turn_kind_of(headers, body, rules, texts)) == \
        _outcome(lambda: _ref_turn_kind(headers, body, rules))
    # and each called alone, without texts found before
    assert _outcome(lambda: turn_kind_of(headers, body, rules)) == _outcome(lambda: _ref_turn_kind(headers, body, rules))
