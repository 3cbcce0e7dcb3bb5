"""`nextstate up` as a user runs it, with the real vLLM CPU build: from the venv,
`up --train combined` trains and promotes a version while a client chats; a vLLM killed under
it is reported in /readyz and /metrics and restarted with the active version; SIGINT, SIGTERM
and SIGHUP (this one while vLLM starts) each leave no process behind and every port free."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.processes import free_port, wait_for

# `up` runs vLLM from the shared cache: the install first (model_dir), which also puts these tests in
# the vllm tier (tests/conftest.py). Under `make test` these run one after another with the other
# modules that start vLLM servers of their own: their memory at once would crowd the 24 GiB machine
# (tests/support/xdist_groups.py)
pytestmark = [pytest.mark.usefixtures("model_dir"), pytest.mark.xdist_group("own-vllm")]


class Up:
    """`nextstate up` in its own session on free ports, its data (SQLite pool and broker, logs)
    in *data_dir*; the shared cache holds vLLM and the model."""

    def __init__(self, data_dir: Path, *args: str, env: dict[str, str] | None = None):
        self.data_dir = data_dir
        self.ports = {"gateway": free_port(), "vllm": free_port(), "teacher": free_port()}
        self.console = data_dir / "up.log"
        data_dir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "nextstate.cli", "up", *args], start_new_session=True,
            stdout=open(self.console, "ab"), stderr=subprocess.STDOUT,
            env={**os.environ, "NEXTSTATE_DATA_DIR": str(data_dir), "NEXTSTATE_PORT": str(self.ports["gateway"]),
                 "NEXTSTATE_VLLM_PORT": str(self.ports["vllm"]),
                 "NEXTSTATE_TEACHER_VLLM_PORT": str(self.ports["teacher"]), **(env or {})})
        self.url = f"http://127.0.0.1:{self.ports['gateway']}"

    def output(self) -> str:
        return self.console.read_text(errors="replace")

    def wait_serving(self, timeout: float = 900) -> None:
        def serving() -> bool:
            if self.proc.poll() is not None:
                pytest.fail(f"`nextstate up` exited with {self.proc.returncode}:\n{self.output()[-4000:]}")
            return "base_url: " in self.output()
        wait_for(serving, timeout=timeout, interval=0.5)

    def readyz(self) -> dict[str, Any]:
        return httpx.get(f"{self.url}/readyz", timeout=30).json()

    def stop(self, sig: int) -> int:
        """*sig* to `up` alone (as `kill`, systemd and docker send it); its exit code."""
        os.kill(self.proc.pid, sig)
        try:
            return self.proc.wait(120)
        except subprocess.TimeoutExpired:
            pytest.fail(f"`nextstate up` still running 120 s after {signal.Signals(sig).name}:\n"
                        + self.output()[-3000:])

    def kill(self) -> None:
        """After a failure: `up` stops what it started on SIGTERM; SIGKILL what is left."""
        if self.proc.poll() is not None:
            return
        below = descendants(self.proc.pid)
        os.kill(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        for pid in alive(below):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(os.getpgid(pid), signal.SIGKILL)


def descendants(pid: int) -> set[int]:
    """Every live process below *pid* (children in their own sessions included)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z":
            parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text(errors="replace")
    except OSError:
        return ""


def alive(pids: set[int]) -> set[int]:
    left = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z":
            left.add(pid)
    return left


def port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def assert_nothing_left(up: Up, pids: set[int]) -> None:
    assert pids, "no child process was seen"
    assert alive(pids) == set(), f"left running: {alive(pids)}"
    busy = [name for name, port in up.ports.items() if not port_free(port)]
    assert busy == [], f"ports still taken: {busy}"


@pytest.fixture
def up_no_scoring(tmp_path: Path) -> Iterator[Up]:
    up = Up(tmp_path, "--no-scoring")
    try:
        up.wait_serving()
        yield up
    finally:
        up.kill()


