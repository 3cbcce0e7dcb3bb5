"""Generated conversations planned as a client would send them, for the trajectory graph
(tests/datapool/test_trajectories.py, and the branch view that draws it): each request of a
conversation (tests.support.conversations) sent plain, without its system prompt, failed and
retried, or with a reminder of its own, and the conversation ended by a fork, a cancelled call
resumed, a dropped reply, or nothing; each turn with the parent the pool must record for it."""

from __future__ import annotations

import random
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

from datapool.records import TurnRecord
from tests.support.conversations import Request
from tests.support.records import turn_record

T0 = datetime(2026, 11, 28, tzinfo=timezone.utc)


@dataclass
class Planned:
    record: TurnRecord
    parent: TurnRecord | None  # the turn it must record as its parent
    appended_from: int | None = None  # its parent's next state: its messages from here on, if it gives it


def _record(messages: list[dict[str, Any]], reply: dict[str, Any] | None, at: int, *, status: str = "ok",
            session_id: str | None = None) -> TurnRecord:
    return turn_record(messages, reply, at=T0 + timedelta(seconds=at), status=status, session_id=session_id,
                       session_source="key" if session_id else None)


def _without_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [m for m in messages if m.get("role") != "system"]


def _reminded(r: random.Random, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """*messages* with context an agent added to its first user message for this call only (the
    date, as Qwen Code does), in the same text or a part of its own; the next call, resumed,
    sends the history without it."""
    reminder = f"<system-reminder>\nThe current date is {uuid.uuid4().hex}.\n</system-reminder>"
    out = [dict(m) for m in messages]
    first = next(m for m in out if m.get("role") == "user")
    text = first["content"] if isinstance(first["content"], str) else None
    if text is not None and r.random() < 0.5:
        first["content"] = reminder + text
    else:
        parts = [{"type": "text", "text": text}] if text is not None else list(first["content"])
        first["content"] = [{"type": "text", "text": reminder}, *parts]
    return out


def plan(r: random.Random, reqs: list[Request], ending: str, named: str | None,
         seen: dict[str, int] | None = None) -> list[Planned]:
    """The turns that *reqs* become, each with the parent it must record: each request sent plain,
    without its system prompt, failed and retried, or with a reminder of its own (counted in
    *seen*), then the conversation ended as *ending* says; *named*: their session key, if any."""
    out: list[Planned] = []
    at = 0
    previous: tuple[Request, Planned] | None = None
    for q in reqs:
        at += 1
        how = r.choice(["plain", "plain", "no system", "retried", "reminded"])
        if seen is not None:
            seen[how] = seen.get(how, 0) + 1
        messages = (_without_system(q.messages) if how == "no system" else
                    _reminded(r, q.messages) if how == "reminded" else q.messages)
        parent = previous[1].record if previous else None
        # what it appended after the previous request and its reply begins here in its messages
        appended = len(previous[0].messages) + 1 - (how == "no system") if previous else None
        if how == "retried":
            failed = Planned(_record(messages, None, at, status="cancelled", session_id=named), parent, appended)
            out.append(failed)
            at += 1
            # the retry repeats the failed call's request: it records that call as its parent
            current = Planned(_record(messages, q.reply, at, session_id=named), failed.record, None)
        else:
            current = Planned(_record(messages, q.reply, at, session_id=named), parent, appended)
        out.append(current)
        previous = (q, current)
    assert previous is not None
    at += 1
    last = previous[1].record
    ok = [p for p in out if p.record.status == "ok"]
    if ending == "fork" and len(ok) > 1:
        base = r.choice(ok[:-1]).record
        messages = [*base.messages, base.replies[0], {"role": "user", "content": f"fork {uuid.uuid4()}"}]
        out.append(Planned(_record(messages, {"role": "assistant", "content": "forked"}, at, session_id=named),
                           base, None))
    elif ending == "cancelled and resumed":
        messages = [*last.messages, last.replies[0], {"role": "user", "content": f"next {uuid.uuid4()}"}]
        cancelled = Planned(_record(messages, None, at, status="cancelled", session_id=named), last,
                            len(last.messages) + 1)
        resumed = [*messages, {"role": "user", "content": "go on"}]
        out += [cancelled, Planned(_record(resumed, {"role": "assistant", "content": "resumed"}, at + 1,
                                           session_id=named), cancelled.record, None)]
    elif ending == "reply dropped":
        messages = [*last.messages, {"role": "user", "content": "No tool call found. Call a tool."}]
        out.append(Planned(_record(messages, {"role": "assistant", "content": "again"}, at, session_id=named),
                           last, len(last.messages)))
    return out
