"""The agents benchmark's pipelining and report, without a model: iteration k+1's rollouts overlap
iteration k's learning in an ``@async`` arm, and the report's standard errors and time-to-target."""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from benchmarks.agents import run as bench


def test_arm_names() -> None:
    assert bench.base_arm("integrated@async") == "integrated" and bench.is_async("integrated@async")
    assert bench.base_arm("outcome") == "outcome" and not bench.is_async("outcome")
    assert bench.short("integrated+opd@async") == "opda" and bench.short("outcome") == "out"


class Timeline:
    """When each phase of a job began and ended, from any thread (``mark``); ``collect`` stands
    in for Job.collect: 0.2 s of rollouts."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int, float]] = []
        self.lock = threading.Lock()

    def mark(self, what: str, it: int) -> None:
        with self.lock:
            self.events.append((what, it, time.monotonic()))

    def collect(self, gw_url: str, it: int, tasks: list[dict[str, Any]]) -> dict[str, Any]:
        self.mark("collect-start", it)
        time.sleep(0.2)
        self.mark("collect-end", it)
        return {"iteration": it, "tasks": tasks}

    def at(self) -> dict[tuple[str, int], float]:
        return {(w, i): t for w, i, t in self.events}


def test_pipelined_overlaps_the_next_rollouts_with_learning(tmp_path: Path) -> None:
    job = bench.Job(argparse.Namespace(upstream="http://127.0.0.1:9/v1", teacher=None), tmp_path, "toolcall",
                    "integrated@async", seed=0)
    timeline = Timeline()
    mark = timeline.mark
    learned: list[dict[str, Any]] = []

    def learn(gw_url: str, it: int, point: dict[str, Any], heldout: list[Any], row: dict[str, Any],
              t0: float) -> None:
        mark("learn-start", it)
        assert point["iteration"] == it and point["tasks"] == [{"id": f"t{it}"}]  # its own iteration's rollouts
        time.sleep(0.2)
        learned.append(point)
        mark("learn-end", it)

    job.collect, job.learn = timeline.collect, learn  # type: ignore[method-assign]
    job.pipelined("http://gw", [[{"id": f"t{i}"}] for i in (1, 2, 3)], [], {}, time.monotonic())
    at = timeline.at()
    assert [p["iteration"] for p in learned] == [1, 2, 3]
    for it in (1, 2):
        # the next rollouts started before this iteration's learning ended, after its own rollouts
        assert at[("collect-end", it)] <= at[("collect-start", it + 1)] < at[("learn-end", it)]
        assert at[("collect-end", it + 1)] <= at[("learn-start", it + 1)]
    assert ("collect-start", 4) not in at


def test_in_turn_evaluates_beside_the_next_rollouts_and_before_the_next_publish(tmp_path: Path) -> None:
    job = bench.Job(argparse.Namespace(upstream="http://127.0.0.1:9/v1", teacher=None, eval_overlap=True), tmp_path,
                    "terminal", "integrated", seed=0)
    timeline = Timeline()
    mark = timeline.mark

    def evaluated(it: int) -> None:
        mark("eval-start", it)
        time.sleep(0.3)
        mark("eval-end", it)

    def learn(gw_url: str, it: int, point: dict[str, Any], heldout: list[Any], row: dict[str, Any], t0: float,
              evals: Any = None) -> Any:
        mark("publish", it)
        return evals.submit(evaluated, it)

    job.collect, job.learn = timeline.collect, learn  # type: ignore[method-assign]
    job.in_turn("http://gw", [[{"id": f"t{i}"}] for i in (1, 2, 3)], [], {}, time.monotonic())
    at = timeline.at()
    for it in (1, 2):
        # version it is evaluated while iteration it+1's rollouts (on the same version) run ...
        assert at[("eval-start", it)] < at[("collect-end", it + 1)]
        assert at[("collect-start", it + 1)] < at[("eval-end", it)]
        # ... and its evaluation ends before version it+1 is published
        assert at[("eval-end", it)] <= at[("publish", it + 1)]
    assert ("eval-end", 3) in at  # the last evaluation is waited for


def _row(suite: str, arm: str, seed: int, curve: list[float], t: list[float]) -> dict[str, Any]:
    return {"suite": suite, "arm": arm, "seed": seed, "pass_at_1": curve, "t_s": t, "iterations": []}


def test_compare_table_standard_errors_and_speedup() -> None:
    rows = [_row("toolcall", "outcome", s, [0.1, v], [0, 100]) for s, v in enumerate((0.10, 0.20, 0.30))]
    rows += [_row("toolcall", "integrated", s, [0.1, 0.3, v], [0, 100, 200]) for s, v in enumerate((0.5, 0.6, 0.7))]
    rows += [_row("toolcall", "integrated@async", s, [0.1, 0.3, v], [0, 50, 90]) for s, v in enumerate((0.5, 0.6, 0.7))]
    text = bench.compare_table(rows)
    # outcome: mean 0.2, SE 0.1/sqrt(3); integrated: 0.6, same SE; difference 0.4 / (0.1*sqrt(2/3)) = 4.9 SE
    assert "| toolcall | outcome | 3 | 1 | 0.200 ± 0.058 | +0.100 | – |" in text
    assert "| toolcall | integrated | 3 | 2 | 0.600 ± 0.058 | +0.500 | +0.400 (+4.9 SE) |" in text
    # both reach 0.6 (the lower of the two best mean points): sync at 200 s, async at 90 s
    assert "| toolcall | integrated | 0.600 | 200.0 | 90.0 | 2.22× |" in text


def test_compare_table_uses_the_point_every_seed_reached() -> None:
    rows = [_row("toolcall", "integrated", 0, [0.1, 0.2, 0.9], [0, 10, 20]),
            _row("toolcall", "integrated", 1, [0.1, 0.4], [0, 10]) | {"partial": True}]
    assert "| toolcall | integrated | 2 | 1 | 0.300 ± 0.100 | +0.200 | – |" in bench.compare_table(rows)


def test_compare_table_without_outcome_or_twin() -> None:
    rows = [_row("terminal", "integrated", 0, [0.2, 0.4], [0, 10])]
    text = bench.compare_table(rows)
    assert "| terminal | integrated | 1 | 1 | 0.400 ± nan | +0.200 | – |" in text and "speed-up" not in text


@pytest.mark.parametrize("arms", ["outcome,bogus", "integrated@sync"])
def test_unknown_arm_is_refused(arms: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr("sys.argv", ["run", "--arms", arms, "--suites", "toolcall"])
    with pytest.raises(SystemExit) as e:
        bench.main()
    assert e.value.code == 2 and "unknown arm" in capsys.readouterr().err


def test_dense_advantages_need_the_iteration_scope(monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr("sys.argv", ["run", "--suites", "toolcall", "--integrated-norm", "dense",
                                     "--advantage-scope", "step"])
    with pytest.raises(SystemExit) as e:
        bench.main()
    assert e.value.code == 2 and "--advantage-scope iteration" in capsys.readouterr().err


def test_escapes_are_tried_and_contained(tmp_path: Path) -> None:
    """What the benchmark tries beside its environments; each is stopped by its own limit."""
    from base.errors import SandboxUnavailable
    from rollout.sandbox import check_available

    try:
        check_available()
    except SandboxUnavailable as exc:
        pytest.skip(f"this machine cannot isolate commands: {exc}")
    out = bench.try_escapes(tmp_path, rounds=1)
    assert set(out["tries"]) == set(bench.ESCAPES)
    assert out["contained"], out
    assert out["accepted_connections"] == 0
    assert "all contained" in bench.escape_line(out)


def test_gateway_seconds_reads_the_gateways_metrics(monkeypatch: pytest.MonkeyPatch) -> None:
    text = ("# TYPE nextstate_request_seconds histogram\n"
            'nextstate_request_seconds_count{endpoint="openai-chat",status="200"} 4\n'
            'nextstate_request_seconds_sum{endpoint="openai-chat",status="200"} 2.5\n'
            'nextstate_request_seconds_count{endpoint="openai-chat",status="400"} 1\n'
            'nextstate_request_seconds_sum{endpoint="openai-chat",status="400"} 0.5\n'
            "# TYPE nextstate_upstream_seconds histogram\n"
            'nextstate_upstream_seconds_count{model="policy"} 5\n'
            'nextstate_upstream_seconds_sum{model="policy"} 2.75\n')

    class Reply:
        def __init__(self, text: str) -> None:
            self.text = text

    monkeypatch.setattr(bench.httpx, "get", lambda url, timeout: Reply(text))
    assert bench.gateway_seconds("http://gw") == (5.0, 3.0, 2.75)


def test_suite_value_per_suite_and_default() -> None:
    assert bench.suite_value(0.6, "terminal") == 0.6
    assert bench.suite_value("terminal=0.6,1.0", "terminal") == 0.6
    assert bench.suite_value("terminal=0.6,1.0", "toolcall") == 1.0
    with pytest.raises(ValueError, match="toolcall"):
        bench.suite_value("terminal=0.6", "toolcall")


@pytest.mark.parametrize("scope", ["iteration", "step"])
def test_training_takes_the_iterations_turns_as_one_batch(scope: str, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """--advantage-scope iteration (the presets'): the iteration's turns leased at once, one optimizer
    step per --batch-size of them; the objective and trainer get --integrated-norm, --vote-weight,
    --kl-coef, --warmup-steps, --max-grad-norm and --trainer-dtype (dense, the presets', only with the
    iteration's scope)."""
    import trainer.offline

    seen: dict[str, Any] = {}
    monkeypatch.setattr(trainer.offline, "train_offline", lambda engine, **kw: seen.update(kw))
    args = argparse.Namespace(upstream="http://127.0.0.1:9/v1", teacher=None, model_dir=str(tmp_path), lr=1e-4,
                              micro_batch_size=4, batch_size=64, **bench.TRAINING | {
                                  "advantage_scope": scope, "kl_coef": 0.05, "warmup_steps": 3, "max_grad_norm": 1.0,
                                  "trainer_dtype": "fp32" if scope == "iteration" else "bf16",
                                  "integrated_norm": "dense" if scope == "iteration" else "group", "vote_weight": 0.5})
    bench.Job(args, tmp_path, "terminal", "outcome", seed=0).train(bench.now_naive())
    assert (seen["batch_size"], seen["mini_batch_size"]) == ((bench.ITERATION_TURNS, 64) if scope == "iteration"
                                                             else (64, None))
    objective = seen["objective"]
    assert (objective.integrated_norm, objective.vote_weight, objective.kl_coef) == (
        "dense" if scope == "iteration" else "group", 0.5, 0.05)
    assert (seen["local"].warmup_steps, seen["local"].max_grad_norm) == (3, 1.0)
    assert seen["local"].bf16 is (scope != "iteration")
    assert all((p["advantage_scope"], p["integrated_norm"], p["vote_weight"]) == ("iteration", "dense", 0.25)
               for p in bench.PRESETS.values())


def test_examples_show_each_kinds_first_held_out_task_as_the_pool_holds_it(tmp_path: Path) -> None:
    """What a drop in one task kind looks like: per kind, its first held-out task's replies, read back
    from the pool the gateway wrote (a tool call's arguments, else the text), each cut to its length."""
    from datetime import datetime, timedelta, timezone

    from sqlalchemy.orm import Session as OrmSession

    from datapool.db import make_engine, upgrade
    from datapool.sessions import Stitcher
    from rollout.runner import RolloutRecord
    from tests.support.records import turn_record

    pool = f"sqlite:///{tmp_path / 'pool.db'}"
    upgrade(pool)
    t0 = datetime.now(timezone.utc)
    call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "run", "arguments": '{"command": "sort a.txt > b.txt"}'}}]}
    turns = [("s-sort-1", call), ("s-sort-1", "done " * 80), ("s-sort-2", "never shown"), ("s-copy-1", "cp a b")]
    engine = make_engine(pool)
    with OrmSession(engine) as db:
        Stitcher(db).write([turn_record([{"role": "user", "content": f"task {i}"}], reply, session_id=sid,
                                        session_source="header", at=t0 + timedelta(seconds=i))
                            for i, (sid, reply) in enumerate(turns)])
        db.commit()
    records = [RolloutRecord("s-sort-2", "t-sort-2", 0, "ok", 1.0, "v", None),
               RolloutRecord("s-sort-1", "t-sort-1", 0, "ok", 0.0, "v", None),
               RolloutRecord("s-copy-1", "t-copy-1", 0, "ok", 1.0, "v", None)]
    kinds = {"t-sort-1": ("sort", 1), "t-sort-2": ("sort", 1), "t-copy-1": ("copy", 2)}
    got = bench.examples(engine, records, kinds, chars=40)
    engine.dispose()
    assert got == {
        "copy/L2": {"task": "t-copy-1", "passed": True, "replies": ["cp a b"]},
        "sort/L1": {"task": "t-sort-1", "passed": False,
                    "replies": ['{"command": "sort a.txt > b.txt"}', ("done " * 8)]},
    }


