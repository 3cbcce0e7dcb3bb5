"""Weights back to serving: publish, promote and roll back policy versions.

A policy version is a LoRA adapter directory at a path of its own (never reused, never
rewritten), loaded into every vLLM server that serves the policy — the replica serving live
traffic *and* the teacher replica, so teacher logprobs of turns served by that version can be
computed under it. The ``policy_versions`` table is the single source of truth the gateways
follow (``gateway.app._active_version``, re-read every 2 s): the ``policy`` alias serves the
newest ``active`` non-base row, or the base model when there is none.

The invariant this module keeps: **a row is only ever made ``active`` after every vLLM in
``vllm_urls`` lists the adapter under the version's name in its ``/v1/models``** (with the
version's path as its ``root``). So no gateway ever points the alias at a model the server does
not have; a request resolved just before a switch finishes on the version it started on.

Statuses: ``candidate`` (published, not activated), ``active``, ``retired`` (was active, was
replaced by a promotion or a newer publish), ``rolled_back`` (was active and was rolled back
from; never chosen again by a plain :func:`rollback`).

Failures. :func:`publish_adapter` registers **nothing** when loading fails anywhere: it
unloads the adapter from the servers that did load it, deletes the copy it made, and raises
:class:`PublishError` naming each server's error. A failed publish leaves no row (so the name
can be reused once the adapter is fixed) and the alias untouched; the trainer's own run record
is the place for its history. :func:`activate` and :func:`rollback` likewise change no row
unless the target is loaded everywhere.

Paths. vLLM reads ``lora_path`` from its own filesystem: with servers on other hosts, the
version store (``store``) must be on a filesystem they share, at the same path.

All functions are synchronous (SQLAlchemy ``Engine`` + ``httpx.Client``); call them from a
thread in async code.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import shutil
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import Engine, select, text, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session as OrmSession

from datapool.models import PolicyVersion
from datapool.queries import active_policy_version

log = logging.getLogger("nextstate.publish")

#: ``rollback(to=BASE)`` / ``activate(name=BASE)``: serve the base model (no active LoRA version).
BASE = "base"
#: Names a version may not take: the gateway alias and the base keyword.
RESERVED_NAMES = frozenset({BASE, "policy"})
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
#: Statuses a plain :func:`rollback` may return to: versions that served before and were
#: replaced, not ones found bad (``rolled_back``) nor never served (``candidate``).
ROLLBACK_TARGET_STATUSES = ("retired",)
# an arbitrary constant: PostgreSQL advisory lock that serialises status changes across processes
_PG_LOCK_KEY = 0x6E657874  # "next"


class PublishError(RuntimeError):
    """A version could not be published, promoted or rolled back; nothing in the pool changed."""


class VersionNotFound(PublishError, LookupError):
    """No policy version of that name."""


@dataclass
class LoadReport:
    """What :func:`ensure_loaded` did, per server (base URL ``…/v1``)."""

    loaded: list[str] = field(default_factory=list)  # servers this call loaded it into
    already: list[str] = field(default_factory=list)  # servers that had it (same path) already
    seconds: dict[str, float] = field(default_factory=dict)  # load_lora_adapter latency per server
    errors: dict[str, str] = field(default_factory=dict)  # server -> why it failed


# --------------------------------------------------------------------------------------------
# vLLM side


def normalize_vllm_url(url: str) -> str:
    """The OpenAI base of a vLLM server: ``http://host:port/v1`` (``/v1`` appended if missing)."""
    url = url.strip().rstrip("/")
    return url if url.endswith("/v1") else f"{url}/v1"


def _error_text(resp: httpx.Response) -> str:
    try:
        body = resp.json()
        if isinstance(body, dict):
            err = body.get("error", body)
            msg = err.get("message") if isinstance(err, dict) else None
            if msg:
                return f"HTTP {resp.status_code}: {msg}"
    except ValueError:
        pass
    return f"HTTP {resp.status_code}: {resp.text[:500]}"


def served_models(http: httpx.Client, url: str) -> dict[str, dict[str, Any]]:
    """``/v1/models`` of one vLLM server as ``{id: card}`` (a LoRA card's ``root`` is its path)."""
    resp = http.get(f"{url}/models")
    if resp.status_code != 200:
        raise PublishError(f"{url}: GET /models failed: {_error_text(resp)}")
    try:
        return {m["id"]: m for m in resp.json()["data"]}
    except (KeyError, TypeError, ValueError) as exc:
        raise PublishError(f"{url}: GET /models returned an unexpected body: {resp.text[:200]}") from exc


