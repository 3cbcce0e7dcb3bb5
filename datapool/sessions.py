"""Stitching captured calls into sessions and pairing each turn with its next state.

A request continues an earlier turn when its messages begin with that turn's request messages
followed by that turn's reply. Both sides are reduced to hashes of a canonical form of the
messages, so the match is a pool lookup and works across gateway replicas and out of order:
whichever of the two turns is written second makes the link.

A batch is stitched in memory, record by record in the order given, by the same rules as if
each record were written alone after the ones before it. What the pool already holds is read up
front in a few set-based queries and the outcome is written in bulk, so a batch costs a roughly
constant number of statements instead of several per turn (the gateway captures faster than a
per-turn writer can stitch). What needs the pool itself mid-batch (merging a stored inferred
session into another, a named session whose history was rewritten, a session's end) is done
where it occurs; those are rare.
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, NamedTuple

from sqlalchemy import Connection, Row, String, bindparam, delete, insert, inspect, literal, or_, select, text, update
from sqlalchemy.orm import Session as OrmSession

from datapool.db import as_utc, chunked, dialect_insert
from datapool.models import Session, ToolCallArguments, Turn, TurnContinuation
from datapool.records import TurnRecord
from datapool.judgements import end_session, mark_pending
from base.vocab import Endpoint, TurnKind, TurnStatus, WireFormat

Message = dict[str, Any]

def _plain(value: Any, *, drop_nulls: bool) -> Any:
    """A JSON value with integral floats as integers, the way every client round-trips it
    (JavaScript's JSON.stringify prints 1.0 as 1), and null members dropped if asked."""
    if isinstance(value, dict):
        return {str(k): _plain(v, drop_nulls=drop_nulls) for k, v in value.items()
                if v is not None or not drop_nulls}
    if isinstance(value, list):
        return [_plain(v, drop_nulls=drop_nulls) for v in value]
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    return value


# Context an agent wraps in these tags (Claude Code, Qwen Code: the date, the skills it offers,
# notes about files) is its own, re-rendered at will: Qwen Code's `--continue` sends the
# transcript without the reminders its first call carried. Not part of the history.
_REMINDER = re.compile(r"<system-reminder>[\s\S]*?</system-reminder>")


def _text(text: str) -> str:
    return _REMINDER.sub("", text) if "<system-reminder>" in text else text


def _content(content: Any) -> Any:
    """Text is the same text whether sent as a string or as ``{"type": "text"}`` parts, and
    without the ``<system-reminder>`` blocks an agent puts in it; other parts (images, audio)
    count with their null fields dropped."""
    if content is None:
        return ""
    if isinstance(content, str):
        return _text(content)
    if not isinstance(content, list):
        return _plain(content, drop_nulls=True)
    out: list[Any] = []
    for part in content:
        if isinstance(part, dict) and part.get("type") == "text":
            text = _text(str(part.get("text") or ""))
            if out and isinstance(out[-1], str):
                out[-1] += text
            else:
                out.append(text)
        else:
            out.append(_plain(part, drop_nulls=True))
    if not out:
        return ""
    return out[0] if len(out) == 1 and isinstance(out[0], str) else out


def _arguments(arguments: Any) -> Any:
    """Tool-call arguments compared as the JSON they encode, not as the string that encodes it
    (clients re-serialise them: key order, whitespace, escapes). An empty string means no
    arguments; what is not JSON is compared as sent."""
    if arguments is None or arguments == "":
        return {}
    if isinstance(arguments, str):
        try:
            return _plain(json.loads(arguments), drop_nulls=False)
        except ValueError:
            return arguments
    return _plain(arguments, drop_nulls=False)


class CanonicalHistory:
    """A conversation's messages, fed in order, in the form matching compares, and the running
    hash of that form.

    Tool-call ids are not compared as strings: clients rewrite them (OpenClaw strips the dashes
    of ``chatcmpl-tool-…``). The n-th tool call of the conversation is call number n, matched by
    its position, function name and arguments; a tool message's ``tool_call_id`` is replaced by
    the number of the call that carried that id. The rules are in docs/sessions.md.
    """

    __slots__ = ("_hash", "_calls", "_count")

    def __init__(self) -> None:
        self._hash = hashlib.sha256()
        self._calls: dict[str, int] = {}  # tool-call id as this history spells it -> its number
        self._count = 0

    def copy(self) -> CanonicalHistory:
        other = CanonicalHistory.__new__(CanonicalHistory)
        other._hash = self._hash.copy()
        other._calls = dict(self._calls)
        other._count = self._count
        return other

    def hexdigest(self) -> str:
        return self._hash.hexdigest()

    def add(self, message: Message) -> dict[str, Any]:
        """Feed one message; returns its canonical form."""
        canon = self.canonical(message)
        self._hash.update(json.dumps(canon, sort_keys=True, ensure_ascii=False).encode())
        self._hash.update(b"\x1e")
        return canon

    def canonical(self, message: Message) -> dict[str, Any]:
        """The parts of a message that identify it; numbers the message's tool calls.

        SDKs echo an assistant reply back with extra null fields (refusal, audio, annotations),
        content ``None`` beside tool calls, text as a list of parts, a ``name`` added; none of
        that matters.
        """
        out: dict[str, Any] = {"role": message.get("role"), "content": _content(message.get("content"))}
        calls = message.get("tool_calls")
        if isinstance(calls, list) and calls:
            canon_calls = []
            for call in calls:
                call = call if isinstance(call, dict) else {}
                fn = call.get("function") if isinstance(call.get("function"), dict) else {}
                call_id = call.get("id")
                if isinstance(call_id, str) and call_id:
                    self._calls[call_id] = self._count  # an id used twice names its latest call
                self._count += 1
                canon_calls.append([fn.get("name"), _arguments(fn.get("arguments"))])
            out["tool_calls"] = canon_calls
        legacy = message.get("function_call")
        if isinstance(legacy, dict):
            out["function_call"] = [legacy.get("name"), _arguments(legacy.get("arguments"))]
        call_id = message.get("tool_call_id")
        if isinstance(call_id, str) and call_id:
            number = self._calls.get(call_id)
            # an id no earlier call carried stays a string, never equal to a number
            out["tool_call_id"] = number if number is not None else call_id
        return out


def canonical_message(message: Message) -> dict[str, Any]:
    """One message's canonical form, on its own (tool-call ids are numbered from 0)."""
    return CanonicalHistory().canonical(message)


def _hasher(messages: Iterable[Message]) -> CanonicalHistory:
    h = CanonicalHistory()
    for m in messages:
        h.add(m)
    return h


def history_hash(messages: Iterable[Message]) -> str:
    """The hash of a whole message history in the canonical form: the same for every client
    spelling of the same history (the eval gate's held-out prompts are keyed by it)."""
    return _hasher(messages).hexdigest()


class Prefixes:
    """One pass over a history: the canonical hash after each message (``digests[i]`` covers
    ``messages[: i + 1]``) and the hasher at its end. Every key stitching looks a request up by,
    or stores a turn under, is read from these, so a request's messages are canonicalized once
    (they were five times, once per kind of key)."""

    __slots__ = ("messages", "digests", "end")

    def __init__(self, messages: Sequence[Message]) -> None:
        self.messages = messages
        h = CanonicalHistory()
        self.digests: list[str] = []
        for m in messages:
            h.add(m)
            self.digests.append(h.hexdigest())
        self.end = h

    def links(self) -> list[tuple[int, str]]:
        """:func:`link_candidates`."""
        return [(i, self.digests[i]) for i in range(len(self.messages) - 1, -1, -1)
                if self.messages[i].get("role") == "assistant"]

    def retries(self) -> list[tuple[int, str]]:
        """:func:`retry_candidates`."""
        m = self.messages
        start = _after_last_assistant(m) if any(x.get("role") == "assistant" for x in m) else 1
        return [(k, _salted(self.digests[k - 1])) for k in range(len(m), start - 1, -1)]

    def request(self) -> str:
        """:func:`request_hash`."""
        return _salted(self.end.hexdigest())

    def continuations(self, replies: Sequence[Message]) -> list[str]:
        """:func:`continuation_hashes`."""
        out = []
        for reply in replies:
            h = self.end.copy()
            h.add(reply)
            out.append(h.hexdigest())
        return out


def link_candidates(messages: Sequence[Message]) -> list[tuple[int, str]]:
    """(index, hash of messages[: index + 1]) for every assistant message, longest prefix first.

    A continuing request's prefix ends with the reply it continues, so only prefixes that end
    at an assistant message can match an earlier turn.
    """
    return Prefixes(messages).links()


def continuation_hashes(messages: Sequence[Message], replies: Sequence[Message]) -> list[str]:
    """For each choice's reply, the hash a request continuing with that reply starts with."""
    return Prefixes(messages).continuations(replies)


def lock_key(value: str) -> int:
    """A signed 64-bit key for pg_advisory_xact_lock."""
    return int.from_bytes(hashlib.sha256(value.encode()).digest()[:8], "big", signed=True)


def _after_last_assistant(messages: Sequence[Message]) -> int:
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].get("role") == "assistant":
            return i + 1
    return len(messages)


