"""Weights back to serving: publish a trained LoRA adapter or full checkpoint as a new policy version.

A policy version is a LoRA adapter directory at a path of its own (never reused, never
rewritten), loaded into every vLLM server that serves the policy — the replica serving live
traffic *and* the teacher replica, so teacher logprobs of turns served by that version can be
computed under it — or a full checkpoint whose weights every server reloads in place. The
registry (statuses, events, promote and rollback) is ``datapool.versions``; vLLM's admin calls
are ``vllm_client``. :func:`publish` takes one :class:`PublishRequest`.

Failures. :func:`publish` registers **nothing** when loading fails anywhere: it
unloads the adapter from the servers that did load it, deletes the copy it made, and raises
:class:`PublishError` naming each server's error. A failed publish leaves no row (so the name
can be reused once the adapter is fixed) and the alias untouched; the trainer's own run record
is the place for its history. ``datapool.versions.activate`` and ``rollback`` likewise change no row
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
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import Engine

from datapool import versions
from vllm_client.adapters import ADAPTER_CONFIG, ensure_loaded, unload
from base.errors import AdminError, PublishError, WeightsError
from vllm_client.http import openai_base, openai_bases
from vllm_client.weights import base_weights_path, check_checkpoint as check_weight_files
from datapool.db import utcnow
from base.settings import Settings
from base.vocab import PauseMode, VersionKind
from publishing import full_weights

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
       ``datapool.versions.activate``.
    4. Only then, in one transaction, registers it (``active``, retiring the active version, or
       ``candidate``) with a ``publish`` event.

    Returns the new version as ``datapool.versions.version_dict``. Raises :class:`PublishError`
    if any step fails, having put back what each server served and removed the copy: nothing is
    registered and the ``policy`` alias is unchanged.
    """
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
        check_checkpoint(directory, urls if request.activate else ())
        pause_mode = request.pause_mode
    timeout_s = request.timeout_s if request.timeout_s is not None else DEFAULT_TIMEOUT_S[kind]
    return _publish(engine, request, kind, directory, name, urls, pause_mode, timeout_s)


def _publish(engine: Engine, request: PublishRequest, kind: VersionKind, directory: Path, name: str,
             urls: list[str], pause_mode: str, timeout_s: float) -> dict[str, Any]:
    """Steps 2-4 of :func:`publish` (*directory* checked): place it, make the servers serve it,
    register it; undo what was done when a step fails."""
    parent_id = versions.check_new(engine, name, request.parent)
    copy, activate = request.copy, request.activate
    path = (_place(directory, request.store or default_store(), name) if copy
            else versions.own_path(engine, directory))
    try:
        if activate:
            metrics = versions.serve(engine, kind, name, str(path), request.base_model, urls,
                                     pause_mode=pause_mode, timeout_s=timeout_s)
        elif kind == VersionKind.LORA:  # a candidate adapter is loaded (so it can be evaluated)
            try:
                report = ensure_loaded(name, path, urls, base_model=request.base_model,
                                                  timeout_s=timeout_s)
            except AdminError as exc:
                raise PublishError(str(exc)) from exc
            metrics = {"lora_load_s": report.seconds}
        else:  # a full candidate is reloaded by activate()
            metrics = {}
    except BaseException:
        if copy:
            shutil.rmtree(path, ignore_errors=True)
        raise
    stats = dict(request.stats or {})
    if kind == VersionKind.FULL:
        if metrics.get("reloads"):
            stats.setdefault("weights_digest", metrics["reloads"][0]["digest"])
        metrics = metrics | {"pause_mode": pause_mode}
    try:
        result, retired = versions.register(
            engine, name=name, kind=kind, base_model=request.base_model, path=path, parent_id=parent_id,
            activate=activate, stats=stats, actor=request.actor, reason=request.reason,
            metrics={**(request.event_metrics or {}), **metrics})
    except BaseException:
        if kind == VersionKind.LORA:
            with httpx.Client(timeout=httpx.Timeout(timeout_s, connect=5.0)) as http:
                unload(http, urls, name)
        elif activate:
            versions.serve_pool_state(engine, urls, pause_mode=pause_mode, timeout_s=timeout_s)
        if copy:
            shutil.rmtree(path, ignore_errors=True)
        raise
    log.info("published %s %s (%s) as %s%s; %s", kind, name, path, result["status"],
             f", retired {retired}" if retired else "", metrics)
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


def check_checkpoint(checkpoint_dir: Path, vllm_urls: Sequence[str] = (), *, timeout_s: float = 30.0) -> None:
    """A full checkpoint vLLM can reload: ``config.json``, whole safetensors files, and (where
    the servers' base directories are readable here) the same architecture and tensor names and
    shapes as the served model. Raises :class:`PublishError`."""
    try:
        check_weight_files(checkpoint_dir)
        with httpx.Client(timeout=timeout_s, trust_env=False) as http:
            for url in vllm_urls:
                base = Path(base_weights_path(http, openai_base(url)))
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
