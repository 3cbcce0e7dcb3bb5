"""The admin UI's training pages: their charts and their data, server side.

    python benchmarks/ui_training.py [--runs 8] [--steps 2000] [--turns 50000] [--repeat 10] [--database-url ...]

Part 1, charts: one chart of --runs series of --steps points each, drawn by
``gateway.ui.plots.line_chart`` (the hand-drawn SVG the pages use) and, for comparison, by
matplotlib's SVG backend (the ``bench`` extra; skipped without it). Part 2, data: seeds --runs
runs of --steps steps, published versions with eval replies, and --turns judged turns over
ten policy versions into a fresh database on the local PostgreSQL (or the empty, migrated
--database-url), then times what each page reads (``datapool.training_view``) plus its charts.
Columns: p50 and p95 milliseconds, and the SVG size where there is one.
"""

from __future__ import annotations

import argparse
import io
import math
import random
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sqlalchemy import insert
from sqlalchemy.orm import Session as OrmSession

from datapool import evals, training_view
from datapool.db import make_engine
from datapool.models import (
    Judgement,
    PolicyEvent,
    PolicyVersion,
    Session,
    TrainingRun,
    TrainingStep,
    Turn,
)
from gateway.ui import plots


def timed(fn: Callable[[], Any], repeat: int) -> tuple[float, float, Any]:
    times, out = [], None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        times.append((time.perf_counter() - t) * 1000)
    times.sort()
    return statistics.median(times), times[min(len(times) - 1, round(0.95 * (len(times) - 1)))], out


def series(runs: int, steps: int) -> dict[str, list[tuple[float, float]]]:
    rng = random.Random(0)
    return {f"{uuid.uuid4().hex[:8]} rl": [(float(s), 1 / math.sqrt(s) + rng.gauss(0, 0.02)) for s in range(1, steps + 1)]
            for _ in range(runs)}


def matplotlib_svg(data: dict[str, list[tuple[float, float]]]) -> str:
    import matplotlib

    matplotlib.use("svg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.2, 2.6))
    for name, pts in data.items():
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=name, linewidth=1)
    ax.set_xlabel("step")
    fig.legend(loc="outside lower center", ncols=4)
    buf = io.StringIO()
    fig.savefig(buf, format="svg")
    plt.close(fig)
    return buf.getvalue()


