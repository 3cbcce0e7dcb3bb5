"""Writing what stitching decided: the sessions and turns a batch made, the parents and next
states it changed, in a few bulk statements per flush.

datapool.sessions decides; datapool.stitch_reads holds what is known of the pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, and_, bindparam, delete, select, update
from sqlalchemy.orm import Session as OrmSession

from datapool.canonical import Prepared
from datapool.db import dialect_insert, insert_rows
from datapool.edits import TAIL_INDEX, is_system_free_index
from datapool.models import Session, ToolCallArguments, Turn, TurnContinuation
from datapool.records import TurnRecord
from datapool.stitch_reads import StitchTurn, clock
from base.vocab import TurnStatus, WireFormat

_turns = Turn.__table__
_sessions = Session.__table__
_set_next_state = (
    update(_turns)
    .where(_turns.c.id == bindparam("b_id"))
    .values(next_state=bindparam("b_next_state", type_=_turns.c.next_state.type))
)
_set_parent = (
    update(_turns).where(_turns.c.id == bindparam("b_id")).values(parent_turn_id=bindparam("b_parent"))
)
_touch_session = (
    update(_sessions)
    .where(_sessions.c.id == bindparam("b_id"), _sessions.c.updated_at < bindparam("b_at"))
    .values(updated_at=bindparam("b_at"))
)


def fill_continuation_keys(conn: Connection, *, missing: bool = False) -> None:
    """Copies each continuation row's turn time and kind onto it (``TurnContinuation.created_at``,
    ``answered``, ``system_free``, as ``PendingWrites.flush`` writes them): migration 0020 for every
    row; ``datapool.sessions.rehash`` for the rows without them (*missing*: those it rewrote, and
    those a gateway older than 0020 wrote)."""
    tc = TurnContinuation.__table__

    def of_turn(value: Any) -> Any:
        return select(value).where(_turns.c.id == tc.c.turn_id).scalar_subquery()

    fill = update(tc).values(created_at=of_turn(_turns.c.created_at),
                             answered=of_turn(_turns.c.status == TurnStatus.OK),
                             system_free=and_(tc.c.choice_index > TAIL_INDEX, tc.c.choice_index <= -2))
    conn.execute(fill.where(tc.c.created_at.is_(None)) if missing else fill)


class PendingWrites:
    """What a batch decided and has not written yet; flush() writes it."""

    def __init__(self, db: OrmSession):
        self.db = db
        self.new_sessions: dict[str, dict[str, Any]] = {}  # inferred: made by this batch
        self.named_sessions: dict[str, dict[str, Any]] = {}  # named: inserted unless present
        self.unstored: list[tuple[Prepared, StitchTurn]] = []
        self.changed_next_state: dict[str, StitchTurn] = {}
        self.changed_parent: dict[str, StitchTurn] = {}
        self.touched: dict[str, datetime] = {}  # session id -> newest created_at written into it

    def move_session(self, old: str, new: str) -> bool:
        """Move every turn of inferred session ``old`` into ``new`` and delete ``old``; whether
        stored turns moved (``old`` was in the pool, not only in this batch)."""
        if old in self.new_sessions:  # made by this batch and not written: only in memory
            del self.new_sessions[old]
            self.touched.pop(old, None)
            return False
        self.flush()  # the turns written so far move too, and ``new`` must exist
        self.db.execute(update(_turns).where(_turns.c.session_id == old).values(session_id=new))
        self.db.execute(delete(_sessions).where(_sessions.c.id == old))
        return True

    def flush(self) -> None:
        """Write what was decided since the last flush: a few bulk statements."""
        # the sessions this batch inferred have ids of its own making (uuid4): nothing to conflict with
        insert_rows(self.db, _sessions, [
            dict(row, updated_at=max(row["updated_at"], self.touched.get(sid, row["updated_at"]), key=clock))
            for sid, row in self.new_sessions.items()
        ])
        if self.named_sessions:
            self.db.execute(dialect_insert(self.db)(_sessions).on_conflict_do_nothing(),
                            list(self.named_sessions.values()))
        if self.unstored:
            insert_rows(self.db, _turns, [turn_row(p, t) for p, t in self.unstored])
            continuations = [
                {"hash": c.hash, "turn_id": t.id, "choice_index": c.choice_index, "created_at": t.created_at,
                 "answered": t.status == TurnStatus.OK, "system_free": is_system_free_index(c.choice_index)}
                for p, t in self.unstored
                for c in p.continuations
            ]
            if continuations:
                insert_rows(self.db, TurnContinuation.__table__, continuations)
            for _, t in self.unstored:
                t.stored = True
        if self.changed_next_state:
            self.db.execute(
                _set_next_state,
                [{"b_id": t.id, "b_next_state": t.next_state} for t in self.changed_next_state.values()],
            )
        if self.changed_parent:
            self.db.execute(
                _set_parent, [{"b_id": t.id, "b_parent": t.parent_id} for t in self.changed_parent.values()]
            )
        touched = [{"b_id": sid, "b_at": at} for sid, at in self.touched.items() if sid not in self.new_sessions]
        if touched:
            self.db.execute(_touch_session, touched)
        self.new_sessions.clear()
        self.named_sessions.clear()
        self.unstored.clear()
        self.changed_next_state.clear()
        self.changed_parent.clear()
        self.touched.clear()


def session_row(session_id: str, r: TurnRecord, source: str) -> dict[str, Any]:
    """The sessions row a record opens (*source*: "inferred", "header" or "path")."""
    return {
        "id": session_id,
        "source": source,
        "task_id": r.task_id,
        "group_id": r.group_id,
        "created_at": r.created_at,
        "updated_at": r.created_at,
        "metadata": {},
        "client": r.client,
        "tenant": r.tenant,
    }


def turn_row(p: Prepared, turn: StitchTurn) -> dict[str, Any]:
    """The turns row of a stitched record, stored under its longest link candidate."""
    r = p.record
    return {
        "id": r.id,
        "session_id": turn.session_id,
        "parent_turn_id": turn.parent_id,
        "turn_type": r.turn_type,
        "endpoint": r.endpoint,
        "wire_format": r.wire_format or r.endpoint,
        "status": r.status,
        "created_at": r.created_at,
        "model": r.model,
        "upstream_model": r.upstream_model,
        "policy_version": r.policy_version,
        "capture": r.capture,
        "request": r.request,
        "response": r.response,
        "next_state": turn.next_state,
        "prompt_token_ids": r.prompt_token_ids,
        "token_ids": r.token_ids,
        "logprobs": r.logprobs,
        "latency_ms": r.latency_ms,
        "usage": r.usage,
        "error": r.error,
        "redaction": r.redaction,
        "link_hash": p.candidates[0][1] if p.candidates else None,
        "response_id": (r.response or {}).get("id"),
        "edit": turn.edit,
    }


def store_sent_arguments(db: OrmSession, records: Sequence[TurnRecord]) -> None:
    """The arguments text of each tool call answered on /v1/messages, by call id, so any gateway
    can put it back when the client sends the call again as an object (models.ToolCallArguments)."""
    rows = []
    for r in records:
        if r.wire_format != WireFormat.MESSAGES or not r.response:
            continue
        for choice in r.response.get("choices") or ():
            for call in ((choice or {}).get("message") or {}).get("tool_calls") or ():
                fn = call.get("function") if isinstance(call, dict) else None
                if isinstance(fn, dict) and isinstance(call.get("id"), str) and isinstance(fn.get("arguments"), str):
                    rows.append({"id": call["id"][:256], "turn_id": r.id, "arguments": fn["arguments"]})
    if rows:
        db.execute(dialect_insert(db)(ToolCallArguments).values(rows).on_conflict_do_nothing())
