"""rollout.sandbox: real commands that misbehave are contained, and the reason is recorded."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from base.errors import SandboxUnavailable
from rollout.sandbox import Limits, Sandbox, check_available, unmount_under
from tests.support import REPO

try:
    check_available()
except SandboxUnavailable as exc:  # pragma: no cover - every machine the suite runs on has namespaces
    pytest.skip(f"no sandbox here: {exc}", allow_module_level=True)

LIMITS = Limits(wall_s=6, cpu_s=2, memory_mb=256, file_mb=2, disk_mb=4, processes=16, open_files=64)


def run(sandbox: Sandbox, command: str | list[str], **kw: float) -> tuple[int | None, str, str | None]:
    result = asyncio.run(sandbox.run(command, **kw))
    return result.exit_code, result.output, result.violation


@pytest.fixture
def sandbox(tmp_path: Path) -> Sandbox:
    with Sandbox(tmp_path / "box", LIMITS, files={"in.txt": "b\na\n"}) as box:
        yield box


def test_a_plain_command_reads_and_writes_its_directory(sandbox: Sandbox) -> None:
    code, out, violation = run(sandbox, "sort in.txt > out.txt && cat out.txt && pwd")
    assert (code, violation) == (0, None)
    assert out.splitlines() == ["a", "b", str(sandbox.root)]
    assert sandbox.read("out.txt") == "a\nb\n" and sandbox.violations == []
    # nothing of the host's environment reaches it
    os.environ["NEXTSTATE_TEST_SECRET"] = "s3cret"
    try:
        assert "s3cret" not in run(sandbox, "env")[1]
    finally:
        del os.environ["NEXTSTATE_TEST_SECRET"]


def test_fork_bomb_is_contained(sandbox: Sandbox) -> None:
    started = time.monotonic()
    code, out, violation = run(sandbox, ["bash", "-c", ":(){ :|:& };: ; sleep 30"])
    assert violation is not None and violation.startswith("processes"), (code, violation, out[-300:])
    assert time.monotonic() - started < LIMITS.wall_s + 5
    assert _gone(sandbox)
    assert sandbox.failure and "processes" in sandbox.failure


def test_filling_the_disk_ends_at_its_quota(sandbox: Sandbox) -> None:
    # files under the per-file limit, more of them than the directory holds
    code, out, violation = run(sandbox, "for i in 1 2 3 4 5 6 7 8; do head -c 1000000 /dev/zero > f$i || exit 1; done")
    assert code != 0 and violation is not None and violation.startswith("disk"), (code, violation, out)
    assert sandbox.disk_bytes() <= (LIMITS.disk_mb + 1) * 1024 * 1024
    code, out, violation = run(sandbox, "head -c 3000000 /dev/zero > big")
    assert violation is not None and violation.startswith(("file_size", "disk")), (code, violation, out)


def test_sleeping_forever_is_killed_with_its_children(sandbox: Sandbox) -> None:
    started = time.monotonic()
    code, _, violation = run(sandbox, "sleep 1000 & setsid sleep 1001 & sleep 1002", timeout=2)
    assert code is None and violation == "timeout: still running after 2 s, killed"
    assert time.monotonic() - started < 8
    assert _gone(sandbox)
    # and what a command leaves in the background when it exits goes with it
    assert run(sandbox, "sleep 1003 & echo started")[0] == 0
    time.sleep(0.5)
    assert _gone(sandbox)


def test_a_socket_reaches_nothing(sandbox: Sandbox) -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.2)
    port = server.getsockname()[1]
    accepted: list[object] = []
    ran = threading.Event()

    def accept() -> None:
        # accepts while the command runs, then once more for a connection still in the backlog
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline:
            last = ran.is_set()
            try:
                accepted.append(server.accept())
            except TimeoutError:
                if last:
                    return

    t = threading.Thread(target=accept)
    t.start()
    try:
        code, out, violation = run(sandbox, ["python3", "-c", f"import socket; socket.create_connection(('127.0.0.1', {port}), 3)"])
    finally:
        ran.set()
    t.join()
    server.close()
    assert accepted == [] and code != 0
    assert violation == "network: the sandbox has none", (code, out)


def test_cpu_and_memory_limits(sandbox: Sandbox) -> None:
    code, out, violation = run(sandbox, ["python3", "-c", "while True: pass"], timeout=30)
    assert violation is not None and violation.startswith("cpu"), (code, violation, out)
    code, out, violation = run(sandbox, ["python3", "-c", "x = bytearray(600 * 1024 * 1024)"])
    assert violation is not None and violation.startswith("memory"), (code, violation, out)


def test_output_is_capped_and_paths_stay_inside(sandbox: Sandbox) -> None:
    code, out, _ = run(sandbox, "yes | head -c 5000000")
    assert code == 0 and len(out) < 20_000 and "bytes of output dropped" in out
    with pytest.raises(ValueError):
        sandbox.path("../outside.txt")
    assert sandbox.read("../../etc/passwd") is None
    # the sandbox's uid cannot write outside its directory
    code, out, _ = run(sandbox, f"echo x > {sandbox.root.parent}/escaped.txt")
    assert code != 0 and not (sandbox.root.parent / "escaped.txt").exists() or os.geteuid() != 0


def test_closing_removes_the_directory(tmp_path: Path) -> None:
    box = Sandbox(tmp_path / "gone", LIMITS, files={"a/b.txt": "x"})
    assert (box.root / "a" / "b.txt").read_text() == "x"
    box.close()
    assert not (tmp_path / "gone").exists()


def _gone(sandbox: Sandbox) -> bool:
    """No process of the sandbox is left: killed with its PID namespace, each is gone within a
    moment (a SIGKILLed process may still be listed while the kernel reaps it)."""
    deadline = time.monotonic() + 5
    while _processes_of(sandbox) and time.monotonic() < deadline:
        time.sleep(0.05)
    return _processes_of(sandbox) == []


def _processes_of(sandbox: Sandbox) -> list[int]:
    """Processes running as the sandbox's own uid (root: one uid per sandbox)."""
    if os.geteuid() != 0:
        return []
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                status = (d / "status").read_text()
            except OSError:
                continue
            uid = int(next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1])
            if uid == sandbox.uid and "State:\tZ" not in status:
                found.append(int(d.name))
    return found


