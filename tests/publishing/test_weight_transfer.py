"""Full weights over NCCL, the control plane: ``vllm_client.transfer`` and ``publish`` with a
``transfer`` drive vLLM's weight-transfer routes in the order vLLM's layerwise reload needs
(pause, start, update while the trainer broadcasts, finish, label, resume), and a transfer that
fails puts back, from disk, the weights each server held before it resumes.

NCCL needs GPUs, so the server here is a stand-in on real HTTP that replays the documented routes
of vLLM 0.26's dev mode with ``--weight-transfer-config '{"backend": "nccl"}'``
(``vllm/entrypoints/serve/dev/rlhf/api_router.py``: ``/get_world_size``,
``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights``,
``/finish_weight_update``; ``/pause``, ``/resume``, ``/is_paused``, ``/collective_rpc``), and the
broadcast is a communicator that hands the tensors to it. The GPU run is
``benchmarks/gpu/publish_load.py --kind full --transfer nccl``.
"""

from __future__ import annotations

import asyncio
import json
import queue
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from base.errors import DevModeMissing, PublishError, WeightsError
from base.vocab import VersionKind
from tests.support.processes import free_port

torch = pytest.importorskip("torch")

from datapool.db import make_engine, upgrade  # noqa: E402
from datapool.versions import active_version  # noqa: E402
from publishing.publish import PublishRequest, publish  # noqa: E402
from vllm_client.transfer import NcclWeights, TransferGroup, transfer_weights  # noqa: E402
from vllm_client.weights import weight_label  # noqa: E402


