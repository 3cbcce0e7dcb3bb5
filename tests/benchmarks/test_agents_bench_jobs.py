"""benchmarks/agents: a job's process that dies (SIGKILL, the OOM killer) takes its gateway and its
sandboxes' commands with it — none is left running, orphaned, holding its port."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

import pytest

from benchmarks.agents import run as bench
from examples.agents import terminal
from base.errors import SandboxUnavailable
from rollout.sandbox import Sandbox, check_available
from tests.support.processes import wait_for

try:
    check_available()
except SandboxUnavailable as exc:  # pragma: no cover - every machine the suite runs on has namespaces
    pytest.skip(f"no sandbox here: {exc}", allow_module_level=True)

pytestmark = pytest.mark.processes  # it starts a gateway (through the benchmark's Job)


def job_with_children(args: argparse.Namespace, work: Path, sleep: str) -> None:
    """In the job's process, as a job starts them (:func:`bench.run_job`): its gateway, and a
    terminal rollout's sandbox running a command (``sleep``) that outlives the test; says which
    processes they are."""
    os.environ["NEXTSTATE_SANDBOX_ROOT"] = str(bench.job_sandboxes(work))
    job = bench.Job(args, work, "terminal", "outcome", 0)
    gw = job.start_gateway()

    async def rollout() -> None:
        root = Path(tempfile.mkdtemp(prefix="orphan-test-", dir=terminal._ensure(terminal.sandbox_root())))
        with Sandbox(root, terminal.LIMITS) as box:
            (work / "children.tmp").write_text(json.dumps(
                {"job": os.getpid(), "gateway": gw.proc.pid, "port": gw.port, "uid": box.uid, "root": str(root)}))
            (work / "children.tmp").rename(work / "children.json")
            await box.run(f"sleep {sleep}; true", timeout=900)

    asyncio.run(rollout())


def alive(pid: int) -> bool:
    """Running (not a zombie waiting for a parent to reap it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def processes_with(text: str) -> dict[int, int]:
    """Live processes whose command line holds *text*: pid -> real uid."""
    found = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmdline = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            uid = int(next(line for line in (d / "status").read_text().splitlines() if line.startswith("Uid:")).split()[1])
        except (OSError, StopIteration, ValueError):
            continue
        if text in cmdline and alive(int(d.name)):
            found[int(d.name)] = uid
    return found


def accepts(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_a_killed_job_leaves_no_gateway_or_sandbox_running(tmp_path: Path) -> None:
    # a sleep no other process on the machine runs: it names this test's sandbox processes
    sleep = f"{random.randint(800, 899)}.{random.randint(10**8, 10**9 - 1)}"
    args = argparse.Namespace(upstream="http://127.0.0.1:9/v1", teacher=None)
    left: list[int] = []
    children: dict[str, Any] = {}
    try:
        with bench.job_process(None) as proc:
            future = proc.submit(job_with_children, args, tmp_path, sleep)

            def started() -> str | None:
                if future.done():
                    future.result()  # the job's error, if it failed
                    raise AssertionError("the job ended before it started its gateway and sandbox")
                return (tmp_path / "children.json").exists() and (tmp_path / "children.json").read_text()

            children = json.loads(wait_for(started, timeout=300))
            # the sandbox's unshare (root), the command's shell and its sleep (the sandbox's uid)
            box = wait_for(lambda: (lambda f: f if len(f) >= 3 else None)(processes_with(f"sleep {sleep}")), 60)
            left = [children["gateway"], *box]
            assert children["uid"] in box.values() and alive(children["gateway"]) and accepts(children["port"])

            os.kill(children["job"], signal.SIGKILL)
            with pytest.raises(BrokenProcessPool):
                future.result(timeout=60)

        # the port is free once the gateway's last thread has exited: its main thread shows as a
        # zombie while the others may still be holding the process's files
        wait_for(lambda: not alive(children["gateway"]) and not processes_with(f"sleep {sleep}")
                 and not accepts(children["port"]), timeout=60)

        # the killed job could not unmount its sandbox's tmpfs: the benchmark does, after the job
        root = Path(children["root"])
        assert bench.job_sandboxes(tmp_path) in root.parents
        mounted = os.geteuid() == 0  # as root a sandbox is a tmpfs (rollout.sandbox)
        assert (str(root) in mounts()) == mounted
        assert bench.clean_job(tmp_path) == ([str(root)] if mounted else [])
        assert not any(str(bench.job_sandboxes(tmp_path)) in m for m in mounts())
        assert not bench.job_sandboxes(tmp_path).exists()
    finally:
        for pid in left:  # whatever this test started and a failure left running
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        if children:
            subprocess.run(["umount", "-l", children["root"]], capture_output=True)
            shutil.rmtree(bench.job_sandboxes(tmp_path), ignore_errors=True)


def mounts() -> str:
    return Path("/proc/self/mountinfo").read_text()
