"""Fitting the judge prompt to the judge's context window (scoring.fit), without services:
a tokenizer of one token per character makes every count exact, so the properties are checked to
the token; tests/scoring/test_judge_long.py fits a real ~10k-token turn with vLLM's tokenizer."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence
from typing import Any

import litellm
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from base.errors import JudgeRefused, PromptTooLong
from scoring.fit import allocate
from scoring.judge import CONTEXT_MESSAGES, LLMJudge, _raise_if_final, context_pieces
from base.vocab import DeadReason

OVERHEAD = 5  # the fake chat template's tokens per message


class CharTokenizer:
    """One token per character; the prompt costs its characters plus a fixed template overhead."""

    def __init__(self, window: int):
        self.window = window

    async def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    async def decode(self, ids: Sequence[int]) -> str:
        return "".join(map(chr, ids))

    async def count_prompt(self, messages: list[dict[str, Any]]) -> int:
        return sum(len(m["content"]) + OVERHEAD for m in messages)

    async def context_window(self) -> int | None:
        return self.window


TEXT = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cc", "Cs", "Zl", "Zp")), max_size=3000)
ROLE = st.sampled_from(["user", "assistant", "tool"])


def _turn(system: str | None, history: list[tuple[str, str]], action: str) -> dict[str, Any]:
    messages = ([{"role": "system", "content": system}] if system is not None else [])
    messages += [{"role": r, "content": c} for r, c in history]
    return {"id": "t", "request": {"messages": messages}, "response": {"content": action}}


MARK = re.compile(r"\[… (?:(\d+) earlier messages?, )?(\d+) tokens omitted …\]")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(system=st.one_of(st.none(), TEXT), history=st.lists(st.tuples(ROLE, TEXT), min_size=1, max_size=12),
       action=st.text(max_size=400), reply=st.text(max_size=400), window=st.integers(600, 12_000))
def test_fitted_prompt_fits_keeps_action_and_next_state_and_counts_what_it_omits(
        system: str | None, history: list[tuple[str, str]], action: str, reply: str, window: int) -> None:
    turn = _turn(system, history, action)
    state = {"messages": [{"role": "user", "content": reply}]}
    judge = LLMJudge("hosted_vllm/x", prompt="prm-v1", api_base="http://unused/v1", tokenizer=CharTokenizer(window))
    try:
        prompt, answer, fit = asyncio.run(judge.fitted_prompt(turn, state))
    except PromptTooLong:
        # only when the action and next state alone, with one marker for the context, cannot fit
        marker = f"[… {len(history) + (system is not None)} earlier messages, 99999 tokens omitted …]"
        bare = judge.template.format(context=marker, action=f"[assistant] {action}".rstrip(),
                                     next_state_role="the user's reply", next_state=f"[user] {reply}".rstrip())
        assert len(bare) + OVERHEAD > window - min(1024, window // 4)
        return
    assert answer == min(1024, window // 4)
    assert fit.prompt_tokens == len(prompt) + OVERHEAD <= window - answer
    assert f"## The assistant's action\n[assistant] {action}".rstrip() in prompt
    assert f"[user] {reply}".rstrip() in prompt
    pieces, dropped = context_pieces(turn)
    assert len(dropped) == max(0, len(history) - CONTEXT_MESSAGES)
    # every omission is marked, and each marker's N is exactly what went missing
    lines = fit.context.split("\n") if fit.context != "(none)" else []
    queue = list(pieces)
    found, run = [], None
    for line in lines:
        m = MARK.fullmatch(line)
        if m and m.group(1):  # the run of dropped messages: the window's and the oldest shown ones
            run = (int(m.group(1)), int(m.group(2)))
            del queue[:run[0] - len(dropped)]
            found.append(run[1])
            continue
        p = queue.pop(0)
        assert line.startswith(p.prefix)
        text = line[len(p.prefix):]
        if text == p.body:
            continue
        marks = MARK.findall(text)
        assert len(marks) == 1, (text, p, fit.context, [p.prefix + p.body for p in pieces])
        n = int(marks[0][1])
        head, _, tail = text.partition(f"[… {n} tokens omitted …]")
        head, tail = head.removesuffix(" "), tail.removeprefix(" ")
        assert p.body.startswith(head) and p.body.endswith(tail)
        assert n == len(p.body) - len(head) - len(tail) > 0
        found.append(n)
    assert not queue  # every piece is shown, cut, or counted in the run
    if dropped:
        assert run is not None
    assert sorted(found) == sorted(fit.markers) and sum(found) == fit.omitted
    if fit.omitted == 0 and not dropped:
        assert fit.context == "\n".join(p.prefix + p.body for p in pieces) or fit.context == "(none)"


@given(counts=st.lists(st.integers(0, 5000), min_size=1, max_size=10), room=st.integers(0, 20_000),
       has_system=st.booleans())
def test_allocation_stays_within_room_and_favours_recent_messages(counts: list[int], room: int,
                                                                  has_system: bool) -> None:
    system = 0 if has_system else None
    keep = allocate(counts, system, room)
    assert all(0 <= k <= c for k, c in zip(keep, counts))
    assert sum(keep) <= max(room, sum(counts) if sum(counts) <= room else 0) or sum(keep) <= room
    rest = [i for i in range(len(counts)) if i != system]
    # a message is cut or dropped only after every newer one was kept whole
    for a, b in zip(rest, rest[1:]):
        if keep[a] > 0:
            assert keep[b] == counts[b]


def test_a_turn_too_long_for_any_shortening_is_refused_as_context_window_exceeded() -> None:
    judge = LLMJudge("hosted_vllm/x", prompt="prm-v1", api_base="http://unused/v1", tokenizer=CharTokenizer(900))
    turn = _turn("sys", [("user", "hi")], "x" * 2000)
    with pytest.raises(JudgeRefused) as caught:
        asyncio.run(judge.vote(turn, {"messages": [{"role": "user", "content": "ok"}]}, 0))
    assert caught.value.reason == DeadReason.CONTEXT_WINDOW_EXCEEDED


@pytest.mark.parametrize(("exc", "reason"), [
    (litellm.ContextWindowExceededError("maximum context length is 8192", "m", "hosted_vllm"),
     DeadReason.CONTEXT_WINDOW_EXCEEDED),
    (litellm.BadRequestError("This model's maximum context length is 8192 tokens", "m", "hosted_vllm"),
     DeadReason.CONTEXT_WINDOW_EXCEEDED),
    (litellm.BadRequestError("response_format: invalid schema", "m", "hosted_vllm"), DeadReason.CLIENT_ERROR),
    (litellm.AuthenticationError("bad key", "hosted_vllm", "m"), DeadReason.CLIENT_ERROR),
    (litellm.NotFoundError("no such model", "m", "hosted_vllm"), DeadReason.CLIENT_ERROR),
    (litellm.RateLimitError("slow down", "hosted_vllm", "m"), None),
    (litellm.InternalServerError("boom", "hosted_vllm", "m"), None),
    (litellm.ServiceUnavailableError("busy", "hosted_vllm", "m"), None),
    (litellm.APIConnectionError("refused", "hosted_vllm", "m"), None),
    (litellm.Timeout("slow", "m", "hosted_vllm"), None),
    (ConnectionError("reset"), None),
])
def test_only_transient_judge_errors_are_left_to_retry(exc: Exception, reason: DeadReason | None) -> None:
    if reason is None:
        _raise_if_final(exc)  # returns: the task is retried
        return
    with pytest.raises(JudgeRefused) as caught:
        _raise_if_final(exc)
    assert caught.value.reason == reason


def test_litellm_tokenizer_fits_a_provider_judge_offline() -> None:
    """A judge LiteLLM knows (no vLLM /tokenize): its tokenizer and token_counter do the counting."""
    from tests.support.prompts import agent_system_prompt

    turn = _turn(agent_system_prompt(12_000), [("user", "List my files."), ("assistant", "Which folder?"),
                                              ("user", "The workspace.")], "AGENTS.md and notes/.")
    state = {"messages": [{"role": "user", "content": "No, run ls first."}]}
    judge = LLMJudge("gpt-4o-mini", prompt="prm-v1", context_tokens=2048)
    prompt, answer, fit = asyncio.run(judge.fitted_prompt(turn, state))
    assert answer == 512 and fit.prompt_tokens == litellm.token_counter(
        model="gpt-4o-mini", messages=[{"role": "user", "content": prompt}]) <= 2048 - 512
    assert fit.omitted > 1000 and sum(int(n) for _, n in MARK.findall(prompt)) == fit.omitted
    assert "[user] The workspace." in prompt and "[assistant] AGENTS.md and notes/." in prompt
    assert "[user] No, run ls first." in prompt
