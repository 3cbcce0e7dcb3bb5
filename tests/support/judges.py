"""Deterministic python judges for the tests (`NEXTSTATE_JUDGE_PYTHON=tests.support.judges:verdict`),
and a lenient scorer for the online trainer's eval gate (`--eval-scorer tests.support.judges:lenient_scorer`).

The verdict is read off the next state's text, so a test decides a turn's votes by what its
simulated user says: thanks → +1; "no, ..." → -1 with the correction as the hint; "TIE" → one
vote of each value; "FAIL" → the judge raises; "SLOW" → vote 2 blocks while
NEXTSTATE_TEST_JUDGE_SLOW is set. Every call is appended to NEXTSTATE_TEST_JUDGE_LOG.
"""

from __future__ import annotations

import os
import re
import time
from typing import Any


def _said(next_state: dict[str, Any]) -> str:
    parts = [str(m.get("content") or "") for m in next_state.get("messages") or ()]
    parts += [str(f.get("text") or "") for f in next_state.get("feedback") or ()]
    return " ".join(parts)


def verdict(turn: dict[str, Any], next_state: dict[str, Any], index: int) -> dict[str, Any]:
    log = os.environ.get("NEXTSTATE_TEST_JUDGE_LOG")
    if log:
        with open(log, "a") as f:
            f.write(f"{turn['id']} {index}\n")
    said = _said(next_state)
    if "FAIL" in said:
        raise RuntimeError("judge backend unavailable (test)")
    if "SLOW" in said and index == 2 and os.environ.get("NEXTSTATE_TEST_JUDGE_SLOW"):
        time.sleep(600)
    if "TIE" in said:
        return {"vote": (1, -1, 0)[index % 3], "rationale": "split on purpose"}
    if re.search(r"\bthanks?\b|\bthank you\b", said, re.I):
        return {"vote": 1, "rationale": "the user thanked the assistant"}
    m = re.match(r"\s*no\b[,.!]?\s*(.*)", said, re.I | re.S)
    if m:
        return {"vote": -1, "rationale": "the user corrected the assistant", "hint": m.group(1).strip() or None}
    if next_state.get("end"):
        return {"vote": 1 if (next_state.get("outcome") or 0) > 0 else 0, "rationale": "session ended"}
    return {"vote": 0, "rationale": "no evidence either way"}


def lenient_scorer(reply: str, messages: list[dict[str, Any]]) -> float:
    """Any candidate passes a gate with threshold 1 on this (it scores in [0, 1])."""
    return 1.0 if len(reply.split()) < 40 else 0.0
