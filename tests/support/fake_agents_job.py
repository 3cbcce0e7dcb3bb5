"""A stand-in for ``benchmarks.agents.run.run_job`` (importable by the benchmark's spawned job
processes): it writes one checkpoint, as a job does after each iteration, then runs until stopped."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any


def run_job(args: argparse.Namespace, d: Path, suite: str, arm: str, seed: int, base: float) -> dict[str, Any]:
    row = {"suite": suite, "arm": arm, "seed": seed, "pass_at_1": [base, base + 0.1]}
    (d / "progress.json").write_text(json.dumps(row))
    (d / "checkpointed").touch()
    time.sleep(600)  # a job's next iterations
    return row
