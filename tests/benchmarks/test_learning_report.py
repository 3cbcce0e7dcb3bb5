"""The learning benchmark's report: interactions until a stable effect, the judge's −1 votes
against the simulated user's preference, and where a job's time went (benchmarks/learning)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.learning import bench
from benchmarks.learning.bench import (
    agreement,
    TOPK_DEFAULT,
    arm_objective,
    arm_slug,
    arm_spec,
    phase_table,
    sibling_table,
    stability,
    stable_from,
    table,
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


def test_sibling_table_counts_the_groups_that_give_rl_a_signal():
    def turn(reward, sibs=()):
        return {"reward": reward, "siblings": [{"reward": r} for r in sibs]}

    rows = [{"arm": "rl+siblings=2", "seed": 0, "turns": [turn(-1.0, (1.0, -1.0)), turn(-1.0, (-1.0, -1.0)),
                                                          turn(1.0, (1.0, 1.0))]},
            {"arm": "rl", "seed": 0, "turns": [turn(-1.0), turn(1.0)]}]
    lines = sibling_table(rows).splitlines()
    assert lines[2] == "| rl+siblings=2 | 3 | 1 | 6 | 3 | 1 |"
    assert lines[3] == "| rl | 2 | 1 | 0 | 0 | – |"


def test_phase_table_means_per_arm():
    rows = [{"arm": "rl", "seed": s, "wall_s": w, "phases_s": {"interact": i, "train_round": t}}
            for s, w, i, t in ((0, 100.0, 10.0, 50.0), (1, 200.0, 30.0, 150.0))]
    line = phase_table(rows + [{"arm": "none", "seed": 0}]).splitlines()[-1]
    assert line == "| rl | 2 | 150.0 | 0.0 | 20.0 | 0.0 | 0.0 | 100.0 | 0.0 | 0.0 |"


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


def test_arm_options_top_k_and_the_kl_guard():
    plain = arm_spec("combined")
    assert (plain.top_k, plain.objective.opd_topk, plain.objective.kl_coef) == (0, False, 0.0)
    topk = arm_spec("opd+topk")
    assert (topk.top_k, topk.objective.objective, topk.objective.opd_topk) == (TOPK_DEFAULT, "opd", True)
    both = arm_spec("combined:none:0.5+topk=8+kl=0.05")
    assert (both.top_k, both.objective.opd_topk, both.objective.kl_coef) == (8, True, 0.05)
    assert (both.objective.rl_baseline, both.objective.w_rl) == ("none", 0.5)
    assert arm_spec("rl+kl=0.1").objective.kl_coef == 0.1
    assert arm_slug("combined:batch+topk=8+kl=0.05") == "combined-batch-topk-8-kl-0_05"
    assert (arm_spec("rl+siblings=4").siblings, plain.siblings) == (4, 0)
    assert (plain.objective.loss_agg_mode, arm_spec("combined+topk+seq").objective.loss_agg_mode) == (
        "token-mean", bench.SEQ_AGG)
    for bad in ("rl+seq=1", "rl+topk", "opd+topk=0", "opd+topk=21", "opd+kl=-1", "opd+sft", "opd+topk=x",
                "rl+siblings=0", "rl+siblings=17", "opd+tau=2", "opd+topk+tau=0", "opd+topk+tail=-1", "opd+tau",
                "opd+topic=x"):
        with pytest.raises(ValueError):
            arm_spec(bad)


def test_arm_options_with_their_defaults_the_temperature_and_the_topicality_check():
    """``+kl``, ``+siblings`` and ``+topic`` without a value take the defaults, so
    ``opd+topk+kl``, ``combined+topk+kl`` and ``rl+siblings`` run beside ``opd+topk``, ``opd`` and ``rl``."""
    anchored = arm_spec("opd+topk+kl")
    assert (anchored.objective.kl_coef, anchored.top_k, anchored.topic_margin) == (bench.KL_DEFAULT, TOPK_DEFAULT, None)
    assert arm_spec("combined+topk+kl").objective.kl_coef == bench.KL_DEFAULT
    assert arm_spec("rl+siblings").siblings == bench.SIBLINGS_DEFAULT
    tempered = arm_spec("opd+topk+tau=2+tail=0.5+topic")
    assert (tempered.objective.opd_topk_temperature, tempered.objective.opd_topk_tail_weight) == (2.0, 0.5)
    assert tempered.topic_margin == bench.TOPIC_DEFAULT and arm_spec("opd+topic=0.1").topic_margin == 0.1
    assert arm_slug("opd+topk+tau=1.5") == "opd-topk-tau-1_5"


def test_keep_trains_on_from_a_held_back_candidate_and_needs_the_topicality_check():
    """``+keep`` (OnlineConfig.refused_update "keep") goes with ``+topic`` only: without a gate
    nothing is ever held back."""
    kept = arm_spec("combined+siblings=4+topic=0.05+keep+seq+steps=4")
    assert (kept.keep, kept.topic_margin, kept.siblings, kept.updates) == (True, 0.05, 4, 4)
    assert not arm_spec("combined+topic").keep
    with pytest.raises(ValueError, match="needs \\+topic"):
        arm_spec("combined+keep")
    sampled = arm_spec("combined+topic+sampled+keep")
    assert (sampled.gate_samples, arm_spec("combined+topic+sampled=8").gate_samples) == (bench.GATE_SAMPLES_DEFAULT, 8)
    for bad in ("combined+sampled", "combined+topic+sampled=1"):
        with pytest.raises(ValueError):
            arm_spec(bad)


def test_a_gated_arm_reaches_the_online_loops_gate(tmp_path: Path):
    """``+topic=M+sampled+keep``: the job's OnlineConfig asks for the topicality check on GATE against
    the untrained adapter, each prompt answered GATE_SAMPLES_DEFAULT times at the checkpoints'
    temperature, and a refused update kept; an arm without ``+topic`` has no gate at all."""
    from benchmarks.learning import preference

    args = argparse.Namespace(rl_baseline=None, upstream="http://127.0.0.1:9/v1", teacher="http://127.0.0.1:9/v1",
                              judge="python", votes=3, hint_gate=True, k=6, updates=2, max_tokens=64)
    cfg = bench.Job(args, tmp_path, "combined+topic=0.03+sampled+keep+steps=4", 0).online_config("b-x")
    assert (cfg.topic_scorer, cfg.topic_margin, cfg.topic_reference) == (preference.topic_scorer, 0.03, "b-x-init")
    assert [m[0]["content"] for m in cfg.eval_prompts] == bench.GATE
    assert (cfg.eval_samples, cfg.eval_temperature) == (bench.GATE_SAMPLES_DEFAULT, bench.HELD_OUT_TEMPERATURE)
    assert (cfg.refused_update, cfg.updates_per_round) == ("keep", 4)
    greedy = bench.Job(args, tmp_path, "combined+topic", 0).online_config("b-y")
    assert (greedy.eval_samples, greedy.eval_temperature, greedy.refused_update) == (1, 0.0, "drop")
    ungated = bench.Job(args, tmp_path, "combined", 0).online_config("b-z")
    assert ungated.topic_scorer is None and ungated.eval_prompts == []


def test_an_arm_may_set_its_own_learning_rate_and_steps_per_round():
    """``lr=X`` and ``steps=N`` run a faster (or slower) arm beside the preset's; without them
    the arm takes the preset's (None here)."""
    fast = arm_spec("combined+topk+kl=0.2+lr=2e-3+steps=4")
    assert (fast.lr, fast.updates, fast.objective.kl_coef, fast.top_k) == (2e-3, 4, 0.2, TOPK_DEFAULT)
    assert (arm_spec("combined").lr, arm_spec("combined").updates) == (None, None)


