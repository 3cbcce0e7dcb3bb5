"""The judges page (issue #34): agreement of judge votes with people's labels per judge and
prompt version, the hint gate's acceptance rate and the effect of both on training, counted
from the pool (``datapool.reliability``) and rendered for every state the pool can be in: no
judgements, judgements without labels, agreement and disagreement."""

from __future__ import annotations

import re
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings, strategies as st
from sqlalchemy import Engine
from sqlalchemy.orm import Session as OrmSession

from datapool import labels, reliability
from datapool.db import make_engine
from datapool.models import Judgement, Session, TrainingLease, TrainingRun, Turn, Vote
from tests.support.admin_ui import admin_page, cells
from tests.support.ui_seed import _turn

NOW = datetime.now(UTC).replace(microsecond=0)


def add_turn(db: OrmSession, votes: list[int | None], *, judge: str = "judge-a", version: str | None = "v1",
             hint: str | None = None, hint_source: str | None = None, vote_hint: str | None = None,
             teacher: bool = False, trained_by: str | None = None) -> str:
    """One judged turn in a session of its own: *votes* of *judge*, the judgement as the scorer
    would fold them (majority, the hint it kept), optionally leased and acked by run *trained_by*."""
    sid = f"s-{uuid.uuid4().hex[:8]}"
    db.add(Session(id=sid, source="header", mode="online", created_at=NOW, updated_at=NOW))
    t = _turn(sid, NOW, [{"role": "user", "content": "Why is the sky blue?"}], {"content": "Rayleigh scattering."},
              next_messages=[{"role": "user", "content": "Too long."}])
    db.add(t)
    db.flush()
    for i, v in enumerate(votes):
        db.add(Vote(turn_id=t.id, kind="prm", dedupe_key=f"prm:{judge}:{version}:{i}", judge=judge,
                    prompt_version=version, vote_index=i, value=v, hint=vote_hint))
    m = reliability.majority(votes)
    db.add(Judgement(turn_id=t.id, status="scored" if m is not None else "tie", reward=m, prm_reward=m,
                     hint=hint, hint_source=hint_source or ("prm" if hint else None), judge=judge,
                     prompt_version=version, attempts=1,
                     teacher_logprobs=[-1.0] * len(t.token_ids or []) if teacher else None))
    if trained_by is not None:
        if db.get(TrainingRun, trained_by) is None:
            db.add(TrainingRun(id=trained_by, objective="combined", backend="local", status="done"))
            db.flush()
        db.add(TrainingLease(run_id=trained_by, turn_id=t.id, expires_at=NOW + timedelta(minutes=10),
                             acked_at=NOW, step=1))
    db.flush()
    return t.id


def thumb(db: OrmSession, turn_id: str, value: Any, kind: str = "thumb") -> None:
    labels.add_label(db, kind=kind, value=value, author="alice", turn_id=turn_id)


def page(database_url: str, tmp_path: Path) -> str:
    return admin_page(database_url, tmp_path, "/admin/judges")


def test_empty_pool(database_url: str, tmp_path: Path) -> None:
    html = page(database_url, tmp_path)
    assert 'data-testid="no-judgements"' in html and "No judge has voted yet" in html
    assert 'data-testid="no-hints"' in html and 'data-testid="no-training"' in html
    assert 'data-testid="agreement"' not in html


def test_judgements_without_labels_say_agreement_is_not_measured(engine: Engine, database_url: str,
                                                                 tmp_path: Path) -> None:
    with OrmSession(engine) as db, db.begin():
        add_turn(db, [1, 1, -1])
        add_turn(db, [-1, -1, -1], judge="judge-b", version=None)
        # a session-wide thumb is not a verdict on the turn
        tid = add_turn(db, [1])
        labels.add_label(db, kind="thumb", value=-1, author="alice", session_id=db.get(Turn, tid).session_id)
    html = page(database_url, tmp_path)
    assert 'data-testid="no-labels"' in html and "cannot be measured" in html
    rows = cells(html, "agreement")
    assert [r[:5] for r in rows] == [["judge-a", "v1", "2", "4", "0"], ["judge-b", "none", "1", "3", "0"]]
    assert all("not measured" in r[5] for r in rows)
    assert 'data-testid="disagreements"' not in html


