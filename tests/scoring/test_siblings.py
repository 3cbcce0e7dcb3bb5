"""Shadow siblings (issue #34): a captured turn resampled from its exact prompt ids when the
policy server has room, each reply stored as a sibling (same session, never in its visible
history, marked in the UI), scored against the same next state, and trained with its original
as one group, whose rewards binary RL standardizes against each other."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from sqlalchemy import Engine, update
from sqlalchemy.orm import Session as OrmSession

from datapool import browse, leases, queries, siblings
from datapool.db import make_engine
from datapool.lineage import session_lineage
from datapool.models import Judgement, Session, Turn
from scoring.judge import PythonJudge
from scoring.score import score_turn
from scoring.siblings import SiblingConfig, resample_siblings
from gateway.classify import turn_kind_of
from base.errors import RequestError
from tests.support.admin_ui import admin_client
from trainer import objectives
from trainer.objectives import ObjectiveConfig
from trainer.samples import load_samples
from vllm_client.sampling import parse_load, sample_from_ids

NOW = datetime.now(UTC).replace(microsecond=0)
QUESTION = "Why is the sky blue?"
JUDGE = PythonJudge("benchmarks.learning.preference:judge")  # +1: under 25 words and on topic

METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="smollm2"} %s
vllm:num_requests_running{engine="1",model_name="smollm2"} 0.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="smollm2"} %s
vllm:num_requests_waiting_by_reason{reason="capacity"} 7.0
"""


def test_load_from_vllm_metrics() -> None:
    load = parse_load(METRICS % ("3.0", "1.0"))
    assert (load.running, load.waiting) == (3.0, 1.0)
    assert parse_load("") == parse_load("# nothing\n")
    assert parse_load("").running == 0.0


def test_a_client_cannot_send_a_sibling() -> None:
    with pytest.raises(RequestError):
        turn_kind_of({"x-turn-type": "sibling"}, {}, [])
    assert turn_kind_of({"x-turn-type": "side"}, {}, []) == "side"


# --------------------------------------------------------------------------- a pool to resample


def add_turn(db: OrmSession, *, reply: str = "It scatters blue light more than red light, because blue "
             "light has a shorter wavelength, and so the whole sky looks blue to us most of the day.",
             mode: str = "online", group: str | None = None, redaction: dict | None = None,
             tool_calls: bool = False, next_state: bool = True, prompt_ids: list[int] | None = None) -> str:
    sid = f"s-{uuid.uuid4().hex[:8]}"
    db.add(Session(id=sid, source="header", mode=mode, group_id=group, created_at=NOW, updated_at=NOW))
    tid = str(uuid.uuid4())
    message: dict[str, Any] = {"role": "assistant", "content": reply}
    if tool_calls:
        message["tool_calls"] = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    db.add(Turn(id=tid, session_id=sid, turn_type="main", endpoint="chat", status="ok", created_at=NOW,
                model="policy", upstream_model="smollm2", policy_version=None, capture="white-box",
                request={"model": "policy", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 24,
                         "temperature": 1.0},
                response={"id": "chatcmpl-1", "choices": [{"index": 0, "finish_reason": "stop", "message": message}]},
                next_state={"messages": [{"role": "user", "content": "Too long. Please keep your answers short."}]}
                if next_state else None,
                prompt_token_ids=prompt_ids or [1, 2, 3, 4], token_ids=[5, 6, 7], logprobs=[-0.1, -0.2, -0.3],
                redaction=redaction))
    db.flush()
    return tid


