"""`nextstate gateway` and `nextstate worker` in processes of their own, for tests and benchmarks."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Self

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: util-linux's setpriv: SIGKILL the command when the thread that started it dies (PR_SET_PDEATHSIG,
#: set between fork and exec with no Python running there, unlike a preexec_fn in a threaded process)
DIE_WITH_PARENT = ["setpriv", "--pdeathsig", "KILL", "--"]


class _NextstateProcess:
    """A `nextstate` subcommand in its own process group, logging to a file in its data dir.

    ``die_with_parent``: the kernel kills it when the thread that started it exits or its process
    dies (killed, the OOM killer), so that it never outlives its owner holding its port; start it
    from a thread that lives as long as it should (a process's main thread)."""

    proc: subprocess.Popen[bytes] | None = None
    log_path: Path
    die_with_parent: bool = False

    def _spawn(self, args: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        if self.die_with_parent:
            args = DIE_WITH_PARENT + args
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        return self.proc

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, sig)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    @property
    def running(self) -> bool:
        """Started and not exited yet."""
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def start(self, timeout: float = 60.0) -> Self:
        raise NotImplementedError

    def __enter__(self) -> Self:
        # `with p.start(timeout=…):` must not start a second one: the first would keep serving
        # its port, unowned, after the block (tests/gateway/test_redaction_gateway.py once left one so)
        return self if self.running else self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


class GatewayProcess(_NextstateProcess):
    """`nextstate gateway` in its own process, on a free port, with its own data dir."""

    def __init__(
        self,
        data_dir: Path,
        *,
        database_url: str,
        upstream_url: str | None = None,
        model_list: Path | None = None,
        env: dict[str, str] | None = None,
        die_with_parent: bool = False,
    ):
        self.port = free_port()
        self.die_with_parent = die_with_parent
        self.data_dir = data_dir
        self.log_path = data_dir / f"gateway-{self.port}.log"
        args = [sys.executable, "-m", "nextstate.cli", "gateway", "--port", str(self.port),
                "--database-url", database_url, "--migrate"]
        if upstream_url:
            args += ["--upstream", upstream_url]
        if model_list:
            args += ["--model-list", str(model_list)]
        self.args = args
        self.env = {**os.environ, "NEXTSTATE_DATA_DIR": str(data_dir), **(env or {})}

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def start(self, timeout: float = 60.0) -> "GatewayProcess":
        self._spawn(self.args, self.env)
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"gateway not up after {timeout}s:\n{self.log_tail()}")

    def stored_turn(self, turn_id: str, *, headers: dict[str, str] | None = None,
                    timeout: float = 20.0) -> dict[str, Any]:
        """Turn *turn_id* as `/api/turns/{id}` serves it, once the write-behind capture has stored it."""

        def fetch() -> dict[str, Any] | None:
            r = httpx.get(f"{self.url}/api/turns/{turn_id}", headers=headers, timeout=10)
            return r.json() if r.status_code == 200 else None

        return wait_for(fetch, timeout)



def wait_for(predicate: Callable[[], Any], timeout: float = 20.0, interval: float = 0.1) -> Any:
    """Poll until predicate() is truthy; returns its value. Capture is write-behind."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout}s (last value: {last!r})")


class WorkerProcess(_NextstateProcess):
    """`nextstate worker` (Celery, threads pool, with the sweep) in its own process."""

    def __init__(self, data_dir: Path, *, database_url: str, broker_url: str, env: dict[str, str]):
        self.data_dir = data_dir
        self.log_path = data_dir / f"worker-{free_port()}.log"
        self.args = [sys.executable, "-m", "nextstate.cli", "worker", "--database-url", database_url,
                     "--broker-url", broker_url, "--log-level", "info"]
        self.env = {**os.environ, "NEXTSTATE_DATA_DIR": str(data_dir), **env}

    def start(self, timeout: float = 60.0) -> "WorkerProcess":
        proc = self._spawn(self.args, self.env)
        wait_for(lambda: proc.poll() is not None or b"ready." in self.log_path.read_bytes(), timeout)
        if proc.poll() is not None:
            raise RuntimeError(f"worker exited with {proc.returncode}:\n{self.log_tail()}")
        return self