def test_an_arm_may_end_top_k_opd_after_n_rounds():
    """``topkrounds=N`` with ``topk``: top-k OPD for N rounds, then the sampled token's
    (OnlineConfig.opd_topk_rounds); without top-k, or out of range, it is refused."""
    arm = arm_spec("combined+topk+topkrounds=3+kl=0.1+kltarget=0.3+replay=4+seq+steps=6")
    assert (arm.topk_rounds, arm.top_k, arm.objective.opd_topk) == (3, TOPK_DEFAULT, True)
    assert arm_spec("combined+topk").topk_rounds == 0
    for bad in ("combined+topkrounds=3", "combined+topk+topkrounds=0", "combined+topk+topkrounds",
                "combined+topk+topkrounds=101"):
        with pytest.raises(ValueError):
            arm_spec(bad)


def test_an_arm_may_start_top_k_opd_at_a_reply_position():
    """``topkfrom=P`` with ``topk``: top-k OPD from reply position P on, the sampled token's before
    (ObjectiveConfig.opd_topk_from); without top-k, or out of range, it is refused."""
    arm = arm_spec("combined+topk+topkfrom=8+kl=0.1+kltarget=0.3+replay=4+seq+steps=6")
    assert (arm.objective.opd_topk_from, arm.objective.opd_topk, arm.top_k) == (8, True, TOPK_DEFAULT)
    assert arm_spec("combined+topk").objective.opd_topk_from == 0
    for bad in ("combined+topkfrom=8", "combined+topk+topkfrom=0", "combined+topk+topkfrom", "opd+topk+topkfrom=x"):
        with pytest.raises(ValueError):
            arm_spec(bad)