def _same_path(a: str | None, b: str) -> bool:
    return a is not None and Path(a).resolve() == Path(b).resolve()


def _load_one(http: httpx.Client, url: str, name: str, path: str, base_model: str | None,
              report: LoadReport) -> None:
    models = served_models(http, url)
    if base_model is not None and base_model not in models:
        raise PublishError(f"{url} does not serve the base model {base_model!r} "
                           f"(it serves {sorted(models)})")
    card = models.get(name)
    if card is not None:
        if _same_path(card.get("root"), path):
            report.already.append(url)
            return
        raise PublishError(
            f"{url} already serves a different adapter as {name!r} (path {card.get('root')!r}, "
            f"expected {path!r}); unload it (POST {url}/unload_lora_adapter) or use another name"
        )
    start = time.perf_counter()
    resp = http.post(f"{url}/load_lora_adapter", json={"lora_name": name, "lora_path": path})
    elapsed = time.perf_counter() - start
    if resp.status_code != 200:
        raise PublishError(f"{url}: load_lora_adapter failed: {_error_text(resp)}")
    report.loaded.append(url)
    report.seconds[url] = elapsed
    card = served_models(http, url).get(name)
    if card is None or not _same_path(card.get("root"), path):
        raise PublishError(f"{url}: load_lora_adapter said ok but /models does not list {name!r} "
                           f"at {path!r}")
    log.info("loaded %s (%s) into %s in %.3fs", name, path, url, elapsed)


def unload(http: httpx.Client, urls: Iterable[str], name: str) -> dict[str, str]:
    """Unload adapter *name* from each server; returns ``{url: error}`` for those that failed
    (a server that does not have it is not an error)."""
    errors: dict[str, str] = {}
    for url in urls:
        try:
            resp = http.post(f"{url}/unload_lora_adapter", json={"lora_name": name})
            if resp.status_code not in (200, 404):
                errors[url] = _error_text(resp)
        except httpx.HTTPError as exc:
            errors[url] = f"{type(exc).__name__}: {exc}"
    for url, err in errors.items():
        log.warning("could not unload %s from %s: %s", name, url, err)
    return errors


def ensure_loaded(name: str, path: str | Path, vllm_urls: Sequence[str], *,
                  base_model: str | None = None, timeout_s: float = 120.0,
                  rollback_on_error: bool = True) -> LoadReport:
    """Make every server in *vllm_urls* serve the adapter at *path* as model *name*.

    A server that already lists *name* with *path* as its root is left alone; one that lists
    *name* with another path is an error (something else owns that name). After each load the
    server's ``/v1/models`` must list it. With *base_model*, each server must serve that base.

    On any failure, and with *rollback_on_error*, the adapter is unloaded again from the
    servers this call loaded it into (not from those that had it before), then
    :class:`PublishError` is raised with every server's error.
    """
    path = str(Path(path).resolve())
    if not Path(path, ADAPTER_CONFIG).is_file():
        raise PublishError(f"adapter of {name!r} is gone from disk: no {ADAPTER_CONFIG} in {path}")
    urls = list(dict.fromkeys(normalize_vllm_url(u) for u in vllm_urls))
    if not urls:
        raise PublishError("no vLLM server given (vllm_urls is empty)")
    report = LoadReport()
    with httpx.Client(timeout=httpx.Timeout(timeout_s, connect=5.0)) as http:
        for url in urls:
            try:
                _load_one(http, url, name, path, base_model, report)
            except PublishError as exc:
                report.errors[url] = str(exc)
            except httpx.HTTPError as exc:
                report.errors[url] = f"{url}: {type(exc).__name__}: {exc}"
        if report.errors and rollback_on_error and report.loaded:
            unload(http, report.loaded, name)
    if report.errors:
        detail = "; ".join(report.errors.values())
        undone = f" (unloaded again from {', '.join(report.loaded)})" if rollback_on_error and report.loaded else ""
        raise PublishError(f"could not load {name!r} from {path} into every vLLM: {detail}{undone}")
    return report


# --------------------------------------------------------------------------------------------
# the pool side


