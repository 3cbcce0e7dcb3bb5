"""The capture writer alone: CPU per turn of what its thread does for a batch, without a gateway.

    python -m benchmarks.gateway.writer [--turns 3000] [--batch 256] [--rounds 3]
        [--databases postgresql sqlite] [--cprofile PATH] [--top 25]

Builds --turns captured turns as benchmarks/stitch.py does (3-turn conversations with a tool
call, the client echoing the replies back, and single questions; 64 under way at a time), then
does per batch of --batch what CaptureWriter does in its thread: redaction's text pass
(datapool.token_mask.redact_text with the default classes, one Redactor for the whole run as the
gateway has) and the transaction (Stitcher.write: stored ids, locks, stitching, rows, commit).
Each round writes fresh turns into a fresh database (the local PostgreSQL service, else a
throwaway cluster; a SQLite file). Prints, per database and round, the thread's CPU µs per turn
(time.thread_time; the PostgreSQL server's own CPU is not in it), split into redaction and the
transaction. ``--cprofile PATH``: one more round under cProfile on the thread's CPU clock, saved to
PATH.<database> and its widest frames printed in µs per turn (inflated by the profiler: read
shares and call counts).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from sqlalchemy.orm import Session as OrmSession  # noqa: E402

from base.redact import DEFAULT_CLASSES, Redactor  # noqa: E402
from benchmarks.stitch import database_maker, traffic  # noqa: E402
from datapool.db import make_engine  # noqa: E402
from datapool.sessions import Stitcher  # noqa: E402
from datapool.token_mask import redact_text  # noqa: E402


def one_round(url: str, turns: int, batch: int, seed: int, profile: cProfile.Profile | None = None) -> dict[str, float]:
    records = traffic(turns, 0.25, 64, seed)
    batches = [records[i:i + batch] for i in range(0, len(records), batch)]
    engine = make_engine(url)
    redactor = Redactor(DEFAULT_CLASSES)
    with OrmSession(engine) as db:  # connect before the clock starts
        db.connection()
    red = tx = 0.0
    if profile is not None:
        profile.enable()
    for b in batches:
        t0 = time.thread_time()
        for r in b:
            redact_text(r, redactor)
        t1 = time.thread_time()
        with OrmSession(engine) as db, db.begin():
            Stitcher(db).write(b)
        t2 = time.thread_time()
        red += t1 - t0
        tx += t2 - t1
    if profile is not None:
        profile.disable()
    engine.dispose()
    return {"redact": red / turns * 1e6, "transaction": tx / turns * 1e6, "total": (red + tx) / turns * 1e6}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gateway.writer", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=3000)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--databases", nargs="+", choices=["postgresql", "sqlite"], default=["postgresql", "sqlite"])
    ap.add_argument("--cprofile", default=None, help="save a profiled round to PATH.<database>")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args(argv)
    with ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        make = database_maker(stack, work)
        for kind in args.databases:
            rows: list[dict[str, float]] = []
            for n in range(args.rounds):
                m = one_round(make(kind), args.turns, args.batch, seed=n + 1)
                rows.append(m)
                print(f"{kind:10} round {n + 1}: {m['total']:7.1f} µs/turn (redact {m['redact']:6.1f}, "
                      f"transaction {m['transaction']:6.1f})", flush=True)
            med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
            print(f"{kind:10} median : {med['total']:7.1f} µs/turn (redact {med['redact']:6.1f}, "
                  f"transaction {med['transaction']:6.1f})", flush=True)
            if args.cprofile:
                prof = cProfile.Profile(time.thread_time)
                one_round(make(kind), args.turns, args.batch, seed=99, profile=prof)
                path = f"{args.cprofile}.{kind}"
                prof.dump_stats(path)
                _widest(pstats.Stats(path), args.turns, args.top)
    return 0


def _widest(stats: Any, turns: int, top: int) -> None:
    """The frames with the most own and the most cumulative time, in µs per turn."""
    entries = stats.stats  # (file, line, name) -> (cc, nc, tt, ct, callers)
    for title, key in (("own", 2), ("cumulative", 3)):
        print(f"  widest by {title} time (µs per turn, calls per turn):")
        for func, v in sorted(entries.items(), key=lambda kv: -kv[1][key])[:top]:
            where = f"{Path(func[0]).name}:{func[1]} {func[2]}"
            print(f"    {v[key] / turns * 1e6:8.1f}  {v[1] / turns:7.2f}  {where}")


if __name__ == "__main__":
    raise SystemExit(main())
