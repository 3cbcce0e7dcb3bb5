"""Traces out, against a real receiver: Arize Phoenix (tests/support/phoenix.py) takes the OTLP spans of a real
gateway process and a real scoring worker, and the spans are read back from Phoenix's REST API.

Each turn is one span whose trace id is the turn's id, with the GenAI semantic conventions'
attributes and the redacted text; its judgement, scored later by the worker, is a child span with
the reward, the votes and the policy version. A receiver that is down costs no turn.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from datapool.traces import EVALUATION_EVENT, JUDGEMENT_SPAN, span_id_of
from tests.support.processes import GatewayProcess, WorkerProcess, free_port, wait_for
from tests.support.redis_server import unique_queue
from tests.support.upstream import UpstreamProcess
from tests.support.phoenix import PhoenixProcess

TOKEN = "traces-admin-token"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
EMAIL = "jane.roe.4711@example.org"


@pytest.fixture(scope="module")
def phoenix(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PhoenixProcess]:
    with PhoenixProcess(tmp_path_factory.mktemp("phoenix")) as p:
        yield p


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpstreamProcess]:
    with UpstreamProcess(tmp_path_factory.mktemp("up") / "upstream.log") as up:
        yield up


@dataclass
class Stack:
    gw: GatewayProcess
    phoenix: PhoenixProcess
    project: str

    def turn(self, turn_id: str) -> dict[str, Any]:
        return self.gw.stored_turn(turn_id, headers=ADMIN, timeout=60)

    def spans(self, want: int) -> list[dict[str, Any]]:
        return wait_for(lambda: len(s := self.phoenix.spans(self.project)) >= want and s, timeout=90, interval=0.5)


@pytest.fixture(scope="module")
def stack(phoenix: PhoenixProcess, upstream: UpstreamProcess, module_db_url: str, redis_url: str,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    d = tmp_path_factory.mktemp("traces")
    project = f"nextstate-{uuid.uuid4().hex[:8]}"
    common = {"NEXTSTATE_BROKER_URL": redis_url, "NEXTSTATE_QUEUE": unique_queue(), "NEXTSTATE_ADMIN_TOKEN": TOKEN,
              "NEXTSTATE_OTEL_TRACES": "1", "NEXTSTATE_REDACT": "all", **phoenix.env(project)}
    worker_env = common | {"NEXTSTATE_JUDGE_BACKEND": "python", "NEXTSTATE_JUDGE_PYTHON": "tests.support.judges:verdict"}
    with GatewayProcess(d, database_url=module_db_url, model_list=upstream.model_list(d / "models.yaml"), env=common) as gw, \
            WorkerProcess(d, database_url=module_db_url, broker_url=redis_url, env=worker_env):
        yield Stack(gw, phoenix, project)


def _by_trace(spans: list[dict[str, Any]], turn_id: str, name: str | None = None) -> list[dict[str, Any]]:
    return [s for s in spans if s["context"]["trace_id"] == turn_id and (name is None or s["name"] == name)]


def _at(text: str) -> datetime:
    return datetime.fromisoformat(text)


def test_turns_and_their_judgements_reach_phoenix(stack: Stack) -> None:
    gw, session = stack.gw, f"trace-{uuid.uuid4().hex[:8]}"
    messages: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."},
                                      {"role": "user", "content": f"write to {EMAIL} please"}]
    r1 = httpx.post(f"{gw.base_url}/chat/completions", headers={"X-Session-Id": session}, timeout=30, json={
        "model": "fixed", "messages": messages, "temperature": 0.5, "max_tokens": 12, "top_p": 0.9})
    assert r1.status_code == 200, r1.text
    # the user's thanks is turn 1's next state: the worker's judge votes +1 three times
    messages += [r1.json()["choices"][0]["message"], {"role": "user", "content": "thanks"}]
    r2 = httpx.post(f"{gw.base_url}/chat/completions", headers={"X-Session-Id": session}, timeout=30,
                    json={"model": "fixed", "messages": messages, "stream": True})
    assert r2.status_code == 200
    # no session id: the pool stitches it into a session of its own, which the span names
    r3 = httpx.post(f"{gw.base_url}/completions", timeout=30, json={"model": "fixed", "prompt": "Once upon"})
    r4 = httpx.post(f"{gw.base_url}/messages", timeout=30, json={
        "model": "fixed", "max_tokens": 16, "messages": [{"role": "user", "content": "hi from the Messages API"}]})
    assert r3.status_code == 200 and r4.status_code == 200, (r3.text, r4.text)
    t1, t2, t3, t4 = (r.headers["x-turn-id"] for r in (r1, r2, r3, r4))
    stored = {t: stack.turn(t) for t in (t1, t2, t3, t4)}
    wait_for(lambda: stack.turn(t1)["judgement"]["status"] == "scored", timeout=90)

    spans = stack.spans(5)  # four turns and turn 1's judgement
    turn_spans = {t: _by_trace(spans, t, f"{'text_completion' if t == t3 else 'chat'} fixed") for t in stored}
    assert all(len(s) == 1 for s in turn_spans.values()), {t: [x["name"] for x in _by_trace(spans, t)] for t in stored}
    for turn_id, turn in stored.items():
        span = turn_spans[turn_id][0]
        a = span["attributes"]
        assert span["parent_id"] is None and span["context"]["span_id"] == f"{span_id_of(turn_id):016x}"
        assert a["gen_ai.operation.name"] == ("text_completion" if turn_id == t3 else "chat")
        assert a["gen_ai.provider.name"] == a["gen_ai.system"] == "vllm"
        assert a["gen_ai.request.model"] == "fixed" and a["gen_ai.response.model"]
        assert a["gen_ai.conversation.id"] == turn["session_id"]
        assert a["gen_ai.response.finish_reasons"] == ["stop"]
        assert a["gen_ai.usage.input_tokens"] == turn["usage"]["prompt_tokens"]
        assert a["gen_ai.usage.output_tokens"] == turn["usage"]["completion_tokens"]
        assert a["nextstate.turn.id"] == turn_id and a["nextstate.policy.version"] == turn["policy_version"]
        assert a["nextstate.wire_format"] == turn["wire_format"]
        # it lasts as long as the call did
        took_ms = (_at(span["end_time"]) - _at(span["start_time"])).total_seconds() * 1000
        assert took_ms == pytest.approx(turn["latency_ms"], abs=1.0)
        assert json.loads(a["gen_ai.input.messages"]) and json.loads(a["gen_ai.output.messages"])

    a1 = turn_spans[t1][0]["attributes"]
    assert a1["gen_ai.conversation.id"] == session
    assert (a1["gen_ai.request.temperature"], a1["gen_ai.request.max_tokens"], a1["gen_ai.request.top_p"]) == (0.5, 12, 0.9)
    assert json.loads(a1["gen_ai.system_instructions"]) == [{"type": "text", "content": "Be brief."}]
    inputs = json.loads(a1["gen_ai.input.messages"])
    assert inputs[0]["role"] == "user" and "[REDACTED:email]" in inputs[0]["parts"][0]["content"]
    assert EMAIL not in json.dumps(spans) and a1["nextstate.redacted.email"] == 1
    outputs = json.loads(a1["gen_ai.output.messages"])
    assert outputs[0]["role"] == "assistant" and outputs[0]["finish_reason"] == "stop"
    assert outputs[0]["parts"][0]["content"] == r1.json()["choices"][0]["message"]["content"]
    assert json.loads(turn_spans[t2][0]["attributes"]["gen_ai.input.messages"])[-1]["parts"] == [
        {"type": "text", "content": "thanks"}]
    assert turn_spans[t4][0]["attributes"]["nextstate.wire_format"] == "messages"
    assert stored[t3]["session_id"] != session  # stitched into a session of its own, named on its span

    judged = wait_for(lambda: _by_trace(stack.spans(5), t1, JUDGEMENT_SPAN), timeout=60)
    j = judged[-1]
    ja = j["attributes"]
    assert j["parent_id"] == turn_spans[t1][0]["context"]["span_id"]
    judgement = stack.turn(t1)["judgement"]
    assert ja["nextstate.reward"] == judgement["reward"] == 1.0
    assert ja["nextstate.judge.votes"] == [v["value"] for v in judgement["votes"]] == [1.0, 1.0, 1.0]
    assert ja["nextstate.judgement.status"] == "scored" and ja["nextstate.judge.name"] == "tests.support.judges:verdict"
    assert ja["nextstate.policy.version"] == stored[t1]["policy_version"]
    assert ja["gen_ai.conversation.id"] == session
    event = next(e for e in j["events"] if e["name"] == EVALUATION_EVENT)
    assert event["attributes"]["gen_ai.evaluation.score.value"] == 1.0
    assert event["attributes"]["gen_ai.evaluation.name"] == "nextstate.prm"


def test_a_receiver_that_is_down_costs_no_turn(upstream: UpstreamProcess, tmp_path: Path) -> None:
    closed = free_port()  # nobody listens there
    env = {"NEXTSTATE_OTEL_TRACES": "1", "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{closed}",
           "OTEL_EXPORTER_OTLP_TIMEOUT": "1", "OTEL_BSP_SCHEDULE_DELAY": "50"}
    with GatewayProcess(tmp_path, database_url=f"sqlite:///{tmp_path / 'pool.db'}", model_list=upstream.model_list(tmp_path / "models.yaml"),
                        env=env) as gw:
        turns = []
        for i in range(20):
            r = httpx.post(f"{gw.base_url}/chat/completions", timeout=30, json={
                "model": "fixed", "stream": bool(i % 2), "messages": [{"role": "user", "content": f"hello {i}"}]})
            assert r.status_code == 200, r.text
            turns.append(r.headers["x-turn-id"])
        for t in turns:
            gw.stored_turn(t, timeout=60)
        assert httpx.get(f"{gw.url}/readyz", timeout=10).status_code == 200
