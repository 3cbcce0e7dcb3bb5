"""Matching a continuing request to the turn it continues survives what clients do to history
(docs/sessions.md), and never joins conversations that differ.

The generated conversations and rewrites are in tests/support/conversations.py. The census of
unrelated pairs prints its counts: ``pytest tests/datapool/test_session_matching.py -k census -s``.
"""

from __future__ import annotations

import copy
import json
import random
import uuid
from datetime import datetime, timedelta, timezone
from typing import Any, NamedTuple

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import Engine, select
from sqlalchemy.orm import Session as OrmSession

from datapool.db import make_engine
from datapool.models import Turn
from datapool.records import TurnRecord
from datapool.canonical import (
    CanonicalHistory,
    Prefixes,
    canonical_message,
    continuation_hashes,
    history_hash,
    link_candidates,
    request_hash,
    system_free_candidates,
)
from datapool.sessions import Stitcher
from tests.support.records import openclaw_tool_loop, turn_record
from tests.support.conversations import (
    REWRITES,
    Request,
    Step,
    draw_steps,
    requests,
    same_history,
)

T0 = datetime(2026, 11, 26, tzinfo=timezone.utc)


def _record(req: Request, at: int) -> TurnRecord:
    return turn_record(req.messages, req.reply, at=T0 + timedelta(seconds=at))


def _write(engine: Engine, *batches: list[TurnRecord]) -> None:
    for batch in batches:
        with OrmSession(engine) as db, db.begin():
            Stitcher(db).write(batch)


def _stored(engine: Engine, ids: list[str]) -> dict[str, Turn]:
    with OrmSession(engine) as db:
        rows = db.scalars(select(Turn).where(Turn.id.in_(ids))).all()
        db.expunge_all()
    return {t.id: t for t in rows}


def _assert_one_session(engine: Engine, records: list[TurnRecord]) -> None:
    """One session; each turn's parent is the turn before it and its next state is what the
    next request appended after its reply, as that request sent it."""
    turns = _stored(engine, [r.id for r in records])
    assert len({t.session_id for t in turns.values()}) == 1
    for k, r in enumerate(records):
        t = turns[r.id]
        assert t.parent_turn_id == (records[k - 1].id if k else None)
        if k + 1 == len(records):
            assert t.next_state is None
        else:
            nxt = records[k + 1]
            assert t.next_state == {"turn_id": nxt.id, "messages": nxt.messages[len(r.messages) + 1:]}


# --- the cases seen in the wild, and the rules one at a time -------------------------------------


def test_openclaw_tool_loop_stays_in_its_session(database_url: str) -> None:
    engine = make_engine(database_url)
    records = openclaw_tool_loop()
    _write(engine, records)
    _assert_one_session(engine, records)
    turns = _stored(engine, [r.id for r in records])
    assert turns[records[0].id].next_state["messages"] == [
        {"role": "tool", "tool_call_id": "chatcmpltool82f1a7c0d5e94b6f", "content": "a.txt\nb.txt"}]
    # the pool keeps the request exactly as sent
    assert turns[records[1].id].request["messages"][2]["tool_calls"][0]["id"] == "chatcmpltool82f1a7c0d5e94b6f"
    engine.dispose()


def _call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _digest(messages: list[dict[str, Any]]) -> str:
    h = CanonicalHistory()
    for m in messages:
        h.add(m)
    return h.hexdigest()


def _form(message: dict[str, Any]) -> str:
    # as hashed: compared as JSON text, where true is not 1
    return json.dumps(canonical_message(message), sort_keys=True, ensure_ascii=False)