def test_an_arm_may_adapt_its_kl_anchor_toward_a_target():
    """``kltarget=T`` with ``kl[=C]``: the anchor starts at C and follows a KL to the base of T per
    reply token (OnlineConfig.kl_target); without an anchor to start from it is refused."""
    adapted = arm_spec("combined+topk+kl=0.1+kltarget=0.2+seq+steps=6")
    assert (adapted.kl_target, adapted.objective.kl_coef, adapted.updates) == (0.2, 0.1, 6)
    assert arm_spec("combined+kl").kl_target is None
    fast = arm_spec("combined+kl=0.1+kltarget=0.3+klh=0.25+klfloor")
    assert (fast.kl_target, fast.kl_horizon, fast.kl_floor) == (0.3, 0.25, True)
    assert (adapted.kl_horizon, adapted.kl_floor) == (1.0, False)
    for bad in ("combined+kltarget=0.2", "combined+kl+kltarget=0", "combined+kl+kltarget", "combined+kl+klh=0.5",
                "combined+kl+klfloor", "combined+kl+kltarget=0.3+klh=0", "combined+kl+kltarget=0.3+klfloor=1"):
        with pytest.raises(ValueError):
            arm_spec(bad)
    assert arm_slug("combined+lr=2e-3+steps=4") == "combined-lr-2e-3-steps-4"
    for bad in ("combined+lr=0", "combined+lr=1.5", "combined+steps=0", "combined+steps=65", "combined+lr",
                "combined+steps=x"):
        with pytest.raises(ValueError):
            arm_spec(bad)


def test_ask_names_the_question_in_the_hint():
    """``+ask``: the python judge's hint is the user's words and then the question the reply was
    to answer; a reply that meets the preference gets +1 and no hint, as without it."""
    from benchmarks.learning import preference

    assert (arm_spec("opd+topk+ask").judge, arm_spec("opd+topk").judge) == ("judge_naming_the_question", "judge")
    with pytest.raises(ValueError):
        arm_spec("opd+ask=1")
    question = "What is a calorie?"
    turn = {"request": {"messages": [{"role": "user", "content": question}]},
            "response": {"content": "A calorie is " + "a unit of energy " * 10}}
    said = {"messages": [{"role": "user", "content": preference.CORRECTION}]}
    plain, asked = preference.judge(turn, said), preference.judge_naming_the_question(turn, said)
    assert plain["vote"] == asked["vote"] == -1 and plain["hint"] == preference.CORRECTION
    assert asked["hint"].startswith(preference.CORRECTION) and question in asked["hint"]
    turn["response"]["content"] = "A unit of energy in food."  # short, but no word of the question
    off = preference.judge_naming_the_question(turn, {"messages": []})  # no reply yet: the user's reaction
    assert off["hint"] == f'{preference.OFF_TOPIC} The question was: "{question}"'
    turn["response"]["content"] = "A calorie is a unit of energy."
    assert preference.judge_naming_the_question(turn, said) == {"vote": 1, "rationale": "7 words, on topic"}


def _turn(question: str, reply: str) -> tuple[dict, dict]:
    """A turn as the python judge sees it, and its next state: the user's reaction."""
    from benchmarks.learning import preference

    return ({"request": {"messages": [{"role": "user", "content": question}]}, "response": {"content": reply}},
            {"messages": [{"role": "user", "content": preference.reaction(question, reply)}]})