def test_the_kind_table_shows_a_kind_lost_and_another_learned() -> None:
    def row(seed: int, copy: list[float], sort: list[float]) -> dict[str, Any]:
        return {"suite": "terminal", "arm": "outcome", "seed": seed, "iterations": [
            {"heldout": {"by_kind": {"copy/L1": c, "sort/L1": s}}} for c, s in zip(copy, sort)]}

    base = {"terminal": {"by_kind": {"copy/L1": 0.0, "sort/L1": 1.0}}}
    # seed 1 stopped after one iteration (a deadline): its later points are left out of the mean
    text = bench.kind_table([row(0, [0.0, 1.0], [0.0, 0.5]), row(1, [0.5], [0.0])], base)
    lines = text.splitlines()
    assert lines[0] == "| suite | arm | kind | base | 1 | 2 |"
    assert "| terminal | outcome | copy/L1 | 0.00 | 0.25 | 1.00 |" in lines
    assert "| terminal | outcome | sort/L1 | 1.00 | 0.00 | 0.50 |" in lines


def _run(seeds: range, curves: dict[str, list[float]], **config: Any) -> dict[str, Any]:
    """A results JSON as the benchmark writes it: one row per arm and seed (the seed added to the
    last point, so that the merged means show which rows were taken)."""
    base_config = {"preset": "gpu", "suites": "terminal", "arms": "outcome,integrated", "iterations": 2, "tasks": 16,
                   "n": 8, "heldout": 64, "temperature": "terminal=0.3", "kl_coef": 0.05, "trainer_dtype": "fp32",
                   "server_dtype": "float16", "minutes": 10.0, "failed": [], "command": f"run seeds {seeds}",
                   "machine": "x86_64, 32 CPUs, NVIDIA H200"}
    rows = [_row("terminal", arm, s, [*curve[:-1], curve[-1] + s / 100], [0, 10, 20])
            for arm, curve in curves.items() for s in seeds]
    return {"config": base_config | config, "base": {"terminal": {"pass_at_1": curves["outcome"][0]}},
            "results": rows, "escapes": {"tries": {"fork_bomb": [{"contained": True, "violation": "processes"}]},
                                         "accepted_connections": 0, "contained": True}}


