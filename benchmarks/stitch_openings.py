"""Stitching as identical openings pile up: the pool's reads per batch, now against a revision.

    .venv/bin/python -m benchmarks.stitch_openings [--turns 10000] [--batch 50] [--baseline REV]

Every request of the gateway's benchmark, and the first call of every environment of a rollout
task, sends the same messages and often gets the same reply: thousands of stored turns share
one request hash and one continuation hash. This writes --turns such turns ("Say hello." /
"Hello!", no session header, like `python -m benchmarks.gateway`) in batches of --batch, one
transaction per batch like the capture writer, into a fresh PostgreSQL database and a fresh
SQLite file, once with this tree's stitching reads (datapool/stitch_reads.py) and once with
those of --baseline (read with `git show` into a temporary module, put in place of
datapool.sessions.KnownTurns for that run). Per database and implementation it prints wall and
CPU milliseconds per turn over the first, middle and last tenth of the batches: flat when a
batch's reads do not grow with the pool.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Sequence
from contextlib import ExitStack
from datetime import datetime, timedelta, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sqlalchemy.orm import Session as OrmSession  # noqa: E402

from benchmarks.stitch import database_maker, load_baseline  # noqa: E402
from datapool import sessions  # noqa: E402
from datapool.db import make_engine  # noqa: E402
from tests.support.records import turn_record  # noqa: E402

# the last commit whose stitching read every stored turn of a hash
BASELINE = "070b645"
T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
MESSAGES = [{"role": "user", "content": "Say hello."}]


def run(url: str, turns: int, batch: int) -> list[tuple[float, float]]:
    """(wall s, CPU s) per batch of identical openings."""
    engine = make_engine(url)
    out = []
    try:
        for b in range(turns // batch):
            records = [turn_record(MESSAGES, "Hello!", at=T0 + timedelta(milliseconds=b * batch + i))
                       for i in range(batch)]
            wall, cpu = time.perf_counter(), time.process_time()
            with OrmSession(engine) as db, db.begin():
                sessions.Stitcher(db).write(records)
            out.append((time.perf_counter() - wall, time.process_time() - cpu))
    finally:
        engine.dispose()
    return out


def tenths(per_batch: list[tuple[float, float]], batch: int) -> list[str]:
    n = len(per_batch)
    cells = []
    for start in (0, n // 2, n - max(1, n // 10)):
        part = per_batch[start:start + max(1, n // 10)]
        wall = 1000 * sum(w for w, _ in part) / len(part) / batch
        cpu = 1000 * sum(c for _, c in part) / len(part) / batch
        cells.append(f"{wall:.2f} / {cpu:.2f}")
    return cells


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.stitch_openings", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=10000, help="identical turns to write (default 10000)")
    ap.add_argument("--batch", type=int, default=50, help="turns per transaction (default 50)")
    ap.add_argument("--databases", nargs="+", choices=["postgresql", "sqlite"], default=["postgresql", "sqlite"])
    ap.add_argument("--baseline", default=BASELINE, help="git revision to compare with (default %(default)s)")
    args = ap.parse_args(argv)
    print(f"{args.turns} identical turns in batches of {args.batch}; wall / CPU ms per turn\n")
    head = "| database | stitching reads | first tenth | middle tenth | last tenth | total s |"
    print(head + "\n| --- | --- | --- | --- | --- | --- |")
    current = sessions.KnownTurns
    with ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-openings-")))
        baseline = load_baseline(args.baseline, work, "datapool/stitch_reads.py")
        implementations = {f"{args.baseline} (every turn of a hash)": baseline.KnownTurns,
                           "this tree (first turns per kind)": current}
        fresh = database_maker(stack, work)
        for kind in args.databases:
            for label, known in implementations.items():
                sessions.KnownTurns = known  # type: ignore[misc]
                try:
                    per_batch = run(fresh(kind), args.turns, args.batch)
                finally:
                    sessions.KnownTurns = current  # type: ignore[misc]
                total = sum(w for w, _ in per_batch)
                print(f"| {kind} | {label} | " + " | ".join(tenths(per_batch, args.batch)) + f" | {total:.1f} |",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
