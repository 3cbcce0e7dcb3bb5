"""Stitching as identical openings pile up: the pool's reads per batch, now against a revision.

    .venv/bin/python -m benchmarks.stitch_openings [--turns 10000] [--batch 50] [--baseline REV]

Every request of the gateway's benchmark, and the first call of every environment of a rollout
task, sends the same messages and often gets the same reply: thousands of stored turns share
one request hash and one continuation hash. This writes --turns such turns ("Say hello." /
"Hello!", no session header, like `python -m benchmarks.gateway`) in batches of --batch, one
transaction per batch like the capture writer, into a fresh PostgreSQL database and a fresh
SQLite file, once with this tree's stitching (datapool/sessions.py and datapool/stitch_reads.py)
and once with that of --baseline (both files read with `git show` into temporary modules, the
baseline's sessions importing the baseline's reads). Per database and implementation it prints
wall and CPU milliseconds per turn over the first, middle and last tenth of the batches: flat
when a batch's reads do not grow with the pool, and about the same at --batch 50 and --batch 2000
when a record's search for its parent does not grow with the batch (the capture writer takes up
to 4,096 queued turns in one batch when it is behind).
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


def run(url: str, turns: int, batch: int, stitcher: type[sessions.Stitcher]) -> list[tuple[float, float]]:
    """(wall s, CPU s) per batch of identical openings."""
    engine = make_engine(url)
    out = []
    try:
        for b in range(turns // batch):
            records = [turn_record(MESSAGES, "Hello!", at=T0 + timedelta(milliseconds=b * batch + i))
                       for i in range(batch)]
            wall, cpu = time.perf_counter(), time.process_time()
            with OrmSession(engine) as db, db.begin():
                stitcher(db).write(records)
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


def baseline_stitcher(rev: str, work: Path) -> type[sessions.Stitcher]:
    """datapool.sessions.Stitcher as of *rev*, over datapool/stitch_reads.py as of *rev*."""
    reads = load_baseline(rev, work, "datapool/stitch_reads.py")
    current = sys.modules["datapool.stitch_reads"]
    sys.modules["datapool.stitch_reads"] = reads  # what the baseline's sessions imports, while it loads
    try:
        return load_baseline(rev, work, "datapool/sessions.py").Stitcher  # type: ignore[no-any-return]
    finally:
        sys.modules["datapool.stitch_reads"] = current


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.stitch_openings", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=10000, help="identical turns to write (default 10000)")
    ap.add_argument("--batch", type=int, default=50, help="turns per transaction (default 50)")
    ap.add_argument("--databases", nargs="+", choices=["postgresql", "sqlite"], default=["postgresql", "sqlite"])
    ap.add_argument("--baseline", default=BASELINE, help="git revision to compare with (default %(default)s)")
    args = ap.parse_args(argv)
    print(f"{args.turns} identical turns in batches of {args.batch}; wall / CPU ms per turn\n")
    head = "| database | stitching | first tenth | middle tenth | last tenth | total s |"
    print(head + "\n| --- | --- | --- | --- | --- | --- |")
    with ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-openings-")))
        implementations = {args.baseline: baseline_stitcher(args.baseline, work),
                           "this tree": sessions.Stitcher}
        fresh = database_maker(stack, work)
        for kind in args.databases:
            for label, stitcher in implementations.items():
                per_batch = run(fresh(kind), args.turns, args.batch, stitcher)
                total = sum(w for w, _ in per_batch)
                print(f"| {kind} | {label} | " + " | ".join(tenths(per_batch, args.batch)) + f" | {total:.1f} |",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
