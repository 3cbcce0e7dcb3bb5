"""The rule-based next-state judge for general agents: a python judge, selected with
``judge_backend: python`` and ``judge_python: scoring.rules:vote``.

It reads only the next state — what the tool, the shell or the test runner answered the action
— and votes without a model:

- **−1** when the next state reports a failure: a tool error (a tool message, or its first
  line, starting ``error``/``Error:``), a non-zero exit status (``exit code 2``, ``exit status
  1``, ``returned non-zero``, ``Command failed``), a Python traceback, or failing tests
  (pytest's ``N failed`` / ``N error`` summary, ``FAILED``, ``ERROR collecting``);
- **+1** when it reports progress: a tool answered without any of the above (``exit code 0``,
  pytest's ``N passed`` with nothing failed, a tool's plain result);
- **0** (abstain) otherwise: no tool output at all (a user's reply, the end of the session),
  an empty tool output.

A −1 vote carries a hint for hindsight OPD: ``The last action failed: <the tool's output>``,
grounded in the next state by construction, so the hint gate keeps it.
Deterministic: every vote on a turn is the same, so one vote (``judge_votes: 1``) is enough.
"""

from __future__ import annotations

import re
from typing import Any

from scoring.judge import Vote, _text

# at the start of the output only: a file the tool printed may well have lines starting "ERROR"
_TOOL_ERROR = re.compile(r"\A\s*(?:[\w.]+\([^\n]*\)\s*->\s*)?(?:error\b|\w*Error:)", re.I)
_EXIT = re.compile(r"\bexit (?:code|status)[ :=]*(-?\d+)", re.I)
_NONZERO = re.compile(r"returned non-zero exit status|Command failed|\bkilled\b", re.I)
_TRACEBACK = re.compile(r"Traceback \(most recent call last\)")
_TESTS_FAILED = re.compile(r"\b\d+ (?:failed|errors?)\b|^FAILED |^ERROR collecting|^E\s+AssertionError", re.M)
_TESTS_PASSED = re.compile(r"\b\d+ passed\b")


def _failure(text: str) -> str | None:
    """The line that says the action failed, or None."""
    for pattern in (_TRACEBACK, _TESTS_FAILED, _NONZERO, _TOOL_ERROR):
        m = pattern.search(text)
        if m:
            if pattern is _TRACEBACK:  # the exception's own line is the last of the traceback
                lines = [line for line in text[m.end():].splitlines() if line.strip()]
                return (lines[-1] if lines else m.group(0)).strip()
            return text[text.rfind("\n", 0, m.start()) + 1:].split("\n", 1)[0].strip()
    for m in _EXIT.finditer(text):
        if int(m.group(1)) != 0:
            return text[text.rfind("\n", 0, m.start()) + 1:].split("\n", 1)[0].strip()
    return None


def vote(turn: dict[str, Any], next_state: dict[str, Any]) -> Vote:
    """The vote on an action given its next state (see the module docstring)."""
    outputs = [_text(m.get("content")) for m in next_state.get("messages") or () if m.get("role") == "tool"]
    if not outputs:
        return Vote(0, "no tool output to judge")
    for output in outputs:
        line = _failure(output)
        if line:
            # the hint restates what the tool said, so it is grounded in the next state
            return Vote(-1, f"the action failed: {line[:200]}", f"The last action failed: {' '.join(output.split())[:300]}")
    if not any(o.strip() for o in outputs):
        return Vote(0, "the tool returned nothing")
    joined = "\n".join(outputs)
    if _TESTS_PASSED.search(joined):
        return Vote(1, "the tests passed")
    return Vote(1, "the tool answered without an error")
