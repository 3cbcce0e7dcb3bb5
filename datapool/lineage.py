"""Lineage from data to policy versions: which versions learned from which turns.

Every turn a training step used is acked on its lease with the step (``training_leases``,
datapool.leases). An online run registers a version per round with ``stats.run_id`` and
``stats.step``: that version learned every turn its run acked up to that step. An offline run
names what it produced in ``training_runs.produced_version``: that version learned every turn the
run acked. A version trained from another (``parent_id``) carries what its parent learned, so
every descendant of such a version learned from the turns too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session as OrmSession

from datapool.db import chunked
from datapool.models import PolicyVersion, TrainingLease, TrainingRun, Turn
from base.vocab import TurnKind


def versions_trained_on(db: OrmSession, turn_ids: Sequence[str]) -> list[dict[str, Any]]:
    """The versions that learned from any of *turn_ids*, oldest first: ``name``, ``status`` and
    ``learned``: ``"trained"`` (a step used one of the turns) or ``"inherited"`` (from its
    ``via`` ancestor)."""
    first_step: dict[str, int | None] = {}  # run -> the earliest step that used one of the turns
    for chunk in chunked(list(turn_ids)):
        for run_id, step in db.execute(
                select(TrainingLease.run_id, func.min(TrainingLease.step))
                .where(TrainingLease.turn_id.in_(chunk), TrainingLease.acked_at.is_not(None))
                .group_by(TrainingLease.run_id)):
            known = first_step.get(run_id)
            first_step[run_id] = step if known is None or (step is not None and step < known) else known
    if not first_step:
        return []
    versions = list(db.scalars(select(PolicyVersion).order_by(PolicyVersion.created_at, PolicyVersion.id)))
    produced = {r.produced_version for r in db.scalars(select(TrainingRun).where(TrainingRun.id.in_(first_step)))
                if r.produced_version}
    trained: set[int] = set()
    for v in versions:
        stats = v.stats or {}
        run = stats.get("run_id")
        if v.name in produced:
            trained.add(v.id)
        elif run in first_step:
            step, first = stats.get("step"), first_step[run]
            if step is None or first is None or int(step) >= first:
                trained.add(v.id)
    via: dict[int, int] = {}  # descendant -> the trained ancestor it inherits from
    for v in versions:  # oldest first: a parent is seen before its children
        if v.id not in trained and v.parent_id is not None:
            if v.parent_id in trained:
                via[v.id] = v.parent_id
            elif v.parent_id in via:
                via[v.id] = via[v.parent_id]
    names = {v.id: v.name for v in versions}
    out = []
    for v in versions:
        if v.id in trained:
            out.append({"name": v.name, "status": v.status, "learned": "trained"})
        elif v.id in via:
            out.append({"name": v.name, "status": v.status, "learned": "inherited", "via": names[via[v.id]]})
    return out


def session_lineage(db: OrmSession, session_id: str) -> dict[str, Any]:
    """A session's turns and the versions that learned from them: ``turns`` counts its own
    turns, ``siblings`` its shadow siblings (``datapool.siblings``); both are looked up."""
    rows = db.execute(select(Turn.id, Turn.turn_type).where(Turn.session_id == session_id)).all()
    turns = [tid for tid, _ in rows]
    siblings = sum(1 for _, kind in rows if kind == TurnKind.SIBLING)
    return {"session_id": session_id, "turns": len(turns) - siblings, "siblings": siblings,
            "versions": versions_trained_on(db, turns)}