def test_a_killed_vllm_is_reported_and_restarted_and_sigint_stops_everything(up_no_scoring: Up) -> None:
    up = up_no_scoring
    assert up.readyz()["checks"]["processes"] == {"vllm": "ok"}
    vllm = min(pid for pid in descendants(up.proc.pid) if f"--port\0{up.ports['vllm']}\0" in _cmdline(pid))
    os.kill(vllm, signal.SIGKILL)
    report = wait_for(lambda: (r := up.readyz())["checks"]["processes"]["vllm"] != "ok" and r, timeout=30)
    assert report["status"] == "not ready"
    assert "killed by SIGKILL" in report["checks"]["processes"]["vllm"], report
    # a CPU vLLM's start on a loaded two-core host has taken minutes
    wait_for(lambda: up.readyz()["status"] == "ready", timeout=900, interval=1)
    metrics = httpx.get(f"{up.url}/metrics", timeout=10).text
    assert 'nextstate_process_restarts_total{process="vllm"} 1.0' in metrics
    assert 'nextstate_process_exits_total{process="vllm",reason="killed by SIGKILL"} 1.0' in metrics
    assert 'nextstate_process_up{process="vllm"} 1.0' in metrics
    assert "vllm: killed by SIGKILL; restarting in 1 s" in up.output()
    r = httpx.post(f"{up.url}/v1/chat/completions", timeout=120, json={
        "model": "policy", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 200, r.text
    pids = descendants(up.proc.pid)
    assert up.stop(signal.SIGINT) == 0
    assert "SIGINT: stopping every process" in up.output()
    assert_nothing_left(up, pids)


def test_sighup_while_vllm_starts_stops_everything(tmp_path: Path) -> None:
    """A user who gives up on a slow start: SIGHUP once vLLM has started its engine process, before
    it serves, stops the whole tree."""
    up = Up(tmp_path, "--no-scoring")
    try:
        def engine_started() -> set[int] | None:
            assert up.proc.poll() is None, up.output()[-3000:]
            pids = descendants(up.proc.pid)
            vllm = [pid for pid in pids if f"--port\0{up.ports['vllm']}\0" in _cmdline(pid)]
            return pids if vllm and descendants(min(vllm)) else None
        pids = wait_for(engine_started, timeout=300, interval=0.2)
        assert "base_url: " not in up.output()
        assert up.stop(signal.SIGHUP) == 0
        assert "SIGHUP: stopping every process" in up.output()
        assert_nothing_left(up, pids)
    finally:
        up.kill()


QUESTIONS = ["Name a fruit.", "Name a color.", "Name an animal.", "Name a city."]


def test_up_train_combined_promotes_a_version_while_a_client_chats_and_sigterm_stops_everything(
        tmp_path: Path) -> None:
    """The README's online mode from the venv: a SQLite pool and broker, the python judge (the
    LLM judge works the same, slower), k=2 turns a round."""
    up = Up(tmp_path, "--train", "combined", "--", "--k", "2", "--rollback-window", "0", env={
        "NEXTSTATE_JUDGE_BACKEND": "python", "NEXTSTATE_JUDGE_PYTHON": "tests.support.judges:verdict",
        "NEXTSTATE_JUDGE_VOTES": "1"})
    try:
        up.wait_serving()
        assert set(up.readyz()["checks"]["processes"]) == {"vllm", "vllm-teacher", "worker", "trainer"}
        chat = f"{up.url}/v1/chat/completions"
        active = None
        # timeouts for a shared 2-core machine: a reply waits while the trainer's step holds the CPUs
        with httpx.Client(timeout=600) as http:
            deadline = time.monotonic() + 1200
            n = 0
            while active is None and time.monotonic() < deadline:
                question = QUESTIONS[n % len(QUESTIONS)]
                n += 1
                messages = [{"role": "user", "content": question}]
                r = http.post(chat, json={"model": "policy", "messages": messages, "max_tokens": 8})
                assert r.status_code == 200, r.text
                reaction = "Thanks, that is what I needed." if n % 2 else "No, answer with one word."
                messages += [{"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]},
                             {"role": "user", "content": reaction}]
                assert http.post(chat, json={"model": "policy", "messages": messages, "max_tokens": 1}
                                 ).status_code == 200
                active = http.get(f"{up.url}/api/policy/versions").json()["active"]
                if active is None:
                    time.sleep(5)
            trainer_log = (tmp_path / "logs" / "trainer.log").read_text(errors="replace")
            assert active, f"no version promoted after {n} interactions; trainer log:\n{trainer_log[-4000:]}"
            assert re.search(r"round 1: update 1/1, [\d,]+/[\d,]+ tokens, [\dhms]+ elapsed, ~[\dhms]+ left", trainer_log), trainer_log
            # the gateway follows the alias: `policy` is served by the trained version

            def served_by() -> str | None:
                r = http.post(chat, json={"model": "policy", "max_tokens": 2,
                                          "messages": [{"role": "user", "content": "Hi"}]})
                assert r.status_code == 200, r.text
                turn = wait_for(lambda: http.get(f"{up.url}/api/turns/{r.headers['x-turn-id']}").json()
                                .get("policy_version"))
                return turn if turn == active else None
            wait_for(served_by, timeout=60, interval=1)
        pids = descendants(up.proc.pid)
        assert up.stop(signal.SIGTERM) == 0
        assert "SIGTERM: stopping every process" in up.output()
        assert_nothing_left(up, pids)
    finally:
        up.kill()
