"""Real processes the tests run: gateways (through the `nextstate` CLI) and tiny upstreams."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _NextstateProcess:
    """A `nextstate` subcommand in its own process group, logging to a file in its data dir."""

    proc: subprocess.Popen[bytes] | None = None
    log_path: Path

    def _spawn(self, args: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
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

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

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
    ):
        self.port = free_port()
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

    def __enter__(self) -> "GatewayProcess":
        return self.start()


class SilentUpstream:
    """Accepts connections and never answers: an upstream that times out."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self._conns: list[socket.socket] = []
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def _accept(self) -> None:
        self.sock.settimeout(0.2)
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
                self._conns.append(conn)
            except OSError:
                continue

    def close(self) -> None:
        self._stop.set()
        for c in self._conns:
            c.close()
        self.sock.close()


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

    def __enter__(self) -> "WorkerProcess":
        return self.start()


# ------------------------------------------------------------------------------------------
# talking to a gateway's `policy` alias (the publish tests)


def openai_client(gw: GatewayProcess, timeout: float = 180) -> Any:
    from openai import OpenAI

    return OpenAI(base_url=gw.base_url, api_key="unused", max_retries=0, timeout=timeout)


def greedy_reply(gw: GatewayProcess, messages: list[dict[str, Any]], max_tokens: int, model: str = "policy") -> str:
    r = openai_client(gw).chat.completions.create(model=model, messages=messages, temperature=0,
                                                  max_tokens=max_tokens)
    return r.choices[0].message.content or ""


def alias_root(gw: GatewayProcess) -> str | None:
    """What the gateway's `policy` alias serves now: a version's name or the base model's."""
    models = httpx.get(f"{gw.base_url}/models", timeout=10).json()["data"]
    return next(m.get("root") for m in models if m["id"] == "policy")


class PolicyStream(threading.Thread):
    """A streaming request via `policy` that runs its full *max_tokens* (ignore_eos), in a
    thread: start it, wait for ``first_chunk``, switch something, then :meth:`result`."""

    def __init__(self, gw: GatewayProcess, messages: list[dict[str, Any]], max_tokens: int):
        super().__init__(daemon=True)
        self.gw, self.messages, self.max_tokens = gw, messages, max_tokens
        self.first_chunk = threading.Event()
        self.text = ""
        self.tokens = 0
        self.model: str | None = None
        self.finish_reason: str | None = None
        self.error: BaseException | None = None
        self.ended_at = 0.0

    def run(self) -> None:
        try:
            stream = openai_client(self.gw).chat.completions.create(
                model="policy", messages=self.messages, temperature=0, max_tokens=self.max_tokens, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            for chunk in stream:
                if chunk.usage is not None:
                    self.tokens = chunk.usage.completion_tokens
                for choice in chunk.choices:
                    self.model = chunk.model
                    self.text += choice.delta.content or ""
                    self.finish_reason = choice.finish_reason or self.finish_reason
                    self.first_chunk.set()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc
        finally:
            self.ended_at = time.monotonic()
            self.first_chunk.set()

    def result(self, timeout: float = 300) -> PolicyStream:
        """Wait for the end; assert it completed its full length without an error."""
        self.join(timeout)
        assert not self.is_alive(), "the stream did not finish"
        assert self.error is None, f"stream failed: {self.error!r}"
        assert self.finish_reason == "length" and self.tokens == self.max_tokens, (self.finish_reason, self.tokens)
        return self
