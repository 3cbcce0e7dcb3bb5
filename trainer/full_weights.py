"""Full weights into a running vLLM: pause, ``reload_weights`` from a directory, resume.

What vLLM (0.32, the CPU build included) offers, and what this module uses. With
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
- ``POST /weight_checker {"action": "checksum"}`` — per-parameter digests of the loaded
  weights; :func:`weights_digest` folds them into one, recorded with the version and checked
  when it is loaded again.

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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import httpx

log = logging.getLogger("nextstate.publish")

PauseMode = Literal["wait", "keep"]
PAUSE_MODES: tuple[str, ...] = ("wait", "keep")
#: ``/weight_info`` of a server that has not reloaded since it started: its ``--model`` weights.
FRESH = "default"
#: The label we give the base model's weights when we reload them.
BASE_LABEL = "base"
BASE_LABELS = frozenset({FRESH, BASE_LABEL})
WEIGHT_FILES = ("*.safetensors",)


class WeightsError(RuntimeError):
    """A reload failed, or a server cannot reload (no dev mode)."""


class DevModeMissing(WeightsError):
    """The server has no development endpoints (started without VLLM_SERVER_DEV_MODE=1)."""


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


def server_root(url: str) -> str:
    """``http://host:port`` of an OpenAI base ``http://host:port/v1``."""
    url = url.strip().rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


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


def check_checkpoint(path: Path) -> None:
    """A directory vLLM can reload from: ``config.json`` and safetensors weights."""
    if not path.is_dir():
        raise WeightsError(f"checkpoint directory {path} does not exist")
    if not (path / "config.json").is_file():
        raise WeightsError(f"{path} is not a model checkpoint: no config.json")
    if not any(path.glob(WEIGHT_FILES[0])):
        raise WeightsError(f"{path} has no *.safetensors weights (save with safe_serialization)")


def check_same_architecture(checkpoint: Path, base: Path) -> None:
    """Refuse a checkpoint whose config differs from the served model's in what the weights'
    shapes depend on (vLLM would fail half-way through loading otherwise)."""
    try:
        new = json.loads((checkpoint / "config.json").read_text())
        old = json.loads((base / "config.json").read_text())
    except (OSError, ValueError):
        return  # the base lives on another host: vLLM checks the shapes
    keys = ("architectures", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "vocab_size")
    diff = {k: (old.get(k), new.get(k)) for k in keys if old.get(k) != new.get(k)}
    if diff:
        raise WeightsError(f"{checkpoint} is not a checkpoint of the served model {base}: "
                           + ", ".join(f"{k} {a!r} != {b!r}" for k, (a, b) in diff.items()))


def _shapes(directory: Path) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open  # reads headers only; refuses a truncated file

    shapes: dict[str, tuple[int, ...]] = {}
    for f in sorted(directory.glob(WEIGHT_FILES[0])):
        try:
            with safe_open(str(f), framework="numpy") as st:
                for key in st.keys():
                    shapes[key] = tuple(st.get_slice(key).get_shape())
        except Exception as exc:  # safetensors raises its own SafetensorError
            raise WeightsError(f"{f} is not a readable safetensors file: {exc}") from exc
    return shapes


def check_same_weights(checkpoint: Path, base: Path) -> None:
    """Every tensor of the served model's checkpoint *base* is in *checkpoint* with the same
    shape, and no other (``lm_head.weight`` may be tied either way), every file whole. vLLM
    only finds a bad file half-way through a reload, which leaves its model broken."""
    new = _shapes(checkpoint)
    if not base.is_dir():
        return  # the base lives on another host: vLLM checks
    old = _shapes(base)
    tied = {"lm_head.weight"}
    missing = sorted(set(old) - set(new) - tied)
    extra = sorted(set(new) - set(old) - tied)
    wrong = sorted(k for k in set(old) & set(new) if old[k] != new[k])
    if missing or extra or wrong:
        parts = [f"{what} {names[:5]}{' ...' if len(names) > 5 else ''}"
                 for what, names in (("missing", missing), ("unexpected", extra), ("shapes differ:", wrong))
                 if names]
        raise WeightsError(f"{checkpoint} does not fit the served model {base}: " + "; ".join(parts))