def fake_vllm(running: float = 0.0, waiting: float = 0.0, *, texts: list[str] | None = None,
              seen: list[Any] | None = None, missing: str | None = None) -> httpx.MockTransport:
    """/metrics and /v1/completions as vLLM answers them (``return_token_ids``, ``logprobs: 0``);
    *missing*: a model name it answers 404 for (a version it does not have loaded)."""
    texts = texts or ["Short: Rayleigh scattering of sunlight.", "Blue light scatters most in the sky's air.",
                      "Sky blue? Air scatters blue light."]

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            return httpx.Response(200, text=METRICS % (running, waiting))
        body = json.loads(request.content)
        if seen is not None:
            seen.append(body)
        if body["model"] == missing:
            return httpx.Response(404, json={"error": {"message": f"The model `{missing}` does not exist."}})
        choices = [{"index": i, "text": texts[i % len(texts)], "token_ids": [100 + i, 101, 2],
                    "logprobs": {"tokens": ["a", "b", "c"], "token_logprobs": [-1.0, -0.5, -0.1],
                                 "top_logprobs": None, "text_offset": [0, 1, 2]}, "finish_reason": "stop"}
                   for i in range(body["n"])]
        return httpx.Response(200, json={"id": "cmpl-1", "object": "text_completion", "model": body["model"],
                                         "choices": choices})

    return httpx.MockTransport(handler)


def test_busy_server_gets_no_resampling(engine: Engine) -> None:
    with OrmSession(engine) as db, db.begin():
        add_turn(db)
    cfg = SiblingConfig("http://vllm:8000/v1", k=3, max_running=2)
    assert resample_siblings(engine, cfg, transport=fake_vllm(running=1, waiting=1)) == []  # a request waits
    assert resample_siblings(engine, cfg, transport=fake_vllm(running=3)) == []  # more than 2 run
    assert len(resample_siblings(engine, cfg, transport=fake_vllm(running=2))) == 3


def test_which_turns_are_resampled_and_how_siblings_are_stored(engine: Engine) -> None:
    with OrmSession(engine) as db, db.begin():
        tid = add_turn(db, prompt_ids=[9, 8, 7, 6, 5])
        skipped = [add_turn(db, mode="eval"), add_turn(db, group="task-1"), add_turn(db, tool_calls=True),
                   add_turn(db, redaction={"counts": {"email": 1}}), add_turn(db, next_state=False)]
    seen: list[Any] = []
    cfg = SiblingConfig("http://vllm:8000/v1", k=3, max_running=None, per_sweep=10)
    ids = resample_siblings(engine, cfg, transport=fake_vllm(seen=seen))
    assert len(ids) == 3 and len(seen) == 1
    # the exact prompt ids, the original's sampling settings, the sampled tokens' log-probs
    assert seen[0] == {"model": "smollm2", "prompt": [9, 8, 7, 6, 5], "n": 3, "max_tokens": 24, "temperature": 1.0,
                       "logprobs": 0, "return_token_ids": True}
    with OrmSession(engine) as db:
        original = db.get(Turn, tid)
        for sid in ids:
            s = db.get(Turn, sid)
            assert (s.turn_type, s.sibling_of, s.session_id) == ("sibling", tid, original.session_id)
            assert s.request == original.request and s.next_state == original.next_state
            assert s.prompt_token_ids == [9, 8, 7, 6, 5] and s.token_ids[1:] == [101, 2]
            assert s.logprobs == [-1.0, -0.5, -0.1] and s.created_at == original.created_at
            assert s.response_id is None and s.link_hash is None
            assert db.get(Judgement, sid).status == "pending"
        assert siblings.siblings_of(db, [tid]) == {tid: sorted(ids)}
        assert all(not siblings.siblings_of(db, [x]) for x in skipped)
    # resampled once: a second sweep finds nothing left
    assert resample_siblings(engine, cfg, transport=fake_vllm()) == []


def test_a_version_no_longer_loaded_falls_back_to_the_active_one(engine: Engine) -> None:
    from datapool.models import PolicyVersion

    with OrmSession(engine) as db, db.begin():
        tid = add_turn(db)
        db.get(Turn, tid).upstream_model = "old-version"
        db.add(PolicyVersion(name="v-active", base_model="smollm2", kind="lora", status="active", path="/x"))
    seen: list[Any] = []
    ids = resample_siblings(engine, SiblingConfig("http://vllm:8000/v1", k=2, max_running=None),
                            transport=fake_vllm(seen=seen, missing="old-version"))
    assert [b["model"] for b in seen] == ["old-version", "v-active"]
    with OrmSession(engine) as db:
        assert {(db.get(Turn, i).upstream_model, db.get(Turn, i).policy_version) for i in ids} == {
            ("v-active", "v-active")}


