"""Known agents (client profiles): which agent sent a request, where it carries its session id,
which of its calls are housekeeping, and what it wraps around a person's words (docs/clients.md).

The built-in profiles below were written from requests the real clients sent to a gateway
(versions in tests/support/agents.py); ``client_profiles`` in the settings adds a user's own, tried first.
A request matches the first profile whose every recognition condition holds; the profile's name
is stored on the session it starts (``sessions.client``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from base.settings import OPENCLAW_SESSION_ID, ClientProfile, Settings
from gateway.classify import Texts

# Claude Code and Qwen Code wrap context they add in these; a person's message may carry several
# before the words typed
SYSTEM_REMINDER = r"<system-reminder>[\s\S]*?</system-reminder>"

BUILTIN_PROFILES: tuple[ClientProfile, ...] = tuple(ClientProfile.model_validate(p) for p in (
    {
        # @anthropic-ai/claude-code: /v1/messages; its session id in a header on every request and
        # inside metadata.user_id (a JSON string, which the Messages translation puts in `user`)
        "name": "claude-code",
        "user_agent": r"^claude-cli/",
        "wire_format": "messages",
        "session_keys": [
            {"source": "header", "name": "x-claude-code-session-id"},
            {"source": "user", "pattern": r'"session_id"\s*:\s*"([^"]+)"'},
        ],
        "skip_text": [SYSTEM_REMINDER],
    },
    {
        # @openai/codex: /v1/responses; one uuid per conversation (thread) in `session-id`,
        # `thread-id` and prompt_cache_key, kept by `codex exec resume`
        "name": "codex",
        "user_agent": r"^codex_",
        "session_keys": [
            {"source": "header", "name": "session-id"},
            {"source": "header", "name": "thread-id"},
            {"source": "field", "name": "prompt_cache_key"},
        ],
        "skip_text": [r"<environment_context>[\s\S]*?</environment_context>",
                      r"<user_instructions>[\s\S]*?</user_instructions>",
                      r"# AGENTS\.md instructions for [^\n]*\n+<INSTRUCTIONS>[\s\S]*?</INSTRUCTIONS>"],
    },
    {
        # npm `openclaw`: its sessionId on the `Runtime:` line (the default session_keys find it
        # too); each user message stamped with the time it arrived
        "name": "openclaw",
        # its own system prompt only: the summarisation prompt of its compaction call is not its
        # own wording alone (other agents use the same), and that call joins the session it
        # summarises by its shape (datapool.edits.summary_shape)
        "system_pattern": r"running inside OpenClaw",
        "session_keys": [
            {"source": "system", "pattern": OPENCLAW_SESSION_ID},
            {"source": "first_user", "pattern": OPENCLAW_SESSION_ID},
        ],
        "skip_text": [r"\A\[[A-Z][a-z]{2} \d{4}-\d{2}-\d{2} \d{2}:\d{2}(?::\d{2})? [A-Za-z+\-0-9:]+\]\s*",
                      r"(?m)^Runtime: .*\bsessionId=.*$"],
    },
    {
        # @qwen-code/qwen-code: chat completions, no session id; after a turn it asks the model to
        # extract memories from the conversation (a side turn)
        "name": "qwen-code",
        "user_agent": r"^QwenCode/",
        "side_turn_rules": [
            {"name": "qwen-code-memory", "system_pattern": r"\AYou are now acting as the managed memory extraction"},
        ],
        "skip_text": [SYSTEM_REMINDER],
    },
    {
        # @continuedev/cli (`cn`): chat completions through an OpenAI SDK of its own name, no
        # session id; known by its system prompt
        "name": "continue",
        "system_pattern": r"\AYou are an agent in the Continue CLI",
    },
    {
        # mini-swe-agent (PyPI): chat completions through LiteLLM, no session id; known by its
        # system prompt
        "name": "mini-swe-agent",
        "system_pattern": r"\AYou are a helpful assistant that can interact with a computer",
    },
))


def profiles(settings: Settings) -> list[ClientProfile]:
    """The user's profiles, then the built-in ones they do not replace (by name)."""
    own = list(settings.client_profiles)
    names = {p.name for p in own}
    return own + [p for p in BUILTIN_PROFILES if p.name not in names]


def _matches(p: ClientProfile, headers: Mapping[str, str], wire_format: str, texts: Texts) -> bool:
    if p.wire_format is not None and p.wire_format != wire_format:
        return False
    if p.user_agent is not None and not p.user_agent.search(headers.get("user-agent", "")):
        return False
    if p.header is not None:
        value = headers.get(p.header)
        if value is None or (p.header_pattern is not None and not p.header_pattern.search(value)):
            return False
    if p.system_pattern is not None:
        text = texts.system_text
        if text is None or not p.system_pattern.search(text):
            return False
    return True


def recognise(known: Sequence[ClientProfile], headers: Mapping[str, str], body: dict[str, Any],
              wire_format: str, texts: Texts | None = None) -> ClientProfile | None:
    """The first profile the request (its chat form) matches, if any (*texts*: its messages'
    parts, shared with the session keys and side-turn rules that read them next)."""
    texts = texts or Texts(body.get("messages"))
    return next((p for p in known if _matches(p, headers, wire_format, texts)), None)


def person_words(skip: Sequence[re.Pattern[str]], text: str) -> str:
    """*text* without what the client added around a person's words (its ``skip_text``)."""
    for pattern in skip:
        text = pattern.sub("", text)
    return text.strip()


def first_words(skip: Sequence[re.Pattern[str]], messages: Any) -> str:
    """The first thing a person said in *messages*: the first user message (each text part on its
    own) with something left once the client's additions are removed."""
    if not isinstance(messages, list):
        return ""
    for m in messages:
        if not isinstance(m, dict) or m.get("role") != "user":
            continue
        content = m.get("content")
        parts = [content] if isinstance(content, str) else [
            str(p.get("text") or "") for p in content or () if isinstance(p, dict) and p.get("type") == "text"]
        for part in parts:
            words = person_words(skip, part)
            if words:
                return words
    return ""


def words_of(known: Sequence[ClientProfile]) -> Callable[[str | None, Any], str]:
    """``(client, messages) -> the person's first words``, for session previews: the client's
    own skip_text, or every profile's for a session of no known client."""
    by_name = {p.name: p.skip_text for p in known}
    every = [pattern for p in known for pattern in p.skip_text]

    def words(client: str | None, messages: Any) -> str:
        return first_words(by_name.get(client or "", every), messages)

    return words
