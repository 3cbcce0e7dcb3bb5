"""A sandbox per rollout: the commands an agent's model chooses run here, never on the host as is.

Each :class:`Sandbox` owns a directory and runs commands in it with what Linux offers without
extra packages (util-linux's ``unshare``, ``setpriv`` and ``prlimit``, the kernel's rlimits and tmpfs):

- **no network**: a new network namespace (``unshare --net``): no interface but a downed
  loopback, so every connect — to the host's gateway, its database, the internet — fails;
- **its own processes**: a new PID namespace (``--pid --fork --kill-child``): killing the
  command's ``unshare`` kills everything it started, daemons and double forks included;
- **no orphans**: ``setpriv --pdeathsig KILL`` ahead of ``unshare``, and again where the command
  takes its uid (a change of uid clears the parent-death signal ``--kill-child`` set): when the
  process that started the command dies (SIGKILL, the OOM killer; strictly, when the thread that
  started it ends), the kernel kills ``unshare``, then the namespace's first process, then the namespace;
- **its own user** (as root): the command runs as a uid of its own (``setpriv``; one per
  sandbox alive at once on the machine, 42000 upwards, held by a lock file), so ``RLIMIT_NPROC`` caps the processes of this sandbox
  alone (the kernel ignores that limit for root) and it cannot touch the host's files beyond
  what any user may;
- **rlimits** on every process: CPU seconds, address space (memory), the size of one file,
  processes, open files;
- **a disk quota**: the directory is a tmpfs of ``disk_mb`` (as root), so filling it ends in
  ``ENOSPC``; without root the directory's size is checked after each command instead;
- **a wall-clock limit** per command: past it, the whole PID namespace is killed.

Not contained: the kernel itself (a kernel exploit escapes any of this), reading world-readable
host files (the filesystem is the host's; only writes are confined by the uid), and CPU time
*shares* between sandboxes (no cgroup). See docs/agents.md.

Every limit a command hits is recorded in :attr:`Sandbox.violations` with its reason
(``timeout``, ``cpu``, ``memory``, ``file_size``, ``disk``, ``processes``, ``network``); the
agents return them, and the rollout is recorded as failed with that reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from base.errors import SandboxUnavailable

OUTPUT_LIMIT = 16 * 1024  # characters of a command's output kept (the head and the tail)
FIRST_UID = 42000
MAX_SANDBOXES = 4096


@dataclass(frozen=True)
class Limits:
    wall_s: float = 20.0  # per command
    cpu_s: int = 10  # per process (RLIMIT_CPU)
    memory_mb: int = 1024  # address space per process (RLIMIT_AS)
    file_mb: int = 8  # the largest file a process may write (RLIMIT_FSIZE)
    disk_mb: int = 32  # the whole directory
    processes: int = 48  # RLIMIT_NPROC of the sandbox's uid
    open_files: int = 256  # RLIMIT_NOFILE


@dataclass
class CommandResult:
    exit_code: int | None  # None: killed at the wall-clock limit
    output: str  # stdout and stderr, interleaved, capped at OUTPUT_LIMIT
    violation: str | None = None  # the limit it hit, if any
    seconds: float = 0.0


_uids_lock = threading.Lock()
_uids_taken: dict[int, int] = {}  # uid -> the fd of its lock file, held while the sandbox lives
UID_LOCKS = Path(tempfile.gettempdir()) / "nextstate-sandbox-uids"


def _take_uid() -> int:
    """A uid no other live sandbox has, in this process or another one on the machine: each is
    held by an flock on ``UID_LOCKS/<uid>``, which the kernel drops when its holder dies."""
    UID_LOCKS.mkdir(mode=0o700, exist_ok=True)
    with _uids_lock:
        for uid in range(FIRST_UID, FIRST_UID + MAX_SANDBOXES):
            if uid in _uids_taken:
                continue
            fd = os.open(UID_LOCKS / str(uid), os.O_CREAT | os.O_RDWR, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            _uids_taken[uid] = fd
            return uid
    raise SandboxUnavailable(f"more than {MAX_SANDBOXES} sandboxes alive at once")


def _give_uid(uid: int) -> None:
    with _uids_lock:
        fd = _uids_taken.pop(uid, None)
        if fd is not None:
            os.close(fd)  # closing drops the flock


_probe: str | None = None


def check_available() -> None:
    """Raise :class:`SandboxUnavailable` unless commands can be isolated here (probed once)."""
    global _probe
    if _probe is None and shutil.which("prlimit") is None:
        raise SandboxUnavailable("util-linux's prlimit is not on PATH (it sets each command's limits)")
    if _probe is None and shutil.which("setpriv") is None:
        raise SandboxUnavailable("util-linux's setpriv is not on PATH (it ties each command's life to its parent's)")
    if _probe is None:
        args = ["unshare", "--net", "--pid", "--fork", "--kill-child", "true"]
        if os.geteuid() != 0:
            args[1:1] = ["--user", "--map-root-user"]
        try:
            done = subprocess.run(args, capture_output=True, text=True, timeout=30)
            _probe = "" if done.returncode == 0 else (done.stderr.strip() or f"exit {done.returncode}")
        except (OSError, subprocess.TimeoutExpired) as exc:
            _probe = f"{type(exc).__name__}: {exc}"
    if _probe:
        raise SandboxUnavailable(f"cannot create network and PID namespaces ({' '.join(args[:-1])}): {_probe}")


def _open_to_others(path: Path) -> bool:
    return all(os.stat(p).st_mode & 0o005 == 0o005 for p in [path, *path.parents] if p.is_dir())


def _python_for_others() -> tuple[str, str]:
    """(a directory with a `python3` of this interpreter's version that any user may run, this
    interpreter's site-packages): a venv under a closed home (/root is 0700) is not runnable by
    the sandbox's uid, the system's python3 of the same version is, with the same packages."""
    import sysconfig

    purelib = sysconfig.get_paths()["purelib"]
    real = Path(sys.executable).resolve()
    if _open_to_others(real.parent):
        return str(Path(sys.executable).parent), purelib
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for d in ("/usr/local/bin", "/usr/bin"):
        if (Path(d) / version).exists():
            return d, purelib
    return str(Path(sys.executable).parent), purelib


_UNSHARE_KILLED = "unshare: sigprocmask unblock failed"
_FORK_FAILED = re.compile(r"fork: (retry|Resource temporarily unavailable)|can't fork|BlockingIOError|"
                          r"Cannot fork|Resource temporarily unavailable", re.I)
_NO_MEMORY = re.compile(r"MemoryError|Cannot allocate memory|std::bad_alloc|out of memory", re.I)
_NO_SPACE = re.compile(r"No space left on device|Disk quota exceeded", re.I)
_NO_NETWORK = re.compile(r"Network is unreachable|ENETUNREACH|Name or service not known|"
                         r"Temporary failure in name resolution|Cannot assign requested address", re.I)


def unmount_under(path: Path) -> list[str]:
    """Unmount every mount at or below *path* (deepest first) and return their mount points.

    A sandbox unmounts its tmpfs when it closes; a process killed before that (SIGKILL, the OOM
    killer) leaves it mounted. Whoever gave that process its sandboxes' directory calls this
    once it is gone. Lazy (``umount -l``): a mount still in use is detached now, freed when idle.
    """
    top = Path(path).resolve()
    points = []
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        # field 5 is the mount point, with space, tab, newline and backslash written as octal escapes
        point = Path(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), line.split()[4]))
        if point == top or top in point.parents:
            points.append(point)
    done = []
    for point in sorted(set(points), key=lambda p: len(p.parts), reverse=True):
        if subprocess.run(["umount", "-l", str(point)], capture_output=True).returncode == 0:
            done.append(str(point))
    return done


class Sandbox:
    """One rollout's directory and the limits its commands run under. Use as a context manager
    (or call :meth:`close`): closing kills what is left, unmounts the tmpfs and removes the
    directory unless ``keep``."""

    def __init__(self, root: Path, limits: Limits | None = None, files: dict[str, str] | None = None,
                 keep: bool = False):
        check_available()
        self.limits = limits or Limits()
        self.root = Path(root).resolve()
        self.keep = keep
        self.violations: list[str] = []
        self.root.mkdir(parents=True, exist_ok=True)
        self.privileged = os.geteuid() == 0
        self.uid = _take_uid() if self.privileged else os.getuid()
        self.mounted = False
        if self.privileged:
            done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.limits.disk_mb}m,mode=0755",
                                   "tmpfs", str(self.root)], capture_output=True, text=True)
            self.mounted = done.returncode == 0  # in a container without CAP_SYS_ADMIN: checked after each command
            os.chown(self.root, self.uid, self.uid)
        for rel, text in (files or {}).items():
            self.write(rel, text)

    # -- files, as the host sees them ------------------------------------------------------------

    def path(self, rel: str) -> Path:
        """The host path of *rel*, refusing one that leaves the sandbox."""
        p = (self.root / rel).resolve()
        if p != self.root and self.root not in p.parents:
            raise ValueError(f"{rel!r} is outside the sandbox")
        return p

    def write(self, rel: str, text: str) -> None:
        p = self.path(rel)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text, encoding="utf-8")
        if self.privileged:
            for q in [p, *p.parents]:
                if q == self.root.parent:
                    break
                os.chown(q, self.uid, self.uid)

    def read(self, rel: str, limit: int = 1 << 20) -> str | None:
        """The text of *rel* (its first *limit* bytes), None when it is not a regular file."""
        try:
            p = self.path(rel)
        except ValueError:
            return None
        if not p.is_file() or p.is_symlink():
            return None
        with open(p, "rb") as f:
            return f.read(limit).decode("utf-8", errors="replace")

    def disk_bytes(self) -> int:
        total = 0
        for dirpath, _, names in os.walk(self.root):
            for name in names:
                with contextlib.suppress(OSError):
                    total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
        return total

    # -- commands ----------------------------------------------------------------------------------

    def _argv(self, command: str | list[str]) -> list[str]:
        argv = ["/bin/sh", "-c", command] if isinstance(command, str) else list(command)
        ns = ["unshare", "--net", "--pid", "--fork", "--kill-child"]
        # SIGKILL when the starting thread's process dies: no Python runs between fork and exec
        # (see _rlimits), so setpriv sets it and execs the rest
        orphan = ["setpriv", "--pdeathsig", "KILL", "--"]
        if not self.privileged:
            return orphan + self._rlimits() + ns[:1] + ["--user", "--map-root-user"] + ns[1:] + ["--", *argv]
        # --reuid clears the parent-death signal --kill-child gave the namespace's first process:
        # set again, after the uid change, so that unshare's death kills the namespace
        return orphan + self._rlimits() + ns + ["--", "setpriv", f"--reuid={self.uid}", f"--regid={self.uid}",
                                                "--clear-groups", "--no-new-privs", "--pdeathsig", "KILL",
                                                "--", *argv]

    def _rlimits(self) -> list[str]:
        """util-linux's ``prlimit`` sets the limits and execs the rest: no Python runs between fork
        and exec (a ``preexec_fn`` can deadlock the child of a process with threads — the agents
        benchmark runs many rollouts' event loops in threads — and hung such rollouts)."""
        lim = self.limits
        mb = 1024 * 1024
        # CPU: SIGXCPU at the soft limit, SIGKILL a second later for a process that ignores it.
        # SIGXCPU and SIGXFSZ reach the command with their default action: subprocess restores
        # what Python ignores (SIGXFSZ, SIGPIPE) before exec, and nothing here ignores SIGXCPU.
        return ["prlimit", f"--cpu={lim.cpu_s}:{lim.cpu_s + 1}", f"--as={lim.memory_mb * mb}",
                f"--fsize={lim.file_mb * mb}", f"--nproc={lim.processes}", f"--nofile={lim.open_files}",
                "--core=0", "--"]

    def _env(self) -> dict[str, str]:
        # nothing of the host's environment (API keys, database URLs) reaches the command; `python3`
        # is one the sandbox's uid may run, with this interpreter's packages (pytest) on its path
        bindir, purelib = _python_for_others()
        return {"PATH": f"{bindir}:/usr/local/bin:/usr/bin:/bin", "HOME": str(self.root), "LANG": "C.UTF-8",
                "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": purelib, "TMPDIR": str(self.root)}

    async def run(self, command: str | list[str], *, timeout: float | None = None, cwd: str = ".") -> CommandResult:
        """Run *command* (a shell line, or an argv) in the sandbox; records any limit it hit."""
        started = time.monotonic()
        wall = timeout if timeout is not None else self.limits.wall_s
        self._wall = wall
        proc = await asyncio.create_subprocess_exec(
            *self._argv(command), cwd=self.path(cwd), env=self._env(), stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, start_new_session=True)
        head, tail, dropped = bytearray(), bytearray(), 0

        async def drain() -> None:
            nonlocal tail, dropped
            assert proc.stdout is not None
            while chunk := await proc.stdout.read(65536):
                room = OUTPUT_LIMIT // 2 - len(head)
                if room > 0:
                    head.extend(chunk[:room])
                    chunk = chunk[room:]
                tail.extend(chunk)
                if len(tail) > OUTPUT_LIMIT // 2:
                    dropped += len(tail) - OUTPUT_LIMIT // 2
                    del tail[: len(tail) - OUTPUT_LIMIT // 2]

        timed_out = False
        reader = asyncio.ensure_future(drain())
        try:
            await asyncio.wait_for(proc.wait(), wall)
        except TimeoutError:
            timed_out = True
        finally:
            if proc.returncode is None:
                # killing unshare kills its child, PID 1 of the namespace, and with it every process there
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(reader, 5)
            reader.cancel()
        text = head.decode("utf-8", errors="replace")
        if dropped:
            text += f"\n[... {dropped} bytes of output dropped ...]\n"
        text += tail.decode("utf-8", errors="replace")
        code = None if timed_out else proc.returncode
        violation = self._violation(code, text, timed_out)
        if violation:
            self.violations.append(violation)
        return CommandResult(code, text, violation, round(time.monotonic() - started, 3))

    def _violation(self, code: int | None, text: str, timed_out: bool) -> str | None:
        lim = self.limits
        if not self.mounted and self.disk_bytes() > lim.disk_mb * 1024 * 1024:
            return f"disk: the directory holds more than {lim.disk_mb} MiB"
        if _FORK_FAILED.search(text):  # a fork bomb usually also runs into the wall clock
            return f"processes: over {lim.processes} processes" + (", killed at the wall-clock limit" if timed_out else "")
        if timed_out:
            return f"timeout: still running after {self._wall:g} s, killed"
        signalled = -code if code is not None and code < 0 else (code - 128 if code is not None and code > 128
                                                                    else None)
        if code == 1 and _UNSHARE_KILLED in text:  # unshare cannot re-raise SIGKILL on itself
            signalled = signal.SIGKILL
        if signalled in (signal.SIGXCPU, signal.SIGKILL):  # nobody else kills it before the wall clock
            return f"cpu: over {lim.cpu_s} s of CPU time"
        if signalled == signal.SIGXFSZ:
            return f"file_size: a file over {lim.file_mb} MiB"
        if code == 0:
            return None
        if _NO_SPACE.search(text):
            return f"disk: the directory's {lim.disk_mb} MiB are full"
        if _NO_MEMORY.search(text):
            return f"memory: over {lim.memory_mb} MiB of address space"
        if _NO_NETWORK.search(text):
            return "network: the sandbox has none"
        return None

    @property
    def failure(self) -> str | None:
        """The limits its commands hit, as one reason (None: none)."""
        return "; ".join(dict.fromkeys(self.violations)) or None

    def close(self) -> None:
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.root)], capture_output=True)
            self.mounted = False
        if not self.keep:
            shutil.rmtree(self.root, ignore_errors=True)
        if self.privileged:
            _give_uid(self.uid)
            self.privileged = False

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> Sandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()