def test_canonical_form_rules() -> None:
    call = {"role": "assistant", "content": None, "tool_calls": [_call("c-1", "f", '{"a": 1, "b": [1.0, "é"]}')]}
    same = [
        # another id, arguments re-serialised (key order, spacing, escapes, 1.0 printed as 1), a
        # `name` added, content "" for null, the tool call's `type` dropped
        {"role": "assistant", "content": "", "name": "bot",
         "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": '{"b":[1,"\\u00e9"],"a":1}'}}]},
    ]
    for other in same:
        assert _form(other) == _form(call)
    different = [
        {"role": "assistant", "content": None, "tool_calls": [_call("c-1", "g", '{"a": 1, "b": [1.0, "é"]}')]},
        {"role": "assistant", "content": None, "tool_calls": [_call("c-1", "f", '{"a": true, "b": [1.0, "é"]}')]},
        {"role": "assistant", "content": None, "tool_calls": [_call("c-1", "f", '{"a": 1, "b": ["é", 1.0]}')]},
        {"role": "assistant", "content": None, "tool_calls": [_call("c-1", "f", '{"a": 1, "b": [1.5, "é"]}')]},
        {"role": "assistant", "content": "sure", "tool_calls": [_call("c-1", "f", '{"a": 1, "b": [1.0, "é"]}')]},
    ]
    for other in different:
        assert _form(other) != _form(call), other
    # arguments that are not JSON are compared as sent; an empty string is no arguments
    bad = {"role": "assistant", "tool_calls": [_call("x", "f", "{oops")]}
    assert _form(bad) != _form({"role": "assistant", "tool_calls": [_call("x", "f", "{oops ")]})
    assert _form({"role": "assistant", "tool_calls": [_call("x", "f", "")]}) == _form(
        {"role": "assistant", "tool_calls": [_call("y", "f", "{}")]})
    # text as a string or as parts (split anywhere, with cache_control) is the same text;
    # an image part is not text
    text = {"role": "user", "content": "hello world"}
    parts = {"role": "user", "content": [{"type": "text", "text": "hello "},
                                         {"type": "text", "text": "world", "cache_control": {"type": "ephemeral"}}]}
    image = {"role": "user", "content": [{"type": "text", "text": "hello world"},
                                         {"type": "image_url", "image_url": {"url": "data:x", "detail": None}}]}
    assert _form(text) == _form(parts) != _form(image)
    # a timestamp the client put in the text is part of the text
    assert _form(text) != _form({"role": "user", "content": "[Thu 2026-11-26 14:03 UTC] hello world"})


def test_tool_results_are_matched_to_calls_by_position() -> None:
    calls = {"role": "assistant", "tool_calls": [_call("a-1", "f", "{}"), _call("a-2", "g", "{}")]}
    results = [{"role": "tool", "tool_call_id": "a-1", "content": "x"}, {"role": "tool", "tool_call_id": "a-2", "content": "y"}]
    renamed = {"role": "assistant", "tool_calls": [_call("b1", "f", "{}"), _call("b2", "g", "{}")]}
    same = [{"role": "tool", "tool_call_id": "b1", "content": "x"}, {"role": "tool", "tool_call_id": "b2", "content": "y"}]
    swapped = [{"role": "tool", "tool_call_id": "b2", "content": "x"}, {"role": "tool", "tool_call_id": "b1", "content": "y"}]
    unknown = [{"role": "tool", "tool_call_id": "zz", "content": "x"}, {"role": "tool", "tool_call_id": "b2", "content": "y"}]
    assert _digest([calls, *results]) == _digest([renamed, *same])
    assert _digest([calls, *results]) != _digest([renamed, *swapped])
    assert _digest([calls, *results]) != _digest([renamed, *unknown])
    # ids reused from turn to turn (servers that number each message's calls from 0) name the latest call
    again = {"role": "assistant", "tool_calls": [_call("call_0", "f", "{}")]}
    first = [again, {"role": "tool", "tool_call_id": "call_0", "content": "1"}]
    second = [again, {"role": "tool", "tool_call_id": "call_0", "content": "2"}]
    other_ids = {"role": "assistant", "tool_calls": [_call("p", "f", "{}")]}, {"role": "assistant", "tool_calls": [_call("q", "f", "{}")]}
    assert _digest([*first, *second]) == _digest([
        other_ids[0], {"role": "tool", "tool_call_id": "p", "content": "1"},
        other_ids[1], {"role": "tool", "tool_call_id": "q", "content": "2"}])


