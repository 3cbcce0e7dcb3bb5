"""The supervisor of `nextstate up` and `nextstate vllm serve` on real processes: a child that
exits is restarted with backoff and reported, one that keeps exiting is given up on, and stopping
leaves no process of any child's group (grandchildren included)."""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

from nextstate.supervisor import process_group_alive
from nextstate.supervisor import Command, RestartPolicy, Supervisor, describe_exit
from tests.support.processes import wait_for

FAST = RestartPolicy(limit=2, backoff_s=0.05, backoff_max_s=0.1, healthy_s=60)


def _command(name: str, code: str, tmp_path: Path) -> Command:
    return Command(name, [sys.executable, "-c", code], env=os.environ, log_path=tmp_path / f"{name}.log")


def test_a_child_that_keeps_exiting_is_restarted_then_given_up_on(tmp_path: Path) -> None:
    lines: list[str] = []
    fatal = threading.Event()
    sup = Supervisor(echo=lines.append, policy=FAST, on_fatal=lambda reason: fatal.set())
    sup.add(_command("crasher", "import sys; sys.exit(3)", tmp_path))
    try:
        sup.start()  # it counts as ready once started: a plain command has no readiness
        wait_for(fatal.is_set, timeout=30, interval=0.05)
    finally:
        sup.stop()
    report = sup.report()["crasher"]
    assert report["state"] == "failed"
    assert report["restarts"] == 2 and report["exits"] == {"exit 3": 3}, report
    assert sup.fatal and "crasher: exit 3; gave up after 2 restarts" in sup.fatal
    assert sum("restarting in" in line for line in lines) == 2, lines


def test_a_killed_child_is_reported_and_restarted(tmp_path: Path) -> None:
    lines: list[str] = []
    sup = Supervisor(echo=lines.append, policy=FAST)
    child = _command("sleeper", "import time; time.sleep(600)", tmp_path)
    sup.add(child)
    try:
        assert sup.start()
        first = child.pid
        assert first is not None
        os.kill(first, signal.SIGKILL)
        wait_for(lambda: child.pid not in (None, first) and sup.report()["sleeper"]["state"] == "running",
                 timeout=30, interval=0.05)
        report = sup.report()["sleeper"]
        assert report["restarts"] == 1 and report["last_exit"] == "killed by SIGKILL", report
        assert any(line.startswith("sleeper: killed by SIGKILL; restarting in") for line in lines), lines
    finally:
        sup.stop()
    assert sup.report()["sleeper"]["state"] == "stopped"
    assert sup.fatal is None


# runs past the reset window (healthy_s), then dies as the OOM killer would end it
OUTLIVES_THE_WINDOW = "import os, signal, time; time.sleep(0.6); os.kill(os.getpid(), signal.SIGKILL)"
SLOW_FAILURES = RestartPolicy(limit=2, backoff_s=0.05, backoff_max_s=0.1, healthy_s=0.3, same_exit_limit=3)


def test_a_child_killed_the_same_way_each_time_is_given_up_on_though_each_run_outlives_the_window(
        tmp_path: Path) -> None:
    lines: list[str] = []
    fatal = threading.Event()
    sup = Supervisor(echo=lines.append, policy=SLOW_FAILURES, on_fatal=lambda reason: fatal.set())
    sup.add(_command("trainer", OUTLIVES_THE_WINDOW, tmp_path))
    try:
        assert sup.start()
        wait_for(fatal.is_set, timeout=60, interval=0.05)
    finally:
        sup.stop()
    report = sup.report()["trainer"]
    # the restart count alone (limit 2) never trips: each run outlived the 0.3 s window
    assert report["state"] == "failed" and report["exits"] == {"killed by SIGKILL": 3}, report
    assert report["gave_up"] == "trainer killed by SIGKILL 3 times in a row (out of memory?)"
    assert sup.fatal and sup.fatal.startswith("trainer killed by SIGKILL 3 times in a row (out of memory?)")
    assert any(line.startswith("trainer killed by SIGKILL 3 times in a row") for line in lines), lines


def test_a_child_that_is_not_essential_is_given_up_on_alone_and_readyz_says_why(tmp_path: Path) -> None:
    from gateway.routes.health import _process_check

    lines: list[str] = []
    sup = Supervisor(echo=lines.append, policy=SLOW_FAILURES, on_fatal=lambda reason: None)
    sup.add(_command("worker", "import time; time.sleep(600)", tmp_path))
    sup.add(_command("trainer", OUTLIVES_THE_WINDOW, tmp_path), essential=False)
    try:
        assert sup.start()
        wait_for(lambda: sup.report()["trainer"]["state"] == "failed", timeout=60, interval=0.05)
        report = sup.report()
        assert sup.fatal is None and report["worker"]["state"] == "running"
        assert _process_check(report["trainer"]) == \
            "failed: trainer killed by SIGKILL 3 times in a row (out of memory?)"
        assert _process_check(report["worker"]) == "ok"
        assert any(line.startswith("trainer killed by SIGKILL 3 times in a row (out of memory?); gave up on it")
                   for line in lines), lines
    finally:
        sup.stop()
    assert sup.report()["trainer"]["state"] == "failed"


def test_different_exits_do_not_add_up(tmp_path: Path) -> None:
    # exit 1, killed, exit 1, killed, ...: never the same way twice in a row
    flip = tmp_path / "flip"
    code = ("import os, pathlib, signal, sys, time; p = pathlib.Path(%r); time.sleep(0.4); "
            "n = int(p.read_text()) if p.exists() else 0; p.write_text(str(n + 1)); "
            "sys.exit(1) if n %% 2 else os.kill(os.getpid(), signal.SIGKILL)") % str(flip)
    sup = Supervisor(echo=lambda line: None, policy=SLOW_FAILURES)
    sup.add(_command("flaky", code, tmp_path))
    try:
        assert sup.start()
        wait_for(lambda: sup.report()["flaky"]["restarts"] >= 4, timeout=60, interval=0.05)
        assert sup.fatal is None and sup.report()["flaky"]["gave_up"] is None
    finally:
        sup.stop()


def test_same_exit_reason() -> None:
    from nextstate.supervisor import same_exit_reason

    assert same_exit_reason("trainer", "exit 1", 3) == "trainer exited 1 3 times in a row"
    assert same_exit_reason("vllm", "killed by SIGKILL", 4) == "vllm killed by SIGKILL 4 times in a row (out of memory?)"


def test_stop_leaves_no_process_of_any_group(tmp_path: Path) -> None:
    # each child starts a grandchild that ignores SIGTERM: only the group's SIGKILL ends it
    stubborn = ("import signal, subprocess, sys, time; "
                "subprocess.Popen([sys.executable, '-c', 'import signal, time; "
                "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)']); time.sleep(600)")
    sup = Supervisor(echo=lambda line: None, policy=FAST)
    children = [_command(f"child{i}", stubborn, tmp_path) for i in range(2)]
    for child in children:
        sup.add(child, grace=1)
    assert sup.start()
    groups = [child.pid for child in children]
    assert all(groups)
    wait_for(lambda: all(_members(g) >= 2 for g in groups), timeout=30, interval=0.05)
    sup.stop()
    assert not any(process_group_alive(g) for g in groups)


def test_describe_exit() -> None:
    assert describe_exit(0) == "exit 0"
    assert describe_exit(-9) == "killed by SIGKILL"
    assert describe_exit(-200) == "killed by signal 200"


def _members(pgid: int) -> int:
    n = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _ppid, pgrp = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, IndexError, ValueError):
            continue
        n += int(pgrp) == pgid and state != "Z"
    return n
