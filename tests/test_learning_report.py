"""The learning benchmark's report: interactions until a stable effect, the judge's −1 votes
against the simulated user's preference, and where a job's time went (benchmarks/learning)."""

from __future__ import annotations

import pytest

from benchmarks.learning.bench import (
    agreement,
    arm_objective,
    arm_slug,
    phase_table,
    stability,
    stable_from,
)


def test_stable_from_needs_three_checkpoints_in_a_row():
    k = 6
    assert stable_from([0.0, 0.8, 0.9, 0.85], k) == 6
    # a dip resets the run: 0.9, 0.7 is not stable; the run starting at 18 is
    assert stable_from([0.0, 0.9, 0.7, 0.8, 0.8, 0.95], k) == 18
    assert stable_from([0.0, 0.9, 0.9, 0.79], k) is None
    assert stable_from([0.8, 0.8], k) is None  # fewer than 3 checkpoints


def test_stability_table_uses_the_mean_curve_and_each_seed():
    rows = [{"arm": "opd", "seed": 0, "curve": [0.0, 0.9, 0.9, 0.9]},
            {"arm": "opd", "seed": 1, "curve": [0.0, 0.5, 0.9, 0.9]}]
    line = stability(rows, 4).splitlines()[-1]
    # mean curve 0, 0.7, 0.9, 0.9: never 3 in a row; seed 0 from 4, seed 1 never
    assert line == "| opd | never | 4, never |"


def test_agreement_counts_votes_against_the_preference():
    turns = [{"meets": False, "votes": [-1, -1, 1], "opd": True},
             {"meets": True, "votes": [-1, 1, None], "opd": False},
             {"meets": False, "votes": [0, 1, -1], "opd": True}]
    line = agreement([{"arm": "combined", "seed": 0, "turns": turns}]).splitlines()[-1]
    # 4 votes of −1, 3 on replies that miss: precision 0.75; misses got 6 votes, 3 of them −1: recall 0.50
    assert line == "| combined | 3 | 2 | 9 | 4 | 0.75 | 0.50 | 2 | 2 |"


def test_phase_table_means_per_arm():
    rows = [{"arm": "rl", "seed": s, "wall_s": w, "phases_s": {"interact": i, "train_round": t}}
            for s, w, i, t in ((0, 100.0, 10.0, 50.0), (1, 200.0, 30.0, 150.0))]
    line = phase_table(rows + [{"arm": "none", "seed": 0}]).splitlines()[-1]
    assert line == "| rl | 2 | 150.0 | 0.0 | 20.0 | 0.0 | 100.0 | 0.0 | 0.0 |"


def test_arms_name_the_rl_baseline():
    assert arm_objective("combined").rl_baseline == "batch"  # ObjectiveConfig's default
    assert arm_objective("rl", "none").rl_baseline == "none"  # --rl-baseline
    old = arm_objective("combined:none", "batch")  # the arm's own wins
    assert (old.objective, old.rl_baseline) == ("combined", "none")
    assert arm_objective("opd").objective == "opd"
    weighted = arm_objective("combined:batch:0.5")
    assert (weighted.rl_baseline, weighted.w_rl, weighted.w_opd) == ("batch", 0.5, 1.0)
    assert arm_objective("combined::0.25", "none").rl_baseline == "none"
    assert arm_slug("combined:none") == "combined-none"
    for bad in ("sft", "rl:ema", "combined:batch:x", "combined:batch:1:2"):
        with pytest.raises(ValueError):
            arm_objective(bad)