def test_text_only_hashes_are_unchanged_by_the_new_form() -> None:
    # the form before 0007 hashed text messages the same way: pools stitch plain chat across the upgrade
    import hashlib
    import json

    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "é"}, {"role": "assistant", "content": "x"}]
    old = hashlib.sha256()
    for m in messages:
        old.update(json.dumps({"role": m["role"], "content": m["content"]}, sort_keys=True, ensure_ascii=False).encode())
        old.update(b"\x1e")
    assert link_candidates(messages)[0][1] == old.hexdigest()
    assert continuation_hashes(messages[:2], [messages[2]]) == [old.hexdigest()]


# --- property: rewritten histories stitch into one session -----------------------------------------


REWRITES_SEEN: dict[str, int] = {}
WRITTEN = {"conversations": 0, "turns": 0}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(r=st.randoms(use_true_random=False), batches=st.integers(1, 3), order=st.sampled_from(["sent", "reversed", "shuffled"]))
def test_rewritten_histories_stitch_into_one_session(module_sqlite_engine: Engine, r: random.Random, batches: int, order: str) -> None:
    steps = draw_steps(r, system=f"agent run {uuid.uuid4().hex}")
    reqs = requests(r, steps, REWRITES_SEEN)
    records = [_record(q, k) for k, q in enumerate(reqs)]
    # in any order and batching (replicas, a replayed spool)
    todo = records[::-1] if order == "reversed" else list(records)
    if order == "shuffled":
        r.shuffle(todo)
    cuts = sorted(r.sample(range(1, len(todo)), min(batches - 1, len(todo) - 1))) if len(todo) > 1 else []
    _write(module_sqlite_engine, *[todo[a:b] for a, b in zip([0, *cuts], [*cuts, len(todo)])])
    _assert_one_session(module_sqlite_engine, records)
    WRITTEN["conversations"] += 1
    WRITTEN["turns"] += len(records)


@pytest.mark.parametrize("batches", ["one", "each"])
def test_grandchild_written_before_its_parent(database_url: str, batches: str) -> None:
    # turn 2 links to turn 0 while turn 1 is missing and takes turn 0's next state; when turn 1
    # comes it gives turn 0 the next state, and turn 2 moves under it
    r = random.Random(7)
    steps = draw_steps(r, system=f"agent run {uuid.uuid4().hex}", rounds=3)
    records = [_record(q, k) for k, q in enumerate(requests(r, steps))]
    assert len(records) >= 4
    order = [records[0], records[2], records[3], records[1], *records[4:]]
    engine = make_engine(database_url)
    _write(engine, *([order] if batches == "one" else [[x] for x in order]))
    _assert_one_session(engine, records)
    engine.dispose()


def test_every_rewrite_was_exercised() -> None:
    # runs after the property test above (file order): each rewrite changed some request
    print(f"\nstitched: {WRITTEN['conversations']} conversations, {WRITTEN['turns']} turns, "
          f"{sum(REWRITES_SEEN.values())} rewrites applied, each one session with the right next states")
    assert set(REWRITES_SEEN) == set(REWRITES), set(REWRITES) - set(REWRITES_SEEN)


# --- unrelated conversations never merge ------------------------------------------------------------


def _mutate(r: random.Random, steps: list[Step], d: int) -> list[Step] | None:
    """``steps`` with step ``d`` changed in what it says (not merely in how it is written)."""
    b = list(steps)
    b[d] = s = copy.deepcopy(steps[d])
    kind = r.randrange(4)
    if s.role in ("system", "user") or (s.role == "assistant" and kind == 0) or (s.role == "tool" and kind < 2):
        if s.role == "user" and s.text.startswith("[") and r.random() < 0.5:
            s.text = "[Thu 2026-11-26 14:05 UTC] " + s.text.split("] ", 1)[1]  # only the time differs
        else:
            words = s.text.split(" ") if s.text else []
            words.insert(r.randrange(len(words) + 1), r.choice(["list", "ok", "why", "é"]))
            s.text = " ".join(words)
    elif s.role == "tool":
        lo, hi = d, d
        while b[lo - 1].role == "tool":
            lo -= 1
        while hi + 1 < len(b) and b[hi + 1].role == "tool":
            hi += 1
        peers = [t for t in b[lo: hi + 1] if t is not s]  # the results of the same calls
        if not peers:
            return None
        k = b.index(r.choice(peers))
        b[k] = t = copy.deepcopy(b[k])
        s.answers, t.answers = t.answers, s.answers  # results handed to each other's calls
    elif not s.calls:
        return None
    elif kind == 1 and len(s.calls) > 1:
        i, j = r.sample(range(len(s.calls)), 2)
        s.calls[i], s.calls[j] = s.calls[j], s.calls[i]
    elif kind == 2:
        c = r.choice(s.calls)
        c.name = r.choice(["read", "exec", "web_search", "edit", "write"])
    else:
        c = r.choice(s.calls)
        key = r.choice(["path", "n", "flag", "extra"])
        if r.random() < 0.8:
            c.args[key] = r.choice([1, True, "1", None, 1.5, [1], {}])
        else:
            c.args.pop(key, None)
    return b


