"""A streamed reply is relayed event for event: each server-sent event the upstream sends reaches
the client as one event, unchanged but for the fields the client did not ask for, however the
upstream's bytes reach the gateway: an event a read, several events in one read, or one event
across two reads.

The upstream is tests/support/upstream.py, whose events and their packing into socket writes a
request chooses. vLLM's own chunking cannot be chosen, nor repeated: when its API server falls
behind the engine (a loaded machine) it sends several tokens in one event, so two identical
requests to it may be chunked differently. test_gateway.py compares the gateway's stream with
vLLM's field for field; the count of events is checked here, against the very events sent.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.support.processes import GatewayProcess
from tests.support.upstream import UpstreamProcess

TOKENS = 7
# how the upstream packs its events into socket writes (tests/support/upstream.py)
PACKINGS: dict[str, dict[str, Any]] = {
    "one_a_write": {},
    "three_a_write": {"fake_together": 3},
    "cut_inside_events": {"fake_split": True},
    "four_a_write_cut": {"fake_together": 4, "fake_split": True},
}


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpstreamProcess]:
    with UpstreamProcess(tmp_path_factory.mktemp("up") / "upstream.log") as up:
        yield up


@pytest.fixture(scope="module")
def gateway(upstream: UpstreamProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    d = tmp_path_factory.mktemp("gw")
    with GatewayProcess(d, database_url=f"sqlite:///{d / 'pool.db'}",
                        model_list=upstream.model_list(d / "models.yaml")) as gw:
        yield gw


def _events(resp: httpx.Response) -> list[Any]:
    """The stream's events in order, each parsed, less the fields that differ between two
    requests (id, created)."""
    resp.raise_for_status()
    *events, rest = resp.content.split(b"\n\n")
    assert rest == b"", resp.content[-200:]
    out: list[Any] = []
    for raw in events:
        assert raw.startswith(b"data: ") and b"\n" not in raw, raw
        data = raw[len(b"data: "):]
        if data == b"[DONE]":
            out.append("[DONE]")
            continue
        obj = json.loads(data)
        obj.pop("id"), obj.pop("created")
        out.append(obj)
    return out


def _not_asked(event: Any) -> Any:
    """*event* as sent to a client that asked for no token ids nor logprobs: those fields null."""
    if isinstance(event, dict):
        if "prompt_token_ids" in event:
            event["prompt_token_ids"] = None
        for choice in event["choices"]:
            choice["token_ids"] = choice["logprobs"] = None
    return event


@pytest.mark.parametrize("asks", ["everything", "nothing"])
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize("packing", PACKINGS)
def test_each_upstream_event_is_one_client_event(gateway: GatewayProcess, upstream: UpstreamProcess,
                                                 packing: str, endpoint: str, asks: str) -> None:
    path = "/chat/completions" if endpoint == "chat" else "/completions"
    body: dict[str, Any] = {"model": "fixed", "stream": True, "max_tokens": TOKENS, "fake_chunks": TOKENS,
                            "fake_chunk_delay_s": 0.02, **PACKINGS[packing]}
    body |= {"messages": [{"role": "user", "content": "Hi"}]} if endpoint == "chat" else {"prompt": "Hi"}
    # the events the upstream sends for the gateway's request: it asks for token ids and logprobs
    sent = _events(httpx.post(f"{upstream.base_url}{path}", json=body | {
        "return_token_ids": True, "logprobs": True if endpoint == "chat" else 0}, timeout=30))
    assert len(sent) == TOKENS + 1 and sent[-1] == "[DONE]"
    if asks == "everything":
        body |= {"return_token_ids": True, "logprobs": True if endpoint == "chat" else 0}
    resp = httpx.post(f"{gateway.base_url}{path}", json=body, timeout=30)
    got = _events(resp)
    assert got == (sent if asks == "everything" else [_not_asked(e) for e in sent])
    # every event, however it arrived, was read into the captured turn once
    stored = gateway.stored_turn(resp.headers["x-turn-id"])
    assert stored["token_ids"] == list(range(100, 100 + TOKENS))
    assert len(stored["logprobs"]) == TOKENS


@pytest.mark.parametrize("hangs_up", ["after_the_finish_reason", "before_it"])
def test_a_client_that_hangs_up_once_the_reply_finished_got_all_of_it(
        gateway: GatewayProcess, upstream: UpstreamProcess, hangs_up: str) -> None:
    """An agent acts on a tool call as soon as its finish reason arrives and closes the stream
    without waiting for [DONE] (which a busy upstream may send in a later write): the turn is
    whole and stored as answered, so the agent's next request continues it. A client that hangs
    up before the finish reason got part of the reply: that turn is cancelled."""
    body: dict[str, Any] = {"model": "fixed", "stream": True, "max_tokens": TOKENS, "fake_chunks": TOKENS,
                            "fake_done_delay_s": 2.0, "messages": [{"role": "user", "content": "Hi"}]}
    if hangs_up == "before_it":
        body["fake_chunk_delay_s"] = 0.3  # the reply's end is not at the gateway yet
    with httpx.stream("POST", f"{gateway.base_url}/chat/completions", json=body, timeout=30) as resp:
        turn_id = resp.headers["x-turn-id"]
        seen = 0
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            seen += 1
            finished = json.loads(line[len("data: "):])["choices"][0]["finish_reason"] is not None
            if finished or (hangs_up == "before_it" and seen == 2):
                break  # the stream is closed here, [DONE] still two seconds away
    stored = gateway.stored_turn(turn_id)
    if hangs_up == "after_the_finish_reason":
        assert stored["status"] == "ok" and stored["error"] is None, stored["error"]
        assert len(stored["token_ids"]) == TOKENS
        assert stored["response"]["choices"][0]["finish_reason"] == "stop"
    else:
        assert stored["status"] == "cancelled" and stored["error"]["type"] == "cancelled"
        assert 2 <= len(stored["token_ids"]) < TOKENS
