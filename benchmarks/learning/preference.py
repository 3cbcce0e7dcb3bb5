"""The simulated user's stated preference, and the judges and scorer built on it.

Preference: short answers — under 25 words — that still answer the question. The user thanks a
reply that does both and otherwise says, in plain words, what to change; that sentence is the
reply's next state, and the hint OPD distills from.

Why "that still answer the question": with length alone, a 135 M policy trained online learns
within 16 interactions to say "Yes" or "Bathroom scale" to "What is a calorie?" (measured: held-out
share under 25 words 0.00 -> 0.94, most of the replies off topic). A person would object, so the
simulated one does. "Answers the question" is checked crudely — the reply mentions one of the
question's content words (a shared 4-letter prefix: "salty" ~ "salt") — which is enough to
refuse the degenerate replies and costs nothing to run.
"""

from __future__ import annotations

import re
from typing import Any

MAX_WORDS = 25
THANKS = "Thanks, that's exactly what I wanted."
CORRECTION = "Too long. Please keep your answers short, under 25 words."
OFF_TOPIC = "That doesn't answer my question. Please answer it, in a sentence."
STOPWORDS = frozenset(
    "what which when where why how who whom whose does do did is are was were the a an of in on to for "
    "and or but with from by at as it its this that these those be been being have has had can could "
    "would should will shall may might must there their they them we us our you your he she his her "
    "made make makes work works".split())


def words(text: str) -> int:
    return len(re.findall(r"\S+", text or ""))


def _stems(text: str) -> set[str]:
    return {w[:4] for w in re.findall(r"[a-z]+", (text or "").lower()) if len(w) >= 3 and w not in STOPWORDS}


def short(reply: str) -> bool:
    return 0 < words(reply) < MAX_WORDS


def on_topic(question: str, reply: str) -> bool:
    """The reply mentions one of the question's content words (4-letter prefixes)."""
    return bool(_stems(question) & _stems(reply))


def meets(question: str, reply: str) -> bool:
    """What the user wants: short, and about the question."""
    return short(reply) and on_topic(question, reply)


def reaction(question: str, reply: str) -> str:
    """What the user says next."""
    if not short(reply):
        return CORRECTION
    return THANKS if on_topic(question, reply) else OFF_TOPIC


def _question(messages: list[dict[str, Any]]) -> str:
    users = [m for m in messages if m.get("role") == "user"]
    content = users[-1].get("content") if users else ""
    return content if isinstance(content, str) else ""


def scorer(reply: str, messages: list[dict[str, Any]]) -> float:
    """Eval-gate scorer (`--eval-scorer benchmarks.learning.preference:scorer`)."""
    return float(meets(_question(messages), reply))


def judge(turn: dict[str, Any], next_state: dict[str, Any]) -> dict[str, Any]:
    """Python judge on the preference: +1 when the reply meets it, else -1 with the user's
    correction as the hint."""
    reply = (turn.get("response") or {}).get("content") or ""
    question = _question((turn.get("request") or {}).get("messages") or [])
    why = f"{words(reply)} words, {'on' if on_topic(question, reply) else 'off'} topic"
    if meets(question, reply):
        return {"vote": 1, "rationale": why}
    said = " ".join(str(m.get("content") or "") for m in next_state.get("messages") or ())
    return {"vote": -1, "rationale": why, "hint": said or reaction(question, reply)}


def judge_naming_the_question(turn: dict[str, Any], next_state: dict[str, Any]) -> dict[str, Any]:
    """:func:`judge` whose hint also names the question the reply was to answer: the hinted teacher
    (the policy's own base model with the hint) is then told what to be short *about*. With the
    user's words alone ("Too long. Please keep your answers short") top-k OPD pulled the student
    into short replies on no topic (benchmarks/gpu/results, "opd against opd+topk"). The hint
    stays grounded in the next state and the turn: the user's words, then the turn's own
    question."""
    vote = judge(turn, next_state)
    if vote["vote"] < 0:
        question = _question((turn.get("request") or {}).get("messages") or [])
        vote["hint"] = f'{vote["hint"]} The question was: "{question}"'
    return vote


def _graded(vote: dict[str, Any], turn: dict[str, Any]) -> dict[str, Any]:
    """*vote* with a miss on topic — a reply the user called too long, not off topic — graded 0."""
    reply = (turn.get("response") or {}).get("content") or ""
    question = _question((turn.get("request") or {}).get("messages") or [])
    return vote | {"vote": 0} if vote["vote"] < 0 and on_topic(question, reply) else vote


def graded_judge(turn: dict[str, Any], next_state: dict[str, Any]) -> dict[str, Any]:
    """:func:`judge` with the user's two corrections told apart (``+graded``): 0 for a reply on
    topic but too long ("Too long…"), -1 still for one off topic or empty, short or not. Under
    :func:`judge` both are -1, so RL never prefers keeping the topic to getting short, and the
    online policy drifted off topic (held-out on-topic share 0.98 -> 0.88-0.94 on the GPU). The 0
    keeps the user's correction as its hint: the pool keeps the hints of the majority's votes,
    so OPD still distills it."""
    return _graded(judge(turn, next_state), turn)


def graded_judge_naming_the_question(turn: dict[str, Any], next_state: dict[str, Any]) -> dict[str, Any]:
    """:func:`graded_judge` whose hint names the question (``+graded+ask``:
    :func:`judge_naming_the_question`)."""
    return _graded(judge_naming_the_question(turn, next_state), turn)


def topic_scorer(reply: str, messages: list[dict[str, Any]]) -> float:
    """Eval-gate topicality scorer (``OnlineConfig.topic_scorer``): 1 when the reply is on topic."""
    return float(on_topic(_question(messages), reply))