class _Keys(NamedTuple):
    """A request's stitching keys, each history hashed once: its messages, and them without
    the first (the system prompt, which every drawn conversation opens with)."""

    whole: Prefixes
    tail: Prefixes
    reply: str  # continuation_hashes(q.messages, [q.reply])[0]
    tail_reply: str  # the same without the system prompt


def _keys(q: Request) -> _Keys:
    whole, tail = Prefixes(q.messages), Prefixes(q.messages[1:])
    return _Keys(whole, tail, whole.continuations([q.reply])[0], tail.continuations([q.reply])[0])


def _trajectory_matches(x: list[Step], rx: list[Request], y: list[Step], ry: list[Request],
                        keys: dict[int, _Keys], counts: dict[str, Any]) -> None:
    """The trajectory graph's links beyond a continued reply, counted like the census's: a
    request of *y* sent without its system prompt that continues a reply of *x* (the turns'
    continuations without the system message), and one that extends a request of *x* without
    its reply (retry_candidates against request_hash; every turn here succeeded, so only a
    strict extension counts)."""
    nosys = {keys[id(q)].tail_reply: q.prefix + 1 for q in rx}
    asked = {keys[id(q)].whole.request(): q.prefix for q in rx}
    for q in ry:
        for index, h in keys[id(q)].tail.links():
            n = nosys.get(h)
            if n is not None:
                counts["dropped_system_matches"] += 1
                counts["false_merges"] += not same_history(x[1:n], y[1: index + 2])
        for k, h in keys[id(q)].whole.retries():
            n = asked.get(h)
            if n is not None and k < len(q.messages):
                counts["retry_matches"] += 1
                counts["false_merges"] += not same_history(x[:n], y[:k])


def census(pairs: int, seed: int = 0) -> dict[str, Any]:
    """Draws ``pairs`` pairs of conversations that open alike and differ later, each request sent
    with random rewrites, and counts how often a request of one continues a turn of the other."""
    r = random.Random(seed)
    counts: dict[str, Any] = {"pairs": 0, "conversations": 0, "requests": 0, "rewrites": {},
                              "shared_prefix_matches": 0, "false_merges": 0, "dropped_system_matches": 0,
                              "retry_matches": 0}
    while counts["pairs"] < pairs:
        a = draw_steps(r, system=r.choice(["You are helpful.", "You are an agent."]))
        if r.random() < 0.7:
            # the same conversation up to step d, then one step says something else
            d = r.randrange(1, len(a))
            b = _mutate(r, a, d)
            if b is None or same_history(a[: d + 1], b[: d + 1]):
                continue
        else:
            # drawn on its own with the same system prompt and first user message
            b = draw_steps(r, system=a[0].text)
            b[1] = copy.deepcopy(a[1])
            d = 1
        counts["pairs"] += 1
        counts["conversations"] += 2
        ra, rb = requests(r, a, counts["rewrites"]), requests(r, b, counts["rewrites"])
        counts["requests"] += len(ra) + len(rb)
        keys = {id(q): _keys(q) for q in (*ra, *rb)}
        for x, rx, y, ry in ((a, ra, b, rb), (b, rb, a, ra)):
            ends = {keys[id(q)].reply: q.prefix + 1 for q in rx}
            for q in ry:
                for index, h in keys[id(q)].whole.links():
                    n = ends.get(h)
                    if n is None:
                        continue
                    if same_history(x[:n], y[: index + 1]):
                        counts["shared_prefix_matches"] += 1
                    else:
                        counts["false_merges"] += 1
            _trajectory_matches(x, rx, y, ry, keys, counts)
    return counts