class StandIn:
    """One vLLM server's weight-transfer routes: what it was asked, in order, and the weights it
    holds (name → tensor) after each update. ``fail_update``: ``/update_weights`` answers 500
    once the tensors arrived (a worker that failed to load them)."""

    def __init__(self, base_dir: Path, workers: int = 1):
        self.calls: list[str] = []
        self.weights: dict[str, Any] = {}
        self.label = "default"
        self.paused = False
        self.joined = threading.Event()
        self.wire: queue.Queue[tuple[str, Any]] = queue.Queue()
        self.workers = workers
        self.fail_update = False
        self.fail_join: str | None = None  # /init_weight_transfer_engine answers 500 with this (workers that failed)
        self.staged: dict[str, Any] | None = None
        self.reloaded: list[tuple[str, str]] = []
        self.labels_read_paused: list[bool] = []  # for each GET /weight_info: was the server paused
        self.lora = False  # started with --enable-lora (its /server_info says so)
        self.model_reads = 0  # GET /v1/models: behind every stream a busy vLLM serves
        self.checksums = False  # a vLLM with /weight_checker (0.26 has none: 404)
        self.meet: threading.Barrier | None = None  # the completion and the checksum wait for each other
        app = FastAPI()
        self.app = app

        @app.get("/get_world_size")
        def get_world_size() -> dict[str, int]:
            return {"world_size": self.workers}

        @app.post("/init_weight_transfer_engine")
        async def init(request: Request) -> dict[str, str]:
            body = await request.json()
            self.calls.append(f"init {json.dumps(body['init_info'], sort_keys=True)}")
            if self.fail_join:
                return JSONResponse({"error": self.fail_join}, status_code=500)  # type: ignore[return-value]
            # vLLM's call returns once every member joined: here, once the trainer's end exists
            for _ in range(200):
                if self.joined.is_set():
                    return {"message": "Weight transfer initialized"}
                await asyncio.sleep(0.01)
            return JSONResponse({"error": "the trainer never joined"}, status_code=500)  # type: ignore[return-value]

        @app.post("/pause")
        def pause(mode: str = "wait") -> dict[str, str]:
            self.calls.append(f"pause {mode}")
            self.paused = True
            return {}

        @app.post("/resume")
        def resume() -> dict[str, str]:
            self.calls.append("resume")
            self.paused = False
            return {}

        @app.get("/is_paused")
        def is_paused() -> dict[str, bool]:
            return {"is_paused": self.paused}

        @app.post("/start_weight_update")
        def start() -> dict[str, str]:
            self.calls.append("start")
            self.staged = {}
            return {}

        @app.post("/update_weights")
        def update(body: dict[str, Any]) -> Response:
            info = body["update_info"]
            self.calls.append(f"update {len(info['names'])} packed={info['packed']}")
            assert self.staged is not None, "update_weights before start_weight_update"
            for name, dtype, shape in zip(info["names"], info["dtype_names"], info["shapes"], strict=True):
                got_name, tensor = self.wire.get(timeout=10)  # what the trainer broadcast, in order
                assert (got_name, str(tensor.dtype), list(tensor.shape)) == (name, f"torch.{dtype}", shape)
                self.staged[name] = tensor.clone()
            if self.fail_update:
                return JSONResponse({"error": "a worker failed loading"}, status_code=500)
            return JSONResponse({"message": "Weights updated"})

        @app.post("/finish_weight_update")
        def finish() -> dict[str, str]:
            self.calls.append("finish")
            assert self.staged is not None
            self.weights, self.staged = {**self.weights, **self.staged}, None
            return {}

        @app.post("/update_weight_version")
        def set_label(body: dict[str, Any]) -> dict[str, str]:
            self.calls.append(f"label {body['new_version']}")
            self.label = body["new_version"]
            return {}

        @app.get("/weight_info")
        def weight_info() -> dict[str, str]:
            self.labels_read_paused.append(self.paused)
            return {"weight_version": self.label}

        @app.get("/server_info")
        def server_info() -> dict[str, Any]:
            return {"vllm_config": {"lora_config": {"max_lora_rank": 16} if self.lora else None}}

        @app.post("/collective_rpc")
        def rpc(body: dict[str, Any]) -> dict[str, Any]:
            assert body["method"] == "reload_weights"
            path = body["kwargs"]["weights_path"]
            self.calls.append(f"reload {path}")
            self.reloaded.append((path, self.label))
            self.staged = None
            return {"results": [None]}

        @app.get("/version")
        def version() -> dict[str, str]:
            return {"version": "0.26.0"}

        @app.get("/v1/models")
        def models() -> dict[str, Any]:
            self.model_reads += 1
            return {"data": [{"id": "smollm2", "root": str(base_dir), "parent": None}]}

        @app.post("/v1/completions")
        def completions() -> dict[str, Any]:
            self.calls.append("completion")
            if self.meet is not None:
                self.meet.wait()
            return {"choices": [{"text": "!"}]}

        @app.post("/weight_checker")
        def weight_checker() -> Any:
            if not self.checksums:
                return JSONResponse({"detail": "Not Found"}, status_code=404)
            if self.meet is not None:
                self.meet.wait()
            return {"checksums": {name: str(hash(str(t.tolist()))) for name, t in sorted(self.weights.items())}}

    def communicator(self, info: dict[str, Any], packed: bool) -> Any:
        """The trainer's end: joins (so that ``/init_weight_transfer_engine`` returns) and hands
        each broadcast tensor to the server."""
        stand_in = self

        class Comm:
            def send(self, tensors: Any) -> None:
                for name, tensor in tensors:
                    stand_in.wire.put((name, tensor))

        self.calls.append(f"trainer joins {info['world_size']} packed={packed}")
        self.joined.set()
        return Comm()


@pytest.fixture()
def server(tmp_path: Path) -> Iterator[tuple[StandIn, str]]:
    stand_in = StandIn(tmp_path / "on-another-host")  # the server's base: not readable here, as over the network
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(stand_in.app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.02)
    yield stand_in, f"http://127.0.0.1:{port}/v1"
    srv.should_exit = True
    thread.join(5)


