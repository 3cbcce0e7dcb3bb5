"""benchmarks/agents: a run stopped by SIGTERM (a GPU lease that ends) or Ctrl-C stops its jobs and
still writes its report, with each job's checkpoints so far marked partial, then exits as stopped.
Before, the job processes' SIGTERM came back to the benchmark as SystemExit, which nothing caught:
the run exited 143 with no report and 21 minutes of a 2-GPU lease's results were lost."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.processes import wait_for

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import argparse, json, pathlib, signal, sys
from benchmarks.agents import run as bench
from tests.support import fake_agents_job

bench.run_job = fake_agents_job.run_job
bench.base_rates = lambda args, suites, work: {s: {"pass_at_1": 0.25} for s in suites}

def write(args, rows, base, minutes, failed, escapes=None, runs=None):
    (args.out / "report.json").write_text(json.dumps({"rows": rows, "failed": failed, "runs": runs}))

bench.write = write
signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
args = argparse.Namespace(jobs=2, seeds=4, first_seed=0, escapes=False, calibrate=False, deadline_min=None,
                          out=pathlib.Path(sys.argv[1]))
bench.run(args, ["terminal"], ["outcome"], pathlib.Path(sys.argv[2]))
"""


def test_sigterm_stops_the_jobs_and_reports_their_checkpoints(tmp_path: Path) -> None:
    out, work = tmp_path / "out", tmp_path / "work"
    out.mkdir()
    work.mkdir()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, str(out), str(work)], cwd=ROOT, env=env)
    try:
        # three jobs run (a thread per job, one more for the sandbox escapes), each past its first
        # checkpoint; the fourth waits for a thread
        wait_for(lambda: len(list(work.glob("*/checkpointed"))) == 3 or None, timeout=180)
        running = {p for p in _children(proc.pid)}
        assert running, "the jobs run in processes of their own"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 143
    finally:
        if proc.poll() is None:
            proc.kill()
    report = json.loads((out / "report.json").read_text())
    assert sorted(r["seed"] for r in report["rows"]) == [0, 1, 2]
    assert all(r["partial"] and r["pass_at_1"] == [0.25, 0.35] for r in report["rows"])
    assert report["failed"] == []
    assert sorted(report["runs"]["stopped"]) == ["terminal/outcome/0", "terminal/outcome/1", "terminal/outcome/2"]
    assert report["runs"]["interrupted"] == "SystemExit"
    assert not list(work.glob("*-3")), "no job starts once the run is stopped"
    wait_for(lambda: not any(_alive(p) for p in running) or None, timeout=30)


def _children(pid: int) -> list[int]:
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(d.name))
            except (OSError, ValueError, IndexError):
                continue
    return found


def _alive(pid: int) -> bool:
    try:
        return (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]) != "Z"
    except OSError:
        return False


class _ClosedStdout:
    """The `| tee` a stopped run's output went to, killed with it."""

    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self) -> None:
        raise BrokenPipeError(32, "Broken pipe")


def test_a_closed_stdout_does_not_lose_the_report(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Both benchmarks write their JSON before they print: a SIGTERM to the whole process group
    also ends the `tee` their output goes through, and a print first would lose the run."""
    import argparse

    from benchmarks.agents import run as agents
    from benchmarks.learning import bench as learning

    monkeypatch.setattr(sys, "stdout", _ClosedStdout())
    args = argparse.Namespace(iterations=10, tasks=16, n=8, heldout=64, seeds=3, out=tmp_path, tag="stopped")
    with pytest.raises(BrokenPipeError):
        agents.write(args, [], {"terminal": {"pass_at_1": 0.17}}, 1.0, [], None, {"stopped": ["terminal/outcome/0"]})
    assert json.loads((tmp_path / "stopped.json").read_text())["config"]["stopped"] == ["terminal/outcome/0"]
    args = argparse.Namespace(arms="combined", judge="python", interactions=60, k=6, heldout=16, samples_per_prompt=4,
                              out=tmp_path)
    with pytest.raises(BrokenPipeError):
        learning.write(args, [], "learn-stopped", 1.0, {"interrupted": "SystemExit"})
    assert json.loads((tmp_path / "learn-stopped.json").read_text())["config"]["interrupted"] == "SystemExit"
