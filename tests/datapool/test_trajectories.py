"""The trajectory graph (docs/sessions.md): requests whose history is not an append-only extension
of the turn before still join its session and record the turn they continue as their parent.

A hypothesis property writes generated conversations through the real Stitcher, each request
sent with the rewrites of the matching tests, and on top of that, per request at random: sent
without its system prompt (the next one carries it again), or first sent and failed and then
retried with the same messages, or sent with a `<system-reminder>` of its own in the first user
message that the next request leaves out (Qwen Code's resume); and at the end one of: a fork
from an earlier turn, a call cancelled and the conversation resumed after it (Codex), a reply
dropped and the conversation gone on without it (mini-swe-agent), or nothing. Inferred and named (session key) sessions
alike: always one session, each turn's parent the turn it continues, each next state what the
request continuing it appended.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import Engine, select
from sqlalchemy.orm import Session as OrmSession

from datapool.db import make_engine, upgrade
from datapool.models import Turn
from datapool.records import TurnRecord
from datapool.sessions import Stitcher
from tests.support.conversations import Request, draw_steps, requests

T0 = datetime(2026, 11, 28, tzinfo=timezone.utc)
SEEN: dict[str, int] = {}  # what the property generated, checked by the last test


@dataclass
class Planned:
    record: TurnRecord
    parent: TurnRecord | None  # the turn it must record as its parent
    appended_from: int | None = None  # its parent's next state: its messages from here on, if it gives it


def _record(messages: list[dict[str, Any]], reply: dict[str, Any] | None, at: int, *, status: str = "ok",
            session_id: str | None = None) -> TurnRecord:
    return TurnRecord(
        id=uuid.uuid4().hex, created_at=T0 + timedelta(seconds=at), endpoint="chat", status=status, model="m",
        capture="white-box", request={"messages": messages, "params": {}},
        response={"id": "chatcmpl-x", "choices": [{"index": 0, "message": reply, "finish_reason": "stop"}]}
        if reply is not None else None,
        error={"message": "client disconnected", "type": "cancelled"} if status != "ok" else None,
        session_id=session_id, session_source="key" if session_id else None)


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


def plan(r: random.Random, reqs: list[Request], ending: str, named: str | None) -> list[Planned]:
    out: list[Planned] = []
    at = 0
    previous: tuple[Request, Planned] | None = None
    for q in reqs:
        at += 1
        how = r.choice(["plain", "plain", "no system", "retried", "reminded"])
        SEEN[how] = SEEN.get(how, 0) + 1
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


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    url = f"sqlite:///{tmp_path_factory.mktemp('trajectories') / 'pool.db'}"
    upgrade(url)
    engine = make_engine(url)
    yield engine
    engine.dispose()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(r=st.randoms(use_true_random=False), batches=st.integers(1, 3),
       ending=st.sampled_from(["none", "fork", "cancelled and resumed", "reply dropped"]), named=st.booleans())
def test_forks_retries_and_dropped_system_prompts_stay_in_one_session(
        pool: Engine, r: random.Random, batches: int, ending: str, named: bool) -> None:
    steps = draw_steps(r, system=f"agent run {uuid.uuid4().hex}")
    # what the person says is this conversation's own: without the system prompt, two
    # conversations that say the same are one history to anybody reading the requests
    steps[1].text = f"{uuid.uuid4().hex} {steps[1].text}"
    planned = plan(r, requests(r, steps), ending, f"s-{uuid.uuid4().hex[:12]}" if named else None)
    records = [p.record for p in planned]
    cuts = sorted(r.sample(range(1, len(records)), min(batches - 1, len(records) - 1))) if len(records) > 1 else []
    for a, b in zip([0, *cuts], [*cuts, len(records)]):
        with OrmSession(pool) as db, db.begin():
            Stitcher(db).write(records[a:b])
    with OrmSession(pool) as db:
        turns = {t.id: t for t in db.scalars(select(Turn).where(Turn.id.in_([x.id for x in records])))}
        db.expunge_all()
    shown = [(p.record.status, [m["role"] for m in p.record.messages], turns[p.record.id].session_id[:6])
             for p in planned]
    assert len({t.session_id for t in turns.values()}) == 1, (ending, shown)
    for p in planned:
        t = turns[p.record.id]
        assert t.parent_turn_id == (p.parent.id if p.parent else None), (ending, p.record.status)
        if p.appended_from is not None and p.parent is not None and p.parent.status == "ok":
            assert turns[p.parent.id].next_state == {"turn_id": p.record.id,
                                                     "messages": p.record.messages[p.appended_from:]}
    SEEN[ending] = SEEN.get(ending, 0) + 1
    SEEN["named" if named else "inferred"] = SEEN.get("named" if named else "inferred", 0) + 1


def test_every_case_was_generated() -> None:
    print(f"\ntrajectories: {SEEN}")
    assert {"plain", "no system", "retried", "reminded", "fork", "cancelled and resumed", "reply dropped", "none",
            "named", "inferred"} <= set(SEEN), SEEN


def test_a_fork_written_later_leaves_the_next_state_to_the_child_with_the_system_prompt_again(pool: Engine) -> None:
    """A turn sent without the system prompt, continued by one that has it again (stored first),
    then forked in a later batch: the fork is a branch and does not take over the next state
    (the stored child is the parent's exact continuation once its system prompt is left out)."""
    system = {"role": "system", "content": f"agent run {uuid.uuid4().hex}"}
    first = [system, {"role": "user", "content": f"{uuid.uuid4().hex} list the files"}]
    a = _record(first, {"role": "assistant", "content": "a.txt"}, 1)
    b = _record([*first[1:], a.replies[0], {"role": "user", "content": "and b?"}],
                {"role": "assistant", "content": "b.txt"}, 2)  # without the system prompt
    c = _record([system, *b.messages, b.replies[0], {"role": "user", "content": "thanks"}],
                {"role": "assistant", "content": "ok"}, 3)  # with it again
    fork = _record([*b.messages, b.replies[0], {"role": "user", "content": "no, c"}],
                   {"role": "assistant", "content": "c.txt"}, 4)
    for batch in ([a, b, c], [fork]):
        with OrmSession(pool) as db, db.begin():
            Stitcher(db).write(batch)
    with OrmSession(pool) as db:
        turns = {t.id: t for t in db.scalars(select(Turn).where(Turn.id.in_([a.id, b.id, c.id, fork.id])))}
        assert turns[c.id].parent_turn_id == b.id and turns[fork.id].parent_turn_id == b.id
        assert turns[b.id].next_state == {"turn_id": c.id, "messages": [{"role": "user", "content": "thanks"}]}