def test_live_sandboxes_never_share_a_uid_across_processes(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("one uid per sandbox only as root")
    import subprocess
    import sys

    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from rollout.sandbox import Sandbox; "
        f"b = Sandbox({str(tmp_path / 'other')!r}); print(b.uid, flush=True); time.sleep(30)")],
        stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        other = int(holder.stdout.readline())
        with Sandbox(tmp_path / "mine", LIMITS) as box:
            assert box.uid != other
    finally:
        holder.kill()
        holder.wait()
        subprocess.run(["umount", "-l", str(tmp_path / "other")], capture_output=True)  # its tmpfs


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_unmount_under_finds_nested_mounts_and_escaped_names(tmp_path: Path) -> None:
    """What a killed process left mounted below a directory (a name with a space is written
    ``\\040`` in /proc/self/mountinfo) is unmounted, deepest first; nothing beside it is."""
    outer, inner, beside = tmp_path / "jobs" / "a b", tmp_path / "jobs" / "a b" / "inner", tmp_path / "beside"
    for d in (outer, beside):
        d.mkdir(parents=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(d)], check=True)
    inner.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(inner)], check=True)
    try:
        assert unmount_under(tmp_path / "jobs") == [str(inner), str(outer)]
        mounted = Path("/proc/self/mountinfo").read_text()
        assert "a\\040b" not in mounted and str(beside) in mounted
        assert unmount_under(tmp_path / "jobs") == []
    finally:
        for d in (inner, outer, beside):
            subprocess.run(["umount", "-l", str(d)], capture_output=True)
