"""Online continual mode on the CPU with the python judge and the real SmolLM2 on vLLM: after a
few scored interactions a trained version is active and serving, the gateway answers every
request of a concurrent stream through each switch, a regressing candidate is refused, a
regressing active version is rolled back, and a trainer killed mid-step loses and duplicates
no turn."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import uuid
from collections import Counter
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from openai import OpenAI
from sqlalchemy import select, text
from sqlalchemy.orm import Session as OrmSession

from datapool.db import make_engine
from datapool.models import Judgement, PolicyEvent, PolicyVersion, Session, TrainingLease, TrainingRun, TrainingStep, Turn
from tests.support.vllm_servers import RunningVLLM
from tests.support.holds import HeldTrainingStep
from tests.support.pg import fresh_database
from tests.support.processes import GatewayProcess, WorkerProcess, wait_for
from tests.support.redis_server import unique_queue
from benchmarks.learning import preference
from datapool import evals, versions
from vllm_client.adapters import served_models, unload
from vllm_client.http import server_root
from base.vocab import VersionKind
from publishing.publish import PublishRequest, publish
from datapool.leases import Filters
from trainer.local import LocalConfig
from trainer.objectives import ObjectiveConfig
from trainer.online import REFUSED, OnlineConfig, OnlineTrainer

QUESTIONS = ["Name a fruit.", "Name a color.", "Name an animal.", "Name a city.", "Name a planet.",
             "Name a metal."]
EVAL_PROMPTS = ["Name a tree.", "Name a river.", "Name a bird."]


@pytest.fixture
def servers(vllm_server: RunningVLLM, teacher_server: RunningVLLM) -> list[str]:
    return [vllm_server.base_url, teacher_server.base_url]


@pytest.fixture
def pg(pg_admin_dsn: str) -> Iterator[str]:
    from datapool.db import upgrade

    url, drop = fresh_database(pg_admin_dsn)
    upgrade(url)
    yield url
    drop()


@pytest.fixture
def cleanup(servers: list[str], pg: str) -> Iterator[None]:
    """Unload every version the test's pool created from the shared vLLMs afterwards."""
    yield
    engine = make_engine(pg)
    with OrmSession(engine) as db:
        names = list(db.scalars(select(PolicyVersion.name)))
    engine.dispose()
    with httpx.Client(timeout=10) as http:
        for name in names:
            unload(http, servers, name)


def _scored_turns(pg: str, upstream: str, data_dir: Path, questions: list[str]) -> list[str]:
    """The turns of *questions* asked through a gateway of their own on *pg*, once stored, then
    scored -1, +1, -1, ... (the gateway gone)."""
    data_dir.mkdir()
    with GatewayProcess(data_dir, database_url=pg, upstream_url=upstream) as gw:
        ids = []
        for q in questions:
            r = httpx.post(f"{gw.base_url}/chat/completions", timeout=120, json={
                "model": "policy", "max_tokens": 8, "temperature": 0, "messages": [{"role": "user", "content": q}]})
            ids.append(r.headers["x-turn-id"])
        gw.stored_turn(ids[-1])
    engine = make_engine(pg)
    with OrmSession(engine) as db, db.begin():
        for i, tid in enumerate(ids):
            db.add(Judgement(turn_id=tid, status="scored", reward=1.0 if i % 2 else -1.0, attempts=1))
    engine.dispose()
    return ids


def _trainer_args(pg: str, model_dir: Path, servers: list[str], *extra: str) -> list[str]:
    return [sys.executable, "-m", "nextstate.cli", "train", "--online", "--objective", "rl", "--database-url", pg,
            "--model-dir", str(model_dir), "--lr", "1e-4", "--rollback-window", "0",
            *(a for u in servers for a in ("--vllm-url", u)), *extra]


def _spawn(args: list[str], data: Path, log_name: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "NEXTSTATE_DATA_DIR": str(data), "NEXTSTATE_UPSTREAM_MODEL": "smollm2"}
    log = open(data / log_name, "ab")
    return subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, sig)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


class Stream:
    """Concurrent requests to `policy` while the alias switches; every failure is kept."""

    def __init__(self, base_url: str, threads: int = 2):
        self.base_url = base_url
        self.errors: list[str] = []
        self.turns: list[str] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(threads)]

    def _run(self, i: int) -> None:
        with httpx.Client(timeout=120) as http:
            n = 0
            while not self.stop.is_set():
                n += 1
                try:
                    r = http.post(f"{self.base_url}/chat/completions", headers={"X-Turn-Type": "side"}, json={
                        "model": "policy", "max_tokens": 4, "temperature": 0,
                        "messages": [{"role": "user", "content": f"Say a number ({i}-{n})."}]})
                    if r.status_code != 200 or not r.json()["choices"]:
                        self.errors.append(f"HTTP {r.status_code}: {r.text[:200]}")
                    else:
                        self.turns.append(r.headers["x-turn-id"])
                except httpx.HTTPError as exc:
                    self.errors.append(f"{type(exc).__name__}: {exc}")

    def __enter__(self) -> "Stream":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(180)


