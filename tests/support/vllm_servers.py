"""The suite's vLLM servers as the tests see them: the `vllm_server` and `teacher_server`
fixtures of tests/conftest.py yield a :class:`RunningVLLM`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RunningVLLM:
    base_url: str  # http://host:port/v1
    model: str
