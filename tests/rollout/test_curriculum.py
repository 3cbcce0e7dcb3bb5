"""rollout.curriculum: tasks drawn by learnability, and `nextstate rollout --sample/--learnable-from`."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from nextstate.cli.rollout import _draw, rollout
from rollout.curriculum import Learnability, from_reports, group_of


def _tasks(groups: dict[str, int]) -> list[dict]:
    """``{"copy/1": 10}`` -> ten tasks of kind copy, level 1."""
    out = []
    for group, count in groups.items():
        kind, level = group.split("/")
        out += [{"id": f"{kind}-{level}-{i}", "kind": kind, "level": int(level)} for i in range(count)]
    return out


def test_group_is_kind_and_level_or_the_task_itself() -> None:
    assert group_of({"id": "t1", "kind": "copy", "level": 2}) == "copy/2"
    assert group_of({"id": "t1", "kind": "copy"}) == "copy"
    assert group_of({"id": "t1"}) == "id:t1"
    assert group_of({"id": "t1", "suite": "x"}, fields=("suite",)) == "x"


def test_rates_are_smoothed_and_older_rounds_count_less() -> None:
    tasks = _tasks({"a/1": 2})
    state = Learnability(decay=0.5)
    assert state.rate("a/1") == 0.5  # never tried
    state.update(tasks, [("a-1-0", True)] * 4)
    assert state.rate("a/1") == pytest.approx(4.5 / 5)
    state.update(tasks, [("a-1-1", False)] * 4)  # the first round now counts half: 2 of 6 passed
    assert state.rate("a/1") == pytest.approx(2.5 / 7)
    state.update(_tasks({"b/1": 1}), [("b-1-0", True)])  # another group's round leaves a/1's counts
    assert state.rate("a/1") == pytest.approx(2.5 / 7)
    with pytest.raises(KeyError, match="not among the tasks"):
        state.update(tasks, [("elsewhere", True)])
    with pytest.raises(ValueError, match="decay"):
        Learnability(decay=0)


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(1, 6), min_size=1, max_size=6), history=st.lists(st.tuples(
    st.integers(0, 40), st.booleans()), max_size=60), count=st.integers(0, 36), seed=st.integers(0, 2 ** 32))
def test_a_draw_is_count_distinct_tasks_of_the_list(sizes: list[int], history: list[tuple[int, bool]],
                                                     count: int, seed: int) -> None:
    tasks = _tasks({f"k{i}/1": n for i, n in enumerate(sizes)})
    count = min(count, len(tasks))
    state = Learnability()
    state.update(tasks, [(tasks[i % len(tasks)]["id"], ok) for i, ok in history])
    drawn = state.sample(tasks, count, random.Random(seed))
    assert len(drawn) == count and len({t["id"] for t in drawn}) == count
    assert all(t in tasks for t in drawn)
    # the same seed draws the same tasks
    assert drawn == state.sample(tasks, count, random.Random(seed))
    with pytest.raises(ValueError, match="cannot draw"):
        state.sample(tasks, len(tasks) + 1, random.Random(seed))


def test_learnable_draws_give_more_groups_with_signal_than_uniform_ones() -> None:
    """Six groups of 20 tasks each, which the policy passes with probability 0, 0, 0, 1, 1 and 0.5
    (the terminal suite's shape: most kinds solved or out of reach). Rounds of 16 tasks x 8 samples;
    a task's group of samples carries signal when they neither all pass nor all fail. After one
    round to learn the rates, learnable draws mostly the 0.5 group; uniform draws it 1 time in 6."""
    rates = {"a/1": 0.0, "b/1": 0.0, "c/1": 0.0, "d/1": 1.0, "e/1": 1.0, "f/1": 0.5}
    tasks = _tasks({g: 20 for g in rates})
    rng, sim = random.Random(7), random.Random(11)

    def roll(batch: list[dict]) -> tuple[list[tuple[str, bool]], float]:
        results, with_signal = [], 0
        for t in batch:
            outcomes = [sim.random() < rates[group_of(t)] for _ in range(8)]
            results += [(t["id"], ok) for ok in outcomes]
            with_signal += len(set(outcomes)) == 2
        return results, with_signal / len(batch)

    state = Learnability()
    uniform, learnable = [], []
    for _ in range(20):
        uniform.append(roll(rng.sample(tasks, 16))[1])
        batch = state.sample(tasks, 16, rng)
        results, share = roll(batch)
        state.update(batch, results)
        learnable.append(share)
    assert sum(uniform) / 20 < 0.3 and sum(learnable[1:]) / 19 > 0.55
    drawn = Counter(group_of(t) for t in state.sample(tasks, 16, rng))
    assert drawn["f/1"] >= 8 and len(drawn) > 1  # the floor keeps the other groups in the draw, at a small share


def _report(by_task: dict[str, tuple[int, int]]) -> dict:
    return {"by_task": {t: {"rollouts": n, "passed": k} for t, (n, k) in by_task.items()}}


def test_from_reports_reads_by_task_of_earlier_runs_oldest_first() -> None:
    tasks = _tasks({"a/1": 2, "b/2": 2})
    state = from_reports(tasks, [_report({"a-1-0": (4, 4), "b-2-0": (4, 0)}), _report({"a-1-1": (4, 2),
                                                                                      "other": (8, 8)})], decay=0.5)
    assert state.rate("a/1") == pytest.approx((2 + 2 + 0.5) / (2 + 4 + 1))  # decay 0.5 on the first report
    assert state.rate("b/2") == pytest.approx(0.5 / (4 + 1))
    with pytest.raises(ValueError, match="without by_task"):
        from_reports(tasks, [{"by_version": {}}])


def test_cli_draw_prefers_the_mixed_group_and_keeps_the_files_order(tmp_path: Path) -> None:
    tasks = _tasks({"a/1": 10, "b/1": 10, "c/1": 10})
    report = tmp_path / "run1"
    report.mkdir()
    (report / "report.json").write_text(json.dumps(_report(
        {"a-1-0": (40, 40), "b-1-0": (40, 20), "c-1-0": (40, 0)})))
    drawn = _draw(tasks, 10, (report,), "kind,level", seed=3)
    assert [t["id"] for t in drawn] == sorted((t["id"] for t in drawn), key=[t["id"] for t in tasks].index)
    assert Counter(group_of(t) for t in drawn)["b/1"] >= 8
    uniform = _draw(tasks, 10, (), "kind,level", seed=3)
    assert len(uniform) == 10 and uniform != drawn


@pytest.mark.parametrize("args, message", [
    (["--learnable-from", "{report}"], "give --sample K too"),
    (["--sample", "5"], "the file has 3 tasks"),
    (["--sample", "2", "--learnable-from", "{bad}"], "without by_task"),
])
def test_cli_refuses_a_draw_it_cannot_make(args: list[str], message: str, tmp_path: Path) -> None:
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps(t) + "\n" for t in _tasks({"a/1": 3})))
    (tmp_path / "report.json").write_text(json.dumps(_report({})))
    (tmp_path / "bad.json").write_text(json.dumps({"by_version": {}}))
    args = [a.format(report=tmp_path / "report.json", bad=tmp_path / "bad.json") for a in args]
    result = CliRunner().invoke(rollout, ["--tasks", str(path), "--agent", "x.py:solve",
                                          "--gateway", "http://127.0.0.1:9", *args])
    assert result.exit_code == 2 and message in result.output