_SYSTEM_ROLES = ("system", "developer")
_RETRY = -1  # the choice_index of a turn's request hash (see request_hash)


def _system_free_index(choice: int) -> int:
    """The choice_index of a choice's continuation without the system messages (-2, -3, ...)."""
    return -2 - choice


def request_hash(messages: Sequence[Message]) -> str:
    """The key under which a turn's own request is found by a request that extends it without a
    reply in between: a retry of a failed or cancelled call, or an agent that dropped the reply
    (mini-swe-agent drops one that made no tool call and says so in a new user message). Salted,
    so it never equals a continuation of a reply."""
    return Prefixes(messages).request()


def _salted(history: str) -> str:
    return hashlib.sha256(b"request\x1e" + history.encode()).hexdigest()


class Continuation(NamedTuple):
    hash: str
    choice_index: int  # the reply's choice; _RETRY for the request hash
    prefix: int  # how many messages a request continuing by this hash starts with


def continuations_of(r: TurnRecord, prefixes: Prefixes | None = None,
                     system_free: Prefixes | None = None) -> list[Continuation]:
    """What a request continuing *r* may start with: each choice's reply after the messages,
    the same without the system (and developer) messages for an agent that drops them on the
    next call, and the request itself (request_hash). *prefixes* and *system_free*: the
    :class:`Prefixes` of its messages and of them without the system ones, if already made."""
    if r.turn_type != TurnKind.MAIN or r.endpoint != Endpoint.CHAT:
        return []
    messages = r.messages
    whole = prefixes or Prefixes(messages)
    out = [Continuation(whole.request(), _RETRY, len(messages))] if messages else []
    if r.status != TurnStatus.OK:
        return out
    out += [Continuation(h, i, len(messages) + 1) for i, h in enumerate(whole.continuations(r.replies))]
    if system_free is None:
        kept = _without_system(messages)
        system_free = Prefixes([messages[i] for i in kept]) if len(kept) < len(messages) else None
    if system_free is not None and system_free.messages:
        out += [Continuation(h, _system_free_index(i), len(system_free.messages) + 1)
                for i, h in enumerate(system_free.continuations(r.replies))]
    return out


