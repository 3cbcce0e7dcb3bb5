"""Weights back to serving: publish a trained LoRA adapter or full checkpoint as a new policy
version, promote a version, roll back — the one place that changes what the model servers serve.

A policy version is a LoRA adapter directory at a path of its own (never reused, never
rewritten), loaded into every vLLM server that serves the policy — the replica serving live
traffic *and* the teacher replica, so teacher logprobs of turns served by that version can be
computed under it — or a full checkpoint whose weights every server reloads in place. The
registry (rows, statuses, events) is ``datapool.versions``; vLLM's admin calls are
``vllm_client``; this module is the only one that uses both. :func:`publish` takes one
:class:`PublishRequest`; :func:`promote` (:func:`activate`), :func:`rollback` and
:func:`rollback_tainted` switch the ``policy`` alias: one call into the pool
(``datapool.versions.switch_active``: read the target, then record the switch) around one call
that makes every server serve it (:func:`serve`).

Failures. :func:`publish` registers **nothing** when loading fails anywhere: it
unloads the adapter from the servers that did load it, deletes the copy it made, and raises
:class:`PublishError` naming each server's error. A failed publish leaves no row (so the name
can be reused once the adapter is fixed) and the alias untouched; the trainer's own run record
is the place for its history. :func:`promote` and :func:`rollback` likewise change no row
unless the target is loaded everywhere.

Full weights (kind ``full``). A fully fine-tuned checkpoint cannot be served *beside* the
base: vLLM holds one set of base weights per server. Publishing a full checkpoint copies the checkpoint
to the store and, on every server in ``vllm_urls``, pauses generation, reloads the weights from
it in place (``reload_weights``) and resumes (see :mod:`vllm_client`; the servers need
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
resolved the alias in the moment before the gateways hear of the new row are recorded under the
previous version but served by the new weights.

Paths. vLLM reads ``lora_path`` from its own filesystem: with servers on other hosts, the
version store (``store``) must be on a filesystem they share, at the same path.

All functions are synchronous; call them from a thread in async code.
"""

from __future__ import annotations

import json
import logging
import secrets
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import Engine

from base.settings import Settings
from base.vocab import PauseMode, PolicyAction, VersionKind
from datapool import forget, versions
from datapool.db import utcnow
from base.errors import AdminError, PublishError, WeightsError
from publishing import full_weights
from vllm_client.adapters import ADAPTER_CONFIG, ensure_loaded, unload
from vllm_client.http import openai_base, openai_bases
from vllm_client.weights import (
    BASE_LABEL,
    BASE_LABELS,
    base_weights_path,
    held_weights,
    require_weight_labels,
    switch_weights,
    weight_label,
)
from vllm_client.transfer import NcclWeights, transfer_weights
from vllm_client.weights import check_checkpoint as check_weight_files

log = logging.getLogger("nextstate.publish")

ADAPTER_CONFIG = ADAPTER_CONFIG
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
#: how long a server may take, by kind: loading an adapter, or pausing and reloading weights
DEFAULT_TIMEOUT_S = {VersionKind.LORA: 120.0, VersionKind.FULL: 600.0}


