"""What the training page shows: versions and their events, runs, and curves over time."""

from __future__ import annotations

import statistics
from datetime import timedelta
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session as OrmSession

from datapool.db import utcnow
from datapool.models import Judgement, PolicyEvent, PolicyVersion, TrainingLease, TrainingRun, TrainingStep, Turn


def versions(db: OrmSession) -> list[dict[str, Any]]:
    """Every version, newest first, with its parent's name and its events (newest first);
    ``evals`` are the metrics of its ``eval`` events."""
    rows = list(db.scalars(select(PolicyVersion).order_by(PolicyVersion.created_at.desc(), PolicyVersion.id.desc())))
    names = {r.id: r.name for r in rows}
    events: dict[int, list[PolicyEvent]] = {}
    for e in db.scalars(select(PolicyEvent).order_by(PolicyEvent.created_at.desc(), PolicyEvent.id.desc())):
        events.setdefault(e.version_id or 0, []).append(e)
    out = []
    for r in rows:
        evs = [event_dict(e, names) for e in events.get(r.id, [])]
        out.append({"id": r.id, "name": r.name, "kind": r.kind, "status": r.status, "base_model": r.base_model,
                    "path": r.path, "parent": names.get(r.parent_id) if r.parent_id else None,
                    "created_at": r.created_at, "stats": dict(r.stats or {}), "events": evs,
                    "evals": [e["metrics"] for e in evs if e["action"] == "eval"]})
    return out


def event_dict(e: PolicyEvent, names: dict[int, str]) -> dict[str, Any]:
    return {"id": e.id, "version": names.get(e.version_id) if e.version_id else None, "action": e.action,
            "actor": e.actor, "reason": e.reason, "metrics": dict(e.metrics or {}), "created_at": e.created_at}


def recent_events(db: OrmSession, limit: int = 30) -> list[dict[str, Any]]:
    names = dict(db.execute(select(PolicyVersion.id, PolicyVersion.name)).all())
    rows = db.scalars(select(PolicyEvent).order_by(PolicyEvent.created_at.desc(), PolicyEvent.id.desc()).limit(limit))
    return [event_dict(e, names) for e in rows]


def runs(db: OrmSession, limit: int = 20) -> list[dict[str, Any]]:
    """Recent training runs, running ones first, with their step count and last metrics."""
    rows = list(db.scalars(select(TrainingRun).order_by((TrainingRun.status == "running").desc(),
                                                         TrainingRun.created_at.desc()).limit(limit)))
    out = []
    for r in rows:
        n, last_at = db.execute(select(func.count(), func.max(TrainingStep.created_at))
                                .where(TrainingStep.run_id == r.id)).one()
        last = db.scalars(select(TrainingStep).where(TrainingStep.run_id == r.id)
                          .order_by(TrainingStep.step.desc()).limit(1)).first()
        leased = db.scalar(select(func.count()).select_from(TrainingLease).where(
            TrainingLease.run_id == r.id, TrainingLease.acked_at.is_(None))) or 0
        metrics = {k: v for k, v in (last.metrics if last else {}).items() if isinstance(v, (int, float))}
        out.append({"id": r.id, "objective": r.objective, "backend": r.backend, "status": r.status,
                    "base_version": r.base_version, "produced_version": r.produced_version,
                    "created_at": r.created_at, "finished_at": r.finished_at, "steps": int(n or 0),
                    "last_step_at": last_at, "in_flight": int(leased), "last_metrics": metrics})
    return out


def _metric(m: dict[str, Any], *keys: str) -> float | None:
    for k in keys:
        v = m.get(k)
        if isinstance(v, (int, float)):
            return float(v)
    return None


def curves(db: OrmSession, *, steps: int = 2000, days: float = 30.0) -> dict[str, dict[str, list[tuple[float, float]]]]:
    """Series for the charts, x in Unix seconds: loss and KL per optimizer step (one series per
    run objective), mean reward of judged turns per hour, and learning latency — how long after
    its capture a turn was trained on (median per step, seconds)."""
    rows = list(db.execute(select(TrainingStep.run_id, TrainingStep.step, TrainingStep.metrics,
                                  TrainingStep.created_at, TrainingRun.objective)
                           .join(TrainingRun, TrainingRun.id == TrainingStep.run_id)
                           .order_by(TrainingStep.created_at.desc()).limit(steps)).all())
    rows.reverse()
    loss: dict[str, list[tuple[float, float]]] = {}
    kl: dict[str, list[tuple[float, float]]] = {}
    adv: dict[str, list[tuple[float, float]]] = {}
    for run_id, step, metrics, at, objective in rows:
        x = at.timestamp()
        m = metrics or {}
        for target, keys in ((loss, ("loss", "pg_loss")), (kl, ("kl", "kl_loss", "ppo_kl")),
                             (adv, ("advantage_mean",))):
            v = _metric(m, *keys)
            if v is not None:
                target.setdefault(objective, []).append((x, v))
    since = utcnow() - timedelta(days=days)
    reward: dict[int, list[float]] = {}
    for r, at in db.execute(select(Judgement.reward, Turn.created_at).join(Turn, Turn.id == Judgement.turn_id)
                            .where(Judgement.reward.is_not(None), Turn.created_at >= since)):
        hour = int(at.timestamp() // 3600 * 3600)
        reward.setdefault(hour, []).append(float(r))
    latency: dict[tuple[str, int], list[float]] = {}
    step_at = {(r[0], r[1]): r[3].timestamp() for r in rows}
    if step_at:
        for run_id, step, acked, created in db.execute(
                select(TrainingLease.run_id, TrainingLease.step, TrainingLease.acked_at, Turn.created_at)
                .join(Turn, Turn.id == TrainingLease.turn_id)
                .where(TrainingLease.acked_at.is_not(None), TrainingLease.acked_at >= since)):
            latency.setdefault((run_id, step), []).append((acked - created).total_seconds())
    lat = sorted((step_at.get(k, max(v)), statistics.median(v)) for k, v in latency.items() if k in step_at)
    return {
        "loss": loss, "kl": kl, "advantage": adv,
        "reward": {"mean reward": sorted((float(h), sum(v) / len(v)) for h, v in reward.items())},
        "latency": {"median s": lat},
    }