def _without_system(messages: Sequence[Message]) -> list[int]:
    """The indices of the messages that are not system (or developer) messages."""
    return [i for i, m in enumerate(messages) if m.get("role") not in _SYSTEM_ROLES]


def system_free_candidates(messages: Sequence[Message]) -> list[tuple[int, str]]:
    """link_candidates of the messages without their system (and developer) messages, each
    index that of the assistant message in *messages*: what a request finds the turns by that
    were sent without the system prompt. Empty when there is none to leave out."""
    kept = _without_system(messages)
    if len(kept) == len(messages):
        return []
    return _system_free_links(kept, Prefixes([messages[i] for i in kept]))


def _system_free_links(kept: list[int], rest: Prefixes) -> list[tuple[int, str]]:
    return [(kept[i], h) for i, h in rest.links()]


def retry_candidates(messages: Sequence[Message]) -> list[tuple[int, str]]:
    """(k, request_hash(messages[:k])) for every prefix that covers the last assistant message,
    longest first: the turns a request extends without their reply (a retry when k is all of it)."""
    return Prefixes(messages).retries()


def rehash(conn: Connection, *, chunk: int = 500) -> tuple[int, int]:
    """Recompute every stored turn's link hash and continuation hashes with the canonical form
    of this version, so that requests arriving from now on find the turns stored before the
    form changed (migration 0007 runs it; so does ``nextstate db rehash``). Links already made
    stay as they are. Reads the turns in chunks ordered by id; returns (turns read,
    turns whose hashes changed)."""
    turns = Turn.__table__
    continuations = TurnContinuation.__table__
    # a tenant's turns hash with their tenant (tenant_hash); migration 0007 runs this before the
    # pool has tenants (0014)
    sessions = Session.__table__
    tenant = (sessions.c.tenant if "tenant" in {c["name"] for c in inspect(conn).get_columns("sessions")}
              else literal(None, String).label("tenant"))
    columns = (turns.c.id, turns.c.endpoint, turns.c.status, turns.c.turn_type, turns.c.request,
               turns.c.response, turns.c.link_hash, tenant)
    seen = changed = 0
    last = ""
    while True:
        rows = conn.execute(select(*columns).select_from(turns.join(sessions, sessions.c.id == turns.c.session_id))
                            .where(turns.c.id > last).order_by(turns.c.id).limit(chunk)).all()
        if not rows:
            return seen, changed
        last = rows[-1].id
        seen += len(rows)
        ids = [row.id for row in rows]
        stored: dict[str, set[tuple[str, int]]] = {}
        for c in conn.execute(select(continuations).where(continuations.c.turn_id.in_(ids))):
            stored.setdefault(c.turn_id, set()).add((c.hash, c.choice_index))
        links: list[dict[str, Any]] = []
        redo: list[str] = []  # turns whose continuations changed
        conts: list[dict[str, Any]] = []
        for row in rows:
            r = TurnRecord(id=row.id, created_at=datetime.min, endpoint=row.endpoint, status=row.status,
                           model="", capture="", request=row.request or {}, turn_type=row.turn_type,
                           response=row.response)
            candidates = link_candidates(r.messages)
            link = tenant_hash(row.tenant, candidates[0][1]) if candidates else None
            fresh = {(tenant_hash(row.tenant, c.hash), c.choice_index) for c in continuations_of(r)}
            if link != row.link_hash:
                links.append({"b_id": row.id, "b_link": link})
            if fresh != stored.get(row.id, set()):
                redo.append(row.id)
                conts += [{"hash": h, "turn_id": row.id, "choice_index": i} for h, i in fresh]
            changed += link != row.link_hash or fresh != stored.get(row.id, set())
        if links:
            conn.execute(update(turns).where(turns.c.id == bindparam("b_id")).values(link_hash=bindparam("b_link")),
                         links)
        if redo:
            conn.execute(delete(continuations).where(continuations.c.turn_id.in_(redo)))
            if conts:
                conn.execute(insert(continuations), conts)