def test_census_of_unrelated_pairs_finds_no_false_merge() -> None:
    counts = census(10_000)
    print(f"\ncensus: {counts['pairs']} pairs, {counts['conversations']} conversations, "
          f"{counts['requests']} requests, {sum(counts['rewrites'].values())} rewrites applied "
          f"({', '.join(f'{k} {v}' for k, v in sorted(counts['rewrites'].items()))}), "
          f"{counts['shared_prefix_matches']} matches on a shared history, "
          f"{counts['dropped_system_matches']} without the system prompt, {counts['retry_matches']} extending a "
          f"request without its reply, {counts['false_merges']} false merges")
    assert counts["false_merges"] == 0
    # the pairs did share histories, and every rewrite was applied: the count is not vacuous
    assert counts["shared_prefix_matches"] > counts["pairs"] // 2
    assert counts["dropped_system_matches"] > counts["pairs"] // 2
    assert set(counts["rewrites"]) == set(REWRITES)


@settings(max_examples=200, deadline=None)
@given(r=st.randoms(use_true_random=False))
def test_pairs_that_differ_never_share_a_continuation(r: random.Random) -> None:
    # the census's pairs, drawn by hypothesis so that a counterexample is shrunk and kept
    a = draw_steps(r)
    d = r.randrange(1, len(a))
    b = _mutate(r, a, d)
    if b is None or same_history(a[: d + 1], b[: d + 1]):
        return
    ends = {continuation_hashes(q.messages, [q.reply])[0]: q.prefix for q in requests(r, a)}
    for q in requests(r, b):
        for index, h in link_candidates(q.messages):
            if index >= d:
                assert h not in ends, (index, d)


@settings(max_examples=150, deadline=None)
@given(r=st.randoms(use_true_random=False))
def test_one_pass_keys_are_each_prefix_hashed_on_its_own(r: random.Random) -> None:
    """Prefixes reads every stitching key from one pass over a history; each must be what
    hashing that prefix on its own gives (history_hash feeds a fresh hasher)."""
    import hashlib

    def salted(h: str) -> str:
        return hashlib.sha256(b"request\x1e" + h.encode()).hexdigest()

    for q in requests(r, draw_steps(r)):
        m = q.messages
        p = Prefixes(m)
        assistants = [i for i, x in enumerate(m) if x.get("role") == "assistant"]
        assert p.links() == [(i, history_hash(m[: i + 1])) for i in reversed(assistants)]
        start = assistants[-1] + 1 if assistants else 1
        assert p.retries() == [(k, salted(history_hash(m[:k]))) for k in range(len(m), start - 1, -1)]
        assert p.request() == salted(history_hash(m)) == request_hash(m)
        assert p.continuations([q.reply]) == [history_hash([*m, q.reply])]
        kept = [i for i, x in enumerate(m) if x.get("role") not in ("system", "developer")]
        rest = [m[i] for i in kept]
        assert system_free_candidates(m) == ([(kept[j], history_hash(rest[: j + 1])) for j in range(len(rest) - 1, -1, -1)
                                              if rest[j].get("role") == "assistant"] if len(rest) < len(m) else [])


def test_a_runtime_line_in_its_own_text_part_is_a_session_key() -> None:
    """After a compaction OpenClaw sends the summary and its Runtime line as two text parts:
    the line-anchored key regex must see the second part's line."""
    from base.settings import DEFAULT_SESSION_KEYS
    from gateway.classify import session_key

    body = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "<summary>the user asked for the weather</summary>"},
        {"type": "text", "text": "Runtime: agent=main | sessionId=oc-7f3a | model=smollm2"},
    ]}]}
    assert session_key(DEFAULT_SESSION_KEYS, {}, body) == "oc-7f3a"
