"""Session keys and side-turn rules through the real gateway HTTP path: the gateway process in
front of vLLM (SmolLM2), writing to a real pool (docs/sessions.md)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from base.settings import DEFAULT_SESSION_KEYS, DEFAULT_SIDE_TURN_RULES
from tests.support.vllm_servers import RunningVLLM
from tests.support.processes import GatewayProcess, wait_for

CUSTOM_KEYS = [
    {"source": "header", "name": "session-id"},  # as Codex names its header
    {"source": "metadata", "name": "conversation_id"},
    {"source": "user"},
    {"source": "field", "name": "prompt_cache_key"},
    {"source": "system", "pattern": r"\[conversation ([\w.-]+)\]"},
]
CUSTOM_RULES = [
    {"name": "titles", "header": "x-agent-purpose", "header_pattern": "^title$"},
    {"name": "summaries", "system_pattern": r"\ASummarise", "user_messages": 1, "tools": False},
]


def _dump(items: Any) -> str:
    return json.dumps([i.model_dump(mode="json", exclude_none=True) for i in items])


@pytest.fixture(scope="module")
def default_gw(vllm_server: RunningVLLM, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    """A gateway with the shipped settings (OpenClaw's session key and compaction rule)."""
    d = tmp_path_factory.mktemp("gw-default")
    with GatewayProcess(d, database_url=f"sqlite:///{d / 'pool.db'}", upstream_url=vllm_server.base_url) as gw:
        yield gw


@pytest.fixture(scope="module")
def custom_gw(vllm_server: RunningVLLM, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    """A gateway configured with one session key and rule of each kind, then the defaults."""
    d = tmp_path_factory.mktemp("gw-custom")
    env = {
        "NEXTSTATE_SESSION_KEYS": json.dumps(CUSTOM_KEYS)[:-1] + ", " + _dump(DEFAULT_SESSION_KEYS)[1:],
        "NEXTSTATE_SIDE_TURN_RULES": json.dumps(CUSTOM_RULES)[:-1] + ", " + _dump(DEFAULT_SIDE_TURN_RULES)[1:],
    }
    with GatewayProcess(d, database_url=f"sqlite:///{d / 'pool.db'}", upstream_url=vllm_server.base_url,
                        env=env) as gw:
        yield gw


def _chat(gw: GatewayProcess, messages: list[dict[str, Any]], headers: dict[str, str] | None = None,
          path: str = "/v1", **body: Any) -> httpx.Response:
    r = httpx.post(f"{gw.url}{path}/chat/completions", headers=headers or {}, timeout=120,
                   json={"model": "smollm2", "messages": messages, "max_tokens": 2, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r


def _turn(gw: GatewayProcess, r: httpx.Response) -> dict[str, Any]:
    return gw.stored_turn(r.headers["x-turn-id"])


def _session(gw: GatewayProcess, sid: str) -> dict[str, Any]:
    r = httpx.get(f"{gw.url}/api/sessions/{sid}", timeout=5)
    r.raise_for_status()
    return r.json()


def _uid() -> str:
    return uuid.uuid4().hex[:12]


def _openclaw_system(sid: str) -> str:
    return ("You are a personal assistant running inside OpenClaw.\n\n## Runtime\n"
            f"Runtime: agent=main | host=box | os=Linux (x64) | model=nextstate/policy | sessionId={sid} | "
            "channel=cli | thinking=off\nReasoning: off.")


# --- OpenClaw, with the shipped defaults ----------------------------------------------------------


def test_openclaw_session_id_in_the_system_prompt(default_gw: GatewayProcess) -> None:
    sid = f"oc-{_uid()}"
    r = _chat(default_gw, [{"role": "system", "content": _openclaw_system(sid)},
                           {"role": "user", "content": "[Thu 2026-11-26 14:03 UTC] hi"}])
    assert r.headers["x-session-id"] == sid
    assert _turn(default_gw, r)["session_id"] == sid
    assert _session(default_gw, sid)["source"] == "key"


def test_openclaw_session_id_moved_to_the_first_user_message(default_gw: GatewayProcess) -> None:
    # for openai-completions providers OpenClaw moves the Runtime line to the end of the first
    # user message; two turns of the conversation, then one after a rewritten history
    sid = f"oc-{_uid()}"
    system = {"role": "system", "content": "You are a personal assistant running inside OpenClaw."}
    first = {"role": "user", "content": f"[Thu 2026-11-26 14:03 UTC] hi\n\nRuntime: agent=main | sessionId={sid} | model=x"}
    r1 = _chat(default_gw, [system, first])
    reply = r1.json()["choices"][0]["message"]
    follow = {"role": "user", "content": "[Thu 2026-11-26 14:04 UTC] and then?"}
    r2 = _chat(default_gw, [system, first, {"role": "assistant", "content": reply["content"]}, follow])
    t1, t2 = _turn(default_gw, r1), _turn(default_gw, r2)
    assert t1["session_id"] == t2["session_id"] == sid
    assert t2["parent_turn_id"] == t1["id"]
    assert wait_for(lambda: _turn(default_gw, r1)["next_state"], 20) == {"turn_id": t2["id"], "messages": [follow]}


def test_the_key_must_be_a_runtime_line(default_gw: GatewayProcess) -> None:
    # a sessionId= anywhere else (here: quoted by the user, mid-line) is not a key
    r = _chat(default_gw, [{"role": "user", "content": f"what does sessionId=x-{_uid()} mean? Runtime: sessionId=no"}])
    assert "x-session-id" not in r.headers
    assert _session(default_gw, _turn(default_gw, r)["session_id"])["source"] == "inferred"


def test_explicit_session_wins_over_the_key(default_gw: GatewayProcess) -> None:
    in_prompt, header, path = f"oc-{_uid()}", f"h-{_uid()}", f"p-{_uid()}"
    messages = [{"role": "system", "content": _openclaw_system(in_prompt)}, {"role": "user", "content": "hi"}]
    r = _chat(default_gw, messages, headers={"X-Session-Id": header})
    assert _turn(default_gw, r)["session_id"] == header and _session(default_gw, header)["source"] == "header"
    r = _chat(default_gw, messages, headers={"X-Session-Id": header}, path=f"/s/{path}/v1")
    assert _turn(default_gw, r)["session_id"] == path


def _compaction(conversation: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": "You are a context summarization assistant. Your task is to read a "
             "conversation between a user and an AI assistant, then produce a structured summary."},
            {"role": "user", "content": f"<conversation>\n{conversation}\n</conversation>\n\nSummarise it."}]


def test_openclaw_compaction_is_a_side_turn(default_gw: GatewayProcess) -> None:
    sid = f"oc-{_uid()}"
    system = {"role": "system", "content": _openclaw_system(sid)}
    user = {"role": "user", "content": "hi"}
    r1 = _chat(default_gw, [system, user])
    # the transcript carries the Runtime line, so the compaction call lands in the same session
    compaction = _compaction(f"[system]\n{system['content']}\n[user]\nhi")
    side = _chat(default_gw, compaction)
    follow = {"role": "user", "content": "next"}
    r2 = _chat(default_gw, [system, {"role": "user", "content": "Summary of earlier: greeting."}, follow])
    t1, ts, t2 = _turn(default_gw, r1), _turn(default_gw, side), _turn(default_gw, r2)
    assert ts["turn_type"] == "side" and ts["session_id"] == sid
    assert t1["turn_type"] == t2["turn_type"] == "main"
    # the side turn took no part in the chain: the turn after the compaction continues turn 1
    t1 = wait_for(lambda: (t := _turn(default_gw, r1))["next_state"] and t, 20)
    assert t1["next_state"]["turn_id"] == t2["id"] and ts["next_state"] is None


@pytest.mark.parametrize("change", ["tools", "two user messages", "no <conversation>", "other system prompt",
                                    "X-Turn-Type: main"])
def test_near_misses_of_the_compaction_rule_stay_main(default_gw: GatewayProcess, change: str) -> None:
    messages = _compaction(f"[user]\nhi {_uid()}")
    body: dict[str, Any] = {}
    headers = {}
    if change == "tools":
        body["tools"] = [{"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}}]
    elif change == "two user messages":
        messages.append({"role": "user", "content": "also this"})
    elif change == "no <conversation>":
        messages[1]["content"] = messages[1]["content"].removeprefix("<conversation>\n")
    elif change == "other system prompt":
        messages[0]["content"] = "You are a helpful assistant. " + messages[0]["content"]
    else:
        headers["X-Turn-Type"] = "main"
    assert _turn(default_gw, _chat(default_gw, messages, headers=headers, **body))["turn_type"] == "main"


# --- configured keys and rules --------------------------------------------------------------------


@pytest.mark.parametrize("where", ["header", "metadata", "user", "field", "system"])
def test_each_kind_of_session_key(custom_gw: GatewayProcess, where: str) -> None:
    sid = f"{where}-{_uid()}"
    messages = [{"role": "user", "content": f"hi {_uid()}"}]
    headers: dict[str, str] = {}
    body: dict[str, Any] = {}
    if where == "header":
        headers["session-id"] = sid
    elif where == "metadata":
        body["metadata"] = {"conversation_id": sid, "other": "x"}
    elif where == "user":
        body["user"] = sid
    elif where == "field":
        body["prompt_cache_key"] = sid
    else:
        messages.insert(0, {"role": "system", "content": [{"type": "text", "text": f"Agent [conversation {sid}]"}]})
    r = _chat(custom_gw, messages, headers=headers, **body)
    assert r.headers["x-session-id"] == sid
    assert _turn(custom_gw, r)["session_id"] == sid
    assert _session(custom_gw, sid)["source"] == "key"


def test_keys_are_tried_in_order_and_invalid_ones_skipped(custom_gw: GatewayProcess) -> None:
    header, user = f"h-{_uid()}", f"u-{_uid()}"
    r = _chat(custom_gw, [{"role": "user", "content": "hi"}], headers={"session-id": header}, user=user)
    assert _turn(custom_gw, r)["session_id"] == header
    # a header value that is no session id is ignored, and the next key is used
    r = _chat(custom_gw, [{"role": "user", "content": "hi"}], headers={"session-id": "../../etc"}, user=user)
    assert _turn(custom_gw, r)["session_id"] == user
    # OpenClaw's default, listed after the custom keys, still applies
    sid = f"oc-{_uid()}"
    r = _chat(custom_gw, [{"role": "system", "content": _openclaw_system(sid)}, {"role": "user", "content": "hi"}])
    assert _turn(custom_gw, r)["session_id"] == sid


def test_configured_side_turn_rules(custom_gw: GatewayProcess) -> None:
    hi = [{"role": "user", "content": f"hi {_uid()}"}]
    assert _turn(custom_gw, _chat(custom_gw, hi, headers={"x-agent-purpose": "title"}))["turn_type"] == "side"
    assert _turn(custom_gw, _chat(custom_gw, hi, headers={"x-agent-purpose": "titles"}))["turn_type"] == "main"
    summary = [{"role": "system", "content": "Summarise the chat."}, *hi]
    assert _turn(custom_gw, _chat(custom_gw, summary))["turn_type"] == "side"
    assert _turn(custom_gw, _chat(custom_gw, summary, headers={"X-Turn-Type": "main"}))["turn_type"] == "main"
    assert _turn(custom_gw, _chat(custom_gw, _compaction("[user]\nhi")))["turn_type"] == "side"  # the default


def test_a_bad_rule_stops_the_gateway_with_a_clear_error(tmp_path: Any) -> None:
    env = {"NEXTSTATE_SIDE_TURN_RULES": json.dumps([{"name": "nothing"}])}
    gw = GatewayProcess(tmp_path, database_url=f"sqlite:///{tmp_path / 'pool.db'}", upstream_url="http://127.0.0.1:9/v1",
                        env=env)
    with pytest.raises(RuntimeError, match="no condition"):
        gw.start(timeout=60)