def _interact(client: OpenAI, question: str, good: bool) -> str:
    """One exchange of a simulated user: a question, the reply, then the user's reaction (the
    reply's next state). Returns the first turn's id."""
    messages = [{"role": "user", "content": question}]
    raw = client.chat.completions.with_raw_response.create(model="policy", messages=messages, max_tokens=12,
                                                           temperature=0.8)
    reaction = "Thanks, that is what I needed." if good else "No, answer with one word."
    messages += [{"role": "assistant", "content": raw.parse().choices[0].message.content},
                 {"role": "user", "content": reaction}]
    client.chat.completions.create(model="policy", messages=messages, max_tokens=1)
    return raw.headers["x-turn-id"]


def test_online_loop_promotes_a_version_that_serves_without_a_dropped_request(
        pg: str, servers: list[str], model_dir: Path, redis_url: str, tmp_path: Path, cleanup: None) -> None:
    queue = unique_queue()
    common = {"NEXTSTATE_BROKER_URL": redis_url, "NEXTSTATE_QUEUE": queue}
    prompts = tmp_path / "eval.txt"
    prompts.write_text("\n".join(EVAL_PROMPTS))
    with GatewayProcess(tmp_path / "gw", database_url=pg, upstream_url=servers[0], env=common) as gw, \
            WorkerProcess(tmp_path / "wk", database_url=pg, broker_url=redis_url, env=common | {
                "NEXTSTATE_JUDGE_BACKEND": "python", "NEXTSTATE_JUDGE_PYTHON": "tests.support.judges:verdict",
                "NEXTSTATE_JUDGE_VOTES": "1", "NEXTSTATE_TEACHER_URL": servers[1]}):
        trainer = _spawn(_trainer_args(pg, model_dir, servers, "--k", "4", "--eval-prompts", str(prompts),
                                       "--eval-scorer", "tests.support.judges:lenient_scorer", "--eval-threshold", "1"),
                         tmp_path, "trainer.log")
        try:
            client = OpenAI(base_url=gw.base_url, api_key="unused", max_retries=0, timeout=120)
            with Stream(gw.base_url) as stream:
                wait_for(lambda: len(stream.turns) >= 3, timeout=120)
                first = [_interact(client, q, good=i % 2 == 0) for i, q in enumerate(QUESTIONS[:4])]

                def active() -> str | None:
                    return httpx.get(f"{gw.url}/api/policy/versions", timeout=10).json()["active"]

                try:
                    name = wait_for(active, timeout=600, interval=1)
                except AssertionError:
                    pytest.fail("no version became active; trainer log:\n"
                                + (tmp_path / "trainer.log").read_text()[-4000:])
                # the gateway follows the alias within its refresh period
                wait_for(lambda: httpx.get(f"{gw.base_url}/models", timeout=10).json()["data"][-1]["root"] == name)
                before = len(stream.turns)
                wait_for(lambda: len(stream.turns) >= before + 3, timeout=120)
            assert stream.errors == [], stream.errors[:5]
            r = client.chat.completions.with_raw_response.create(
                model="policy", messages=[{"role": "user", "content": "Name a fruit."}], max_tokens=4)
            served = gw.stored_turn(r.headers["x-turn-id"])["policy_version"]
            assert served == name
        finally:
            _stop(trainer)
    engine = make_engine(pg)
    with OrmSession(engine) as db:
        versions = {t.policy_version for t in db.scalars(select(Turn).where(Turn.id.in_(stream.turns)))}
        steps = db.scalars(select(TrainingStep)).all()
    engine.dispose()
    # the stream was served by the base model before the switch and by the new version after it
    assert {"smollm2", name} <= versions, versions
    assert sorted(tid for s in steps for tid in s.metrics["turn_ids"]) == sorted(first)
    engine = make_engine(pg)
    with OrmSession(engine) as db:
        actions = [a for a, in db.execute(select(PolicyEvent.action).join(PolicyVersion).where(
            PolicyVersion.name == name).order_by(PolicyEvent.id))]
        promote = db.scalars(select(PolicyEvent).where(PolicyEvent.action == "promote")).one()
    engine.dispose()
    assert actions == ["publish", "eval", "promote"], actions
    assert promote.metrics["learning_latency_s_max"] > 0


