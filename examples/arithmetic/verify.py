"""Exact-answer verifier for the arithmetic example: 1.0 when the agent's answer equals the task's."""

from __future__ import annotations

from typing import Any


def verify(task: dict[str, Any], result: dict[str, Any], session: dict[str, Any]) -> float:
    answer = result.get("answer") if isinstance(result, dict) else None
    return 1.0 if answer is not None and abs(float(answer) - float(task["answer"])) < 1e-9 else 0.0