def test_agreement_and_disagreements(engine: Engine, database_url: str, tmp_path: Path) -> None:
    with OrmSession(engine) as db, db.begin():
        a = add_turn(db, [1, 1, -1])  # majority +1, the person says −1: one vote of three agrees
        thumb(db, a, -1)
        b = add_turn(db, [-1, -1, None])  # override −0.5: both parsed votes and the majority agree
        thumb(db, b, -0.5, kind="override")
        c = add_turn(db, [1])  # a rating posted as feedback: +1
        db.add(Vote(turn_id=c, kind="feedback", dedupe_key="feedback:1", judge="user", value=1))
        d = add_turn(db, [1, -1])  # a tie: no majority; its votes still count
        thumb(db, d, 1)
        e = add_turn(db, [1])  # a thumb withdrawn (value null) is no verdict
        thumb(db, e, 1)
        thumb(db, e, None)
        f = add_turn(db, [-1], judge="judge-b")  # the newest thumb is the one in force; the override wins over it
        thumb(db, f, -1)
        thumb(db, f, 1)
        thumb(db, f, 0.0, kind="override")
    with OrmSession(engine) as db:
        people = reliability.verdicts(db)
        assert people == {a: -1, b: -1, c: 1, d: 1, f: 0}
        rows = {r.judge: r for r in reliability.agreement(db)}
    ra = rows["judge-a"]
    assert (ra.turns, ra.votes, ra.labelled_turns, ra.labelled_votes, ra.unparsed_votes) == (5, 10, 4, 9, 1)
    # a: 1 of 3, b: 2 of 2, c: 1 of 1, d: 1 of 2
    assert ra.agreeing_votes == 5 and ra.vote_agreement == pytest.approx(5 / 8)
    assert (ra.majority_turns, ra.agreeing_majorities, ra.disagreeing_turns) == (3, 2, 1)
    assert ra.confusion == {(1, -1): 2, (-1, -1): 3, (1, 1): 2, (-1, 1): 1}
    assert [x[0] for x in ra.disagreements] == [a]
    rb = rows["judge-b"]
    assert (rb.labelled_turns, rb.agreeing_votes, rb.majority_agreement) == (1, 0, 0.0)

    html = page(database_url, tmp_path)
    assert 'data-testid="no-labels"' not in html
    table = {r[0]: r for r in cells(html, "agreement")}
    assert table["judge-a"][4:7] == ["4", "62% (5 of 8; 1 unparsable)", "67% (2 of 3)"]
    assert table["judge-b"][5:7] == ["0% (0 of 1)", "0% (0 of 1)"]
    listed = re.findall(r'data-testid="disagreements">(.*?)</ul>', html, re.S)
    assert len(listed) == 2 and f"#turn-{a}" in listed[0] and "judge +1, person −1" in listed[0]
    assert f"#turn-{f}" in listed[1] and "judge −1, person 0" in listed[1]


def test_hint_gate_acceptance(engine: Engine, database_url: str, tmp_path: Path) -> None:
    with OrmSession(engine) as db, db.begin():
        add_turn(db, [-1, -1, 1], hint="keep it under 25 words", vote_hint="keep it under 25 words")  # kept
        add_turn(db, [-1, -1, 1], vote_hint="shine the carpet")  # dropped by the gate
        add_turn(db, [1, -1], vote_hint="a hint in a tie")  # a tie: every hint counts; dropped
        # a person's corrected reply is not gated, whatever the judge said
        add_turn(db, [-1], hint="Blue light scatters most.", hint_source="label", vote_hint="shorter")
        # no vote of the judge gave a hint
        add_turn(db, [-1, -1])
        add_turn(db, [1], judge="judge-b", hint="be brief", vote_hint="be brief")
    with OrmSession(engine) as db:
        gate = {g.judge: g for g in reliability.hint_gate(db)}
    assert (gate["judge-a"].seen, gate["judge-a"].kept) == (3, 1)
    assert gate["judge-a"].acceptance == pytest.approx(1 / 3)
    assert (gate["judge-b"].seen, gate["judge-b"].kept) == (1, 1)
    rows = {r[0]: r for r in cells(page(database_url, tmp_path), "gate")}
    assert rows["judge-a"][2:] == ["3", "1", "2", "33%"]
    assert rows["judge-b"][2:] == ["1", "1", "0", "100%"]


