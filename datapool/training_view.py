"""What the training pages show: versions and their events, runs and their steps, curves by
step (one series per run), reward and eval scores by policy version, and two versions side by
side on the eval gate's held-out prompts."""

from __future__ import annotations

import math
import statistics
from datetime import timedelta
from typing import Any

from sqlalchemy import BigInteger, case, cast, func, or_, select
from sqlalchemy.orm import Session as OrmSession

from datapool import evals
from datapool.db import utcnow
from datapool.models import (Judgement, PolicyEvent, PolicyVersion, TrainingLease, TrainingRun, TrainingStep, Turn,
                             Vote)
from base.vocab import PolicyAction, VoteKind


def versions(db: OrmSession) -> list[dict[str, Any]]:
    """Every version, newest first, with its parent's name and its events (newest first);
    ``evals`` are the metrics of its ``eval`` events, ``held_back`` the reason of its newest
    ``refuse`` event (why the gate refused it: its score, or off topic)."""
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
                    "evals": [e["metrics"] for e in evs if e["action"] == "eval"],
                    "serving": _train_serve(evs),
                    "held_back": next((e["reason"] for e in evs if e["action"] == PolicyAction.REFUSE), None)})
    return out


def _train_serve(events: list[dict[str, Any]]) -> dict[str, Any] | None:
    """What trainer.agreement found when the version was published: does the server serve the
    policy that was trained (mean and max |Δ log-prob|, or the error that kept it from checking)."""
    for e in events:  # newest first
        m = e["metrics"]
        if e["action"] == "publish" and ("train_serve_mean_abs" in m or "train_serve_error" in m):
            return {k: m[k] for k in ("train_serve_mean_abs", "train_serve_max_abs", "train_serve_kl",
                                      "train_serve_tokens", "train_serve_error") if k in m}
    return None


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


def number(v: Any) -> float | None:
    """A metric value as a float, non-finite ones included (NaN and inf as a float or as the
    strings JSON writers store them as, ``"NaN"``, ``"Infinity"``); None for anything that is
    not a number."""
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str) and len(v) < 40:
        try:
            return float(v)
        except ValueError:
            return None
    return None


# the charts every run has, and the metric keys each reads (the first one present)
STEP_CHARTS = (("loss", "Loss", ("loss", "pg_loss")), ("kl", "KL to the base policy", ("kl", "drift_kl_k3", "kl_loss", "ppo_kl")),
               ("advantage", "Mean advantage", ("advantage_mean",)))
MAX_RUNS = 8


def run_label(run_id: str, objective: str | None) -> str:
    return f"{run_id[:8]} {objective or ''}".strip()


def _metric(m: dict[str, Any], keys: tuple[str, ...]) -> float | None:
    for k in keys:
        v = number(m.get(k))
        if v is not None:
            return v
    return None


def series_by_run(rows: list[tuple[str, int, dict[str, Any]]], keys: tuple[str, ...],
                  labels: dict[str, str] | None = None) -> dict[str, list[tuple[float, float]]]:
    """(run id, step, metrics) rows as one series per run, x the step, sorted by step: a chart
    draws each series on its own, so no line ever joins two runs."""
    out: dict[str, list[tuple[float, float]]] = {}
    for run_id, step, metrics in rows:
        v = _metric(metrics or {}, keys)
        if v is not None:
            out.setdefault((labels or {}).get(run_id, run_id), []).append((float(step), v))
    for points in out.values():
        points.sort(key=lambda p: p[0])
    return out


def _latency_by_step(db: OrmSession, run_ids: list[str]) -> dict[str, list[tuple[float, float]]]:
    """Per run, the median time from a turn's capture to the step that trained on it (s)."""
    found: dict[tuple[str, int], list[float]] = {}
    if not run_ids:
        return {}
    for run_id, step, acked, created in db.execute(
            select(TrainingLease.run_id, TrainingLease.step, TrainingLease.acked_at, Turn.created_at)
            .join(Turn, Turn.id == TrainingLease.turn_id)
            .where(TrainingLease.run_id.in_(run_ids), TrainingLease.acked_at.is_not(None),
                   TrainingLease.step.is_not(None))):
        found.setdefault((run_id, step), []).append((acked - created).total_seconds())
    out: dict[str, list[tuple[float, float]]] = {}
    for (run_id, step), v in found.items():
        out.setdefault(run_id, []).append((float(step), statistics.median(v)))
    return {k: sorted(v) for k, v in out.items()}


