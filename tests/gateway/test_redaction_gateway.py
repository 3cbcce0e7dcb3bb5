"""Acceptance of redaction before storage, through a real gateway process: secrets and personal data
planted in any field of any wire format (chat completions, responses, messages), streamed or not,
never appear in the pool, the spool, the exports (JSONL and Parquet), the logs, the admin UI, the
admin API or the OTLP spans (read back from a real receiver, Arize Phoenix: tests/support/phoenix.py), and
/metrics counts them per detector. With a real vLLM, the stored token ids do not decode to them:
tests/gateway/test_redaction_tokens.py (apart, so that this module and its Phoenix, a minute and
more to start, run on any worker under `make test`, not in the shared vLLM servers' group).

The upstream is tests/support/upstream.py (fast; its `FAKE TOOL CALL:` cue makes the reply carry
the planted text as tool-call arguments), so hypothesis can send many requests.
"""

from __future__ import annotations

import io
import json
import random
import sqlite3
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.support.upstream import UpstreamProcess
from tests.support.processes import GatewayProcess, wait_for
from tests.support.phoenix import PhoenixProcess
from tests.support.planted import PERSONAL, SECRETS

TOKEN = "admin-secret-token"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
PLANTED: list[str] = []  # every value planted by the property test, checked everywhere after it
SESSIONS: list[str] = []
TURNS: list[str] = []
PROJECT = f"redaction-{uuid.uuid4().hex[:8]}"  # the Phoenix project the gateway's spans go to


@pytest.fixture(scope="module")
def phoenix(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PhoenixProcess]:
    with PhoenixProcess(tmp_path_factory.mktemp("phoenix")) as p:
        yield p


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, phoenix: PhoenixProcess) -> Iterator[GatewayProcess]:
    d = tmp_path_factory.mktemp("redact-gw")
    with UpstreamProcess(d / "upstream.log") as upstream:
        models = upstream.model_list(d / "models.yaml")
        gw = GatewayProcess(d, database_url=f"sqlite:///{d / 'pool.db'}", model_list=models,
                            env={"NEXTSTATE_REDACT": "all", "NEXTSTATE_ADMIN_TOKEN": TOKEN,
                                 "NEXTSTATE_REDACT_PATTERNS": json.dumps({"employee_id": r"EMP-\d{6}"}),
                                 "NEXTSTATE_OTEL_TRACES": "1", **phoenix.env(PROJECT)})
        gw.start(timeout=300)  # LiteLLM's import is slow on two shared cores
        try:
            yield gw
        finally:
            gw.stop()


def _value(rng: random.Random) -> str:
    kind = rng.choice(sorted({**SECRETS, **PERSONAL}) + ["employee_id"])
    if kind == "employee_id":
        return f"EMP-{rng.randrange(10**5, 10**6)}"
    return {**SECRETS, **PERSONAL}[kind](rng)


FIELDS = {
    "chat": ["system", "user", "user_parts", "tool_result", "tool_call_arguments", "user_param", "reply"],
    "responses": ["instructions", "input", "function_call_output"],
    "messages": ["system", "user", "tool_result"],
}


def _request(fmt: str, field: str, value: str, stream: bool) -> tuple[str, dict[str, Any]]:
    """(path, body) of a request with *value* planted in *field*."""
    text = f"please keep this: {value} thanks"
    if fmt == "chat":
        messages: list[dict[str, Any]] = [{"role": "system", "content": text if field == "system" else "Be brief."}]
        if field == "tool_result" or field == "tool_call_arguments":
            messages += [{"role": "user", "content": "look it up"},
                         {"role": "assistant", "content": None, "tool_calls": [{
                             "id": "call_1", "type": "function", "function": {
                                 "name": "lookup", "arguments": json.dumps({"q": text if field == "tool_call_arguments" else "x"})}}]},
                         {"role": "tool", "tool_call_id": "call_1", "content": text if field == "tool_result" else "ok"}]
        elif field == "user_parts":
            messages.append({"role": "user", "content": [{"type": "text", "text": text}]})
        elif field == "reply":
            messages.append({"role": "user", "content": f"FAKE TOOL CALL: {json.dumps({'v': value})}"})
        else:
            messages.append({"role": "user", "content": text if field == "user" else "hello"})
        body: dict[str, Any] = {"model": "fixed", "messages": messages, "stream": stream and field != "reply"}
        if field == "user_param":
            body["user"] = value
        return "/v1/chat/completions", body
    if fmt == "responses":
        body = {"model": "fixed", "stream": stream, "instructions": text if field == "instructions" else "Be brief."}
        if field == "function_call_output":
            body["input"] = [{"type": "message", "role": "user", "content": "look it up"},
                             {"type": "function_call", "call_id": "call_1", "name": "lookup", "arguments": "{}"},
                             {"type": "function_call_output", "call_id": "call_1", "output": text}]
        else:
            body["input"] = text if field == "input" else "hello"
        return "/v1/responses", body
    body = {"model": "fixed", "max_tokens": 32, "stream": stream,
            "system": text if field == "system" else "Be brief."}
    if field == "tool_result":
        body["messages"] = [{"role": "user", "content": "look it up"},
                            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "lookup",
                                                               "input": {"q": "x"}}]},
                            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                          "content": text}]}]
    else:
        body["messages"] = [{"role": "user", "content": text if field == "user" else "hello"}]
    return "/v1/messages", body


