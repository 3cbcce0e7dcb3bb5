"""The flaky tests of a run: those that failed, were re-run once (pytest-rerunfailures, ``--reruns 1``
in ``make test``) and then passed. They leave the run green; this plugin writes each to the ledger,
``tests/flakes.md``, and prints the same rows and a summary line, since a CI run keeps only its output
(docs/testing.md). A test that fails its re-run too is an ordinary failure and no flake.

Only the controller counts: with pytest-xdist every worker's reports reach it through
``pytest_runtest_logreport``, where an attempt that is to be re-run has the outcome ``rerun``; in a
run of one process that process is the controller.

A pytest plugin: ``tests/conftest.py`` registers this module (``register``).
"""

from __future__ import annotations

import datetime
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

LEDGER = Path("tests") / "flakes.md"  # under the rootdir
HEADER = """# Flaky tests

Tests that failed and then passed on their one re-run (`make test`; docs/testing.md, "Flaky tests").
Each row is a flake not yet fixed: the change that fixes it deletes its row.

| date | test | first failure | commit |
| --- | --- | --- | --- |
"""
MESSAGE_CHARS = 200


@dataclass
class Flake:
    nodeid: str
    message: str  # the first failure's, one line
    longrepr: str  # the first failure's traceback, printed once
    passed: bool = False  # the re-run's call passed (set after the rerun report only)


def register(config: pytest.Config) -> None:
    """Make this module's ledger a plugin of *config*, in the controller only (the workers' reports
    reach the controller's hooks)."""
    if not hasattr(config, "workerinput"):
        config.pluginmanager.register(Ledger(config), "nextstate-flakes")


def short_message(report: pytest.TestReport) -> str:
    """The failure's message, its first line (the exception and its text), else the report's last line."""
    crash = getattr(report.longrepr, "reprcrash", None)
    lines = (getattr(crash, "message", None) or "").strip().splitlines()
    line = lines[0] if lines else (str(report.longrepr).strip().splitlines() or [""])[-1]
    line = " ".join(line.split())
    return line if len(line) <= MESSAGE_CHARS else line[:MESSAGE_CHARS - 1] + "…"


def row(date: str, nodeid: str, message: str, commit: str) -> str:
    def cell(text: str) -> str:
        return text.replace("\\", "\\\\").replace("|", "\\|").replace("`", "'")

    return f"| {date} | `{cell(nodeid)}` | {cell(message)} | {commit or '?'} |"


def commit_of(root: Path) -> str:
    """The checkout's commit, short; empty when there is no git or no repository."""
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                              text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


class Ledger:
    """Follows the reports of one run; at its end appends its flakes to the ledger and prints them."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.path = config.rootpath / LEDGER
        self.seen: dict[str, Flake] = {}  # a test re-run this session -> its first failure
        self.failed: set[str] = set()
        self.rows: list[str] = []
        self.error = ""

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.outcome == "rerun":
            if report.nodeid not in self.seen:
                self.seen[report.nodeid] = Flake(report.nodeid, short_message(report), str(report.longrepr))
        elif report.failed:
            self.failed.add(report.nodeid)
        elif report.when == "call" and report.nodeid in self.seen:
            # only a pass after the rerun report counts: an attempt whose call passed and whose teardown
            # failed reports that pass ahead of its rerun report
            self.seen[report.nodeid].passed = True

    def flakes(self) -> list[Flake]:
        return [f for f in self.seen.values() if f.passed and f.nodeid not in self.failed]

    def reruns_on(self) -> bool:
        return bool(getattr(self.config.option, "reruns", None))

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        flakes = self.flakes()
        if not flakes:
            return
        date = datetime.datetime.now(datetime.UTC).date().isoformat()
        commit = commit_of(self.config.rootpath)
        self.rows = [row(date, f.nodeid, f.message, commit) for f in flakes]
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            text = self.path.read_text() if self.path.exists() else HEADER
            if text and not text.endswith("\n"):
                text += "\n"
            self.path.write_text(text + "".join(f"{r}\n" for r in self.rows))
        except OSError as exc:
            self.error = f" (not written: {exc})"

    @pytest.hookimpl(trylast=True)  # after the slowest durations: next to pytest's closing lines
    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        tr = terminalreporter
        flakes = self.flakes()
        if not flakes:
            if self.reruns_on():
                tr.write_line("0 flaked (passed on re-run)")
            return
        tr.write_sep("=", f"{len(flakes)} flaked: their first failures", yellow=True)
        for flake in flakes:
            tr.write_sep("_", flake.nodeid)
            tr.write_line(flake.longrepr)
        tr.write_sep("=", f"ledger rows ({self.display_path()})", yellow=True)
        for line in self.rows:
            tr.write_line(line)
        ids = ", ".join(f.nodeid for f in flakes)
        tr.write_line(f"{len(flakes)} flaked (passed on re-run): {ids}; ledger: {self.display_path()}{self.error}",
                      yellow=True, bold=True)

    def display_path(self) -> str:
        try:
            return str(self.path.relative_to(Path.cwd()))
        except ValueError:
            return str(self.path)

