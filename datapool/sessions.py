"""Stitching captured calls into sessions and pairing each turn with its next state.

A request continues an earlier turn when its messages begin with that turn's request messages
followed by that turn's reply. Both sides are reduced to hashes of a canonical form of the
messages, so the match is a pool lookup and works across gateway replicas and out of order:
whichever of the two turns is written second makes the link.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import select, text, update
from sqlalchemy.orm import Session as OrmSession

from datapool.db import dialect_insert
from datapool.models import Session, Turn, TurnContinuation
from datapool.records import TurnRecord
from datapool.scoring import end_session, mark_pending

Message = dict[str, Any]


def _content_text(content: Any) -> Any:
    # Clients send the same text as a string or as [{"type": "text", "text": ...}] parts.
    if content is None:
        return ""
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" for p in content
    ):
        return "".join(str(p.get("text", "")) for p in content)
    return content


def canonical_message(message: Message) -> dict[str, Any]:
    """The parts of a message that identify it, in a form every client round-trips.

    SDKs echo an assistant reply back with extra null fields (refusal, audio, annotations),
    content ``None`` beside tool calls, or text as a list of parts; none of that matters.
    """
    out: dict[str, Any] = {"role": message.get("role"), "content": _content_text(message.get("content"))}
    calls = message.get("tool_calls")
    if calls:
        out["tool_calls"] = [
            [
                c.get("id"),
                (c.get("function") or {}).get("name"),
                (c.get("function") or {}).get("arguments"),
            ]
            for c in calls
        ]
    for key in ("tool_call_id", "name"):
        if message.get(key):
            out[key] = message[key]
    return out


def _feed(h: "hashlib._Hash", message: Message) -> None:
    h.update(json.dumps(canonical_message(message), sort_keys=True, ensure_ascii=False).encode())
    h.update(b"\x1e")


def _hasher(messages: Iterable[Message]) -> "hashlib._Hash":
    h = hashlib.sha256()
    for m in messages:
        _feed(h, m)
    return h


def link_candidates(messages: Sequence[Message]) -> list[tuple[int, str]]:
    """(index, hash of messages[: index + 1]) for every assistant message, longest prefix first.

    A continuing request's prefix ends with the reply it continues, so only prefixes that end
    at an assistant message can match an earlier turn.
    """
    h = hashlib.sha256()
    out: list[tuple[int, str]] = []
    for i, m in enumerate(messages):
        _feed(h, m)
        if m.get("role") == "assistant":
            out.append((i, h.copy().hexdigest()))
    out.reverse()
    return out


def continuation_hashes(messages: Sequence[Message], replies: Sequence[Message]) -> list[str]:
    """For each choice's reply, the hash a request continuing with that reply starts with."""
    base = _hasher(messages)
    out = []
    for reply in replies:
        h = base.copy()
        _feed(h, reply)
        out.append(h.hexdigest())
    return out


def lock_key(value: str) -> int:
    """A signed 64-bit key for pg_advisory_xact_lock."""
    return int.from_bytes(hashlib.sha256(value.encode()).digest()[:8], "big", signed=True)


def _next_state(child: Turn, start: int) -> dict[str, Any]:
    messages = (child.request or {}).get("messages") or []
    return {"turn_id": child.id, "messages": messages[start:]}


def _after_last_assistant(messages: Sequence[Message]) -> int:
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].get("role") == "assistant":
            return i + 1
    return len(messages)


