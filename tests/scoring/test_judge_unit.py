"""Votes, majority and hint choice: the rules, without any service."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from scoring.judge import Vote, choose_hint, coerce_vote, next_state_role, parse_vote, render_prompt, tally


def test_majority_tie_and_unparsable() -> None:
    assert tally([-1, -1, 1]).majority == -1 and tally([-1, -1, 1]).status == "scored"
    assert tally([1, None, 1]).majority == 1  # an unparsable vote does not count
    t = tally([1, -1, 0])
    assert (t.status, t.majority, t.mean) == ("tie", None, 0.0)
    assert tally([1, -1, None]).status == "tie"
    u = tally([None, None, None])
    assert (u.status, u.majority, u.mean) == ("unparsable", None, None)
    assert tally([0, 0, 1]).majority == 0 and tally([0, 0, 1]).mean == pytest.approx(1 / 3)


def test_parse_vote_reads_json_then_falls_back() -> None:
    v = parse_vote('{"vote": -1, "rationale": "user corrected it", "hint": "Answer in French."}')
    assert v == Vote(-1, "user corrected it", "Answer in French.", raw=v.raw)
    assert parse_vote('Sure! {"vote": "+1", "rationale": "ok", "hint": null} Done.').value == 1
    assert parse_vote('{"vote": 1, "rationale": "", "hint": "  "}').hint is None
    assert parse_vote("My verdict... vote: -1 because").value == -1
    bad = parse_vote("I think it was fine")
    assert bad.value is None and bad.raw == "I think it was fine"
    assert parse_vote('{"vote": 7}').value is None  # out of range is unparsable, not clamped


def test_python_judge_results_are_checked() -> None:
    assert coerce_vote(1) == Vote(1)
    assert coerce_vote({"vote": -1, "hint": "x"}) == Vote(-1, "", "x")
    for bad in (2, True, "1", {"vote": 3}):
        with pytest.raises((TypeError, ValueError)):
            coerce_vote(bad)


def test_hint_is_the_one_voters_agree_on_most_not_the_longest() -> None:
    hints = [
        "Check the file exists before reading it.",
        "You should have checked that the file exists first, then read it, and also consider "
        "logging, retries, permissions and a dozen other unrelated things.",
        "Check that the file exists before you read it.",
    ]
    assert choose_hint(hints) in (hints[0], hints[2])
    assert choose_hint(["only one"]) == "only one"
    assert choose_hint([]) is None and choose_hint(["", "  "]) is None
    assert choose_hint(["a b", "c d"]) == "a b"  # no agreement: the earliest vote


def test_prompt_shows_action_and_next_state_with_its_role() -> None:
    turn = {"request": {"messages": [{"role": "user", "content": "read config.yaml"}]},
            "response": {"content": None, "tool_calls": [
                {"function": {"name": "read_file", "arguments": '{"path": "config.yaml"}'}}]}}
    state = {"messages": [{"role": "tool", "content": "Error: no such file"}]}
    text = render_prompt("{context}|{action}|{next_state_role}|{next_state}", turn, state)
    assert "read config.yaml" in text and 'read_file({"path": "config.yaml"})' in text
    assert "an error from a tool" in text and "no such file" in text
    assert next_state_role({"messages": [{"role": "user", "content": "thanks"}]}) == "the user's reply"
    assert next_state_role({"end": True}) == "the session ended"
    assert next_state_role({"feedback": [{"value": -1}]}) == "the user's feedback"


# -- the hint-quality gate (scoring.judge.hint_is_valid) -----------------------------

TOO_LONG = {"messages": [{"role": "user", "content": "Too long. Please keep your answers short, under 25 words."}]}


def test_a_hint_restating_the_next_state_is_grounded() -> None:
    from scoring.judge import hint_is_valid

    assert hint_is_valid("Keep answers short, under 25 words.", TOO_LONG, ["Keep answers short, under 25 words."])
    tool = {"messages": [{"role": "tool", "content": "Error: config.yaml: no such file"}]}
    assert hint_is_valid("Check that config.yaml exists first.", tool, [])
    assert hint_is_valid("The file!", {"feedback": "you forgot the file"}, [])  # one content word: all of it
    assert not hint_is_valid("Mention the file.", {"feedback": "you forgot the file"}, [])  # 1 of 2


def test_an_ungrounded_lone_hint_is_dropped() -> None:
    """What SmolLM2 judging itself wrote under `make up`'s default: nothing in it is in the next
    state, and no other vote agrees."""
    from scoring.judge import hint_is_valid

    assert not hint_is_valid("need to shine carpet", TOO_LONG, ["need to shine carpet"])
    assert not hint_is_valid("bon Ton lud", TOO_LONG, ["bon Ton lud", "The answer was wrong about Paris."])
    assert not hint_is_valid("need to shine carpet", None, [])  # no next state, no votes
    assert not hint_is_valid("the and of", TOO_LONG, ["the and of", "the and of"])  # no content words


def test_an_ungrounded_hint_the_votes_agree_on_is_kept() -> None:
    from scoring.judge import hint_is_valid

    hints = ["Answer with the capital city name only.", "Answer with only the capital city name.", "Say Paris."]
    assert hint_is_valid(hints[0], {"messages": [{"role": "user", "content": "No."}]}, hints)
    # the same text given by one vote only is not agreement
    assert not hint_is_valid(hints[0], {"messages": [{"role": "user", "content": "No."}]}, hints[:1])


@given(st.lists(st.text(alphabet="abcdefghij klmnop", min_size=1, max_size=40), min_size=1, max_size=5),
       st.text(alphabet="abcdefghij klmnop.,", max_size=120))
def test_gate_rules_hold_for_any_hints(hints: list[str], state_text: str) -> None:
    from scoring.judge import _content_words, hint_is_valid

    state = {"messages": [{"role": "user", "content": state_text}]}
    hint = choose_hint(hints)
    if hint is None:
        return
    # a hint copied into the next state is always grounded (if it has content words at all)
    assert hint_is_valid(hint, {"messages": [{"role": "user", "content": state_text + " " + hint}]}, hints) \
        == bool(_content_words(hint))
    # a hint sharing no content word with the next state is valid only by agreement
    if not (_content_words(hint) & _content_words(state_text)):
        assert hint_is_valid(hint, state, hints) == hint_is_valid(hint, None, hints)
    # a single vote never agrees with itself
    assert hint_is_valid(hint, None, [hint]) is False