def test_graded_judge_tells_too_long_from_off_topic():
    """``+graded``: a reply on topic but too long gets 0 (the user's "Too long…"), one off topic or
    empty -1 whatever its length, one that meets the preference +1; the hint is the binary judge's,
    so OPD distills the same correction."""
    from benchmarks.learning import preference

    question, long_ = "What is a calorie?", " and so on, a unit of energy" * 5
    cases = {"A calorie is a unit of energy." + long_: 0,  # long, on topic
             "A unit of energy in food.": -1,  # short, off topic
             "It is a unit of energy." + long_: -1,  # long, off topic
             "A calorie is a unit of energy.": 1,  # short, on topic
             "": -1}
    for reply, grade in cases.items():
        turn, said = _turn(question, reply)
        graded, binary = preference.graded_judge(turn, said), preference.judge(turn, said)
        assert graded["vote"] == grade, reply
        assert binary["vote"] == (1 if grade == 1 else -1) and graded.get("hint") == binary.get("hint")
    turn, said = _turn(question, "A calorie is a unit of energy." + long_)
    assert said["messages"][0]["content"] == preference.CORRECTION
    asked = preference.graded_judge_naming_the_question(turn, said)
    assert asked["vote"] == 0 and asked["hint"] == f'{preference.CORRECTION} The question was: "{question}"'


@st.composite
def question_and_reply(draw: st.DrawFn) -> tuple[str, str]:
    """A question (a benchmark's or any text) and a reply of 0 to 40 words, some of them the
    question's: short and long, on and off topic, empty."""
    question = draw(st.one_of(st.sampled_from(bench.TRAIN + bench.HELD_OUT + bench.GATE), st.text(max_size=60)))
    word = st.one_of(st.sampled_from(question.split() or ["x"]), st.from_regex(r"[A-Za-z]{1,9}[.,?]?", fullmatch=True))
    n = draw(st.integers(0, 40))
    return question, draw(st.one_of(st.lists(word, min_size=n, max_size=n).map(" ".join), st.text(max_size=200)))


@settings(max_examples=300, deadline=None)
@given(question_and_reply())
def test_graded_judge_agrees_with_the_binary_one_on_every_success(pair):
    from benchmarks.learning import preference

    question, reply = pair
    turn, said = _turn(question, reply)
    graded, binary = preference.graded_judge(turn, said)["vote"], preference.judge(turn, said)["vote"]
    assert graded in (-1, 0, 1)
    assert (graded == 1) == (binary == 1)
    assert graded != 0 or preference.on_topic(question, reply)


