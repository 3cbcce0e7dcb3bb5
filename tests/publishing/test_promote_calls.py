"""A promotion or rollback touches the pool once and the model servers once: one short read of the
pool, then the servers switched, then one short transaction that records it — no pool lookups
before the read (is it the base?) nor while the servers switch (which checkpoint did a server
hold?), on both databases.

The servers are a fake vLLM on ``httpx.MockTransport`` that answers the routes
``vllm_client`` calls (``/v1/models``, ``/v1/load_lora_adapter``, ``/weight_info``, ``/pause``,
``/collective_rpc``, ``/update_weight_version``, ``/resume``, ``/is_paused``, a completion) as
vLLM 0.32 in dev mode does; counting calls into a real vLLM would only add minutes.
tests/publishing/test_publish.py and test_publish_full.py switch real servers."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from sqlalchemy import event

from base.settings import Settings
from base.vocab import VersionKind
from datapool.db import make_engine
from datapool.versions import register
from gateway import actions
from publishing import publish

BASE_MODEL = "smollm2"
URL = "http://vllm.test:8000/v1"


class FakeVLLM:
    """One vLLM server's admin routes, recording each call on *timeline* as ``"servers"``."""

    def __init__(self, timeline: list[str], label: str = "default") -> None:
        self.timeline = timeline
        self.label = label  # the weights it holds, by version name ("default": its --model)
        self.adapters: dict[str, str] = {}
        self.transport = httpx.MockTransport(self.answer)

    def answer(self, request: httpx.Request) -> httpx.Response:
        self.timeline.append("servers")
        route = (request.method, request.url.path)
        body = json.loads(request.content) if request.content else {}
        if route == ("GET", "/v1/models"):
            cards = [{"id": BASE_MODEL, "root": "/models/base", "parent": None}]
            cards += [{"id": n, "root": p, "parent": BASE_MODEL} for n, p in self.adapters.items()]
            return httpx.Response(200, json={"data": cards})
        if route == ("POST", "/v1/load_lora_adapter"):
            self.adapters[body["lora_name"]] = body["lora_path"]
            return httpx.Response(200, text="ok")
        if route == ("GET", "/weight_info"):
            return httpx.Response(200, json={"weight_version": self.label})
        if route == ("GET", "/version"):
            return httpx.Response(200, json={"version": "0.32.0"})
        if route == ("POST", "/update_weight_version"):
            self.label = body["new_version"]
            return httpx.Response(200, json={})
        if route == ("GET", "/is_paused"):
            return httpx.Response(200, json={"is_paused": False})
        if route in {("POST", "/pause"), ("POST", "/resume"), ("POST", "/collective_rpc"),
                     ("POST", "/v1/completions")}:
            return httpx.Response(200, json={"results": [None]} if "collective" in route[1] else {})
        return httpx.Response(404, json={"detail": "Not Found"})


@pytest.fixture
def timeline() -> list[str]:
    return []


@pytest.fixture
def server(timeline: list[str], monkeypatch: pytest.MonkeyPatch) -> FakeVLLM:
    fake = FakeVLLM(timeline)
    real_client = httpx.Client

    class Client(real_client):  # type: ignore[misc,valid-type]
        def __init__(self, *a: Any, **kw: Any) -> None:
            kw["transport"] = fake.transport
            super().__init__(*a, **kw)

    def post(url: str, **kw: Any) -> httpx.Response:  # vllm_client.weights' fresh-connection POSTs
        kw.pop("trust_env", None)
        with Client(timeout=kw.pop("timeout", None)) as http:
            return http.post(url, **kw)

    monkeypatch.setattr(httpx, "Client", Client)
    monkeypatch.setattr(httpx, "post", post)
    return fake


@pytest.fixture
def pool(database_url: str, timeline: list[str], tmp_path: Path) -> Any:
    """The pool with versions ``lora1`` (active), ``lora2``, ``full1`` and ``full2`` (candidates);
    every connection checkout recorded on *timeline* as ``"pool"`` (one per session)."""
    engine = make_engine(database_url)
    for name, kind in (("lora1", VersionKind.LORA), ("lora2", VersionKind.LORA),
                       ("full1", VersionKind.FULL), ("full2", VersionKind.FULL)):
        path = tmp_path / name
        path.mkdir()
        if kind == VersionKind.LORA:
            (path / "adapter_config.json").write_text("{}")
        else:
            (path / "config.json").write_text("{}")
            (path / "model.safetensors").write_bytes(b"")
        register(engine, name=name, kind=kind, base_model=BASE_MODEL, path=path, parent_id=None,
                 activate=name == "lora1", stats={}, actor="test", reason=None, metrics={})
    event.listen(engine, "checkout", lambda *_: timeline.append("pool"))
    yield engine
    engine.dispose()


def calls(timeline: list[str]) -> list[str]:
    """*timeline* with each run of server calls as one entry; empties it."""
    out = [c for i, c in enumerate(timeline) if c == "pool" or i == 0 or timeline[i - 1] != c]
    timeline.clear()
    return out


def test_promote_and_rollback_touch_the_pool_once_and_the_servers_once(
        pool: Any, server: FakeVLLM, timeline: list[str]) -> None:
    # a LoRA version: the adapter loaded, then recorded
    assert publish.activate(pool, "lora2", [URL])["name"] == "lora2"
    assert calls(timeline) == ["pool", "servers", "pool"]
    assert "lora2" in server.adapters
    # a full version's weights, on a server that holds another's: which checkpoint it held (to
    # put back on failure) comes from the one read, not from a lookup while the servers reload
    server.label = "full1"
    switched = publish.promote(pool, "full2", [URL])
    assert calls(timeline) == ["pool", "servers", "pool"]
    assert server.label == "full2" and switched.active["name"] == "full2" and switched.previous == "lora2"
    # the base model, by name
    assert publish.activate(pool, "base", [URL]) is None
    assert calls(timeline) == ["pool", "servers", "pool"]
    assert server.label == "base"
    # a rollback to a named version and a plain one (the newest retired, older than the active one)
    assert publish.rollback(pool, [URL], to="full2")["active"]["name"] == "full2"
    assert calls(timeline) == ["pool", "servers", "pool"]
    result = publish.rollback(pool, [URL])
    assert result == {"active": result["active"], "rolled_back": ["full2"]} and result["active"]["name"] == "lora2"
    assert calls(timeline) == ["pool", "servers", "pool"]


def test_a_refused_switch_touches_no_server(pool: Any, server: FakeVLLM, timeline: list[str]) -> None:
    with pytest.raises(publish.PublishError, match="active version already"):
        publish.rollback(pool, [URL], to="lora1")
    with pytest.raises(publish.PublishError, match="no policy version"):
        publish.activate(pool, "nope", [URL])
    assert calls(timeline) == ["pool", "pool"]


def test_the_admin_promote_reads_the_previous_version_from_the_switch(
        pool: Any, server: FakeVLLM, timeline: list[str]) -> None:
    """The UI's and the API's promote (gateway.actions) makes the same one call: the version it
    replaced comes back from the recording transaction, not from a read before it."""
    gw = SimpleNamespace(engine=pool, settings=Settings(upstream_url=URL))
    assert asyncio.run(actions.promote(gw, "lora2", actor="admin")) == {"active": "lora2", "previous": "lora1"}  # type: ignore[arg-type]
    assert calls(timeline) == ["pool", "servers", "pool"]
    assert asyncio.run(actions.promote(gw, "lora2", actor="admin")) == {"active": "lora2", "previous": "lora2"}  # type: ignore[arg-type]
    assert calls(timeline) == ["pool", "servers", "pool"]
