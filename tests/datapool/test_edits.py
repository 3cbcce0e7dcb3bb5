"""Matching that tolerates edits (docs/sessions.md#edited-histories): an agent's recovery pass, a
summary inserted before the messages kept or in place of earlier ones, a fork, a retry, and its
summarisation calls (the transcript embedded, or the history with the instruction appended) stay in
the session, with the edit recorded on the turn; unrelated sessions never merge.

The hypothesis property writes a few generated sessions at once (tests.support.edits), some
opening with the same system prompt, interleaved, through the real Stitcher in random batches;
benchmarks/edits/run.py runs the same generator over 10,000 sessions.
"""

from __future__ import annotations

import random
import uuid
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from sqlalchemy import Engine, select
from sqlalchemy.orm import Session as OrmSession

from datapool.edits import (
    COMPACTION_INSERT,
    COMPACTION_REPLACE,
    align,
    embedded_transcript,
    loose_forms,
    request_pairs,
    reply_pairs,
    summary_shape,
)
from datapool.models import Turn
from datapool.sessions import Stitcher
from tests.support.edits import KINDS, Clock, outcome, plan_session
from tests.support.records import turn_record

CLOCK = Clock()  # one clock for the module's pool: each example's calls come after the last one's


def _write(engine: Engine, records: list[Any], cuts: list[int]) -> dict[str, Any]:
    for a, b in zip([0, *cuts], [*cuts, len(records)]):
        with OrmSession(engine) as db, db.begin():
            Stitcher(db).write(records[a:b])
    with OrmSession(engine) as db:
        stored = {t.id: t for t in db.scalars(select(Turn).where(Turn.id.in_([r.id for r in records])))}
        db.expunge_all()
    return stored


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow],
          phases=[Phase.generate])  # derandomized: no database of examples to replay, no shrinking
@given(r=st.randoms(use_true_random=False), first=st.integers(0, len(KINDS) - 1), count=st.integers(1, 3),
       batches=st.integers(1, 4), shared_system=st.booleans())
def test_each_edit_joins_its_session_and_unrelated_sessions_never_merge(
        module_sqlite_engine: Engine, r: random.Random, first: int, count: int, batches: int,
        shared_system: bool) -> None:
    kinds = [KINDS[(first + i) % len(KINDS)] for i in range(count)]
    clock = CLOCK
    system = f"agent {uuid.uuid4().hex[:6]}"
    sessions = [plan_session(r, n, kind, clock, system if shared_system else f"agent {uuid.uuid4().hex[:6]}")
                for n, kind in enumerate(kinds)]
    # interleaved as concurrent sessions arrive, each session's calls in its own order
    planned, queues = [], [list(s) for s in sessions]
    while any(queues):
        planned.append(r.choice([q for q in queues if q]).pop(0))
    records = [p.record for p in planned]
    cuts = sorted(r.sample(range(1, len(records)), min(batches - 1, len(records) - 1)))
    result = outcome(_write(module_sqlite_engine, records, cuts), planned)
    assert (result.splits, result.false_merges, result.wrong_parent, result.wrong_edit,
            result.wrong_next_state) == (0, 0, 0, 0, 0), (kinds, result.failures)


@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_of_edit_joins_its_session(module_sqlite_engine: Engine, kind: str) -> None:
    """Every kind, every run, whatever the property above drew: its session written alone, then
    beside two unrelated ones opening with the same system prompt, in two batches."""
    r = random.Random(f"edit-{kind}")
    system = f"agent {uuid.uuid4().hex[:6]}"
    sessions = [plan_session(r, n, k, CLOCK, system) for n, k in enumerate([kind, kind, KINDS[0]])]
    planned = [p for s in sessions for p in s]
    records = [p.record for p in planned]
    result = outcome(_write(module_sqlite_engine, records, [len(records) // 2]), planned)
    assert (result.splits, result.false_merges, result.wrong_parent, result.wrong_edit,
            result.wrong_next_state) == (0, 0, 0, 0, 0), (kind, result.failures)


# -- the pieces ----------------------------------------------------------------------------------------

CALL = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "chatcmpl-tool-1a2b", "type": "function", "function": {"name": "exec", "arguments": '{"cmd": "ls"}'}}]}
RESULT = {"role": "tool", "tool_call_id": "chatcmpl-tool-1a2b", "content": "a.txt"}
SYSTEM = {"role": "system", "content": "You are an agent."}


def _replayed(call_id: str) -> list[dict[str, Any]]:
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": "exec", "arguments": '{"cmd":"ls"}'}}]}
    return [call, {"role": "tool", "tool_call_id": call_id, "content": "a.txt"}]


def test_a_tool_result_compares_by_the_call_it_answers_not_its_id() -> None:
    user = {"role": "user", "content": "list"}
    assert loose_forms([user, CALL, RESULT])[1:] == loose_forms([user, *_replayed("toolu_99")])[1:]
    other = [user, {**CALL, "tool_calls": [{**CALL["tool_calls"][0], "function": {"name": "read", "arguments": "{}"}}]},
             RESULT]
    assert loose_forms([user, CALL, RESULT])[2] != loose_forms(other)[2]