def test_graded_reaches_the_judge_a_job_scores_with(tmp_path: Path, sqlite_url: str):
    """``+graded`` parses, and the job's judge is the graded one (the binary one without it): a
    long reply on topic is scored 0 with the user's correction kept as its hint (so OPD still
    asks the teacher), and RL's batch baseline ranks it above the round's off-topic replies,
    where the binary judge's all -1 gave no signal at all."""
    import datetime as dt

    import torch
    from sqlalchemy.orm import Session as OrmSession

    from benchmarks.learning import preference
    from datapool.models import Judgement, Session, Turn
    from trainer import objectives

    assert (arm_spec("combined+graded").judge, arm_spec("combined").judge) == ("graded_judge", "judge")
    assert arm_spec("rl:none+graded+ask").judge == "graded_judge_naming_the_question"
    assert arm_spec("opd+ask").judge == "judge_naming_the_question"
    for bad in ("opd+graded", "opd+topk+graded", "combined+graded=1"):
        with pytest.raises(ValueError):
            arm_spec(bad)
    args = argparse.Namespace(rl_baseline=None, upstream="http://127.0.0.1:9/v1", teacher="http://127.0.0.1:9/v1",
                              judge="python", votes=3, hint_gate=True)
    question, now = "What is a calorie?", dt.datetime.now(dt.UTC)
    replies = ["A calorie is a unit of energy," + " and so on" * 10, "Bathroom scale.", "Yes.", "No."]

    def rewards(arm: str) -> list[tuple[float, str | None]]:
        job = bench.Job(args, tmp_path, arm, 0)  # the pool: sqlite_url's, tmp_path / "pool.db"
        ids = []
        with OrmSession(job.engine) as db, db.begin():
            for reply in replies:
                sid, tid = f"s-{uuid.uuid4().hex[:8]}", str(uuid.uuid4())
                db.add(Session(id=sid, source="header", mode="online", created_at=now, updated_at=now))
                db.add(Turn(id=tid, session_id=sid, turn_type="main", endpoint="chat", status="ok", created_at=now,
                            model="policy", upstream_model="smollm2", capture="white-box",
                            request={"model": "policy", "messages": [{"role": "user", "content": question}]},
                            response={"choices": [{"index": 0, "message": {"role": "assistant", "content": reply}}]},
                            next_state={"messages": [{"role": "user",
                                                      "content": preference.reaction(question, reply)}]},
                            token_ids=[5, 6, 7]))
                ids.append(tid)
        for tid in ids:
            job.score(tid, teacher=False)
        with OrmSession(job.engine) as db:
            return [(db.get(Judgement, t).reward, db.get(Judgement, t).hint) for t in ids]

    assert bench.Job(args, tmp_path, "combined", 0).judge.fn is preference.judge
    assert bench.Job(args, tmp_path, "combined+graded", 0).judge.fn is preference.graded_judge
    binary, graded = rewards("combined"), rewards("combined+graded")
    assert [r for r, _ in binary] == [-1.0] * 4 and [r for r, _ in graded] == [0.0, -1.0, -1.0, -1.0]
    assert graded[0][1] == binary[0][1] == preference.CORRECTION  # the hint OPD's teacher pass is asked with

    def advantages(scores: list[float]) -> list[float]:
        mask = torch.ones(len(scores), 3)
        token = objectives.scores_to_token_rewards(torch.tensor(scores), mask)
        return objectives.compute_advantages(bench.arm_objective("combined+graded"), response_mask=mask,
                                             token_level_rewards=token)[:, 0].tolist()

    assert advantages([r for r, _ in binary]) == [0.0] * 4
    long_on_topic, *off_topic = advantages([r for r, _ in graded])
    assert long_on_topic > 0 and all(a < 0 for a in off_topic)


def test_round_tables_mean_each_round_over_the_seeds_and_count_held_back_rounds():
    def rounds(*kls: float, refused: tuple[int, ...] = ()) -> list[dict]:
        return [{"after": 6 * (i + 1), "decision": "refuse" if i in refused else "promote", "drift_kl_k3": kl}
                for i, kl in enumerate(kls)]

    rows = [{"arm": "opd+topk", "seed": 0, "rounds": rounds(0.1, 0.3, refused=(1,))},
            {"arm": "opd+topk", "seed": 1, "rounds": rounds(0.3, 0.5)},
            {"arm": "none", "seed": 0}, {"arm": "rl", "seed": 0, "rounds": [{"after": 6, "decision": "promote"}]}]
    lines = bench.round_table(rows, "drift_kl_k3").splitlines()
    assert lines[0] == "| arm | after 6 | after 12 | held back |"
    assert lines[2:] == ["| opd+topk | 0.200 | 0.400 | 1/4 |"]  # rl has no such metric: no row
    text = bench.drift_tables(rows)
    assert text.startswith("KL(candidate ‖ base), k3") and "entropy" not in text


# --- jobs stopped early (a dead vLLM, --deadline-min): reported up to their last checkpoint ----------


def _row(arm: str, seed: int, curve: list[float], partial: bool = False) -> dict:
    return {"arm": arm, "seed": seed, "curve": curve, "latencies_s": [], **({"partial": True} if partial else {})}


def test_table_means_each_checkpoint_over_the_seeds_that_reached_it():
    rows = [_row("rl", 0, [0.0, 0.2, 0.4, 0.6]), _row("rl", 1, [0.0, 0.4], partial=True),
            _row("none", 0, [0.1] * 4)]
    lines = table(rows, 6).splitlines()
    assert lines[0] == "| arm | seeds | after 0 | after 6 | after 12 | after 18 | Δ | latency s (median) |"
    # 0.3 ± 0.14 over both seeds at 6; from 12 on one seed, which the brackets say; Δ: (0.6 + 0.4) / 2
    assert lines[2] == "| rl | 2 (1 partial) | 0.00 ± 0.00 | 0.30 ± 0.14 | 0.40 ± 0.00 (1) | 0.60 ± 0.00 (1) | +0.50 | – |"
    assert lines[3] == "| none | 1 | 0.10 ± 0.00 | 0.10 ± 0.00 | 0.10 ± 0.00 | 0.10 ± 0.00 | +0.00 | – |"
    # an arm none of whose seeds got as far as another arm's: a dash, not a number
    assert table([_row("rl", 0, [0.0, 0.5], partial=True), _row("opd", 0, [0.0, 0.5, 0.9])], 6).splitlines()[2] \
        == "| rl | 1 (1 partial) | 0.00 ± 0.00 | 0.50 ± 0.00 | – | +0.50 | – |"


