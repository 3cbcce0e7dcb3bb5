"""The policy-version registry: which versions exist, which one the ``policy`` alias serves, and
every decision about them (``policy_events``). Rows only: making the model servers serve a
version is ``publishing.publish``'s, which calls :func:`register` and :func:`switch_active`.

The ``policy_versions`` table is the single source of truth the gateways follow (told of every
switch at commit by ``datapool.policy_signal``, and re-read on a slow fallback poll): the
``policy`` alias serves the newest ``active`` non-base row, or the base model when there is none.
The invariant, kept by the callers: **a row is only ever made ``active`` after every model
server serves it** — so no gateway ever points the alias at a model the server does not have;
a request resolved just before a switch finishes on the version it started on.

Statuses (:class:`base.vocab.VersionStatus`): ``candidate`` (published, not activated),
``active``, ``retired`` (was active, replaced by a promotion or a newer publish),
``rolled_back`` (was active and was rolled back from; never chosen again by a plain
rollback), ``refused`` (a candidate the eval gate refused). Apart from its status, a version
may be ``tainted`` (it learned from data that was forgotten, ``datapool.forget``):
:func:`switch_active` refuses a tainted target, and a plain rollback skips them. Each status
change writes a ``policy_events`` row in the same transaction.

Full versions and names: vLLM keeps serving full weights under its **base served name**, so
while a full version is active "the base model" on those servers *is* that version; the
original base weights come back when the policy rolls back to the base or to a LoRA version,
because LoRA versions are adapters of the original base.

All functions are synchronous (SQLAlchemy ``Engine``); call them from a thread in async code.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, false, select, text, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session as OrmSession

from base.errors import PublishError, VersionNotFound, VersionTainted
from datapool import audit, policy_signal
from datapool.db import iso
from datapool.models import PolicyEvent, PolicyVersion
from datapool.queries import active_policy_version
from base.vocab import AuditAction, PolicyAction, VersionKind, VersionStatus

log = logging.getLogger("nextstate.publish")

#: ``rollback(to=BASE)`` / ``activate(name=BASE)``: serve the base model (no active version).
BASE = "base"
#: Names a version may not take: the gateway alias and the base keyword.
RESERVED_NAMES = frozenset({BASE, "policy"})
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
#: Statuses a plain rollback may return to: versions that served before and were
#: replaced, not ones found bad (``rolled_back``) nor never served (``candidate``).
ROLLBACK_TARGET_STATUSES = (VersionStatus.RETIRED,)
# an arbitrary constant: PostgreSQL advisory lock that serialises status changes across processes
_PG_LOCK_KEY = 0x6E657874  # "next"


# --------------------------------------------------------------------------------------------
# reading the registry


def version_dict(row: PolicyVersion, parent_name: str | None = None) -> dict[str, Any]:
    """A ``PolicyVersion`` as plain JSON-able data."""
    return {
        "id": row.id,
        "name": row.name,
        "base_model": row.base_model,
        "kind": row.kind,
        "path": row.path,
        "parent_id": row.parent_id,
        "parent": parent_name,
        "status": row.status,
        "created_at": iso(row.created_at),
        "stats": dict(row.stats or {}),
        "tainted": bool(row.tainted),
    }


def _dict(db: OrmSession, row: PolicyVersion) -> dict[str, Any]:
    parent = db.get(PolicyVersion, row.parent_id) if row.parent_id is not None else None
    return version_dict(row, parent.name if parent else None)


def _get(db: OrmSession, name: str) -> PolicyVersion:
    row = db.scalars(select(PolicyVersion).where(PolicyVersion.name == name)).first()
    if row is None:
        raise VersionNotFound(f"no policy version named {name!r}")
    return row


def list_versions(engine: Engine) -> list[dict[str, Any]]:
    """Every policy version, oldest first, as :func:`version_dict` dicts."""
    with OrmSession(engine) as db:
        rows = list(db.scalars(select(PolicyVersion).order_by(PolicyVersion.created_at, PolicyVersion.id)))
        names = {r.id: r.name for r in rows}
        return [version_dict(r, names.get(r.parent_id) if r.parent_id is not None else None) for r in rows]


def active_version(engine: Engine) -> dict[str, Any] | None:
    """The version the ``policy`` alias serves, or None when it serves the base model."""
    with OrmSession(engine) as db:
        row = active_policy_version(db)
        return _dict(db, row) if row else None


def get_version(engine: Engine, name: str) -> dict[str, Any]:
    """One version by name; :class:`VersionNotFound` if there is none."""
    with OrmSession(engine) as db:
        return _dict(db, _get(db, name))


# --------------------------------------------------------------------------------------------
# writing it: every status change under one lock, with its event


def _lock(db: OrmSession) -> None:
    """Serialise status changes, so that what the transaction reads (which version is active) is
    still true when it writes: an advisory transaction lock on PostgreSQL; on SQLite the write
    lock, taken now by an UPDATE that changes nothing. (The sqlite3 driver begins a transaction
    only at the first write, so without it two promotions could both read "none active" and both
    set theirs: a race tests/publishing/test_publish.py caught with 9 concurrent promotions.)"""
    dialect = db.get_bind().dialect.name
    if dialect == "postgresql":
        db.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _PG_LOCK_KEY})
    elif dialect == "sqlite":
        db.execute(update(PolicyVersion).where(false()).values(status=PolicyVersion.status))


def _demote_active(db: OrmSession, status: str, *, keep_id: int | None = None) -> list[str]:
    """Give every ``active`` row (but *keep_id*) *status*; returns their names."""
    cond = [PolicyVersion.status == VersionStatus.ACTIVE]
    if keep_id is not None:
        cond.append(PolicyVersion.id != keep_id)
    names = list(db.scalars(select(PolicyVersion.name).where(*cond)))
    if names:
        db.execute(update(PolicyVersion).where(*cond).values(status=status))
    return names


def event(db: OrmSession, version_id: int | None, action: str, actor: str, reason: str | None,
           metrics: dict[str, Any]) -> None:
    """Add a ``policy_events`` row to the transaction of *db* (beside the change it records)."""
    db.add(PolicyEvent(version_id=version_id, action=action, actor=actor, reason=reason, metrics=metrics))


def check_name(name: str, base_model: str) -> None:
    """A name a new version may take; raises :class:`PublishError`."""
    if not NAME_RE.match(name):
        raise PublishError(f"invalid version name {name!r}: use letters, digits, '.', '_', '-' "
                           "(at most 128, starting with a letter or digit)")
    if name in RESERVED_NAMES or name == base_model:
        raise PublishError(f"version name {name!r} is reserved")


def check_new(engine: Engine, name: str, parent: str | None) -> int | None:
    """The name is free; returns *parent*'s id (None for the base)."""
    with OrmSession(engine) as db:
        if db.scalars(select(PolicyVersion.id).where(PolicyVersion.name == name)).first() is not None:
            raise PublishError(f"a policy version named {name!r} exists already")
        if parent is not None and parent != BASE:
            return _get(db, parent).id
    return None


