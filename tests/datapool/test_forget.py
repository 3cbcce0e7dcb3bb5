"""Forgetting on a real pool (SQLite and PostgreSQL): a session, a tenant or an end user's data
goes from every table keyed to it and from the idle spool files, the versions that learned from
it are reported and (with taint) never served again, and the audit log says who did it."""

from __future__ import annotations

import json
import threading
import time
import uuid
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import func, select
from sqlalchemy.orm import Session as OrmSession

from datapool import audit, evals, versions
from datapool.capture import Spool
from datapool.db import make_engine, upgrade
from base.errors import ForgetError, VersionTainted
from datapool.forget import forget, forget_waiting
from datapool.leases import ack, start_run
from datapool.models import (
    AuditEntry,
    EvalReply,
    Judgement,
    Label,
    PolicyVersion,
    Session,
    ToolCallArguments,
    TrainingLease,
    Turn,
    Vote,
)
from datapool.records import TurnRecord
from datapool.sessions import Stitcher
from publishing.publish import activate, rollback_tainted
from tests.support.records import turn_record


class _AdapterServer(ThreadingHTTPServer):
    """vLLM's adapter endpoints in miniature: /v1/models (the base ``b`` and what was loaded) and
    /v1/load_lora_adapter; no dev mode (``/weight_info`` 404), as a LoRA-only vLLM."""

    def __init__(self) -> None:
        self.adapters: dict[str, str] = {}
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a: object) -> None:
                pass

            def _send(self, code: int, body: object) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path == "/v1/models":
                    cards = [{"id": "b", "root": "b"}] + [{"id": n, "root": p, "parent": "b"}
                                                          for n, p in server.adapters.items()]
                    return self._send(200, {"data": cards})
                self._send(404, {"error": "no route"})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/v1/load_lora_adapter":
                    server.adapters[body["lora_name"]] = body["lora_path"]
                    return self._send(200, {})
                self._send(404, {"error": "no route"})

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1"


def _turn(session: str, tenant: str | None = None, user: str | None = None) -> TurnRecord:
    # as the gateway stores the body's other fields: in params
    params = ({"user": user} if "alice" in user else {"metadata": {"user_id": user}}) if user else None
    return turn_record([{"role": "user", "content": uuid.uuid4().hex}], capture="black-box", params=params,
                       response_id="r", session_id=session, session_source="header", tenant=tenant)


def _pool(database_url: str, adapters: Path) -> tuple:
    """Sessions of two tenants, signals on them, a run that trained on some, versions: ``old``
    (retired, clean), ``v1`` (active, trained on a1), ``v1child`` (its candidate child)."""
    upgrade(database_url)
    (adapters / "adapter_config.json").write_text("{}")
    engine = make_engine(database_url)
    tag = uuid.uuid4().hex[:8]
    a1, a2 = _turn(f"a-{tag}", tenant=f"acme-{tag}", user=f"alice-{tag}"), _turn(f"a-{tag}", tenant=f"acme-{tag}")
    b = _turn(f"b-{tag}", tenant=f"acme-{tag}", user=f"bob-{tag}")
    other = _turn(f"o-{tag}", tenant=f"other-{tag}", user=f"alice-{tag}-not")
    with OrmSession(engine) as db, db.begin():
        Stitcher(db).write([a1, a2, b, other])
    run = start_run(engine, objective="rl", backend="local", config={}, base_version=None)
    t0 = datetime.now(timezone.utc)
    with OrmSession(engine) as db, db.begin():
        for t in (a1, b, other):
            db.add(Vote(turn_id=t.id, kind="prm", dedupe_key="k", judge="j", value=1))
            db.merge(Judgement(turn_id=t.id, status="done", reward=1.0))
            db.add(Label(turn_id=t.id, kind="exclude", value=True, author="x"))
            db.add(ToolCallArguments(id=f"call-{t.id}", turn_id=t.id, arguments="{}"))
            db.add(TrainingLease(run_id=run, turn_id=t.id, leased_at=t0, expires_at=t0 + timedelta(minutes=10)))
        db.add(Label(session_id=a1.session_id, kind="exclude", value=True, author="x"))
        db.flush()
        ack(db, run, [a1.id], 1)
        ack(db, run, [other.id], 5)
        old = PolicyVersion(name=f"old-{tag}", base_model="b", kind="lora", path=str(adapters), status="retired",
                            created_at=t0 - timedelta(minutes=1), stats={})
        db.add(old)
        db.flush()
        v = PolicyVersion(name=f"v1-{tag}", base_model="b", kind="lora", path="/x/v1", status="active",
                          created_at=t0, parent_id=old.id, stats={"run_id": run, "step": 2})
        db.add(v)
        db.flush()
        db.add(PolicyVersion(name=f"v1child-{tag}", base_model="b", kind="lora", path="/x/c", status="candidate",
                             created_at=t0 + timedelta(minutes=1), parent_id=v.id, stats={}))
        db.execute(PolicyVersion.__table__.update().where(PolicyVersion.status == "active",
                                                          PolicyVersion.name != v.name).values(status="retired"))
    evals.record_replies(engine, "base", [a1.request["messages"], other.request["messages"]], ["x", "y"], [1.0, 0.0])
    return engine, tag, a1, a2, b, other