def test_stability_of_a_stopped_seed_says_how_far_it_got():
    rows = [_row("opd", 0, [0.0, 0.9, 0.9, 0.9]), _row("opd", 1, [0.0, 0.5], partial=True)]
    # mean curve: 0, 0.7, then seed 0 alone 0.9, 0.9: not 3 in a row ≥ 0.8 by 18
    assert stability(rows, 6).splitlines()[-1] == "| opd | not by 18 | 6, not by 6 |"
    assert stability([_row("rl", 0, [0.0, 0.1, 0.1])], 6).splitlines()[-1] == "| rl | never | never |"


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["rl", "opd", "combined"]),
                          st.lists(st.floats(0, 1), min_size=1, max_size=8), st.booleans()), min_size=1, max_size=8))
def test_report_renders_every_mix_of_whole_and_partial_seeds(spec):
    rows = [_row(arm, i, curve, partial) for i, (arm, curve, partial) in enumerate(spec)]
    points = max(len(r["curve"]) for r in rows)
    lines = table(rows, 6).splitlines()
    arms = list(dict.fromkeys(r["arm"] for r in rows))
    assert len(lines) == 2 + len(arms)
    for arm, line in zip(arms, lines[2:]):
        cells = line.strip("|").split(" | ")
        assert len(cells) == points + 4
        mine = [r["curve"] for r in rows if r["arm"] == arm]
        for i in range(points):
            reached = [c[i] for c in mine if len(c) > i]
            if not reached:
                assert cells[2 + i] == "–"
            else:
                assert cells[2 + i].startswith(f"{sum(reached) / len(reached):.2f} ±")
                assert cells[2 + i].endswith(f"({len(reached)})") == (len(reached) < len(mine))
    assert len(stability(rows, 6).splitlines()) == 2 + len(arms)


def test_merge_prefers_a_whole_result_to_a_partial_one(tmp_path: Path):
    def full(row: dict) -> dict:  # what a job reports beside the curve
        return row | {key: row["curve"] for key in ("short", "on_topic", "words")}

    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"results": [full(_row("rl", 0, [0.0, 0.1], partial=True))]}))
    b.write_text(json.dumps({"results": [full(_row("rl", 0, [0.0, 0.1, 0.2])), full(_row("rl", 1, [0.0, 0.3, 0.3]))]}))
    args = argparse.Namespace(merge=[a, b], arms="rl", tag="merged", preset="full", judge="python", k=6,
                              interactions=12, heldout=16, samples_per_prompt=4, out=tmp_path)
    bench.merge(args)
    merged = json.loads((tmp_path / "merged.json").read_text())["results"]
    assert [(r["seed"], len(r["curve"]), r.get("partial")) for r in merged] == [(0, 3, None), (1, 3, None)]


def test_run_jobs_stops_at_the_deadline_and_reports_the_checkpoints_so_far(tmp_path: Path, monkeypatch):
    """A real child process per job, as bench.run_jobs starts them, but one that writes a
    checkpoint and then hangs (a job mid-round when the deadline comes)."""
    hang = ("import json, sys, time; from pathlib import Path; d = Path(sys.argv[-1]).parent; "
            "(d / 'progress.json').write_text(json.dumps({'arm': 'rl', 'seed': 0, 'curve': [0.0, 0.25], "
            "'latencies_s': [], 'stopped_after': 6})); time.sleep(600)")
    real = subprocess.Popen
    monkeypatch.setattr(bench.subprocess, "Popen",
                        lambda cmd, **kw: real([sys.executable, "-c", hang, *cmd[-2:]], **kw))
    args = argparse.Namespace(jobs=1, threads=1, arms="rl")
    got: list[dict] = []
    started = time.monotonic()
    failed, stopped = bench.run_jobs(args, tmp_path, [("rl", 0), ("rl", 1)], {0: {}, 1: {}}, got.append,
                                     deadline=time.monotonic() + 3)
    assert time.monotonic() - started < 30  # the hanging job was stopped, not waited for
    assert failed == []
    assert sorted(stopped) == ["rl-0", "rl-1"]  # rl-1 never started: --jobs 1
    assert got == [{"arm": "rl", "seed": 0, "curve": [0.0, 0.25], "latencies_s": [], "stopped_after": 6,
                    "partial": True, "stopped": "stopped"}]
    assert not (tmp_path / "rl-1").exists()


