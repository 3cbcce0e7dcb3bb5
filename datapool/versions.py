"""The policy-version registry: which versions exist, which one the ``policy`` alias serves, and
every decision about them (``policy_events``).

The ``policy_versions`` table is the single source of truth the gateways follow (told of every
switch at commit by ``datapool.policy_signal``, and re-read on a slow fallback poll): the
``policy`` alias serves the newest ``active`` non-base row, or the base model when there is none.
The invariant kept here: **a row is only ever made ``active`` after every vLLM in
``vllm_urls`` serves it** — a LoRA adapter listed in ``/v1/models`` under the version's name, or
a full version's weights reloaded in place (``vllm_client``). So no gateway ever points
the alias at a model the server does not have; a request resolved just before a switch finishes
on the version it started on.

Statuses (:class:`base.vocab.VersionStatus`): ``candidate`` (published, not activated),
``active``, ``retired`` (was active, replaced by a promotion or a newer publish),
``rolled_back`` (was active and was rolled back from; never chosen again by a plain
:func:`rollback`), ``refused`` (a candidate the eval gate refused). Apart from its status, a
version may be ``tainted`` (it learned from data that was forgotten, ``datapool.forget``):
:func:`activate` and :func:`rollback` refuse a tainted target, and a plain rollback skips them. :func:`activate` and
:func:`rollback` change no row unless the target is served everywhere; each status change
writes a ``policy_events`` row in the same transaction.

Full versions and names: vLLM keeps serving full weights under its **base served name**, so
while a full version is active "the base model" on those servers *is* that version; the
original base weights come back (reloaded from the server's own ``--model`` directory) when
the policy rolls back to the base or to a LoRA version, because LoRA versions are adapters of
the original base.

All functions are synchronous (SQLAlchemy ``Engine`` + ``httpx.Client``); call them from a
thread in async code. Publishing new versions is the trainer's (``publishing.publish``).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import Engine, false, select, text, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session as OrmSession

from base.errors import AdminError, PublishError, VersionNotFound, VersionTainted, WeightsError
from datapool import audit, policy_signal
from vllm_client.adapters import ensure_loaded
from vllm_client.http import openai_bases
from vllm_client.weights import (
    BASE_LABEL,
    BASE_LABELS,
    base_weights_path,
    check_checkpoint,
    require_weight_labels,
    switch_weights,
    weight_label,
)
from datapool.db import iso
from datapool.models import PolicyEvent, PolicyVersion
from datapool.queries import active_policy_version
from base.vocab import AuditAction, PauseMode, PolicyAction, VersionKind, VersionStatus

log = logging.getLogger("nextstate.publish")

#: ``rollback(to=BASE)`` / ``activate(name=BASE)``: serve the base model (no active LoRA version).
BASE = "base"
#: Names a version may not take: the gateway alias and the base keyword.
RESERVED_NAMES = frozenset({BASE, "policy"})
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
#: Statuses a plain :func:`rollback` may return to: versions that served before and were
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
# which weights each server holds (full versions; see vllm_client.weights)


def _path_of(engine: Engine) -> Any:
    """``path_of(http, url, label)``: the checkpoint of the full version named *label* (None:
    the base, or no such full version)."""
    def path_of(_http: httpx.Client, _url: str, label: str | None) -> str | None:
        if label is None or label in BASE_LABELS:
            return None
        with OrmSession(engine) as db:
            row = db.scalars(select(PolicyVersion).where(PolicyVersion.name == label)).first()
        return row.path if row is not None and row.kind == VersionKind.FULL else None
    return path_of


def _base_target(http: httpx.Client, url: str) -> tuple[str, str] | None:
    """Servers holding a full version's weights go back to their base; others stay as they are
    (one without dev mode can only hold its base)."""
    try:
        label = weight_label(http, url)
    except httpx.TransportError as exc:
        # down: when it comes back it holds its base weights (a restart forgets a reload)
        log.warning("%s did not answer (%s); it will hold its base weights when it is back", url, exc)
        return None
    if label is None or label in BASE_LABELS:
        return None
    return BASE_LABEL, base_weights_path(http, url)


def _full_target(name: str, path: str) -> Any:
    def target(http: httpx.Client, url: str) -> tuple[str, str] | None:
        label = require_weight_labels(http, url)
        return None if label == name else (name, path)
    return target


def serve(engine: Engine, kind: str, name: str | None, path: str | None, base_model: str | None,
           urls: Sequence[str], *, pause_mode: str, timeout_s: float) -> dict[str, Any]:
    """Make every server serve version *name* of *kind* (``base``: the base model): a full
    version's weights reloaded in place; for a LoRA version or the base, the original base
    weights (reloaded where a full version held the server) and then the adapter. All servers
    or none: a failure puts back the weights each held. Returns metrics for the event row."""
    metrics: dict[str, Any] = {}
    try:
        if kind == VersionKind.FULL:
            assert name is not None and path is not None
            reloads = switch_weights(
                urls, _full_target(name, path), path_of=_path_of(engine), pause_mode=pause_mode,
                served_name=base_model, timeout_s=timeout_s)
        else:
            def load_adapter() -> None:
                if kind == VersionKind.LORA:
                    assert name is not None and path is not None
                    report = ensure_loaded(name, path, urls, base_model=base_model, timeout_s=timeout_s)
                    metrics["lora_load_s"] = report.seconds
            reloads = switch_weights(
                urls, _base_target, path_of=_path_of(engine), pause_mode=pause_mode,
                served_name=base_model, timeout_s=timeout_s, then=load_adapter)
    except AdminError as exc:
        raise PublishError(str(exc)) from exc
    except httpx.HTTPError as exc:
        raise PublishError(f"vLLM did not answer while switching weights: {type(exc).__name__}: {exc}") from exc
    if reloads:
        metrics["reloads"] = [vars(r) for r in reloads]
    return metrics


def serve_pool_state(engine: Engine, urls: Sequence[str], *, pause_mode: str, timeout_s: float) -> None:
    """Best effort, after a failed registration: make the servers hold what the pool says is active."""
    with OrmSession(engine) as db:
        row = active_policy_version(db)
        kind, name, path, base = (row.kind, row.name, row.path, row.base_model) if row else ("base", None, None, None)
    if kind == VersionKind.LORA:
        kind = "base"  # its adapter is still loaded; only the weights under it may have changed
    try:
        serve(engine, kind, name, path, base, urls, pause_mode=pause_mode, timeout_s=timeout_s)
    except PublishError as exc:
        log.error("could not put back the active version's weights: %s", exc)


# --------------------------------------------------------------------------------------------
# promote / rollback


_AUDIT = {PolicyAction.PROMOTE: AuditAction.PROMOTE, PolicyAction.ROLLBACK: AuditAction.ROLLBACK}


def _switch_to(engine: Engine, target: str | None, vllm_urls: Sequence[str], *, demoted_status: str,
               timeout_s: float, action: str, actor: str, reason: str | None,
               pause_mode: str = PauseMode.WAIT, event_metrics: dict[str, Any] | None = None
               ) -> tuple[dict[str, Any] | None, list[str]]:
    """Make *target* (a version name; None: the base model) the active version; every other
    active version gets *demoted_status*. Makes every server serve it first."""
    urls = openai_bases(vllm_urls)
    kind, path, base_model = "base", None, None
    with OrmSession(engine) as db:
        if target is not None:
            row = _get(db, target)
            if row.tainted:
                raise VersionTainted(f"version {target!r} is tainted: it learned from forgotten data "
                                     "(nextstate forget --taint) and is never served again")
            kind, path, base_model = row.kind, row.path, row.base_model
            if kind in (VersionKind.LORA, VersionKind.FULL) and not path:
                raise PublishError(f"version {target!r} has no {'adapter' if kind == 'lora' else 'checkpoint'} path")
        else:
            current = active_policy_version(db)
            base_model = current.base_model if current is not None else None
    if kind == VersionKind.FULL:
        assert path is not None
        try:
            check_checkpoint(Path(path))
        except WeightsError as exc:
            raise PublishError(f"version {target!r}: {exc}") from exc
    metrics = serve(engine, kind if kind in (VersionKind.LORA, VersionKind.FULL) else VersionKind.BASE, target, path, base_model, urls,
                     pause_mode=pause_mode, timeout_s=timeout_s)
    metrics = {**(event_metrics or {}), **metrics}
    with OrmSession(engine) as db, db.begin():
        _lock(db)
        if target is None or kind == VersionKind.BASE:
            demoted = _demote_active(db, demoted_status)
            event(db, None, action, actor, reason, {"to": BASE, "from": demoted, **metrics})
            audit.record(db, actor, _AUDIT[action], BASE, {"from": demoted, "reason": reason})
            policy_signal.announce(db, None)
            return None, demoted
        row = _get(db, target)
        if row.tainted:  # tainted while vLLM was loading it
            raise VersionTainted(f"version {target!r} is tainted: it learned from forgotten data")
        demoted = _demote_active(db, demoted_status, keep_id=row.id)
        row.status = VersionStatus.ACTIVE
        db.flush()
        event(db, row.id, action, actor, reason, {"to": row.name, "from": demoted, **metrics})
        audit.record(db, actor, _AUDIT[action], row.name, {"from": demoted, "reason": reason})
        policy_signal.announce(db, row.name)
        return _dict(db, row), demoted


def activate(engine: Engine, name: str, vllm_urls: Sequence[str], *, timeout_s: float = 120.0,
             pause_mode: str = PauseMode.WAIT, actor: str = "admin", reason: str | None = None,
             event_metrics: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """Promote version *name*: make every server of *vllm_urls* serve it (a LoRA adapter is
    loaded where it is missing — after a vLLM restart none is; a full version's weights are
    reloaded where the server holds others), then make it ``active`` and the previously active
    one ``retired``, in one transaction, with a ``promote`` event.

    Idempotent: promoting the active version just makes sure every server serves it (run it
    after restarting vLLM). ``name="base"`` (or a ``kind="base"`` row) makes the alias serve
    the base model. Returns the now active version (None for the base). Raises
    :class:`VersionNotFound` / :class:`PublishError`, changing nothing.
    """
    kw = dict(demoted_status=VersionStatus.RETIRED, timeout_s=timeout_s, action=PolicyAction.PROMOTE, actor=actor, reason=reason,
              pause_mode=pause_mode, event_metrics=event_metrics)
    if name == BASE:
        return _switch_to(engine, None, vllm_urls, **kw)[0]  # type: ignore[arg-type]
    with OrmSession(engine) as db:
        is_base = _get(db, name).kind == VersionKind.BASE
    if is_base:
        return _switch_to(engine, None, vllm_urls, **kw)[0]  # type: ignore[arg-type]
    active, demoted = _switch_to(engine, name, vllm_urls, **kw)  # type: ignore[arg-type]
    log.info("activated %s%s", name, f", retired {demoted}" if demoted else "")
    return active


def rollback(engine: Engine, vllm_urls: Sequence[str], to: str | None = None, *,
             timeout_s: float = 120.0, pause_mode: str = PauseMode.WAIT, actor: str = "admin",
             reason: str | None = None, event_metrics: dict[str, Any] | None = None) -> dict[str, Any]:
    """Roll the policy back from the active version.

    *to* None: to the newest ``retired`` version (LoRA or full) created before the active one,
    or to the base model if there is none. *to* a name: to that version. *to* ``"base"``: to
    the base model (no active version; the alias serves the base, and servers that held a full
    version's weights get their base weights back). The target is made to serve everywhere
    first (as in :func:`activate`); the version rolled back from becomes ``rolled_back``
    (never a default rollback target again). A ``rollback`` event records it.

    Returns ``{"active": version dict or None (base), "rolled_back": [names]}``. Raises
    :class:`PublishError` when there is nothing to roll back from (``to`` None and the alias
    already serves the base) or the target cannot be served; nothing changes then.
    """
    with OrmSession(engine) as db:
        current = active_policy_version(db)
        target: str | None
        if to is None:
            if current is None:
                raise PublishError("nothing to roll back: the policy already serves the base model")
            prev = db.scalars(
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
            target = prev.name if prev else None
        elif to == BASE:
            target = None
        else:
            row = _get(db, to)
            target = None if row.kind == VersionKind.BASE else row.name
        if current is not None and target == current.name:
            raise PublishError(f"{target!r} is the active version already")
    active, demoted = _switch_to(engine, target, vllm_urls, demoted_status=VersionStatus.ROLLED_BACK,
                                 timeout_s=timeout_s, action=PolicyAction.ROLLBACK, actor=actor, reason=reason,
                                 pause_mode=pause_mode, event_metrics=event_metrics)
    log.info("rolled back %s; now serving %s", demoted, target or "the base model")
    return {"active": active, "rolled_back": demoted}
