"""PostgreSQL for the test suite and the benchmarks.

Two ways of getting a database for tests:

* :func:`service_dsn` finds an already running PostgreSQL service (env
  ``NEXTSTATE_TEST_PG_URL`` or a trust-auth server on ``127.0.0.1:5432``);
  :func:`fresh_database` then creates a uniquely named, disposable database on it.
* :class:`ThrowawayPostgres` runs a private cluster in a temporary directory.
  Unlike a shared service it can be crashed (:meth:`ThrowawayPostgres.kill`) and
  brought back (:meth:`ThrowawayPostgres.restart`) on the same port and data
  directory, which is what crash-recovery tests need.

DSNs handed out and accepted here are SQLAlchemy URLs
(``postgresql+psycopg://user@host:port/db``); :func:`to_conninfo` turns one into
something :func:`psycopg.connect` accepts.

PostgreSQL refuses to run as root. When the tests run as root (containers, CI),
the cluster's processes run as the ``postgres`` OS user (override with env
``NEXTSTATE_PG_OS_USER``) and the temporary directory is handed over to it.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

import psycopg
from psycopg import sql

__all__ = [
    "PG_BIN_ENV",
    "SERVICE_URL_ENV",
    "OS_USER_ENV",
    "ThrowawayPostgres",
    "find_pg_bin",
    "throwaway_unavailable_reason",
    "service_dsn",
    "fresh_database",
    "to_conninfo",
    "with_database",
]

PG_BIN_ENV = "NEXTSTATE_PG_BIN"
SERVICE_URL_ENV = "NEXTSTATE_TEST_PG_URL"
OS_USER_ENV = "NEXTSTATE_PG_OS_USER"

_SERVER_BINARIES = ("initdb", "pg_ctl", "postgres")
_SERVICE_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
_SCHEME_RE = re.compile(r"^postgres(?:ql)?(?:\+[A-Za-z0-9_]+)?://")


# --------------------------------------------------------------------------
# Locating binaries
# --------------------------------------------------------------------------


def _has_server_binaries(directory: Path) -> bool:
    return all(os.access(directory / name, os.X_OK) for name in _SERVER_BINARIES)


def _version_key(path: Path) -> tuple[int, ...]:
    # /usr/lib/postgresql/<version>/bin -> numeric version parts, for sorting.
    return tuple(int(part) for part in re.findall(r"\d+", path.parent.name))


def find_pg_bin() -> Path | None:
    """Return the directory holding the PostgreSQL server binaries, or ``None``.

    Looked up, in order: env ``NEXTSTATE_PG_BIN``; ``pg_config --bindir``; the
    newest ``/usr/lib/postgresql/*/bin`` (Debian/Ubuntu layout); the directory
    of ``pg_ctl`` on ``PATH``. A candidate counts only if it contains
    ``initdb``, ``pg_ctl`` and ``postgres``.

    Raises:
        ValueError: ``NEXTSTATE_PG_BIN`` is set but lacks those binaries (an
            explicit setting that is wrong should fail loudly, not be skipped).
    """
    explicit = os.environ.get(PG_BIN_ENV)
    if explicit:
        path = Path(explicit).expanduser()
        if not _has_server_binaries(path):
            raise ValueError(
                f"${PG_BIN_ENV}={explicit!r} does not contain {', '.join(_SERVER_BINARIES)}"
            )
        return path

    pg_config = shutil.which("pg_config")
    if pg_config:
        try:
            out = subprocess.run(
                [pg_config, "--bindir"], capture_output=True, text=True, timeout=10, check=True
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            out = ""
        if out and _has_server_binaries(Path(out)):
            return Path(out)

    debian = sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=_version_key, reverse=True)
    for candidate in debian:
        if _has_server_binaries(candidate):
            return candidate

    pg_ctl = shutil.which("pg_ctl")
    if pg_ctl:
        candidate = Path(pg_ctl).resolve().parent
        if _has_server_binaries(candidate):
            return candidate
    return None


def _os_user_if_root() -> pwd.struct_passwd | None:
    """The account to run the server as when we are root; ``None`` when not root."""
    if os.geteuid() != 0:
        return None
    name = os.environ.get(OS_USER_ENV, "postgres")
    try:
        return pwd.getpwnam(name)
    except KeyError:
        raise RuntimeError(
            f"running as root, but OS user {name!r} does not exist; PostgreSQL cannot run as "
            f"root. Create the user or set ${OS_USER_ENV} to an unprivileged account."
        ) from None


def throwaway_unavailable_reason() -> str | None:
    """Return why :class:`ThrowawayPostgres` cannot work here, or ``None`` if it can.

    Meant for ``pytest.skip`` messages.
    """
    try:
        if find_pg_bin() is None:
            return (
                "PostgreSQL server binaries (initdb, pg_ctl) not found; install PostgreSQL "
                f"or set ${PG_BIN_ENV}"
            )
        _os_user_if_root()
    except (ValueError, RuntimeError) as exc:
        return str(exc)
    return None


# --------------------------------------------------------------------------
# DSN handling
# --------------------------------------------------------------------------


def to_conninfo(dsn: str) -> str:
    """Convert a SQLAlchemy URL (``postgresql+psycopg://…``) to a libpq URI.

    Only the ``+driver`` part is dropped; user, password, host, port, database
    and query parameters are passed through. Anything that is not a URL (e.g. a
    ``key=value`` conninfo string) is returned unchanged.
    """
    return _SCHEME_RE.sub("postgresql://", dsn, count=1)


def with_database(dsn: str, dbname: str) -> str:
    """Return ``dsn`` (a SQLAlchemy URL) pointing at database ``dbname`` instead."""
    parts = urlsplit(dsn)
    return urlunsplit(parts._replace(path="/" + quote(dbname, safe="")))


def _port_open(host: str, port: int, timeout: float = 0.2) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


# --------------------------------------------------------------------------
# Databases on an existing server
# --------------------------------------------------------------------------


def service_dsn() -> str | None:
    """Return the DSN of a running PostgreSQL service usable by tests, or ``None``.

    Env ``NEXTSTATE_TEST_PG_URL`` wins (returned as is, unchecked). Otherwise a
    server on ``127.0.0.1:5432`` that lets ``postgres`` in without a password is
    used, if it answers within 2 seconds.
    """
    explicit = os.environ.get(SERVICE_URL_ENV)
    if explicit:
        return explicit
    if not _port_open("127.0.0.1", 5432, timeout=1.0):
        return None
    try:
        with psycopg.connect(to_conninfo(_SERVICE_URL), connect_timeout=2):
            pass
    except psycopg.Error:
        return None
    return _SERVICE_URL


def _admin_connect(admin_dsn: str) -> psycopg.Connection[Any]:
    return psycopg.connect(to_conninfo(admin_dsn), autocommit=True, connect_timeout=10)


def _create_database(admin_dsn: str, name: str, template: str | None = None) -> str:
    with _admin_connect(admin_dsn) as conn:
        if template is None:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        else:
            conn.execute(sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(sql.Identifier(name), sql.Identifier(template)))
    return with_database(admin_dsn, name)


def _drop_database(admin_dsn: str, name: str) -> None:
    with _admin_connect(admin_dsn) as conn:
        conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE datname = %s AND pid <> pg_backend_pid()",
            (name,),
        )
        force = sql.SQL(" WITH (FORCE)") if conn.info.server_version >= 130000 else sql.SQL("")
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {}{}").format(sql.Identifier(name), force))


def fresh_database(
    admin_dsn: str, prefix: str = "nextstate_test", *, template: str | None = None
) -> tuple[str, Callable[[], None]]:
    """Create a uniquely named database and return ``(dsn, drop)``.

    Args:
        admin_dsn: SQLAlchemy URL of a role allowed to CREATE/DROP DATABASE.
        prefix: start of the database name; a random hex suffix is appended.
        template: the name of a database to copy (``CREATE DATABASE ... TEMPLATE``): its
            schema and rows, in a fraction of the time migrating an empty one takes. Nothing
            may be connected to the template while it is copied.

    Returns:
        The new database's SQLAlchemy URL (same credentials/host as
        ``admin_dsn``) and a function that terminates every connection to it
        and drops it. Calling the function more than once is harmless.
    """
    name = f"{prefix}_{secrets.token_hex(6)}"
    dsn = _create_database(admin_dsn, name, template)

    def drop() -> None:
        _drop_database(admin_dsn, name)

    return dsn, drop


# --------------------------------------------------------------------------
# Throwaway cluster
# --------------------------------------------------------------------------


def _pid_state(pid: int) -> str | None:
    """Linux process state letter (``R``, ``S``, ``Z``…), ``"?"`` elsewhere, ``None`` if gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("State:"):
                return line.split()[1]
    except OSError:
        if Path("/proc/self").exists():
            return None  # vanished between the two checks
    return "?"


def _alive(pid: int) -> bool:
    # A zombie (killed, not yet reaped by whoever inherited it) counts as dead.
    return _pid_state(pid) not in (None, "Z")


def _children(pid: int) -> list[int]:
    """Direct children of ``pid``: from /proc on Linux, else ``pgrep -P``."""
    proc = Path("/proc")
    if proc.is_dir():
        kids = []
        for entry in proc.iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            # Fields after the ")" closing the command name: state, ppid, ...
            fields = stat[stat.rfind(")") + 2 :].split()
            if len(fields) > 1 and int(fields[1]) == pid:
                kids.append(int(entry.name))
        return kids
    pgrep = shutil.which("pgrep")
    if not pgrep:
        return []
    out = subprocess.run([pgrep, "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(tok) for tok in out.split()]


def _is_postgres_process(pid: int) -> bool:
    """Guard against a stale ``postmaster.pid`` whose pid now belongs to something else.

    Checks the process name on Linux; elsewhere trusts the pid.
    """
    comm = Path(f"/proc/{pid}/comm")
    if not Path("/proc/self").exists():
        return True
    try:
        return comm.read_text().strip() in ("postgres", "postmaster")
    except OSError:
        return False


def _read_postmaster_pid(data_dir: Path) -> int | None:
    """The pid in ``data_dir/postmaster.pid`` if that process is a live PostgreSQL server."""
    try:
        pid = int((data_dir / "postmaster.pid").read_text().split("\n", 1)[0].strip())
    except (OSError, ValueError):
        return None
    return pid if _alive(pid) and _is_postgres_process(pid) else None


def _sigkill_cluster(data_dir: Path) -> list[int]:
    """SIGKILL the postmaster of ``data_dir`` and all its children; return the pids hit.

    The postmaster is SIGSTOPped first so it cannot fork while its children
    are being listed.
    """
    pid = _read_postmaster_pid(data_dir)
    if pid is None:
        return []
    try:
        os.kill(pid, signal.SIGSTOP)
        victims = [pid, *_children(pid)]
        for victim in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, signal.SIGKILL)
    except ProcessLookupError:
        return []
    return victims


def _emergency_cleanup(data_dir: Path, base_dir: Path) -> None:
    """Finalizer for clusters nobody destroyed: kill processes, remove files."""
    victims = _sigkill_cluster(data_dir)
    _wait_until(lambda: not any(_alive(pid) for pid in victims), timeout=5)
    shutil.rmtree(base_dir, ignore_errors=True)


def _wait_until(predicate: Callable[[], bool], timeout: float, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


class ThrowawayPostgres:
    """A private PostgreSQL cluster in a temporary directory, for tests.

    Listens on ``127.0.0.1:<port>`` (a free port picked at construction time,
    kept across restarts) and on a unix socket inside the temporary directory;
    trust authentication, superuser ``postgres``. Durability settings are
    relaxed (``fsync=off`` etc.): committed data survives a process crash
    (:meth:`kill`) but not an OS crash, which is all tests need.

    Layout under :attr:`base_dir`: ``data/`` (the cluster), ``socket/``
    (unix socket), ``postgres.log`` (server log).

    Use as a context manager (``with ThrowawayPostgres() as pg: ...``) or call
    :meth:`start` / :meth:`destroy` yourself. A cluster that is never
    destroyed is killed and removed when the interpreter exits.
    """

    host = "127.0.0.1"

    def __init__(
        self,
        *,
        pg_bin: Path | str | None = None,
        port: int | None = None,
        start_timeout: float = 60.0,
    ) -> None:
        """Prepare (but do not start) a cluster.

        Args:
            pg_bin: directory with initdb/pg_ctl; default :func:`find_pg_bin`.
            port: TCP port; default a currently free one.
            start_timeout: seconds ``pg_ctl`` waits for startup/shutdown.

        Raises:
            RuntimeError: no PostgreSQL binaries, or root without a usable
                unprivileged OS user.
        """
        found = Path(pg_bin) if pg_bin is not None else find_pg_bin()
        if found is None:
            raise RuntimeError(
                f"PostgreSQL server binaries not found; install PostgreSQL or set ${PG_BIN_ENV}"
            )
        self.pg_bin: Path = found
        self._os_user = _os_user_if_root()
        self.port: int = port if port is not None else _free_port(self.host)
        self.start_timeout = start_timeout

        self.base_dir: Path = Path(
            tempfile.mkdtemp(prefix="nextstate-pg-", dir="/tmp" if self._os_user else None)
        )
        self.data_dir: Path = self.base_dir / "data"
        self.socket_dir: Path = self.base_dir / "socket"
        self.log_file: Path = self.base_dir / "postgres.log"
        self.socket_dir.mkdir()
        if self._os_user is not None:
            # The server user must be able to reach and write the directory.
            self.base_dir.chmod(0o755)
            for path in (self.base_dir, self.socket_dir):
                os.chown(path, self._os_user.pw_uid, self._os_user.pw_gid)
        self._finalizer = weakref.finalize(self, _emergency_cleanup, self.data_dir, self.base_dir)

    # -- properties -------------------------------------------------------

    @property
    def dsn(self) -> str:
        """SQLAlchemy URL of the ``postgres`` database as superuser ``postgres``."""
        return f"postgresql+psycopg://postgres@{self.host}:{self.port}/postgres"

    @property
    def conninfo(self) -> str:
        """libpq URI of the ``postgres`` database, for :func:`psycopg.connect`."""
        return to_conninfo(self.dsn)

    @property
    def initialized(self) -> bool:
        """Whether ``initdb`` has run."""
        return (self.data_dir / "PG_VERSION").exists()

    @property
    def pid(self) -> int | None:
        """The postmaster's pid if it is running, else ``None``."""
        return _read_postmaster_pid(self.data_dir)

    @property
    def running(self) -> bool:
        """Whether the postmaster process is alive."""
        return self.pid is not None

    # -- process control --------------------------------------------------

    def _run(self, *args: str) -> subprocess.CompletedProcess[str]:
        """Run a PostgreSQL binary, as the unprivileged OS user if we are root."""
        cmd = [str(self.pg_bin / args[0]), *args[1:]]
        env = dict(os.environ, LC_ALL="C", LANG="C")
        extra: dict[str, Any] = {}
        if self._os_user is not None:
            user = self._os_user
            env.update(HOME=user.pw_dir, USER=user.pw_name, LOGNAME=user.pw_name)
            extra = {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}
        proc = subprocess.run(
            cmd,
            cwd=self.base_dir,
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            **extra,
        )
        if proc.returncode != 0:
            log_tail = ""
            if self.log_file.exists():
                log_tail = "\n".join(self.log_file.read_text(errors="replace").splitlines()[-20:])
            raise RuntimeError(
                f"{' '.join(cmd)} failed with exit code {proc.returncode}\n"
                f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}\nserver log tail:\n{log_tail}"
            )
        return proc

    def _initdb(self) -> None:
        self._run(
            "initdb",
            "-D", str(self.data_dir),
            "--no-sync",
            "-A", "trust",
            "-U", "postgres",
            "-E", "UTF8",
            "--locale=C",
        )  # fmt: skip
        # Settings go into postgresql.conf (not `pg_ctl -o`) so that every
        # start, including restarts after a crash, uses the same ones and no
        # shell quoting of paths is involved.
        socket_dir = str(self.socket_dir).replace("'", "''")
        settings = {
            "port": str(self.port),
            "listen_addresses": f"'{self.host}'",
            "unix_socket_directories": f"'{socket_dir}'",
            # Safe against process crashes, not OS crashes: every commit is
            # still write()n to the kernel, just never fsync()ed.
            "fsync": "off",
            "full_page_writes": "off",
            # NOT off: with synchronous_commit=off a commit returns while its
            # WAL is only in shared memory, and kill() would lose it.
            "synchronous_commit": "on",
            "max_connections": "100",
        }
        with (self.data_dir / "postgresql.conf").open("a") as conf:
            conf.write("\n# nextstate test settings\n")
            conf.writelines(f"{key} = {value}\n" for key, value in settings.items())

    def _remove_stale_lock_files(self) -> None:
        """Delete lock files left by a dead server (what PostgreSQL would do itself).

        PostgreSQL probes the pid in a lock file with ``kill(pid, 0)``, which
        also succeeds for a zombie. Where init does not reap orphans (some
        containers), a killed postmaster stays a zombie and would block the
        next start with "lock file already exists".
        """
        for lock in (
            self.data_dir / "postmaster.pid",
            self.socket_dir / f".s.PGSQL.{self.port}.lock",
        ):
            try:
                pid = int(lock.read_text().split("\n", 1)[0].strip())
            except (OSError, ValueError):
                continue
            if not _alive(pid):
                lock.unlink(missing_ok=True)

    def start(self) -> None:
        """Start the server (running ``initdb`` first if needed); wait until it accepts connections.

        No-op if it is already running.
        """
        if self.running:
            return
        if not self.base_dir.exists():
            raise RuntimeError(f"cluster at {self.base_dir} was destroyed")
        if not self.initialized:
            self._initdb()
        self._remove_stale_lock_files()
        self._run(
            "pg_ctl", "start",
            "-D", str(self.data_dir),
            "-l", str(self.log_file),
            "-w", "-t", str(int(self.start_timeout)),
        )  # fmt: skip

    def stop(self) -> None:
        """Shut the server down cleanly (fast mode: abort sessions, checkpoint).

        No-op if it is not running.
        """
        if not self.running:
            return
        self._run(
            "pg_ctl", "stop",
            "-D", str(self.data_dir),
            "-m", "fast",
            "-w", "-t", str(int(self.start_timeout)),
        )  # fmt: skip

    def kill(self) -> None:
        """Simulate a crash: SIGKILL the postmaster and every server process.

        Returns once all of them are gone and the TCP port no longer accepts
        connections. ``postmaster.pid`` is left behind, as after a real crash;
        the next :meth:`start` runs crash recovery. No-op if not running.
        """
        victims = _sigkill_cluster(self.data_dir)
        if not victims:
            return
        if not _wait_until(lambda: not any(_alive(pid) for pid in victims), timeout=10):
            survivors = [pid for pid in victims if _alive(pid)]
            raise RuntimeError(f"PostgreSQL processes survived SIGKILL: {survivors}")
        if not _wait_until(lambda: not _port_open(self.host, self.port), timeout=10):
            raise RuntimeError(f"port {self.port} still accepts connections after kill()")

    def restart(self) -> None:
        """Start again on the same port and data directory (stopping first if running).

        After :meth:`kill` this exercises crash recovery: committed data is kept,
        uncommitted transactions are gone.
        """
        self.stop()
        self.start()

    def destroy(self) -> None:
        """Stop the server (killing it if a clean stop fails) and delete the directory."""
        if not self._finalizer.alive:
            return
        try:
            self.stop()
        except RuntimeError:
            self.kill()
        finally:
            self._finalizer()  # kills anything left, removes base_dir; runs once

    # -- databases --------------------------------------------------------

    def create_database(self, name: str) -> str:
        """Create database ``name`` and return its SQLAlchemy URL."""
        return _create_database(self.dsn, name)

    # -- context manager --------------------------------------------------

    def __enter__(self) -> ThrowawayPostgres:
        try:
            self.start()
        except BaseException:
            self.destroy()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.destroy()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"<ThrowawayPostgres {self.host}:{self.port} {state} at {self.base_dir}>"


@contextlib.contextmanager
def benchmark_database(url: str | None) -> Any:
    """The database a benchmark measures, migrated to head: *url* as given, or a fresh database on
    this machine's PostgreSQL (127.0.0.1:5432), dropped on exit. Exits clearly when there is none."""
    from datapool.db import upgrade

    drop = None
    if url is None:
        dsn = service_dsn()
        if dsn is None:
            raise SystemExit("no PostgreSQL on 127.0.0.1:5432: pass --database-url")
        url, drop = fresh_database(dsn)
    try:
        upgrade(url)
        yield url
    finally:
        if drop:
            drop()
