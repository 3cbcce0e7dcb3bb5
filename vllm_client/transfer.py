"""Full weights over NCCL: the trainer's tensors go straight into the servers' GPU memory through
vLLM's weight-transfer engine, instead of a checkpoint reloaded from disk
(:func:`vllm_client.weights.reload_one`).

The server side is vLLM's own (0.26 and later): started with ``--weight-transfer-config
'{"backend": "nccl"}'`` and ``VLLM_SERVER_DEV_MODE=1``, it mounts

- ``GET /get_world_size`` — its workers (TP × PP × DP);
- ``POST /init_weight_transfer_engine {"init_info": {master_address, master_port, rank_offset,
  world_size}}`` — its workers join a NCCL group with the trainer (rank 0; the call returns once
  every member has joined);
- ``POST /start_weight_update``, ``POST /update_weights {"update_info": {names, dtype_names,
  shapes, packed}}`` (the workers receive the tensors the trainer broadcasts, in that order, and
  load them), ``POST /finish_weight_update`` (vLLM's layerwise reload lifecycle).

This module is the trainer's side: :class:`TransferGroup` holds one group with every worker of
the servers, and :func:`transfer_weights` makes every server serve the tensors it is given,
all or none, around vLLM's pause: pause, read what each holds, start, update (the HTTP calls in
threads while the trainer broadcasts), finish, label, resume, then the same confirmation as a
reload from disk.
A failure after the servers were paused puts back, from disk, the weights each held before
(their model may be half-updated) and resumes every server whatever happens.

The broadcast is vLLM's ``NCCLWeightTransferEngine.trainer_send_weights`` over the
``PyNcclCommunicator`` its ``trainer_init`` returns: the trainer process needs vLLM importable
and a CUDA device of its own (another GPU of the same host). NCCL cannot run without GPUs, so on
a CPU machine only the control plane is exercised (``tests/publishing/test_weight_transfer.py``,
with a communicator that hands the tensors to a stand-in server).
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx

from base.errors import DevModeMissing, WeightsError
from base.net import free_port
from base.vocab import PauseMode
from vllm_client.http import response_text, server_root
from vllm_client.weights import (
    PAUSE_MODES,
    Reload,
    base_weights_path,
    confirmed,
    pause,
    reload_weights,
    require_weight_labels,
    resume,
    set_weight_label,
    dev_post,
    together,
)

log = logging.getLogger("nextstate.publish")

#: the ``vllm serve`` argument that enables it
SERVE_ARGS = ("--weight-transfer-config", '{"backend": "nccl"}')


class Communicator(Protocol):
    """What :class:`TransferGroup` needs of the trainer's end of the group."""

    def send(self, tensors: Iterable[tuple[str, Any]]) -> None:
        """Broadcast each tensor (rank 0 → every worker), in order."""


class VllmNccl:
    """The trainer's end of vLLM's NCCL group (``trainer_init``, ``trainer_send_weights``) on this
    process's current CUDA device: :class:`TransferGroup`'s default communicator."""

    def __init__(self, init_info: dict[str, Any], packed: bool):
        from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

        self._engine = NCCLWeightTransferEngine
        self._packed = packed
        self.group = NCCLWeightTransferEngine.trainer_init(init_info)

    def send(self, tensors: Iterable[tuple[str, Any]]) -> None:
        self._engine.trainer_send_weights(iter(tensors), {"group": self.group, "packed": self._packed})


#: what a 404 from a weight-transfer route means
MISSING = (f"full weights over NCCL need vLLM >= 0.26 started with VLLM_SERVER_DEV_MODE=1 and {' '.join(SERVE_ARGS)} "
           "(`nextstate vllm serve --weight-transfer nccl`)")


def _cuda_device() -> int | None:
    """This thread's current CUDA device, where torch is loaded and has a GPU; else None."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return None
    return int(torch.cuda.current_device())


def _post(http: httpx.Client, url: str, path: str, what: str, **kw: Any) -> None:
    dev_post(http, url, path, what, missing=MISSING, **kw)


def world_size(http: httpx.Client, url: str) -> int:
    """How many workers of *url* join the group (``GET /get_world_size``)."""
    try:
        resp = http.get(f"{server_root(url)}/get_world_size")
    except httpx.HTTPError as exc:
        raise WeightsError(f"{url}: GET /get_world_size failed: {type(exc).__name__}: {exc}") from exc
    if resp.status_code == 404:
        raise DevModeMissing(f"{url} has no /get_world_size endpoint: {MISSING}")
    if resp.status_code != 200:
        raise WeightsError(f"{url}: GET /get_world_size failed: {response_text(resp)}")
    return int(resp.json()["world_size"])


def checkpoint_tensors(checkpoint: Path, device: str = "cuda") -> list[tuple[str, Any]]:
    """A ``save_pretrained`` checkpoint's tensors on *device*, by their checkpoint names (what
    vLLM's ``load_weights`` takes), file by file in name order. Needs ``safetensors``."""
    from safetensors.torch import load_file

    files = sorted(Path(checkpoint).glob("*.safetensors"))
    if not files:
        raise WeightsError(f"{checkpoint} has no *.safetensors weights to send")
    return [item for f in files for item in sorted(load_file(str(f), device=device).items())]