def _count(engine, model, *where) -> int:
    with OrmSession(engine) as db:
        return db.scalar(select(func.count()).select_from(model).where(*where)) or 0


def test_forget_session_deletes_everything_keyed_to_it_and_taints(database_url: str, tmp_path: Path) -> None:
    engine, tag, a1, a2, b, other = _pool(database_url, tmp_path)
    dry = forget(engine, session_id=a1.session_id, actor="cli:test", dry_run=True, taint=True)
    assert dry["deleted"] == {"sessions": 1, "turns": 2, "votes": 1, "judgements": 1, "labels": 2,
                              "tool_call_arguments": 1, "turn_continuations": dry["deleted"]["turn_continuations"],
                              "training_leases": 1, "eval_replies": 1}
    assert _count(engine, Turn, Turn.session_id == a1.session_id) == 2  # a dry run deletes nothing
    assert _count(engine, AuditEntry, AuditEntry.target == f"session:{a1.session_id}") == 0

    rep = forget(engine, session_id=a1.session_id, actor="cli:test", taint=True)
    assert {v["name"] for v in rep["versions"]} == {f"v1-{tag}", f"v1child-{tag}"}
    assert rep["tainted"] == sorted([f"v1-{tag}", f"v1child-{tag}"]) and rep["active_tainted"]
    for model, col in ((Turn, Turn.id), (Vote, Vote.turn_id), (Judgement, Judgement.turn_id),
                       (Label, Label.turn_id), (ToolCallArguments, ToolCallArguments.turn_id),
                       (TrainingLease, TrainingLease.turn_id)):
        assert _count(engine, model, col.in_([a1.id, a2.id])) == 0, model
    assert _count(engine, Session, Session.id == a1.session_id) == 0
    assert _count(engine, Label, Label.session_id == a1.session_id) == 0
    assert _count(engine, EvalReply, EvalReply.prompt_hash == evals.prompt_hash(a1.request["messages"])) == 0
    # the rest stays
    assert _count(engine, Turn, Turn.id.in_([b.id, other.id])) == 2
    assert _count(engine, EvalReply, EvalReply.prompt_hash == evals.prompt_hash(other.request["messages"])) == 1
    # audit: forget and taint, in the action's transaction
    with OrmSession(engine) as db:
        log = [e for e in audit.entries(db, limit=20) if tag in (e["target"] or "")]
    assert [e["action"] for e in log] == ["taint", "forget"]
    assert log[1]["actor"] == "cli:test" and log[1]["details"]["deleted"]["turns"] == 2
    # tainted: never promoted again, skipped by rollback; the active one is rolled back to the clean one
    with pytest.raises(VersionTainted, match="tainted"):
        activate(engine, f"v1child-{tag}", [])
    vllm = _AdapterServer()
    try:
        rolled = rollback_tainted(engine, [vllm.url], actor="cli:test")
        assert rolled is not None and rolled["active"]["name"] == f"old-{tag}"
        assert vllm.adapters == {f"old-{tag}": str(tmp_path.resolve())}
        assert rollback_tainted(engine, [vllm.url], actor="cli:test") is None
    finally:
        vllm.shutdown()
    with OrmSession(engine) as db:
        assert [e["action"] for e in audit.entries(db, limit=1)] == ["rollback"]
    engine.dispose()


