"""The simulated user's stated preference, and the judges and scorer built on it.

Preference: replies under 25 words. The user thanks a reply that meets it and otherwise says,
in plain words, what to change — that sentence is the reply's next state, and the hint OPD
distills from.
"""

from __future__ import annotations

import re
from typing import Any

MAX_WORDS = 25
THANKS = "Thanks, that's exactly what I wanted."
CORRECTION = "Too long. Please keep your answers short, under 25 words."


def words(text: str) -> int:
    return len(re.findall(r"\S+", text or ""))


def meets(reply: str) -> bool:
    return 0 < words(reply) < MAX_WORDS


def reaction(reply: str) -> str:
    """What the user says next."""
    return THANKS if meets(reply) else CORRECTION


def scorer(reply: str, messages: list[dict[str, Any]]) -> float:
    """Eval-gate scorer (`--eval-scorer benchmarks.learning.preference:scorer`)."""
    return float(meets(reply))


def judge(turn: dict[str, Any], next_state: dict[str, Any]) -> dict[str, Any]:
    """Python judge on the preference: +1 when the reply meets it, else -1 with the user's
    correction as the hint."""
    reply = (turn.get("response") or {}).get("content") or ""
    if meets(reply):
        return {"vote": 1, "rationale": f"{words(reply)} words"}
    said = " ".join(str(m.get("content") or "") for m in next_state.get("messages") or ())
    return {"vote": -1, "rationale": f"{words(reply)} words", "hint": said or CORRECTION}
