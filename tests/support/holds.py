"""States a test holds still instead of racing the clock for.

A test that polls for a passing state ("the writer has shed but not yet replayed", "a step is
recorded and the next batch is leased") fails on a busy machine: the state comes and goes
between two polls. These helpers make such a state wait for the test, with PostgreSQL's own
locks, so the code under test runs unchanged and the test releases it when it has looked.
"""

from __future__ import annotations

from types import TracebackType

from sqlalchemy import text

from datapool.db import make_engine


class HeldPool:
    """An open transaction holding the turns table: every write to it (the capture writer's)
    waits inside PostgreSQL until :meth:`release`."""

    def __init__(self, url: str):
        self.engine = make_engine(url)
        self.conn = self.engine.connect()
        self.tx = self.conn.begin()
        self.conn.execute(text("LOCK TABLE turns IN ACCESS EXCLUSIVE MODE"))

    def release(self) -> None:
        if self.conn.closed:
            return
        self.tx.rollback()
        self.conn.close()
        self.engine.dispose()


class HeldTrainingStep:
    """Holds a trainer inside the transaction that records its step ``after + 1``.

    A trigger on ``training_steps`` makes that insert wait for an advisory lock this object
    holds: the pool then shows ``after`` steps recorded and the next batch leased, not acked,
    for as long as the test needs (e.g. to SIGKILL the trainer right there). On exit the lock
    is released and the trigger dropped, so a resumed trainer runs freely. A killed trainer's
    backend notices its client is gone once the lock is released and rolls the step back.
    """

    LOCK_KEY = 7_150_001

    def __init__(self, url: str, *, after: int = 1):
        self.engine = make_engine(url)
        self.after = after
        self.conn = self.engine.connect().execution_options(isolation_level="AUTOCOMMIT")

    def __enter__(self) -> "HeldTrainingStep":
        self.conn.execute(text("SELECT pg_advisory_lock(:key)"), {"key": self.LOCK_KEY})
        self.conn.execute(text(f"""
            CREATE FUNCTION test_hold_training_step() RETURNS trigger AS $$
            BEGIN
                IF (SELECT count(*) FROM training_steps) >= {int(self.after)} THEN
                    PERFORM pg_advisory_xact_lock({self.LOCK_KEY});
                END IF;
                RETURN NEW;
            END $$ LANGUAGE plpgsql"""))
        self.conn.execute(text("CREATE TRIGGER test_hold_training_step BEFORE INSERT ON training_steps "
                               "FOR EACH ROW EXECUTE FUNCTION test_hold_training_step()"))
        return self

    def waiting(self) -> bool:
        """True while a trainer waits in the held step's transaction."""
        return bool(self.conn.scalar(text(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted AND objid = :key"),
            {"key": self.LOCK_KEY}))

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.conn.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": self.LOCK_KEY})
        # waits for the held transaction to end (a killed trainer's backend rolls it back)
        self.conn.execute(text("DROP TRIGGER test_hold_training_step ON training_steps"))
        self.conn.execute(text("DROP FUNCTION test_hold_training_step()"))
        self.conn.close()
        self.engine.dispose()