def weight_label(http: httpx.Client, url: str) -> str | None:
    """The label of the weights *url* holds (``"default"``: its ``--model``), or None when the
    server has no dev mode (then it holds its ``--model`` weights: it cannot reload)."""
    resp = http.get(f"{server_root(url)}/weight_info")
    if resp.status_code == 404:
        return None
    if resp.status_code != 200:
        raise WeightsError(f"{url}: GET /weight_info failed: {_text(resp)}")
    return str(resp.json().get("weight_version"))


def base_weights_path(http: httpx.Client, url: str) -> str:
    """The directory the server was started with (its base model card's ``root``)."""
    resp = http.get(f"{url}/models")
    if resp.status_code != 200:
        raise WeightsError(f"{url}: GET /models failed: {_text(resp)}")
    for card in resp.json().get("data", []):
        if card.get("parent") is None and card.get("root"):
            return str(card["root"])
    raise WeightsError(f"{url}: /models lists no base model with a root path")


def weights_digest(http: httpx.Client, url: str) -> str:
    """One sha256 over the server's per-parameter weight digests (``/weight_checker``)."""
    resp = http.post(f"{server_root(url)}/weight_checker", json={"action": "checksum"})
    if resp.status_code != 200:
        raise WeightsError(f"{url}: weight checksum failed: {_text(resp)}")
    checksums = resp.json()["checksums"]
    return hashlib.sha256(json.dumps(checksums, sort_keys=True).encode()).hexdigest()


def _post(http: httpx.Client, url: str, path: str, what: str, **kw: Any) -> httpx.Response:
    # a fresh connection each time: after a failed reload vLLM drops the connection it answered on
    try:
        resp = httpx.post(f"{server_root(url)}{path}", timeout=http.timeout, trust_env=False, **kw)
    except httpx.HTTPError as exc:
        raise WeightsError(f"{url}: {what} failed: {type(exc).__name__}: {exc} (see the vLLM log)") from exc
    if resp.status_code == 404 and path in ("/pause", "/collective_rpc"):
        raise DevModeMissing(f"{url} has no {path} endpoint: start vLLM with VLLM_SERVER_DEV_MODE=1 "
                             "(`nextstate vllm serve --dev-mode`) to publish full weights")
    if resp.status_code != 200:
        raise WeightsError(f"{url}: {what} failed: {_text(resp)}")
    return resp


def _reload(http: httpx.Client, url: str, path: str, label: str) -> None:
    _post(http, url, "/collective_rpc", f"reload_weights from {path}",
          json={"method": "reload_weights", "kwargs": {"weights_path": path}})
    _post(http, url, "/update_weight_version", "update_weight_version", json={"new_version": label})


def _resume(http: httpx.Client, url: str, attempts: int = 3) -> None:
    for attempt in range(attempts):
        try:
            _post(http, url, "/resume", "resume")
            return
        except WeightsError as exc:
            log.error("could not resume %s (attempt %d): %s", url, attempt + 1, exc)
            if attempt + 1 == attempts:
                raise
            time.sleep(0.5)


def reload_one(http: httpx.Client, url: str, path: str, label: str, *, pause_mode: PauseMode = "wait",
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
    _post(http, url, "/pause", "pause", params={"mode": pause_mode, "clear_cache": "true"})
    paused_at = time.perf_counter()
    result.pause_s = paused_at - started
    try:
        try:
            _reload(http, url, path, label)
        except WeightsError as exc:
            if fallback is None:
                raise
            try:
                _reload(http, url, fallback[1], fallback[0])
            except WeightsError as again:
                raise WeightsError(f"{exc}; putting back {fallback[1]} failed too ({again}): the server's "
                                   "model is broken, restart it") from exc
            log.warning("%s: reloading %s failed, put back %s: %s", url, path, fallback[1], exc)
            raise
        result.reload_s = time.perf_counter() - paused_at
    finally:
        _resume(http, url)
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
    pause_mode: PauseMode = "wait",
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