def _tensors() -> list[tuple[str, Any]]:
    torch.manual_seed(0)
    return [("model.layers.0.self_attn.q_proj.weight", torch.randn(4, 4, dtype=torch.bfloat16)),
            ("model.norm.weight", torch.randn(4))]


def test_the_transfer_runs_vllms_update_lifecycle_inside_a_pause(server: tuple[StandIn, str]) -> None:
    stand_in, url = server
    group = TransferGroup([url], master_port=29555, communicator=stand_in.communicator).connect()
    assert stand_in.calls == [
        'init {"master_address": "127.0.0.1", "master_port": 29555, "rank_offset": 1, "world_size": 2}',
        "trainer joins 2 packed=True"] or stand_in.calls == [
        "trainer joins 2 packed=True",
        'init {"master_address": "127.0.0.1", "master_port": 29555, "rank_offset": 1, "world_size": 2}']
    stand_in.calls.clear()
    sent = _tensors()
    held_when: list[str] = []

    def held(http: httpx.Client, u: str) -> tuple[str, str]:  # what the server holds: read once it is paused
        held_when.append("paused" if stand_in.paused else "serving")
        return "default", "/models/base"

    (result,) = transfer_weights(group, sent, "v1", held=held, served_name="smollm2")
    assert stand_in.calls == ["pause keep", "start", "update 2 packed=True", "finish", "label v1", "resume",
                              "completion"]
    # behind 200 streams an unpaused vLLM answers these reads in ~1 s; paused, it has nothing else to do
    assert held_when == ["paused"] and result.pause_s <= result.before_s <= result.total_s
    for name, tensor in sent:
        assert torch.equal(stand_in.weights[name], tensor)
    assert (stand_in.label, stand_in.paused, result.label, result.path) == ("v1", False, "v1", "nccl")
    assert 0 <= result.pause_s <= result.total_s and result.reload_s <= result.total_s


def test_the_confirmation_and_the_checksum_are_asked_at_once(server: tuple[StandIn, str]) -> None:
    """After the resume, the one-token completion and the weights' checksum each answer behind
    every stream the server serves: asked one after the other their waits added up. Here each
    answers only once the other has been asked (a barrier of two), so asked in turn the first
    times out and the transfer fails."""
    stand_in, url = server
    group = TransferGroup([url], communicator=stand_in.communicator).connect()
    stand_in.checksums, stand_in.meet = True, threading.Barrier(2, timeout=5)
    (result,) = transfer_weights(group, _tensors(), "v1", held=lambda http, u: ("default", "/models/base"),
                                 served_name="smollm2")
    assert result.digest is not None and result.confirm_s > 0 and result.digest_s > 0
    assert stand_in.calls[-2:] == ["resume", "completion"] and not stand_in.meet.broken


def test_a_failed_transfer_puts_back_what_the_server_held_and_resumes(server: tuple[StandIn, str]) -> None:
    """A worker that fails to load the tensors: the half-updated model gets the weights it held
    from disk (``reload_weights`` of the held version's checkpoint) before the server resumes."""
    stand_in, url = server
    group = TransferGroup([url], communicator=stand_in.communicator).connect()
    stand_in.label = "full-old"
    stand_in.fail_update = True
    stand_in.calls.clear()
    with pytest.raises(WeightsError, match="update_weights failed"):
        transfer_weights(group, _tensors(), "v2", held=lambda http, u: ("full-old", "/store/full-old"))
    assert stand_in.calls == ["pause keep", "start", "update 2 packed=True", "reload /store/full-old",
                              "label full-old", "resume"]
    assert (stand_in.label, stand_in.paused, stand_in.weights) == ("full-old", False, {})


