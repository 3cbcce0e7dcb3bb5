"""Held-out evaluation in the pool: the eval gate's replies (``eval_replies``), written where the
gate evaluates a version and read by the admin UI's version-vs-version page; and held-out pass@1
per policy version from the sessions of mode ``eval`` (``nextstate rollout --eval``: never
trained on), read by the admin UI's training page."""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Engine, bindparam, func, select, update
from sqlalchemy.orm import Session as OrmSession

from datapool.db import utcnow
from datapool.models import EvalReply, Session, Turn
from base.vocab import SessionMode, TurnKind
from datapool.canonical import history_hash


def prompt_hash(messages: Sequence[dict[str, Any]]) -> str:
    """The key that finds the same held-out prompt across versions: the canonical history hash
    that stitches sessions (``datapool.canonical``), so a prompt matches itself whatever null
    fields, content parts or tool-call ids a client's spelling of it carries."""
    return history_hash(messages)


def rehash(conn: Connection, *, chunk: int = 500) -> tuple[int, int]:
    """Recompute every stored held-out reply's ``prompt_hash`` from its stored prompt (migration
    0011 runs it when the hash changed form; so does ``nextstate db rehash``). Reads in chunks
    ordered by id; returns (rows read, rows whose hash changed)."""
    table = EvalReply.__table__
    seen = changed = 0
    last = 0
    while True:
        rows = conn.execute(select(table.c.id, table.c.prompt, table.c.prompt_hash)
                            .where(table.c.id > last).order_by(table.c.id).limit(chunk)).all()
        if not rows:
            return seen, changed
        last = rows[-1].id
        seen += len(rows)
        fresh = [{"b_id": r.id, "b_hash": h} for r in rows if (h := prompt_hash(r.prompt or [])) != r.prompt_hash]
        if fresh:
            conn.execute(update(table).where(table.c.id == bindparam("b_id")).values(prompt_hash=bindparam("b_hash")),
                         fresh)
        changed += len(fresh)


def record_replies(engine: Engine, version: str, prompts: Sequence[list[dict[str, Any]]], replies: Sequence[str],
                   scores: Sequence[float | None]) -> None:
    """Store *version*'s reply and score for each held-out prompt, in one transaction."""
    now = utcnow()
    with OrmSession(engine) as db, db.begin():
        db.add_all(EvalReply(version=version, prompt_hash=prompt_hash(p), prompt=list(p), reply=r, score=s,
                             created_at=now) for p, r, s in zip(prompts, replies, scores))


def replies_of(db: OrmSession, version: str, limit: int = 500) -> dict[str, dict[str, Any]]:
    """*version*'s newest reply to each held-out prompt, by prompt hash."""
    out: dict[str, dict[str, Any]] = {}
    rows = db.scalars(select(EvalReply).where(EvalReply.version == version)
                      .order_by(EvalReply.created_at.desc(), EvalReply.id.desc()).limit(limit * 4))
    for r in rows:
        if r.prompt_hash not in out and len(out) < limit:
            out[r.prompt_hash] = {"prompt": list(r.prompt or []), "reply": r.reply, "score": r.score,
                                  "created_at": r.created_at}
    return out


def evaluated_versions(db: OrmSession) -> list[str]:
    """Every name with stored held-out replies (policy versions, and the base model the gate
    evaluated as the active side)."""
    return sorted(v for v in db.scalars(select(EvalReply.version).distinct()) if v)



# -- held-out pass@1 of the eval sessions -------------------------------------------------------------


@dataclass
class PassAt1:
    """Held-out pass@1 of one policy version (``run`` None: over all its eval sessions) or of
    one run's sessions that version answered.

    ``pass_at_1`` is the mean over tasks of c/n (c of a task's n sessions with a verdict passed),
    as ``nextstate rollout --eval`` reports it; None while no session has a verdict. A session
    has a verdict when it has an outcome, or when its rollout finished without one (timed out,
    agent failed, verifier error: not passed, as the rollout's report counts it). ``awaiting``
    are sessions without a verdict yet (running, or tagged eval and no outcome posted), left out
    of pass@1; ``mixed`` are sessions counted here that another version also answered."""

    version: str | None
    run: str | None = None
    rollouts: int = 0  # sessions with a verdict
    passed: int = 0
    tasks: int = 0  # distinct tasks among them
    runs: int = 0  # distinct runs (``metadata.rollout.run``) among all its sessions
    pass_at_1: float | None = None
    stderr: float | None = None  # of pass@1 over tasks (None below two tasks)
    awaiting: int = 0
    mixed: int = 0
    first: datetime | None = None
    last: datetime | None = None
    _per_task: dict[str, list[bool]] = field(default_factory=lambda: defaultdict(list), repr=False)

    def _add(self, task: str, passed: bool | None, mixed: bool, at: datetime | None) -> None:
        if passed is None:
            self.awaiting += 1
        else:
            self.rollouts += 1
            self.passed += passed
            self._per_task[task].append(passed)
        self.mixed += mixed
        if at is not None:
            self.first = at if self.first is None else min(self.first, at)
            self.last = at if self.last is None else max(self.last, at)

    def _finish(self) -> PassAt1:
        rates = [sum(t) / len(t) for t in self._per_task.values()]
        self.tasks = len(rates)
        self.pass_at_1 = sum(rates) / len(rates) if rates else None
        self.stderr = statistics.stdev(rates) / math.sqrt(len(rates)) if len(rates) > 1 else None
        return self


