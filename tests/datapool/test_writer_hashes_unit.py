"""The capture writer's per-turn hashes, made with less work, are the hashes made before, on random
histories: datapool.edits.pair_continuations against its former composition of request_tail and
reply_pairs (which made the last non-system message's loose form twice), and made from a Prefixes' canonical
forms (datapool.edits.loose_form_in) instead of canonicalising the messages again; datapool.canonical.prepare,
whose system-free pass hashes the whole pass's canonical forms (Prefixes.kept), against each message
canonicalised by a pass of its own."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any
from unittest.mock import patch

from hypothesis import given, settings
from hypothesis import strategies as st

from base.vocab import Endpoint, TurnKind, TurnStatus
from datapool.canonical import CanonicalHistory, Continuation, Prefixes, continuations_of, prepare
from datapool.edits import (TAIL_INDEX, loose_form_at, loose_form_in, pair_continuations, reply_pair_index,
                            reply_pairs, request_tail)
from tests.support.records import turn_record

_text = st.sampled_from(["", "hi", "[Thu 2026-11-26 14:03 UTC] list the files", "4", "x\nRuntime: a sessionId=1",
                         "<system-reminder>d</system-reminder>ok"])
_content = st.one_of(st.none(), _text, st.lists(st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": _text}),
    st.fixed_dictionaries({"type": st.just("image_url"), "image_url": st.just({"url": "u", "detail": None})})),
    max_size=3))
_call = st.fixed_dictionaries({"id": st.sampled_from(["c1", "c2", "", "call-3"]), "type": st.just("function"),
                               "function": st.fixed_dictionaries({"name": st.sampled_from(["calc", "exec"]),
                                                                  "arguments": st.sampled_from(
                                                                      ['{"e":"2+2"}', '{"e": "2+2"}', "", "nojson"])})})


@st.composite
def _message(draw: Any) -> Any:
    if draw(st.integers(0, 30)) == 0:
        return draw(st.sampled_from(["a string", None, 3]))
    m: dict[str, Any] = {"role": draw(st.sampled_from(["system", "developer", "user", "assistant", "tool"])),
                         "content": draw(_content)}
    if m["role"] == "assistant" and draw(st.booleans()):
        m["tool_calls"] = draw(st.lists(_call, max_size=2))
    if m["role"] == "tool" or (m.get("tool_calls") and draw(st.integers(0, 5)) == 0):
        m["tool_call_id"] = draw(st.sampled_from(["c1", "c2", "call-3", "other"]))
    return m


def _former(r: Any) -> list[Continuation]:
    tail = request_tail(r.messages)
    out = [Continuation(tail, TAIL_INDEX, len(r.messages))] if tail else []
    if r.status == TurnStatus.OK:
        out += [Continuation(h, reply_pair_index(i), 0) for i, h in enumerate(reply_pairs(r.messages, r.replies))]
    return out


@settings(max_examples=400, deadline=None)
@given(messages=st.lists(_message(), max_size=8), replies=st.lists(_message(), max_size=3),
       status=st.sampled_from([TurnStatus.OK, "error"]))
def test_pair_continuations_are_those_made_before(messages: list[Any], replies: list[Any], status: str) -> None:
    r = SimpleNamespace(turn_type=TurnKind.MAIN, endpoint=Endpoint.CHAT, status=status, messages=messages,
                        replies=replies)
    assert pair_continuations(r) == _former(r)
    if all(isinstance(m, dict) for m in messages + replies):  # what a Prefixes takes
        prefixes = Prefixes(messages)
        if status == TurnStatus.OK:
            prefixes.continuations(replies)  # replies_encoded made first, as prepare makes it
        assert pair_continuations(r, prefixes) == _former(r)
        assert [loose_form_in(prefixes, i) for i in range(len(messages))] == [
            loose_form_at(messages, i) for i in range(len(messages))]


# -- prepare: the system-free pass hashes the whole pass's canonical forms instead of making them again --


def _old_prefixes(messages: list[Any]) -> tuple[list[str], CanonicalHistory]:
    """Prefixes as it was: every message canonicalised by its own pass."""
    h = CanonicalHistory()
    digests = []
    for m in messages:
        h.add(m)
        digests.append(h.hexdigest())
    return digests, h


def _old_continuations(end: CanonicalHistory, replies: list[Any]) -> list[str]:
    out = []
    for reply in replies:
        h = end.copy()
        h.add(reply)
        out.append(h.hexdigest())
    return out


_dict_message = _message().filter(lambda m: isinstance(m, dict))
_system_call = st.fixed_dictionaries({"role": st.just("system"), "content": _text,
                                      "tool_calls": st.lists(_call, min_size=1, max_size=1)})


@settings(max_examples=400, deadline=None)
@given(messages=st.lists(st.one_of(_dict_message, _system_call), max_size=8),
       replies=st.lists(_dict_message, max_size=3), status=st.sampled_from([TurnStatus.OK, "error"]))
def test_prepare_makes_the_hashes_it_made_before(messages: list[Any], replies: list[Any], status: str) -> None:
    kept = [i for i, m in enumerate(messages) if m.get("role") not in ("system", "developer")]
    whole = Prefixes(messages)
    digests, end = _old_prefixes(messages)
    assert whole.digests == digests and whole.end.hexdigest() == end.hexdigest()
    rest = whole.kept(kept)
    rest_digests, rest_end = _old_prefixes([messages[i] for i in kept])
    assert rest.digests == rest_digests and rest.end.hexdigest() == rest_end.hexdigest()
    assert rest.messages == [messages[i] for i in kept]
    encoded = whole.replies_encoded(replies)
    assert whole.continuations(replies, encoded) == whole.continuations(replies) == _old_continuations(end, replies)
    same = encoded if rest.source is whole.source else None
    assert rest.continuations(replies, same) == _old_continuations(rest_end, replies)

    r = turn_record(messages, {"role": "assistant", "content": "ok"} if status == TurnStatus.OK else None,
                    status=status)
    r.response = {"choices": [{"index": i, "message": m} for i, m in enumerate(replies)]} if replies else r.response
    slow = prepare(r)
    with patch.object(Prefixes, "kept", lambda self, indices: Prefixes([self.messages[i] for i in indices])):
        assert prepare(r) == slow
    assert continuations_of(r) == slow.continuations