def tensor_meta(tensors: Sequence[tuple[str, Any]]) -> dict[str, Any]:
    """``update_info`` of *tensors*: names, dtype names (``bfloat16``) and shapes, in order."""
    return {"names": [n for n, _ in tensors],
            "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in tensors],
            "shapes": [list(t.shape) for _, t in tensors]}


class TransferGroup:
    """One NCCL group of this process (rank 0) and every worker of *urls*; :meth:`connect` once,
    then :func:`transfer_weights` for each version. *communicator*: how the trainer's end is
    made from the ``init_info`` (default: vLLM's, on this process's current CUDA device)."""

    def __init__(self, urls: Sequence[str], *, master_address: str = "127.0.0.1", master_port: int | None = None,
                 packed: bool = True, timeout_s: float = 300.0,
                 communicator: Callable[[dict[str, Any], bool], Communicator] = VllmNccl):
        if not urls:
            raise WeightsError("no vLLM server to transfer weights to")
        self.urls = list(urls)
        self.master_address = master_address
        self.master_port = master_port
        self.packed = packed
        self.timeout_s = timeout_s
        self._communicator = communicator
        self.comm: Communicator | None = None
        #: each server's base model directory (its ``/v1/models`` root), read when it joined: what
        #: a checkpoint is checked against (``publishing.publish.check_checkpoint``) without asking a
        #: server that answers behind every stream it serves
        self.base_paths: dict[str, str] = {}

    def connect(self) -> TransferGroup:
        """Ask each server's workers to join (``/init_weight_transfer_engine``, in threads: each
        call returns only once the trainer has joined too) while this process joins as rank 0.

        Each server is first checked to take full weights at all (dev mode; not a vLLM that dies
        reloading with LoRA: :func:`require_weight_labels`), and its base directory is kept
        (:attr:`base_paths`). Once here rather than before every transfer: both hold for the life of
        the server's process, and a restarted vLLM leaves the group anyway (its workers joined the
        old one), so a new group reads them again."""
        if self.comm is not None:
            return self
        port = self.master_port or free_port(self.master_address)
        with httpx.Client(timeout=httpx.Timeout(self.timeout_s, connect=5.0), trust_env=False) as http:
            checked = together(*(functools.partial(require_weight_labels, http, url) for url in self.urls),
                               *(functools.partial(base_weights_path, http, url) for url in self.urls))
            bases = checked[len(self.urls):]
            sizes = [world_size(http, url) for url in self.urls]
            world = 1 + sum(sizes)
            offsets = [1 + sum(sizes[:i]) for i in range(len(sizes))]  # each server's first rank
            info = {"master_address": self.master_address, "master_port": port, "world_size": world}
            self.comm = self._join(http, info, offsets)
            self.base_paths = dict(zip(self.urls, bases, strict=True))
        log.info("NCCL weight-transfer group of %d (this process and %s) on %s:%d", world,
                 ", ".join(f"{u}: {s}" for u, s in zip(self.urls, sizes, strict=True)), self.master_address, port)
        return self

    def _join(self, http: httpx.Client, info: dict[str, Any], offsets: Sequence[int]) -> Communicator:
        """This process's end of the group, made while every server's workers are asked to join.

        NCCL's rendezvous waits for every member: a server whose join fails (its answer an error)
        would leave this process waiting forever, so its end is made in a thread of its own and
        the first failed join, or *timeout_s* without a group, ends the wait with the reason. The
        thread left waiting is a daemon; a later :meth:`connect` makes a new group on a new port."""
        made: Future[Communicator] = Future()
        device = _cuda_device()  # CUDA's current device is per thread: the new one starts on device 0

        def make() -> None:
            try:
                if device is not None:
                    sys.modules["torch"].cuda.set_device(device)
                made.set_result(self._communicator(info, self.packed))
            except BaseException as exc:  # noqa: BLE001 -- handed to the waiting thread
                made.set_exception(exc)

        pool = ThreadPoolExecutor(len(self.urls))
        # a server's join answers once the whole group formed: its read may not end before the deadline
        # below does, or a group that never forms reads as that server's timeout instead of who was missing
        patient = httpx.Timeout(self.timeout_s + 10.0, connect=5.0)
        try:
            joins = {pool.submit(_post, http, url, "/init_weight_transfer_engine", "joining the NCCL group",
                                 json={"init_info": info | {"rank_offset": offset}}, timeout=patient): url
                     for url, offset in zip(self.urls, offsets, strict=True)}
            threading.Thread(target=make, name="nccl-join", daemon=True).start()
            deadline = time.monotonic() + self.timeout_s
            every = [made, *joins]
            while True:
                failed = [f for f in every if f.done() and f.exception() is not None]
                if failed:  # this process's end first: the servers' joins then fail for want of it
                    raise failed[0].exception()  # type: ignore[misc]
                waiting = [f for f in every if not f.done()]
                if not waiting:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    names = [joins.get(f, "this process") for f in waiting]
                    raise WeightsError(f"the NCCL group did not form within {self.timeout_s:g} s: still waiting for "
                                       f"{', '.join(names)} (port {info['master_port']})")
                wait(waiting, timeout=left, return_when=FIRST_COMPLETED)
            return made.result()
        finally:
            pool.shutdown(wait=False, cancel_futures=True)

    def send(self, http: httpx.Client, tensors: Sequence[tuple[str, Any]]) -> None:
        """``/update_weights`` to every server (in threads) while the tensors are broadcast."""
        if self.comm is None:
            raise WeightsError("the NCCL group is not connected (TransferGroup.connect)")
        update = tensor_meta(tensors) | {"packed": self.packed}
        with ThreadPoolExecutor(len(self.urls)) as pool:
            calls = [pool.submit(_post, http, url, "/update_weights", "update_weights", json={"update_info": update})
                     for url in self.urls]
            try:
                self.comm.send(tensors)
            finally:
                errors = [f.exception() for f in calls]
        failed = [e for e in errors if e is not None]
        if failed:
            raise failed[0]