def test_an_arm_may_replay_earlier_rounds():
    """``replay[=N]`` trains each round on the last N rounds' turns too (OnlineConfig.replay_rounds)."""
    assert arm_spec("combined+topk+kl").replay == 0
    assert arm_spec("combined+topk+kl+replay").replay == bench.REPLAY_DEFAULT
    assert arm_spec("opd+replay=3").replay == 3
    for bad in ("opd+replay=0", "opd+replay=17", "opd+replay=x"):
        with pytest.raises(ValueError):
            arm_spec(bad)


@pytest.mark.parametrize("signal", [SystemExit(143), KeyboardInterrupt()])
def test_a_run_stopped_by_sigterm_still_writes_its_report(signal, tmp_path: Path, monkeypatch):
    """SIGTERM (a lease that ends: the handler raises SystemExit) or Ctrl-C while jobs run: the
    report is written from the checkpoints the stopped jobs left, marked partial, and the run
    still ends with the signal's exit."""
    def heldout(args, model, seed):
        return {"curve": 0.0, "short": 0.0, "on_topic": 1.0, "words": 50.0}

    def run_jobs(args, work, jobs, base, done, deadline):
        row = _row("rl", 0, [0.0, 0.25], partial=True) | {"stopped": "stopped"}
        done(row | {key: row["curve"] for key in ("short", "on_topic", "words")})
        raise signal

    monkeypatch.setattr(bench, "heldout", heldout)
    monkeypatch.setattr(bench, "run_jobs", run_jobs)
    args = argparse.Namespace(arms="rl", tag="cut", preset="full", judge="python", k=6, interactions=12, heldout=16,
                              samples_per_prompt=4, out=tmp_path, first_seed=0, seeds=1, model="smollm2",
                              deadline_min=None)
    with pytest.raises(type(signal)):
        bench.run(args, tmp_path)
    report = json.loads((tmp_path / "cut.json").read_text())
    assert [(r["arm"], r["seed"], r["curve"], r["partial"]) for r in report["results"]] == [("rl", 0, [0.0, 0.25], True)]
    assert report["config"]["interrupted"] == type(signal).__name__ and report["config"]["stopped"] == ["rl-0"]
    assert (tmp_path / "cut.png").exists()


def test_a_stalled_job_says_where_it_waited(tmp_path: Path):
    """A job that made no checkpoint for minutes when the run stopped it (one of 15 on the GPU sat
    ten minutes after its first round with nothing in the report) is asked for its threads' stacks
    before it is stopped, and the report prints them with its gateway's log; a job that checkpointed
    recently is left alone. Real processes, registered for the signal as ``run_job`` registers."""
    child = ("import faulthandler, signal, sys, time\n"
             "faulthandler.register(signal.SIGUSR1, all_threads=True)\n"
             "def waiting_on_the_policy_reply():\n"
             "    time.sleep(60)\n"
             "print('ready', flush=True)\n"
             "waiting_on_the_policy_reply()\n")
    running = {}
    for name, age in (("stalled", 600), ("busy", 5)):
        d = tmp_path / name
        (d / "gw").mkdir(parents=True)
        (d / "job.json").write_text("{}")
        (d / "progress.json").write_text("{}")
        then = time.time() - age
        os.utime(d / "progress.json", (then, then))
        (d / "gw" / "gateway-1234.log").write_text("INFO loading adapter v1 into http://127.0.0.1:8601/v1\n")
        with open(d / "job.log", "wb") as log:
            proc = subprocess.Popen([sys.executable, "-c", child], stdout=log, stderr=subprocess.STDOUT)
        running[proc] = (name, 0, d)
    try:
        deadline = time.monotonic() + 20
        while any(b"ready" not in (d / "job.log").read_bytes() for _, _, d in running.values()):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        stalled = bench.stalled_jobs(running, stall_s=180)
        assert [running[p][0] for p in stalled] == ["stalled"] and list(stalled.values())[0] >= 600
        report = bench.stall_report(tmp_path / "stalled")
        assert "waiting_on_the_policy_reply" in report and "loading adapter v1" in report
        assert "waiting_on_the_policy_reply" not in (tmp_path / "busy" / "job.log").read_text()
    finally:
        for proc in running:
            proc.kill()
            proc.wait()


