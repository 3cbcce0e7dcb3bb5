"""Advantages of agent episodes: turns of a task's group that all failed (or all passed) carry no
outcome signal and must get A = 0 from the outcome, however the leased batches cut the group and
whatever step the turns are at, and only the bounded credit of their votes under
``integrated_norm="dense"``; the trainer's warmup and gradient clipping."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.agents import advantages
from tests.support.tiny_model import VOCAB, write_tiny_llama
from trainer import objectives
from trainer.config import LocalConfig
from trainer.local import LocalTrainer
from trainer.objectives import ObjectiveConfig
from trainer.offline import batch_advantages, fixed_advantages, mini_batches
from trainer.samples import Sample


def _turn(task: int, episode: int, step: int, outcome: float, vote: float = 0.0) -> Sample:
    return Sample(turn_id=f"{task}-{episode}-{step}", session_id=f"{task}-{episode}", group_id=f"task{task}",
                  step_index=step, prompt_ids=[2], response_ids=[3, 4], behaviour_logprobs=None,
                  teacher_logprobs=None, reward=vote, integrated_reward=outcome + vote, capture="white_box")


def _iteration(seed: int, *, turns: tuple[int, ...] = (3,)) -> list[tuple[Sample, bool]]:
    """A GPU iteration's turns in the pool's lease order, without votes (the advantages instrument's
    own: 16 tasks x 8 episodes, 4 of the 16 tasks with some successes, jittered turn lengths)."""
    return advantages.iteration(seed, "outcome", turns=list(turns), jitter=0.6)


def _no_signal(rows: list[tuple[Sample, bool]]) -> set[str]:
    by_group: dict[str, set[bool]] = {}
    for s, ok in rows:
        by_group.setdefault(s.group_id or "", set()).add(ok)
    return {g for g, oks in by_group.items() if len(oks) == 1}


def _step_advantages(batch: list[Sample], cfg: ObjectiveConfig) -> list[float]:
    """What the local trainer's step computes for *batch* (LocalTrainer._advantages, rl)."""
    mask = torch.ones((len(batch), 2))
    rewards = objectives.sample_rewards(batch, by_group=cfg.integrated_norm == "group")
    adv = objectives.compute_advantages(cfg, response_mask=mask,
                                        token_level_rewards=objectives.scores_to_token_rewards(rewards, mask),
                                        index=[s.group_id for s in batch])
    return adv[:, 0].tolist()


def test_leased_batches_cut_groups_and_give_failed_groups_advantages() -> None:
    """The old path (64 turns a step, R_t standardized per step across the batch): most turns of
    groups that all failed get |A| ~ 0.4; what the GPU runs trained on."""
    rows = _iteration(0)
    quiet = _no_signal(rows)
    cfg = ObjectiveConfig()
    noise = []
    for lo in range(0, len(rows), 64):
        part = rows[lo:lo + 64]
        adv = _step_advantages([s for s, _ in part], cfg)
        noise += [abs(a) for (s, _), a in zip(part, adv) if s.group_id in quiet]
    assert sum(a > 1e-6 for a in noise) / len(noise) > 0.3


