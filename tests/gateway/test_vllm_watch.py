"""A vLLM upstream that dies and comes back, seen from a real gateway: requests get 503 with
Retry-After in the client's dialect and are recorded as error turns, /readyz and /metrics say
so, and the next request after the restart is served (the LoRA reload into a restarted real
vLLM is measured by benchmarks/chaos.py and tests/nextstate/test_up.py)."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.support.upstream import UpstreamProcess
from tests.support.processes import GatewayProcess, wait_for


def test_a_dead_upstream_is_503_with_retry_after_and_served_again_once_back(tmp_path: Path) -> None:
    upstream = UpstreamProcess(tmp_path / "upstream.log").start()
    try:
        with GatewayProcess(tmp_path, database_url=f"sqlite:///{tmp_path / 'pool.db'}",
                            upstream_url=upstream.base_url) as gw, httpx.Client(timeout=30) as http:
            chat = {"model": "fixed", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
            assert http.post(f"{gw.base_url}/chat/completions", json=chat).status_code == 200
            upstream.stop()
            r = http.post(f"{gw.base_url}/chat/completions", json=chat)
            assert r.status_code == 503 and r.headers["retry-after"] == "2", r.text
            assert r.json()["error"]["code"] == "upstream_unavailable"
            turn = gw.stored_turn(r.headers["x-turn-id"])
            assert turn["status"] == "error" and turn["error"]["status"] == 503
            r = http.post(f"{gw.base_url}/responses", json={"model": "fixed", "input": "hi"})
            assert r.status_code == 503 and r.headers["retry-after"] == "2"
            assert r.json()["error"]["type"] == "service_unavailable"
            r = http.post(f"{gw.base_url}/messages", json={"model": "fixed", "max_tokens": 2,
                                                           "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 529 and r.headers["retry-after"] == "2"
            assert r.json() == {"type": "error", "error": {"type": "overloaded_error",
                                                          "message": r.json()["error"]["message"]}}
            ready = http.get(f"{gw.url}/readyz")
            assert ready.status_code == 503
            assert "nextstate_upstream_up{upstream=" in http.get(f"{gw.url}/metrics").text

            upstream.start()
            wait_for(lambda: http.get(f"{gw.url}/readyz").status_code == 200, timeout=30)
            assert http.post(f"{gw.base_url}/chat/completions", json=chat).status_code == 200
            base = upstream.base_url
            # the watch looks once a second, on its own: /readyz may see the server first
            up = f'nextstate_upstream_up{{upstream="{base}"}} 1.0'
            metrics = wait_for(lambda: m if up in (m := http.get(f"{gw.url}/metrics").text) else None, timeout=30)
            assert f'nextstate_upstream_restarts_total{{upstream="{base}"}} 1.0' in metrics
    finally:
        upstream.stop()


def test_a_version_activated_while_the_watch_loads_the_last_one_is_not_refused() -> None:
    """The watch found the active version `a` missing (a restart, or an unload) and is loading
    it; meanwhile `b` is activated (its activation loaded it everywhere). A request for `b` goes
    through; one for `a` while it is still `a`'s turn to load gets the 503; a 404 for `b` later
    makes `b` the one being loaded."""
    import pytest

    from base.errors import RequestError
    from gateway.metrics import Metrics
    from gateway.upstream import ActiveVersion
    from gateway.vllm_watch import State, VLLMWatch

    active = [ActiveVersion("a")]
    watch = VLLMWatch(None, None, Metrics(), bases=dict, active=lambda: active[0])  # type: ignore[arg-type]
    base = "http://vllm:8000/v1"
    watch._set(base, State.LOADING, "the active version a is not loaded", "a")
    with pytest.raises(RequestError, match="loading the active version a"):
        watch.refuse(base, "a", "policy")
    active[0] = ActiveVersion("b")
    watch.refuse(base, "b", "policy")  # b was loaded by its activation: not refused
    watch.mark_loading(base)  # ... unless vLLM answers 404 for it after all
    with pytest.raises(RequestError, match="loading the active version b"):
        watch.refuse(base + "/", "b", "policy")
    watch._set(base, State.OK, "the active version b loaded")
    watch.refuse(base, "b", "policy")
    assert watch.loading == {}


def test_a_group_of_two_vllm_replicas_keeps_serving_while_one_is_down(tmp_path: Path) -> None:
    """A warm standby: the `fixed` group is served by two vLLM deployments. Once the watch sees
    one gone, every request goes to the other (none gets the 503); when it is back it serves
    again. Without routing around the dead replica, the Router would send it about half; one
    that dies between two looks of the watch costs no request either (failover on a refused
    connection)."""
    import yaml

    replicas = [UpstreamProcess(tmp_path / f"upstream-{i}.log").start() for i in range(2)]
    model_list = tmp_path / "models.yaml"
    model_list.write_text(yaml.safe_dump({"model_list": [
        {"model_name": "fixed", "litellm_params": {"model": "hosted_vllm/fixed", "api_base": r.base_url}}
        for r in replicas]}))
    try:
        with GatewayProcess(tmp_path, database_url=f"sqlite:///{tmp_path / 'pool.db'}",
                            model_list=model_list) as gw, httpx.Client(timeout=30) as http:
            chat = {"model": "fixed", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
            assert http.post(f"{gw.base_url}/chat/completions", json=chat).status_code == 200
            dead = replicas[0]
            dead.stop()
            down = f'nextstate_upstream_up{{upstream="{dead.base_url}"}} 0.0'
            wait_for(lambda: down in http.get(f"{gw.url}/metrics").text, timeout=30)
            statuses = [http.post(f"{gw.base_url}/chat/completions", json=chat).status_code for _ in range(24)]
            statuses += [http.post(f"{gw.base_url}/chat/completions", json=dict(chat, stream=True)).status_code
                         for _ in range(8)]
            assert statuses == [200] * 32, statuses
            # the gateway stays ready (a load balancer keeps sending to it); the replica down is named
            ready = http.get(f"{gw.url}/readyz")
            assert ready.status_code == 200, ready.text
            assert ready.json()["checks"]["upstreams"][dead.base_url].startswith("unreachable")
            assert "unserved_models" not in ready.json()["checks"]
            turns = [gw.stored_turn(http.post(f"{gw.base_url}/responses",
                                              json={"model": "fixed", "input": "hi"}).headers["x-turn-id"])]
            assert turns[0]["status"] == "ok"

            replicas[1].stop()  # none left: unready, and the model says which
            ready = wait_for(lambda: r if (r := http.get(f"{gw.url}/readyz")).status_code == 503 else None, timeout=30)
            assert ready.json()["checks"]["unserved_models"] == ["fixed"]
            replicas[1].start()
            dead.start()
            up = f'nextstate_upstream_up{{upstream="{dead.base_url}"}} 1.0'
            wait_for(lambda: up in http.get(f"{gw.url}/metrics").text, timeout=30)
            assert all(http.post(f"{gw.base_url}/chat/completions", json=chat).status_code == 200 for _ in range(8))

            # a replica that dies between two looks of the watch: the request the Router sends it
            # finds the connection refused (nothing reached it) and is sent to the other one
            dead.stop()
            statuses = [http.post(f"{gw.base_url}/chat/completions", json=chat).status_code for _ in range(24)]
            assert statuses == [200] * 24, statuses
            assert f'nextstate_upstream_up{{upstream="{dead.base_url}"}} 0.0' in http.get(f"{gw.url}/metrics").text
    finally:
        for r in replicas:
            r.stop()