@dataclass(frozen=True)
class NcclWeights:
    """A full version's weights to send over NCCL (``PublishRequest.transfer``): the connected
    *group* and *tensors*, a callable that returns ``(checkpoint name, tensor)`` pairs on the
    trainer's GPU, in the order they are sent."""

    group: TransferGroup
    tensors: Callable[[], Sequence[tuple[str, Any]]]


def transfer_weights(group: TransferGroup, tensors: Sequence[tuple[str, Any]], label: str, *,
                     held: Callable[[httpx.Client, str], tuple[str, str]],
                     pause_mode: str = PauseMode.KEEP, served_name: str | None = None,
                     digest: bool = True) -> list[Reload]:
    """Every server of *group* serves *tensors* (``(name, tensor)``, the checkpoint's names) as
    *label*: pause (``keep`` by default: streams in flight freeze and continue after), read what
    each holds, start, update while broadcasting, finish, label, resume; then confirm each as
    :func:`vllm_client.weights.reload_one` does. ``held(http, url)`` says ``(label, checkpoint
    directory)`` of what *url* holds now: on a failure after the pause, each server reloads it
    from disk before it resumes, and the error is raised. Returns one :class:`Reload` per server
    (``reload_s``: start to finish, the transfer included; ``before_s``: the pause and the reads).

    What a server holds is read once it is paused: before, its API server answers behind every
    stream it serves (1.0 s p50 under 200 streams on an H200, ``publish_load.py``); paused, it has
    none to serve. Whether it takes full weights at all was checked when the group connected."""
    if pause_mode not in PAUSE_MODES:
        raise ValueError(f"pause_mode must be one of {PAUSE_MODES}, not {pause_mode!r}")
    urls = group.urls
    results = {url: Reload(url=url, label=label, path="nccl") for url in urls}
    started = time.perf_counter()
    with httpx.Client(timeout=httpx.Timeout(group.timeout_s, connect=5.0), trust_env=False) as http:
        paused: list[str] = []
        try:
            for url in urls:
                pause(http, url, pause_mode)
                paused.append(url)
                results[url].pause_s = time.perf_counter() - started
            before = dict(zip(urls, together(*(functools.partial(held, http, url) for url in urls))))
            before_s = time.perf_counter() - started
            for result in results.values():
                result.before_s = before_s
            begun = time.perf_counter()
            try:
                for url in urls:
                    _post(http, url, "/start_weight_update", "start_weight_update")
                group.send(http, tensors)
                for url in urls:
                    _post(http, url, "/finish_weight_update", "finish_weight_update")
                    set_weight_label(http, url, label)
            except WeightsError as exc:
                _put_back(http, before, exc)
                raise
            for url in urls:
                results[url].reload_s = time.perf_counter() - begun
        finally:
            for url in paused:
                resume(http, url)
        for url in urls:
            results[url].total_s = time.perf_counter() - started
        together(*(functools.partial(confirmed, http, results[url], served_name, what=f"sent {label} over NCCL",
                                     digest=digest) for url in urls))
    log.info("sent %d tensors over NCCL to %s as %s in %.3fs", len(tensors), ", ".join(urls), label,
             max(r.total_s for r in results.values()))
    return [results[url] for url in urls]


def _put_back(http: httpx.Client, before: dict[str, tuple[str, str]], exc: WeightsError) -> None:
    """After a failed transfer: every server reloads, from disk, the weights it held."""
    for url, (label, path) in before.items():
        try:
            reload_weights(http, url, path, label)
        except WeightsError as again:
            raise WeightsError(f"{exc}; putting back {path} on {url} failed too ({again}): the server's model is "
                               "broken, restart it") from exc
        log.warning("%s: the NCCL transfer failed, put back %s: %s", url, path, exc)