def seed(engine: Any, runs: int, steps: int, turns: int) -> tuple[str, list[str]]:
    rng = random.Random(1)
    start = datetime.now(UTC) - timedelta(days=5)
    run_ids, names = [], []
    with OrmSession(engine) as db, db.begin():
        for r in range(runs):
            rid = uuid.uuid4().hex
            run_ids.append(rid)
            db.add(TrainingRun(id=rid, objective="rl", backend="local", config={"lr": 1e-5}, status="done",
                               created_at=start))
            db.flush()
            db.execute(insert(TrainingStep), [
                {"run_id": rid, "step": s, "created_at": start + timedelta(seconds=30 * s),
                 "metrics": {"pg_loss": 1 / math.sqrt(s) + rng.gauss(0, 0.02), "kl": 1e-4 * s,
                             "advantage_mean": rng.gauss(0, 0.1), "tokens_per_s": 900.0, "turn_ids": ["x"] * 4}}
                for s in range(1, steps + 1)])
        prompts = [[{"role": "user", "content": f"held-out question {i}"}] for i in range(20)]
        for v in range(10):
            name = f"bench-v{v}"
            names.append(name)
            row = PolicyVersion(name=name, base_model="smollm2", kind="lora", path="/x", status="retired",
                                stats={"run_id": run_ids[v % runs], "step": (v + 1) * steps // 10})
            db.add(row)
            db.flush()
            db.add(PolicyEvent(version_id=row.id, action="eval", actor="eval-gate", metrics={"score": rng.random()}))
    for name in names:
        evals.record_replies(engine, name, prompts, [f"{name} says {i}" for i in range(20)], [1.0] * 20)
    for lo in range(0, turns, 5000):
        srows, trows, jrows = [], [], []
        for i in range(lo, min(turns, lo + 5000)):
            sid, tid, at = f"b-{i}", str(uuid.uuid4()), start + timedelta(seconds=8 * i)
            srows.append({"id": sid, "source": "header", "mode": "online", "created_at": at, "updated_at": at, "meta": {}})
            trows.append({"id": tid, "session_id": sid, "turn_type": "main", "endpoint": "chat", "status": "ok",
                          "wire_format": "chat", "created_at": at, "model": "policy", "capture": "black-box",
                          "policy_version": names[i * 10 // turns], "request": {"messages": []}})
            jrows.append({"turn_id": tid, "status": "scored", "reward": rng.choice((1.0, -1.0)), "attempts": 1,
                          "retries": 0, "updated_at": at})
        with OrmSession(engine) as db, db.begin():
            db.execute(insert(Session), srows)
            db.execute(insert(Turn), trows)
            db.execute(insert(Judgement), jrows)
    with engine.begin() as conn:
        conn.exec_driver_sql("ANALYZE")
    return run_ids[0], names


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--turns", type=int, default=50000)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--database-url")
    args = ap.parse_args()
    print(f"{'what':<44} {'p50 ms':>8} {'p95 ms':>8} {'KiB':>7}")

    def row(name: str, p50: float, p95: float, size: int | None = None) -> None:
        print(f"{name:<44} {p50:8.1f} {p95:8.1f} {'' if size is None else f'{size / 1024:7.0f}'}")

    for runs, steps in ((1, 40), (args.runs, args.steps)):
        data = series(runs, steps)
        p50, p95, svg = timed(lambda data=data: plots.line_chart("loss", data), args.repeat)
        row(f"chart {runs}x{steps} points: plots.line_chart", p50, p95, len(svg))
        try:
            p50, p95, svg = timed(lambda data=data: matplotlib_svg(data), args.repeat)
            row(f"chart {runs}x{steps} points: matplotlib svg", p50, p95, len(svg))
        except ImportError:
            print("matplotlib not installed (pip install -e .[bench]): its row skipped", file=sys.stderr)

    from tests.support.pg import benchmark_database

    with benchmark_database(args.database_url) as url:
        engine = make_engine(url)
        t0 = time.perf_counter()
        run_id, names = seed(engine, args.runs, args.steps, args.turns)
        print(f"seeded {args.runs} runs x {args.steps} steps, {len(names)} versions, {args.turns} judged turns "
              f"in {time.perf_counter() - t0:.1f}s", file=sys.stderr)

        def page(fn: Callable[[OrmSession], Any]) -> Callable[[], Any]:
            def go() -> Any:
                with OrmSession(engine) as db:
                    return fn(db)
            return go

        def training(db: OrmSession) -> str:
            c, bv = training_view.step_curves(db), training_view.by_version(db)
            training_view.runs(db), training_view.versions(db), training_view.recent_events(db)
            return "".join(str(plots.line_chart(k, c[k])) for k in ("loss", "kl", "advantage", "latency", "eval")) \
                + str(plots.line_chart("reward", bv["series"], time_axis=True))

        def run_page(db: OrmSession) -> str:
            d = training_view.run_detail(db, run_id)
            return "".join(str(plots.line_chart(k, d["series"][k])) for k in d["metric_keys"])

        for name, fn in (("/admin/training: data + 6 charts", training),
                         ("  step_curves", training_view.step_curves),
                         ("  by_version", training_view.by_version),
                         ("/admin/training/runs/{id}: data + charts", run_page),
                         ("/admin/training/compare: data", lambda db: training_view.compare(db, names[0], names[1]))):
            p50, p95, out = timed(page(fn), args.repeat)
            row(name, p50, p95, len(out) if isinstance(out, str) else None)
        engine.dispose()


if __name__ == "__main__":
    main()