def test_whole_iteration_gives_failed_groups_zero_and_signal_the_right_sign() -> None:
    rows = _iteration(0, turns=(1, 2, 3, 4))
    quiet = _no_signal(rows)
    samples = [s for s, _ in rows]
    parts = mini_batches(samples, ObjectiveConfig(integrated_norm="group"), 64, seed=3)
    assert sorted(s.turn_id for p in parts for s in p) == sorted(s.turn_id for s in samples)
    assert len(parts) == -(-len(samples) // 64) and max(map(len, parts)) - min(map(len, parts)) <= 1
    passed = {s.turn_id: ok for s, ok in rows}
    group = {s.turn_id: s.group_id for s in samples}
    step = ObjectiveConfig()
    for part in parts:
        # what the trainer's step takes under fixed_advantages: the carried advantage as it is
        adv = _step_advantages(part, _fixed(step))
        assert adv == pytest.approx([s.reward for s in part])
        for s, a in zip(part, adv):
            if group[s.turn_id] in quiet:
                assert a == 0.0
            else:
                assert (a > 0) == passed[s.turn_id] and a != 0.0


class _Holder:
    def __init__(self, objective: ObjectiveConfig) -> None:
        self.objective = objective


def _fixed(cfg: ObjectiveConfig) -> ObjectiveConfig:
    holder = _Holder(cfg)
    with fixed_advantages(holder, True):
        return holder.objective


def test_fixed_advantages_restores_the_objective_and_needs_one() -> None:
    holder = _Holder(ObjectiveConfig(kl_coef=0.1))
    with fixed_advantages(holder, True):
        assert not holder.objective.grpo and holder.objective.rl_baseline == "none"
        assert holder.objective.kl_coef == 0.1
    assert holder.objective == ObjectiveConfig(kl_coef=0.1)
    with pytest.raises(ValueError, match="local trainer"), fixed_advantages(object(), True):
        pass


@settings(max_examples=60, derandomize=True, deadline=None)
@given(st.lists(st.tuples(st.lists(st.booleans(), min_size=2, max_size=8),
                          st.lists(st.integers(1, 4), min_size=8, max_size=8)), min_size=1, max_size=6),
       st.booleans())
def test_group_norm_zero_without_signal_property(groups: list[tuple[list[bool], list[int]]], votes: bool) -> None:
    """Any groups of episodes of any lengths, in one batch: a group whose episodes all failed or all
    passed gets A = 0 on every turn when no turn has a vote; with votes, a turn's sign follows its
    R_t against its group's mean."""
    samples = []
    for g, (oks, lengths) in enumerate(groups):
        for e, ok in enumerate(oks):
            for k in range(lengths[e]):
                vote = -1.0 if votes and not ok and k == 0 and e % 2 else 0.0
                samples.append(_turn(g, e, k, 1.0 if ok else 0.0, vote))
    adv = batch_advantages(samples, ObjectiveConfig(integrated_norm="group"))
    for g in range(len(groups)):
        mine = [(s, a) for s, a in zip(samples, adv) if s.group_id == f"task{g}"]
        values = [s.integrated_reward for s, _ in mine]
        mean = sum(values) / len(values)
        for s, a in mine:
            if abs(s.integrated_reward - mean) < 1e-9:
                assert a == 0.0
            else:
                assert (a > 0) == (s.integrated_reward > mean)


def test_step_norm_gives_a_failed_group_of_mixed_lengths_advantages() -> None:
    """Why ``integrated_norm="group"``: one batch, a group that all failed with episodes of 1 and
    3 turns beside a group that passed at step 0 only: per-step standardization makes the failed
    group's turns differ, and its group baseline turns that into |A| of about 1."""
    failed = [_turn(0, e, k, 0.0) for e, n in enumerate((1, 3, 1, 3)) for k in range(n)]
    other = [_turn(1, e, 0, float(e % 2)) for e in range(4)]
    step = batch_advantages(failed + other, ObjectiveConfig(integrated_norm="step"))[: len(failed)]
    group = batch_advantages(failed + other, ObjectiveConfig(integrated_norm="group"))[: len(failed)]
    assert max(abs(a) for a in step) > 0.5
    assert group == [0.0] * len(failed)


@settings(max_examples=80, derandomize=True, deadline=None)
@given(st.lists(st.tuples(st.lists(st.booleans(), min_size=1, max_size=8),
                          st.lists(st.lists(st.sampled_from((-1.0, 0.0, 1.0)), min_size=1, max_size=4),
                                   min_size=8, max_size=8)), min_size=1, max_size=6),
       st.sampled_from((0.0, 0.25, 1.0)))
def test_dense_keeps_outcome_and_votes_apart_property(groups: list[tuple[list[bool], list[list[float]]]],
                                                      weight: float) -> None:
    """Any groups of episodes of any lengths, with any votes on any turns, in one batch: under
    ``dense`` each group's advantages sum to 0; a group whose outcomes agree gets exactly its votes'
    centred credit, never more than 2·weight; a group whose votes agree gets what the outcome alone
    gets (``group``, without votes); and the rest, the outcome's advantage plus the votes'. A
    group of one turn has nothing to compare with and is taken as under ``group``."""
    samples, plain = [], []
    for g, (oks, votes) in enumerate(groups):
        for e, ok in enumerate(oks):
            for k, v in enumerate(votes[e]):
                samples.append(_turn(g, e, k, 1.0 if ok else 0.0, v))
                plain.append(_turn(g, e, k, 1.0 if ok else 0.0))
    cfg = ObjectiveConfig(integrated_norm="dense", vote_weight=weight)
    dense = batch_advantages(samples, cfg)
    outcome_only = batch_advantages(plain, ObjectiveConfig(integrated_norm="group"))
    grouped = batch_advantages(samples, ObjectiveConfig(integrated_norm="group"))
    for g, (oks, _) in enumerate(groups):
        idx = [i for i, s in enumerate(samples) if s.group_id == f"task{g}"]
        if len(idx) == 1:  # a group of one has none to compare with: the batch's baseline
            assert dense[idx[0]] == pytest.approx(grouped[idx[0]])
            continue
        votes = [samples[i].reward for i in idx]
        mean_v = sum(votes) / len(votes)
        assert sum(dense[i] for i in idx) == pytest.approx(0.0, abs=1e-6)
        for i in idx:
            credit = weight * (samples[i].reward - mean_v)
            assert dense[i] == pytest.approx(outcome_only[i] + credit, abs=1e-6)
            if len(set(oks)) == 1:
                assert dense[i] == pytest.approx(credit, abs=1e-9) and abs(dense[i]) <= 2 * weight + 1e-9
    # mini-batches carry the same advantages, and the step takes them as they are
    parts = mini_batches(samples, cfg, 16, seed=1)
    carried = {s.turn_id: s.reward for p in parts for s in p}
    assert [carried[s.turn_id] for s in samples] == pytest.approx(dense)


def test_dense_moves_the_update_off_groups_without_signal() -> None:
    """The advantages instrument's integrated arm (−1 votes on a quarter of the turns): under
    ``group`` most of Σ|A| falls on the groups with no outcome signal, their votes standardized;
    under ``dense`` it falls on the groups with signal, and the outcome arm is what it was."""
    def share(arm: str, norm: str) -> float:
        rows = advantages.iteration(0, arm, turns=[3], jitter=0.6)
        quiet = _no_signal(rows)
        adv = advantages.iteration_path(rows, 64, norm)
        total = sum(abs(a) for a in adv)
        return sum(abs(a) for (s, _), a in zip(rows, adv) if s.group_id in quiet) / total

    assert share("integrated", "group") > 0.6
    assert share("integrated", "dense") < 0.35
    rows = advantages.iteration(1, "outcome", turns=[1, 2, 3], jitter=0.6)
    assert advantages.iteration_path(rows, 64, "dense") == pytest.approx(advantages.iteration_path(rows, 64, "group"))


def test_dense_needs_the_whole_batch(tiny_model: Path) -> None:
    trainer = LocalTrainer(LocalConfig(model_dir=tiny_model, device="cpu"), ObjectiveConfig(integrated_norm="dense"))
    with pytest.raises(ValueError, match="mini-batches"):
        trainer.step(_samples())
    with pytest.raises(ValueError, match="integrated_norm"):
        ObjectiveConfig(integrated_norm="votes")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def _samples(seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    return [Sample(turn_id=f"t{i}", session_id=f"s{i}", group_id=None, step_index=0,
                   prompt_ids=[rng.randrange(2, VOCAB) for _ in range(6)],
                   response_ids=[rng.randrange(2, VOCAB) for _ in range(4)], behaviour_logprobs=None,
                   teacher_logprobs=None, reward=1.0 if i % 2 else -1.0, integrated_reward=None, capture="white_box")
            for i in range(4)]


def _update_size(trainer: LocalTrainer, steps: int) -> list[float]:
    """The largest change of any trainable weight in each of *steps* steps."""
    sizes = []
    for _ in range(steps):
        before = [p.detach().clone() for p in trainer.model.parameters() if p.requires_grad]
        trainer.step(_samples())
        after = [p.detach() for p in trainer.model.parameters() if p.requires_grad]
        sizes.append(max(float((a - b).abs().max()) for a, b in zip(after, before)))
    return sizes


def test_warmup_makes_a_fresh_optimizers_first_steps_smaller(tiny_model: Path) -> None:
    """AdamW's first step moves weights by about lr whatever the gradient's size; warmup over 4
    steps moves them by lr/4, 2·lr/4, ... then lr."""
    cold = _update_size(LocalTrainer(LocalConfig(model_dir=tiny_model, lr=1e-2, device="cpu"), ObjectiveConfig(
        rl_baseline="none")), 1)
    warm = LocalTrainer(LocalConfig(model_dir=tiny_model, lr=1e-2, device="cpu", warmup_steps=4),
                        ObjectiveConfig(rl_baseline="none"))
    sizes = _update_size(warm, 5)
    assert cold[0] == pytest.approx(1e-2, rel=0.05)
    assert sizes[0] == pytest.approx(cold[0] / 4, rel=0.05)
    assert sizes[0] < sizes[1] < sizes[3]
    assert [g["lr"] for g in warm.optimizer.param_groups] == [pytest.approx(1e-2)]


def test_max_grad_norm_clips_the_gradient(tiny_model: Path) -> None:
    trainer = LocalTrainer(LocalConfig(model_dir=tiny_model, lr=1e-2, device="cpu", max_grad_norm=1e-4),
                           ObjectiveConfig(rl_baseline="none"))
    seen = []
    step = trainer.optimizer.step

    def record(*args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(float(torch.linalg.vector_norm(torch.stack([
            torch.linalg.vector_norm(p.grad) for g in trainer.optimizer.param_groups for p in g["params"]
            if p.grad is not None]))))
        return step(*args, **kwargs)

    trainer.optimizer.step = record  # type: ignore[method-assign]
    trainer.step(_samples())
    assert seen and seen[0] == pytest.approx(1e-4, rel=1e-3)


def test_warmup_and_clip_are_validated(tiny_model: Path) -> None:
    with pytest.raises(ValueError, match="warmup_steps"):
        LocalConfig(model_dir=tiny_model, warmup_steps=-1)
    with pytest.raises(ValueError, match="max_grad_norm"):
        LocalConfig(model_dir=tiny_model, max_grad_norm=0.0)
    with pytest.raises(ValueError, match="integrated_norm"):
        ObjectiveConfig(integrated_norm="episode")


class _RecordingTrainer:
    """What run_epochs drives, recording each step's samples and the advantages its objective gives."""

    tokenizer = None

    def __init__(self, objective: ObjectiveConfig) -> None:
        self.objective = objective
        self.step_count = 0
        self.steps: list[list[tuple[str, float]]] = []

    def step(self, samples: list[Sample]) -> dict[str, float]:
        self.steps.append(list(zip([s.turn_id for s in samples], _step_advantages(samples, self.objective))))
        self.step_count += 1
        return {"loss": 0.0}


def test_run_epochs_mini_batches_take_advantages_over_the_leased_batch(tmp_path: Path) -> None:
    """Through a pool: 2 tasks x 4 episodes of 2 turns, task 0 all failed, task 1 half passed; the
    whole batch leased at once, 4 optimizer steps of 4 turns, every turn acked once, task 0's turns
    at A = 0 and task 1's signed by their outcome, however the mini-batches cut the groups."""
    from datetime import datetime, timedelta

    from sqlalchemy import func, select
    from sqlalchemy.orm import Session as OrmSession

    from datapool import leases
    from datapool.db import make_engine, upgrade
    from datapool.models import Judgement, Session, TrainingLease, Turn
    from trainer.offline import run_epochs

    url = f"sqlite:///{tmp_path / 'pool.db'}"
    upgrade(url)
    engine = make_engine(url)
    at = datetime(2026, 1, 1)
    outcome = {}
    judgements = []
    with OrmSession(engine) as db, db.begin():
        for task in range(2):
            for e in range(4):
                sid = f"s{task}-{e}"
                o = float(task == 1 and e % 2 == 0)
                db.add(Session(id=sid, source="rollout", task_id=f"task{task}", group_id=f"task{task}",
                               mode="offline", outcome=o))
                for k in range(2):
                    tid = f"t{task}-{e}-{k}"
                    outcome[tid] = o
                    db.add(Turn(id=tid, session_id=sid, turn_type="main", endpoint="chat", status="ok",
                                created_at=at + timedelta(seconds=k * 10 + e + task), model="m", capture="white-box",
                                request={"messages": []}, response={}, prompt_token_ids=[1, 2],
                                token_ids=[3, 4], logprobs=[-1.0, -1.0]))
                    judgements.append(Judgement(turn_id=tid, status="scored", reward=0.0, prm_reward=0.0,
                                                vote_mean=0.0, integrated_reward=o, attempts=1))
        db.flush()
        db.add_all(judgements)
    trainer = _RecordingTrainer(ObjectiveConfig(integrated_norm="group"))
    _, metrics, turns = run_epochs(engine, trainer, backend="local", config={}, objective="rl", parent_name=None,
                                   filters=leases.Filters(modes=("offline",)), batch_size=1000, max_steps=None,
                                   epochs=1, lease_s=60, resume=None, mini_batch_size=4)
    assert len(metrics) == 4 and turns == 16 and [len(s) for s in trainer.steps] == [4, 4, 4, 4]
    seen = [pair for step in trainer.steps for pair in step]
    assert sorted(t for t, _ in seen) == sorted(outcome)
    for tid, a in seen:
        if tid.startswith("t0-"):
            assert a == 0.0
        else:
            assert (a > 0) == (outcome[tid] == 1.0) and a != 0.0
    with OrmSession(engine) as db:
        assert db.scalar(select(func.count()).select_from(TrainingLease)
                         .where(TrainingLease.acked_at.is_not(None))) == 16
    engine.dispose()