@dataclass(frozen=True)
class PublishRequest:
    """What to publish, where, and how it is recorded.

    *directory*: a PEFT LoRA adapter (``adapter_config.json``) or a whole fine-tuned checkpoint
    (``save_pretrained``: ``config.json`` + safetensors); *kind* says which, or None to tell by
    the files. *vllm_urls*: every server (``…/v1``) that must serve it (the policy server and
    the teacher replica); each must serve *base_model*. *name*: default
    ``<kind>-<UTC time>-<random>``. *parent*: the version it was trained from (recorded).
    *activate*: make it the active version, or register a ``candidate``. *copy*: copy it under
    *store* (default ``<data dir>/policies``) so later writes to *directory* never change a
    served version; without it the version keeps *directory*, which no other version may use.
    *timeout_s*: per server (default :data:`DEFAULT_TIMEOUT_S`). *pause_mode*: full weights
    only (see :class:`base.vocab.PauseMode`). *actor*, *reason*, *event_metrics*: recorded
    on the ``publish`` event.
    """

    directory: Path
    base_model: str
    vllm_urls: Sequence[str]
    kind: VersionKind | None = None
    name: str | None = None
    parent: str | None = None
    stats: dict[str, Any] | None = None
    activate: bool = True
    copy: bool = True
    store: Path | None = None
    timeout_s: float | None = None
    pause_mode: PauseMode = PauseMode.WAIT
    actor: str = "trainer"
    reason: str | None = None
    event_metrics: dict[str, Any] | None = None
    #: a full version's weights over NCCL (``vllm_client.transfer``) instead of a reload from
    #: *directory*, which is still checked, placed and recorded (promotion and rollback reload it)
    transfer: NcclWeights | None = None

    def resolved_kind(self) -> VersionKind:
        """*kind*, or what the directory holds: an adapter config makes it a LoRA version."""
        if self.kind is not None:
            return VersionKind(self.kind)
        return VersionKind.LORA if (Path(self.directory) / ADAPTER_CONFIG).is_file() else VersionKind.FULL


def publish(engine: Engine, request: PublishRequest) -> dict[str, Any]:
    """Publish *request*'s directory as a new policy version.

    1. Checks the directory (a LoRA adapter's config and weights; a checkpoint's files and, where
       the servers' base directories are readable here, its architecture and tensor shapes) and
       the name (unique in the pool, not ``base``/``policy``/the base model's name).
    2. With ``copy`` copies it to a new directory under ``store``.
    3. Makes every server serve it: an adapter is loaded under its name (a server holding a full
       version's weights gets its base weights back first) and must be listed in ``/v1/models``;
       a checkpoint is reloaded in place (pause, ``reload_weights``, label, resume, confirm; the
       servers need ``VLLM_SERVER_DEV_MODE=1``) and keeps being served as ``base_model``. A
       candidate adapter is loaded (so it can be evaluated); a full candidate is reloaded by
       :func:`promote`.
    4. Only then, in one transaction, registers it (``active``, retiring the active version, or
       ``candidate``) with a ``publish`` event.

    Returns the new version as ``datapool.versions.version_dict``. Raises :class:`PublishError`
    if any step fails, having put back what each server served and removed the copy: nothing is
    registered and the ``policy`` alias is unchanged.
    """
    started = time.perf_counter()
    kind = request.resolved_kind()
    directory = Path(request.directory)
    name = request.name or default_name(kind)
    versions.check_name(name, request.base_model)
    urls = openai_bases(request.vllm_urls)
    if kind == VersionKind.LORA:
        _check_adapter(directory)
        pause_mode = PauseMode.WAIT  # an adapter loads beside the weights: nothing pauses
    else:
        if request.activate and not urls:
            raise PublishError("no vLLM server given (vllm_urls is empty)")
        check_checkpoint(directory, urls if request.activate else (),
                         bases=request.transfer.group.base_paths if request.transfer is not None else None)
        pause_mode = request.pause_mode
    timeout_s = request.timeout_s if request.timeout_s is not None else DEFAULT_TIMEOUT_S[kind]
    return _publish(engine, request, kind, directory, name, urls, pause_mode, timeout_s,
                    {"check_s": time.perf_counter() - started})