def test_a_summary_inserted_or_in_place_of_earlier_messages_is_named() -> None:
    turn = [SYSTEM, {"role": "user", "content": "q0"}, {"role": "assistant", "content": "a0"},
            {"role": "user", "content": "q1"}]
    reply = {"role": "assistant", "content": "a1"}
    summary = {"role": "user", "content": "Summary of the conversation so far: q0 was answered."}
    inserted = [SYSTEM, summary, *turn[1:], reply, {"role": "user", "content": "q2"}]
    replaced = [SYSTEM, summary, turn[3], reply, {"role": "user", "content": "q2"}]
    stray = [SYSTEM, {"role": "user", "content": "something else"}, turn[3], reply]
    for request, kind in ((inserted, COMPACTION_INSERT), (replaced, COMPACTION_REPLACE), (stray, None)):
        forms = loose_forms(request)
        at = next(i for i, m in enumerate(request) if m is reply)
        assert (i := [k for k, h in request_pairs(request) if k == at]) and reply_pairs(turn, [reply])
        found = align(request, forms, i[0], turn, loose_forms(turn))
        assert (found.edit if found else None) == kind, (kind, found)


def test_another_system_prompt_continues_nothing() -> None:
    turn = [SYSTEM, {"role": "user", "content": "q0"}]
    reply = {"role": "assistant", "content": "a0"}
    request = [{"role": "system", "content": "You are someone else."}, turn[1], reply, {"role": "user", "content": "x"}]
    assert align(request, loose_forms(request), 2, turn, loose_forms(turn)) is None
    dropped = [turn[1], reply, {"role": "user", "content": "x"}]
    found = align(dropped, loose_forms(dropped), 1, turn, loose_forms(turn))
    assert found is not None and found.whole and found.dropped_system


@pytest.mark.parametrize("labels", [("[user]", "[assistant]"), ("User:", "Assistant:"), ("**Human:**", "**AI:**"),
                                    ("<user>", "<assistant>")])
def test_a_summarisation_call_is_known_by_its_shape_whatever_its_wording(labels: tuple[str, str]) -> None:
    transcript = f"{labels[0]}\nlist the files\n{labels[1]}\na.txt b.txt"
    assert embedded_transcript(transcript)
    call = [{"role": "system", "content": "Condense this chat into a short summary."},
            {"role": "user", "content": f"<transcript>\n{transcript}\n</transcript>"}]
    assert summary_shape(call, has_tools=False) == "embedded"
    assert summary_shape(call, has_tools=True) is None  # an agent's own call declares its tools
    # a transcript of one side only, or one to do something else with, is no summarisation call
    assert summary_shape([call[0], {"role": "user", "content": f"{labels[0]}\nhi"}], has_tools=False) is None
    assert summary_shape([{"role": "user", "content": f"Translate this: {transcript}"}], has_tools=False) is None


def test_a_persons_request_for_a_summary_stays_main() -> None:
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    short = [*history, {"role": "user", "content": "Can you summarise our conversation?"}]
    assert summary_shape(short, has_tools=False) is None
    long = [*history, {"role": "user", "content": "Write a detailed summary of the conversation so far. " * 5}]
    assert summary_shape(long, has_tools=False) == "appended"


def test_openclaws_recovery_pass_as_captured_joins_the_loop(engine: Engine) -> None:
    """The real client's recovery pass (openclaw 2026.9.6, captured through a gateway): the loop's
    calls carry the session key in the first user message's Runtime line, after an arrival stamp;
    the pass after the empty reply of call 2 drops the system prompt, the tools, the stamp, the
    Runtime line and that empty reply, and asks for the answer. It goes on from call 2."""
    sid = f"oc-{uuid.uuid4().hex[:10]}"
    system = {"role": "system", "content": "<!-- openclaw:attempt:STABLE -->\nYou are a personal assistant running "
                                           "inside OpenClaw.\n## Tooling"}
    words = f"Check the session status with the session_status tool. {uuid.uuid4().hex[:6]}"
    user = {"role": "user", "content": f"[Sun 2026-11-29 02:59 UTC] {words}\n\nRuntime: agent=main | "
                                       f"session=agent:main:explicit:{sid} | sessionId={sid} | host=vm"}
    call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "chatcmpl-tool-9600bb112f78f71a", "type": "function", "function": {"name": "session_status",
                                                                                  "arguments": "{}"}}]}
    replayed = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "chatcmpltool9600bb112f78f71a", "type": "function", "function": {"name": "session_status",
                                                                                "arguments": "{}"}}]}
    result = {"role": "tool", "tool_call_id": "chatcmpltool9600bb112f78f71a", "content": "OpenClaw 2026.9.6 status"}
    instruction = {"role": "user", "content": "The previous assistant turn completed its tool calls but did not "
                                              "produce a user-visible answer. Continue from the current transcript "
                                              "and produce the final user-visible answer now."}
    tools = {"tools": [{"type": "function", "function": {"name": "session_status"}}], "tool_choice": "auto"}
    one = turn_record([system, user], call, params=tools, session_id=sid, session_source="key", client="openclaw")
    two = turn_record([system, user, replayed, result], " ", params=tools, session_id=sid, session_source="key",
                      client="openclaw")
    three = turn_record([{"role": "user", "content": words}, replayed, result, instruction], "The status is ok.")
    for record in (one, two, three):
        with OrmSession(engine) as db, db.begin():
            Stitcher(db).write([record])
    with OrmSession(engine) as db:
        turns = {t.id: t for t in db.scalars(select(Turn).where(Turn.id.in_([one.id, two.id, three.id])))}
        assert {t.session_id for t in turns.values()} == {sid}
        assert turns[one.id].next_state == {"turn_id": two.id, "messages": [result]}  # the tool result
        assert turns[three.id].parent_turn_id == two.id and turns[three.id].edit == "recovery"
        assert turns[two.id].next_state == {"turn_id": three.id, "messages": [instruction]}