def test_merge_takes_the_seeds_of_runs_made_apart_and_keeps_each_runs_command(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeds 0-2 of one session and 3-5 of another, one configuration: one report of 6 seeds per
    arm (the table's seed count and mean read all six), each run's command, machine and seeds kept."""
    curves = {"outcome": [0.2, 0.3, 0.4], "integrated": [0.2, 0.3, 0.5]}
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_run(range(3), curves)))
    b.write_text(json.dumps(_run(range(3, 6), curves, machine="x86_64, 16 CPUs, NVIDIA H200")))
    monkeypatch.setattr("sys.argv", ["run", "--merge", str(a), str(b), "--tag", "ab", "--out", str(tmp_path)])
    bench.main()
    merged = json.loads((tmp_path / "ab.json").read_text())
    assert sorted((r["arm"], r["seed"]) for r in merged["results"]) == sorted(
        (arm, s) for arm in curves for s in range(6))
    assert [r["seeds"] for r in merged["config"]["runs"]] == [[0, 1, 2], [3, 4, 5]]
    assert [r["command"] for r in merged["config"]["runs"]] == ["run seeds range(0, 3)", "run seeds range(3, 6)"]
    assert merged["config"]["runs"][1]["machine"] == "x86_64, 16 CPUs, NVIDIA H200"
    assert merged["config"]["minutes"] == 20.0 and merged["config"]["seeds"] == 6
    assert len(merged["escapes"]["tries"]["fork_bomb"]) == 2 and merged["escapes"]["contained"]
    # integrated's last point: 0.5 + mean(0..5)/100 = 0.525 over six seeds
    assert "| terminal | integrated | 6 | 2 | 0.525 ±" in (tmp_path / "ab.md").read_text()


@pytest.mark.parametrize("change", [{"server_dtype": "bfloat16"}, {"kl_coef": 0.0}, {"server_dtype": None},
                                    {"iterations": 3}, {"task_sampling": "learnable"}])
def test_merge_refuses_another_configuration(change: dict[str, Any], tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    curves = {"outcome": [0.2, 0.3, 0.4], "integrated": [0.2, 0.3, 0.5]}
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_run(range(3), curves)))
    b.write_text(json.dumps(_run(range(3, 6), curves, **change)))
    monkeypatch.setattr("sys.argv", ["run", "--merge", str(a), str(b), "--tag", "ab", "--out", str(tmp_path)])
    with pytest.raises(SystemExit) as e:
        bench.main()
    key = next(iter(change))
    assert e.value.code == 2 and f"another configuration than a.json: {key}" in capsys.readouterr().err
    assert not (tmp_path / "ab.json").exists()


def test_merge_counts_a_run_without_task_sampling_as_uniform() -> None:
    """Runs made before --task-sampling was recorded drew their tasks uniformly: they merge with a
    uniform run, not with a learnable one."""
    curves = {"outcome": [0.2, 0.3, 0.4], "integrated": [0.2, 0.3, 0.5]}
    merged = bench.merge_runs([("old", _run(range(3), curves)),
                               ("new", _run(range(3, 6), curves, task_sampling="uniform"))])
    assert len(merged["rows"]) == 12
    with pytest.raises(bench.MergeError, match="task_sampling 'learnable' != 'uniform'"):
        bench.merge_runs([("old", _run(range(3), curves)),
                          ("new", _run(range(3, 6), curves, task_sampling="learnable"))])


def test_merge_refuses_a_seed_run_twice_and_takes_a_whole_row_over_a_partial_one() -> None:
    curves = {"outcome": [0.2, 0.3, 0.4], "integrated": [0.2, 0.3, 0.5]}
    with pytest.raises(bench.MergeError, match="terminal/outcome/0 is in both a and b.*--first-seed"):
        bench.merge_runs([("a", _run(range(3), curves)), ("b", _run(range(3), curves))])
    partial = _run(range(1), curves)
    for row in partial["results"]:
        row["partial"] = True
        row["pass_at_1"] = row["pass_at_1"][:2]
    merged = bench.merge_runs([("p", partial), ("w", _run(range(2), curves))])
    assert all(not r.get("partial") and len(r["pass_at_1"]) == 3 for r in merged["rows"]) and len(merged["rows"]) == 4


def test_learnable_batches_draw_each_iteration_when_it_starts() -> None:
    """--task-sampling learnable: iteration k's tasks follow what iterations 1..k-1 passed."""
    import random

    from rollout.curriculum import Learnability, group_of

    train = [{"id": f"t{i}", "kind": "solved" if i < 30 else "mixed", "level": 1} for i in range(40)]
    curriculum = Learnability()
    batches = bench.LearnableBatches(curriculum, train, 8, 3, random.Random(0))
    assert len(batches) == 3
    with pytest.raises(IndexError, match="after iteration 1"):
        batches[1]
    first = batches[0]
    assert batches[0] is first and len({t["id"] for t in first}) == 8
    curriculum.update(train, [(t["id"], True) for t in train[:30]] * 4
                      + [(t["id"], ok) for t in train[30:] for ok in (True, False)] * 2)
    second = batches[1]
    # 10 of 40 tasks are mixed: a uniform draw of 8 holds 2 of them on average
    assert sum(group_of(t) == "mixed/1" for t in second) >= 6
    assert len(list(batches)) == 3


def test_the_final_table_compares_the_arms_over_every_final_task(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """--final-heldout: a run without it (seeds 0-2) merged with one that has it (seeds 3-5): the curves
    read all six seeds, the final table the three that answered all 256 tasks, against the base over
    the same 256, unpaired and paired by seed."""
    curves = {"outcome": [0.2, 0.3, 0.4], "integrated": [0.2, 0.3, 0.5]}
    old, new = _run(range(3), curves), _run(range(3, 6), curves, final_heldout=256)
    finals = {("outcome", 3): 0.30, ("outcome", 4): 0.40, ("outcome", 5): 0.35,
              ("integrated", 3): 0.36, ("integrated", 4): 0.45, ("integrated", 5): 0.39}
    for row in new["results"]:
        row["final_heldout"] = {"tasks": 256, "iteration": 2, "pass_at_1": finals[row["arm"], row["seed"]]}
    new["base"]["terminal"]["final_heldout"] = {"tasks": 256, "pass_at_1": 0.18}
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(old))
    b.write_text(json.dumps(new))
    monkeypatch.setattr("sys.argv", ["run", "--merge", str(a), str(b), "--tag", "ab", "--out", str(tmp_path)])
    bench.main()
    merged = json.loads((tmp_path / "ab.json").read_text())
    assert merged["base"]["terminal"]["final_heldout"]["pass_at_1"] == 0.18  # from the run that measured it
    text = (tmp_path / "ab.md").read_text()
    assert "(base terminal 0.180 over 256)" in text
    assert "| terminal | outcome | 3 | 256 | 2 | 0.350 ± 0.029 | +0.170 | – | – |" in text
    # integrated 0.400 ± 0.026; unpaired 0.05 / sqrt(0.029² + 0.026²) = 1.3 SE; paired: +0.06, +0.05,
    # +0.04, mean 0.05, SE 0.01/sqrt(3) -> 8.7 SE: the seeds' shared spread cancels
    assert ("| terminal | integrated | 3 | 256 | 2 | 0.400 ± 0.026 | +0.220 | +0.050 (+1.3 SE) "
            "| +0.050 (+8.7 SE, 3 seeds) |") in text
    assert "| terminal | integrated | 6 | 2 |" in text  # the 64-task comparison still reads all six seeds
    assert bench.final_table([_row("terminal", "outcome", 0, [0.1, 0.2], [0, 1])], {}) == ""


def test_final_heldout_must_lie_between_heldout_and_the_file(monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture) -> None:
    for n in ("64", "257"):
        monkeypatch.setattr("sys.argv", ["run", "--preset", "gpu", "--suites", "terminal", "--final-heldout", n])
        with pytest.raises(SystemExit) as e:
            bench.main()
        assert e.value.code == 2 and f"between --heldout (64) and terminal's 256 held-out tasks, not {n}" in \
            capsys.readouterr().err
    assert [t["id"] for t in bench.final_extra("terminal", argparse.Namespace(heldout=64, final_heldout=70))] == [
        f"terminal-heldout-{i:04d}" for i in range(64, 70)]
    assert bench.final_extra("terminal", argparse.Namespace(heldout=64, final_heldout=None)) == []