def step_curves(db: OrmSession, run_ids: list[str] | None = None, *, steps: int = 2000) -> dict[str, Any]:
    """Charts by optimizer step with one series per run: *run_ids*, or the newest runs that
    have steps (at most ``MAX_RUNS``), each its newest *steps* steps. ``eval`` is the held-out
    score of each candidate a run published, by the step that made it."""
    if run_ids is None:
        newest = (select(TrainingStep.run_id, func.max(TrainingStep.created_at).label("at"))
                  .group_by(TrainingStep.run_id).order_by(func.max(TrainingStep.created_at).desc()).limit(MAX_RUNS))
        run_ids = [r for r, _ in db.execute(newest)]
    objectives = dict(db.execute(select(TrainingRun.id, TrainingRun.objective).where(TrainingRun.id.in_(run_ids))).all())
    labels = {r: run_label(r, objectives.get(r)) for r in run_ids}
    # on PostgreSQL only the values the charts read, as text, picked in the database: a step's
    # metrics can hold hundreds of turn ids, and decoding JSON per value costs more than the
    # query. (SQLite's JSON functions refuse the NaN its JSON text may hold: read it whole.)
    pg = db.get_bind().dialect.name == "postgresql"
    picked = [func.coalesce(*(TrainingStep.metrics[k].as_string() for k in keys)) if len(keys) > 1
              else TrainingStep.metrics[keys[0]].as_string() for _, _, keys in STEP_CHARTS]
    rows: list[tuple[str, int, dict[str, Any]]] = []
    for run_id in run_ids:
        part = db.execute(select(TrainingStep.run_id, TrainingStep.step, *(picked if pg else [TrainingStep.metrics]))
                          .where(TrainingStep.run_id == run_id).order_by(TrainingStep.step.desc()).limit(steps)).all()
        if pg:
            rows += [(r[0], r[1], {key: v for (key, _, _), v in zip(STEP_CHARTS, r[2:])}) for r in part]
        else:
            rows += [(r[0], r[1], {key: _metric(r[2] or {}, keys) for key, _, keys in STEP_CHARTS}) for r in part]
    out: dict[str, Any] = {key: series_by_run(rows, (key,), labels) for key, _, _ in STEP_CHARTS}
    out["latency"] = {labels[k]: v for k, v in _latency_by_step(db, run_ids).items()}
    out["eval"] = {}
    for v in _published(db, set(run_ids)):
        score = number((v["eval"] or {}).get("score"))
        if score is not None and v["step"] is not None:
            out["eval"].setdefault(labels[v["run_id"]], []).append((float(v["step"]), score))
    for points in out["eval"].values():
        points.sort()
    out["labels"] = labels
    return out


def _latest_evals(db: OrmSession, version_ids: list[int]) -> dict[int, dict[str, Any]]:
    """The newest ``eval`` event's metrics of each version."""
    out: dict[int, dict[str, Any]] = {}
    if not version_ids:
        return out
    for e in db.scalars(select(PolicyEvent).where(PolicyEvent.action == PolicyAction.EVAL,
                                                  PolicyEvent.version_id.in_(version_ids))
                        .order_by(PolicyEvent.created_at.desc(), PolicyEvent.id.desc())):
        out.setdefault(e.version_id or 0, dict(e.metrics or {}))
    return out


def _published(db: OrmSession, run_ids: set[str]) -> list[dict[str, Any]]:
    """The versions the runs published (``stats.run_id``), oldest first, with their newest eval."""
    rows = [r for r in db.scalars(select(PolicyVersion).order_by(PolicyVersion.created_at, PolicyVersion.id))
            if (r.stats or {}).get("run_id") in run_ids]
    names = dict(db.execute(select(PolicyVersion.id, PolicyVersion.name)).all())
    ev = _latest_evals(db, [r.id for r in rows])
    out = []
    for r in rows:
        step = (r.stats or {}).get("step")
        out.append({"name": r.name, "status": r.status, "kind": r.kind, "created_at": r.created_at,
                    "run_id": (r.stats or {}).get("run_id"), "step": step if isinstance(step, int) else None,
                    "parent": names.get(r.parent_id) if r.parent_id else None, "eval": ev.get(r.id),
                    "turns": (r.stats or {}).get("turns")})
    return out