def version_dict(row: PolicyVersion, parent_name: str | None = None) -> dict[str, Any]:
    """A ``PolicyVersion`` as plain JSON-able data."""
    created = row.created_at
    if created is not None and created.tzinfo is None:  # SQLite drops the zone; we write UTC
        created = created.replace(tzinfo=timezone.utc)
    return {
        "id": row.id,
        "name": row.name,
        "base_model": row.base_model,
        "kind": row.kind,
        "path": row.path,
        "parent_id": row.parent_id,
        "parent": parent_name,
        "status": row.status,
        "created_at": created.isoformat() if created else None,
        "stats": dict(row.stats or {}),
    }


def _dict(db: OrmSession, row: PolicyVersion) -> dict[str, Any]:
    parent = db.get(PolicyVersion, row.parent_id) if row.parent_id is not None else None
    return version_dict(row, parent.name if parent else None)


def _lock(db: OrmSession) -> None:
    """Serialise status changes: an advisory transaction lock on PostgreSQL. SQLite allows one
    writer at a time already, and the retiring UPDATE below is a single statement."""
    if db.get_bind().dialect.name == "postgresql":
        db.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _PG_LOCK_KEY})


def _get(db: OrmSession, name: str) -> PolicyVersion:
    row = db.scalars(select(PolicyVersion).where(PolicyVersion.name == name)).first()
    if row is None:
        raise VersionNotFound(f"no policy version named {name!r}")
    return row


def _current(db: OrmSession) -> PolicyVersion | None:
    """The version the gateway serves."""
    return active_policy_version(db)


def _demote_active(db: OrmSession, status: str, *, keep_id: int | None = None) -> list[str]:
    """Give every ``active`` row (but *keep_id*) *status*; returns their names."""
    cond = [PolicyVersion.status == "active"]
    if keep_id is not None:
        cond.append(PolicyVersion.id != keep_id)
    names = list(db.scalars(select(PolicyVersion.name).where(*cond)))
    if names:
        db.execute(update(PolicyVersion).where(*cond).values(status=status))
    return names


def list_versions(engine: Engine) -> list[dict[str, Any]]:
    """Every policy version, oldest first, as :func:`version_dict` dicts."""
    with OrmSession(engine) as db:
        rows = list(db.scalars(select(PolicyVersion).order_by(PolicyVersion.created_at, PolicyVersion.id)))
        names = {r.id: r.name for r in rows}
        return [version_dict(r, names.get(r.parent_id) if r.parent_id is not None else None) for r in rows]


def active_version(engine: Engine) -> dict[str, Any] | None:
    """The version the ``policy`` alias serves, or None when it serves the base model."""
    with OrmSession(engine) as db:
        row = _current(db)
        return _dict(db, row) if row else None


def get_version(engine: Engine, name: str) -> dict[str, Any]:
    """One version by name; :class:`VersionNotFound` if there is none."""
    with OrmSession(engine) as db:
        return _dict(db, _get(db, name))


# --------------------------------------------------------------------------------------------
# publish / activate / rollback


def _check_adapter(adapter_dir: Path) -> dict[str, Any]:
    if not adapter_dir.is_dir():
        raise PublishError(f"adapter directory {adapter_dir} does not exist")
    cfg_path = adapter_dir / ADAPTER_CONFIG
    try:
        cfg = json.loads(cfg_path.read_text())
    except FileNotFoundError as exc:
        raise PublishError(f"{adapter_dir} is not a PEFT adapter: no {ADAPTER_CONFIG}") from exc
    except (OSError, ValueError) as exc:
        raise PublishError(f"{cfg_path} is unreadable: {exc}") from exc
    if not isinstance(cfg, dict):
        raise PublishError(f"{cfg_path} is not a JSON object")
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise PublishError(f"{adapter_dir}: peft_type {cfg.get('peft_type')!r} is not LORA")
    if not any((adapter_dir / w).is_file() for w in ADAPTER_WEIGHTS):
        raise PublishError(f"{adapter_dir} has no adapter weights ({' or '.join(ADAPTER_WEIGHTS)})")
    return cfg


def _check_name(name: str, base_model: str) -> None:
    if not NAME_RE.match(name):
        raise PublishError(f"invalid version name {name!r}: use letters, digits, '.', '_', '-' "
                           "(at most 128, starting with a letter or digit)")
    if name in RESERVED_NAMES or name == base_model:
        raise PublishError(f"version name {name!r} is reserved")


