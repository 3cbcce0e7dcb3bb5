"""Seeded sessions for the admin UI tests: written with the ORM, as the gateway and the scorer
would have left them (turns, next states, judgements, votes, teacher logprobs)."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.orm import Session as OrmSession

from datapool.models import Judgement, Session, Turn, Vote

XSS_USER = "<script>window.__xss = 1</script> What is 2+2?"
XSS_REPLY = '<img src=x onerror="window.__xss = 2">It is 4.'
TOOL_WORD = "zanzibar"  # appears only in a tool result


def _turn(sid: str, at: datetime, messages: list[dict[str, Any]], reply: dict[str, Any], *,
          next_messages: list[dict[str, Any]] | None, capture: str = "white-box", model: str = "smollm2",
          version: str | None = None, turn_type: str = "main", parent: str | None = None,
          tokenize: Callable[[str], list[int]] | None = None) -> Turn:
    text = reply.get("content") or ""
    token_ids = logprobs = prompt_ids = None
    if capture == "white-box":
        token_ids = (tokenize(text) if tokenize and text else [1000 + i for i in range(max(1, len(text.split())))]) + [2]
        logprobs = [-0.05 * (i % 7) - (2.5 if i % 5 == 3 else 0.0) for i in range(len(token_ids))]
        prompt_ids = list(range(1, 20))
    return Turn(
        id=str(uuid.uuid4()), session_id=sid, parent_turn_id=parent, turn_type=turn_type, endpoint="chat",
        status="ok", created_at=at, model=model, upstream_model=model, policy_version=version, capture=capture,
        request={"model": model, "messages": messages},
        response={"id": f"chatcmpl-{uuid.uuid4().hex[:8]}", "model": model,
                  "choices": [{"index": 0, "finish_reason": "tool_calls" if reply.get("tool_calls") else "stop",
                               "message": {"role": "assistant", **reply}}]},
        next_state={"messages": next_messages} if next_messages else None,
        prompt_token_ids=prompt_ids, token_ids=token_ids, logprobs=logprobs,
        latency_ms=123.0, usage={"prompt_tokens": 19, "completion_tokens": len(token_ids or [])})


def _judge(db: OrmSession, turn: Turn, votes: list[int | None], *, status: str | None = None,
           hint: str | None = None, teacher_shift: float | None = None, feedback: int | None = None) -> None:
    for i, v in enumerate(votes):
        db.add(Vote(turn_id=turn.id, kind="prm", dedupe_key=f"prm:test:v1:{i}", judge="test-judge",
                    prompt_version="v1", vote_index=i, value=v,
                    rationale=f"vote {i}: the reply {'helped' if (v or 0) > 0 else 'did not help'}", hint=hint))
    if feedback is not None:
        db.add(Vote(turn_id=turn.id, kind="feedback", dedupe_key=f"feedback:{uuid.uuid4().hex}", judge="user",
                    vote_index=0, value=feedback, hint="the user disagreed"))
    parsed = [v for v in votes if v is not None]
    pos, neg = parsed.count(1), parsed.count(-1)
    majority = 1.0 if pos > neg and pos > parsed.count(0) else -1.0 if neg > pos and neg > parsed.count(0) else None
    if status is None:
        status = "scored" if majority is not None else "tie"
    teacher = None
    if teacher_shift is not None and turn.logprobs:
        teacher = [lp + teacher_shift * (1 if i % 2 else -1) for i, lp in enumerate(turn.logprobs)]
    db.add(Judgement(turn_id=turn.id, status=status, reward=majority if status == "scored" else None,
                     prm_reward=majority, vote_mean=sum(parsed) / len(parsed) if parsed else None,
                     hint=hint, hint_source="prm" if hint else None, teacher_logprobs=teacher,
                     teacher_prompt_ids=[1, 2, 3] if teacher else None, judge="test-judge", prompt_version="v1",
                     attempts=1))


def seed(engine: Engine, tokenize: Callable[[str], list[int]] | None = None) -> dict[str, str]:
    """Write the sessions; returns the ids the tests look for."""
    now = datetime.now(timezone.utc).replace(microsecond=0)
    ids: dict[str, str] = {}
    with OrmSession(engine) as db, db.begin():
        # a tool-using session: the search word is only in the tool's result
        sid = "s-weather-" + uuid.uuid4().hex[:6]
        db.add(Session(id=sid, source="header", mode="online", created_at=now - timedelta(minutes=50),
                       updated_at=now, task_id="weather"))
        ask = [{"role": "system", "content": "You are a helpful agent with tools."},
               {"role": "user", "content": "What's the weather where my parcel is?"}]
        call = {"content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "parcel location"}'}}]}
        result = [{"role": "tool", "tool_call_id": "call_1", "content": f"Sunny in {TOOL_WORD.capitalize()}, 31 C"}]
        t1 = _turn(sid, now - timedelta(minutes=50), ask, call, next_messages=result, tokenize=tokenize)
        follow = ask + [{"role": "assistant", **call}] + result
        reply = {"content": "It is sunny and 31 degrees where your parcel is."}
        thanks = [{"role": "user", "content": "Thanks, that's right!"}]
        t2 = _turn(sid, now - timedelta(minutes=49), follow, reply, next_messages=thanks, parent=t1.id,
                   tokenize=tokenize)
        side = _turn(sid, now - timedelta(minutes=48), [{"role": "user", "content": "Summarize the chat title"}],
                     {"content": "Weather check"}, next_messages=None, turn_type="side")
        db.add_all([t1, t2, side])
        db.flush()
        _judge(db, t1, [1, 1, -1])
        _judge(db, t2, [1, 1, 1], hint="mention the source of the forecast", teacher_shift=1.5)
        ids.update(weather=sid, weather_call=t1.id, weather_reply=t2.id)

        # a message that tries to run script in the admin's browser
        sid = "s-xss-" + uuid.uuid4().hex[:6]
        db.add(Session(id=sid, source="header", mode="online", created_at=now - timedelta(minutes=40), updated_at=now))
        t = _turn(sid, now - timedelta(minutes=40), [{"role": "user", "content": XSS_USER}], {"content": XSS_REPLY},
                  next_messages=[{"role": "user", "content": "no, that is wrong"}], tokenize=tokenize)
        db.add(t)
        db.flush()
        _judge(db, t, [-1, -1, 1], feedback=1)
        ids.update(xss=sid, xss_turn=t.id)

        # an eval session through an opaque provider, judges tied
        sid = "s-eval-" + uuid.uuid4().hex[:6]
        db.add(Session(id=sid, source="header", mode="eval", created_at=now - timedelta(minutes=30), updated_at=now,
                       task_id="eval-set-1"))
        t = _turn(sid, now - timedelta(minutes=30), [{"role": "user", "content": "Translate 'cat' to French."}],
                  {"content": "chat"}, next_messages=[{"role": "user", "content": "ok"}], capture="black-box",
                  model="gpt-4o-mini")
        db.add(t)
        db.flush()
        _judge(db, t, [1, -1, 0])
        ids.update(eval=sid, eval_turn=t.id)

        # offline rollouts of one task, served by a trained version
        for i in range(4):
            sid = f"s-offline-{i}-" + uuid.uuid4().hex[:6]
            db.add(Session(id=sid, source="path", mode="offline", created_at=now - timedelta(minutes=20 - i),
                           updated_at=now, task_id="task-7", group_id="g-7", outcome=1.0 if i % 2 == 0 else 0.0))
            t = _turn(sid, now - timedelta(minutes=20 - i), [{"role": "user", "content": f"Solve puzzle {i}"}],
                      {"content": f"Answer {i}"}, next_messages=[{"role": "user", "content": "tests passed" if i % 2 == 0
                                                                   else "tests failed"}],
                      version="v-seed", tokenize=tokenize)
            db.add(t)
            db.flush()
            _judge(db, t, [1, 1, 1] if i % 2 == 0 else [-1, -1, -1])
            ids[f"offline_{i}"] = t.id
        # a turn still waiting for its judgement
        sid = "s-unscored-" + uuid.uuid4().hex[:6]
        db.add(Session(id=sid, source="inferred", mode="online", created_at=now - timedelta(minutes=5), updated_at=now))
        t = _turn(sid, now - timedelta(minutes=5), [{"role": "user", "content": "Hello there"}],
                  {"content": "Hi! How can I help?"}, next_messages=None, tokenize=tokenize)
        db.add(t)
        ids.update(unscored=sid, unscored_turn=t.id)
    return ids
