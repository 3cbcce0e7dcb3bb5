"""Arize Phoenix, a real OpenTelemetry receiver, for the trace-export tests: installed from PyPI
(pinned) into a venv of its own under ``$NEXTSTATE_CACHE_DIR/phoenix`` (default
``~/.cache/nextstate/phoenix``; its dependencies are not ours to share a venv with), started on free
ports with its own working directory, read back through its REST API.

It takes OTLP over HTTP at ``/v1/traces`` and files each span under the project its resource names
(``openinference.project.name``), so each test sends to a project of its own.

`python -m tests.support.phoenix install` installs it (idempotent, locked against parallel runs; the fixtures
call the same function).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from base.settings import Settings
from nextstate.modelserver import file_lock
from tests.support.processes import free_port, wait_for

SPEC = "arize-phoenix==20.26.1"
READY_STAMP = ".ready"


def default_root() -> Path:
    return Settings().cache_dir / "phoenix"


def ensure_phoenix(root: Path | None = None, say: Any = print) -> Path:
    """The ``phoenix`` command of a venv under *root*, installed unless already there."""
    root = root or default_root()
    exe = root / "venv" / "bin" / "phoenix"
    stamp = root / READY_STAMP
    with file_lock(root / ".lock"):
        if stamp.exists() and stamp.read_text().strip() == SPEC and exe.exists():
            return exe
        stamp.unlink(missing_ok=True)
        log_path = root / "install.log"
        say(f"phoenix: pip install {SPEC} into {root / 'venv'} (log: {log_path})")
        started = time.monotonic()
        with open(log_path, "a") as log:
            for cmd in ([sys.executable, "-m", "venv", str(root / "venv")],
                        [str(root / "venv" / "bin" / "pip"), "--disable-pip-version-check", "install", SPEC]):
                log.write(f"\n$ {' '.join(cmd)}\n")
                log.flush()
                if subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL).returncode:
                    raise RuntimeError(f"`{' '.join(cmd[:3])} …` failed; see {log_path}")
        if not exe.exists():
            raise RuntimeError(f"installing {SPEC} left no {exe}; see {log_path}")
        stamp.write_text(SPEC + "\n")
        say(f"phoenix: installed in {time.monotonic() - started:.0f} s")
    return exe


class PhoenixProcess:
    """`phoenix serve` on 127.0.0.1, free HTTP and gRPC ports, its database in *work_dir*."""

    def __init__(self, work_dir: Path):
        self.work_dir = work_dir
        self.port = free_port()
        self.log_path = work_dir / "phoenix.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 240.0) -> "PhoenixProcess":
        exe = ensure_phoenix()
        self.work_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PHOENIX_WORKING_DIR": str(self.work_dir / "phoenix"), "PHOENIX_HOST": "127.0.0.1",
               "PHOENIX_PORT": str(self.port), "PHOENIX_GRPC_PORT": str(free_port()),
               "PHOENIX_TELEMETRY_ENABLED": "false"}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([str(exe), "serve"], env=env, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)

        def up() -> bool:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"phoenix exited with {self.proc.returncode}; see {self.log_path}")
            try:
                return httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(up, timeout=timeout, interval=0.5)  # ~35 s on two busy cores: its migrations
        return self

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def __enter__(self) -> "PhoenixProcess":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def env(self, project: str) -> dict[str, str]:
        """The standard OpenTelemetry variables that point an exporter at this Phoenix, into *project*."""
        return {"OTEL_EXPORTER_OTLP_ENDPOINT": self.url,
                "OTEL_RESOURCE_ATTRIBUTES": f"openinference.project.name={project}",
                "OTEL_BSP_SCHEDULE_DELAY": "100"}

    def spans(self, project: str) -> list[dict[str, Any]]:
        """Every span Phoenix holds in *project*, as its REST API returns them."""
        out: list[dict[str, Any]] = []
        cursor: str | None = None
        while True:
            params: dict[str, Any] = {"limit": 1000}
            if cursor:
                params["cursor"] = cursor
            resp = httpx.get(f"{self.url}/v1/projects/{project}/spans", params=params, timeout=30)
            if resp.status_code == 404:
                return out  # nothing arrived yet: the project is made by its first span
            resp.raise_for_status()
            body = resp.json()
            out += body["data"]
            cursor = body.get("next_cursor")
            if not cursor:
                return out


def main(argv: list[str]) -> int:
    if argv[:1] != ["install"]:
        print("usage: python -m tests.support.phoenix install", file=sys.stderr)
        return 2
    print(ensure_phoenix())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
