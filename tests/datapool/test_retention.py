"""Retention on a real pool (SQLite and PostgreSQL): turns older than the period lose their
content (request, reply, next state, token ids, hints, votes' text, tool-call arguments) and
keep their rows, rewards and usage; newer turns are untouched; no training run leases an expired
turn; each pass writes its audit entry; a second pass finds nothing; `nextstate db expire`."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta, timezone

from click.testing import CliRunner
from sqlalchemy import select
from sqlalchemy.orm import Session as OrmSession

from datapool import export, queries, retention
from datapool.browse import Browse
from datapool.db import make_engine, upgrade
from datapool.leases import lease, start_run
from datapool.models import AuditEntry, Judgement, ToolCallArguments, Turn, Vote
from datapool.records import TurnRecord
from datapool.sessions import Stitcher
from nextstate.cli import main
from tests.support.records import turn_record


def _turn(age_days: float) -> TurnRecord:
    return turn_record([{"role": "user", "content": "PRIVATE " + uuid.uuid4().hex}],
                       at=datetime.now(timezone.utc) - timedelta(days=age_days), response_id="r",
                       session_id=uuid.uuid4().hex, session_source="header", prompt_token_ids=[1, 2, 3],
                       token_ids=[4, 5], logprobs=[-0.1, -0.2], usage={"prompt_tokens": 3, "completion_tokens": 2})


def test_old_content_expires_and_the_numbers_stay(database_url: str) -> None:
    upgrade(database_url)
    engine = make_engine(database_url)
    old, new = _turn(10), _turn(1)
    with OrmSession(engine) as db, db.begin():
        Stitcher(db).write([old, new])
        for t in (old, new):
            db.merge(Judgement(turn_id=t.id, status="done", reward=0.5, hint="do X", teacher_logprobs=[-1.0]))
            db.add(Vote(turn_id=t.id, kind="prm", dedupe_key="k", judge="j", value=1, rationale="because PRIVATE"))
            db.add(ToolCallArguments(id=f"c-{t.id}", turn_id=t.id, arguments='{"secret": 1}'))
    assert retention.expire(engine, 5, actor="cli:t", dry_run=True)["turns"] >= 1
    done = retention.expire(engine, 5, actor="cli:t")
    assert done["turns"] >= 1
    with OrmSession(engine) as db:
        o, n = db.get(Turn, old.id), db.get(Turn, new.id)
        assert set(o.request) == {"expired_at"} and "PRIVATE" not in str(o.request)
        assert (o.response, o.next_state, o.prompt_token_ids, o.token_ids, o.logprobs, o.link_hash) == (None,) * 6
        assert o.usage == {"prompt_tokens": 3, "completion_tokens": 2} and o.status == "ok"
        j = db.get(Judgement, old.id)
        assert j.reward == 0.5 and j.hint is None and j.teacher_logprobs is None
        assert db.scalar(select(Vote.rationale).where(Vote.turn_id == old.id)) is None
        assert db.scalar(select(ToolCallArguments.id).where(ToolCallArguments.turn_id == old.id)) is None
        # the newer turn is untouched
        assert "PRIVATE" in str(n.request) and n.token_ids == [4, 5] and db.get(Judgement, new.id).hint == "do X"
        assert db.scalar(select(AuditEntry.details).where(AuditEntry.action == "expire")
                         .order_by(AuditEntry.id.desc()).limit(1))["turns"] == done["turns"]
    # what reads turns still reads an expired one: the API's turn and session, the export
    with OrmSession(engine) as db:
        assert queries.get_turn(db, old.id)["request"] == db.get(Turn, old.id).request
        assert queries.get_session(db, old.session_id) is not None
    exported = b"".join(export.jsonl(engine, Browse())).decode()
    assert old.id in exported and new.id in exported and old.request["messages"][0]["content"] not in exported
    run = start_run(engine, objective="rl", backend="local", config={}, base_version=None)
    leased = lease(engine, run, limit=1000)
    assert new.id in leased and old.id not in leased
    assert retention.expire(engine, 5, actor="cli:t")["turns"] == 0
    engine.dispose()


def test_db_expire_command(sqlite_url: str) -> None:
    upgrade(sqlite_url)
    engine = make_engine(sqlite_url)
    with OrmSession(engine) as db, db.begin():
        Stitcher(db).write([_turn(3)])
    out = CliRunner().invoke(main, ["db", "expire", "--database-url", sqlite_url])
    assert out.exit_code != 0 and "no retention period" in out.output
    out = CliRunner().invoke(main, ["db", "expire", "--database-url", sqlite_url, "--days", "2"])
    assert out.exit_code == 0 and "expired 1 turn(s)" in out.output, out.output
    out = CliRunner().invoke(main, ["db", "expire", "--database-url", sqlite_url], env={"NEXTSTATE_RETENTION_DAYS": "1"})
    assert out.exit_code == 0 and "expired 0 turn(s)" in out.output, out.output
    engine.dispose()


def test_the_workers_sweep_expires(sqlite_url: str) -> None:
    from datapool.queue import SWEEP_TASK
    from scoring.worker import build_worker_app
    from base.settings import Settings

    upgrade(sqlite_url)
    engine = make_engine(sqlite_url)
    old = _turn(3)
    with OrmSession(engine) as db, db.begin():
        Stitcher(db).write([old])
    settings = Settings(database_url=sqlite_url, broker_url="memory://", retention_days=2, judge_backend="python",
                        judge_python="tests.support.judges:verdict")
    build_worker_app(settings).tasks[SWEEP_TASK]()  # what beat runs every sweep_interval_s
    with OrmSession(engine) as db:
        assert set(db.get(Turn, old.id).request) == {"expired_at"}
        assert db.scalar(select(AuditEntry.actor).where(AuditEntry.action == "expire")) == "worker"
    engine.dispose()


def test_the_admin_ui_shows_an_expired_turn(sqlite_url: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from fastapi.testclient import TestClient

    from base.settings import Settings
    from gateway.app import create_app

    upgrade(sqlite_url)
    engine = make_engine(sqlite_url)
    old = _turn(3)
    with OrmSession(engine) as db, db.begin():
        Stitcher(db).write([old])
    retention.expire(engine, 2, actor="cli:t")
    settings = Settings(upstream_url="http://127.0.0.1:9/v1", database_url=sqlite_url, data_dir=tmp_path / "d")
    with TestClient(create_app(settings)) as client:
        for page in (f"/admin/sessions/{old.session_id}", "/admin/turns", "/admin/sessions"):
            r = client.get(page)
            assert r.status_code == 200 and old.request["messages"][0]["content"] not in r.text, page
    engine.dispose()
