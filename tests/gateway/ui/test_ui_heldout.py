"""Held-out pass@1 per policy version (issue 30, item 4): counted from the pool's sessions of mode
``eval`` (``datapool.evals.heldout_pass_at_1``) on SQLite and PostgreSQL, for every state the pool
can be in — no eval session, eval sessions without an outcome, several versions and runs, a
session answered by two versions — checked against ``nextstate rollout``'s own report, and the
training page rendering each state."""

from __future__ import annotations

import uuid
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from sqlalchemy import Engine, delete
from sqlalchemy.orm import Session as OrmSession

from datapool import evals
from datapool.models import Session, Turn
from rollout.runner import RolloutRecord, RunSummary
from tests.support.admin_ui import admin_page, cells
from tests.support.ui_seed import _turn

T0 = datetime(2025, 3, 1, 12, 0, tzinfo=UTC)


def add_session(db: OrmSession, *, task: str | None, versions: list[str | None], outcome: float | None = None,
                status: str | None = "done", run: str | None = "r1", mode: str = "eval", at: datetime = T0,
                sid: str | None = None, side: tuple[str, ...] = (), recorded: str | None = None) -> str:
    """A session as ``nextstate rollout`` leaves it: one main turn per entry of *versions* (in
    order, a second apart), side turns of *side* versions, its outcome, and ``metadata.rollout``
    (``status`` None: a session tagged by hand, without rollout metadata)."""
    sid = sid or f"{run or 'hand'}:{task}:{uuid.uuid4().hex[:6]}"
    meta: dict[str, Any] = {}
    if status is not None:
        meta = {"rollout": {"run": run, "task_id": task, "index": 0, "status": status, "policy_version": recorded}}
    db.add(Session(id=sid, source="path", mode=mode, task_id=task, group_id=task, created_at=at, updated_at=at,
                   meta=meta, outcome=outcome, outcome_source="verifier:v" if outcome is not None else None))
    db.flush()
    for i, v in enumerate(versions):
        db.add(_turn(sid, at + timedelta(seconds=i), [{"role": "user", "content": f"task {task} step {i}"}],
                     {"content": "done"}, next_messages=None, version=v))
    for i, v in enumerate(side):
        db.add(_turn(sid, at - timedelta(seconds=1 + i), [{"role": "user", "content": "title?"}],
                     {"content": "t"}, next_messages=None, version=v, turn_type="side"))
    db.flush()
    return sid


def heldout(engine: Engine, **kw: Any) -> evals.HeldOut:
    with OrmSession(engine) as db:
        return evals.heldout_pass_at_1(db, **kw)


def page(database_url: str, tmp_path: Path) -> str:
    # the phrases the tests look for, whatever the template's line breaks
    return " ".join(admin_page(database_url, tmp_path, "/admin/training").split())


def test_no_eval_session(engine: Engine, database_url: str, tmp_path: Path) -> None:
    with OrmSession(engine) as db, db.begin():
        # offline rollouts, even passed ones, are training data: not held out
        add_session(db, task="a", versions=["v1"], outcome=1.0, mode="offline")
        add_session(db, task="b", versions=["v1"], outcome=0.0, mode="online", status=None)
    h = heldout(engine)
    assert (h.versions, h.runs, h.sessions, h.awaiting, h.mixed, h.cancelled) == ([], [], 0, 0, 0, 0)
    html = page(database_url, tmp_path)
    assert 'data-testid="no-evals"' in html and "No evaluation runs yet" in html
    assert "nextstate rollout --eval ...</code>" in html
    assert 'data-testid="heldout-versions"' not in html and 'data-testid="heldout-runs"' not in html