def _publish(engine: Engine, request: PublishRequest, kind: VersionKind, directory: Path, name: str,
             urls: list[str], pause_mode: str, timeout_s: float, phases: dict[str, float]) -> dict[str, Any]:
    """Steps 2-4 of :func:`publish` (*directory* checked): place it, make the servers serve it,
    register it; undo what was done when a step fails. *phases*: seconds per step, to which
    this adds its own (``phases_s`` in the publish event's metrics, and in the log line; the
    pool's commit, the last step, only in the log line)."""
    at = time.perf_counter()
    parent_id = versions.check_new(engine, name, request.parent)
    copy, activate = request.copy, request.activate
    path = (_place(directory, request.store or default_store(), name) if copy
            else versions.own_path(engine, directory))
    phases["place_s"] = time.perf_counter() - at
    at = time.perf_counter()
    try:
        if activate:
            target = versions.Target(name, kind, str(path), request.base_model, versions.full_paths(engine))
            metrics = serve(target, urls, pause_mode=pause_mode, timeout_s=timeout_s, transfer=request.transfer)
        elif kind == VersionKind.LORA:  # a candidate adapter is loaded (so it can be evaluated)
            try:
                report = ensure_loaded(name, path, urls, base_model=request.base_model,
                                                  timeout_s=timeout_s)
            except AdminError as exc:
                raise PublishError(str(exc)) from exc
            metrics = {"lora_load_s": report.seconds}
        else:  # a full candidate is reloaded by promote()
            metrics = {}
    except BaseException:
        if copy:
            shutil.rmtree(path, ignore_errors=True)
        raise
    phases["serve_s"] = time.perf_counter() - at
    at = time.perf_counter()
    stats = dict(request.stats or {})
    if kind == VersionKind.FULL:
        if metrics.get("reloads"):
            stats.setdefault("weights_digest", metrics["reloads"][0]["digest"])
        metrics = metrics | {"pause_mode": pause_mode}
    try:
        result, retired = versions.register(
            engine, name=name, kind=kind, base_model=request.base_model, path=path, parent_id=parent_id,
            activate=activate, stats=stats, actor=request.actor, reason=request.reason,
            metrics={**(request.event_metrics or {}), **metrics,
                     "phases_s": {k: round(v, 4) for k, v in phases.items()}})
    except BaseException:
        if kind == VersionKind.LORA:
            with httpx.Client(timeout=httpx.Timeout(timeout_s, connect=5.0)) as http:
                unload(http, urls, name)
        elif activate:
            serve_pool_state(engine, urls, pause_mode=pause_mode, timeout_s=timeout_s)
        if copy:
            shutil.rmtree(path, ignore_errors=True)
        raise
    phases["register_s"] = time.perf_counter() - at
    log.info("published %s %s (%s) as %s%s; %s; seconds per step %s", kind, name, path, result["status"],
             f", retired {retired}" if retired else "", metrics, {k: round(v, 4) for k, v in phases.items()})
    return result


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


def check_checkpoint(checkpoint_dir: Path, vllm_urls: Sequence[str] = (), *, timeout_s: float = 30.0,
                     bases: Mapping[str, str] | None = None) -> None:
    """A full checkpoint vLLM can reload: ``config.json``, whole safetensors files, and (where
    the servers' base directories are readable here) the same architecture and tensor names and
    shapes as the served model. *bases*: servers' base directories already known (an NCCL
    group's, read when it connected), by OpenAI base URL; the others are asked. Raises
    :class:`PublishError`."""
    try:
        check_weight_files(checkpoint_dir)
        with httpx.Client(timeout=timeout_s, trust_env=False) as http:
            for url in map(openai_base, vllm_urls):
                base = Path((bases or {}).get(url) or base_weights_path(http, url))
                full_weights.check_same_architecture(checkpoint_dir, base)
                full_weights.check_same_weights(checkpoint_dir, base)
    except WeightsError as exc:
        raise PublishError(str(exc)) from exc
    except httpx.HTTPError as exc:
        raise PublishError(f"vLLM did not answer: {type(exc).__name__}: {exc}") from exc


def default_name(kind: str = VersionKind.LORA) -> str:
    """A fresh version name: ``<kind>-<UTC timestamp>-<random>``; unique across pools sharing a
    vLLM, which keeps every adapter ever loaded under its name until restarted."""
    return f"{kind}-{utcnow():%Y%m%dT%H%M%S}-{secrets.token_hex(3)}"


def default_store() -> Path:
    """Where published versions are kept by default: ``<data dir>/policies``."""
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


# --------------------------------------------------------------------------------------------
# making every server serve a version (vllm_client: adapters, weights)


def _path_of(paths: Mapping[str, str]) -> Callable[[httpx.Client, str, str | None], str | None]:
    """``path_of(http, url, label)`` for ``switch_weights``: the checkpoint of the full version a
    server reports holding (None: its base, or no such full version)."""
    def path_of(_http: httpx.Client, _url: str, label: str | None) -> str | None:
        return None if label is None or label in BASE_LABELS else paths.get(label)
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


