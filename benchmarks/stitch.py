"""Session stitching: the set-based Stitcher against the per-record one it replaced, side by side.

    .venv/bin/python -m benchmarks.stitch [--turns 5000] [--batch 256] [--baseline REV]

Builds --turns captured turns: 3-turn conversations continuing each other (the way an agent
resends its growing history, with the SDK noise a client echoes back) and single-turn
conversations, each its own inferred session. --concurrency conversations are under way at a
time, so a parent and its child land in the same batch or in different ones. The turns are
written in batches of --batch, one transaction per batch like the gateway's capture writer,
into a fresh PostgreSQL database (the local service, else a throwaway cluster) and a fresh
SQLite file, once by each implementation. The baseline is datapool/sessions.py as of
--baseline, read with `git show` into a temporary module; it is never kept in the tree.

Columns: turns per second of wall time, CPU seconds of this process, and SQL statements per
turn as SQLAlchemy sends them (an executemany counts once; `scoring` is the share of them
spent in datapool.judgements.mark_pending, one statement per turn whose next state became known).
Each database's row pair is followed by whether both implementations stitched the same sessions,
parents, next states, session times and scoring marks (up to inferred session ids); the
command exits with status 1 if they did not.
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import subprocess
import sys
import tempfile
import time
import types
import uuid
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sqlalchemy import Engine, event, select  # noqa: E402
from sqlalchemy.orm import Session as OrmSession  # noqa: E402

from datapool import sessions as current  # noqa: E402
from datapool.db import make_engine, upgrade  # noqa: E402
from datapool.models import Judgement, Session, Turn  # noqa: E402
from datapool.records import TurnRecord  # noqa: E402
from tests.support.records import turn_record  # noqa: E402

# the last commit whose datapool/sessions.py stitches record by record
BASELINE = "d8199f465e5103ba476dfa8fb92ce915c51d66fe"
T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


# modules the baselines import that have moved since (old name -> where it lives now)
MOVED = {"datapool.scoring": "datapool.judgements"}


def load_baseline(rev: str, directory: Path, source_path: str = "datapool/sessions.py") -> types.ModuleType:
    """*source_path* (default datapool/sessions.py) as of ``rev``, written to ``directory`` and
    imported from there as a module of its own (not in sys.modules); its imports of modules
    that moved since (MOVED) point to where they are now."""
    source = subprocess.run(
        ["git", "show", f"{rev}:{source_path}"], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout
    for old, new in MOVED.items():
        source = source.replace(f"from {old} import", f"from {new} import")
    name = "baseline_" + Path(source_path).stem
    path = directory / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while it executes
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


# --- the captured turns ------------------------------------------------------------------------


def _record(messages: list[dict[str, Any]], reply: dict[str, Any], at: datetime) -> TurnRecord:
    return turn_record(messages, reply, at=at, model="policy", params={"temperature": 0.7, "max_tokens": 256},
                       response_id=f"chatcmpl-{uuid.uuid4().hex[:12]}",
                       prompt_token_ids=list(range(40 * len(messages))), token_ids=list(range(24)),
                       logprobs=[-0.5] * 24, latency_ms=12.5,
                       usage={"prompt_tokens": 40 * len(messages), "completion_tokens": 24})


def _conversation(tag: str) -> list[tuple[list[dict[str, Any]], dict[str, Any]]]:
    """(request messages, reply) of three turns of one conversation, as tests/datapool/test_sessions.py has."""
    sys_msg = {"role": "system", "content": f"You are a careful assistant. Conversation {tag}."}
    u1 = {"role": "user", "content": f"Hi, I am working on task {tag}."}
    a1 = {"role": "assistant", "content": f"Hello! What do you need for {tag}?"}
    u2 = {"role": "user", "content": "What is 2+2?"}
    a2 = {"role": "assistant", "content": None, "tool_calls": [
        {"id": f"c-{tag}", "type": "function", "function": {"name": "calc", "arguments": '{"e":"2+2"}'}}]}
    tool = {"role": "tool", "tool_call_id": f"c-{tag}", "content": "4"}
    a3 = {"role": "assistant", "content": "It is 4."}
    # the client echoes the replies back with SDK noise: null fields, text as parts
    a1_echo = {"role": "assistant", "content": [{"type": "text", "text": a1["content"]}], "refusal": None}
    a2_echo = dict(a2, content="", audio=None)
    return [
        ([sys_msg, u1], a1),
        ([sys_msg, u1, a1_echo, u2], a2),
        ([sys_msg, u1, a1_echo, u2, a2_echo, tool], a3),
    ]


def _question(tag: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """A conversation of one turn."""
    return [{"role": "user", "content": f"One question ({tag}): what time is it?"}], {
        "role": "assistant", "content": "I cannot tell the time."}


def traffic(turns: int, single_share: float, concurrency: int, seed: int) -> list[TurnRecord]:
    """``turns`` records in the order a gateway would capture them: ``concurrency``
    conversations under way at a time, a turn's child captured after it."""
    rng = random.Random(seed)
    singles = round(turns * single_share)
    conversations = (turns - singles) // 3
    singles = turns - 3 * conversations
    starts = [3] * conversations + [1] * singles
    rng.shuffle(starts)
    pending: list[list[tuple[list[dict[str, Any]], dict[str, Any]]]] = []
    out: list[TurnRecord] = []
    at = T0
    started = 0
    while started < len(starts) or pending:
        while started < len(starts) and len(pending) < concurrency:
            tag = f"{seed}-{started}"
            pending.append(_conversation(tag) if starts[started] == 3 else [_question(tag)])
            started += 1
        steps = pending.pop(rng.randrange(len(pending)))
        at += timedelta(milliseconds=rng.randint(1, 10))
        messages, reply = steps.pop(0)
        out.append(_record(messages, reply, at))
        if steps:
            pending.append(steps)
    return out