def test_scored_siblings_train_as_the_originals_group(engine: Engine) -> None:
    """Every turn of the batch failed (−1): under the batch baseline binary RL has no signal
    (A = 0). A turn whose sibling succeeded forms a group of its own: its failure is now worse
    than its group's mean, the sibling's success better."""
    with OrmSession(engine) as db, db.begin():
        tid = add_turn(db)
        others = [add_turn(db) for _ in range(3)]
    cfg = SiblingConfig("http://vllm:8000/v1", k=3, max_running=None)
    ids = resample_siblings(engine, cfg, turn_ids=[tid], transport=fake_vllm(
        texts=["Blue light scatters most in the sky.", "Because of the way light and air work together, which is "
               "a long story about physics, waves, particles, colors, eyes, brains and more words than asked for."]))
    for t in [tid, *others, *ids]:
        score_turn(engine, t, JUDGE, 1)
    with OrmSession(engine) as db:
        rewards = {t: db.get(Judgement, t).reward for t in [tid, *others, *ids]}
        assert [rewards[t] for t in [tid, *others]] == [-1.0] * 4
        assert sorted(rewards[i] for i in ids) == [-1.0, 1.0, 1.0]
        # the samples bring the siblings along (test_leases_never_hand_out_a_sibling: not leased)
        samples = load_samples(db, [tid, *others])
        plain = load_samples(db, [tid, *others], siblings=False)
        view = queries.get_session(db, db.get(Turn, tid).session_id)
    assert [s.turn_id for s in samples] == [tid, *others, *sorted(ids)]
    assert {s.group_id for s in samples if s.turn_id in (tid, *ids)} == {f"siblings:{tid}"}
    assert all(s.group_id is None for s in samples if s.turn_id in others)
    assert all(s.sibling_of == tid and s.behaviour_logprobs == [-1.0, -0.5, -0.1] for s in samples[4:])
    assert [s.turn_id for s in plain] == [tid, *others]
    # the session's history shows the original only; its siblings are listed apart
    assert [t["id"] for t in view["turns"]] == [tid] and view["turn_count"] == 1
    assert sorted(t["id"] for t in view["siblings"]) == sorted(ids)

    def advantages(batch: list[Any]) -> torch.Tensor:
        mask = torch.ones(len(batch), 3)
        rewards_t = objectives.scores_to_token_rewards(objectives.sample_rewards(batch), mask)
        groups = [s.group_id for s in batch]
        return objectives.compute_advantages(ObjectiveConfig(objective="rl"), response_mask=mask,
                                             token_level_rewards=rewards_t,
                                             index=groups if any(g is not None for g in groups) else None)[:, 0]

    assert torch.equal(advantages(plain), torch.zeros(4))  # all −1: no signal
    adv = advantages(samples)
    by_id = dict(zip([s.turn_id for s in samples], adv.tolist(), strict=True))
    assert by_id[tid] < 0 and all(by_id[o] == 0.0 for o in others)
    assert all((by_id[i] > 0) == (rewards[i] == 1.0) for i in ids)
    assert abs(sum(by_id[t] for t in [tid, *ids])) < 1e-5  # standardized within the group


def test_leases_never_hand_out_a_sibling(engine: Engine) -> None:
    with OrmSession(engine) as db, db.begin():
        tid = add_turn(db)
    ids = resample_siblings(engine, SiblingConfig("http://vllm:8000/v1", k=2, max_running=None), transport=fake_vllm())
    for t in [tid, *ids]:
        score_turn(engine, t, JUDGE, 1)
    from datapool.models import TrainingRun

    with OrmSession(engine) as db, db.begin():
        db.add(TrainingRun(id="run-s", objective="rl", backend="local", status="running"))
    leased = leases.lease(engine, "run-s", limit=10, lease_s=60, filters=leases.Filters())
    assert leased == [tid]