def test_eval_sessions_without_outcome_are_awaiting(engine: Engine, database_url: str, tmp_path: Path) -> None:
    with OrmSession(engine) as db, db.begin():
        add_session(db, task="a", versions=["v1", "v1"], status="running")  # the agent is still at it
        add_session(db, task="b", versions=[], status="running")  # not answered yet: no version
        add_session(db, task="c", versions=["v1"], status=None, run=None)  # tagged eval by hand, no outcome posted
        # an attempt the rollout cancelled and ran again: neither awaiting nor failed
        add_session(db, task="a", versions=["v1"], status="cancelled")
    h = heldout(engine)
    assert (h.sessions, h.awaiting, h.cancelled, h.mixed) == (4, 3, 1, 0)
    assert [(v.version, v.rollouts, v.passed, v.tasks, v.pass_at_1, v.awaiting, v.runs) for v in h.versions] == [
        ("v1", 0, 0, 0, None, 2, 1), (None, 0, 0, 0, None, 1, 1)]
    assert [(r.run, r.version, r.awaiting, r.pass_at_1) for r in h.runs] == [("r1", "v1", 1, None),
                                                                             ("r1", None, 1, None)]
    html = page(database_url, tmp_path)
    assert 'data-testid="no-evals"' not in html
    assert 'data-testid="no-outcomes"' in html and "3 awaiting the verifier" in html
    assert "1 cancelled attempt (run again) left out" in html
    assert cells(html, "heldout-versions") == [["v1", "–", "0 / 0", "0", "1", "2", "2025-03-01 12:00:00"],
                                               ["(no version)", "–", "0 / 0", "0", "1", "1", "2025-03-01 12:00:00"]]


def test_several_versions_and_runs(engine: Engine, database_url: str, tmp_path: Path) -> None:
    with OrmSession(engine) as db, db.begin():
        # the base model on run base-tool: 1 of 4 tasks
        for task, out in zip("abcd", [1.0, 0.0, 0.0, 0.5]):
            add_session(db, task=task, versions=["base"], outcome=out, run="base-tool")
        # v1 on run i1-eval, an hour later: a and b pass; c timed out (done, no outcome: not passed);
        # d twice (n = 2), one of them passed: pass@1 = (1 + 1 + 0 + 1/2) / 4
        later = T0 + timedelta(hours=1)
        for task, out in [("a", 1.0), ("b", 1.0), ("d", 1.0), ("d", 0.0)]:
            add_session(db, task=task, versions=["v1", "v1"], outcome=out, run="i1-eval", at=later)
        add_session(db, task="c", versions=["v1"], outcome=None, run="i1-eval", at=later)
        # v1 again on another suite's run, two hours in: 2 of 2
        for task in ("x", "y"):
            add_session(db, task=task, versions=["v1"], outcome=1.0, run="i1-eval-term", at=T0 + timedelta(hours=2))
    h = heldout(engine)
    assert (h.sessions, h.awaiting, h.mixed, h.cancelled, h.runs_total) == (11, 0, 0, 0, 3)
    base, v1 = h.versions
    assert (base.version, base.rollouts, base.passed, base.tasks, base.runs) == ("base", 4, 1, 4, 1)
    assert base.pass_at_1 == pytest.approx(0.25)
    assert base.stderr == pytest.approx(0.25)  # sd of [1, 0, 0, 0] / sqrt(4)
    assert (v1.version, v1.rollouts, v1.passed, v1.tasks, v1.runs) == ("v1", 7, 5, 6, 2)
    assert v1.pass_at_1 == pytest.approx((1 + 1 + 0 + 0.5 + 1 + 1) / 6)
    assert [(r.run, r.version, r.rollouts, r.passed, r.tasks) for r in h.runs] == [
        ("i1-eval-term", "v1", 2, 2, 2), ("i1-eval", "v1", 5, 3, 4), ("base-tool", "base", 4, 1, 4)]
    assert h.runs[1].pass_at_1 == pytest.approx(2.5 / 4) and h.runs[0].stderr == 0.0
    # a lower threshold passes the 0.5 of task d on the base model
    assert heldout(engine, pass_threshold=0.5).versions[0].passed == 2
    assert [r.run for r in heldout(engine, runs_limit=2).runs] == ["i1-eval-term", "i1-eval"]

    html = page(database_url, tmp_path)
    assert 'data-testid="no-evals"' not in html and 'data-testid="no-outcomes"' not in html
    assert 'data-testid="heldout-mixed"' not in html
    assert [r[:6] for r in cells(html, "heldout-versions")] == [
        ["base", "0.250 ± 0.250", "1 / 4", "4", "1", "0"], ["v1", "0.750 ± 0.171", "5 / 7", "6", "2", "0"]]
    assert 'href="/admin/sessions?mode=eval&amp;policy_version=v1"' in html
    assert [r[:6] for r in cells(html, "heldout-runs")] == [
        ["i1-eval-term", "v1", "1.000 ± 0.000", "2 / 2", "2", "0"], ["i1-eval", "v1", "0.625 ± 0.239", "3 / 5", "4", "0"],
        ["base-tool", "base", "0.250 ± 0.250", "1 / 4", "4", "0"]]
    assert "at least 1;" in html


