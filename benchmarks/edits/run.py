"""Edited histories at scale: generated sessions whose agent edits its history, written through the
real Stitcher, and how many the pool split or merged.

    .venv/bin/python -m benchmarks.edits.run [--sessions 10000] [--seed 0] [--concurrency 8]
        [--batch 64] [--db sqlite:///path] [--out benchmarks/edits/results/latest.json]

Each session (tests.support.edits) is a random conversation with tool loops, its requests rewritten
as real clients do (tool-call ids stripped or re-minted, arguments re-serialised, text as parts,
null fields, ...), with one edit at a random request, the kinds in turn: a recovery pass, a summary
inserted, a summary in place of earlier messages, a fork, a retry, a summarisation call with the
transcript embedded, one with the history and the instruction appended. Sessions come in groups
that share their system prompt (as one agent's runs do); --concurrency sessions are under way at a
time, their calls interleaved, written in batches of --batch, one transaction each, into a fresh
SQLite pool (or --db, migrated first).

Prints and writes (--out) the counts: splits (a session spread over more than one pool session),
false merges (a pool session holding calls of more than one generated session), turns whose
parent, edit or parent's next state is not the planned one, and the edits recorded by kind. Exits
with status 1 unless all of those are 0. The committed result is referenced by
docs/results/edits.md.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from sqlalchemy import select  # noqa: E402
from sqlalchemy.orm import Session as OrmSession  # noqa: E402

from datapool.db import make_engine, upgrade  # noqa: E402
from datapool.models import Turn  # noqa: E402
from datapool.sessions import Stitcher  # noqa: E402
from tests.support.edits import KINDS, Clock, Planned, outcome, plan_session  # noqa: E402


def generate(sessions: int, seed: int, concurrency: int) -> list[Planned]:
    """The sessions' calls in the order they are written: --concurrency sessions under way at a time."""
    r = random.Random(seed)
    clock = Clock()
    planned: list[Planned] = []
    running: list[list[Planned]] = []
    n = 0
    system = ""
    while n < sessions or any(running):
        while n < sessions and len(running) < concurrency:
            if n % 4 == 0:
                system = f"agent {r.getrandbits(32):08x}"  # four sessions in a row share a system prompt
            running.append(plan_session(r, n, KINDS[n % len(KINDS)], clock, system))
            n += 1
        queue = r.choice([q for q in running if q])
        planned.append(queue.pop(0))
        running = [q for q in running if q]
    return planned


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=10_000, help="generated sessions (default 10000)")
    ap.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    ap.add_argument("--concurrency", type=int, default=8, help="sessions under way at a time (default 8)")
    ap.add_argument("--batch", type=int, default=64, help="calls per write transaction (default 64)")
    ap.add_argument("--db", help="database URL to migrate and write into (default: a fresh SQLite file)")
    ap.add_argument("--out", type=Path, help="write the counts as JSON here")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        url = args.db or f"sqlite:///{Path(tmp) / 'pool.db'}"
        upgrade(url)
        engine = make_engine(url)
        planned = generate(args.sessions, args.seed, args.concurrency)
        records = [p.record for p in planned]
        started = time.perf_counter()
        for i in range(0, len(records), args.batch):
            with OrmSession(engine) as db, db.begin():
                Stitcher(db).write(records[i:i + args.batch])
        seconds = time.perf_counter() - started
        stored: dict[str, Any] = {}
        with OrmSession(engine) as db:
            for i in range(0, len(records), 500):
                chunk = [r.id for r in records[i:i + 500]]
                stored.update((t.id, t) for t in db.scalars(select(Turn).where(Turn.id.in_(chunk))))
            db.expunge_all()
        engine.dispose()
    result = outcome(stored, planned)
    report: dict[str, Any] = {"command": "python -m benchmarks.edits.run " + " ".join(argv or sys.argv[1:]),
                              "seed": args.seed, "concurrency": args.concurrency, "batch": args.batch,
                              **asdict(result), "write_seconds": round(seconds, 1),
                              "turns_per_second": round(len(records) / seconds)}
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    bad = (result.splits, result.false_merges, result.wrong_parent, result.wrong_edit, result.wrong_next_state)
    return 0 if bad == (0, 0, 0, 0, 0) else 1


if __name__ == "__main__":
    sys.exit(main())
