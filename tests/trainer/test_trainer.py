"""The trainer on the CPU with the real SmolLM2: samples from captured turns, learning moves the
policy the right way, and a killed trainer trains every turn exactly once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from sqlalchemy import select, text
from sqlalchemy.orm import Session as OrmSession

from datapool.db import make_engine
from datapool.models import Judgement, Session, TrainingLease, TrainingStep, Turn
from scoring.teacher import teacher_logprobs, teacher_messages
from tests.support.vllm_servers import RunningVLLM
from tests.support.holds import HeldTrainingStep
from tests.support.processes import GatewayProcess, wait_for
from datapool.leases import Filters
from trainer.local import LocalConfig, LocalTrainer
from trainer.objectives import ObjectiveConfig
from trainer.offline import train_offline
from trainer.samples import load_samples, render_prompt_ids

QUESTIONS = ["Name a fruit.", "Name a color.", "Name an animal.", "Name a city.", "Name a planet.",
             "Name a metal.", "Name a tree.", "Name a river."]


@pytest.fixture(scope="module")
def pool(vllm_server: RunningVLLM, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, list[str]]]:
    """A SQLite pool with one captured white-box turn per question (greedy, through the gateway)."""
    d = tmp_path_factory.mktemp("trainpool")
    url = f"sqlite:///{d / 'pool.db'}"
    ids = []
    with GatewayProcess(d, database_url=url, upstream_url=vllm_server.base_url) as gw:
        for q in QUESTIONS:
            r = httpx.post(f"{gw.base_url}/chat/completions", timeout=120, json={
                "model": "smollm2", "max_tokens": 12, "temperature": 0,
                "messages": [{"role": "system", "content": "Answer in a few words."}, {"role": "user", "content": q}]})
            ids.append(r.headers["x-turn-id"])
        gw.stored_turn(ids[-1])
    yield url, ids


def _judge(url: str, rewards: dict[str, float | None], teacher: dict[str, list[float]] | None = None) -> None:
    engine = make_engine(url)
    with OrmSession(engine) as db, db.begin():
        db.execute(text("DELETE FROM judgements"))
        db.execute(text("DELETE FROM training_leases"))
        for tid, r in rewards.items():
            db.add(Judgement(turn_id=tid, status="scored", reward=r, prm_reward=r, attempts=1,
                             teacher_logprobs=(teacher or {}).get(tid), hint="hint" if teacher else None))
    engine.dispose()


def _mean_logprob(trainer: LocalTrainer, url: str, ids: list[str]) -> list[float]:
    engine = make_engine(url)
    with OrmSession(engine) as db:
        samples = load_samples(db, ids)
    engine.dispose()
    with torch.no_grad():
        lp, mask = trainer.response_logprobs(samples)
    return ((lp * mask).sum(-1) / mask.sum(-1)).tolist()


def test_white_box_rerender_equals_vllm_prompt_ids(pool: tuple[str, list[str]], model_dir: Path) -> None:
    from transformers import AutoTokenizer

    url, ids = pool
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    engine = make_engine(url)
    with OrmSession(engine) as db:
        turns = db.scalars(select(Turn).where(Turn.id.in_(ids))).all()
        for t in turns:
            assert render_prompt_ids(tokenizer, t.request["messages"]) == t.prompt_token_ids
        # the same turn read as black-box (text only) gives the same tokens
        t = turns[0]
        expected = (list(t.prompt_token_ids), list(t.token_ids))
        t.capture = "black-box"
        sample = load_samples(db, [t.id], tokenizer)[0]
        db.rollback()
    engine.dispose()
    assert (sample.prompt_ids, sample.response_ids) == expected
    assert sample.behaviour_logprobs is None


def test_binary_rl_raises_rewarded_and_lowers_punished_replies(
    pool: tuple[str, list[str]], model_dir: Path, tmp_path: Path
) -> None:
    url, ids = pool
    good, bad = ids[::2], ids[1::2]
    _judge(url, {tid: 1.0 for tid in good} | {tid: -1.0 for tid in bad})
    local = LocalConfig(model_dir=model_dir, lr=2e-3, micro_batch_size=4)
    before = LocalTrainer(local, ObjectiveConfig(objective="rl"))
    lp_good0, lp_bad0 = _mean_logprob(before, url, good), _mean_logprob(before, url, bad)
    result = train_offline(make_engine(url), objective=ObjectiveConfig(objective="rl", grpo=False), local=local,
                           filters=Filters(), batch_size=8, epochs=3, output_root=tmp_path)
    assert result.steps == 3 and result.turns == 24  # every turn once per pass
    after = LocalTrainer(LocalConfig(model_dir=model_dir, init_adapter=result.output_dir), ObjectiveConfig())
    lp_good1, lp_bad1 = _mean_logprob(after, url, good), _mean_logprob(after, url, bad)
    assert sum(lp_good1) / 4 > sum(lp_good0) / 4 + 0.05
    assert sum(lp_bad1) / 4 < sum(lp_bad0) / 4 - 0.05
    for m in result.metrics:
        assert {"pg_loss", "tokens_per_s"} <= set(m)


@pytest.mark.asyncio
async def test_opd_shrinks_the_gap_to_the_teacher(
    pool: tuple[str, list[str]], model_dir: Path, teacher_server: RunningVLLM, tmp_path: Path
) -> None:
    url, ids = pool
    engine = make_engine(url)
    with OrmSession(engine) as db:
        turns = {t.id: t for t in db.scalars(select(Turn).where(Turn.id.in_(ids)))}
    hints = {}
    async with httpx.AsyncClient(timeout=120) as http:
        for tid in ids:
            t = turns[tid]
            result = await teacher_logprobs(http, teacher_server.base_url, "smollm2",
                                            teacher_messages(t.request["messages"], "Answer with one word only."),
                                            list(t.token_ids))
            hints[tid] = result.logprobs
    _judge(url, {tid: None for tid in ids}, teacher=hints)
    local = LocalConfig(model_dir=model_dir, lr=2e-3)

    def gap(trainer: LocalTrainer) -> float:
        with OrmSession(engine) as db:
            samples = load_samples(db, ids)
        with torch.no_grad():
            lp, mask = trainer.response_logprobs(samples)
        teacher = torch.zeros_like(lp)
        for i, s in enumerate(samples):
            teacher[i, : len(s.teacher_logprobs)] = torch.tensor(s.teacher_logprobs)
        return float(((teacher - lp).abs() * mask).sum() / mask.sum())

    gap0 = gap(LocalTrainer(local, ObjectiveConfig(objective="opd")))
    result = train_offline(engine, objective=ObjectiveConfig(objective="opd"), local=local,
                           filters=Filters(needs_teacher=True), batch_size=8, epochs=3, output_root=tmp_path)
    assert result.steps == 3
    gap1 = gap(LocalTrainer(LocalConfig(model_dir=model_dir, init_adapter=result.output_dir), ObjectiveConfig()))
    engine.dispose()
    assert gap1 < gap0 * 0.9, (gap0, gap1)


def _copy_pool(src: str, dst: str) -> None:
    """The sessions and turns of one pool, written unchanged into another."""
    source, target = make_engine(src), make_engine(dst)
    try:
        with source.connect() as read, target.begin() as write:
            for table in (Session.__table__, Turn.__table__):
                rows = [dict(r._mapping) for r in read.execute(select(table))]
                if rows:
                    write.execute(table.insert(), rows)
    finally:
        source.dispose()
        target.dispose()


def test_killed_trainer_trains_every_turn_exactly_once(pool: tuple[str, list[str]], pg_url: str, model_dir: Path,
                                                       tmp_path: Path) -> None:
    # on PostgreSQL, where the trainer can be held inside its second step (tests/support/holds.py) and
    # killed there, instead of hoping a poll lands between two steps on a busy machine: the 2
    # turns trained and acked must not be trained again, the 2 leased must be
    _copy_pool(pool[0], pg_url)
    url, ids = pg_url, pool[1]
    _judge(url, {tid: (1.0 if i % 2 else -1.0) for i, tid in enumerate(ids)})
    args = [sys.executable, "-m", "nextstate.cli", "train", "--objective", "rl", "--batch-size", "2",
            "--database-url", url, "--model-dir", str(model_dir), "--no-publish", "--lease-s", "600"]
    env = {**os.environ, "NEXTSTATE_DATA_DIR": str(tmp_path)}
    log = open(tmp_path / "train.log", "ab")
    engine = make_engine(url)
    with HeldTrainingStep(url, after=1) as held:
        proc = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_for(held.waiting, timeout=600, interval=0.5)
        except AssertionError:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail("the trainer never got to its second step:\n" + (tmp_path / "train.log").read_text()[-4000:])
        with OrmSession(engine) as db:
            assert db.scalar(select(text("count(*)")).select_from(TrainingStep)) == 1
            run_id = db.scalar(select(TrainingLease.run_id).where(TrainingLease.acked_at.is_(None)).limit(1))
        assert run_id is not None  # the second batch is leased, not acked
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    subprocess.run([*args, "--resume", run_id], env=env, check=True, stdout=log, stderr=subprocess.STDOUT,
                   timeout=900)
    with OrmSession(engine) as db:
        steps = db.scalars(select(TrainingStep).where(TrainingStep.run_id == run_id)).all()
        unacked = db.scalar(select(TrainingLease.turn_id).where(TrainingLease.run_id == run_id,
                                                                TrainingLease.acked_at.is_(None)).limit(1))
    engine.dispose()
    trained = Counter(tid for s in steps for tid in s.metrics["turn_ids"])
    assert trained == Counter({tid: 1 for tid in ids}), trained
    assert unacked is None