def default_name() -> str:
    """A fresh version name: ``lora-<UTC timestamp>-<random>``; unique across pools sharing a
    vLLM, which keeps every adapter ever loaded under its name until restarted."""
    return f"lora-{datetime.now(timezone.utc):%Y%m%dT%H%M%S}-{secrets.token_hex(3)}"


def default_store() -> Path:
    """Where published adapters are kept by default: ``<data dir>/policies``."""
    from nextstate.settings import Settings

    return Settings().data_dir / "policies"


def _place(adapter_dir: Path, store: Path, name: str) -> Path:
    """Copy *adapter_dir* to a fresh directory under *store* (atomically, via a temp dir)."""
    store.mkdir(parents=True, exist_ok=True)
    dest = store / name
    if dest.exists():
        dest = store / f"{name}-{secrets.token_hex(4)}"
    tmp = store / f".tmp-{dest.name}"
    shutil.copytree(adapter_dir, tmp)
    tmp.rename(dest)
    return dest.resolve()


def publish_adapter(
    engine: Engine,
    adapter_dir: Path,
    *,
    name: str | None = None,
    base_model: str,
    vllm_urls: Sequence[str],
    parent: str | None = None,
    stats: dict[str, Any] | None = None,
    activate: bool = True,
    copy: bool = True,
    store: Path | None = None,
    timeout_s: float = 120.0,
) -> dict[str, Any]:
    """Publish the PEFT LoRA adapter in *adapter_dir* as a new policy version.

    1. Checks the directory (``adapter_config.json`` of a LoRA, adapter weights) and the name
       (*name*, default :func:`default_name`; unique in the pool, not ``base``/``policy``/the
       base model's name).
    2. With *copy* (the default) copies it to a new directory under *store* (default
       ``<data dir>/policies/<name>``), so later writes to *adapter_dir* never change a served
       version; without it the version keeps *adapter_dir* itself, which no other version may
       use.
    3. Loads it into every server of *vllm_urls* (``…/v1``; the policy server and the teacher
       replica) under *name* and checks each lists it in ``/v1/models`` — each must also serve
       *base_model*.
    4. Only then, in one transaction, inserts the row (kind ``lora``, *parent*'s id, *stats*) as
       ``active`` (every previously active version becomes ``retired``) or, without *activate*,
       as ``candidate``.

    Returns the new version as :func:`version_dict`. Raises :class:`PublishError` if any step
    fails, having unloaded it from the servers it was loaded into and removed the copy:
    nothing is registered and the ``policy`` alias is unchanged.
    """
    adapter_dir = Path(adapter_dir)
    name = name or default_name()
    _check_name(name, base_model)
    _check_adapter(adapter_dir)
    with OrmSession(engine) as db:
        if db.scalars(select(PolicyVersion.id).where(PolicyVersion.name == name)).first() is not None:
            raise PublishError(f"a policy version named {name!r} exists already")
        parent_id: int | None = None
        if parent is not None and parent != BASE:
            parent_id = _get(db, parent).id
    if copy:
        path = _place(adapter_dir, store or default_store(), name)
    else:
        path = adapter_dir.resolve()
        with OrmSession(engine) as db:
            owner = db.scalars(select(PolicyVersion.name).where(PolicyVersion.path == str(path))).first()
        if owner is not None:
            raise PublishError(f"{path} is already the path of version {owner!r}; "
                               "every version needs a directory of its own")
    try:
        report = ensure_loaded(name, path, vllm_urls, base_model=base_model, timeout_s=timeout_s)
    except BaseException:
        if copy:
            shutil.rmtree(path, ignore_errors=True)
        raise
    try:
        with OrmSession(engine) as db, db.begin():
            _lock(db)
            retired = _demote_active(db, "retired") if activate else []
            row = PolicyVersion(
                name=name,
                base_model=base_model,
                kind="lora",
                path=str(path),
                parent_id=parent_id,
                status="active" if activate else "candidate",
                stats=dict(stats or {}),
            )
            db.add(row)
            db.flush()
            result = _dict(db, row)
    except BaseException as exc:
        with httpx.Client(timeout=httpx.Timeout(timeout_s, connect=5.0)) as http:
            unload(http, report.loaded, name)
        if copy:
            shutil.rmtree(path, ignore_errors=True)
        if isinstance(exc, IntegrityError):
            raise PublishError(f"could not register {name!r}: {exc.orig}") from exc
        raise
    log.info("published %s (%s) as %s%s; load times %s", name, path, result["status"],
             f", retired {retired}" if retired else "", report.seconds)
    return result


