"""Pushing a switch of the ``policy`` alias to the gateways, instead of having them poll.

Whoever changes which version is ``active`` (``datapool.versions``: publish with activation,
promote, rollback) calls :func:`announce` inside that transaction. Gateways hold a
:class:`PolicyWatch`, which calls back as soon as the change is committed:

- **PostgreSQL**: ``pg_notify('nextstate_policy', <name>)`` inside the transaction, delivered
  by the server at commit (never for a rolled-back transaction) to every session that ran
  ``LISTEN nextstate_policy`` — one dedicated psycopg connection per gateway process, on any
  host.
- **SQLite**: in the same process, the session's commit calls the watchers of that database
  file directly. Another process on the same file (a gateway beside a trainer) is woken by
  ``PRAGMA data_version``, which changes when any *other* connection commits to the file; the
  watch reads it every :data:`SQLITE_CHECK_S` (a local file read, no query planning).

A notification can still be missed (the listening connection was down, the database was
restarted), so gateways also re-read the alias every ``policy_fallback_s`` seconds: the push
makes the switch prompt, the slow poll makes it certain.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import weakref
from collections.abc import Callable
from pathlib import Path

from sqlalchemy import Engine, event, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session as OrmSession

log = logging.getLogger("nextstate.policy_signal")

#: the PostgreSQL ``LISTEN``/``NOTIFY`` channel
CHANNEL = "nextstate_policy"
#: SQLite, another process: how often the watch reads ``PRAGMA data_version``
SQLITE_CHECK_S = 0.05

# SQLite, this process: database file → the callbacks of the watches on it
_local: dict[str, weakref.WeakSet[PolicyWatch]] = {}
_local_lock = threading.Lock()


def _sqlite_key(url: str) -> str | None:
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        return None
    db = parsed.database or ":memory:"
    return db if db == ":memory:" else str(Path(db).resolve())


def announce(db: OrmSession, version: str | None) -> None:
    """Tell every gateway, once this transaction commits, that the active version changed to
    *version* (None: the base model). Call it inside the transaction that changes it."""
    bind = db.get_bind()
    if bind.dialect.name == "postgresql":
        db.execute(text("SELECT pg_notify(:ch, :v)"), {"ch": CHANNEL, "v": version or ""})
        return
    key = _sqlite_key(bind.engine.url.render_as_string(hide_password=False)) if hasattr(bind, "engine") else None
    if key is None:
        return

    def _after_commit(_session: OrmSession) -> None:
        with _local_lock:
            watches = list(_local.get(key, ()))
        for w in watches:
            w.poke()

    event.listen(db, "after_commit", _after_commit, once=True)


class PolicyWatch:
    """Calls *on_change* (from its own thread) whenever the active version may have changed.

    ``start()`` / ``stop()``. Spurious calls are allowed (the caller re-reads the pool);
    missed ones are what the caller's slow fallback poll is for.
    """

    def __init__(self, engine: Engine, on_change: Callable[[], None]):
        self.url = engine.url.render_as_string(hide_password=False)
        self.on_change = on_change
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._sqlite = _sqlite_key(self.url)
        #: set once the watch listens (PostgreSQL: ``LISTEN`` ran), for tests and logs
        self.listening = threading.Event()

    def poke(self) -> None:
        try:
            self.on_change()
        except Exception:  # a closed event loop at shutdown: nothing left to tell
            log.debug("policy watch callback failed", exc_info=True)

    def start(self) -> PolicyWatch:
        if self._sqlite is not None:
            with _local_lock:
                _local.setdefault(self._sqlite, weakref.WeakSet()).add(self)
            target = self._run_sqlite if self._sqlite != ":memory:" else None
        elif make_url(self.url).get_backend_name() == "postgresql":
            target = self._run_postgres
        else:
            target = None
        if target is None:
            self.listening.set()
            return self
        self._thread = threading.Thread(target=target, name="policy-watch", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._sqlite is not None:
            with _local_lock:
                _local.get(self._sqlite, weakref.WeakSet()).discard(self)
        if self._thread is not None:
            self._thread.join(timeout=5)

    # -- PostgreSQL ------------------------------------------------------------------------------

    def _run_postgres(self) -> None:
        import psycopg

        dsn = make_url(self.url).set(drivername="postgresql").render_as_string(hide_password=False)
        while not self._stop.is_set():
            try:
                with psycopg.connect(dsn, autocommit=True, connect_timeout=5) as conn:
                    conn.execute(f"LISTEN {CHANNEL}")
                    self.listening.set()
                    # (re)connected: what happened while we were not listening is read now
                    self.poke()
                    while not self._stop.is_set():
                        for _note in conn.notifies(timeout=0.5, stop_after=1):
                            self.poke()
            except psycopg.Error as exc:
                self.listening.clear()
                log.warning("policy watch: PostgreSQL connection lost (%s); the fallback poll covers it", exc)
                self._stop.wait(1.0)

    # -- SQLite, other processes -----------------------------------------------------------------

    def _run_sqlite(self) -> None:
        assert self._sqlite is not None
        seen: int | None = None
        conn: sqlite3.Connection | None = None
        self.listening.set()
        while not self._stop.is_set():
            try:
                if conn is None:
                    conn = sqlite3.connect(self._sqlite, timeout=5, check_same_thread=False)
                version = conn.execute("PRAGMA data_version").fetchone()[0]
                if seen is not None and version != seen:
                    self.poke()
                seen = version
            except sqlite3.Error:
                conn = None
            self._stop.wait(SQLITE_CHECK_S)
        if conn is not None:
            conn.close()