def _longest(p: _Prepared) -> int:
    """Where what a record appended begins if its longest candidate matched."""
    return p.candidates[0][0] + 1 if p.candidates else 0


class _Prepared(NamedTuple):
    record: TurnRecord
    candidates: list[tuple[int, str]]  # link_candidates of its messages
    continuations: list[Continuation]  # what a request continuing it starts with
    retries: list[tuple[int, str]]  # retry_candidates of its messages
    system_free: list[tuple[int, str]]  # system_free_candidates of its messages


def tenant_hash(tenant: str | None, h: str) -> str:
    """A stitching hash of a tenant's turn: only the same tenant's requests find it, so the same
    conversation sent by two tenants never joins one session. Unchanged without a tenant."""
    return h if tenant is None else hashlib.sha256(f"tenant\x1e{tenant}\x1e{h}".encode()).hexdigest()


def prepare(r: TurnRecord) -> _Prepared:
    """Every hash stitching needs of a record, from one pass over its messages and one over
    them without the system messages (when it has any)."""
    whole = Prefixes(r.messages)
    kept = _without_system(r.messages)
    rest = Prefixes([r.messages[i] for i in kept]) if len(kept) < len(r.messages) else None
    return _Prepared(r, whole.links(), continuations_of(r, whole, rest),
                     whole.retries() if r.turn_type == TurnKind.MAIN else [],
                     _system_free_links(kept, rest) if rest is not None else [])


def _tenant_scoped(p: _Prepared) -> _Prepared:
    t = p.record.tenant
    if t is None:
        return p
    return _Prepared(p.record, [(i, tenant_hash(t, h)) for i, h in p.candidates],
                     [c._replace(hash=tenant_hash(t, c.hash)) for c in p.continuations],
                     [(k, tenant_hash(t, h)) for k, h in p.retries],
                     [(i, tenant_hash(t, h)) for i, h in p.system_free])


@dataclass(eq=False)
class _Turn:
    """A turn as stitching sees it, stored or from this batch. Once loaded, this object and not
    the pool is the truth for the rest of the batch; its changes reach the pool at a flush."""

    id: str
    session_id: str
    created_at: datetime  # as the database compares it: see _Batch.clock
    turn_type: str
    status: str
    parent_id: str | None
    has_next_state: bool
    stored: bool  # its row exists, so a change is an UPDATE rather than part of its INSERT
    messages: list[Message] | None = None  # its request's messages, loaded only for orphans
    next_state: dict[str, Any] | None = None  # set by this batch, not yet written
    # its parent is the turn its whole history continues (its longest candidate matched); a turn
    # linked to an earlier ancestor because its parent was not written yet is not, and is
    # re-parented when the parent comes
    exact: bool = True

    @property
    def order(self) -> tuple[datetime, str]:
        """The pool's ORDER BY created_at, id."""
        return (self.created_at, self.id)


# what stitching reads of a stored turn (never its request or response: those are large)
_COLUMNS = (
    Turn.id,
    Turn.session_id,
    Turn.created_at,
    Turn.turn_type,
    Turn.status,
    Turn.parent_turn_id,
    Turn.next_state.is_(None).label("open"),
)

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