def test_effect_on_training(engine: Engine, database_url: str, tmp_path: Path) -> None:
    with OrmSession(engine) as db, db.begin():
        wrong = add_turn(db, [1, 1], trained_by="run-1")  # trained on +1; the person says −1
        thumb(db, wrong, -1)
        fixed = add_turn(db, [1, 1], trained_by="run-1")  # the person's override was trained instead
        thumb(db, fixed, -1.0, kind="override")
        right = add_turn(db, [-1], trained_by="run-1")
        thumb(db, right, -1)
        add_turn(db, [-1, -1], hint="shorter", vote_hint="shorter", teacher=True, trained_by="run-1")
        add_turn(db, [-1, -1], hint="Rayleigh.", hint_source="label", teacher=True, trained_by="run-2")
        add_turn(db, [-1, -1], vote_hint="polish the carpet", trained_by="run-2")  # dropped by the gate
        untrained = add_turn(db, [1, 1])  # leased but never acked: not trained
        db.add(TrainingLease(run_id="run-1", turn_id=untrained, expires_at=NOW))
        thumb(db, untrained, -1)
    with OrmSession(engine) as db:
        (effect,) = reliability.training_effect(db)
    assert (effect.trained, effect.labelled, effect.against_person, effect.corrected) == (6, 3, 1, 1)
    assert (effect.opd_judge_hint, effect.opd_person_hint, effect.gate_dropped) == (1, 1, 1)
    (row,) = cells(page(database_url, tmp_path), "training")
    assert row[2:] == ["6", "3", "1 (33%)", "1", "1", "1", "1"]


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.lists(st.sampled_from([1, 0, -1, None]), min_size=1, max_size=4),
                          st.sampled_from([None, 1, -1, 0.5, -0.25, 0.0])), min_size=1, max_size=6))
def test_agreement_counts_any_votes_and_labels(sqlite_url_for_hypothesis: str, turns: list[Any]) -> None:
    """Any mix of votes and verdicts: agreeing votes are those equal to the verdict's sign;
    majorities as the scorer's tally makes them."""
    engine = make_engine(sqlite_url_for_hypothesis)
    judge = f"judge-{uuid.uuid4().hex[:8]}"  # the examples share one pool: each its own judge
    try:
        with OrmSession(engine) as db, db.begin():
            for votes, verdict in turns:
                tid = add_turn(db, votes, judge=judge)
                if verdict is not None:
                    thumb(db, tid, verdict, kind="override")
        with OrmSession(engine) as db:
            (row,) = [r for r in reliability.agreement(db) if r.judge == judge]
        labelled = [(v, reliability.sign(p)) for v, p in turns if p is not None]
        assert row.labelled_turns == len(labelled)
        assert row.agreeing_votes == sum(x == p for v, p in labelled for x in v if x is not None)
        assert row.unparsed_votes == sum(x is None for v, _ in labelled for x in v)
        majorities = [(reliability.majority(v), p) for v, p in labelled]
        assert row.majority_turns == sum(m is not None for m, _ in majorities)
        assert row.agreeing_majorities == sum(m == p for m, p in majorities if m is not None)
    finally:
        engine.dispose()


@pytest.fixture(scope="module")
def sqlite_url_for_hypothesis(tmp_path_factory: pytest.TempPathFactory) -> str:
    from datapool.db import upgrade

    url = f"sqlite:///{tmp_path_factory.mktemp('judges') / 'pool.db'}"
    upgrade(url)
    return url