def run_detail(db: OrmSession, run_id: str, *, steps: int = 500) -> dict[str, Any] | None:
    """One run: its config, its newest *steps* steps (numbers only, newest first), the metric
    keys they carry, the versions it published and its curves; None if there is no such run."""
    r = db.get(TrainingRun, run_id)
    if r is None:
        return None
    total = db.scalar(select(func.count()).select_from(TrainingStep).where(TrainingStep.run_id == run_id)) or 0
    leased = db.scalar(select(func.count()).select_from(TrainingLease).where(
        TrainingLease.run_id == run_id, TrainingLease.acked_at.is_(None))) or 0
    rows = list(db.scalars(select(TrainingStep).where(TrainingStep.run_id == run_id)
                           .order_by(TrainingStep.step.desc()).limit(steps)))
    keys: dict[str, None] = {}
    listed = []
    for s in rows:
        m = s.metrics or {}
        nums = {k: v for k, v in ((k, number(v)) for k, v in m.items()) if v is not None}
        for k in nums:
            keys.setdefault(k, None)
        listed.append({"step": s.step, "created_at": s.created_at, "metrics": nums,
                       "candidate": m.get("candidate") if isinstance(m.get("candidate"), str) else None,
                       "turns": len(m["turn_ids"]) if isinstance(m.get("turn_ids"), list) else None})
    first = [k for _, _, ks in STEP_CHARTS for k in ks if k in keys]
    ordered = first + sorted(k for k in keys if k not in first)
    label = run_label(r.id, r.objective)
    by_key = {k: series_by_run([(r.id, s["step"], s["metrics"]) for s in listed], (k,), {r.id: label})
              for k in ordered}
    return {"run": {"id": r.id, "objective": r.objective, "backend": r.backend, "status": r.status,
                    "config": dict(r.config or {}), "base_version": r.base_version,
                    "produced_version": r.produced_version, "created_at": r.created_at,
                    "finished_at": r.finished_at, "steps": int(total), "in_flight": int(leased), "label": label},
            "steps": listed, "metric_keys": ordered, "series": by_key, "versions": _published(db, {r.id}),
            "latency": {label: _latency_by_step(db, [r.id]).get(r.id, [])}}


def _bucket(span: float) -> int:
    return 3600 if span <= 3 * 86400 else 86400


