"""The admin UI's turns view (``datapool.browse.turns_page``, what ``GET /admin/turns`` and
``GET /api/turns`` run) and session list page, on real PostgreSQL.

    python benchmarks/ui_turns.py [--sessions 10000] [--turns-per-session 5] [--repeat 20] [--database-url ...]

Seeds --sessions sessions of --turns-per-session main turns (judged +1/−1/unjudged, varied
latency, usage, finish reasons, tool calls) into a fresh database on the local PostgreSQL (or
the empty, migrated --database-url), VACUUM ANALYZEs it, then times each view --repeat times,
server side without HTTP: a turns page of 50 rows with its labels (every filter and sort the
view offers), a session-list request (50 sessions with their summaries, and the counts), and the
model/version lists a full page load reads. Columns: p50 and p95 milliseconds, rows returned.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sqlalchemy import insert, select
from sqlalchemy.orm import Session as OrmSession

from datapool import browse
from datapool.db import make_engine
from datapool.models import Judgement, Label, Session, Turn


def seed(engine: Any, sessions: int, per: int) -> None:
    start = datetime.now(UTC) - timedelta(days=7)
    for lo in range(0, sessions, 1000):
        srows, trows, jrows, lrows = [], [], [], []
        for i in range(lo, min(sessions, lo + 1000)):
            at = start + timedelta(seconds=60 * i)
            sid = f"bench-{i}"
            srows.append({"id": sid, "source": "header", "mode": "eval" if i % 20 == 0 else "online",
                          "created_at": at, "updated_at": at, "meta": {}})
            if i % 100 == 0:  # a person's reward override of a whole session, and a tag
                lrows.append({"session_id": sid, "kind": "override", "value": -0.5, "author": "bench", "created_at": at})
                lrows.append({"session_id": sid, "kind": "tag", "value": "slow", "author": "bench", "created_at": at})
            for j in range(per):
                k = i * per + j
                tid = str(uuid.uuid4())
                calls = [{"id": f"c{j}", "type": "function", "function": {"name": "ls", "arguments": "{}"}}] * (j % 3)
                trows.append({"id": tid, "session_id": sid, "turn_type": "main", "endpoint": "chat", "status": "ok",
                              "wire_format": "chat", "created_at": at + timedelta(seconds=j),
                              "model": f"model-{i % 3}", "upstream_model": "smollm2",
                              "capture": "white-box" if i % 10 == 0 else "black-box",
                              "policy_version": f"v{i % 4}",
                              "request": {"messages": [{"role": "user", "content": f"task {i} step {j}: list the files"}]},
                              "response": {"choices": [{"index": 0, "finish_reason": "length" if k % 17 == 0 else "stop",
                                                        "message": {"role": "assistant", "content": f"answer {k}",
                                                                    **({"tool_calls": calls} if calls else {})}}]},
                              "latency_ms": float((k * 7919) % 5000), "usage": {"prompt_tokens": 20 + j * 30,
                                                                              "completion_tokens": (k * 31) % 400}})
                if k % 251 == 0:
                    jrows.append({"turn_id": tid, "status": "dead", "dead_reason": "retries_exhausted",
                                  "last_error": "retries_exhausted: judge timed out", "attempts": 3, "retries": 3,
                                  "updated_at": at})
                elif k % 499 == 0:
                    jrows.append({"turn_id": tid, "status": "tie", "attempts": 1, "retries": 0, "updated_at": at})
                elif k % 4:
                    jrows.append({"turn_id": tid, "status": "scored", "reward": -1.0 if k % 997 == 0 else 1.0,
                                  "attempts": 1, "retries": 0, "updated_at": at})
                if k % 389 == 0:  # people's labels on single turns
                    lrows.append({"turn_id": tid, "kind": "override", "value": 0.25, "author": "bench", "created_at": at})
                    lrows.append({"turn_id": tid, "kind": "thumb", "value": -1, "author": "bench", "created_at": at})
        with OrmSession(engine) as db, db.begin():
            db.execute(insert(Session), srows)
            db.execute(insert(Turn), trows)
            db.execute(insert(Judgement), jrows)
            db.execute(insert(Label), lrows)
    # as autovacuum leaves a pool: dead row versions (each scored turn's update) cleared, statistics fresh
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.exec_driver_sql("VACUUM ANALYZE")


VIEWS: list[tuple[str, dict[str, str]]] = [
    ("newest", {}),
    ("oldest", {"order": "asc"}),
    ("reward=negative", {"reward": "negative"}),
    ("reward=positive", {"reward": "positive"}),
    ("reward=tie", {"reward": "tie"}),
    ("reward=unscored", {"reward": "unscored"}),
    ("status=none", {"status": "none"}),
    ("status=dead", {"status": "dead"}),
    ("sort=latency", {"sort": "latency"}),
    ("sort=latency asc", {"sort": "latency", "order": "asc"}),
    ("sort=reward", {"sort": "reward"}),
    ("sort=reward asc", {"sort": "reward", "order": "asc"}),
    ("sort=tokens", {"sort": "tokens"}),
    ("sort=tokens asc", {"sort": "tokens", "order": "asc"}),
    ("model + version", {"model": "model-1", "policy_version": "v1"}),
    ("capture=white-box", {"capture": "white-box"}),
    ("mode=eval", {"mode": "eval"}),
    ("label=labeled", {"label": "labeled"}),
    ("label=tag:slow", {"label": "tag:slow"}),
    ("label=thumb-down", {"label": "thumb-down"}),
    ("since + until (a day)", {"since": "-3", "until": "-2"}),
    ("q=files (full text)", {"q": "files"}),
    ("q=4242 (rare word)", {"q": "4242"}),
    ("negative, sort=latency", {"reward": "negative", "sort": "latency"}),
    ("offset 5000", {"offset": "5000"}),
]
#: the session list's filters (it is always newest first)
SESSION_VIEWS: list[tuple[str, dict[str, str]]] = [
    ("newest", {}),
    ("reward=negative", {"reward": "negative"}),
    ("reward=unscored", {"reward": "unscored"}),
    ("mode=eval", {"mode": "eval"}),
    ("capture=white-box", {"capture": "white-box"}),
    ("label=tag:slow", {"label": "tag:slow"}),
    ("q=4242 (rare word)", {"q": "4242"}),
    ("model + version", {"model": "model-1", "policy_version": "v1"}),
]


def _session_list(db: Any, f: Any) -> list[Any]:
    page = browse.sessions_window(db, f, limit=50, cursor=None)[0]
    browse.counts(db, f)
    return page


def _choices(db: Any) -> list[Any]:
    """The filter forms' model and version lists as a full page load reads them (uncached)."""
    models = list(db.scalars(select(Turn.model).distinct().limit(200)))
    return models + list(db.scalars(select(Turn.policy_version).distinct().limit(200)))