@pytest.mark.parametrize("kind", ["tenant", "user"])
def test_forget_tenant_or_end_user(database_url: str, kind: str, tmp_path: Path) -> None:
    engine, tag, a1, a2, b, other = _pool(database_url, tmp_path)
    if kind == "tenant":
        rep = forget(engine, tenant=f"acme-{tag}", actor="token")
        gone, kept = [a1, a2, b], [other]
    else:
        rep = forget(engine, end_user=f"alice-{tag}", actor="token")
        gone, kept = [a1, a2], [b, other]  # alice's whole session, not bob's nor the look-alike id
    assert rep["deleted"]["turns"] == len(gone) and rep["tainted"] == []
    assert _count(engine, Turn, Turn.id.in_([t.id for t in gone])) == 0
    assert _count(engine, Turn, Turn.id.in_([t.id for t in kept])) == len(kept)
    with OrmSession(engine) as db:  # no taint asked: the versions are reported, not marked
        assert not any(db.scalars(select(PolicyVersion.tainted).where(PolicyVersion.name.like(f"%{tag}"))))
    engine.dispose()


def test_a_tenant_forgets_only_its_own(database_url: str, tmp_path: Path) -> None:
    engine, tag, a1, a2, b, other = _pool(database_url, tmp_path)
    rep = forget(engine, session_id=other.session_id, actor="tenant:x", within_tenant=f"acme-{tag}")
    assert rep["deleted"]["turns"] == 0 and _count(engine, Turn, Turn.id == other.id) == 1
    with pytest.raises(ForgetError):
        forget(engine, session_id="s", tenant="t", actor="token")
    engine.dispose()


def test_spool_files_lose_the_records(database_url: str, tmp_path: Path) -> None:
    engine, tag, a1, a2, b, other = _pool(database_url, tmp_path)
    spool = tmp_path / "spool"
    spool.mkdir()
    running = Spool(spool)  # a running gateway: holds the lock of its file
    assert running.path is not None and running.path.name == "capture-0.jsonl"
    running.append([a2])
    idle = spool / "capture-1.jsonl"  # a stopped gateway's file
    idle.write_text("".join(json.dumps(r.to_json()) + "\n" for r in (a1, b, a2)))
    (spool / "rejected.jsonl").write_text(json.dumps({"error": "x", "record": a1.to_json()}) + "\n")
    rep = forget(engine, session_id=a1.session_id, actor="token", spool_dir=spool)
    assert rep["spool"]["removed"] == 3
    assert rep["spool"]["held"] == {str(running.path): 1}
    assert [json.loads(line)["id"] for line in idle.read_text().splitlines()] == [b.id]
    assert (spool / "rejected.jsonl").read_text() == ""
    running.close()
    engine.dispose()


def test_a_version_trained_from_a_tainted_one_is_tainted(database_url: str, tmp_path: Path) -> None:
    engine, tag, a1, *_ = _pool(database_url, tmp_path)
    forget(engine, session_id=a1.session_id, actor="token", taint=True)
    parent = versions.check_new(engine, f"next-{tag}", f"v1-{tag}")
    with pytest.raises(VersionTainted, match="tainted version"):
        versions.register(engine, name=f"next-{tag}", kind="lora", base_model="b", path=tmp_path / "n",
                          parent_id=parent, activate=True, stats={}, actor="trainer", reason=None, metrics={})
    row, _ = versions.register(engine, name=f"next-{tag}", kind="lora", base_model="b", path=tmp_path / "n",
                               parent_id=parent, activate=False, stats={}, actor="trainer", reason=None, metrics={})
    assert row["tainted"] and row["status"] == "candidate"
    engine.dispose()


_WORLD = st.lists(st.tuples(st.sampled_from(["t1", "t2", None]), st.sampled_from(["u1", "u2", None]),
                            st.integers(1, 3)), min_size=1, max_size=6)


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(world=_WORLD, kind=st.sampled_from(["session", "tenant", "user"]), pick=st.integers(0, 5),
       value=st.sampled_from(["t1", "t2", "u1", "u2"]), caller=st.sampled_from([None, "t1", "t2"]))