@st.composite
def planted(draw: Any) -> tuple[str, str, str, bool]:
    fmt = draw(st.sampled_from(sorted(FIELDS)))
    field = draw(st.sampled_from(FIELDS[fmt]))
    value = _value(draw(st.randoms(use_true_random=False)))
    return fmt, field, value, draw(st.booleans())


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(planted())
@example(("chat", "user", "EMP-314159", False))  # the custom pattern, whatever the draw (checked below)
@example(("messages", "tool_result", "EMP-271828", True))
def test_planted_values_are_answered_and_stored_redacted(gateway: GatewayProcess, case: tuple[str, str, str, bool]) -> None:
    fmt, field, value, stream = case
    path, body = _request(fmt, field, value, stream)
    session = uuid.uuid4().hex
    resp = httpx.post(f"{gateway.url}{path}", json=body, headers={"X-Session-Id": session}, timeout=60)
    assert resp.status_code == 200, resp.text[:500]
    PLANTED.append(value)
    SESSIONS.append(session)
    turn = resp.headers["x-turn-id"]
    TURNS.append(turn)
    gateway.stored_turn(turn, headers=ADMIN, timeout=60)
    stored = httpx.get(f"{gateway.url}/api/turns/{turn}", headers=ADMIN, timeout=10).text
    assert value not in stored and "[REDACTED:" in stored, (fmt, field, stream, stored[:2000])


def _everything(gateway: GatewayProcess, phoenix: PhoenixProcess) -> dict[str, str]:
    """Every place a captured turn can end up, as text."""
    out: dict[str, str] = {}
    # every turn's span has reached the receiver (its trace id is the turn id)
    def arrived() -> list[dict[str, Any]] | None:
        spans = phoenix.spans(PROJECT)
        return spans if set(TURNS) <= {s["context"]["trace_id"] for s in spans} else None

    spans = wait_for(arrived, timeout=60, interval=0.5)
    out["otlp spans"] = json.dumps(spans, ensure_ascii=False)
    db = sqlite3.connect(gateway.data_dir / "pool.db")
    tables = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
    out["pool"] = "\n".join(repr(row) for t in tables for row in db.execute(f'SELECT * FROM "{t}"'))
    db.close()
    out["spool"] = "\n".join(p.read_text(errors="replace") for p in (gateway.data_dir / "spool").glob("*")
                             if p.is_file())
    out["logs"] = "\n".join(p.read_text(errors="replace") for p in gateway.data_dir.glob("*.log"))
    out["export.jsonl"] = httpx.get(f"{gateway.url}/api/export", params={"format": "jsonl"}, headers=ADMIN,
                                    timeout=60).text
    parquet = httpx.get(f"{gateway.url}/api/export", params={"format": "parquet"}, headers=ADMIN, timeout=60)
    assert parquet.status_code == 200
    out["export.parquet"] = json.dumps(pq.read_table(io.BytesIO(parquet.content)).to_pylist(), default=str)
    with httpx.Client(base_url=gateway.url, timeout=60) as ui:
        login = ui.post("/admin/login", data={"secret": TOKEN}, follow_redirects=True)
        assert login.status_code == 200
        pages = [ui.get("/admin/sessions").text, ui.get("/admin/turns").text]
        pages += [ui.get(f"/admin/sessions/{s}").text for s in SESSIONS]
        out["ui"] = "\n".join(pages)
    out["api"] = "\n".join(httpx.get(f"{gateway.url}/api/sessions/{s}", headers=ADMIN, timeout=30).text
                           for s in SESSIONS)
    return out


def test_nothing_planted_is_anywhere(gateway: GatewayProcess, phoenix: PhoenixProcess) -> None:
    assert PLANTED, "the property test runs first"
    places = _everything(gateway, phoenix)
    assert all(places[k] for k in ("pool", "export.jsonl", "export.parquet", "ui", "api", "otlp spans")), \
        {k: len(v) for k, v in places.items()}
    for value in PLANTED:
        for place, text in places.items():
            assert value not in text, (place, value)
            assert json.dumps(value)[1:-1] not in text, (place, value)  # nor JSON-escaped
    assert "[REDACTED:" in places["ui"]  # the UI shows the placeholder
    assert "[REDACTED:" in places["otlp spans"] and "gen_ai.input.messages" in places["otlp spans"]
    metrics = httpx.get(f"{gateway.url}/metrics", timeout=10).text
    counted = {line.split('"')[1] for line in metrics.splitlines()
               if line.startswith("nextstate_redactions_total{")}
    assert "employee_id" in counted and len(counted) >= 5, counted