class _Batch:
    """One batch stitched in memory over what the pool holds, written in bulk by flush()."""

    def __init__(self, db: OrmSession, prepared: Sequence[_Prepared]):
        self.db = db
        self.prepared = prepared
        self.ready: list[str] = []  # turns whose next state became known, in the order it did
        # what is known of the pool and of the batch so far
        self.turns: dict[str, _Turn] = {}
        self.members: dict[str, list[_Turn]] = {}  # session id -> its known turns
        self.by_hash: dict[str, dict[str, _Turn]] = {}  # continuation hash -> turns it continues
        self.fetched: set[str] = set()  # continuation hashes whose stored turns are in by_hash
        # (hash, turn id) of continuations with the turn's system messages left out
        self.system_left_out: set[tuple[str, str]] = set()
        self.by_link: dict[str, dict[str, _Turn]] = {}  # link hash -> turns that may be orphans
        self.sources: dict[str, str] = {}  # session id -> "inferred" | "header" | "path"
        self.latest: dict[str, _Turn | None] | None = None  # see _latest_stored
        # decided, not yet written
        self.new_sessions: dict[str, dict[str, Any]] = {}  # inferred: made by this batch
        self.named_sessions: dict[str, dict[str, Any]] = {}  # named: inserted unless present
        self.unstored: list[tuple[_Prepared, _Turn]] = []
        self.changed_next_state: dict[str, _Turn] = {}
        self.changed_parent: dict[str, _Turn] = {}
        self.touched: dict[str, datetime] = {}  # session id -> newest created_at written into it

    @staticmethod
    def clock(at: datetime) -> datetime:
        """``at`` as the pool compares it: an aware UTC instant (the UTCDateTime columns store
        and read every time so, SQLite included; a zoneless one is taken as UTC)."""
        return as_utc(at)

    def run(self) -> None:
        """Stitch the records in order, then write what is still unwritten."""
        self._load_orphans({c.hash for p in self.prepared for c in p.continuations})
        self._prefetch_parents()
        for p in self.prepared:
            self._stitch(p)
        self.flush()

    # -- reading the pool -------------------------------------------------------------------

    def _known(self, row: Row[Any]) -> _Turn:
        """The turn of a row of _COLUMNS; one that is already known keeps its in-memory state."""
        turn = self.turns.get(row.id)
        if turn is None:
            turn = _Turn(
                id=row.id,
                session_id=row.session_id,
                created_at=self.clock(row.created_at),
                turn_type=row.turn_type,
                status=row.status,
                parent_id=row.parent_turn_id,
                has_next_state=not row.open,
                stored=True,
            )
            self._add(turn)
        return turn

    def _add(self, turn: _Turn) -> None:
        self.turns[turn.id] = turn
        self.members.setdefault(turn.session_id, []).append(turn)

    def _load_orphans(self, hashes: set[str]) -> None:
        """Stored turns whose link hash is one of this batch's continuations and whose parent is
        not the turn that hash continues (none, or an earlier ancestor because the parent was
        not written yet): the turns a record of this batch may adopt. One query before
        stitching finds all of them."""
        exact = (
            select(TurnContinuation.turn_id)
            .where(TurnContinuation.turn_id == Turn.parent_turn_id, TurnContinuation.hash == Turn.link_hash)
            .correlate(Turn)
            .exists()
        )
        for chunk in chunked(hashes):
            rows = self.db.execute(
                select(*_COLUMNS, Turn.link_hash, Turn.request, Session.source)
                .join(Session, Session.id == Turn.session_id)
                .where(Turn.link_hash.in_(chunk), or_(Turn.parent_turn_id.is_(None), ~exact))
            )
            for row in rows:
                turn = self._known(row)
                turn.messages = list((row.request or {}).get("messages") or [])
                turn.exact = row.parent_turn_id is None
                self.by_link.setdefault(row.link_hash, {})[turn.id] = turn
                self.sources[row.session_id] = row.source

    def _load_parents(self, hashes: Iterable[str]) -> None:
        """The stored turns that requests starting with these hashes would continue."""
        todo = set(hashes) - self.fetched
        self.fetched |= todo
        for chunk in chunked(todo):
            rows = self.db.execute(
                select(TurnContinuation.hash, TurnContinuation.choice_index, *_COLUMNS)
                .join(Turn, Turn.id == TurnContinuation.turn_id)
                .where(TurnContinuation.hash.in_(chunk))
            )
            for row in rows:
                self.by_hash.setdefault(row.hash, {})[row.id] = self._known(row)
                if row.choice_index <= _system_free_index(0):
                    self.system_left_out.add((row.hash, row.id))

    def _prefetch_parents(self) -> None:
        """Loads, in two rounds of queries, the stored turns the records may continue: first each
        record's longest candidate (the one that matches unless a turn went uncaptured), then
        every candidate of the records that one cannot match. _find_parent loads what else it
        needs on its own."""
        self._load_parents({p.candidates[0][1] for p in self.prepared if p.candidates})
        earlier: set[str] = set()  # continuations of the records before this one
        rest: set[str] = set()
        for p in self.prepared:
            if len(p.candidates) > 1:
                longest = p.candidates[0][1]
                if longest not in earlier and not self.by_hash.get(longest):
                    rest.update(h for _, h in p.candidates[1:])
            earlier.update(c.hash for c in p.continuations)
        self._load_parents(rest | {h for p in self.prepared for _, h in p.retries})

    def _load_latest(self, session_ids: Iterable[str], before: datetime) -> dict[str, _Turn | None]:
        """For each session, its stored main turn with the latest created_at <= ``before``."""
        latest = (
            select(Turn.id)
            .where(
                Turn.session_id == Session.id,
                Turn.turn_type == TurnKind.MAIN,
                Turn.status == TurnStatus.OK,
                Turn.created_at <= before,
            )
            .order_by(Turn.created_at.desc(), Turn.id.desc())
            .limit(1)
            .correlate(Session)
            .scalar_subquery()
        )
        found: dict[str, _Turn | None] = dict.fromkeys(session_ids)
        for chunk in chunked(found):
            rows = self.db.execute(
                select(*_COLUMNS).where(Turn.id.in_(select(latest).where(Session.id.in_(chunk))))
            )
            for row in rows:
                found[row.session_id] = self._known(row)
        return found

    def _latest_stored(self, session_id: str, before: datetime) -> _Turn | None:
        """The stored part of _latest_main_turn. The first call asks for every named session of
        the batch at once, up to the batch's newest record; a record older than the answer, or a
        session that stored turns were merged into since, is asked about on its own."""
        if self.latest is None:
            named = [p.record for p in self.prepared if p.record.session_id and p.record.turn_type == TurnKind.MAIN]
            newest = max((r.created_at for r in named), key=self.clock)
            self.latest = self._load_latest({r.session_id for r in named if r.session_id}, newest)
        if session_id in self.latest:
            hit = self.latest[session_id]
            if hit is None or hit.created_at <= self.clock(before):
                return hit
        return self._load_latest([session_id], before)[session_id]

    def _source(self, session_id: str) -> str:
        if session_id not in self.sources:
            # a named session of this batch may exist already; then its stored source holds
            stored = self.db.scalar(select(Session.source).where(Session.id == session_id))
            self.sources[session_id] = stored or self.named_sessions[session_id]["source"]
        return self.sources[session_id]

    # -- stitching, one record at a time ----------------------------------------------------

    def _stitch(self, p: _Prepared) -> None:
        r = p.record
        parent: _Turn | None = None
        prefix_end = 0  # index in r.messages where what r appended after the parent begins
        if r.session_id:
            session_id = r.session_id
            self.named_sessions.setdefault(session_id, _session_row(session_id, r, r.session_source or "header"))
            parent, prefix_end = self._find_parent(p, session_id)
            # linked by its whole history, or past a parent that may still come
            exact = parent is None or prefix_end >= _longest(p)
            if parent is None and r.turn_type == TurnKind.MAIN:
                parent = self._latest_main_turn(session_id, r.created_at)
                prefix_end = _after_last_assistant(r.messages)
                exact = parent is None
        else:
            parent, prefix_end = self._find_parent(p, None)
            exact = parent is None or prefix_end >= _longest(p)
            if parent is not None:
                session_id = parent.session_id
            else:
                session_id = uuid.uuid4().hex
                self.new_sessions[session_id] = _session_row(session_id, r, "inferred")
                self.sources[session_id] = "inferred"

        turn = _Turn(
            id=r.id,
            session_id=session_id,
            created_at=self.clock(r.created_at),
            turn_type=r.turn_type,
            status=r.status,
            parent_id=parent.id if parent else None,
            has_next_state=False,
            stored=False,
            messages=r.messages,
            exact=exact,
        )
        self._add(turn)
        self.unstored.append((p, turn))
        for c in p.continuations:
            self.by_hash.setdefault(c.hash, {})[turn.id] = turn
            if c.choice_index <= _system_free_index(0):
                self.system_left_out.add((c.hash, turn.id))
        if p.candidates:
            self.by_link.setdefault(p.candidates[0][1], {})[turn.id] = turn

        if parent is not None and r.turn_type == TurnKind.MAIN and parent.status == TurnStatus.OK and (
            not parent.has_next_state or (exact and self._skipped_to(parent))
        ):
            self._give_next_state(parent, r.id, r.messages[prefix_end:])
        if p.continuations:
            self._adopt_orphans(turn, p)
        # the session's updated_at follows the turns written into it, not those merged in later
        newest = self.touched.get(session_id)
        if newest is None or self.clock(newest) < turn.created_at:
            self.touched[session_id] = r.created_at
        if r.session_done:
            self.flush()  # end_session reads the session's turns from the pool
            self.ready += end_session(self.db, session_id)
            self.db.flush()

    def _find_parent(self, p: _Prepared, session_id: str | None) -> tuple[_Turn | None, int]:
        """The earliest turn whose continuation is the longest candidate any turn has (within
        the named session, if there is one), and where what the record appended begins.

        A turn whose request the record extends further without its reply (retry_candidates)
        wins over one whose reply it continues: the record retries a failed or cancelled call
        (the same messages: only a turn that failed), or goes on after a reply it dropped."""
        parent: _Turn | None = None
        prefix_end = 0
        for n, (index, h) in enumerate(p.candidates):
            if h not in self.fetched:
                self._load_parents(c for _, c in p.candidates[n:])
            turns = [t for t in self.by_hash.get(h, {}).values() if session_id is None or t.session_id == session_id]
            if turns:
                parent, prefix_end = min(turns, key=lambda t: t.order), index + 1
                break
        # the turn before may have been sent without the system prompt: it continues that turn's
        # history once its own system messages are left out (never a turn that had others)
        for n, (index, h) in enumerate(p.system_free):
            if index + 1 <= prefix_end:
                break
            if h not in self.fetched:
                self._load_parents(c for _, c in p.system_free[n:])
            turns = [t for t in self.by_hash.get(h, {}).values() if (session_id is None or t.session_id == session_id)
                     and (h, t.id) not in self.system_left_out]
            if turns:
                parent, prefix_end = min(turns, key=lambda t: t.order), index + 1
                break
        whole = len(p.record.messages)
        for n, (k, h) in enumerate(p.retries):
            if k <= prefix_end:
                break
            if h not in self.fetched:
                self._load_parents(c for _, c in p.retries[n:])
            turns = [t for t in self.by_hash.get(h, {}).values()
                     if (session_id is None or t.session_id == session_id) and t.id != p.record.id
                     and (k < whole or t.status != TurnStatus.OK)]
            if turns:
                # a turn that answered (its reply dropped) before one that failed on the same messages
                return min(turns, key=lambda t: (t.status != TurnStatus.OK, t.order)), k
        return parent, prefix_end

    def _latest_main_turn(self, session_id: str, before: datetime) -> _Turn | None:
        # An explicit session whose agent rewrote its history (compaction, a dropped system
        # prompt) still continues its latest turn; the next state is what follows the last
        # assistant message.
        at = self.clock(before)
        found = [
            t
            for t in self.members.get(session_id, ())
            if t.turn_type == TurnKind.MAIN and t.status == TurnStatus.OK and t.created_at <= at
        ]
        stored = self._latest_stored(session_id, before)
        if stored is not None:
            found.append(stored)
        return max(found, key=lambda t: t.order, default=None)

    def _adopt_orphans(self, turn: _Turn, p: _Prepared) -> None:
        """Link turns written before their parent (this turn) to it: those with no parent, and
        those linked to an earlier ancestor while this turn was missing."""
        orphans = {
            o.id: (o, c.prefix)  # where what the orphan appended begins
            for c in p.continuations
            for o in self.by_link.get(c.hash, {}).values()
            if (o.parent_id is None or not o.exact) and o.id != turn.id and o.created_at >= turn.created_at
        }
        for orphan, start in sorted(orphans.values(), key=lambda o: o[0].order):
            if orphan.session_id != turn.session_id:
                if self._source(orphan.session_id) != "inferred":
                    continue  # a named session is never merged into another
                self._merge(orphan.session_id, turn.session_id)
            orphan.parent_id = turn.id
            orphan.exact = True
            if orphan.stored:
                self.changed_parent[orphan.id] = orphan
            if orphan.turn_type == TurnKind.MAIN and not turn.has_next_state:
                self._give_next_state(turn, orphan.id, (orphan.messages or [])[start:])

    def _skipped_to(self, parent: _Turn) -> bool:
        """Whether the parent's next state came from a turn that is not its exact child: one
        that linked to it past its own missing parent (see _Turn.exact), or has moved under
        that parent since. A turn continuing the parent exactly then gives the next state."""
        state = parent.next_state
        if state is None and parent.stored:
            state = self.db.scalar(select(Turn.next_state).where(Turn.id == parent.id))
        child_id = (state or {}).get("turn_id")
        if not child_id:
            return False
        child = self.turns.get(child_id)
        if child is not None and (not child.stored or child.messages is not None):
            # stitched by this batch, or loaded with its exactness
            return child.parent_id != parent.id or not child.exact
        exact = (
            select(TurnContinuation.turn_id)
            .where(TurnContinuation.turn_id == parent.id, TurnContinuation.hash == Turn.link_hash)
            .correlate(Turn)
            .exists()
        )
        skipped = self.db.execute(
            select(Turn.parent_turn_id, Turn.request, Session.tenant)
            .join(Session, Session.id == Turn.session_id)
            .where(Turn.id == child_id, or_(Turn.parent_turn_id != parent.id, ~exact))
        ).first()
        if skipped is None:
            return False
        if skipped.parent_turn_id != parent.id:
            return True
        # its link hash keeps its system prompt: a child that has it again after a parent sent
        # without it continues the parent's whole history once its system messages are left out
        free = system_free_candidates((skipped.request or {}).get("messages") or [])
        return not free or self.db.scalar(
            select(TurnContinuation.turn_id).where(TurnContinuation.turn_id == parent.id,
                                                   TurnContinuation.hash == tenant_hash(skipped.tenant, free[0][1]))
        ) is None

    def _give_next_state(self, parent: _Turn, child_id: str, appended: list[Message]) -> None:
        parent.next_state = {"turn_id": child_id, "messages": appended}
        parent.has_next_state = True
        if parent.stored:
            self.changed_next_state[parent.id] = parent
        self.ready.append(parent.id)

    def _merge(self, old: str, new: str) -> None:
        """Move every turn of inferred session ``old`` into ``new`` and delete ``old``."""
        if old in self.new_sessions:  # made by this batch and not written: only in memory
            del self.new_sessions[old]
            self.touched.pop(old, None)
        else:
            self.flush()  # the turns written so far move too, and ``new`` must exist
            self.db.execute(update(_turns).where(_turns.c.session_id == old).values(session_id=new))
            self.db.execute(delete(_sessions).where(_sessions.c.id == old))
            if self.latest is not None:
                self.latest.pop(new, None)  # stored turns came in: ask again
        moved = self.members.pop(old, [])
        for t in moved:
            t.session_id = new
        self.members.setdefault(new, []).extend(moved)

    # -- writing ----------------------------------------------------------------------------

    def flush(self) -> None:
        """Write what was decided since the last flush: a few bulk statements."""
        sessions = [
            dict(row, updated_at=max(row["updated_at"], self.touched.get(sid, row["updated_at"]), key=self.clock))
            for sid, row in self.new_sessions.items()
        ]
        sessions += self.named_sessions.values()
        if sessions:
            self.db.execute(dialect_insert(self.db)(_sessions).on_conflict_do_nothing(), sessions)
        if self.unstored:
            self.db.execute(insert(_turns), [_turn_row(p, t) for p, t in self.unstored])
            continuations = [
                {"hash": c.hash, "turn_id": t.id, "choice_index": c.choice_index}
                for p, t in self.unstored
                for c in p.continuations
            ]
            if continuations:
                self.db.execute(insert(TurnContinuation.__table__), continuations)
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