def test_a_session_answered_by_two_versions_counts_once(engine: Engine, database_url: str, tmp_path: Path) -> None:
    """A session counts once, under the version of most of its main turns (the one that answered
    first on a tie), as the rollout records it; side turns do not count."""
    with OrmSession(engine) as db, db.begin():
        # published mid-episode: two turns by v1, then one by v2 -> v1, failed
        add_session(db, task="a", versions=["v1", "v1", "v2"], outcome=0.0, recorded="v1")
        # one each, v2 first -> v2, passed
        add_session(db, task="b", versions=["v2", "v1"], outcome=1.0, recorded="v2")
        # v1 on every main turn; its title (side) turns by v2 do not make it mixed
        add_session(db, task="c", versions=["v1"], outcome=1.0, side=("v2", "v2"))
        # no turn names a version (the upstream served none): the version the rollout recorded
        add_session(db, task="d", versions=[None], outcome=1.0, recorded="v2")
    h = heldout(engine)
    assert h.mixed == 2 and h.sessions == 4
    got = {v.version: (v.rollouts, v.passed, v.tasks, v.mixed, v.pass_at_1) for v in h.versions}
    assert got == {"v1": (2, 1, 2, 1, 0.5), "v2": (2, 2, 2, 1, 1.0)}
    html = page(database_url, tmp_path)
    assert 'data-testid="heldout-mixed"' in html and "2 sessions answered by more than one version" in html
    rows = {r[0]: r for r in cells(html, "heldout-versions")}
    assert rows["v1"][1:4] == ["0.500 ± 0.500", "1 / 2", "2"] and rows["v1"][5] == "0 (1 mixed)"
    assert rows["v2"][1:4] == ["1.000 ± 0.000", "2 / 2", "2"]


# -- the same numbers as `nextstate rollout --eval`'s report ---------------------------------------

sessions_st = st.lists(st.tuples(
    st.sampled_from(["t1", "t2", "t3"]),  # task
    st.lists(st.sampled_from(["v1", "v2", "v3"]), min_size=1, max_size=4),  # versions of its main turns
    st.one_of(st.none(), st.sampled_from([0.0, 0.5, 1.0])),  # outcome (None: timed out)
), min_size=1, max_size=12)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rollouts=sessions_st, threshold=st.sampled_from([0.5, 1.0]))
def test_pool_pass_at_1_is_the_rollout_report(sqlite_engine: Engine, rollouts: list[tuple[str, list[str], float | None]],
                                              threshold: float) -> None:
    """For finished rollouts, the page's numbers per version are those ``RunSummary.report()``
    prints, the version picked as the runner picks it (``Counter.most_common`` over the main
    turns in order)."""
    with OrmSession(sqlite_engine) as db, db.begin():
        db.execute(delete(Turn))
        db.execute(delete(Session))
        records = []
        for i, (task, versions, outcome) in enumerate(rollouts):
            sid = add_session(db, task=task, versions=versions, outcome=outcome, sid=f"r1:{task}:{i}",
                              at=T0 + timedelta(minutes=i))
            version = Counter(versions).most_common(1)[0][0]
            records.append(RolloutRecord(sid, task, i, "ok" if outcome is not None else "timed_out", outcome,
                                         version, None))
    report = RunSummary("r1", "eval", records, pass_threshold=threshold).report()["by_version"]
    h = heldout(sqlite_engine, pass_threshold=threshold)
    got = {v.version: (v.rollouts, v.tasks, v.pass_at_1) for v in h.versions}
    assert got.keys() == report.keys()
    for version, r in report.items():
        assert got[version][:2] == (r["rollouts"], r["tasks"])
        assert got[version][2] == pytest.approx(r["pass@1"])
    assert h.mixed == sum(len(set(v)) > 1 for _, v, _ in rollouts)