def _full_target(name: str, path: str) -> Callable[[httpx.Client, str], tuple[str, str] | None]:
    def target(http: httpx.Client, url: str) -> tuple[str, str] | None:
        label = require_weight_labels(http, url)
        return None if label == name else (name, path)
    return target


def serve(target: versions.Target, urls: Sequence[str], *, pause_mode: str, timeout_s: float,
          transfer: NcclWeights | None = None) -> dict[str, Any]:
    """Make every server serve *target*: a full version's weights reloaded in place (with
    *transfer*, sent over NCCL instead); for a LoRA version or the base, the original base
    weights (reloaded where a full version held the server) and then the adapter. All servers or
    none: a failure puts back the weights each held (found by name in ``target.full_paths``).
    Returns metrics for the event row; touches no pool."""
    metrics: dict[str, Any] = {}
    kind, name, path = target.kind, target.name, target.path
    path_of = _path_of(target.full_paths)
    try:
        if kind == VersionKind.FULL and transfer is not None:
            assert name is not None
            if sorted(transfer.group.urls) != sorted(urls):
                raise PublishError(f"the NCCL group holds {transfer.group.urls}, the version goes to {list(urls)}")
            bases = transfer.group.base_paths
            reloads = transfer_weights(transfer.group, transfer.tensors(), name, pause_mode=pause_mode,
                                       served_name=target.base_model,
                                       held=lambda http, url: held_weights(http, url, path_of, bases.get(url)))
            metrics["transfer"] = "nccl"
        elif kind == VersionKind.FULL:
            assert name is not None and path is not None
            reloads = switch_weights(urls, _full_target(name, path), path_of=path_of, pause_mode=pause_mode,
                                     served_name=target.base_model, timeout_s=timeout_s)
        else:
            def load_adapter() -> None:
                if kind == VersionKind.LORA:
                    assert name is not None and path is not None
                    report = ensure_loaded(name, path, urls, base_model=target.base_model, timeout_s=timeout_s)
                    metrics["lora_load_s"] = report.seconds
            reloads = switch_weights(urls, _base_target, path_of=path_of, pause_mode=pause_mode,
                                     served_name=target.base_model, timeout_s=timeout_s, then=load_adapter)
    except AdminError as exc:
        raise PublishError(str(exc)) from exc
    except httpx.HTTPError as exc:
        raise PublishError(f"vLLM did not answer while switching weights: {type(exc).__name__}: {exc}") from exc
    if reloads:
        metrics["reloads"] = [vars(r) for r in reloads]
    return metrics


def serve_pool_state(engine: Engine, urls: Sequence[str], *, pause_mode: str, timeout_s: float) -> None:
    """Best effort, after a switch the pool did not record: make the servers hold what the pool
    says is active."""
    target = versions.active_target(engine)
    if target.kind == VersionKind.LORA:  # its adapter is still loaded; only the weights under it may have changed
        target = replace(target, kind=VersionKind.BASE, name=None, path=None)
    try:
        serve(target, urls, pause_mode=pause_mode, timeout_s=timeout_s)
    except PublishError as exc:
        log.error("could not put back the active version's weights: %s", exc)


# --------------------------------------------------------------------------------------------
# promote / rollback: the pool once (datapool.versions.switch_active), the servers once (serve)


def promote(engine: Engine, name: str, vllm_urls: Sequence[str], *, timeout_s: float = 120.0,
            pause_mode: str = PauseMode.WAIT, actor: str = "admin", reason: str | None = None,
            event_metrics: dict[str, Any] | None = None) -> versions.Switched:
    """Promote version *name*: make every server of *vllm_urls* serve it (a LoRA adapter is
    loaded where it is missing — after a vLLM restart none is; a full version's weights are
    reloaded where the server holds others), then make it ``active`` and the previously active
    one ``retired``, in one transaction, with a ``promote`` event.

    Idempotent: promoting the active version just makes sure every server serves it (run it
    after restarting vLLM). ``name="base"`` (or a ``kind="base"`` row) makes the alias serve
    the base model. Returns what changed (:class:`datapool.versions.Switched`). Raises
    :class:`VersionNotFound` / :class:`PublishError`, changing nothing.
    """
    switched = _switch(engine, PolicyAction.PROMOTE, name, vllm_urls, timeout_s=timeout_s, pause_mode=pause_mode,
                       actor=actor, reason=reason, event_metrics=event_metrics)
    log.info("activated %s%s", name, f", retired {switched.demoted}" if switched.demoted else "")
    return switched