def test_policy_api_lists_versions_and_events(pg: str, servers: list[str], tmp_path: Path) -> None:
    engine = make_engine(pg)
    with OrmSession(engine) as db, db.begin():
        v = PolicyVersion(name=f"api-{uuid.uuid4().hex[:6]}", base_model="smollm2", kind="lora", path="/nowhere",
                          status=REFUSED, stats={"step": 1})
        db.add(v)
        db.flush()
        db.add(PolicyEvent(version_id=v.id, action="refuse", actor="eval-gate", reason="worse",
                           metrics={"score": 0.1}))
        name = v.name
    engine.dispose()
    with GatewayProcess(tmp_path / "gw", database_url=pg, upstream_url=servers[0]) as gw:
        versions = httpx.get(f"{gw.url}/api/policy/versions", timeout=10).json()
        assert versions["active"] is None and versions["data"][0]["status"] == REFUSED
        events = httpx.get(f"{gw.url}/api/policy/events", params={"version": name}, timeout=10).json()["data"]
        assert [(e["action"], e["actor"], e["metrics"]) for e in events] == [("refuse", "eval-gate", {"score": 0.1})]
        missing = httpx.get(f"{gw.url}/api/policy/events", params={"version": "nope"}, timeout=10)
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "version_not_found"
        bad = httpx.get(f"{gw.url}/api/policy/events", params={"action": "explode"}, timeout=10)
        assert bad.status_code in (400, 422)


