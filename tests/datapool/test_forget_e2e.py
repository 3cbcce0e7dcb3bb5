"""`nextstate forget` end to end, on SQLite and PostgreSQL, while a real gateway keeps serving:
the session's data is gone from the pool and the idle spool, the versions that learned from it
are reported and tainted (a promotion of one is refused), the audit log has the entry; a
tenant's key forgets its own end user through POST /api/forget and nothing of another tenant's;
every request of a client calling throughout was answered."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

import httpx
from sqlalchemy import func, select
from sqlalchemy.orm import Session as OrmSession

from datapool.db import make_engine
from datapool.leases import ack, start_run
from datapool.models import PolicyVersion, TrainingLease, Turn, Vote
from tests.support.processes import GatewayProcess, wait_for
from tests.support.upstream import UpstreamProcess

ADMIN = {"Authorization": "Bearer admin-token-for-forget"}
ACME = {"Authorization": "Bearer key-acme"}
GLOBEX = {"Authorization": "Bearer key-globex"}


def _chat(gw: GatewayProcess, headers: dict[str, str], content: str, session: str | None = None,
          user: str | None = None) -> httpx.Response:
    h = dict(headers, **({"X-Session-Id": session} if session else {}))
    body = {"model": "fixed", "messages": [{"role": "user", "content": content}], **({"user": user} if user else {})}
    return httpx.post(f"{gw.base_url}/chat/completions", headers=h, json=body, timeout=60)


def _session_of(gw: GatewayProcess, turn_id: str) -> str:
    def found() -> str | None:
        r = httpx.get(f"{gw.url}/api/turns/{turn_id}", headers=ADMIN, timeout=10)
        return r.json()["session_id"] if r.status_code == 200 else None
    return wait_for(found, timeout=60)


def test_forget_while_the_gateway_serves(database_url: str, tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    with UpstreamProcess(tmp_path / "upstream.log") as upstream:
        models = upstream.model_list(tmp_path / "models.yaml")
        gw = GatewayProcess(tmp_path, database_url=database_url, model_list=models, env={
            "NEXTSTATE_ADMIN_TOKEN": ADMIN["Authorization"].split()[1], "NEXTSTATE_SPOOL_DIR": str(spool),
            "NEXTSTATE_TENANT_KEYS": json.dumps({"key-acme": "acme", "key-globex": "globex"})})
        gw.start(timeout=300)
        try:
            _run(gw, database_url, spool)
        finally:
            gw.stop()


def _run(gw: GatewayProcess, database_url: str, spool: Path) -> None:
    victim = [_chat(gw, ACME, f"secret plan {i}", session="victim").headers["x-turn-id"] for i in range(2)]
    bob = _chat(gw, ACME, "bob's question", session="bobs", user="bob").headers["x-turn-id"]
    kept = _chat(gw, ACME, "keep me", session="kept").headers["x-turn-id"]
    other_bob = _chat(gw, GLOBEX, "globex's bob", session="gbob", user="bob").headers["x-turn-id"]
    httpx.post(f"{gw.url}/api/capture/flush", headers=ADMIN, timeout=60)
    sid, bob_sid, other_sid = _session_of(gw, victim[1]), _session_of(gw, bob), _session_of(gw, other_bob)
    _session_of(gw, kept)

    # a run trained on the victim's turns and published v1; v1-child was trained from v1
    engine = make_engine(database_url)
    run = start_run(engine, objective="rl", backend="local", config={}, base_version=None)
    t0 = datetime.now(timezone.utc)
    tag = uuid.uuid4().hex[:6]
    with OrmSession(engine) as db, db.begin():
        db.add_all(TrainingLease(run_id=run, turn_id=t, leased_at=t0, expires_at=t0 + timedelta(minutes=9))
                   for t in victim)
        db.add(Vote(turn_id=victim[0], kind="prm", dedupe_key="k", judge="j", value=1))
        db.flush()
        ack(db, run, victim, 1)
        v1 = PolicyVersion(name=f"v1-{tag}", base_model="fixed", kind="lora", path="/nowhere", status="retired",
                           stats={"run_id": run, "step": 1})
        db.add(v1)
        db.flush()
        db.add(PolicyVersion(name=f"v1-child-{tag}", base_model="fixed", kind="lora", path="/nowhere2",
                             status="candidate", parent_id=v1.id, stats={}))
    # an idle spool file (a gateway that stopped while the pool was away) holding a victim turn
    (spool / "capture-9.jsonl").write_text(json.dumps({
        "id": uuid.uuid4().hex, "created_at": t0.isoformat(), "endpoint": "chat", "status": "ok", "model": "fixed",
        "capture": "black-box", "request": {"messages": [], "params": {}}, "session_id": sid}) + "\n")

    # a client calling all along
    answered: list[int] = []
    stop = threading.Event()

    def client() -> None:
        while not stop.is_set():
            try:
                answered.append(_chat(gw, GLOBEX, "still there?", session="busy").status_code)
            except httpx.HTTPError as exc:
                answered.append(-1)
                print("client:", exc)
    t = threading.Thread(target=client)
    t.start()
    try:
        cli = [sys.executable, "-m", "nextstate.cli", "forget", "--database-url", database_url,
               "--spool-dir", str(spool), "--json"]
        env = {**os.environ, "NEXTSTATE_DATA_DIR": str(gw.data_dir)}
        dry = json.loads(subprocess.run([*cli, "--session", sid, "--dry-run"], env=env, check=True,
                                        capture_output=True, text=True, timeout=120).stdout)
        assert dry["deleted"]["turns"] == 2 and dry["spool"]["removed"] == 1
        assert _count(engine, Turn, Turn.session_id == sid) == 2
        done = subprocess.run([*cli, "--session", sid, "--taint"], env=env, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr
        report = json.loads(done.stdout)
        # a tenant's key: its own end user only, and no tainting; bob's newest turn is not yet
        # written when the forget arrives (the gateway writes behind): the forget waits for it
        late = _chat(gw, ACME, "bob again", session="bobs", user="bob").headers["x-turn-id"]
        tenant = httpx.post(f"{gw.url}/api/forget", headers=ACME, json={"user": "bob"}, timeout=60)
        refused = httpx.post(f"{gw.url}/api/forget", headers=ACME, json={"user": "bob", "taint": True}, timeout=60)
        bad = httpx.post(f"{gw.url}/api/forget", headers=ADMIN, json={"user": "bob", "tenant": "acme"}, timeout=60)
        audit_by_tenant = httpx.get(f"{gw.url}/api/audit", headers=ACME, timeout=30)
        promote = httpx.post(f"{gw.url}/api/policy/promote", headers=ADMIN, json={"name": f"v1-child-{tag}"},
                             timeout=60)
        wait_for(lambda: len(answered) >= 5, timeout=120)
    finally:
        stop.set()
        t.join(timeout=120)

    assert report["deleted"]["turns"] == 2 and report["deleted"]["votes"] == 1
    assert report["deleted"]["training_leases"] == 2 and report["spool"]["removed"] == 1
    assert {v["name"]: v["learned"] for v in report["versions"]} == {f"v1-{tag}": "trained",
                                                                     f"v1-child-{tag}": "inherited"}
    assert report["tainted"] == sorted([f"v1-{tag}", f"v1-child-{tag}"])
    assert _count(engine, Turn, Turn.session_id == sid) == 0 and _count(engine, Vote, Vote.turn_id.in_(victim)) == 0
    assert httpx.get(f"{gw.url}/api/sessions/{sid}", headers=ADMIN, timeout=10).status_code == 404
    assert not (spool / "capture-9.jsonl").read_text()
    with OrmSession(engine) as db:
        assert set(db.scalars(select(PolicyVersion.name).where(PolicyVersion.tainted.is_(True)))) >= set(report["tainted"])

    assert tenant.status_code == 200 and tenant.json()["deleted"]["turns"] == 2, tenant.text
    assert _count(engine, Turn, Turn.session_id == bob_sid) == 0 and _count(engine, Turn, Turn.id == late) == 0
    assert _count(engine, Turn, Turn.session_id == other_sid) == 1  # globex's bob stays
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "admin_only"
    assert bad.status_code == 400
    assert audit_by_tenant.status_code == 403
    assert promote.status_code == 409 and "tainted" in promote.text

    log = httpx.get(f"{gw.url}/api/audit", headers=ADMIN, timeout=30).json()["data"]
    forgets = [e for e in log if e["action"] == "forget"]
    assert [e["target"] for e in forgets[:2]] == ["user:bob", f"session:{sid}"]
    assert forgets[0]["actor"] == "tenant:acme" and forgets[1]["actor"].startswith("cli:")
    assert forgets[1]["details"]["deleted"]["turns"] == 2
    assert any(e["action"] == "taint" and e["details"]["versions"] == report["tainted"] for e in log)

    assert answered and all(s == 200 for s in answered), answered  # the gateway served throughout
    assert _count(engine, Turn, Turn.id == kept) == 1
    engine.dispose()


def _count(engine, model, *where) -> int:  # type: ignore[no-untyped-def]
    with OrmSession(engine) as db:
        return db.scalar(select(func.count()).select_from(model).where(*where)) or 0