def activate(engine: Engine, name: str, vllm_urls: Sequence[str], *, timeout_s: float = 120.0,
             pause_mode: str = PauseMode.WAIT, actor: str = "admin", reason: str | None = None,
             event_metrics: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """:func:`promote`, returning only the now active version (None for the base)."""
    return promote(engine, name, vllm_urls, timeout_s=timeout_s, pause_mode=pause_mode, actor=actor,
                   reason=reason, event_metrics=event_metrics).active


def rollback(engine: Engine, vllm_urls: Sequence[str], to: str | None = None, *,
             timeout_s: float = 120.0, pause_mode: str = PauseMode.WAIT, actor: str = "admin",
             reason: str | None = None, event_metrics: dict[str, Any] | None = None) -> dict[str, Any]:
    """Roll the policy back from the active version.

    *to* None: to the newest ``retired`` version (LoRA or full, not tainted) created before the
    active one, or to the base model if there is none. *to* a name: to that version. *to*
    ``"base"``: to the base model (no active version; the alias serves the base, and servers
    that held a full version's weights get their base weights back). The target is made to
    serve everywhere first (as in :func:`promote`); the version rolled back from becomes
    ``rolled_back`` (never a default rollback target again). A ``rollback`` event records it.

    Returns ``{"active": version dict or None (base), "rolled_back": [names]}``. Raises
    :class:`PublishError` when there is nothing to roll back from (``to`` None and the alias
    already serves the base) or the target cannot be served; nothing changes then.
    """
    switched = _switch(engine, PolicyAction.ROLLBACK, to, vllm_urls, timeout_s=timeout_s, pause_mode=pause_mode,
                       actor=actor, reason=reason, event_metrics=event_metrics)
    now = switched.active["name"] if switched.active else "the base model"
    log.info("rolled back %s; now serving %s", switched.demoted, now)
    return {"active": switched.active, "rolled_back": switched.demoted}


def rollback_tainted(engine: Engine, vllm_urls: Sequence[str], *, actor: str, timeout_s: float = 120.0
                     ) -> dict[str, Any] | None:
    """If the active version is tainted (``nextstate forget --taint``), roll back to the newest
    clean version that served before, or the base (``datapool.forget.tainted_rollback_target``);
    None when the active version is clean."""
    target = forget.tainted_rollback_target(engine)
    if target is None:
        return None
    return rollback(engine, vllm_urls, to=target, actor=actor, timeout_s=timeout_s,
                    reason="the active version learned from forgotten data")


def _switch(engine: Engine, action: PolicyAction, to: str | None, vllm_urls: Sequence[str], *, timeout_s: float,
            pause_mode: str, actor: str, reason: str | None, event_metrics: dict[str, Any] | None
            ) -> versions.Switched:
    """One call into the pool, which resolves *to*, has :func:`serve` switch the servers, and
    records it. Should the pool refuse the record after the servers switched (the target was
    tainted meanwhile), the servers are given back what the pool says is active."""
    urls = openai_bases(vllm_urls)
    served: list[versions.Target] = []

    def serve_target(target: versions.Target) -> dict[str, Any]:
        if target.kind == VersionKind.FULL:
            assert target.path is not None
            try:
                check_weight_files(Path(target.path))
            except WeightsError as exc:
                raise PublishError(f"version {target.name!r}: {exc}") from exc
        metrics = serve(target, urls, pause_mode=pause_mode, timeout_s=timeout_s)
        served.append(target)
        return metrics

    try:
        return versions.switch_active(engine, action, to, serve_target, actor=actor, reason=reason,
                                      event_metrics=event_metrics)
    except PublishError:
        if served:
            serve_pool_state(engine, urls, pause_mode=pause_mode, timeout_s=timeout_s)
        raise
