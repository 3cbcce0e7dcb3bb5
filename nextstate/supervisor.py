"""Supervision of the processes `nextstate up` and `nextstate vllm serve` run.

Each child runs in its own process group (a vLLM server's engine and workers with it), watched
by a thread of its own. A child that exits is reported (``echo`` and :meth:`Supervisor.report`,
which the gateway shows in ``/readyz`` and ``/metrics``) and started again after a backoff that
doubles from :attr:`RestartPolicy.backoff_s` up to :attr:`RestartPolicy.backoff_max_s`. The
supervisor gives up on a child after :attr:`RestartPolicy.limit` restarts in a row (a child that
ran :attr:`RestartPolicy.healthy_s` seconds starts that count again), or once it exited the same
way :attr:`RestartPolicy.same_exit_limit` times in a row however long each run lasted (a trainer
the OOM killer ends each time it takes the same round would otherwise loop forever). Giving up
on an essential child (the default) stops everything: :attr:`Supervisor.fatal` says why and
``on_fatal`` is called, so the command exits non-zero. A child added with ``essential=False``
(`up`'s trainer) is left stopped, the reason echoed and in :meth:`Supervisor.report`
(``gave_up``, which ``/readyz`` shows), while the others keep running.

:meth:`Supervisor.stop` stops every child: SIGTERM to its process group, SIGKILL to what is left
after the grace period, and waits until no member of the group is alive.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol


Echo = Callable[[str], None]

#: what stops `up` and `vllm serve`: Ctrl-C, `kill` (systemd, docker), a closed terminal
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextmanager
def on_stop_signals(handler: Callable[[signal.Signals], None]) -> Iterator[None]:
    """Call *handler* (in the main thread) on SIGINT, SIGTERM and SIGHUP while inside."""
    previous = {sig: signal.signal(sig, lambda signum, frame: handler(signal.Signals(signum)))
                for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def process_group_alive(pgid: int) -> bool:
    """True while process group *pgid* has a member that is not a zombie."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        return True
    for stat in proc.glob("[0-9]*/stat"):
        try:
            state, _ppid, pgrp = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, IndexError, ValueError):
            continue
        if int(pgrp) == pgid and state != "Z":
            return True
    return False


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def stop_process_group(process: subprocess.Popen[bytes], grace: float = 30) -> None:
    """SIGTERM the process group *process* leads (started with ``start_new_session``); SIGKILL
    what is left after *grace* s. Returns once no live process remains in the group."""
    pgid = process.pid
    _signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while process.poll() is None or process_group_alive(pgid):
        if time.monotonic() > deadline:
            _signal_group(pgid, signal.SIGKILL)
            break
        time.sleep(0.1)
    process.wait()
    while process_group_alive(pgid):  # SIGKILLed members not reaped by init yet
        time.sleep(0.05)


class Child(Protocol):
    """A process the supervisor runs: started in its own process group, stoppable as a group."""

    name: str
    log_path: Path

    def spawn(self) -> None:
        """Start the process; return at once."""

    def wait_ready(self, cancel: threading.Event) -> None:
        """Block until the process serves (raise RuntimeError if it exits first); return early
        when *cancel* is set."""

    def poll(self) -> int | None:
        """The exit code once the process exited, else None."""

    def stop(self, grace: float = 30) -> None:
        """Stop the whole process group; idempotent."""


