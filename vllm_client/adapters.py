"""LoRA adapters on vLLM servers (``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter``,
``/v1/models``): vLLM must run with ``--enable-lora``; a loaded adapter is listed in
``/v1/models`` with its path as ``root``."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from base.errors import LoadError
from vllm_client.http import openai_bases, response_text

log = logging.getLogger("nextstate.publish")

ADAPTER_CONFIG = "adapter_config.json"


@dataclass
class LoadReport:
    """What :func:`ensure_loaded` did, per server (base URL ``…/v1``)."""

    loaded: list[str] = field(default_factory=list)  # servers this call loaded it into
    already: list[str] = field(default_factory=list)  # servers that had it (same path) already
    seconds: dict[str, float] = field(default_factory=dict)  # load_lora_adapter latency per server
    errors: dict[str, str] = field(default_factory=dict)  # server -> why it failed


def served_models(http: httpx.Client, url: str) -> dict[str, dict[str, Any]]:
    """``/v1/models`` of one vLLM server as ``{id: card}`` (a LoRA card's ``root`` is its path)."""
    resp = http.get(f"{url}/models")
    if resp.status_code != 200:
        raise LoadError(f"{url}: GET /models failed: {response_text(resp)}")
    try:
        return {m["id"]: m for m in resp.json()["data"]}
    except (KeyError, TypeError, ValueError) as exc:
        raise LoadError(f"{url}: GET /models returned an unexpected body: {resp.text[:200]}") from exc


def _same_path(a: str | None, b: str) -> bool:
    return a is not None and Path(a).resolve() == Path(b).resolve()


def _load_one(http: httpx.Client, url: str, name: str, path: str, base_model: str | None,
              report: LoadReport) -> None:
    models = served_models(http, url)
    if base_model is not None and base_model not in models:
        raise LoadError(f"{url} does not serve the base model {base_model!r} "
                           f"(it serves {sorted(models)})")
    card = models.get(name)
    if card is not None:
        if _same_path(card.get("root"), path):
            report.already.append(url)
            return
        raise LoadError(
            f"{url} already serves a different adapter as {name!r} (path {card.get('root')!r}, "
            f"expected {path!r}); unload it (POST {url}/unload_lora_adapter) or use another name"
        )
    start = time.perf_counter()
    resp = http.post(f"{url}/load_lora_adapter", json={"lora_name": name, "lora_path": path})
    elapsed = time.perf_counter() - start
    if resp.status_code != 200:
        raise LoadError(f"{url}: load_lora_adapter failed: {response_text(resp)}")
    report.loaded.append(url)
    report.seconds[url] = elapsed
    card = served_models(http, url).get(name)
    if card is None or not _same_path(card.get("root"), path):
        raise LoadError(f"{url}: load_lora_adapter said ok but /models does not list {name!r} "
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
                errors[url] = response_text(resp)
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
    :class:`LoadError` is raised with every server's error.
    """
    path = str(Path(path).resolve())
    if not Path(path, ADAPTER_CONFIG).is_file():
        raise LoadError(f"adapter of {name!r} is gone from disk: no {ADAPTER_CONFIG} in {path}")
    urls = openai_bases(vllm_urls)
    if not urls:
        raise LoadError("no vLLM server given (vllm_urls is empty)")
    report = LoadReport()
    with httpx.Client(timeout=httpx.Timeout(timeout_s, connect=5.0)) as http:
        for url in urls:
            try:
                _load_one(http, url, name, path, base_model, report)
            except LoadError as exc:
                report.errors[url] = str(exc)
            except httpx.HTTPError as exc:
                report.errors[url] = f"{url}: {type(exc).__name__}: {exc}"
        if report.errors and rollback_on_error and report.loaded:
            unload(http, report.loaded, name)
    if report.errors:
        detail = "; ".join(report.errors.values())
        undone = f" (unloaded again from {', '.join(report.loaded)})" if rollback_on_error and report.loaded else ""
        raise LoadError(f"could not load {name!r} from {path} into every vLLM: {detail}{undone}")
    return report