def test_a_server_that_cannot_take_full_weights_is_refused_when_the_group_connects(
        server: tuple[StandIn, str]) -> None:
    """vLLM 0.26 with LoRA enabled dies reloading full weights: refused once, before its workers
    join a group, so that no transfer ever pauses it; the same server without LoRA joins, and its
    label is not read again before each transfer."""
    stand_in, url = server
    stand_in.lora = True
    with pytest.raises(WeightsError, match="with LoRA enabled"):
        TransferGroup([url], communicator=stand_in.communicator).connect()
    assert stand_in.calls == [] and not stand_in.paused
    stand_in.lora = False
    group = TransferGroup([url], communicator=stand_in.communicator).connect()
    assert stand_in.labels_read_paused == [False, False]  # at each connect, while serving
    stand_in.labels_read_paused.clear()
    transfer_weights(group, _tensors(), "v1", held=lambda http, u: (weight_label(http, u) or "", "/models/base"),
                     digest=False)
    assert stand_in.labels_read_paused[0] is True  # what it holds, read once paused (then the confirmation's)


def test_a_server_whose_workers_cannot_join_ends_the_connect_with_its_reason(server: tuple[StandIn, str]) -> None:
    """NCCL's rendezvous waits for every member: a server whose join answers an error (its workers
    failed to join) left this process's end waiting for ever, with nothing said. Here the trainer's
    end never returns (as NCCL's does not while a member is missing) and the server answers 500:
    the connect fails at once with the server's reason, and the group stays unconnected."""
    stand_in, url = server
    stand_in.fail_join = "NCCL error: unhandled cuda error (out of memory)"
    release = threading.Event()
    group = TransferGroup([url], communicator=lambda info, packed: release.wait(60), timeout_s=30)
    t0 = time.monotonic()
    with pytest.raises(WeightsError, match="out of memory"):
        group.connect()
    release.set()
    assert time.monotonic() - t0 < 10 and group.comm is None


def test_the_trainers_end_is_made_on_the_callers_cuda_device(server: tuple[StandIn, str],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The trainer's end is made in a thread of its own, and CUDA's current device is per thread
    (a new one starts on device 0): it is made on the device the caller had current. A stand-in
    of torch's CUDA calls records where ``set_device`` was called from."""
    stand_in, url = server
    seen: list[tuple[int, str]] = []

    class Cuda:
        @staticmethod
        def is_available() -> bool:
            return True

        @staticmethod
        def current_device() -> int:
            return 1

        @staticmethod
        def set_device(device: int) -> None:
            seen.append((device, threading.current_thread().name))

    monkeypatch.setitem(sys.modules, "torch", type("Torch", (), {"cuda": Cuda}))
    TransferGroup([url], communicator=stand_in.communicator).connect()
    assert seen == [(1, "nccl-join")]


def test_a_group_that_never_forms_ends_at_the_timeout(server: tuple[StandIn, str]) -> None:
    """Neither end fails and neither finishes (a member that never arrives): the connect ends after
    ``timeout_s`` saying who it still waited for."""
    stand_in, url = server
    release = threading.Event()
    group = TransferGroup([url], communicator=lambda info, packed: release.wait(60), timeout_s=1)
    t0 = time.monotonic()
    with pytest.raises(WeightsError, match=r"did not form within 1 s: still waiting for .*this process"):
        group.connect()
    release.set()
    assert time.monotonic() - t0 < 10 and group.comm is None


def test_a_server_without_the_routes_is_told_how_to_start_vllm(tmp_path: Path) -> None:
    app = FastAPI()
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    while not srv.started:
        time.sleep(0.02)
    try:
        with pytest.raises(DevModeMissing, match="VLLM_SERVER_DEV_MODE=1"):
            TransferGroup([f"http://127.0.0.1:{port}/v1"], communicator=lambda i, p: None).connect()
        with pytest.raises(WeightsError, match="not connected"):
            TransferGroup([f"http://127.0.0.1:{port}/v1"]).send(httpx.Client(), _tensors())
    finally:
        srv.should_exit = True
        thread.join(5)


def _checkpoint(directory: Path) -> Path:
    from safetensors.torch import save_file

    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 4}))
    save_file({name: t.float() for name, t in _tensors()}, str(directory / "model.safetensors"))
    return directory