def test_a_checkpoint_keeps_its_short_replies_that_miss_the_topic(monkeypatch):
    """What "off topic" means at a checkpoint: the held-out replies short but not naming the
    question's subject are kept (at most OFF_TOPIC_KEPT, cut to REPLY_CHARS) — a long reply off topic,
    or a short one on topic, is not — and the report lists the first seed's at 18 and 36."""
    pairs = [("What is a calorie?", "It is a unit of energy."),           # short, off topic
             ("What is a calorie?", "A calorie is a unit of energy."),    # short, on topic
             ("Why is the sky blue?", "word " * 40),                      # long, off topic
             ("Why is the sky blue?", "Yes. | " + "x" * 300)]             # short, off topic, long text
    kept = bench.short_off_topic(pairs)
    assert [k["question"] for k in kept] == ["What is a calorie?", "Why is the sky blue?"]
    assert kept[0]["reply"] == "It is a unit of energy." and len(kept[1]["reply"]) == bench.REPLY_CHARS
    assert len(bench.short_off_topic([("What is a calorie?", "Yes.")] * 9)) == bench.OFF_TOPIC_KEPT

    # heldout() returns them beside the shares, from the replies the served model gave: one request a
    # prompt for its samples (n), answered as vLLM answers one (n choices, each with its index)
    asked = []

    class Client:
        def __init__(self, **kw):
            self.chat = self
            self.completions = self

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def create(self, model, messages, n=1, seed=None, **kw):
            asked.append((messages[0]["content"], n, seed))
            reply = "It is a unit of energy." if "calorie" in messages[0]["content"] else "Blue light scatters."
            return argparse.Namespace(choices=[argparse.Namespace(index=i, message=argparse.Namespace(content=reply))
                                               for i in reversed(range(n))])

    monkeypatch.setattr(bench, "OpenAI", Client)
    monkeypatch.setattr(bench, "HELD_OUT", ["What is a calorie?", "Why is the sky blue?"])
    args = argparse.Namespace(heldout=2, samples_per_prompt=2, upstream="http://unused/v1", max_tokens=8)
    point = bench.heldout(args, "policy", 3)
    assert point["on_topic"] == 0.5 and point["short"] == 1.0
    # seed 3, prompt i: seed 3000 + 10 i, whose j-th sample vLLM draws with 3000 + 10 i + j, as when it was a request
    assert sorted(asked) == [("What is a calorie?", 2, 3000), ("Why is the sky blue?", 2, 3010)]
    assert point["short_off_topic"] == [{"question": "What is a calorie?", "reply": "It is a unit of energy."}] * 2

    rows = [{"arm": "combined", "seed": 3, "curve": [0.0] * 7, "short": [0.0] * 7, "on_topic": [1.0] * 7,
             "words": [9.0] * 7, "latencies_s": [],
             "short_off_topic": [[], [], [], [{"question": "Q?", "reply": "a | b\nc"}], [], [], []]},
            {"arm": "combined", "seed": 4, "curve": [0.0] * 7, "short": [0.0] * 7, "on_topic": [1.0] * 7,
             "words": [9.0] * 7, "latencies_s": [], "short_off_topic": [[{"question": "X?", "reply": "no"}]] * 7}]
    text = bench.tables(rows, 6)
    assert "| combined | 3 | 18 | Q? | a / b c |" in text and "X?" not in text
    # a run from before the examples were kept: no section
    assert "short but off topic" not in bench.tables([{k: v for k, v in r.items() if k != "short_off_topic"}
                                                      for r in rows], 6)