def _dated(params: dict[str, str], now: datetime) -> dict[str, str]:
    """since/until given as days from *now* (the seed spans the last week)."""
    return {k: (now + timedelta(days=int(v))).isoformat() if k in ("since", "until") else v for k, v in params.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=10000)
    ap.add_argument("--turns-per-session", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--database-url")
    args = ap.parse_args()
    from tests.support.pg import benchmark_database

    with benchmark_database(args.database_url) as url:
        engine = make_engine(url)
        t0 = time.perf_counter()
        seed(engine, args.sessions, args.turns_per_session)
        print(f"seeded {args.sessions} sessions / {args.sessions * args.turns_per_session} turns "
              f"in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
        print(f"{'view':<34} {'p50 ms':>8} {'p95 ms':>8} {'rows':>5}")
        now = datetime.now(UTC)
        dated = [(name, _dated(params, now)) for name, params in VIEWS]
        runs: list[tuple[str, Any]] = [
            (f"turns {name}", lambda db, p=params: browse.turns_page(
                db, browse.Browse.from_params(p), browse.TurnPage.from_params(p), limit=50)[0])
            for name, params in dated]
        # the session list's request (its rows and its counts), as a filter change asks for it
        runs += [(f"sessions {name}", lambda db, p=params: _session_list(db, browse.Browse.from_params(p)))
                 for name, params in SESSION_VIEWS]
        runs += [("page load: model/version lists", _choices)]
        for name, fn in runs:
            times, n = [], 0
            for _ in range(args.repeat):
                with OrmSession(engine) as db:
                    t = time.perf_counter()
                    n = len(fn(db))
                    times.append((time.perf_counter() - t) * 1000)
            times.sort()
            p95 = times[min(len(times) - 1, round(0.95 * (len(times) - 1)))]
            print(f"{name:<34} {statistics.median(times):8.1f} {p95:8.1f} {n:5d}")
        engine.dispose()


if __name__ == "__main__":
    main()
