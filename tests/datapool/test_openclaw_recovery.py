"""OpenClaw's recovery pass, as the real client sends it (tests/support/records.py), through the real
Stitcher: it carries the tool loop's history without the system prompt, the tools, the arrival
stamp and the `Runtime:` line that holds the session key, so only the history can tie it to the
loop; it must join the loop's session as its last turn (edit `recovery`), whether the pass is
written with the loop or in a batch of its own. tests/agents/test_openclaw.py checks the same
with the real OpenClaw."""

from __future__ import annotations

import pytest
from sqlalchemy import Engine, select
from sqlalchemy.orm import Session as OrmSession

from datapool.edits import loose_forms
from datapool.models import Turn
from datapool.sessions import Stitcher
from tests.support.records import openclaw_recovery_pass


def test_the_arrival_stamp_and_runtime_line_do_not_make_a_user_message_another() -> None:
    call, empty, recovery = openclaw_recovery_pass()
    stamped = call.request["messages"][1]
    bare = recovery.request["messages"][0]
    assert stamped["content"] != bare["content"]
    assert loose_forms([stamped]) == loose_forms([bare])
    assert loose_forms([stamped]) != loose_forms([{"role": "user", "content": "Check the session status."}])


@pytest.mark.parametrize("batches", [[3], [1, 1, 1], [2, 1]], ids=["one-batch", "each-alone", "pass-alone"])
def test_the_recovery_pass_joins_the_tool_loop_as_its_last_turn(sqlite_engine: Engine, batches: list[int]) -> None:
    records = openclaw_recovery_pass()
    at = 0
    for n in batches:
        with OrmSession(sqlite_engine) as db, db.begin():
            Stitcher(db).write(records[at:at + n])
        at += n
    with OrmSession(sqlite_engine) as db:
        turns = {t.id: t for t in db.scalars(select(Turn))}
    call, empty, recovery = (turns[r.id] for r in records)
    assert call.session_id == empty.session_id == recovery.session_id == records[0].session_id
    assert recovery.parent_turn_id in {call.id, empty.id}
    assert recovery.edit == "recovery"
    assert [m["role"] for m in call.next_state["messages"]] == ["tool"]
