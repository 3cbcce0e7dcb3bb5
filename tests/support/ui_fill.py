"""A pool holding every state a turn can be in, for the read-side fill test: judgements pending,
waiting, dead, tied, unparsable, skipped, scored and missing; error, cancelled and side turns;
black-box turns without token ids; odd content (text parts, None, tool calls without content,
markdown with raw HTML, 60 kB of text, non-Latin scripts and emoji); requests without any
setting, turns without usage or latency; sessions of 1 and of 200 turns. ``TurnSpec`` describes
one turn; hypothesis draws random ones."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

from hypothesis import strategies as st
from sqlalchemy import Engine
from sqlalchemy.orm import Session as OrmSession

from datapool.models import Judgement, Label, Session, Turn, Vote
from base.vocab import CaptureKind, JudgementStatus, SessionMode, SessionSource, TurnKind, TurnStatus

JUDGEMENTS = (None, *JudgementStatus)  # None: no judgement row at all
CONTENTS = ("text", "parts", "none", "tool_calls", "markdown", "empty", "huge", "unicode")
SMALL = tuple(c for c in CONTENTS if c != "huge")  # the 200-turn session's (each request repeats the history)
UNICODE = "Ünïcødé ✓ 日本語のテキスト العربية עברית 🙂👍🏽 e\u0301 \u200b zero-width, 𝔘𝔫𝔦"


@dataclass(frozen=True)
class TurnSpec:
    status: str = TurnStatus.OK
    turn_type: str = TurnKind.MAIN
    capture: str = CaptureKind.WHITE_BOX
    judgement: str | None = JudgementStatus.SCORED
    votes: tuple[int | None, ...] = (1, 1, -1)
    content: str = "text"
    next_state: bool = True
    label: bool = False
    settings: bool = True  # False: the request names no sampling setting at all


turn_specs = st.builds(
    TurnSpec,
    status=st.sampled_from(list(TurnStatus)),
    turn_type=st.sampled_from(list(TurnKind)),
    capture=st.sampled_from(list(CaptureKind)),
    judgement=st.sampled_from(JUDGEMENTS),
    votes=st.lists(st.sampled_from((1, 0, -1, None)), max_size=4).map(tuple),
    content=st.sampled_from(CONTENTS),
    next_state=st.booleans(),
    label=st.booleans(),
    settings=st.booleans(),
)


def every_state() -> list[list[TurnSpec]]:
    """Sessions that together hold each state at least once, and one of 200 turns."""
    one_each = [[TurnSpec(judgement=j, votes=(None, None) if j == JudgementStatus.UNPARSABLE else (1, -1, 0))]
                for j in JUDGEMENTS]
    odd = [[TurnSpec(status=TurnStatus.ERROR, judgement=None, next_state=False)],
           [TurnSpec(status=TurnStatus.CANCELLED, judgement=JudgementStatus.SKIPPED)],
           [TurnSpec(turn_type=TurnKind.SIDE, judgement=None)],
           [TurnSpec(capture=CaptureKind.BLACK_BOX, judgement=None, content="parts")],
           [TurnSpec(content=c, judgement=JudgementStatus.PENDING) for c in CONTENTS],
           [TurnSpec(settings=False, capture=CaptureKind.BLACK_BOX, content="unicode")]]
    long = [TurnSpec(judgement=JUDGEMENTS[i % len(JUDGEMENTS)], capture=list(CaptureKind)[i % 2],
                     turn_type=TurnKind.SIDE if i % 17 == 5 else TurnKind.MAIN, content=SMALL[i % len(SMALL)],
                     status=TurnStatus.ERROR if i % 23 == 7 else TurnStatus.OK, label=i % 11 == 0)
            for i in range(200)]
    return one_each + odd + [long]


def _content(kind: str, i: int) -> dict[str, Any]:
    return {"text": {"content": f"Reply {i}."},
            "parts": {"content": [{"type": "text", "text": f"Reply {i} in parts."}]},
            "none": {"content": None},
            "empty": {"content": ""},
            "huge": {"content": ("A long line of a tool dump, " * 40 + "\n") * 54},  # 60 kB: past the markdown limit
            "unicode": {"content": f"{UNICODE} {i}"},
            "markdown": {"content": f"# Heading {i}\n\n```python\nprint('<b>{i}</b>')\n```\n\n* item\n<script>x()</script>"},
            "tool_calls": {"content": None, "tool_calls": [{"id": f"call_{i}", "type": "function", "function": {
                "name": "lookup", "arguments": '{"q": "weather"}'}}]}}[kind]


def write_session(engine: Engine, specs: list[TurnSpec], *, at: datetime | None = None) -> tuple[str, list[str]]:
    """One session holding *specs* in order; returns its id and its turns' ids."""
    at = at or datetime.now(timezone.utc).replace(microsecond=0)
    sid = "fill-" + uuid.uuid4().hex[:12]
    ids: list[str] = []
    with OrmSession(engine) as db, db.begin():
        db.add(Session(id=sid, source=SessionSource.HEADER, mode=SessionMode.ONLINE, created_at=at, updated_at=at))
        db.flush()
        history: list[dict[str, Any]] = [{"role": "system", "content": "You are terse."}]
        for i, spec in enumerate(specs):
            history = history + [{"role": "user", "content": f"question {i}"}]
            reply = _content(spec.content, i)
            white = spec.capture == CaptureKind.WHITE_BOX and spec.status == TurnStatus.OK
            ok = spec.status == TurnStatus.OK
            t = Turn(
                id=str(uuid.uuid4()), session_id=sid, turn_type=spec.turn_type, endpoint="chat", status=spec.status,
                created_at=at + timedelta(seconds=i), model="smollm2", upstream_model="smollm2",
                policy_version="v-fill" if i % 3 == 0 else None, capture=spec.capture,
                request={"model": "smollm2", "messages": list(history),
                         **({"temperature": 0.7, "max_tokens": 64} if spec.settings else {}),
                         **({"tools": [{"type": "function", "function": {"name": "lookup", "parameters": {
                             "type": "object", "properties": {"q": {"type": "string"}}}}}]}
                            if spec.content == "tool_calls" else {})},
                response={"id": f"chatcmpl-{i}", "choices": [{"index": 0, "finish_reason": "length" if i % 4 == 1
                                                              else "stop", "message": {"role": "assistant", **reply}}]}
                if ok else None,
                error=None if ok else {"error": {"message": "upstream said no", "type": "upstream_error"}},
                next_state={"messages": [{"role": "user", "content": f"next {i}"}]} if spec.next_state else None,
                prompt_token_ids=list(range(1, 9)) if white else None,
                token_ids=[100 + i, 101, 2] if white else None, logprobs=[-0.1, -2.5, -0.01] if white else None,
                latency_ms=None if i % 5 == 2 else 40.0 + i,
                usage={"prompt_tokens": 8, "completion_tokens": 3} if ok and i % 6 != 3 else None)
            db.add(t)
            db.flush()
            for k, v in enumerate(spec.votes if spec.judgement else ()):
                db.add(Vote(turn_id=t.id, kind="prm", dedupe_key=f"prm:fill:{k}", judge="fill-judge",
                            prompt_version="v1", vote_index=k, value=v,
                            rationale=None if v is None else f"vote {v}", raw="???" if v is None else None))
            if spec.judgement is not None:
                scored = spec.judgement == JudgementStatus.SCORED
                db.add(Judgement(turn_id=t.id, status=spec.judgement, reward=(-1.0 if i % 2 else 1.0) if scored else None,
                                 prm_reward=1.0 if scored else None, vote_mean=0.3 if scored else None,
                                 integrated_reward=0.5 if scored and i % 2 else None, attempts=5 if
                                 spec.judgement == JudgementStatus.DEAD else 1,
                                 last_error="ContextWindowExceededError: too long"
                                 if spec.judgement == JudgementStatus.DEAD else None, judge="fill-judge"))
            if spec.label:
                db.add(Label(turn_id=t.id, kind="tag", value="fill", author="test"))
            ids.append(t.id)
            if ok:
                history = history + [{"role": "assistant", **reply}]
    return sid, ids


