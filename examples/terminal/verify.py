"""Verifier for the terminal example: 1.0 when the task's file exists with the expected text."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def verify(task: dict[str, Any], result: dict[str, Any], session: dict[str, Any]) -> float:
    path = Path(result["workdir"]) / task["file"]
    if not path.is_file():
        return 0.0
    return 1.0 if path.read_text(errors="replace").strip() == task["expect"].strip() else 0.0
