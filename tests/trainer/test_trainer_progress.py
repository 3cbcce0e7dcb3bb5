"""A training step reports its progress after each micro-batch of each pass (a CPU round over
long agent turns takes minutes), and the online trainer's round logs it with an estimate."""

from __future__ import annotations

import logging
import random
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.local import LocalConfig, LocalTrainer, StepProgress
from trainer.objectives import ObjectiveConfig
from trainer.online import RoundProgress, _duration
from trainer.samples import Sample


def _samples(shapes: list[tuple[int, int]]) -> list[Sample]:
    rng = random.Random(0)
    return [Sample(turn_id=f"t{i}", session_id=f"s{i}", group_id=None, step_index=0,
                   prompt_ids=[rng.randint(3, 49151) for _ in range(p)],
                   response_ids=[rng.randint(3, 49151) for _ in range(r)],
                   behaviour_logprobs=None, teacher_logprobs=[-1.0] * r, reward=1.0 if i % 2 else -1.0,
                   integrated_reward=None, capture="white-box") for i, (p, r) in enumerate(shapes)]


def test_a_step_reports_each_micro_batch_of_each_pass(model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    trainer = LocalTrainer(LocalConfig(model_dir=model_dir, micro_batch_size=2), ObjectiveConfig(objective="combined"))
    shapes = [(30, 5), (12, 9), (20, 6)]
    samples = _samples(shapes)
    seen: list[tuple[int, int]] = []
    report = RoundProgress(step=7, updates=1, every_s=0)
    caplog.set_level(logging.INFO, logger="nextstate.online")

    def progress(p: StepProgress) -> None:
        seen.append((p.tokens, p.tokens_total))
        report(0, p)

    trainer.step(samples, progress=progress)
    tokens = sum(p + r for p, r in shapes)
    # combined needs the policy's log-probs first: a no-grad pass, then the step, 2 micro-batches each
    assert trainer.last_step_no_grad_pass
    assert [t for t, _ in seen] == [56, tokens, tokens + 56, 2 * tokens]
    assert {total for _, total in seen} == {2 * tokens}
    lines = [r.getMessage() for r in caplog.records if r.name == "nextstate.online"]
    assert len(lines) == 4
    assert re.fullmatch(rf"round 7: update 1/1, 56/{2 * tokens} tokens, \d+(m\d\ds)?s? elapsed, ~\S+ left", lines[0])
    assert lines[-1].endswith("~0s left")


@given(st.floats(min_value=0, max_value=10 * 24 * 3600, allow_nan=False))
@settings(max_examples=200)
def test_duration_reads_as_hours_minutes_seconds(seconds: float) -> None:
    text = _duration(seconds)
    s = int(seconds)
    if s < 60:
        assert text == f"{s}s"
    elif s < 3600:
        minutes, rest = text.rstrip("s").split("m")
        assert int(minutes) * 60 + int(rest) == s and len(rest) == 2
    else:
        hours, minutes = text.rstrip("m").split("h")
        assert int(hours) * 3600 + int(minutes) * 60 == s - s % 60 and len(minutes) == 2