# a session: its own turns in order, each main ("main", k siblings) or side ("side", 0)
own_turns = st.lists(st.one_of(st.tuples(st.just("main"), st.integers(0, 3)), st.tuples(st.just("side"), st.just(0))),
                     min_size=0, max_size=5)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sessions=st.lists(own_turns, min_size=1, max_size=4))
def test_turn_counts_leave_siblings_apart(engine: Engine, sessions: list[list[tuple[str, int]]]) -> None:
    """Every count of a session's turns (the sessions list and its API, the session itself, the
    filter counts over an export's selection, lineage) is its own turns; siblings are apart,
    and a sibling's reward lands in no reward bucket."""
    task = f"task-{uuid.uuid4().hex[:8]}"  # this example's sessions only: the pool outlives it
    with OrmSession(engine) as db, db.begin():
        sids = []
        for n, spec in enumerate(sessions):
            sid = f"s-{uuid.uuid4().hex[:8]}"
            sids.append(sid)
            db.add(Session(id=sid, source="header", mode="online", task_id=task, created_at=NOW, updated_at=NOW))
            for kind, k in spec:
                t = Turn(id=str(uuid.uuid4()), session_id=sid, turn_type=kind, endpoint="chat", status="ok",
                         created_at=NOW, model="policy", capture="white-box",
                         request={"messages": [{"role": "user", "content": f"{QUESTION} {n}"}]},
                         response={"id": "r", "choices": [{"index": 0, "message": {"role": "assistant", "content": "x"}}]},
                         prompt_token_ids=[1, 2], token_ids=[3], logprobs=[-0.1])
                db.add(t)
                db.flush()
                replies = [type("Reply", (), {"text": f"alt {i}", "token_ids": [9], "logprobs": [-1.0],
                                              "finish_reason": "stop"})() for i in range(k)]
                ids = siblings.add_siblings(db, t, replies, model="smollm2", policy_version="v1")
                if ids:  # scored siblings: their reward must not reach the session's buckets
                    db.execute(update(Judgement).where(Judgement.turn_id.in_(ids)).values(reward=1.0, status="done"))
    own = {sid: len(spec) for sid, spec in zip(sids, sessions, strict=True)}
    main = {sid: sum(kind == "main" for kind, _ in spec) for sid, spec in zip(sids, sessions, strict=True)}
    sibs = {sid: sum(k for _, k in spec) for sid, spec in zip(sids, sessions, strict=True)}
    with OrmSession(engine) as db:
        api, _ = queries.list_sessions(db, limit=50, cursor=None, filters=queries.SessionFilter(task_id=task))
        assert {s["id"]: (s["turn_count"], s["sibling_count"]) for s in api} == \
            {sid: (own[sid], sibs[sid]) for sid in sids}
        rows, _, _ = browse.sessions_window(db, browse.Browse(task_id=task), limit=50)
        assert {r["id"]: (r["turns"], r["main"], r["siblings"]) for r in rows} == \
            {sid: (own[sid], main[sid], sibs[sid]) for sid in sids}
        counts = browse.counts(db, browse.Browse(task_id=task))
        assert (counts["sessions"], counts["turns"], counts["siblings"], counts["positive"]) == \
            (len(sids), sum(own.values()), sum(sibs.values()), 0)
        assert counts["unscored"] + counts["negative"] + counts["neutral"] + counts["tie"] == counts["turns"]
        # a filter that selects siblings only: sessions that have them, no own turn
        only = browse.counts(db, browse.Browse(task_id=task, turn_type="sibling"))
        assert (only["sessions"], only["turns"], only["siblings"]) == \
            (sum(1 for sid in sids if sibs[sid]), 0, sum(sibs.values()))
        for sid in sids:
            view = queries.get_session(db, sid)
            assert view is not None
            assert (view["turn_count"], len(view["turns"]), view["sibling_count"], len(view["siblings"])) == \
                (own[sid], own[sid], sibs[sid], sibs[sid])
            assert (session_lineage(db, sid)["turns"], session_lineage(db, sid)["siblings"]) == (own[sid], sibs[sid])