def test_publish_sends_a_full_version_over_nccl_and_registers_it(server: tuple[StandIn, str], tmp_path: Path) -> None:
    """``publish`` with a transfer: the checkpoint is checked and placed in the store as for a
    reload (promotion and rollback reload it from there), the servers get the tensors over the
    group, and only then is the version active; the event says how it was sent."""
    stand_in, url = server
    pool = f"sqlite:///{tmp_path / 'pool.db'}"
    upgrade(pool)
    engine = make_engine(pool)
    group = TransferGroup([url], communicator=stand_in.communicator).connect()
    assert group.base_paths == {url: str(tmp_path / "on-another-host")}  # read when it joined
    sent = _tensors()
    stand_in.calls.clear()
    stand_in.model_reads = 0
    version = publish(engine, PublishRequest(
        directory=_checkpoint(tmp_path / "ckpt"), base_model="smollm2", vllm_urls=[url], name="full-nccl-1",
        kind=VersionKind.FULL, store=tmp_path / "store", transfer=NcclWeights(group, lambda: sent)))
    assert version["status"] == "active" and active_version(engine)["name"] == "full-nccl-1"
    assert Path(version["path"]).parent == tmp_path / "store" and (Path(version["path"]) / "config.json").is_file()
    assert "start" in stand_in.calls and "reload" not in " ".join(stand_in.calls)
    assert stand_in.model_reads == 0  # the checkpoint was checked against the base the group read
    assert stand_in.label == "full-nccl-1" and torch.equal(stand_in.weights[sent[0][0]], sent[0][1])
    # where publish()'s time went, step by step, kept in its event (benchmarks/gpu/publish_load.py splits by it)
    from benchmarks.gpu.publish_load import event_metrics, reload_parts

    metrics = event_metrics(engine, "full-nccl-1")
    phases = metrics["phases_s"]
    assert set(phases) == {"check_s", "place_s", "serve_s"} and all(v >= 0 for v in phases.values())
    parts = reload_parts(metrics)  # and the server's own steps around the transfer
    assert set(parts) == {"pause_s", "before_s", "reload_s", "confirm_s", "digest_s"}
    assert parts["confirm_s"] > 0 and 0 < parts["pause_s"] <= parts["before_s"] and parts["reload_s"] > 0
    # a group made for other servers is refused before anything is paused
    other = TransferGroup(["http://127.0.0.1:9/v1"], communicator=stand_in.communicator)
    stand_in.calls.clear()
    with pytest.raises(PublishError, match="NCCL group holds"):
        publish(engine, PublishRequest(
            directory=_checkpoint(tmp_path / "ckpt2"), base_model="smollm2", vllm_urls=[url], name="full-nccl-2",
            kind=VersionKind.FULL, store=tmp_path / "store", transfer=NcclWeights(other, lambda: sent)))
    assert stand_in.calls == []
    assert active_version(engine)["name"] == "full-nccl-1"
    engine.dispose()


def test_a_checkpoints_tensors_are_read_by_their_names(tmp_path: Path) -> None:
    from vllm_client.transfer import checkpoint_tensors

    got = dict(checkpoint_tensors(_checkpoint(tmp_path / "ckpt"), device="cpu"))
    assert sorted(got) == sorted(name for name, _ in _tensors())
    for name, tensor in _tensors():
        assert torch.equal(got[name], tensor.float())
    with pytest.raises(WeightsError, match="no \\*.safetensors"):
        checkpoint_tensors(tmp_path, device="cpu")


def test_train_refuses_nccl_where_no_full_version_is_published() -> None:
    from click.testing import CliRunner

    from nextstate.cli import main

    for args in (["--weight-transfer", "nccl"], ["--full", "--no-publish", "--weight-transfer", "nccl"]):
        result = CliRunner().invoke(main, ["train", "--objective", "rl", *args])
        assert result.exit_code == 2 and "needs --full and --publish" in result.output