def test_forget_takes_exactly_what_it_names(sqlite_engine, world, kind, pick, value, caller) -> None:  # type: ignore[no-untyped-def]
    """Any mix of sessions (tenant, end user, turns) and any target, by the admin or a tenant:
    exactly the named sessions within the caller's tenant go, whole; the others keep every turn."""
    tag = uuid.uuid4().hex[:8]
    sessions: dict[str, tuple[str | None, str | None, list[str]]] = {}
    records = []
    for i, (tenant, user, n) in enumerate(world):
        sid = f"{tag}-{i}"
        t = f"{tenant}-{tag}" if tenant else None
        u = f"{user}-{tag}" if user else None
        turns = [_turn(sid, tenant=t, user=u if j == n - 1 else None) for j in range(n)]  # the user in one turn
        sessions[sid] = (t, u, [r.id for r in turns])
        records += turns
    with OrmSession(sqlite_engine) as db, db.begin():
        Stitcher(db).write(records)
    target = {"session": {"session_id": sorted(sessions)[pick % len(sessions)]},
              "tenant": {"tenant": f"{value}-{tag}"}, "user": {"end_user": f"{value}-{tag}"}}[kind]
    within = f"{caller}-{tag}" if caller else None
    rep = forget(sqlite_engine, actor="token", within_tenant=within, **target)

    def named(sid: str) -> bool:
        t, u, _ = sessions[sid]
        hit = {"session": sid == target.get("session_id"), "tenant": t == target.get("tenant"),
               "user": u is not None and u == target.get("end_user")}[kind]
        return hit and (within is None or t == within)
    gone = {sid for sid in sessions if named(sid)}
    assert rep["deleted"]["sessions"] == len(gone)
    assert rep["deleted"]["turns"] == sum(len(sessions[s][2]) for s in gone)
    for sid, (_, _, turns) in sessions.items():
        assert _count(sqlite_engine, Turn, Turn.id.in_(turns)) == (0 if sid in gone else len(turns)), sid


def test_the_forget_and_audit_commands(sqlite_url: str, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from nextstate.cli import main

    engine, tag, a1, *_ = _pool(sqlite_url, tmp_path)
    runner = CliRunner()
    out = runner.invoke(main, ["forget", "--database-url", sqlite_url])
    assert out.exit_code == 2 and "exactly one of" in out.output
    out = runner.invoke(main, ["forget", "--database-url", sqlite_url, "--session", a1.session_id, "--dry-run",
                               "--spool-dir", str(tmp_path / "none")])
    assert out.exit_code == 0, out.output
    assert "would delete: 1 sessions, 2 turns" in out.output and f"v1-{tag} (active, trained)" in out.output
    assert _count(engine, Turn, Turn.session_id == a1.session_id) == 2
    out = runner.invoke(main, ["forget", "--database-url", sqlite_url, "--session", a1.session_id])
    assert out.exit_code == 0 and "deleted: 1 sessions, 2 turns" in out.output and "[tainted]" not in out.output
    out = runner.invoke(main, ["audit", "--database-url", sqlite_url, "--action", "forget"])
    assert out.exit_code == 0 and f"forget     session:{a1.session_id}" in out.output, out.output
    engine.dispose()


def test_forget_waits_for_a_running_gateways_spool(database_url: str, tmp_path: Path) -> None:
    """A running gateway's spool holds a record of the session (the pool was away): forget leaves
    its file alone, waits while the gateway replays it into the pool, and forgets it then."""
    engine, tag, a1, a2, b, other = _pool(database_url, tmp_path)
    late = _turn(a1.session_id, tenant=a1.tenant)
    spool_dir = tmp_path / "spool"
    running = Spool(spool_dir)
    running.append([late])

    def replay() -> None:  # what the gateway's writer does once the pool answers
        time.sleep(1.0)
        chunk = running.chunk(None)
        with OrmSession(engine) as db, db.begin():
            Stitcher(db).write(chunk.records)
        running.advance(chunk)
    t = threading.Thread(target=replay)
    t.start()
    rep = forget_waiting(engine, 30, session_id=a1.session_id, actor="token", spool_dir=spool_dir, poll_s=0.2)
    t.join()
    assert rep["passes"] == 2 and rep["spool"]["held"] == {}
    assert rep["deleted"]["turns"] == 3  # a1, a2, then the replayed one
    assert _count(engine, Turn, Turn.session_id == a1.session_id) == 0
    # no gateway replays: the wait ends and the report says what is still held
    stuck = Spool(tmp_path / "spool2")
    stuck.append([_turn(b.session_id, tenant=b.tenant)])
    rep = forget_waiting(engine, 0.5, session_id=b.session_id, actor="token", spool_dir=tmp_path / "spool2", poll_s=0.1)
    assert rep["passes"] == 1 and rep["spool"]["held"] == {str(stuck.path): 1}
    running.close()
    stuck.close()
    engine.dispose()
