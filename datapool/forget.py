"""Forgetting: delete a session's, a tenant's or an end user's data from the pool and the local
spool, report the policy versions that learned from it, and optionally taint them.

What goes, in one transaction: the sessions and every row keyed to them or to their turns
(turns, votes, judgements, labels, tool-call arguments, continuations, training leases) and the
eval gate's stored replies to those turns' prompts (``eval_replies`` by prompt hash). The
lineage (:mod:`datapool.lineage`) is read first, in the same transaction, since the leases it
reads go with the turns. With *taint*, those versions (trained on the turns, or descended from
one that was) get ``tainted``: promotion (``datapool.versions.switch_active``) refuses them from
then on, and ``publishing.publish.rollback_tainted`` moves the policy off a tainted active
version (to :func:`tainted_rollback_target`). An ``audit_log`` row records the action and its
counts in the same transaction.

An end user is the ``user`` field of the requests (the OpenAI API's end-user id; Anthropic's
``metadata.user_id``), as the pool keeps it in ``request.params``: every session holding a turn
whose request named that user is forgotten whole.

Spool files (``capture-N.jsonl``, ``rejected.jsonl`` in the spool directory of this machine)
are rewritten without the matching records when no running gateway holds them; a file a
running gateway holds is reported (``spool.held``), since rewriting it under the gateway's
replay cursor would corrupt it: its records reach the pool once it replays, which
:func:`forget_waiting` waits for before it forgets again. Other machines' spools are not
reachable from here.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, delete, func, or_, select, update
from sqlalchemy.orm import Session as OrmSession

from datapool import audit, versions
from datapool.db import chunked
from base.errors import ForgetError
from datapool.evals import prompt_hash
from datapool.lineage import versions_trained_on
from datapool.models import (
    EvalReply,
    Judgement,
    Label,
    PolicyVersion,
    Session,
    ToolCallArguments,
    TrainingLease,
    Turn,
    TurnContinuation,
    Vote,
)
from base.vocab import AuditAction, VersionKind, VersionStatus


def _target(session_id: str | None, tenant: str | None, end_user: str | None) -> tuple[str, str]:
    given = [(k, v) for k, v in (("session", session_id), ("tenant", tenant), ("user", end_user)) if v]
    if len(given) != 1:
        raise ForgetError("name exactly one of a session id, a tenant or an end-user id")
    return given[0]


def session_ids(db: OrmSession, kind: str, value: str, *, within_tenant: str | None = None) -> list[str]:
    """The sessions a target names; *within_tenant* (a tenant's key): only that tenant's."""
    if kind == "session":
        q = select(Session.id).where(Session.id == value)
    elif kind == "tenant":
        q = select(Session.id).where(Session.tenant == value)
    else:
        q = select(Turn.session_id).join(Session, Session.id == Turn.session_id).where(or_(
            Turn.request[("params", "user")].as_string() == value,
            Turn.request[("params", "metadata", "user_id")].as_string() == value)).distinct()
    if within_tenant is not None:
        q = q.where(Session.tenant == within_tenant)
    return sorted(set(db.scalars(q)))


def _count(db: OrmSession, col: Any, ids: Sequence[str]) -> int:
    return sum(db.scalar(select(func.count()).select_from(col.table).where(col.in_(c))) or 0 for c in chunked(ids))


def forget(engine: Engine, *, session_id: str | None = None, tenant: str | None = None,
           end_user: str | None = None, actor: str, within_tenant: str | None = None,
           dry_run: bool = False, taint: bool = False, spool_dir: Path | None = None) -> dict[str, Any]:
    """Forget what the target names (see the module). Returns the report: ``deleted`` counts per
    table, ``versions`` that learned from the data, ``tainted`` names, ``active_tainted`` (the
    active version is tainted now: call ``publishing.publish.rollback_tainted``), ``spool``."""
    kind, value = _target(session_id, tenant, end_user)
    with OrmSession(engine) as db, db.begin():
        sids = session_ids(db, kind, value, within_tenant=within_tenant)
        turns: list[str] = []
        hashes: set[str] = set()
        for chunk in chunked(sids):
            for tid, request in db.execute(select(Turn.id, Turn.request).where(Turn.session_id.in_(chunk))):
                turns.append(tid)
                if (request or {}).get("messages"):
                    try:
                        hashes.add(prompt_hash(request["messages"]))
                    except (TypeError, ValueError, AttributeError):
                        pass  # a malformed request cannot be an eval prompt
        lineage = versions_trained_on(db, turns)
        evals = sorted(set(db.scalars(select(EvalReply.id).where(EvalReply.prompt_hash.in_(sorted(hashes)))))) \
            if hashes else []
        deleted = {
            "sessions": len(sids),
            "turns": len(turns),
            "votes": _count(db, Vote.turn_id, turns),
            "judgements": _count(db, Judgement.turn_id, turns),
            "labels": sum(db.scalar(select(func.count()).select_from(Label).where(
                or_(Label.turn_id.in_(t), Label.session_id.in_(s)))) or 0
                for t, s in _pairs(turns, sids)),
            "tool_call_arguments": _count(db, ToolCallArguments.turn_id, turns),
            "turn_continuations": _count(db, TurnContinuation.turn_id, turns),
            "training_leases": _count(db, TrainingLease.turn_id, turns),
            "eval_replies": len(evals),
        }
        names = [v["name"] for v in lineage]
        tainted = sorted(set(names)) if taint else []
        active = db.scalars(select(PolicyVersion.name).where(PolicyVersion.status == VersionStatus.ACTIVE)).first()
        report: dict[str, Any] = {
            "target": {kind: value}, "dry_run": dry_run, "deleted": deleted, "versions": lineage,
            "tainted": tainted, "active_tainted": bool(taint and active in tainted),
        }
        if dry_run:
            report["spool"] = scrub_spool(spool_dir, kind, value, set(sids), within_tenant, dry_run=True)
            db.rollback()
            return report
        for chunk in chunked(evals):
            db.execute(delete(EvalReply).where(EvalReply.id.in_(chunk)))
        # children first: SQLite cascades only with foreign_keys on, and explicit deletes keep
        # the statement count known on both databases
        for model, col in ((Vote, Vote.turn_id), (Judgement, Judgement.turn_id), (Label, Label.turn_id),
                           (ToolCallArguments, ToolCallArguments.turn_id),
                           (TurnContinuation, TurnContinuation.turn_id), (TrainingLease, TrainingLease.turn_id)):
            for chunk in chunked(turns):
                db.execute(delete(model).where(col.in_(chunk)))
        for chunk in chunked(sids):
            db.execute(delete(Label).where(Label.session_id.in_(chunk)))
            db.execute(delete(Turn).where(Turn.session_id.in_(chunk)))
            db.execute(delete(Session).where(Session.id.in_(chunk)))
        if tainted:
            db.execute(update(PolicyVersion).where(PolicyVersion.name.in_(tainted)).values(tainted=True))
        audit.record(db, actor, AuditAction.FORGET, f"{kind}:{value}",
                     {"deleted": deleted, "versions": names, "tainted": tainted})
        if tainted:
            audit.record(db, actor, AuditAction.TAINT, ",".join(tainted)[:512],
                         {"versions": tainted, "because": f"forget {kind}:{value}"})
    report["spool"] = scrub_spool(spool_dir, kind, value, set(sids), within_tenant, dry_run=False)
    return report


def _pairs(turns: list[str], sids: list[str]) -> Iterable[tuple[list[str], list[str]]]:
    """Chunks of turns and sessions side by side, for one OR-ed count per pair."""
    t, s = list(chunked(turns)), list(chunked(sids))
    for i in range(max(len(t), len(s))):
        yield (t[i] if i < len(t) else []), (s[i] if i < len(s) else [])


def forget_waiting(engine: Engine, wait_s: float, *, poll_s: float = 0.5, **kw: Any) -> dict[str, Any]:
    """:func:`forget`, then, while a running gateway's spool file still holds matching records
    (``spool.held``), wait up to *wait_s* for that gateway to replay them into the pool and
    forget again; the report adds up both passes (``passes``: how many ran)."""
    report = forget(engine, **kw)
    report["passes"] = 1
    if kw.get("dry_run") or not report["spool"]["held"]:
        return report
    kind, value = _target(kw.get("session_id"), kw.get("tenant"), kw.get("end_user"))
    spool_dir, within = kw.get("spool_dir"), kw.get("within_tenant")
    deadline = time.monotonic() + wait_s
    sids = {v for v in (kw.get("session_id"),) if v}
    while time.monotonic() < deadline:
        time.sleep(poll_s)
        if scrub_spool(spool_dir, kind, value, sids, within, dry_run=True)["held"]:
            continue
        again = forget(engine, **kw)
        for table, n in again["deleted"].items():
            report["deleted"][table] += n
        known = {v["name"] for v in report["versions"]}
        report["versions"] += [v for v in again["versions"] if v["name"] not in known]
        report["tainted"] = sorted(set(report["tainted"]) | set(again["tainted"]))
        report["active_tainted"] = report["active_tainted"] or again["active_tainted"]
        report["spool"] = {**again["spool"], "removed": report["spool"]["removed"] + again["spool"]["removed"]}
        report["passes"] = 2
        break
    return report


# --------------------------------------------------------------------------------------------
# the spool


def end_user_of(request: dict[str, Any]) -> str | None:
    """The end-user id a stored request names: OpenAI's ``user``, Anthropic's ``metadata.user_id``."""
    params = request.get("params") or {}
    user = params.get("user")
    if user is None and isinstance(params.get("metadata"), dict):
        user = params["metadata"].get("user_id")
    return user if isinstance(user, str) else None


def _matches(record: dict[str, Any], kind: str, value: str, sids: set[str], within_tenant: str | None) -> bool:
    if within_tenant is not None and record.get("tenant") != within_tenant:
        return False
    if kind == "tenant":
        return record.get("tenant") == value
    if kind == "user":
        return end_user_of(record.get("request") or {}) == value
    return record.get("session_id") == value or record.get("session_id") in sids


def _scrub_file(path: Path, test: Any, dry_run: bool) -> int:
    """Rewrite *path* without the lines *test* matches (atomically); returns how many."""
    keep: list[bytes] = []
    removed = 0
    with open(path, "rb") as f:
        for line in f:
            try:
                obj = json.loads(line)
            except ValueError:
                keep.append(line)
                continue
            rec = obj.get("record", obj) if isinstance(obj, dict) else obj
            if isinstance(rec, dict) and test(rec):
                removed += 1
            else:
                keep.append(line)
    if removed and not dry_run:
        tmp = path.with_name(path.name + ".forget")
        with open(tmp, "wb") as f:
            f.writelines(keep)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    return removed


def scrub_spool(spool_dir: Path | None, kind: str, value: str, sids: set[str], within_tenant: str | None,
                *, dry_run: bool) -> dict[str, Any]:
    """Remove the target's records from this machine's spool files that no running gateway holds;
    report the held ones (``held``: file -> matching records)."""
    out: dict[str, Any] = {"dir": str(spool_dir) if spool_dir else None, "removed": 0, "held": {}}
    if spool_dir is None or not spool_dir.is_dir():
        return out
    def test(r: dict[str, Any]) -> bool:
        return _matches(r, kind, value, sids, within_tenant)
    for path in sorted(spool_dir.glob("capture-*.jsonl")):
        lock = open(path.with_suffix(".lock"), "ab")
        try:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # a running gateway's own file: count only
                n = _scrub_file(path, test, dry_run=True)
                if n:
                    out["held"][str(path)] = n
                continue
            out["removed"] += _scrub_file(path, test, dry_run)
        finally:
            lock.close()
    rejected = spool_dir / "rejected.jsonl"
    if rejected.exists():
        out["removed"] += _scrub_file(rejected, test, dry_run)
    return out


# --------------------------------------------------------------------------------------------
# after tainting


def tainted_rollback_target(engine: Engine) -> str | None:
    """Where the policy goes when its active version is tainted: the newest version that served
    before and is not tainted, else ``versions.BASE``; None when the active version is clean (or
    none is active). ``publishing.publish.rollback_tainted`` rolls back to it."""
    with OrmSession(engine) as db:
        active = db.scalars(select(PolicyVersion).where(PolicyVersion.status == VersionStatus.ACTIVE)).first()
        if active is None or not active.tainted:
            return None
        clean = db.scalars(
            select(PolicyVersion.name).where(
                PolicyVersion.tainted.is_(False), PolicyVersion.status == VersionStatus.RETIRED,
                PolicyVersion.kind.in_((VersionKind.LORA, VersionKind.FULL)))
            .order_by(PolicyVersion.created_at.desc(), PolicyVersion.id.desc()).limit(1)).first()
    return clean or versions.BASE