@dataclass
class HeldOut:
    """What :func:`heldout_pass_at_1` found: per version (oldest evaluated first), per run and
    version (newest run first, at most ``runs_limit``), and the counts behind them."""

    versions: list[PassAt1]
    runs: list[PassAt1]
    sessions: int  # eval sessions, cancelled attempts included
    awaiting: int
    mixed: int
    cancelled: int  # attempts a rollout cancelled and ran again: left out
    runs_total: int
    pass_threshold: float


def session_versions(db: OrmSession) -> dict[str, tuple[str | None, bool]]:
    """Per eval session the policy version that answered it and whether another version
    answered some of it too: the version of most of its main turns (on a tie, the one that
    answered first), the rule ``nextstate rollout`` records in the session's metadata."""
    rows = db.execute(
        select(Turn.session_id, Turn.policy_version, func.count(), func.min(Turn.created_at))
        .join(Session, Session.id == Turn.session_id)
        .where(Session.mode == SessionMode.EVAL, Turn.turn_type == TurnKind.MAIN, Turn.policy_version.is_not(None))
        .group_by(Turn.session_id, Turn.policy_version)).all()
    by_session: dict[str, list[tuple[int, datetime, str]]] = defaultdict(list)
    for sid, version, n, first in rows:
        by_session[sid].append((-int(n), first, version))
    return {sid: (min(vs)[2], len(vs) > 1) for sid, vs in by_session.items()}


def heldout_pass_at_1(db: OrmSession, *, pass_threshold: float = 1.0, runs_limit: int = 100) -> HeldOut:
    """Held-out pass@1 per policy version, and per run (``metadata.rollout.run``) and version,
    from the sessions of mode ``eval``: a session passes when its outcome (the verifier's) is at
    least *pass_threshold*. Tasks are the sessions' ``task_id`` (a session without one is a task
    of its own). A session answered by two versions counts once, under the version of most of
    its main turns (:func:`session_versions`); one no turn names a version under the version its
    rollout recorded, else under None."""
    answered = session_versions(db)
    rollout_status = Session.meta[("rollout", "status")].as_string()
    rows = db.execute(select(Session.id, Session.task_id, Session.outcome, Session.created_at, rollout_status,
                             Session.meta[("rollout", "run")].as_string(),
                             Session.meta[("rollout", "policy_version")].as_string())
                      .where(Session.mode == SessionMode.EVAL)).all()
    by_version: dict[str | None, PassAt1] = {}
    by_run: dict[tuple[str, str | None], PassAt1] = {}
    cancelled = 0
    for sid, task, outcome, at, status, run, recorded in rows:
        if outcome is None and status == "cancelled":
            cancelled += 1
            continue
        version, mixed = answered.get(sid, (recorded, False))
        passed = (outcome >= pass_threshold if outcome is not None else False if status == "done" else None)
        by_version.setdefault(version, PassAt1(version))._add(task or sid, passed, mixed, at)
        if run:
            by_run.setdefault((run, version), PassAt1(version, run))._add(task or sid, passed, mixed, at)
    for run, version in by_run:
        by_version[version].runs += 1
    versions = sorted((v._finish() for v in by_version.values()),
                      key=lambda v: (v.first.isoformat() if v.first else "", v.version is None, v.version or ""))
    runs = sorted((r._finish() for r in by_run.values()),
                  key=lambda r: (r.last.isoformat() if r.last else "", r.run or "", r.version or ""), reverse=True)
    return HeldOut(versions=versions, runs=runs[:runs_limit], sessions=len(rows),
                   awaiting=sum(v.awaiting for v in versions), mixed=sum(v.mixed for v in versions),
                   cancelled=cancelled, runs_total=len(runs), pass_threshold=pass_threshold)
