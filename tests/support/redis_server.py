"""Redis for the test suite and the benchmarks.

Two ways of getting a Redis for tests:

* :func:`service_redis_url` finds an already running Redis (env
  ``NEXTSTATE_TEST_REDIS_URL``, else ``redis://127.0.0.1:6379/15`` if it answers
  ``PING`` within a second). Shared: give each test its own keys / queue names
  (:func:`unique_queue`).
* :class:`ThrowawayRedis` runs a private ``redis-server`` (from ``PATH`` or env
  ``NEXTSTATE_REDIS_SERVER``) on a free port of 127.0.0.1, without persistence,
  in a temporary directory. Unlike a shared service it can be crashed
  (:meth:`ThrowawayRedis.kill`) and started again on the same port
  (:meth:`ThrowawayRedis.start`), which is what broker-outage tests need.
  Nothing is kept on disk, so a restarted server comes back empty.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import weakref
from pathlib import Path
from types import TracebackType

import redis

__all__ = [
    "REDIS_SERVER_ENV",
    "SERVICE_URL_ENV",
    "ThrowawayRedis",
    "find_redis_server",
    "redis_unavailable_reason",
    "service_redis_url",
    "unique_queue",
]

SERVICE_URL_ENV = "NEXTSTATE_TEST_REDIS_URL"
REDIS_SERVER_ENV = "NEXTSTATE_REDIS_SERVER"

_SERVICE_URL = "redis://127.0.0.1:6379/15"


def _pings(url: str, timeout: float = 1.0) -> bool:
    client = redis.Redis.from_url(url, socket_connect_timeout=timeout, socket_timeout=timeout)
    try:
        return bool(client.ping())
    except (redis.RedisError, OSError):
        return False
    finally:
        client.close()


def service_redis_url() -> str | None:
    """URL of a Redis service for tests, or ``None`` if there is none.

    Env ``NEXTSTATE_TEST_REDIS_URL`` is returned as is (not probed: an explicit
    setting that is wrong should fail in the test, not be skipped). Otherwise
    ``redis://127.0.0.1:6379/15`` if it answers ``PING`` within 1 s.
    """
    explicit = os.environ.get(SERVICE_URL_ENV)
    if explicit:
        return explicit
    return _SERVICE_URL if _pings(_SERVICE_URL) else None


def find_redis_server() -> str | None:
    """Path of the ``redis-server`` binary: env ``NEXTSTATE_REDIS_SERVER``, else ``PATH``.

    Raises:
        ValueError: ``NEXTSTATE_REDIS_SERVER`` is set but is not an executable.
    """
    explicit = os.environ.get(REDIS_SERVER_ENV)
    if explicit:
        path = shutil.which(os.path.expanduser(explicit))
        if path is None:
            raise ValueError(f"${REDIS_SERVER_ENV}={explicit!r} is not an executable")
        return path
    return shutil.which("redis-server")


def redis_unavailable_reason() -> str | None:
    """Why a :class:`ThrowawayRedis` cannot be started here, or ``None`` if it can."""
    try:
        binary = find_redis_server()
    except ValueError as exc:
        return str(exc)
    if binary is None:
        return f"redis-server is not on PATH (set ${REDIS_SERVER_ENV} to its path)"
    return None


def unique_queue(prefix: str = "nextstate-test") -> str:
    """A queue (or key) name no other test run uses: ``<prefix>-<12 hex chars>``."""
    return f"{prefix}-{secrets.token_hex(6)}"


def _kill_quietly(proc: subprocess.Popen[bytes], directory: Path) -> None:
    # Safety net for servers never stopped (a test that crashed, an interrupted run).
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)
    shutil.rmtree(directory, ignore_errors=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ThrowawayRedis:
    """A private ``redis-server`` on 127.0.0.1, without persistence, in a temporary directory.

    The port is chosen when the object is made, so :attr:`url` is known before
    :meth:`start` and stays the same across :meth:`kill` / :meth:`start`.

    Example::

        with ThrowawayRedis() as server:
            redis.Redis.from_url(server.url).set("k", "v")
            server.kill()   # clients now get "connection refused"
            server.start()  # same URL, empty database
    """

    def __init__(self, binary: str | None = None, port: int | None = None) -> None:
        """
        Args:
            binary: path of ``redis-server``; default :func:`find_redis_server`.
            port: TCP port; default a free one.

        Raises:
            FileNotFoundError: no ``redis-server`` binary was found.
        """
        found = binary or find_redis_server()
        if found is None:
            raise FileNotFoundError(
                f"redis-server not found on PATH; install Redis or set ${REDIS_SERVER_ENV}"
            )
        self.binary = found
        self._port_given = port is not None
        self.port = port if port is not None else _free_port()
        self.base_dir: Path | None = None
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:<port>/0``."""
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        """Whether the server process is alive."""
        return self.proc is not None and self.proc.poll() is None

    @property
    def log_file(self) -> Path | None:
        """The server's log file (``None`` before the first start)."""
        return self.base_dir / "redis.log" if self.base_dir else None

    def start(self, timeout: float = 10.0) -> ThrowawayRedis:
        """Start the server (no-op if running) and wait until it answers ``PING``.

        Raises:
            RuntimeError: the server exited or did not answer within ``timeout``.
        """
        if self.running:
            return self
        fresh_dir = self.base_dir is None
        if self.base_dir is None:
            self.base_dir = Path(tempfile.mkdtemp(prefix="nextstate-redis-"))
        for attempt in range(3):
            try:
                self._spawn(timeout)
                return self
            except RuntimeError:
                # Someone took our auto-chosen port between choosing and binding: pick another.
                if self._port_given or attempt == 2 or "Address already in use" not in self._log_tail():
                    if fresh_dir:  # the error message already carries the log
                        shutil.rmtree(self.base_dir, ignore_errors=True)
                        self.base_dir = None
                    raise
                self.port = _free_port()
        raise AssertionError("unreachable")

    def _spawn(self, timeout: float) -> None:
        assert self.base_dir is not None and self.log_file is not None
        args = [
            self.binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.base_dir),
            "--logfile", str(self.log_file),
            "--daemonize", "no",
        ]
        self.proc = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        weakref.finalize(self, _kill_quietly, self.proc, self.base_dir)  # also runs at interpreter exit
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"redis-server exited with {self.proc.returncode}:\n{self._log_tail()}"
                )
            if self._answers():
                return
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"redis-server not answering after {timeout}s:\n{self._log_tail()}")

    def _answers(self) -> bool:
        # Ours answering, not some other server that happens to hold the port.
        assert self.proc is not None
        client = redis.Redis.from_url(self.url, socket_connect_timeout=0.5, socket_timeout=0.5)
        try:
            return client.info("server").get("process_id") == self.proc.pid
        except (redis.RedisError, OSError):
            return False
        finally:
            client.close()

    def _log_tail(self, n: int = 30) -> str:
        try:
            lines = self.log_file.read_text(errors="replace").splitlines() if self.log_file else []
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def kill(self) -> None:
        """SIGKILL the server (a crash). The temporary directory is kept; idempotent."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(10)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the server (SIGTERM, SIGKILL after ``timeout``) and delete its directory.

        Idempotent; :meth:`start` afterwards brings up a new, empty server on the same port.
        """
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        if self.base_dir is not None:
            shutil.rmtree(self.base_dir, ignore_errors=True)
            self.base_dir = None

    def __enter__(self) -> ThrowawayRedis:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
