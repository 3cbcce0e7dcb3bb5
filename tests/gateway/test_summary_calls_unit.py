"""Summarisation calls are side turns by their shape, whichever agent sends them and however it
words them (gateway.classify, datapool.edits.summary_shape); a client profile recognises its own
client, not a summarisation prompt other agents use too (gateway.clients)."""

from __future__ import annotations

from typing import Any

import pytest

from base.settings import DEFAULT_SIDE_TURN_RULES
from gateway.classify import turn_kind_of
from gateway.clients import BUILTIN_PROFILES, recognise

HISTORY = [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": "fix the bug"},
           {"role": "assistant", "content": "Fixed in main.py."}]
APPENDED = ("Your task is to create a detailed summary of the conversation so far, paying close attention to the "
            "user's explicit requests and your previous actions, so that the work can go on without losing context.")
EMBEDDED = [{"role": "system", "content": "Condense the chat below into a summary the agent can resume from."},
            {"role": "user", "content": "User: fix the bug\nAssistant: Fixed in main.py."}]
TOOLS = [{"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}}]


def _kind(body: dict[str, Any], headers: dict[str, str] | None = None) -> str:
    return turn_kind_of(headers or {}, body, DEFAULT_SIDE_TURN_RULES)


@pytest.mark.parametrize("body", [
    {"messages": [*HISTORY, {"role": "user", "content": APPENDED}]},  # the history, the instruction appended
    {"messages": [*HISTORY, {"role": "user", "content": [{"type": "text", "text": APPENDED}]}]},
    {"messages": EMBEDDED},  # the transcript embedded in one message
], ids=["appended", "appended as parts", "embedded"])
def test_a_summarisation_call_is_a_side_turn(body: dict[str, Any]) -> None:
    assert _kind(body) == "side"
    assert _kind(body, {"x-turn-type": "main"}) == "main"
    assert _kind({**body, "tools": TOOLS}) == "main"  # an agent's own calls declare its tools


def test_a_persons_question_about_a_summary_stays_main() -> None:
    assert _kind({"messages": [*HISTORY, {"role": "user", "content": "Can you summarise the conversation?"}]}) == "main"
    assert _kind({"messages": [{"role": "user", "content": "Summarise the history of Rome."}]}) == "main"


def test_openclaws_profile_recognises_openclaw_not_a_summarisation_prompt() -> None:
    summarising = {"messages": [
        {"role": "system", "content": "You are a context summarization assistant. Your task is to read a conversation "
                                      "between a user and an AI assistant, then produce a structured summary."},
        {"role": "user", "content": "<conversation>\n[user]\nhi\n[assistant]\nhello\n</conversation>"}]}
    assert recognise(BUILTIN_PROFILES, {}, summarising, "chat") is None
    assert _kind(summarising) == "side"
    own = {"messages": [{"role": "system", "content": "You are a personal assistant running inside OpenClaw."},
                        {"role": "user", "content": "hi"}]}
    profile = recognise(BUILTIN_PROFILES, {}, own, "chat")
    assert profile is not None and profile.name == "openclaw"
