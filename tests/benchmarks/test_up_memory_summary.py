"""benchmarks/trainer/up_memory.py's summary: which health checks count as unanswered, and round 1
read from the online trainer's log as it writes it now."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from tests.support import REPO

BENCH = REPO / "benchmarks" / "trainer"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import up_memory  # noqa: E402


def _sample(t: float, phase: str, gateway: float | None, vllm: float | None = 0.01) -> dict[str, Any]:
    return {"t": t, "phase": phase, "rss_gib": {}, "mem_available_gib": 10.0,
            "check_s": {"gateway": gateway, "vllm": vllm, "vllm-teacher": 0.01}}


def test_each_phase_counts_its_checks_from_its_own_up_s_first_answer(tmp_path: Path) -> None:
    """The train phase starts a second `up`: its servers' start-up is not a failure to answer,
    though the traffic phase's `up` had answered; a miss after its first answer counts, one too late
    (negative seconds) as well, and none while `up` stops. `--report` writes the counts again."""
    samples = [_sample(0, "traffic", None), _sample(1, "traffic", 0.01), _sample(2, "traffic", None),
               _sample(3, "traffic-stop", None),
               _sample(4, "train", None, None), _sample(5, "train", None, None),  # the second `up` starting
               _sample(6, "train", 0.02, 0.01), _sample(7, "train", -2.5), _sample(8, "train", None),
               _sample(9, "train", 0.01, None), _sample(10, "train-stop", None, None)]
    traffic, train = up_memory.summarize(samples, "traffic"), up_memory.summarize(samples, "train")
    assert traffic["unanswered_checks"] == {"gateway": 1, "vllm": 0, "vllm-teacher": 0}
    assert train["unanswered_checks"] == {"gateway": 2, "vllm": 1, "vllm-teacher": 0}
    assert train["slowest_answer_s"]["gateway"] == 2.5 and train["samples"] == 7
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"samples": samples, "summary": {}, "train": {}, "traffic": {"turns": []}}))
    assert up_memory.main(["--report", str(path)]) == 0
    assert json.loads(path.read_text())["summary"]["train"]["unanswered_checks"]["gateway"] == 2
    assert "| train (7 s) |" in path.with_suffix(".md").read_text()
    assert "| 2 / 1 / 0 |" in path.with_suffix(".md").read_text()


def test_round_1_is_read_from_the_trainer_log_with_its_replay_count(tmp_path: Path) -> None:
    log = tmp_path / "trainer.log"
    log.write_text(
        "2026-12-01 05:20:31,476 INFO nextstate.online: round 1: training on 4 turns (31,647 tokens; 0 replayed), "
        "1 update\n"
        "2026-12-01 05:32:50,000 INFO nextstate.online: round 1: trained in 12m19s; publishing the candidate\n")
    assert up_memory.trainer_round(log) == {"round": 1, "turns": 4, "tokens": 31647, "trained_in": "12m19s",
                                            "killed": 0}
    log.write_text("round 2: training on 16 turns (35,529 tokens), 2 updates\n")  # the form before replay
    assert up_memory.trainer_round(log)["tokens"] == 35529
