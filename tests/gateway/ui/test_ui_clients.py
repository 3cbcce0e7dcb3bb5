"""The admin UI's sessions list by client (docs/clients.md): the agent a session came from as a
column and a filter, and the person's first words instead of the agent's boilerplate."""

from __future__ import annotations

import uuid
from pathlib import Path

from sqlalchemy.orm import Session as OrmSession

from datapool.db import make_engine
from datapool.records import TurnRecord
from datapool.sessions import Stitcher
from gateway.clients import BUILTIN_PROFILES, first_words
from tests.support.admin_ui import admin_client
from tests.support.records import turn_record

REMINDER = "<system-reminder>\nToday's date is 2026-11-27.\n</system-reminder>"
CONTEXT = "<environment_context>\n  <cwd>/src</cwd>\n</environment_context>"


def _turn(client: str | None, content: object) -> TurnRecord:
    messages = [{"role": "system", "content": f"agent {uuid.uuid4().hex}"}, {"role": "user", "content": content}]
    return turn_record(messages, model="smollm2", client=client)


def test_first_words_skip_each_agents_boilerplate() -> None:
    skip = {p.name: p.skip_text for p in BUILTIN_PROFILES}
    parts = [{"type": "text", "text": REMINDER}, {"type": "text", "text": f"{REMINDER}\nfix the test\n"}]
    assert first_words(skip["claude-code"], [{"role": "user", "content": parts}]) == "fix the test"
    assert first_words(skip["codex"], [{"role": "user", "content": CONTEXT},
                                       {"role": "user", "content": "rename the flag"}]) == "rename the flag"
    stamped = "[Thu 2026-11-26 16:53 UTC] what's the weather\nRuntime: agent=main | sessionId=oc-1 | model=m"
    assert first_words(skip["openclaw"], [{"role": "user", "content": stamped}]) == "what's the weather"
    assert first_words(skip["claude-code"], [{"role": "user", "content": REMINDER}]) == ""


def test_sessions_list_shows_and_filters_the_client(database_url: str, tmp_path: Path) -> None:
    word = uuid.uuid4().hex[:8]
    claude = _turn("claude-code", [{"type": "text", "text": REMINDER}, {"type": "text", "text": f"fix {word}"}])
    codex = _turn("codex", f"{CONTEXT}\nrename {word}")
    engine = make_engine(database_url)
    with OrmSession(engine) as db, db.begin():
        Stitcher(db).write([claude, codex])
    engine.dispose()
    with admin_client(database_url, tmp_path) as client:
        page = client.get("/admin/sessions").text
        assert "<th>Client</th>" in page and ">claude-code<" in page and ">codex<" in page
        assert f"fix {word}" in page and f"rename {word}" in page
        assert "system-reminder" not in page and "environment_context" not in page
        only = client.get("/admin/sessions", params={"client": "codex"}).text
        assert f"rename {word}" in only and f"fix {word}" not in only
        assert '<option selected>codex</option>' in only