def _epoch_bucket(db: OrmSession, column: Any, bucket: int) -> Any:
    """SQL for *column*'s Unix time cut down to a multiple of *bucket* seconds."""
    if db.get_bind().dialect.name == "sqlite":
        seconds = cast(func.strftime("%s", column), BigInteger)
    else:
        seconds = cast(func.floor(func.extract("epoch", column)), BigInteger)
    return (seconds // bucket) * bucket


def by_version(db: OrmSession, *, days: float = 30.0, limit: int = MAX_RUNS) -> dict[str, Any]:
    """Reward by policy version: the mean reward of judged turns each version served, per hour
    (per day when the data spans more than three days) — one series per version, the *limit*
    most recently served; and a row per version: judged turns, mean reward, share positive,
    people's mean rating, its newest held-out eval. Aggregated in the database."""
    since = utcnow() - timedelta(days=days)
    judged = (Judgement.reward.is_not(None), Turn.created_at >= since)
    totals: dict[str, dict[str, Any]] = {}
    for version, n, mean, pos, first, last in db.execute(
            select(Turn.policy_version, func.count(), func.avg(Judgement.reward),
                   func.sum(case((Judgement.reward > 0, 1), else_=0)), func.min(Turn.created_at),
                   func.max(Turn.created_at))
            .join(Judgement, Judgement.turn_id == Turn.id).where(*judged).group_by(Turn.policy_version)):
        totals[version or "(no version)"] = {"n": int(n), "mean": float(mean), "pos": int(pos or 0) / int(n),
                                             "first": first, "last": last}
    stamps = [t["first"] for t in totals.values()] + [t["last"] for t in totals.values()]
    bucket = _bucket((max(stamps) - min(stamps)).total_seconds()) if stamps else 3600
    recent = sorted(totals, key=lambda n: totals[n]["last"], reverse=True)[:limit]
    series: dict[str, list[tuple[float, float]]] = {n: [] for n in recent}
    if recent:
        at = _epoch_bucket(db, Turn.created_at, bucket).label("at")
        chosen = [n for n in recent if n != "(no version)"]
        which = Turn.policy_version.in_(chosen)
        if "(no version)" in recent:
            which = or_(which, Turn.policy_version.is_(None))
        for version, t, mean in db.execute(
                select(Turn.policy_version, at, func.avg(Judgement.reward))
                .join(Judgement, Judgement.turn_id == Turn.id).where(*judged, which)
                .group_by(Turn.policy_version, at)):
            series[version or "(no version)"].append((float(t), float(mean)))
    for points in series.values():
        points.sort()
    feedback = {v or "(no version)": (int(n), float(mean)) for v, n, mean in db.execute(
        select(Turn.policy_version, func.count(), func.avg(Vote.value)).join(Turn, Turn.id == Vote.turn_id)
        .where(Vote.kind == VoteKind.FEEDBACK, Vote.value.is_not(None), Turn.created_at >= since)
        .group_by(Turn.policy_version))}
    vrows = {r.name: r for r in db.scalars(select(PolicyVersion))}
    ev = _latest_evals(db, [r.id for r in vrows.values()])

    def newest(name: str) -> Any:
        return (totals.get(name, {}).get("last") or getattr(vrows.get(name), "created_at", None) or since)

    table = []
    for name in sorted(set(totals) | set(vrows) | set(feedback), key=newest, reverse=True):
        t, row = totals.get(name), vrows.get(name)
        f_n, f_mean = feedback.get(name, (0, None))
        table.append({"name": name, "status": row.status if row else None, "n": t["n"] if t else 0,
                      "mean": t["mean"] if t else None, "positive": t["pos"] if t else None,
                      "first": t["first"] if t else None, "last": t["last"] if t else None,
                      "feedback_n": f_n, "feedback": f_mean, "eval": ev.get(row.id) if row else None})
    return {"series": series, "bucket": bucket, "table": table}


def version_names(db: OrmSession) -> list[str]:
    """Every name a comparison can pick: policy versions (newest first), then the base models
    they were trained from and other names turns were served by or the eval gate evaluated."""
    named = [n for n in db.scalars(select(PolicyVersion.name).order_by(PolicyVersion.created_at.desc(),
                                                                         PolicyVersion.id.desc()))]
    other = (set(evals.evaluated_versions(db)) | {v for v in db.scalars(select(Turn.policy_version).distinct()) if v}
             | set(db.scalars(select(PolicyVersion.base_model).distinct())))
    return named + sorted(other - set(named))


def _side(db: OrmSession, name: str) -> dict[str, Any]:
    row = db.scalars(select(PolicyVersion).where(PolicyVersion.name == name)).first()
    live_n, live_mean = db.execute(select(func.count(), func.avg(Judgement.reward))
                                   .join(Turn, Turn.id == Judgement.turn_id)
                                   .where(Turn.policy_version == name, Judgement.reward.is_not(None))).one()
    ev = _latest_evals(db, [row.id]).get(row.id) if row else None
    parent = db.get(PolicyVersion, row.parent_id).name if row and row.parent_id else None
    replies = evals.replies_of(db, name)
    scores = [r["score"] for r in replies.values() if r["score"] is not None and math.isfinite(r["score"])]
    return {"name": name, "status": row.status if row else None, "kind": row.kind if row else "base / other",
            "created_at": row.created_at if row else None, "parent": parent,
            "run_id": (row.stats or {}).get("run_id") if row else None,
            "step": (row.stats or {}).get("step") if row else None, "eval": ev,
            "live_n": int(live_n or 0), "live_mean": float(live_mean) if live_mean is not None else None,
            "heldout_n": len(replies), "heldout_mean": sum(scores) / len(scores) if scores else None,
            "replies": replies}


def compare(db: OrmSession, a: str, b: str) -> dict[str, Any] | None:
    """Versions *a* and *b* side by side: their eval results, live reward, and their replies to
    the same held-out prompts (prompts both answered first); None if either is unknown."""
    names = set(version_names(db))
    if a not in names or b not in names:
        return None
    left, right = _side(db, a), _side(db, b)
    keys = list(left["replies"]) + [k for k in right["replies"] if k not in left["replies"]]
    rows = []
    for k in keys:
        ra, rb = left["replies"].get(k), right["replies"].get(k)
        prompt = (ra or rb or {}).get("prompt") or []
        rows.append({"hash": k, "prompt": prompt, "a": ra, "b": rb})
    rows.sort(key=lambda r: (r["a"] is None or r["b"] is None, str(r["prompt"][-1:])))
    return {"a": left, "b": right, "rows": rows, "same": a == b,
            "shared": sum(1 for r in rows if r["a"] and r["b"])}