def test_the_admin_ui_marks_siblings_and_keeps_them_out_of_the_conversation(engine: Engine, database_url: str,
                                                                            tmp_path: Path) -> None:
    with OrmSession(engine) as db, db.begin():
        tid = add_turn(db)
        sid = db.get(Turn, tid).session_id
    ids = resample_siblings(engine, SiblingConfig("http://vllm:8000/v1", k=2, max_running=None),
                            transport=fake_vllm(texts=["SIBLING-ONE says blue.", "SIBLING-TWO says scattering."]))
    score_turn(engine, ids[0], JUDGE, 1)
    with admin_client(database_url, tmp_path) as client:
        page = client.get(f"/admin/sessions/{sid}").text
        conversation, _, rest = page.partition('data-testid="siblings"')
        assert "SIBLING-ONE" not in conversation and "SIBLING-TWO" not in conversation
        assert "2 shadow siblings" in rest and "never sent to the user" in rest
        assert "SIBLING-ONE" in rest and "SIBLING-TWO" in rest and 'class="badge sibling"' in rest
        rows = client.get("/admin/turns?turn_type=sibling").text
        assert all(f"#turn-{i}" in rows for i in ids) and f"#turn-{tid}" not in rows
        api = client.get(f"/api/sessions/{sid}").json()
        assert [t["id"] for t in api["turns"]] == [tid]
        assert sorted(t["id"] for t in api["siblings"]) == sorted(ids)
        assert all(t["turn_type"] == "sibling" and t["sibling_of"] == tid for t in api["siblings"])
        # counted apart wherever a session's turns are counted
        assert (api["turn_count"], api["sibling_count"]) == (1, 2)
        assert "1 turns (and 2 shadow siblings)" in page
        listed = {s["id"]: s for s in client.get("/api/sessions").json()["data"]}
        assert (listed[sid]["turn_count"], listed[sid]["sibling_count"]) == (1, 2)
        row = client.get("/admin/sessions").text.partition(f'data-session="{sid}"')[2].partition("</tr>")[0]
        assert 'data-siblings="2"' in row and "+2 siblings" in row and "side" not in row
        put = client.put(f"/api/sessions/{sid}", json={"mode": "online"}, headers={"Authorization": "Bearer tok-123"})
        assert put.status_code == 200 and (put.json()["turn_count"], put.json()["sibling_count"]) == (1, 2)


# ------------------------------------------------------------------------------------ vLLM-CPU


async def test_resampling_on_vllm(vllm_server: Any) -> None:
    """The real server: replies to exact prompt ids, their token ids and one log-prob each; the
    load it reports while idle lets resampling run."""
    base, model = vllm_server.base_url, vllm_server.model
    async with httpx.AsyncClient(timeout=120) as http:
        prompt = (await http.post(f"{base.removesuffix('/v1')}/tokenize", json={
            "model": model, "messages": [{"role": "user", "content": QUESTION}],
            "add_generation_prompt": True})).json()["tokens"]
        replies = await sample_from_ids(http, base, model, prompt, n=3, max_tokens=16, temperature=1.0, seed=1)
        # Each reply's ids are its text: what a sibling stores trains on what it shows. (Not "the
        # same seed gives the same replies": on a shared CPU server the batch a request lands in
        # changes its logits, and a CI run saw one of three seeded samples differ.)
        decoded = [(await http.post(f"{base.removesuffix('/v1')}/detokenize", json={
            "model": model, "tokens": r.token_ids})).json()["prompt"] for r in replies]
        from vllm_client.sampling import server_load

        load = await server_load(http, base)
    assert len(replies) == 3 and load.waiting == 0
    for r, text in zip(replies, decoded, strict=True):
        assert 0 < len(r.token_ids) <= 16 and len(r.logprobs) == len(r.token_ids)
        assert all(lp <= 0 for lp in r.logprobs) and r.text
        assert text == r.text
    assert len({tuple(r.token_ids) for r in replies}) > 1  # n samples, not one repeated