class Stitcher:
    """Writes a batch of records in one transaction, linking each to its session and parent."""

    def __init__(self, db: OrmSession):
        self.db = db
        self.dialect = db.get_bind().dialect.name
        # turns whose next state became known in this batch: to be scored once it commits
        self.ready: list[str] = []

    def write(self, records: Sequence[TurnRecord]) -> int:
        """Insert the records not yet stored (a replayed spool may repeat some); returns how many."""
        if not records:
            return 0
        ids = [r.id for r in records]
        stored = set(self.db.scalars(select(Turn.id).where(Turn.id.in_(ids))))
        fresh = [r for r in records if r.id not in stored]
        prepared = [(r, link_candidates(r.messages), self._continuations(r)) for r in fresh]
        self._lock(prepared)
        for record, candidates, continuations in prepared:
            self._write_one(record, candidates, continuations)
        self.ready = mark_pending(self.db, self.ready)
        return len(fresh)

    @staticmethod
    def _continuations(r: TurnRecord) -> list[str]:
        if r.status != "ok" or r.turn_type != "main" or r.endpoint != "chat":
            return []
        return continuation_hashes(r.messages, r.replies)

    def _lock(self, prepared: list[tuple[TurnRecord, list[tuple[int, str]], list[str]]]) -> None:
        # Two replicas writing a parent and its child at the same moment would each miss the
        # other; serialising on the hash that links them makes one of them see the other.
        if self.dialect != "postgresql":
            return  # SQLite allows one writer at a time anyway
        keys: set[int] = set()
        for r, candidates, continuations in prepared:
            keys.update(lock_key(h) for _, h in candidates[:1])
            keys.update(lock_key(h) for h in continuations)
            if r.session_id:
                keys.add(lock_key("session:" + r.session_id))
        for key in sorted(keys):
            self.db.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": key})

    def _insert_ignore(self, table: Any, values: dict[str, Any]) -> None:
        self.db.execute(dialect_insert(self.db)(table).values(**values).on_conflict_do_nothing())

    def _write_one(
        self, r: TurnRecord, candidates: list[tuple[int, str]], continuations: list[str]
    ) -> None:
        parent: Turn | None = None
        prefix_end = 0  # index in r.messages where what r appended after the parent begins
        if r.session_id:
            session_id = r.session_id
            self._insert_ignore(
                Session.__table__,
                {
                    "id": session_id,
                    "source": r.session_source or "header",
                    "task_id": r.task_id,
                    "group_id": r.group_id,
                    "created_at": r.created_at,
                    "updated_at": r.created_at,
                    "metadata": {},
                },
            )
            parent, prefix_end = self._find_parent(candidates, session_id)
            if parent is None and r.turn_type == "main":
                parent = self._latest_main_turn(session_id, r.created_at)
                prefix_end = _after_last_assistant(r.messages)
        else:
            parent, prefix_end = self._find_parent(candidates, None)
            if parent is not None:
                session_id = parent.session_id
            else:
                session_id = uuid.uuid4().hex
                self.db.add(
                    Session(
                        id=session_id,
                        source="inferred",
                        task_id=r.task_id,
                        group_id=r.group_id,
                        created_at=r.created_at,
                        updated_at=r.created_at,
                        meta={},
                    )
                )
                self.db.flush()

        turn = Turn(
            id=r.id,
            session_id=session_id,
            parent_turn_id=parent.id if parent else None,
            turn_type=r.turn_type,
            endpoint=r.endpoint,
            status=r.status,
            created_at=r.created_at,
            model=r.model,
            upstream_model=r.upstream_model,
            policy_version=r.policy_version,
            capture=r.capture,
            request=r.request,
            response=r.response,
            prompt_token_ids=r.prompt_token_ids,
            token_ids=r.token_ids,
            logprobs=r.logprobs,
            latency_ms=r.latency_ms,
            usage=r.usage,
            error=r.error,
            link_hash=candidates[0][1] if candidates else None,
            response_id=(r.response or {}).get("id"),
        )
        self.db.add(turn)
        self.db.flush()
        if parent is not None and r.turn_type == "main" and parent.next_state is None:
            parent.next_state = _next_state(turn, prefix_end)
            self.ready.append(parent.id)

        for choice, h in enumerate(continuations):
            self.db.add(TurnContinuation(hash=h, turn_id=turn.id, choice_index=choice))
        if continuations:
            self.db.flush()
            self._adopt_orphans(turn, continuations)
        self.db.execute(
            update(Session)
            .where(Session.id == turn.session_id, Session.updated_at < r.created_at)
            .values(updated_at=r.created_at)
        )
        if r.session_done:
            self.ready += end_session(self.db, turn.session_id)

    def _find_parent(
        self, candidates: list[tuple[int, str]], session_id: str | None
    ) -> tuple[Turn | None, int]:
        for index, h in candidates:
            q = (
                select(Turn)
                .join(TurnContinuation, TurnContinuation.turn_id == Turn.id)
                .where(TurnContinuation.hash == h)
                .order_by(Turn.created_at, Turn.id)
                .limit(1)
            )
            if session_id is not None:
                q = q.where(Turn.session_id == session_id)
            parent = self.db.scalars(q).first()
            if parent is not None:
                return parent, index + 1
        return None, 0

    def _latest_main_turn(self, session_id: str, before: datetime) -> Turn | None:
        # An explicit session whose agent rewrote its history (compaction, a dropped system
        # prompt) still continues its latest turn; the next state is what follows the last
        # assistant message.
        return self.db.scalars(
            select(Turn)
            .where(
                Turn.session_id == session_id,
                Turn.turn_type == "main",
                Turn.status == "ok",
                Turn.created_at <= before,
            )
            .order_by(Turn.created_at.desc(), Turn.id.desc())
            .limit(1)
        ).first()

    def _adopt_orphans(self, turn: Turn, continuations: list[str]) -> None:
        """Link turns written before their parent (this turn) to it."""
        orphans = self.db.scalars(
            select(Turn)
            .where(
                Turn.link_hash.in_(continuations),
                Turn.parent_turn_id.is_(None),
                Turn.id != turn.id,
                Turn.created_at >= turn.created_at,
            )
            .order_by(Turn.created_at, Turn.id)
        ).all()
        for orphan in orphans:
            if orphan.session_id != turn.session_id:
                source = self.db.get(Session, orphan.session_id)
                if source is None or source.source != "inferred":
                    continue  # a named session is never merged into another
                old = orphan.session_id
                self.db.execute(
                    update(Turn).where(Turn.session_id == old).values(session_id=turn.session_id)
                )
                self.db.expire_all()
                self.db.delete(source)
                self.db.flush()
            orphan.parent_turn_id = turn.id
            if orphan.turn_type == "main" and turn.next_state is None:
                turn.next_state = _next_state(orphan, len(turn.request.get("messages") or []) + 1)
                self.ready.append(turn.id)