# --- running one implementation ----------------------------------------------------------------


@dataclass
class Run:
    seconds: float
    cpu_seconds: float
    statements: int
    scoring_statements: int
    written: int
    ready: list[str]
    stitching: dict[str, Any]


def write(engine: Engine, stitcher: Callable[[OrmSession], Any], batches: Sequence[Sequence[TurnRecord]]) -> Run:
    """Write the batches through ``stitcher`` like the capture writer; count what it sent."""
    statements = scoring = 0

    def count(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        nonlocal statements, scoring
        statements += 1
        scoring += statement.startswith("INSERT INTO judgements")

    event.listen(engine, "before_cursor_execute", count)
    written, ready = 0, []
    wall, cpu = time.perf_counter(), time.process_time()
    for batch in batches:
        with OrmSession(engine) as db, db.begin():
            s = stitcher(db)
            written += s.write(batch)
        ready += s.ready
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    event.remove(engine, "before_cursor_execute", count)
    return Run(wall, cpu, statements, scoring, written, ready, stitching(engine))


def stitching(engine: Engine) -> dict[str, Any]:
    """What stitching decided, with each session named by its first turn's id (inferred
    sessions get random ids)."""
    with OrmSession(engine) as db:
        turns = db.execute(
            select(Turn.id, Turn.session_id, Turn.parent_turn_id, Turn.next_state)
            .order_by(Turn.created_at, Turn.id)
        ).all()
        name: dict[str, str] = {}
        for t in turns:
            name.setdefault(t.session_id, t.id)
        sessions = db.execute(select(Session.id, Session.source, Session.created_at, Session.updated_at,
                                     Session.ended_at.is_not(None).label("ended"))).all()
        marks = db.execute(select(Judgement.turn_id, Judgement.status)).all()
    return {
        # not the link hashes: their canonical form changed with migration 0007, the decisions did not
        "turns": {t.id: (name[t.session_id], t.parent_turn_id, t.next_state) for t in turns},
        "sessions": sorted(
            (name.get(s.id, "(empty)"), s.source, s.created_at, s.updated_at, bool(s.ended)) for s in sessions
        ),
        "scoring": sorted(tuple(m) for m in marks),
    }


def database_maker(stack: ExitStack, work: Path) -> Callable[[str], str]:
    """A function giving a fresh, migrated database of a kind ("postgresql" | "sqlite"): a file
    in ``work``, or a database on the local PostgreSQL service (else a throwaway cluster),
    dropped when ``stack`` closes."""
    from tests.support.pg import ThrowawayPostgres, fresh_database, service_dsn

    admin: list[str] = []

    def make(kind: str) -> str:
        if kind == "sqlite":
            url = f"sqlite:///{work / uuid.uuid4().hex}.db"
        else:
            if not admin:
                admin.append(service_dsn() or stack.enter_context(ThrowawayPostgres()).dsn)
            url, drop = fresh_database(admin[0], prefix="bench_stitch")
            stack.callback(drop)
        upgrade(url)
        return url

    return make


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.stitch", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--turns", type=int, default=5000, help="turns to write (default 5000)")
    ap.add_argument("--batch", type=int, default=256, help="turns per transaction (default 256, the capture writer's)")
    ap.add_argument("--single-share", type=float, default=0.25,
                    help="share of the turns that are single-turn conversations (default 0.25)")
    ap.add_argument("--concurrency", type=int, default=64, help="conversations under way at a time (default 64)")
    ap.add_argument("--databases", nargs="+", choices=["postgresql", "sqlite"], default=["postgresql", "sqlite"])
    ap.add_argument("--baseline", default=BASELINE,
                    help="git revision whose datapool/sessions.py is the per-record Stitcher (default: %(default).12s)")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)

    records = traffic(args.turns, args.single_share, args.concurrency, args.seed)
    batches = [records[i : i + args.batch] for i in range(0, len(records), args.batch)]
    print(f"{len(records)} turns in {len(batches)} batches of {args.batch}; "
          f"baseline {args.baseline[:12]}:datapool/sessions.py\n")
    head = f"{'database':<11} {'stitcher':<11} {'turns/s':>8} {'wall s':>7} {'CPU s':>6} {'stmts/turn':>10} {'scoring':>8}"
    print(head)
    print("-" * len(head))
    same_everywhere = True
    with ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-stitch-")))
        baseline = load_baseline(args.baseline, work)
        implementations = {"per-record": baseline.Stitcher, "set-based": current.Stitcher}
        fresh = database_maker(stack, work)
        for kind in args.databases:
            runs: dict[str, Run] = {}
            for label, stitcher in implementations.items():
                engine = make_engine(fresh(kind))
                try:
                    runs[label] = run = write(engine, stitcher, batches)
                finally:
                    engine.dispose()
                assert run.written == len(records)
                print(f"{kind:<11} {label:<11} {len(records) / run.seconds:>8.0f} {run.seconds:>7.2f} "
                      f"{run.cpu_seconds:>6.2f} {run.statements / len(records):>10.3f} "
                      f"{run.scoring_statements / len(records):>8.3f}")
            old, new = runs.values()
            same = old.stitching == new.stitching and old.ready == new.ready
            same_everywhere &= same
            print(f"{'':<11} {'speed-up':<11} {old.seconds / new.seconds:>7.1f}x   "
                  f"same stitching: {'yes' if same else 'NO'}")
    return 0 if same_everywhere else 1


if __name__ == "__main__":
    sys.exit(main())