class Command:
    """A plain command as a child (`nextstate worker`, `nextstate train --online`): ready once
    started, its output appended to *log_path*."""

    def __init__(self, name: str, argv: list[str], *, env: Mapping[str, str], log_path: Path):
        self.name = name
        self.argv = argv
        self.env = dict(env)
        self.log_path = log_path
        self._process: subprocess.Popen[bytes] | None = None

    def spawn(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self._process = subprocess.Popen(self.argv, env=self.env, stdin=subprocess.DEVNULL, stdout=log,
                                             stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, cancel: threading.Event) -> None:
        return None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def poll(self) -> int | None:
        return self._process.poll() if self._process else None

    def stop(self, grace: float = 30) -> None:
        process, self._process = self._process, None
        if process is not None:
            stop_process_group(process, grace)


@dataclass(frozen=True)
class RestartPolicy:
    limit: int = 5  # restarts in a row before giving up
    backoff_s: float = 1.0  # the first wait before a restart, doubling after each
    backoff_max_s: float = 30.0
    healthy_s: float = 120.0  # a child that ran this long starts the count of restarts again
    same_exit_limit: int = 3  # exits the same way (code or signal, not exit 0) in a row before giving up


def describe_exit(rc: int) -> str:
    """``exit 1`` or ``killed by SIGKILL`` (Popen's negative return code)."""
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit {rc}"


def same_exit_reason(name: str, reason: str, times: int) -> str:
    """``trainer killed by SIGKILL 3 times in a row (out of memory?)``."""
    what = reason.replace("exit ", "exited ", 1) if reason.startswith("exit ") else reason
    hint = " (out of memory?)" if reason == "killed by SIGKILL" else ""
    return f"{name} {what} {times} times in a row{hint}"


@dataclass
class _Slot:
    child: Child
    after_start: Callable[[], None] | None
    grace: float
    essential: bool = True
    state: str = "starting"  # starting | running | restarting | failed | stopped
    restarts: int = 0  # in all
    in_a_row: int = 0
    same_in_a_row: int = 0  # exits with last_exit's reason in a row, however long each run lasted
    gave_up: str | None = None
    exits: Counter[str] = field(default_factory=Counter)  # reason -> count
    last_exit: str | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    ready: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None


class Supervisor:
    """Runs children, restarts one that exits, stops them all (see the module docstring)."""

    def __init__(self, *, echo: Echo = print, policy: RestartPolicy = RestartPolicy(),
                 on_fatal: Callable[[str], None] | None = None):
        self.echo = echo
        self.policy = policy
        self.on_fatal = on_fatal
        self.fatal: str | None = None
        self._slots: dict[str, _Slot] = {}
        self._stopping = threading.Event()

    def add(self, child: Child, *, after_start: Callable[[], None] | None = None, grace: float = 30,
            essential: bool = True) -> None:
        """Supervise *child*; *after_start* runs once it is ready, every time (a vLLM's reload of
        the active version) and counts as part of its start. *grace*: seconds between SIGTERM
        and SIGKILL when stopping it. Giving up on a child that is not *essential* leaves it
        stopped and the others running."""
        self._slots[child.name] = _Slot(child, after_start, grace, essential)

    def start(self, *names: str) -> bool:
        """Start these children (all not yet started without names) at once; block until each
        is ready. False when stopped or given up on meanwhile."""
        slots = [self._slots[n] for n in names] if names else [s for s in self._slots.values() if not s.thread]
        for slot in slots:
            slot.thread = threading.Thread(target=self._run, args=(slot,), name=f"supervise-{slot.child.name}",
                                           daemon=True)
            slot.thread.start()
        for slot in slots:
            while not slot.ready.wait(0.2) and slot.state != "failed":
                if self._stopping.is_set() or self.fatal:
                    return False
        return not (self._stopping.is_set() or self.fatal)

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def request_stop(self) -> None:
        """Stop restarting and waiting (safe in a signal handler); :meth:`stop` does the rest."""
        self._stopping.set()

    def wait(self) -> None:
        """Block until a stop is requested or the supervisor gave up."""
        while not self._stopping.wait(0.5) and not self.fatal:
            pass

    def report(self) -> dict[str, dict[str, Any]]:
        """Each child's state, pid, restarts, exits by reason and why it was given up on (for
        /readyz and /metrics)."""
        return {name: {"state": s.state, "pid": getattr(s.child, "pid", None), "restarts": s.restarts,
                       "last_exit": s.last_exit, "exits": dict(s.exits), "gave_up": s.gave_up,
                       "log": str(s.child.log_path)}
                for name, s in self._slots.items()}

    def stop(self) -> None:
        """Stop every child (the ones added last first: the trainer and worker before the vLLMs
        they use), each as a process group; return when none is left."""
        self._stopping.set()
        order = list(self._slots.values())[::-1]
        plain = [s for s in order if s.after_start is None]
        servers = [s for s in order if s.after_start is not None]
        for group in (plain, servers):
            threads = [threading.Thread(target=self._stop_slot, args=(s,)) for s in group]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        for slot in order:
            if slot.thread is not None:
                slot.thread.join(10)

    def _stop_slot(self, slot: _Slot) -> None:
        with slot.lock:
            slot.child.stop(slot.grace)
            if slot.state != "failed":
                slot.state = "stopped"

    # -- one child's thread -----------------------------------------------------------------------

    def _run(self, slot: _Slot) -> None:
        child, policy = slot.child, self.policy
        while not self._stopping.is_set():
            started = time.monotonic()
            with slot.lock:
                if self._stopping.is_set():
                    return
                child.spawn()
            try:
                child.wait_ready(self._stopping)
                if self._stopping.is_set():
                    return
                if slot.after_start is not None:
                    slot.after_start()
            except Exception as exc:  # noqa: BLE001 - any failure to start is a failed start, reported
                reason = f"failed to start: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
            else:
                slot.state = "running"
                slot.ready.set()
                rc = child.poll()
                while rc is None and not self._stopping.wait(0.5):
                    rc = child.poll()
                if rc is None:
                    return
                reason = describe_exit(rc)
            if self._stopping.is_set():
                return
            if time.monotonic() - started >= policy.healthy_s:
                slot.in_a_row = 0
            slot.in_a_row += 1
            same = reason == slot.last_exit and reason != describe_exit(0)
            slot.same_in_a_row = slot.same_in_a_row + 1 if same else 1
            slot.last_exit = reason
            slot.exits[reason.split(":")[0]] += 1
            with slot.lock:
                child.stop(5)  # what is left of its process group (a vLLM's engine core)
            if slot.in_a_row > policy.limit:
                self._give_up(slot, f"{child.name}: {reason}; gave up after {policy.limit} restarts in a row")
                return
            if slot.same_in_a_row >= policy.same_exit_limit and reason != describe_exit(0):
                self._give_up(slot, same_exit_reason(child.name, reason, slot.same_in_a_row))
                return
            delay = min(policy.backoff_max_s, policy.backoff_s * 2 ** (slot.in_a_row - 1))
            slot.state = "restarting"
            self.echo(f"{child.name}: {reason}; restarting in {delay:.0f} s "
                      f"({slot.in_a_row}/{policy.limit}, log: {child.log_path})")
            if self._stopping.wait(delay):
                return
            slot.restarts += 1

    def _give_up(self, slot: _Slot, why: str) -> None:
        slot.state = "failed"
        slot.gave_up = why
        if not slot.essential:
            self.echo(f"{why}; gave up on it, the other processes keep running (log: {slot.child.log_path})")
            return
        reason = f"{why} (log: {slot.child.log_path})"
        if self.fatal is None:
            self.fatal = reason
            self.echo(reason)
            if self.on_fatal is not None:
                self.on_fatal(reason)
