"""Which session a request belongs to and what kind of turn it is, decided from the request alone
before it is proxied (docs/sessions.md).

A session named by the client (``/s/{id}/v1``, then ``X-Session-Id``) always wins; otherwise the
configured session keys (``session_keys``) are tried in order, and a request none of them names
is left to prefix stitching (``datapool.sessions``). A turn's kind comes from ``X-Turn-Type`` if
the client sent it, else from the first matching side-turn rule (``side_turn_rules``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from functools import cached_property
from typing import Any

from base.settings import SessionKey, SideTurnRule
from base.vocab import SessionSource, TurnKind
from base.errors import RequestError
from datapool.edits import summary_shape
from gateway.protocol import SESSION_ID

log = logging.getLogger("nextstate.gateway")

_TURN_KINDS = frozenset({TurnKind.MAIN, TurnKind.SIDE})  # a client never sends a sibling
_SYSTEM_ROLES = ("system", "developer")


def message_text(message: Any) -> str:
    """A message's text: its string content, or its text parts one per line.

    Parts are joined with newlines so that line-anchored rules see each part's lines: after a
    compaction OpenClaw sends the summary and its ``Runtime: … sessionId=…`` line as two parts.
    """
    if not isinstance(message, dict):
        return ""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(str(p.get("text") or "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return ""


def first_message(messages: Any, roles: Sequence[str]) -> dict[str, Any] | None:
    """The first message of one of *roles*."""
    if not isinstance(messages, list):
        return None
    return next((m for m in messages if isinstance(m, dict) and m.get("role") in roles), None)


class Texts:
    """The parts of a request's messages the classification rules read, each found once: the
    first system (or developer) message's text, the user messages and the first one's text. The
    client profiles, the session keys and the side-turn rules ask for the same few (the built-in
    ones: the system message's text five times a request), each a scan of the messages and a
    join of their text parts otherwise. Each is found at its first use: a request that names its
    session or whose rules never look at a message scans nothing."""

    def __init__(self, messages: Any):
        self.messages = messages

    @cached_property
    def system_text(self) -> str | None:
        """The first system (or developer) message's text (:func:`message_text`); None without one."""
        system = first_message(self.messages, _SYSTEM_ROLES)
        return None if system is None else message_text(system)

    @cached_property
    def users(self) -> list[dict[str, Any]]:
        """The user messages, in order."""
        messages = self.messages if isinstance(self.messages, list) else []
        return [m for m in messages if isinstance(m, dict) and m.get("role") == "user"]

    @cached_property
    def first_user_text(self) -> str | None:
        """The first user message's text; None without one."""
        return message_text(self.users[0]) if self.users else None


def _key_text(key: SessionKey, headers: Mapping[str, str], body: dict[str, Any], texts: Texts) -> str | None:
    if key.source == "header":
        return headers.get(key.name or "")
    if key.source in ("user", "field"):
        value = body.get("user" if key.source == "user" else key.name or "")
    elif key.source == "metadata":
        metadata = body.get("metadata")
        value = metadata.get(key.name) if isinstance(metadata, dict) else None
    else:
        value = texts.system_text if key.source == "system" else texts.first_user_text
    return value if isinstance(value, str) else None


def session_key(keys: Sequence[SessionKey], headers: Mapping[str, str], body: dict[str, Any],
                texts: Texts | None = None) -> str | None:
    """The session id the first configured key finds in the request, if any (*texts*: its
    messages' parts, when the caller found some already)."""
    texts = texts or Texts(body.get("messages"))
    for key in keys:
        text = _key_text(key, headers, body, texts)
        if not text:
            continue
        if key.pattern is None:
            found: str | None = text.strip()
        else:
            match = key.pattern.search(text)
            found = (match.group(1) if key.pattern.groups else match.group(0)) if match else None
        if found and SESSION_ID.match(found):
            return found
        if found:
            log.debug("session key from %s is not a valid session id; ignored", key.source)
    return None


def session_of(headers: Mapping[str, str], body: dict[str, Any], path_session: str | None,
               keys: Sequence[SessionKey], texts: Texts | None = None) -> tuple[str | None, str | None]:
    """(session id, how it was known) of a request; (None, None) leaves it to prefix stitching.
    A session id the client named that is not valid is a 400."""
    if path_session is not None:
        sid, source = path_session, SessionSource.PATH
    elif headers.get("x-session-id"):
        sid, source = headers["x-session-id"], SessionSource.HEADER
    else:
        found = session_key(keys, headers, body, texts)
        return (found, SessionSource.KEY) if found else (None, None)
    if not SESSION_ID.match(sid):
        raise RequestError(400, "session id must be 1-128 characters of letters, digits and . _ : -, "
                          "starting with a letter or digit",
                          param="session_id")
    return sid, source


def _matches(rule: SideTurnRule, headers: Mapping[str, str], body: dict[str, Any], texts: Texts) -> bool:
    if rule.header is not None:
        value = headers.get(rule.header)
        if value is None or (rule.header_pattern is not None and not rule.header_pattern.search(value)):
            return False
    if rule.tools is not None and bool(body.get("tools") or body.get("functions")) != rule.tools:
        return False
    if rule.user_messages is not None and len(texts.users) != rule.user_messages:
        return False
    if rule.user_pattern is not None:
        text = texts.first_user_text
        if text is None or not rule.user_pattern.search(text):
            return False
    if rule.system_pattern is not None:
        text = texts.system_text
        if text is None or not rule.system_pattern.search(text):
            return False
    return True


def side_rule(rules: Sequence[SideTurnRule], headers: Mapping[str, str], body: dict[str, Any],
              texts: Texts | None = None) -> str | None:
    """The name of the first side-turn rule the request matches, if any."""
    texts = texts or Texts(body.get("messages"))
    return next((rule.name for rule in rules if _matches(rule, headers, body, texts)), None)


def turn_kind_of(headers: Mapping[str, str], body: dict[str, Any], rules: Sequence[SideTurnRule],
                 texts: Texts | None = None) -> str:
    """``X-Turn-Type`` if sent (a bad value is a 400), else side if a side-turn rule matches or
    the request has the shape of a summarisation call (datapool.edits.summary_shape)."""
    sent = headers.get("x-turn-type")
    if sent is not None:
        value = sent.strip().lower()
        if value not in _TURN_KINDS:
            raise RequestError(400, "X-Turn-Type must be `main` or `side`", param="X-Turn-Type")
        return value
    rule = side_rule(rules, headers, body, texts)
    if rule is not None:
        log.debug("side turn by rule %s", rule)
        return TurnKind.SIDE
    shape = summary_shape(body.get("messages"), bool(body.get("tools") or body.get("functions")))
    if shape is not None:
        log.debug("side turn: a summarisation call (%s transcript)", shape)
        return TurnKind.SIDE
    return TurnKind.MAIN