def own_path(engine: Engine, directory: Path) -> Path:
    """*directory*, resolved, if no version has it as its path yet (every version needs its own)."""
    path = directory.resolve()
    with OrmSession(engine) as db:
        owner = db.scalars(select(PolicyVersion.name).where(PolicyVersion.path == str(path))).first()
    if owner is not None:
        raise PublishError(f"{path} is already the path of version {owner!r}; "
                           "every version needs a directory of its own")
    return path


def register(engine: Engine, *, name: str, kind: str, base_model: str, path: Path, parent_id: int | None,
              activate: bool, stats: dict[str, Any] | None, actor: str, reason: str | None,
              metrics: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Insert a published version (``active``, retiring the active one, or ``candidate``) and its
    ``publish`` event in one transaction; returns it and the names it retired."""
    try:
        with OrmSession(engine) as db, db.begin():
            _lock(db)
            parent = db.get(PolicyVersion, parent_id) if parent_id is not None else None
            tainted = bool(parent is not None and parent.tainted)  # it learned what its parent did
            if tainted and activate:
                raise VersionTainted(f"{name!r} was trained from tainted version {parent.name!r} "  # type: ignore[union-attr]
                                     "(it learned from forgotten data): it may not be served")
            retired = _demote_active(db, VersionStatus.RETIRED) if activate else []
            row = PolicyVersion(name=name, base_model=base_model, kind=kind, path=str(path),
                                parent_id=parent_id, status=VersionStatus.ACTIVE if activate else VersionStatus.CANDIDATE,
                                stats=dict(stats or {}), tainted=tainted)
            db.add(row)
            db.flush()
            event(db, row.id, PolicyAction.PUBLISH, actor, reason,
                   {"status": row.status, "retired": retired, **metrics})
            if activate:
                policy_signal.announce(db, name)
            return _dict(db, row), retired
    except IntegrityError as exc:
        raise PublishError(f"could not register {name!r}: {exc.orig}") from exc


def record_event(engine: Engine, action: str, *, version: str | None, actor: str, reason: str | None = None,
                 metrics: dict[str, Any] | None = None) -> None:
    """A decision about version *version* (by name; None: about the base) in a transaction of its own."""
    with OrmSession(engine) as db, db.begin():
        vid = (db.scalars(select(PolicyVersion.id).where(PolicyVersion.name == version)).first()
               if version else None)
        event(db, vid, action, actor, reason, dict(metrics or {}))


def add_event_metrics(engine: Engine, name: str, action: str, metrics: dict[str, Any]) -> None:
    """Merge *metrics* into the newest *action* event of version *name* (numbers known only
    after the decision, such as a promotion's learning latency)."""
    with OrmSession(engine) as db, db.begin():
        event = db.scalars(select(PolicyEvent).join(PolicyVersion, PolicyVersion.id == PolicyEvent.version_id)
                           .where(PolicyVersion.name == name, PolicyEvent.action == action)
                           .order_by(PolicyEvent.id.desc()).limit(1)).first()
        if event is not None:
            event.metrics = {**(event.metrics or {}), **metrics}


def event_actions(engine: Engine, name: str) -> list[str]:
    """The actions recorded for version *name*, oldest first."""
    with OrmSession(engine) as db:
        return list(db.scalars(select(PolicyEvent.action).join(PolicyVersion, PolicyVersion.id ==
                                                               PolicyEvent.version_id)
                               .where(PolicyVersion.name == name).order_by(PolicyEvent.id)))


def refuse_candidate(engine: Engine, name: str) -> None:
    """Mark candidate *name* refused (a candidate only: a version that served keeps its status)."""
    with OrmSession(engine) as db, db.begin():
        db.execute(update(PolicyVersion).where(PolicyVersion.name == name,
                                               PolicyVersion.status == VersionStatus.CANDIDATE)
                   .values(status=VersionStatus.REFUSED))


def versions_of_run(engine: Engine, run_id: str) -> list[PolicyVersion]:
    """The LoRA versions a training run published (``stats.run_id``), detached from the session."""
    with OrmSession(engine) as db:
        rows = db.scalars(select(PolicyVersion).where(PolicyVersion.kind == VersionKind.LORA)).all()
        for r in rows:
            db.expunge(r)
    return [r for r in rows if (r.stats or {}).get("run_id") == run_id]


def active_row(engine: Engine) -> PolicyVersion | None:
    """The active version's row, detached (None: the alias serves the base)."""
    with OrmSession(engine) as db:
        row = active_policy_version(db)
        if row is not None:
            db.expunge(row)
        return row


def active_name(engine: Engine) -> str | None:
    """The name the ``policy`` alias serves (None: the base model)."""
    with OrmSession(engine) as db:
        row = active_policy_version(db)
        return row.name if row else None


def active_and_parent(engine: Engine) -> tuple[str, str | None] | None:
    """``(active version, its parent)`` by name (parent None: the base); None when the alias
    serves the base model."""
    with OrmSession(engine) as db:
        active = active_policy_version(db)
        if active is None:
            return None
        parent = db.get(PolicyVersion, active.parent_id) if active.parent_id is not None else None
        return active.name, parent.name if parent is not None else None


def lineage(engine: Engine) -> list[str]:
    """Names from the active version back through its parents (the base model not included)."""
    chain: list[str] = []
    with OrmSession(engine) as db:
        row = active_policy_version(db)
        while row is not None:
            chain.append(row.name)
            row = db.get(PolicyVersion, row.parent_id) if row.parent_id is not None else None
    return chain




# --------------------------------------------------------------------------------------------
# promote / rollback: the pool's side of a switch of the alias


@dataclass(frozen=True)
class Target:
    """What a promotion or rollback makes the ``policy`` alias serve, as the pool has it."""

    name: str | None  # None: the base model
    kind: str  # a VersionKind: lora, full or base
    path: str | None  # the adapter or checkpoint directory (None for the base)
    base_model: str | None
    #: every full version's checkpoint by name: what a server that holds one is given back if the
    #: switch fails half-way (servers report the weights they hold by version name)
    full_paths: dict[str, str]


@dataclass(frozen=True)
class Switched:
    """What :func:`switch_active` changed."""

    active: dict[str, Any] | None  # the version the alias serves now (None: the base model)
    previous: str | None  # the one it served before (None: the base model)
    demoted: list[str]  # the versions that stopped being active


_AUDIT = {PolicyAction.PROMOTE: AuditAction.PROMOTE, PolicyAction.ROLLBACK: AuditAction.ROLLBACK}
#: what the version switched away from becomes: a rollback marks it never to be chosen again by default
_DEMOTED_TO = {PolicyAction.PROMOTE: VersionStatus.RETIRED, PolicyAction.ROLLBACK: VersionStatus.ROLLED_BACK}


def switch_active(engine: Engine, action: str, to: str | None, serve: Callable[[Target], dict[str, Any]], *,
                  actor: str, reason: str | None, event_metrics: dict[str, Any] | None = None) -> Switched:
    """Make *to* the active version: a promotion (*action* ``promote``; *to* a name or
    :data:`BASE`) or a rollback (``rollback``; *to* None: the newest untainted ``retired``
    version older than the active one, else the base model). Reads the :class:`Target` in one
    short session, calls ``serve(target)`` — which makes every model server serve it and returns
    metrics for the event, or raises to change nothing — then, in one short transaction under
    the status lock, re-reads the target (a version tainted meanwhile is refused), makes it
    ``active``, every other active version ``retired`` (promote) or ``rolled_back`` (rollback),
    and writes the event, the audit row and the gateways' signal.

    Why two short transactions and not one around *serve*: loading an adapter takes seconds and
    reloading full weights minutes, and on SQLite the status lock is the database's write lock —
    held through the load it would stall every capture write of the gateways (past their busy
    timeout). So nothing is held while the servers switch; the record re-checks under the lock
    what can have changed (the target tainted, another switch recorded) and demotes whatever is
    active at that moment, so concurrent switches still leave exactly one version active.

    Raises :class:`VersionNotFound`, :class:`VersionTainted`, or :class:`PublishError` (nothing to
    roll back, the target already active on a rollback, no path), having changed nothing.
    """
    with OrmSession(engine) as db:
        target = _resolve(db, action, to)
    metrics = {**(event_metrics or {}), **serve(target)}
    with OrmSession(engine) as db, db.begin():
        return _record(db, action, target, metrics, actor, reason)


def active_target(engine: Engine) -> Target:
    """The :class:`Target` the alias serves now (kind ``base`` when no version is active)."""
    with OrmSession(engine) as db:
        return _target(db, active_policy_version(db), None)


def full_paths(engine: Engine) -> dict[str, str]:
    """Every full version's checkpoint directory by name (see :attr:`Target.full_paths`)."""
    with OrmSession(engine) as db:
        return _full_paths(db)


def _full_paths(db: OrmSession) -> dict[str, str]:
    rows = db.execute(select(PolicyVersion.name, PolicyVersion.path).where(PolicyVersion.kind == VersionKind.FULL))
    return {name: path for name, path in rows if path}


def _target(db: OrmSession, row: PolicyVersion | None, current: PolicyVersion | None) -> Target:
    if row is None or row.kind == VersionKind.BASE:
        base_model = current.base_model if current is not None else None
        return Target(None, VersionKind.BASE, None, base_model, _full_paths(db))
    return Target(row.name, row.kind, row.path, row.base_model, _full_paths(db))


def _resolve(db: OrmSession, action: str, to: str | None) -> Target:
    """The switch's target, checked: it exists, is not tainted, has its files' path."""
    current = active_policy_version(db)
    row: PolicyVersion | None = None
    if action == PolicyAction.ROLLBACK and to is None:
        if current is None:
            raise PublishError("nothing to roll back: the policy already serves the base model")
        row = db.scalars(
            select(PolicyVersion)
            .where(
                PolicyVersion.status.in_(ROLLBACK_TARGET_STATUSES),
                PolicyVersion.tainted.is_(False),
                PolicyVersion.kind.in_((VersionKind.LORA, VersionKind.FULL)),
                PolicyVersion.created_at < current.created_at,
            )
            .order_by(PolicyVersion.created_at.desc(), PolicyVersion.id.desc())
            .limit(1)
        ).first()
    elif to is not None and to != BASE:
        row = _get(db, to)
    target = _target(db, row, current)
    if target.name is None:
        return target
    if action == PolicyAction.ROLLBACK and current is not None and target.name == current.name:
        raise PublishError(f"{target.name!r} is the active version already")
    if row is not None and row.tainted:
        raise VersionTainted(f"version {target.name!r} is tainted: it learned from forgotten data "
                             "(nextstate forget --taint) and is never served again")
    if not target.path:
        raise PublishError(f"version {target.name!r} has no "
                           f"{'adapter' if target.kind == VersionKind.LORA else 'checkpoint'} path")
    return target


def _record(db: OrmSession, action: str, target: Target, metrics: dict[str, Any], actor: str,
            reason: str | None) -> Switched:
    """The switch in the pool, under the status lock: statuses, event, audit row, signal."""
    _lock(db)
    demoted_to = _DEMOTED_TO[action]
    if target.name is None:
        demoted = _demote_active(db, demoted_to)
        event(db, None, action, actor, reason, {"to": BASE, "from": demoted, **metrics})
        audit.record(db, actor, _AUDIT[action], BASE, {"from": demoted, "reason": reason})
        policy_signal.announce(db, None)
        return Switched(None, demoted[0] if demoted else None, demoted)
    row = _get(db, target.name)
    if row.tainted:  # tainted while the servers were loading it
        raise VersionTainted(f"version {target.name!r} is tainted: it learned from forgotten data")
    previous = row.name if row.status == VersionStatus.ACTIVE else None
    demoted = _demote_active(db, demoted_to, keep_id=row.id)
    row.status = VersionStatus.ACTIVE
    db.flush()
    event(db, row.id, action, actor, reason, {"to": row.name, "from": demoted, **metrics})
    audit.record(db, actor, _AUDIT[action], row.name, {"from": demoted, "reason": reason})
    policy_signal.announce(db, row.name)
    return Switched(_dict(db, row), previous or (demoted[0] if demoted else None), demoted)