def _session_row(session_id: str, r: TurnRecord, source: str) -> dict[str, Any]:
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


def _turn_row(p: _Prepared, turn: _Turn) -> dict[str, Any]:
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
    }


class Stitcher:
    """Writes a batch of records in one transaction, linking each to its session and parent."""

    def __init__(self, db: OrmSession):
        self.db = db
        self.dialect = db.get_bind().dialect.name
        # turns whose next state became known in this batch: to be scored once it commits
        self.ready: list[str] = []
        # the session each turn written by this stitcher went into (turn id -> session id)
        self.sessions: dict[str, str] = {}

    def write(self, records: Sequence[TurnRecord]) -> int:
        """Insert the records not yet stored (a replayed spool may repeat some, a record may
        appear twice in one batch: the first copy counts); returns how many."""
        if not records:
            return 0
        unique: dict[str, TurnRecord] = {}
        for r in records:
            unique.setdefault(r.id, r)
        stored = {i for chunk in chunked(unique) for i in self.db.scalars(select(Turn.id).where(Turn.id.in_(chunk)))}
        fresh = [r for r in unique.values() if r.id not in stored]
        prepared = [_tenant_scoped(prepare(r)) for r in fresh]
        self._lock(prepared)
        batch = _Batch(self.db, prepared)
        batch.run()
        self.sessions.update((r.id, batch.turns[r.id].session_id) for r in fresh)
        _store_sent_arguments(self.db, fresh)
        self.ready += batch.ready
        self.ready = mark_pending(self.db, self.ready)
        return len(fresh)

    def _lock(self, prepared: list[_Prepared]) -> None:
        # Two replicas writing a parent and its child at the same moment would each miss the
        # other; serialising on the hash that links them makes one of them see the other.
        if self.dialect != "postgresql":
            return  # SQLite allows one writer at a time anyway
        keys: set[int] = set()
        for r, candidates, continuations, retries, _ in prepared:
            keys.update(lock_key(h) for _, h in candidates[:1])
            keys.update(lock_key(c.hash) for c in continuations)
            keys.update(lock_key(h) for _, h in retries[:1])
            if r.session_id:
                keys.add(lock_key("session:" + r.session_id))
        if keys:
            # one statement, taking the locks in key order so that two writers cannot deadlock
            self.db.execute(
                text("SELECT pg_advisory_xact_lock(k) FROM unnest(CAST(:keys AS bigint[])) AS k ORDER BY k"),
                {"keys": sorted(keys)},
            )


def _store_sent_arguments(db: OrmSession, records: Sequence[TurnRecord]) -> None:
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