def write_training_states(engine: Engine) -> dict[str, list[str]]:
    """Training in every state the training pages show: a run without steps, a run of one step,
    runs whose metrics hold NaN and infinities (floats on SQLite; on PostgreSQL, whose JSONB
    refuses them, the strings JSON writers use), a failed run; versions with and without an
    eval, with held-out replies on one side only or both. Returns the run ids and the version
    names (and a name no row holds)."""
    from datapool import evals, leases
    from datapool.models import PolicyEvent, PolicyVersion
    from base.vocab import RunStatus, VersionKind, VersionStatus

    odd = engine.dialect.name == "sqlite"
    nan, inf, ninf = (float("nan"), float("inf"), float("-inf")) if odd else ("NaN", "Infinity", "-Infinity")
    tag = uuid.uuid4().hex[:6]
    empty = leases.start_run(engine, objective="rl", backend="local", config={}, base_version=None)
    one = leases.start_run(engine, objective="opd", backend="local", config={"lr": 1e-5}, base_version=None)
    leases.record_step(engine, one, 1, [], {"loss": 0.7, "kl": 0.0})
    weird = leases.start_run(engine, objective="rl", backend="verl", config={"nested": {"a": [1, 2]}}, base_version=None)
    for step in range(1, 30):
        leases.record_step(engine, weird, step, [], {
            "pg_loss": nan if step % 7 == 0 else -0.00475 * step, "kl": inf if step == 3 else 1e-7 * step,
            "advantage_mean": ninf if step == 5 else 12345.6 * step, "grad_norm": "not a number", "flag": True,
            "turn_ids": ["a", "b"], "candidate": f"fill-{tag}-v1" if step == 29 else None})
    leases.finish_run(engine, weird, status=RunStatus.FAILED)
    names = [f"fill-{tag}-v1", f"fill-{tag}-v2", f"fill-{tag}-v3"]
    with OrmSession(engine) as db, db.begin():
        parent = None
        for i, name in enumerate(names):
            v = PolicyVersion(name=name, base_model="smollm2", kind=VersionKind.LORA, path=f"/nowhere/{name}",
                              parent_id=parent, status=(VersionStatus.ACTIVE, VersionStatus.REFUSED,
                                                        VersionStatus.CANDIDATE)[i],
                              stats={"run_id": weird, "step": 29 + i, "turns": 2})
            db.add(v)
            db.flush()
            parent = v.id
            if i < 2:  # the third has no eval
                db.add(PolicyEvent(version_id=v.id, action="eval", actor="eval-gate",
                                   metrics={"score": 0.5 + i / 10, "active_score": 0.5, "against": "smollm2",
                                            "n": 2, "threshold": 0.1}))
    prompts = [[{"role": "user", "content": "Name a tree."}], [{"role": "user", "content": "Name a river."}]]
    evals.record_replies(engine, "smollm2", prompts, ["Oak.", "Nile."], [1.0, 1.0])
    evals.record_replies(engine, names[0], prompts, ["<b>Birch</b>", ""], [1.0, None])
    evals.record_replies(engine, names[1], prompts[1:], ["Rhine."], [0.0])
    return {"runs": [empty, one, weird], "versions": ["smollm2", *names], "missing": [f"fill-{tag}-nowhere"]}
