"""Alembic migrations: the same revisions pass on PostgreSQL and SQLite, up and down, and match the models."""

from __future__ import annotations

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import inspect

from datapool.db import alembic_config, current_revision, head_revision, make_engine
from datapool.models import Base


# SQLite cannot reflect the PostgreSQL-only expression indexes of turns (sorts NULLs last, search)
@pytest.mark.filterwarnings("ignore:autogenerate skipping metadata-specified expression-based index:UserWarning")
def test_migrations_round_trip_and_match_models(database_url: str) -> None:
    # the fixture has already upgraded to head
    engine = make_engine(database_url)
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    assert diff == [], f"models and migrations disagree: {diff}"
    assert {"sessions", "turns", "turn_continuations", "policy_versions", "votes", "judgements"} <= set(
        inspect(engine).get_table_names())
    engine.dispose()

    command.downgrade(alembic_config(database_url), "base")
    engine = make_engine(database_url)
    assert set(inspect(engine).get_table_names()) <= {"alembic_version"}
    engine.dispose()
    command.upgrade(alembic_config(database_url), "head")
    assert current_revision(database_url) == head_revision()


# --- 0007: the hashes that stitch sessions, recomputed in the tolerant canonical form ----------------


def _old_form(message: dict) -> dict:
    """The canonical form before 0007 (tool-call ids and argument strings compared as sent)."""
    content = message.get("content")
    if content is None:
        content = ""
    elif isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        content = "".join(str(p.get("text", "")) for p in content)
    out = {"role": message.get("role"), "content": content}
    if message.get("tool_calls"):
        out["tool_calls"] = [[c.get("id"), c["function"]["name"], c["function"]["arguments"]]
                             for c in message["tool_calls"]]
    for key in ("tool_call_id", "name"):
        if message.get(key):
            out[key] = message[key]
    return out


def _old_hash(messages: list) -> str:
    import hashlib
    import json

    h = hashlib.sha256()
    for m in messages:
        h.update(json.dumps(_old_form(m), sort_keys=True, ensure_ascii=False).encode())
        h.update(b"\x1e")
    return h.hexdigest()


def test_0007_rehashes_a_pool_written_with_the_old_form(database_url: str) -> None:
    from click.testing import CliRunner
    from sqlalchemy import delete, insert, select, update
    from sqlalchemy.orm import Session as OrmSession

    from datapool.models import Turn, TurnContinuation
    from datapool.canonical import continuation_hashes, link_candidates
    from datapool.edits import stored_continuations as continuations_of
    from datapool.sessions import Stitcher
    from nextstate.cli import main
    from tests.support.records import openclaw_tool_loop

    first, rewritten = openclaw_tool_loop()
    engine = make_engine(database_url)
    with OrmSession(engine) as db, db.begin():
        Stitcher(db).write([first])
    # what a gateway before 0007 stored: its link hash and continuation in the old form
    old_continuation = _old_hash([*first.messages, *first.replies])
    with engine.begin() as conn:
        conn.execute(update(Turn).where(Turn.id == first.id).values(link_hash=None))
        conn.execute(delete(TurnContinuation))
        conn.execute(insert(TurnContinuation), [{"hash": old_continuation, "turn_id": first.id, "choice_index": 0}])
    assert old_continuation not in [h for _, h in link_candidates(rewritten.messages)]  # the split it caused
    engine.dispose()

    cfg = alembic_config(database_url)
    command.downgrade(cfg, ScriptDirectory.from_config(cfg).get_revision("0007").down_revision)
    command.upgrade(cfg, "head")

    engine = make_engine(database_url)
    with engine.connect() as conn:
        stored = conn.execute(select(TurnContinuation.hash).where(TurnContinuation.turn_id == first.id)).scalars().all()
    # the continuation of its reply, and the trajectory graph's keys (docs/sessions.md)
    assert set(continuation_hashes(first.messages, first.replies)) <= set(stored)
    assert set(stored) == {c.hash for c in continuations_of(first)}
    # the tool result, sent with the rewritten id, now continues the turn stored before the upgrade
    with OrmSession(engine) as db, db.begin():
        Stitcher(db).write([rewritten])
    with OrmSession(engine) as db:
        turns = {t.id: t for t in db.scalars(select(Turn))}
    assert turns[rewritten.id].session_id == turns[first.id].session_id
    assert turns[rewritten.id].parent_turn_id == first.id
    assert turns[first.id].next_state["turn_id"] == rewritten.id
    assert turns[rewritten.id].link_hash == link_candidates(rewritten.messages)[0][1]
    engine.dispose()

    # the same by hand: nothing left to change
    result = CliRunner().invoke(main, ["db", "rehash", "--database-url", database_url])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == "2 turns read, 0 rehashed; 0 held-out replies read, 0 rehashed"


# --- 0011: the eval gate's held-out prompts, keyed by the canonical history hash ------------------


def test_0011_pairs_held_out_prompts_whatever_their_spelling(database_url: str) -> None:
    import hashlib
    import json

    from click.testing import CliRunner
    from sqlalchemy import insert, select
    from sqlalchemy.orm import Session as OrmSession

    from datapool import evals
    from datapool.models import EvalReply
    from nextstate.cli import main

    prompt = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is 2 + 2?"}]
    # the same prompt as an SDK echoes it: content as text parts, null fields added
    spelled = [{"role": "system", "content": [{"type": "text", "text": "Answer briefly."}], "name": None},
               {"role": "user", "content": "What is 2 + 2?", "refusal": None}]
    other = [{"role": "user", "content": "What is 3 + 3?"}]

    def before_0011(messages: list) -> str:
        return hashlib.sha256(json.dumps(messages, sort_keys=True, ensure_ascii=False).encode()).hexdigest()

    assert before_0011(prompt) != before_0011(spelled)  # what split the pair before
    engine = make_engine(database_url)
    rows = [("base", prompt, "4"), ("v1", spelled, "four"), ("v1", other, "6")]
    with engine.begin() as conn:
        conn.execute(insert(EvalReply), [{"version": v, "prompt_hash": before_0011(p), "prompt": p, "reply": r,
                                          "score": 1.0, "created_at": evals.utcnow()} for v, p, r in rows])
    engine.dispose()

    cfg = alembic_config(database_url)
    command.downgrade(cfg, "0010")
    command.upgrade(cfg, "head")

    engine = make_engine(database_url)
    with OrmSession(engine) as db:
        base, v1 = evals.replies_of(db, "base"), evals.replies_of(db, "v1")
        stored = db.scalars(select(EvalReply).order_by(EvalReply.id)).all()
        assert [r.reply for r in stored] == ["4", "four", "6"]  # nothing lost or rewritten but the key
        assert [r.prompt for r in stored] == [p for _, p, _ in rows]
    shared = set(base) & set(v1)
    assert shared == {evals.prompt_hash(prompt)} == {evals.prompt_hash(spelled)}
    assert (base[evals.prompt_hash(prompt)]["reply"], v1[evals.prompt_hash(prompt)]["reply"]) == ("4", "four")
    assert evals.prompt_hash(other) in v1 and evals.prompt_hash(other) not in base
    engine.dispose()

    result = CliRunner().invoke(main, ["db", "rehash", "--database-url", database_url])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == "0 turns read, 0 rehashed; 3 held-out replies read, 0 rehashed"