def _switch_to(engine: Engine, target: str | None, vllm_urls: Sequence[str], *, demoted_status: str,
               timeout_s: float) -> tuple[dict[str, Any] | None, list[str]]:
    """Make *target* (a version name; None: the base model) the active version; every other
    active version gets *demoted_status*. Loads *target* everywhere first."""
    if target is not None:
        with OrmSession(engine) as db:
            row = _get(db, target)
            kind, path, base_model = row.kind, row.path, row.base_model
        if kind == "lora":
            if not path:
                raise PublishError(f"version {target!r} has no adapter path")
            ensure_loaded(target, path, vllm_urls, base_model=base_model, timeout_s=timeout_s)
        elif kind == "full":
            raise PublishError(f"version {target!r} is a full checkpoint: activating full weights "
                               "is not supported by trainer.publish yet")
    with OrmSession(engine) as db, db.begin():
        _lock(db)
        if target is None:
            demoted = _demote_active(db, demoted_status)
            return None, demoted
        row = _get(db, target)
        demoted = _demote_active(db, demoted_status, keep_id=row.id)
        row.status = "active"
        db.flush()
        return _dict(db, row), demoted


def activate(engine: Engine, name: str, vllm_urls: Sequence[str], *, timeout_s: float = 120.0
             ) -> dict[str, Any] | None:
    """Promote version *name*: load it into every server of *vllm_urls* where it is missing
    (after a vLLM restart no adapter is loaded; it is reloaded from its path), then make it
    ``active`` and the previously active one ``retired``, in one transaction.

    Idempotent: promoting the active version just makes sure every server has it loaded (run
    it after restarting vLLM). ``name="base"`` (or a ``kind="base"`` row) makes the alias serve
    the base model. Returns the now active version (None for the base). Raises
    :class:`VersionNotFound` / :class:`PublishError`, changing nothing.
    """
    if name == BASE:
        return _switch_to(engine, None, vllm_urls, demoted_status="retired", timeout_s=timeout_s)[0]
    with OrmSession(engine) as db:
        is_base = _get(db, name).kind == "base"
    if is_base:
        return _switch_to(engine, None, vllm_urls, demoted_status="retired", timeout_s=timeout_s)[0]
    active, demoted = _switch_to(engine, name, vllm_urls, demoted_status="retired", timeout_s=timeout_s)
    log.info("activated %s%s", name, f", retired {demoted}" if demoted else "")
    return active


def rollback(engine: Engine, vllm_urls: Sequence[str], to: str | None = None, *,
             timeout_s: float = 120.0) -> dict[str, Any]:
    """Roll the policy back from the active version.

    *to* None: to the newest ``retired`` LoRA version created before the active one, or to the
    base model if there is none. *to* a name: to that version. *to* ``"base"``: to the base
    model (no active LoRA version; the alias serves the base). The target is loaded into every
    server first (as in :func:`activate`); the version rolled back from becomes
    ``rolled_back`` (never a default rollback target again).

    Returns ``{"active": version dict or None (base), "rolled_back": [names]}``. Raises
    :class:`PublishError` when there is nothing to roll back from (``to`` None and the alias
    already serves the base) or the target cannot be loaded; nothing changes then.
    """
    with OrmSession(engine) as db:
        current = _current(db)
        target: str | None
        if to is None:
            if current is None:
                raise PublishError("nothing to roll back: the policy already serves the base model")
            prev = db.scalars(
                select(PolicyVersion)
                .where(
                    PolicyVersion.status.in_(ROLLBACK_TARGET_STATUSES),
                    PolicyVersion.kind == "lora",
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
            target = None if row.kind == "base" else row.name
        if current is not None and target == current.name:
            raise PublishError(f"{target!r} is the active version already")
    active, demoted = _switch_to(engine, target, vllm_urls, demoted_status="rolled_back",
                                 timeout_s=timeout_s)
    log.info("rolled back %s; now serving %s", demoted, target or "the base model")
    return {"active": active, "rolled_back": demoted}
