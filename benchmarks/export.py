"""Export of the admin UI: streamed vs built whole, on real PostgreSQL.

    python benchmarks/export.py [--turns 20000] [--batch 500] [--database-url postgresql+psycopg://...]

Seeds --turns white-box turns (one per session, a ~2 KB request each, judged) into a fresh
database on the local PostgreSQL (or the empty, migrated --database-url), then, in one run and
on the same data, measures:

* ``jsonl stream`` / ``parquet stream``: ``datapool.export.jsonl`` / ``.parquet`` — what
  ``GET /admin/export.{jsonl,parquet}`` streams — consumed chunk by chunk and discarded;
* ``parquet whole``: the same rows gathered into one list and written as one table, the way a
  non-streaming export would build it.

Columns: wall seconds, rows/s, megabytes produced, and how much the process's peak RSS grew
during the export (each row runs in a forked child of its own).
The streamed peak should stay flat as --turns grows; the whole-table peak grows with it.
"""

from __future__ import annotations

import argparse
import io
import sys
import time
import multiprocessing
import resource
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
from sqlalchemy.orm import Session as OrmSession  # noqa: E402

from datapool import export  # noqa: E402
from datapool.browse import Browse  # noqa: E402
from datapool.db import make_engine  # noqa: E402
from datapool.models import Judgement, Session, Turn  # noqa: E402


def seed(engine: Any, n: int) -> None:
    start = datetime.now(timezone.utc) - timedelta(days=1)
    filler = "lorem ipsum dolor sit amet " * 60
    for lo in range(0, n, 1000):
        with OrmSession(engine) as db, db.begin():
            for i in range(lo, min(n, lo + 1000)):
                sid, tid, at = f"bench-{i}", str(uuid.uuid4()), start + timedelta(seconds=i)
                db.add(Session(id=sid, source="header", mode="offline", created_at=at, updated_at=at,
                               task_id=f"task-{i % 50}"))
                db.add(Turn(id=tid, session_id=sid, turn_type="main", endpoint="chat", status="ok", created_at=at,
                            model="smollm2", upstream_model="smollm2", capture="white-box",
                            request={"messages": [{"role": "system", "content": filler},
                                                  {"role": "user", "content": f"task {i}: solve it"}]},
                            response={"choices": [{"index": 0, "finish_reason": "stop",
                                                   "message": {"role": "assistant", "content": f"answer {i}"}}]},
                            prompt_token_ids=list(range(40)), token_ids=list(range(12)), logprobs=[-0.1] * 12))
                db.flush()
                db.add(Judgement(turn_id=tid, status="scored", reward=1.0 if i % 2 else -1.0, prm_reward=1.0,
                                 vote_mean=1.0, attempts=1))


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _child(fn: Any, out: Any) -> None:
    engine_rss = _rss_mb()
    t0 = time.perf_counter()
    size = fn()
    wall = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out.put((wall, size, peak - engine_rss))


def measure(name: str, fn: Any, rows: int) -> dict[str, Any]:
    """Run *fn* in a forked child, so each row's peak memory is its own."""
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    proc = ctx.Process(target=_child, args=(fn, out))
    proc.start()
    wall, size, grown = out.get()
    proc.join()
    return {"export": name, "s": wall, "rows/s": rows / wall, "MB out": size / 1e6, "peak RSS +MB": grown}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--turns", type=int, default=20000)
    ap.add_argument("--batch", type=int, default=500)
    ap.add_argument("--database-url")
    args = ap.parse_args()
    from tests.support.pg import benchmark_database

    with benchmark_database(args.database_url) as url:
        engine = make_engine(url)
        t0 = time.perf_counter()
        seed(engine, args.turns)
        print(f"seeded {args.turns} turns in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
        engine.dispose()  # each measured child opens connections of its own
        f = Browse()

        def stream(gen: Any) -> int:
            return sum(len(chunk) for chunk in gen)

        def whole() -> int:
            rows = [r for batch in export.iter_rows(engine, f, args.batch) for r in batch]
            buf = io.BytesIO()
            pq.write_table(pa.Table.from_pylist(rows, schema=export.SCHEMA), buf, compression="zstd")
            return buf.tell()

        results = [
            measure("jsonl stream", lambda: stream(export.jsonl(engine, f, args.batch)), args.turns),
            measure("parquet stream", lambda: stream(export.parquet(engine, f, args.batch)), args.turns),
            measure("parquet whole", whole, args.turns),
        ]
        print(f"\n{args.turns} turns, batch {args.batch}, PostgreSQL\n")
        cols = list(results[0])
        print(" | ".join(f"{c:>14}" for c in cols))
        print(" | ".join("-" * 14 for _ in cols))
        for r in results:
            print(" | ".join(f"{r[c]:>14.2f}" if isinstance(r[c], float) else f"{r[c]:>14}" for c in cols))
        engine.dispose()


if __name__ == "__main__":
    main()