@pytest.fixture(scope="module")
def garbling_adapter(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Path:
    """A LoRA adapter with large random B matrices: it wrecks the greedy replies."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                                  init_lora_weights=False, task_type="CAUSAL_LM"))
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.mul_(50.0)
    out = tmp_path_factory.mktemp("garble") / "adapter"
    peft_model.save_pretrained(out)
    return out


def _online(pg: str, servers: list[str], model_dir: Path, tmp_path: Path, **cfg: Any) -> OnlineTrainer:
    return OnlineTrainer(make_engine(pg), objective=ObjectiveConfig(), local=LocalConfig(model_dir=model_dir),
                         filters=Filters(), config=OnlineConfig(version_prefix=f"t{uuid.uuid4().hex[:6]}", **cfg),
                         vllm_urls=servers, base_model="smollm2", output_root=tmp_path / "runs",
                         store=tmp_path / "store")


def test_regressing_candidate_is_refused_and_the_alias_stays(
        pg: str, servers: list[str], model_dir: Path, garbling_adapter: Path, tmp_path: Path, cleanup: None) -> None:
    prompts = [[{"role": "user", "content": q}] for q in EVAL_PROMPTS]
    with httpx.Client(timeout=120) as http:
        base = {q[0]["content"]: http.post(f"{servers[0]}/chat/completions", json={
            "model": "smollm2", "messages": q, "temperature": 0, "max_tokens": 16}).json()
            ["choices"][0]["message"]["content"] for q in prompts}

    def same_as_base(reply: str, messages: list[dict[str, Any]]) -> float:
        # bf16 batching may shift a greedy token: compare the first words
        return float(reply.split()[:3] == base[messages[0]["content"]].split()[:3])

    online = _online(pg, servers, model_dir, tmp_path, eval_prompts=prompts, eval_scorer=same_as_base,
                     eval_max_tokens=16, eval_threshold=0.34)
    name = f"{online.cfg.version_prefix}-bad"
    publish(online.engine, PublishRequest(garbling_adapter, kind=VersionKind.LORA, name=name, base_model="smollm2",
                                          vllm_urls=servers, activate=False, store=tmp_path / "store",
                                          stats={"run_id": online.run_id}))
    assert online.gate.decide(name, {}) == "refuse"
    with OrmSession(online.engine) as db:
        row = db.scalars(select(PolicyVersion).where(PolicyVersion.name == name)).one()
        events = db.execute(select(PolicyEvent.action, PolicyEvent.metrics).where(PolicyEvent.version_id == row.id)
                            .order_by(PolicyEvent.id)).all()
        assert row.status == REFUSED
    assert versions.active_version(online.engine) is None  # the base still serves
    # published (as a candidate, by publishing.publish), then gated and refused
    assert [a for a, _ in events] == ["publish", "eval", "refuse"]
    assert events[1][1]["score"] < events[1][1]["active_score"] - 0.34
    # both sides' replies to the held-out prompts are kept, keyed alike (the UI's compare page)
    with OrmSession(online.engine) as db:
        replies = {v: evals.replies_of(db, v) for v in ("smollm2", name)}
    assert set(replies["smollm2"]) == set(replies[name]) == {evals.prompt_hash(p) for p in prompts}
    assert [r["reply"] for r in replies["smollm2"].values()] != [r["reply"] for r in replies[name].values()]
    assert sum(r["score"] for r in replies[name].values()) / 3 == pytest.approx(events[1][1]["score"])
    assert name not in served_models(httpx.Client(timeout=10), servers[0])  # unloaded again
    online.engine.dispose()


def test_a_sampled_gate_draws_on_vllm_what_a_request_per_seed_draws(pg: str, servers: list[str], model_dir: Path,
                                                                     tmp_path: Path) -> None:
    """OnlineConfig.eval_samples: the gate asks the real vLLM once per held-out prompt for all its
    samples (``n``, seed SAMPLE_SEED) and gets what one request per sample with seed SAMPLE_SEED + i
    gets: every version is compared on the same draws, however the gate asks for them. vLLM is not
    batch-invariant: a reply drawn in another batch may take another token at a near tie (bf16 on
    the CPU: 2 of 16 twelve-token replies did in one check), so most, not all, are
    the same text; on different seeds at temperature 1 next to none would be."""
    from trainer.eval_gate import SAMPLE_SEED

    prompts = [[{"role": "user", "content": q}] for q in EVAL_PROMPTS]
    online = _online(pg, servers, model_dir, tmp_path, eval_prompts=prompts, eval_samples=3, eval_temperature=1.0,
                     eval_max_tokens=6, eval_scorer=lambda reply, messages: 1.0)
    gate = online.gate
    got = gate.answer("smollm2", prompts)
    with httpx.Client(timeout=120) as http:
        one_by_one = [http.post(f"{servers[0]}/chat/completions", json={
            "model": "smollm2", "messages": q, "temperature": 1.0, "max_tokens": 6, "seed": SAMPLE_SEED + i})
            .json()["choices"][0]["message"]["content"] for q in prompts for i in range(3)]
    assert len(got) == len(one_by_one) == 9
    assert sum(a == b for a, b in zip(got, one_by_one)) >= 5, list(zip(got, one_by_one))
    assert all(len(set(got[j:j + 3])) > 1 for j in range(0, 9, 3)), got  # a prompt's samples are three draws
    online.engine.dispose()


def _add_turns(engine: Any, version: str, rewards: list[float]) -> None:

    with OrmSession(engine) as db, db.begin():
        for r in rewards:
            sid, tid = uuid.uuid4().hex, str(uuid.uuid4())
            db.add(Session(id=sid, source="header"))
            db.flush()
            db.add(Turn(id=tid, session_id=sid, endpoint="chat", status="ok", created_at=datetime.now(timezone.utc),
                        model="policy", policy_version=version, capture="white-box",
                        request={"messages": [{"role": "user", "content": "hi"}]}))
            db.flush()
            db.add(Judgement(turn_id=tid, status="scored", reward=r, attempts=1))


def test_active_version_regressing_on_live_rewards_is_rolled_back(
        pg: str, servers: list[str], model_dir: Path, garbling_adapter: Path, tmp_path: Path, cleanup: None) -> None:
    online = _online(pg, servers, model_dir, tmp_path, rollback_window=4, rollback_threshold=0.5)
    name = f"{online.cfg.version_prefix}-live"
    publish(online.engine, PublishRequest(garbling_adapter, kind=VersionKind.LORA, name=name, base_model="smollm2",
                                          vllm_urls=servers, store=tmp_path / "store"))
    _add_turns(online.engine, "smollm2", [1.0, 1.0, 0.0, 1.0])
    _add_turns(online.engine, name, [1.0, -1.0, -1.0])
    assert online.monitor.check() is None  # fewer live turns than the window: not judged yet
    assert versions.active_version(online.engine)["name"] == name
    _add_turns(online.engine, name, [-1.0])
    assert online.monitor.check() == name
    assert versions.active_version(online.engine) is None
    with OrmSession(online.engine) as db:
        event = db.scalars(select(PolicyEvent).where(PolicyEvent.action == "rollback")).one()
        regressed = db.scalars(select(PolicyVersion).where(PolicyVersion.name == name)).one()
        assert regressed.status == "rolled_back"
    # the event names the version rolled back to (None: the base) and the one it left
    assert event.version_id is None and event.metrics["to"] == "base" and name in event.metrics["from"]
    assert event.actor == "live-monitor" and event.metrics["live_reward"] == -0.5
    online.engine.dispose()


def test_trainer_killed_mid_step_loses_and_duplicates_nothing(
        pg: str, servers: list[str], model_dir: Path, tmp_path: Path, cleanup: None) -> None:
    ids = _scored_turns(pg, servers[0], tmp_path / "gw", QUESTIONS)
    engine = make_engine(pg)
    args = _trainer_args(pg, model_dir, servers, "--k", "2")

    # the trainer is held inside its second step's transaction, so it is killed there, after one
    # step recorded and with the next batch leased, however busy the machine is
    with HeldTrainingStep(pg, after=1) as held:
        proc = _spawn(args, tmp_path, "trainer.log")
        try:
            wait_for(held.waiting, timeout=600, interval=0.5)
        except AssertionError:
            _stop(proc)
            pytest.fail("the trainer never got to a second step:\n" + (tmp_path / "trainer.log").read_text()[-4000:])
        with OrmSession(engine) as db:
            assert db.scalar(select(text("count(*)")).select_from(TrainingStep)) == 1
            assert db.scalar(select(TrainingLease.turn_id).where(TrainingLease.acked_at.is_(None)).limit(1))
        _stop(proc, signal.SIGKILL)
    proc = _spawn(args, tmp_path, "trainer.log")

    def all_acked() -> bool:
        with OrmSession(engine) as db:
            acked = db.scalar(select(text("count(*)")).select_from(TrainingLease)
                              .where(TrainingLease.acked_at.is_not(None)))
            open_candidates = db.scalar(select(PolicyVersion.id).where(PolicyVersion.status == "candidate").limit(1))
        return acked == len(ids) and open_candidates is None

    try:
        wait_for(all_acked, timeout=600, interval=0.5)
    except AssertionError:
        pytest.fail("the restarted trainer did not finish:\n" + (tmp_path / "trainer.log").read_text()[-4000:])
    finally:
        _stop(proc)
    with OrmSession(engine) as db:
        runs = db.scalars(select(TrainingRun.id)).all()
        steps = db.scalars(select(TrainingStep)).all()
        versions = {v.name: v.status for v in db.scalars(select(PolicyVersion))}
        active = db.scalars(select(PolicyVersion).where(PolicyVersion.status == "active")).all()
    engine.dispose()
    assert len(runs) == 1  # the restarted trainer continued the run
    trained = Counter(tid for s in steps for tid in s.metrics["turn_ids"])
    assert trained == Counter({tid: 1 for tid in ids}), trained
    assert all(s in ("active", "retired", REFUSED) for s in versions.values()), versions
    assert len(active) == 1
    # the alias points at a version every vLLM has
    with httpx.Client(timeout=10) as http:
        for url in servers:
            assert active[0].name in served_models(http, url)
    print(json.dumps(versions))


def _stored_scored_turns(engine: Any, session: str, rewards: list[float], **turn: Any) -> None:
    """Session *session* with one scored white-box turn per reward, ``{session}-{i}``, each with
    token ids and logprobs to train on (*turn* overrides its columns)."""
    with OrmSession(engine) as db, db.begin():
        db.add(Session(id=session, source="header"))
        db.flush()
        for i, reward in enumerate(rewards):
            db.add(Turn(**{"id": f"{session}-{i}", "session_id": session, "endpoint": "chat", "status": "ok",
                           "model": "policy", "created_at": datetime.now(timezone.utc), "capture": "white-box",
                           "request": {"messages": []}, "prompt_token_ids": [1, 2], "token_ids": [3, 4],
                           "logprobs": [-1.0, -1.0]} | turn))
            db.flush()
            db.add(Judgement(turn_id=f"{session}-{i}", status="scored", reward=reward, attempts=1))


def test_stale_turns_are_corrected_with_the_capped_ratio_or_dropped(pg: str, servers: list[str], model_dir: Path,
                                                                     tmp_path: Path) -> None:
    from trainer.local import LocalTrainer
    from trainer.samples import Sample

    trainer = LocalTrainer(LocalConfig(model_dir=model_dir), ObjectiveConfig())
    sample = Sample("t", "s", None, 0, [1, 2, 3, 4], [5, 6, 7], None, None, 1.0, None, "white-box")
    current, _ = trainer.response_logprobs([sample])
    # produced by a policy far from the current one: ratio π_current / π_behaviour = e^5 per token
    sample.behaviour_logprobs = (current[0].detach() - 5.0).tolist()
    plain = trainer.step([sample])
    corrected = trainer.step([sample], correct=[True], ratio_cap=2.0)
    assert plain["pg_loss"] == pytest.approx(-1.28, abs=1e-3)  # PPO clips the ratio at 1 + ε_high
    assert corrected["pg_loss"] == pytest.approx(-2.0, abs=1e-3)  # the capped importance weight
    assert corrected["pg_clipfrac"] == 0.0  # the PPO ratio is taken against the current policy

    # --stale drop: turns more than S versions behind are acked without training
    engine = make_engine(pg)
    _stored_scored_turns(engine, "old", [1.0] * 3, policy_version="a-retired-branch")
    online = _online(pg, servers, model_dir, tmp_path, k=3, staleness=0, stale_policy="drop")
    online.trainer, online.trainer_version = trainer, None
    result = online.run_round()
    assert result is not None and result.candidate is None and sorted(result.dropped) == ["old-0", "old-1", "old-2"]
    assert online.run_round() is None  # acked: never leased again
    with OrmSession(engine) as db:
        assert db.scalar(select(text("count(*)")).select_from(PolicyVersion)) == 0
    engine.dispose()
    online.engine.dispose()


def test_replay_trains_each_round_on_the_last_rounds_turns_too(pg: str, servers: list[str], model_dir: Path,
                                                               tmp_path: Path) -> None:
    """OnlineConfig.replay_rounds: a round trains on its new turns and, corrected as stale turns
    are (sampled by an older policy), on those of the rounds before it, N at most."""
    from trainer.local import LocalTrainer

    engine = make_engine(pg)
    _stored_scored_turns(engine, "replay", [float(i % 2) for i in range(6)], prompt_token_ids=[1, 2, 3], token_ids=[4, 5])
    engine.dispose()
    # staleness 10: the new turns (answered by the base, versions ago by round 3) count as fresh here
    online = _online(pg, servers, model_dir, tmp_path, k=2, replay_rounds=1, staleness=10)
    trainer = LocalTrainer(LocalConfig(model_dir=model_dir), ObjectiveConfig())
    steps: list[dict[str, bool]] = []  # per optimizer step: turn id -> corrected as stale
    real_step = trainer.step

    def step(samples: Any, *, correct: Any = None, **kw: Any) -> Any:
        steps.append(dict(zip([s.turn_id for s in samples], correct, strict=True)))
        return real_step(samples, correct=correct, **kw)

    trainer.step = step  # type: ignore[method-assign]
    online.trainer, online.trainer_version = trainer, None
    rounds = [online.run_round() for _ in range(3)]
    assert all(r is not None and r.candidate for r in rounds)
    first, second, third = (r.turn_ids for r in rounds)  # type: ignore[union-attr]
    assert len(set(first + second + third)) == 6
    assert steps == [
        dict.fromkeys(first, False),
        dict.fromkeys(second, False) | dict.fromkeys(first, True),
        dict.fromkeys(third, False) | dict.fromkeys(second, True),  # one round back, not two
    ]
    assert [r.metrics["replayed"] for r in rounds] == [0, 2, 2]  # type: ignore[union-attr]
    online.engine.dispose()


@pytest.mark.parametrize("refused_update", ["keep", "drop"])
def test_a_refused_candidates_update_is_kept_or_dropped(pg: str, servers: list[str], model_dir: Path,
                                                       tmp_path: Path, cleanup: None, refused_update: str) -> None:
    """OnlineConfig.refused_update: the topicality check refuses round 1's candidate (its replies
    off topic); under "keep" round 2 trains on top of it (the same weights in memory, its metrics
    name the refused one it carries) while the base serves on, and once round 2's candidate is
    promoted nothing is carried; under "drop" round 2 starts again from the version serving."""
    from trainer.local import LocalTrainer

    engine = make_engine(pg)
    _stored_scored_turns(engine, f"refused-{refused_update}", [float(i % 2) for i in range(4)],
                         prompt_token_ids=[1, 2, 3], token_ids=[4, 5])
    engine.dispose()
    prompts = [[{"role": "user", "content": q}] for q in ("What is a cloud?", "Why is the ocean salty?")]
    online = _online(pg, servers, model_dir, tmp_path, k=2, staleness=10, eval_prompts=prompts,
                     topic_scorer=preference.topic_scorer, topic_margin=0.1, refused_update=refused_update)
    off_topic = [True]  # the candidates' replies: off topic in round 1, on topic after

    def answer(model: str, asked: list[list[dict[str, Any]]]) -> list[str]:
        drifted = model != "smollm2" and off_topic[0]
        return ["Bathroom scale." if drifted else m[0]["content"].rstrip("?") + "." for m in asked]

    online.gate.answer = answer  # type: ignore[method-assign]
    trainer = LocalTrainer(LocalConfig(model_dir=model_dir), ObjectiveConfig())
    online.trainer, online.trainer_version = trainer, None
    first = online.run_round()
    assert first is not None and first.decision == "refuse" and first.reason.startswith("off topic")
    assert versions.active_version(online.engine) is None  # the base serves on
    if refused_update == "drop":
        assert online.trainer is None
    else:
        assert online.trainer is trainer and online.carried == [first.candidate]
    off_topic[0] = False
    second = online.run_round()
    assert second is not None and second.decision == "promote"
    assert second.metrics.get("carried") == ([first.candidate] if refused_update == "keep" else None)
    assert (online.trainer is trainer) == (refused_update == "keep")
    assert online.trainer_version == second.candidate and online.carried == []
    assert versions.active_row(online.engine).name == second.candidate  # type: ignore[union-attr]
    with OrmSession(online.engine) as db:  # the policy event of the second candidate names what it carries
        published = db.execute(
            select(PolicyEvent.metrics).join(PolicyVersion, PolicyVersion.id == PolicyEvent.version_id)
            .where(PolicyVersion.name == second.candidate, PolicyEvent.action == "publish")).scalar_one()
    assert published.get("carried") == ([first.candidate] if refused_update == "keep" else None)
    online.engine.dispose()


# --- a vLLM that goes down mid-run --------------------------------------------------------------


class SwitchableVLLM:
    """A real vLLM behind a proxy whose port closes on :meth:`down` (connections refused, as
    from a dead or restarting server) and opens again on :meth:`up`."""

    def __init__(self, target: str):
        from tests.support.processes import free_port

        self.root = server_root(target)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.server: Any = None
        self.thread: threading.Thread | None = None

    def _app(self) -> Any:
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import Response
        from starlette.routing import Route

        async def forward(request: Request) -> Response:
            async with httpx.AsyncClient(timeout=300) as client:
                upstream = await client.request(request.method, f"{self.root}{request.url.path}",
                                                params=request.query_params, content=await request.body(),
                                                headers={"content-type": request.headers.get("content-type",
                                                                                             "application/json")})
            return Response(upstream.content, upstream.status_code, media_type=upstream.headers.get("content-type"))

        return Starlette(routes=[Route("/{path:path}", forward, methods=["GET", "POST", "DELETE"])])

    def up(self) -> None:
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(self._app(), host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_for(lambda: self.server.started, timeout=30, interval=0.05)

    def down(self) -> None:
        if self.server is not None:
            self.server.should_exit = True
            assert self.thread is not None
            self.thread.join(timeout=30)
            self.server = None
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{self.url}/models", timeout=5)

    def __enter__(self) -> SwitchableVLLM:
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.server is not None:
            self.down()


def test_a_round_a_down_vllm_could_not_take_is_tried_again_and_nothing_is_lost(
        pg: str, servers: list[str], model_dir: Path, tmp_path: Path, cleanup: None) -> None:
    from datapool import leases

    ids = _scored_turns(pg, servers[0], tmp_path / "gw", QUESTIONS[:4])
    engine = make_engine(pg)

    def pool_state() -> tuple[int, list[str], int]:
        with OrmSession(engine) as db:
            steps = db.scalar(select(text("count(*)")).select_from(TrainingStep))
            names = list(db.scalars(select(PolicyVersion.name)))
        return steps, names, leases.available(engine, online.run_id, Filters())

    with SwitchableVLLM(servers[0]) as policy:
        online = _online(pg, [policy.url, servers[1]], model_dir, tmp_path, k=2, poll_s=0.2, retry_max_s=1.0,
                         rollback_window=0, max_rounds=2)
        policy.down()
        # one round against the dead server: the loop survives it and undoes it
        online.loop(stop=lambda: online.failures >= 1)
        assert online.failures == 1 and "ConnectError" in (online.last_error or ""), online.last_error
        assert pool_state() == (0, [], 4)  # no step, no version, every turn back in the pool
        assert online.trainer is None and online.step == 0

        # the same loop, left running, keeps trying while the server is down and trains once it is back
        done = threading.Event()
        errors: list[BaseException] = []

        def run() -> None:
            try:
                online.loop()
            except BaseException as exc:  # the test reports it below
                errors.append(exc)
            finally:
                done.set()

        threading.Thread(target=run, daemon=True).start()
        wait_for(lambda: online.failures >= 3 or done.is_set(), timeout=300, interval=0.1)
        assert not done.is_set() and not errors, errors
        policy.up()
        assert done.wait(600), "the loop did not finish two rounds once the server was back"
        assert not errors, errors

    assert online.failures == 0 and online.last_error is None
    with OrmSession(engine) as db:
        steps = db.scalars(select(TrainingStep).order_by(TrainingStep.step)).all()
        rows = {v.name: v.status for v in db.scalars(select(PolicyVersion))}
        active = db.scalars(select(PolicyVersion).where(PolicyVersion.status == "active")).one()
    assert [s.step for s in steps] == [1, 2]  # numbered after the steps recorded, not the attempts
    trained = Counter(tid for s in steps for tid in s.metrics["turn_ids"])
    assert trained == Counter({tid: 1 for tid in ids}), trained  # every turn trained once
    assert set(rows.values()) <= {"active", "retired"} and len(rows) == 2, rows  # no candidate left behind
    with httpx.Client(timeout=10) as http:
        for url in servers:
            assert active.name in served_models(http, url)
    assert not list((tmp_path / "runs").rglob("adapter_config.json"))  # no trainer output left over
    online.engine.dispose()
    engine.dispose()


def test_the_kl_anchor_follows_its_target_round_by_round(pg: str, servers: list[str], model_dir: Path,
                                                         tmp_path: Path) -> None:
    """OnlineConfig.kl_target: after each round the KL anchor's coefficient moves toward the target
    by the round's measured KL(candidate ‖ base) — up (at most 20 % a round) while the candidate
    drifted past it, down while it stayed under — and the next round trains with the new one."""
    from trainer.local import LocalTrainer
    from trainer.samples import Sample

    objective, local = ObjectiveConfig(kl_coef=0.1), LocalConfig(model_dir=model_dir, lr=1e-2)
    trainer = LocalTrainer(local, objective)
    # the turns carry the base policy's own log-probs, as vLLM would have captured them: ratio 1
    base, _ = trainer.response_logprobs([Sample("t", "s", None, 0, [1, 2, 3], [4, 5], None, None, 1.0, None,
                                                "white-box")])
    engine = make_engine(pg)
    _stored_scored_turns(engine, "kl", [float(i % 2) for i in range(6)], prompt_token_ids=[1, 2, 3], token_ids=[4, 5],
                         logprobs=base[0].detach().tolist())
    engine.dispose()
    online = OnlineTrainer(make_engine(pg), objective=objective, local=local,
                           filters=Filters(), config=OnlineConfig(version_prefix=f"t{uuid.uuid4().hex[:6]}", k=2,
                                                                  staleness=10, kl_target=1e-12),
                           vllm_urls=servers, base_model="smollm2", output_root=tmp_path / "runs",
                           store=tmp_path / "store")
    trained_with: list[float] = []
    real_step = trainer.step

    def step(samples: Any, **kw: Any) -> Any:
        trained_with.append(trainer.objective.kl_coef)
        return real_step(samples, **kw)

    trainer.step = step  # type: ignore[method-assign]
    online.trainer, online.trainer_version = trainer, None
    rounds = [online.run_round(), online.run_round()]
    online.kl.target = 1e6  # type: ignore[union-attr]  # far above any drift: the anchor loosens
    rounds.append(online.run_round())
    metrics = [r.metrics for r in rounds]  # type: ignore[union-attr]
    assert all(m["drift_kl_k3"] > 0 for m in metrics)
    assert [m["kl_coef"] for m in metrics] == pytest.approx([0.1, 0.12, 0.144])
    assert [m["kl_coef_next"] for m in metrics] == pytest.approx([0.12, 0.144, 0.1152])
    assert trained_with == pytest.approx([0.1, 0.12, 0.144])
    assert online.objective.kl_coef == pytest.approx(0.1152)
    with pytest.raises(ValueError, match="kl_coef > 0"):
        _online(pg, servers, model_dir, tmp_path, kl_target=0.2)
    with pytest.raises(ValueError, match="kl_target must be > 0"):
        OnlineConfig(kl_target=0)
    online.engine.dispose()


@pytest.mark.parametrize("floor", [False, True])
def test_a_floored_kl_anchor_only_tightens(pg: str, servers: list[str], model_dir: Path, tmp_path: Path,
                                           floor: bool) -> None:
    """OnlineConfig.kl_floor: a fast controller (kl_horizon 0.25: up to ×1.8 a round) tightens the anchor
    as the drift passes the target and, floored, never loosens it below its starting value; unfloored it
    falls ×0.2 a round under the target (veRL's controller, both ways alike)."""
    config = OnlineConfig(version_prefix=f"t{uuid.uuid4().hex[:6]}", kl_target=0.3, kl_horizon=0.25, kl_floor=floor)
    online = OnlineTrainer(make_engine(pg), objective=ObjectiveConfig(kl_coef=0.1),
                           local=LocalConfig(model_dir=model_dir), filters=Filters(), config=config,
                           vllm_urls=servers, base_model="smollm2", output_root=tmp_path / "runs",
                           store=tmp_path / "store")
    trainer = SimpleNamespace(objective=online.objective)
    coefs = []
    for drift in (0.07, 0.34, 0.6, 0.1):  # under, a little over, far over, under the target of 0.3
        online._adapt_kl(trainer, metrics := {"drift_kl_k3": drift})  # type: ignore[arg-type]
        coefs.append(metrics["kl_coef_next"])
        assert trainer.objective.kl_coef == online.objective.kl_coef == metrics["kl_coef_next"]
    if floor:
        assert coefs == pytest.approx([0.1, 0.1 * (1 + (0.34 / 0.3 - 1) / 0.25), 0.1 * 1.5333 * 1.8, 0.1], rel=1e-3)
    else:
        assert coefs == pytest.approx([0.02, 0.02 * 1.5333, 0.02 * 1.5333 * 1.8, 0.02 * 1.5333 * 1.8 * 0.2], rel=1e-3)
    online.engine.dispose()


def test_top_k_opd_for_n_rounds_then_the_sampled_token(pg: str, servers: list[str], model_dir: Path,
                                                        tmp_path: Path) -> None:
    """OnlineConfig.opd_topk_rounds: the first N rounds train with top-k OPD (the teacher's top-k KL is in
    the round's loss), the rounds after with the sampled-token OPD advantage from the same teacher passes
    (no top-k term), and a trainer rebuilt later keeps it."""
    objective = ObjectiveConfig(objective="combined", opd_topk=True)
    engine = make_engine(pg)
    session = f"topk-{uuid.uuid4().hex[:6]}"
    _stored_scored_turns(engine, session, [1.0, -1.0, 1.0, -1.0])
    with OrmSession(engine) as db, db.begin():
        for j in db.scalars(select(Judgement).where(Judgement.turn_id.like(f"{session}-%"))):
            j.teacher_logprobs = [-0.5, -0.7]
            j.teacher_topk_ids, j.teacher_topk_logprobs = [[3, 7], [4, 9]], [[-0.5, -1.5], [-0.7, -1.2]]
    engine.dispose()
    online = OnlineTrainer(make_engine(pg), objective=objective, local=LocalConfig(model_dir=model_dir),
                           filters=Filters(), config=OnlineConfig(version_prefix=f"t{uuid.uuid4().hex[:6]}", k=2,
                                                                  staleness=10, opd_topk_rounds=1),
                           vllm_urls=servers, base_model="smollm2", output_root=tmp_path / "runs",
                           store=tmp_path / "store")
    first, second = online.run_round(), online.run_round()
    assert first is not None and second is not None
    assert "topk_kl" in first.metrics and first.metrics["opd_topk_next"] is False
    assert "topk_kl" not in second.metrics and "opd_topk_next" not in second.metrics
    assert second.metrics["loss"] != 0.0  # the sampled-token OPD (and RL) trained instead
    assert online.objective.opd_topk is False and online._trainer().objective.opd_topk is False
    with pytest.raises(ValueError, match="opd_topk_rounds"):
        OnlineConfig(opd_topk_rounds=-1)
    online.engine.dispose()