def test_siblings_end_to_end_on_vllm(sqlite_url: str, vllm_server: Any) -> None:
    """A real captured turn (prompt ids from vLLM's chat template, reply from vLLM) resampled by
    resample_siblings on the real server, its load checked, and the siblings scored."""
    base, model = vllm_server.base_url, vllm_server.model
    chat = httpx.post(f"{base}/chat/completions", json={
        "model": model, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 24, "temperature": 1.0,
        "seed": 5, "logprobs": True, "return_token_ids": True}, timeout=120).json()
    engine = make_engine(sqlite_url)
    with OrmSession(engine) as db, db.begin():
        tid = add_turn(db, reply=chat["choices"][0]["message"]["content"], prompt_ids=chat["prompt_token_ids"])
        t = db.get(Turn, tid)
        t.token_ids = chat["choices"][0]["token_ids"]
        t.logprobs = [c["logprob"] for c in chat["choices"][0]["logprobs"]["content"]]
    ids = resample_siblings(engine, SiblingConfig(base, k=3, max_running=4))
    assert len(ids) == 3
    for i in ids:
        assert score_turn(engine, i, JUDGE, 1) == "scored"
    with OrmSession(engine) as db:
        for i in ids:
            s = db.get(Turn, i)
            assert s.upstream_model == model and len(s.token_ids) == len(s.logprobs) <= 24
            assert db.get(Judgement, i).reward in (-1.0, 1.0)
    engine.dispose()


def test_a_round_waits_for_its_turns_siblings(engine: Engine) -> None:
    """``OnlineConfig.siblings_wait_s``: the round's turns a worker will resample, or whose siblings are not
    scored yet, are awaited (``siblings.awaiting``); a turn that cannot have siblings (a tool call) is not. The
    online trainer's wait ends once none is pending, so the samples it loads then carry every sibling; it ends
    at once when the loop is told to stop, and at its deadline with what is scored."""
    from types import SimpleNamespace

    from trainer.config import OnlineConfig
    from trainer.online import OnlineTrainer

    with OrmSession(engine) as db, db.begin():
        tid, tool = add_turn(db), add_turn(db, tool_calls=True)
    with OrmSession(engine) as db:
        assert siblings.awaiting(db, [tid, tool]) == [tid]  # the worker has yet to resample it
    cfg = SiblingConfig("http://vllm:8000/v1", k=2, max_running=None)
    made: list[str] = []

    def worker_sweep() -> bool:  # what a worker does between two of the trainer's polls: resample, then score
        if not made:
            made.extend(resample_siblings(engine, cfg, turn_ids=[tid], transport=fake_vllm()))
            with OrmSession(engine) as db:
                assert siblings.awaiting(db, [tid, tool]) == [tid]  # resampled, not scored
            score_turn(engine, made[0], JUDGE, 1)
        elif len(made) == 2:
            score_turn(engine, made[1], JUDGE, 1)
            made.append("scored")
        return False

    trainer = SimpleNamespace(engine=engine, step=0, _stop=worker_sweep,
                              cfg=OnlineConfig(siblings_wait_s=600.0, poll_s=0.0))
    OnlineTrainer._await_siblings(trainer, [tid, tool])
    assert made[2:] == ["scored"]  # it waited for both, and no longer
    with OrmSession(engine) as db:
        assert siblings.awaiting(db, [tid, tool]) == []
        assert sorted(s.turn_id for s in load_samples(db, [tid, tool])[2:]) == sorted(made[:2])
    # told to stop, or out of time: it returns with a turn still awaited
    with OrmSession(engine) as db, db.begin():
        late = add_turn(db)
    trainer._stop = lambda: True
    OnlineTrainer._await_siblings(trainer, [late])
    trainer._stop, trainer.cfg = (lambda: False), OnlineConfig(siblings_wait_s=0.05, poll_s=0.01)
    OnlineTrainer._await_siblings(trainer, [late])
    with OrmSession(engine) as db:
        assert siblings.awaiting(db, [late]) == [late]
    with pytest.raises(ValueError, match="siblings_wait_s"):
        OnlineConfig(siblings_wait_s=-1)
