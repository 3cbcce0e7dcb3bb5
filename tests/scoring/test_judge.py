"""Scoring end to end: gateway → pool (PostgreSQL) → Redis → a real Celery worker process → votes,
rewards, hints and teacher logprobs from the real vLLM. The python judge (tests/support/judges.py) makes
the votes exact; tests/scoring/test_judge_llm.py runs the LLM judge."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI

from scoring.teacher import teacher_messages
from tests.support.vllm_servers import RunningVLLM
from tests.support.processes import GatewayProcess, WorkerProcess, wait_for
from tests.support.redis_server import unique_queue


class Stack:
    """A gateway and a worker sharing one pool and one queue."""

    def __init__(self, gateway: GatewayProcess, worker_env: dict[str, str], database_url: str,
                 broker_url: str, data_dir: Path):
        self.gateway = gateway
        self.worker_env = worker_env
        self.database_url = database_url
        self.broker_url = broker_url
        self.data_dir = data_dir
        self.worker: WorkerProcess | None = None

    def start_worker(self, **extra_env: str) -> WorkerProcess:
        self.worker = WorkerProcess(self.data_dir, database_url=self.database_url, broker_url=self.broker_url,
                                    env=self.worker_env | extra_env).start()
        return self.worker

    @property
    def chat(self) -> OpenAI:
        return OpenAI(base_url=self.gateway.base_url, api_key="unused", max_retries=0, timeout=120)

    def api(self, method: str, path: str, **kw: Any) -> httpx.Response:
        return httpx.request(method, f"{self.gateway.url}{path}", timeout=30, **kw)

    def turn(self, turn_id: str) -> dict[str, Any]:
        return wait_for(lambda: (r := self.api("GET", f"/api/turns/{turn_id}")).status_code == 200 and r.json())

    def judged(self, turn_id: str, *statuses: str, timeout: float = 60) -> dict[str, Any]:
        want = statuses or ("scored", "tie", "unparsable", "dead")
        return wait_for(lambda: (t := self.turn(turn_id))["judgement"]["status"] in want and t, timeout)

    def exchange(self, first_user: str, reply: str | None = None, **headers: str) -> tuple[str, str]:
        """Two requests of one conversation; returns (turn 1 id, turn 2 id). The second request
        carries `reply` as the user's answer to turn 1, which becomes turn 1's next state."""
        messages: list[Any] = [{"role": "system", "content": f"Be brief. {uuid.uuid4().hex[:8]}"},
                               {"role": "user", "content": first_user}]
        raw = self.chat.chat.completions.with_raw_response.create(
            model="smollm2", messages=messages, max_tokens=12, temperature=0)
        messages += [raw.parse().choices[0].message, {"role": "user", "content": reply or "ok"}]
        raw2 = self.chat.chat.completions.with_raw_response.create(
            model="smollm2", messages=messages, max_tokens=4, temperature=0, extra_headers=headers)
        return raw.headers["x-turn-id"], raw2.headers["x-turn-id"]


@pytest.fixture(scope="module")
def stack(vllm_server: RunningVLLM, teacher_server: RunningVLLM, redis_url: str, pg_admin_dsn: str,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    from tests.support.pg import fresh_database

    database_url, drop = fresh_database(pg_admin_dsn)
    data = tmp_path_factory.mktemp("judge")
    queue = unique_queue()
    common = {"NEXTSTATE_BROKER_URL": redis_url, "NEXTSTATE_QUEUE": queue}
    worker_env = common | {
        "NEXTSTATE_JUDGE_BACKEND": "python", "NEXTSTATE_JUDGE_PYTHON": "tests.support.judges:verdict",
        "NEXTSTATE_TEACHER_URL": teacher_server.base_url, "NEXTSTATE_JUDGE_MAX_RETRIES": "2",
        "NEXTSTATE_JUDGE_RETRY_BACKOFF_S": "1", "NEXTSTATE_SWEEP_INTERVAL_S": "1",
        "NEXTSTATE_REQUEUE_AFTER_S": "4", "NEXTSTATE_TEST_JUDGE_LOG": str(data / "judge-calls.log"),
        "NEXTSTATE_SESSION_IDLE_TIMEOUT_S": "3600",
    }
    with GatewayProcess(data, database_url=database_url, upstream_url=vllm_server.base_url, env=common) as gw:
        s = Stack(gw, worker_env, database_url, redis_url, data)
        s.start_worker()
        try:
            yield s
        finally:
            if s.worker:
                s.worker.stop()
    drop()


def test_corrected_reply_gets_negative_majority_hint_and_teacher_logprobs(
    stack: Stack, teacher_server: RunningVLLM
) -> None:
    correction = "You should have answered with a single word."
    t1, _ = stack.exchange("What is the capital of France?", f"No, {correction}")
    turn = stack.judged(t1, "scored")
    j = turn["judgement"]
    assert [v["value"] for v in j["votes"]] == [-1, -1, -1]
    assert {v["index"] for v in j["votes"]} == {0, 1, 2}
    assert all(v["judge"] == "tests.support.judges:verdict" for v in j["votes"])
    assert j["reward"] == -1 and j["prm_reward"] == -1 and j["vote_mean"] == -1
    assert j["hint"] == correction and j["hint_source"] == "prm"
    turn = wait_for(lambda: (t := stack.turn(t1))["judgement"]["has_teacher_logprobs"] and t)
    teacher = turn["judgement"]["teacher_logprobs"]
    assert len(teacher) == len(turn["token_ids"])

    # the same numbers straight from vLLM: prompt_logprobs over teacher prompt + response tokens
    root = teacher_server.base_url.removesuffix("/v1")
    prompt = httpx.post(f"{root}/tokenize", json={
        "model": "smollm2", "messages": teacher_messages(turn["request"]["messages"], correction),
        "add_generation_prompt": True}, timeout=30).json()["tokens"]
    out = httpx.post(f"{teacher_server.base_url}/completions", json={
        "model": "smollm2", "prompt": prompt + turn["token_ids"], "max_tokens": 1, "temperature": 0,
        "prompt_logprobs": 0}, timeout=60).json()
    entries = out["choices"][0]["prompt_logprobs"][-len(turn["token_ids"]):]
    direct = [e[str(tok)]["logprob"] for e, tok in zip(entries, turn["token_ids"])]
    assert teacher == pytest.approx(direct, abs=1e-4)
    # the hint changes the context, so the teacher disagrees with the behaviour policy somewhere
    assert teacher != pytest.approx(turn["logprobs"], abs=1e-3)


def test_thanked_reply_gets_positive_majority(stack: Stack) -> None:
    t1, _ = stack.exchange("Say hello.", "Thanks, that is what I needed!")
    j = stack.judged(t1, "scored")["judgement"]
    assert j["reward"] == 1 and [v["value"] for v in j["votes"]] == [1, 1, 1]
    assert j["hint"] is None and not j["has_teacher_logprobs"]


def test_tie_is_recorded_as_tie(stack: Stack) -> None:
    t1, _ = stack.exchange("Pick a number.", "TIE please")
    j = stack.judged(t1, "tie")["judgement"]
    assert j["reward"] is None and j["prm_reward"] is None
    assert sorted(v["value"] for v in j["votes"]) == [-1, 0, 1]
    assert j["vote_mean"] == 0
    metrics = wait_for(lambda: 'nextstate_judgements{status="tie"}' in (m := stack.api("GET", "/metrics").text) and m,
                       timeout=30)
    assert 'nextstate_votes{kind="prm",parsed="true"}' in metrics


def test_failing_judge_is_retried_then_dead_lettered(stack: Stack) -> None:
    t1, _ = stack.exchange("Hi.", "FAIL this one")
    j = stack.judged(t1, "dead", timeout=90)["judgement"]
    assert j["attempts"] == 3  # the first try and judge_max_retries=2 retries
    assert j["retries"] == 2 and j["dead_reason"] == "retries_exhausted"  # a transient failure: retried
    assert j["last_error"].startswith("retries_exhausted: ") and "judge backend unavailable" in j["last_error"]
    metrics = wait_for(lambda: 'nextstate_judgements_dead{reason="retries_exhausted"}' in (
        m := stack.api("GET", "/metrics").text) and m, timeout=30)
    retried = re.search(r"^nextstate_judge_retries_total (\S+)$", metrics, re.M)
    assert retried is not None and float(retried.group(1)) >= 2
    assert j["votes"] == []
    dead = stack.api("GET", "/api/judgements", params={"status": "dead"}).json()["data"]
    assert t1 in [d["turn_id"] for d in dead]


def test_worker_killed_mid_task_leaves_each_vote_once(stack: Stack) -> None:
    assert stack.worker is not None
    stack.worker.stop()
    slow = stack.start_worker(NEXTSTATE_TEST_JUDGE_SLOW="1")
    t1, _ = stack.exchange("Tell me a fact.", "SLOW down, thanks")
    log = stack.data_dir / "judge-calls.log"
    # votes 0 and 1 are stored; vote 2 hangs in the judge
    wait_for(lambda: len(stack.turn(t1)["judgement"]["votes"]) == 2 and f"{t1} 2" in log.read_text(), 60)
    slow.kill()
    stack.start_worker()  # the sweep finds the task pending and sends it again
    j = stack.judged(t1, "scored", timeout=60)["judgement"]
    assert sorted(v["index"] for v in j["votes"]) == [0, 1, 2]
    calls = [line for line in log.read_text().splitlines() if line.startswith(t1)]
    assert calls.count(f"{t1} 0") == calls.count(f"{t1} 1") == 1
    assert calls.count(f"{t1} 2") == 2  # once killed, once completed
    assert j["reward"] == 1


def test_feedback_validates_and_overrides_the_judges(stack: Stack) -> None:
    ok = {"rating": "down", "text": "Too long; answer in one sentence."}
    for bad in ({"rating": "down"}, {"turn_id": "a", "response_id": "b", "rating": "up"},
                {"turn_id": "a", "rating": "sideways"}, {"turn_id": "a"}, {"turn_id": "a", "rating": "up", "x": 1}):
        r = stack.api("POST", "/v1/feedback", json=bad)
        assert r.status_code == 422 and r.json()["error"]["message"], (bad, r.text)
    assert stack.api("POST", "/v1/feedback", content=b"{nope").status_code == 400
    r = stack.api("POST", "/v1/feedback", json=ok | {"turn_id": "no-such-turn"})
    assert r.status_code == 404 and "no-such-turn" in r.json()["error"]["message"]
    assert stack.api("POST", "/v1/feedback", json=ok | {"response_id": "chatcmpl-nope"}).status_code == 404

    t1, _ = stack.exchange("Describe the sea.", "Thanks!")
    assert stack.judged(t1, "scored")["judgement"]["reward"] == 1
    response_id = stack.turn(t1)["response"]["id"]
    r = stack.api("POST", "/v1/feedback", json=ok | {"response_id": response_id})
    assert r.status_code == 200 and r.json()["turn_id"] == t1
    j = wait_for(lambda: (j := stack.turn(t1)["judgement"])["reward"] == -1 and j, 60)
    assert j["prm_reward"] == 1  # the judges' majority is kept beside the person's verdict
    assert j["hint"] == ok["text"] and j["hint_source"] == "feedback"
    assert [v["kind"] for v in j["votes"]].count("feedback") == 1
    assert len([v for v in j["votes"] if v["kind"] == "prm"]) == 3  # not asked again


def test_outcome_validates_and_sets_integrated_reward(stack: Stack) -> None:
    t1, t2 = stack.exchange("Add 2 and 2.", "No, the answer is 4.")
    sid = stack.turn(t1)["session_id"]
    assert stack.judged(t1, "scored")["judgement"]["vote_mean"] == -1
    for bad in ({"outcome": "high"}, {"outcome": True}, {}, {"outcome": 1, "extra": 2}):
        r = stack.api("POST", f"/api/sessions/{sid}/outcome", json=bad)
        assert r.status_code == 422, (bad, r.text)
    r = stack.api("POST", f"/api/sessions/{sid}/outcome", content=b'{"outcome": NaN}')
    assert r.status_code in (400, 422)
    assert stack.api("POST", "/api/sessions/nope/outcome", json={"outcome": 1}).status_code == 404
    r = stack.api("POST", f"/api/sessions/{sid}/outcome", json={"outcome": 1.0, "source": "unit-test"})
    assert r.status_code == 200 and r.json()["queued"] == [t2]  # the last turn now has a next state
    j1 = stack.turn(t1)["judgement"]
    assert j1["integrated_reward"] == 0.0  # O + mean votes = 1 + (-1)
    j2 = stack.judged(t2, "scored")["judgement"]
    assert j2["reward"] == 1 and j2["integrated_reward"] == 2.0  # the end with outcome 1 → +1 votes
    s = stack.api("GET", f"/api/sessions/{sid}").json()
    assert s["outcome"] == 1.0 and s["outcome_source"] == "unit-test"


def test_session_done_header_and_end_endpoint_score_the_last_turn(stack: Stack) -> None:
    _, t2 = stack.exchange("Name a planet.", "ok", **{"X-Session-Done": "1"})
    assert stack.judged(t2, "scored")["judgement"]["votes"]
    t1, t2 = stack.exchange("Name a river.", "ok")
    sid = stack.turn(t2)["session_id"]
    assert stack.turn(t2)["judgement"]["status"] is None  # nothing followed it yet
    assert stack.api("POST", "/api/sessions/nope/end").status_code == 404
    assert stack.api("POST", f"/api/sessions/{sid}/end").json()["queued"] == [t2]
    assert stack.judged(t2, "scored")["judgement"]["reward"] == 0
