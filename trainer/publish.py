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

Full weights (kind ``full``). A fully fine-tuned checkpoint cannot be served *beside* the
base: vLLM holds one set of base weights per server. :func:`publish_full` copies the checkpoint
to the store and, on every server in ``vllm_urls``, pauses generation, reloads the weights from
it in place (``reload_weights``) and resumes (see :mod:`trainer.full_weights`; the servers need
``VLLM_SERVER_DEV_MODE=1``). Only after every server confirms (its ``/weight_info`` names the
version, a completion answers) is the row made ``active``. How full versions relate to names:
vLLM keeps serving the weights under its **base served name** (``smollm2``), so the gateway
sends ``policy`` requests for a full version upstream as the base name and records the version
name as the turn's ``policy_version``; a request that names the base model directly is served
by the loaded full weights as well, and is recorded under the full version too. So while a
full version is active, "the base model" on those servers *is* that version; the original base
weights come back (reloaded from the server's own ``--model`` directory) when the policy rolls
back to the base or to a LoRA version, because LoRA versions are adapters of the original base.
Requests in flight during a reload: with ``pause_mode="wait"`` (the default) they finish on the
old weights before the reload starts, while new ones queue; with ``"keep"`` they are frozen and
continue on the new weights (shorter pause, mixed versions within one reply). Requests that
resolved the alias in the ~2 s before the gateways see the new row are recorded under the
previous version but served by the new weights.

Every publish, promotion and rollback also writes a ``policy_events`` row (action, actor,
reason, timings) in the same transaction as the status change.

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

from datapool.models import PolicyEvent, PolicyVersion
from datapool.queries import active_policy_version
from trainer import full_weights
from trainer.full_weights import PauseMode, WeightsError

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


def normalize_vllm_urls(urls: Sequence[str]) -> list[str]:
    """:func:`normalize_vllm_url` of each, duplicates dropped, order kept."""
    return list(dict.fromkeys(normalize_vllm_url(u) for u in urls))


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
    urls = normalize_vllm_urls(vllm_urls)
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


def default_name(kind: str = "lora") -> str:
    """A fresh version name: ``<kind>-<UTC timestamp>-<random>``; unique across pools sharing a
    vLLM, which keeps every adapter ever loaded under its name until restarted."""
    return f"{kind}-{datetime.now(timezone.utc):%Y%m%dT%H%M%S}-{secrets.token_hex(3)}"


def default_store() -> Path:
    """Where published versions are kept by default: ``<data dir>/policies``."""
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


def _event(db: OrmSession, version_id: int | None, action: str, actor: str, reason: str | None,
           metrics: dict[str, Any]) -> None:
    db.add(PolicyEvent(version_id=version_id, action=action, actor=actor, reason=reason, metrics=metrics))


# --------------------------------------------------------------------------------------------
# which weights each server holds (full versions; see trainer.full_weights)


def _path_of(engine: Engine) -> Any:
    """``path_of(http, url, label)``: the checkpoint of the full version named *label* (None:
    the base, or no such full version)."""
    def path_of(_http: httpx.Client, _url: str, label: str | None) -> str | None:
        if label is None or label in full_weights.BASE_LABELS:
            return None
        with OrmSession(engine) as db:
            row = db.scalars(select(PolicyVersion).where(PolicyVersion.name == label)).first()
        return row.path if row is not None and row.kind == "full" else None
    return path_of


def _base_target(http: httpx.Client, url: str) -> tuple[str, str] | None:
    """Servers holding a full version's weights go back to their base; others stay as they are
    (one without dev mode can only hold its base)."""
    try:
        label = full_weights.weight_label(http, url)
    except httpx.TransportError as exc:
        # down: when it comes back it holds its base weights (a restart forgets a reload)
        log.warning("%s did not answer (%s); it will hold its base weights when it is back", url, exc)
        return None
    if label is None or label in full_weights.BASE_LABELS:
        return None
    return full_weights.BASE_LABEL, full_weights.base_weights_path(http, url)


def _full_target(name: str, path: str) -> Any:
    def target(http: httpx.Client, url: str) -> tuple[str, str] | None:
        label = full_weights.weight_label(http, url)
        if label is None:
            raise full_weights.DevModeMissing(
                f"{url} has no development endpoints: full weights can only be published to a vLLM "
                "started with VLLM_SERVER_DEV_MODE=1 (`nextstate vllm serve --dev-mode`)")
        return None if label == name else (name, path)
    return target


def _serve(engine: Engine, kind: str, name: str | None, path: str | None, base_model: str | None,
           urls: Sequence[str], *, pause_mode: PauseMode, timeout_s: float) -> dict[str, Any]:
    """Make every server serve version *name* of *kind* (``base``: the base model): a full
    version's weights reloaded in place; for a LoRA version or the base, the original base
    weights (reloaded where a full version held the server) and then the adapter. All servers
    or none: a failure puts back the weights each held. Returns metrics for the event row."""
    metrics: dict[str, Any] = {}
    try:
        if kind == "full":
            assert name is not None and path is not None
            reloads = full_weights.switch_weights(
                urls, _full_target(name, path), path_of=_path_of(engine), pause_mode=pause_mode,
                served_name=base_model, timeout_s=timeout_s)
        else:
            def load_adapter() -> None:
                if kind == "lora":
                    assert name is not None and path is not None
                    report = ensure_loaded(name, path, urls, base_model=base_model, timeout_s=timeout_s)
                    metrics["lora_load_s"] = report.seconds
            reloads = full_weights.switch_weights(
                urls, _base_target, path_of=_path_of(engine), pause_mode=pause_mode,
                served_name=base_model, timeout_s=timeout_s, then=load_adapter)
    except WeightsError as exc:
        raise PublishError(str(exc)) from exc
    except httpx.HTTPError as exc:
        raise PublishError(f"vLLM did not answer while switching weights: {type(exc).__name__}: {exc}") from exc
    if reloads:
        metrics["reloads"] = [vars(r) for r in reloads]
    return metrics


def _serve_pool_state(engine: Engine, urls: Sequence[str], *, pause_mode: PauseMode, timeout_s: float) -> None:
    """Best effort, after a failed registration: make the servers hold what the pool says is active."""
    with OrmSession(engine) as db:
        row = _current(db)
        kind, name, path, base = (row.kind, row.name, row.path, row.base_model) if row else ("base", None, None, None)
    if kind == "lora":
        kind = "base"  # its adapter is still loaded; only the weights under it may have changed
    try:
        _serve(engine, kind, name, path, base, urls, pause_mode=pause_mode, timeout_s=timeout_s)
    except PublishError as exc:
        log.error("could not put back the active version's weights: %s", exc)


# --------------------------------------------------------------------------------------------
# publish


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
    actor: str = "trainer",
    reason: str | None = None,
    event_metrics: dict[str, Any] | None = None,
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
       *base_model*. A server holding a full version's weights gets its base weights back
       first (an adapter is trained on the base).
    4. Only then, in one transaction, inserts the row (kind ``lora``, *parent*'s id, *stats*) as
       ``active`` (every previously active version becomes ``retired``) or, without *activate*,
       as ``candidate``; and a ``publish`` event by *actor*.

    Returns the new version as :func:`version_dict`. Raises :class:`PublishError` if any step
    fails, having unloaded it from the servers it was loaded into and removed the copy:
    nothing is registered and the ``policy`` alias is unchanged.
    """
    adapter_dir = Path(adapter_dir)
    name = name or default_name()
    _check_name(name, base_model)
    _check_adapter(adapter_dir)
    urls = normalize_vllm_urls(vllm_urls)
    return _publish(engine, "lora", adapter_dir, name=name, base_model=base_model, urls=urls, parent=parent,
                    stats=stats, activate=activate, copy=copy, store=store, timeout_s=timeout_s,
                    pause_mode="wait", actor=actor, reason=reason, event_metrics=event_metrics)


def _publish(engine: Engine, kind: str, directory: Path, *, name: str, base_model: str, urls: list[str],
             parent: str | None, stats: dict[str, Any] | None, activate: bool, copy: bool, store: Path | None,
             timeout_s: float, pause_mode: PauseMode, actor: str, reason: str | None,
             event_metrics: dict[str, Any] | None) -> dict[str, Any]:
    """Steps 2-4 of :func:`publish_adapter` / :func:`publish_full` (*directory* checked): place
    it, make the servers serve it, register it; undo what was done when a step fails."""
    parent_id = _check_new(engine, name, parent)
    path = _place(directory, store or default_store(), name) if copy else _own_path(engine, directory)
    try:
        if activate:
            metrics = _serve(engine, kind, name, str(path), base_model, urls, pause_mode=pause_mode,
                             timeout_s=timeout_s)
        elif kind == "lora":  # a candidate adapter is loaded (so it can be evaluated); the weights under it stay
            metrics = {"lora_load_s": ensure_loaded(name, path, urls, base_model=base_model,
                                                    timeout_s=timeout_s).seconds}
        else:  # a full candidate is reloaded by activate()
            metrics = {}
    except BaseException:
        if copy:
            shutil.rmtree(path, ignore_errors=True)
        raise
    stats = dict(stats or {})
    if kind == "full":
        if metrics.get("reloads"):
            stats.setdefault("weights_digest", metrics["reloads"][0]["digest"])
        metrics = metrics | {"pause_mode": pause_mode}
    try:
        result, retired = _register(engine, name=name, kind=kind, base_model=base_model, path=path,
                                    parent_id=parent_id, activate=activate, stats=stats, actor=actor,
                                    reason=reason, metrics={**(event_metrics or {}), **metrics})
    except BaseException:
        if kind == "lora":
            with httpx.Client(timeout=httpx.Timeout(timeout_s, connect=5.0)) as http:
                unload(http, urls, name)
        elif activate:
            _serve_pool_state(engine, urls, pause_mode=pause_mode, timeout_s=timeout_s)
        if copy:
            shutil.rmtree(path, ignore_errors=True)
        raise
    log.info("published %s %s (%s) as %s%s; %s", kind, name, path, result["status"],
             f", retired {retired}" if retired else "", metrics)
    return result


def _check_new(engine: Engine, name: str, parent: str | None) -> int | None:
    """The name is free; returns *parent*'s id (None for the base)."""
    with OrmSession(engine) as db:
        if db.scalars(select(PolicyVersion.id).where(PolicyVersion.name == name)).first() is not None:
            raise PublishError(f"a policy version named {name!r} exists already")
        if parent is not None and parent != BASE:
            return _get(db, parent).id
    return None


def _own_path(engine: Engine, directory: Path) -> Path:
    path = directory.resolve()
    with OrmSession(engine) as db:
        owner = db.scalars(select(PolicyVersion.name).where(PolicyVersion.path == str(path))).first()
    if owner is not None:
        raise PublishError(f"{path} is already the path of version {owner!r}; "
                           "every version needs a directory of its own")
    return path


def _register(engine: Engine, *, name: str, kind: str, base_model: str, path: Path, parent_id: int | None,
              activate: bool, stats: dict[str, Any] | None, actor: str, reason: str | None,
              metrics: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    try:
        with OrmSession(engine) as db, db.begin():
            _lock(db)
            retired = _demote_active(db, "retired") if activate else []
            row = PolicyVersion(name=name, base_model=base_model, kind=kind, path=str(path),
                                parent_id=parent_id, status="active" if activate else "candidate",
                                stats=dict(stats or {}))
            db.add(row)
            db.flush()
            _event(db, row.id, "publish", actor, reason,
                   {"status": row.status, "retired": retired, **metrics})
            return _dict(db, row), retired
    except IntegrityError as exc:
        raise PublishError(f"could not register {name!r}: {exc.orig}") from exc


def check_checkpoint(checkpoint_dir: Path, vllm_urls: Sequence[str] = (), *, timeout_s: float = 30.0) -> None:
    """A full checkpoint vLLM can reload: ``config.json``, whole safetensors files, and (where
    the servers' base directories are readable here) the same architecture and tensor names and
    shapes as the served model. Raises :class:`PublishError`."""
    try:
        full_weights.check_checkpoint(checkpoint_dir)
        with httpx.Client(timeout=timeout_s, trust_env=False) as http:
            for url in vllm_urls:
                base = Path(full_weights.base_weights_path(http, normalize_vllm_url(url)))
                full_weights.check_same_architecture(checkpoint_dir, base)
                full_weights.check_same_weights(checkpoint_dir, base)
    except WeightsError as exc:
        raise PublishError(str(exc)) from exc
    except httpx.HTTPError as exc:
        raise PublishError(f"vLLM did not answer: {type(exc).__name__}: {exc}") from exc


def publish_full(
    engine: Engine,
    checkpoint_dir: Path,
    *,
    name: str | None = None,
    base_model: str,
    vllm_urls: Sequence[str],
    parent: str | None = None,
    stats: dict[str, Any] | None = None,
    activate: bool = True,
    copy: bool = True,
    store: Path | None = None,
    timeout_s: float = 600.0,
    pause_mode: PauseMode = "wait",
    actor: str = "trainer",
    reason: str | None = None,
    event_metrics: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Publish a fully fine-tuned checkpoint (``save_pretrained`` of the whole model) as a new
    policy version of kind ``full``.

    1. Checks the directory (:func:`check_checkpoint`) and the name (default ``full-<time>-<rand>``).
    2. With *copy* (the default) copies it under *store*, as :func:`publish_adapter` does.
    3. With *activate*: on every server of *vllm_urls* (each needs ``VLLM_SERVER_DEV_MODE=1``)
       pauses generation (*pause_mode*: ``wait`` lets running requests finish first, ``keep``
       freezes them), reloads the weights from the copy, labels them *name*, resumes, and
       confirms (``/weight_info`` names the version; a one-token completion of *base_model*
       answers). The servers keep serving it as *base_model*: that is the name vLLM knows.
    4. Only then inserts the row (kind ``full``) as ``active`` — or, without *activate*, as a
       ``candidate`` that no server holds yet (:func:`activate` reloads it) — and a ``publish``
       event with the reload timings.

    Raises :class:`PublishError` on any failure, having put back on every server the weights it
    held before and removed the copy: nothing is registered, the alias is unchanged.
    """
    checkpoint_dir = Path(checkpoint_dir)
    name = name or default_name("full")
    _check_name(name, base_model)
    urls = normalize_vllm_urls(vllm_urls)
    if activate and not urls:
        raise PublishError("no vLLM server given (vllm_urls is empty)")
    check_checkpoint(checkpoint_dir, urls if activate else ())
    return _publish(engine, "full", checkpoint_dir, name=name, base_model=base_model, urls=urls, parent=parent,
                    stats=stats, activate=activate, copy=copy, store=store, timeout_s=timeout_s,
                    pause_mode=pause_mode, actor=actor, reason=reason, event_metrics=event_metrics)


def publish(engine: Engine, directory: Path, **kwargs: Any) -> dict[str, Any]:
    """:func:`publish_adapter` for a PEFT adapter directory, :func:`publish_full` for a whole
    checkpoint (no ``adapter_config.json``). ``pause_mode`` only applies to full checkpoints."""
    if (Path(directory) / ADAPTER_CONFIG).is_file():
        kwargs.pop("pause_mode", None)
        return publish_adapter(engine, directory, **kwargs)
    return publish_full(engine, directory, **kwargs)


# --------------------------------------------------------------------------------------------
# promote / rollback


def _switch_to(engine: Engine, target: str | None, vllm_urls: Sequence[str], *, demoted_status: str,
               timeout_s: float, action: str, actor: str, reason: str | None,
               pause_mode: PauseMode = "wait", event_metrics: dict[str, Any] | None = None
               ) -> tuple[dict[str, Any] | None, list[str]]:
    """Make *target* (a version name; None: the base model) the active version; every other
    active version gets *demoted_status*. Makes every server serve it first."""
    urls = normalize_vllm_urls(vllm_urls)
    kind, path, base_model = "base", None, None
    with OrmSession(engine) as db:
        if target is not None:
            row = _get(db, target)
            kind, path, base_model = row.kind, row.path, row.base_model
            if kind in ("lora", "full") and not path:
                raise PublishError(f"version {target!r} has no {'adapter' if kind == 'lora' else 'checkpoint'} path")
        else:
            current = _current(db)
            base_model = current.base_model if current is not None else None
    if kind == "full":
        assert path is not None
        try:
            full_weights.check_checkpoint(Path(path))
        except WeightsError as exc:
            raise PublishError(f"version {target!r}: {exc}") from exc
    metrics = _serve(engine, kind if kind in ("lora", "full") else "base", target, path, base_model, urls,
                     pause_mode=pause_mode, timeout_s=timeout_s)
    metrics = {**(event_metrics or {}), **metrics}
    with OrmSession(engine) as db, db.begin():
        _lock(db)
        if target is None or kind == "base":
            demoted = _demote_active(db, demoted_status)
            _event(db, None, action, actor, reason, {"to": BASE, "from": demoted, **metrics})
            return None, demoted
        row = _get(db, target)
        demoted = _demote_active(db, demoted_status, keep_id=row.id)
        row.status = "active"
        db.flush()
        _event(db, row.id, action, actor, reason, {"to": row.name, "from": demoted, **metrics})
        return _dict(db, row), demoted


def activate(engine: Engine, name: str, vllm_urls: Sequence[str], *, timeout_s: float = 120.0,
             pause_mode: PauseMode = "wait", actor: str = "admin", reason: str | None = None,
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
    kw = dict(demoted_status="retired", timeout_s=timeout_s, action="promote", actor=actor, reason=reason,
              pause_mode=pause_mode, event_metrics=event_metrics)
    if name == BASE:
        return _switch_to(engine, None, vllm_urls, **kw)[0]  # type: ignore[arg-type]
    with OrmSession(engine) as db:
        is_base = _get(db, name).kind == "base"
    if is_base:
        return _switch_to(engine, None, vllm_urls, **kw)[0]  # type: ignore[arg-type]
    active, demoted = _switch_to(engine, name, vllm_urls, **kw)  # type: ignore[arg-type]
    log.info("activated %s%s", name, f", retired {demoted}" if demoted else "")
    return active


def rollback(engine: Engine, vllm_urls: Sequence[str], to: str | None = None, *,
             timeout_s: float = 120.0, pause_mode: PauseMode = "wait", actor: str = "admin",
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
        current = _current(db)
        target: str | None
        if to is None:
            if current is None:
                raise PublishError("nothing to roll back: the policy already serves the base model")
            prev = db.scalars(
                select(PolicyVersion)
                .where(
                    PolicyVersion.status.in_(ROLLBACK_TARGET_STATUSES),
                    PolicyVersion.kind.in_(("lora", "full")),
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
                                 timeout_s=timeout_s, action="rollback", actor=actor, reason=reason,
                                 pause_mode=pause_mode, event_metrics=event_metrics)
    log.info("rolled back %s; now serving %s", demoted, target or "the base model")
    return {"active": active, "rolled_back": demoted}
