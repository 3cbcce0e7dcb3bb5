"""What a batch being stitched knows of the pool: the stored turns it may link to, read up front
in a few set-based queries and on demand, kept in memory as the truth for the rest of the batch.

datapool.sessions decides the links over these turns; datapool.stitch_writes writes them.
"""

from __future__ import annotations

import functools
from bisect import insort
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import (ARRAY, Integer, Row, Select, String, TextualSelect, any_, bindparam, cast, column, func, or_,
                        select, text)
from sqlalchemy.orm import Session as OrmSession, aliased

from datapool.canonical import Message, Prepared
from datapool.edits import is_pair_index, is_system_free_index
from datapool.db import BIND_CHUNK, as_utc, chunked, pg_array
from datapool.models import Session, Turn, TurnContinuation
from base.vocab import TurnKind, TurnStatus


def clock(at: datetime) -> datetime:
    """``at`` as the pool compares it: an aware UTC instant (the UTCDateTime columns store and
    read every time so, SQLite included; a zoneless one is taken as UTC)."""
    return as_utc(at)


@dataclass(eq=False)
class StitchTurn:
    """A turn as stitching sees it, stored or from this batch. Once loaded, this object and not
    the pool is the truth for the rest of the batch; its changes reach the pool at a flush."""

    id: str
    session_id: str
    created_at: datetime  # as the database compares it: see clock
    turn_type: str
    status: str
    parent_id: str | None
    has_next_state: bool
    stored: bool  # its row exists, so a change is an UPDATE rather than part of its INSERT
    messages: list[Message] | None = None  # its request's messages, loaded only for orphans and edits
    replies: list[Message] | None = None  # its replies, loaded only for edits (datapool.stitch_edits)
    next_state: dict[str, Any] | None = None  # set by this batch, not yet written
    # its parent is the turn its whole history continues (its longest candidate matched); a turn
    # linked to an earlier ancestor because its parent was not written yet is not, and is
    # re-parented when the parent comes
    exact: bool = True
    edit: str | None = None  # how it continues its parent when not as sent (datapool.edits.EDIT_KINDS)

    @property
    def order(self) -> tuple[datetime, str]:
        """The pool's ORDER BY created_at, id."""
        return (self.created_at, self.id)


def _order(turn: StitchTurn) -> tuple[datetime, str]:
    return turn.order


class Continuing:
    """The turns one continuation hash continues, kept in the order a parent is chosen by: the
    earliest first (StitchTurn.order), and the failed ones apart. Choosing a parent takes the
    first turn that passes a filter, not the least of all: the same opening sent by a rollout's
    hundreds of environments puts hundreds of this batch's turns under one hash, and a scan of
    all of them per record made a batch quadratic in its size (benchmarks/gateway/README.md)."""

    __slots__ = ("ids", "in_order", "failed")

    def __init__(self) -> None:
        self.ids: set[str] = set()
        self.in_order: list[StitchTurn] = []
        self.failed: list[StitchTurn] = []  # status other than ok, in the same order

    def add(self, turn: StitchTurn) -> None:
        if turn.id in self.ids:
            return
        self.ids.add(turn.id)
        insort(self.in_order, turn, key=_order)
        if turn.status != TurnStatus.OK:
            insort(self.failed, turn, key=_order)

    def __len__(self) -> int:
        return len(self.ids)

    def first(self, keep: Any = None) -> StitchTurn | None:
        """The earliest turn for which *keep* (a predicate; None: any) holds."""
        return next((t for t in self.in_order if keep is None or keep(t)), None)

    def first_failed(self, keep: Any = None) -> StitchTurn | None:
        """The earliest turn that did not answer ok for which *keep* holds."""
        return next((t for t in self.failed if keep is None or keep(t)), None)


_NOTHING = Continuing()


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
# the stored turns read per continuation hash and kind, over the pool and per named session: the
# earliest wins (datapool.sessions._find_parent); one more in case the earliest is the record itself
PARENTS_KEPT = 2
# a kind of parent: (system-free continuation, answered), TurnContinuation's copies of its turn's
KINDS = ((False, False), (False, True), (True, False), (True, True))
# SQLite: hashes per statement of per_hash (one LIMIT subquery per hash and kind; its compound
# SELECT holds at most 500), padded up to one of these counts so that a few statement texts repeat
_SQLITE_BUCKETS = (1, 4, 16, 64, 100)
_VARCHARS = ARRAY(String)
_per_hash_columns = (column("hash", String), column("choice_index", Integer), column("turn_id", String))


def per_hash(db: OrmSession, hashes: list[str], kinds: Sequence[tuple[bool, bool]], *, limit: int,
             latest: bool = False, where: str = "TRUE") -> list[tuple[TextualSelect, dict[str, Any]]]:
    """Statements reading, for each hash and kind (system_free, answered), the first *limit*
    continuation rows by their turn's (created_at, id), or the last with *latest*, that also meet
    *where* (SQL on the row ``c``): one range of ix_turn_continuations_first each, however many
    rows share the hash. Each yields (hash, choice_index, turn_id); use it as a subquery, executed
    with the parameters beside it. The statements are of a few constant texts (_per_hash_text)."""
    postgresql = db.get_bind().dialect.name == "postgresql"
    if postgresql:
        statement = _per_hash_text(True, 0, tuple(kinds), limit, latest, where)
        return [(statement, {"hashes": pg_array(chunk)}) for chunk in chunked(hashes)]
    out = []
    for chunk in chunked(hashes, _SQLITE_BUCKETS[-1]):
        count = next(b for b in _SQLITE_BUCKETS if b >= len(chunk))
        padded = chunk + chunk[-1:] * (count - len(chunk))  # a repeated hash finds the same rows
        out.append((_per_hash_text(False, count, tuple(kinds), limit, latest, where),
                    {f"h{i}": h for i, h in enumerate(padded)}))
    return out


@functools.lru_cache(maxsize=64)
def _per_hash_text(postgresql: bool, count: int, kinds: tuple[tuple[bool, bool], ...], limit: int, latest: bool,
                   where: str) -> TextualSelect:
    """per_hash's statement for its dialect (SQLite: for *count* hashes), made once: SQLAlchemy's
    text() parses every bind name of SQLite's compound SELECT (400 members at 100 hashes) each time
    it is made, which was a fifth of the SQLite writer's CPU when made per batch."""
    order = "DESC" if latest else "ASC"
    probe = ("SELECT c.hash, c.choice_index, c.turn_id FROM turn_continuations c WHERE c.hash = {h} "
             "AND c.system_free = {free} AND c.answered = {ok} AND " + where +
             f" ORDER BY c.created_at {order}, c.turn_id {order} LIMIT {limit}")
    if postgresql:
        values = ", ".join(f"({str(free).lower()}, {str(ok).lower()})" for free, ok in kinds)
        sql = (f"SELECT f.hash, f.choice_index, f.turn_id FROM unnest(CAST(:hashes AS varchar[])) AS h(hash) "
               f"CROSS JOIN (VALUES {values}) AS k(free, ok) CROSS JOIN LATERAL ("
               + probe.format(h="h.hash", free="k.free", ok="k.ok") + ") AS f")
        return text(sql).columns(*_per_hash_columns)
    # SQLite has no LATERAL: one member per probe
    members = [f"SELECT * FROM ({probe.format(h=f':h{i}', free=int(free), ok=int(ok))})"
               for i in range(count) for free, ok in kinds]
    return text(" UNION ALL ".join(members)).columns(*_per_hash_columns)


def first_in_pool(db: OrmSession, hashes: list[str]) -> Iterator[Row[Any]]:
    """For each hash, the first PARENTS_KEPT turns by (created_at, id) of each kind over the
    whole pool."""
    for statement, params in per_hash(db, hashes, KINDS, limit=PARENTS_KEPT):
        yield from db.execute(with_turns(statement), params)


@functools.lru_cache(maxsize=32)
def with_turns(statement: TextualSelect, columns: tuple[Any, ...] = ()) -> Select[Any]:
    """The query over one of per_hash's statements: each row's hash and choice_index, _COLUMNS of its
    turn and *columns* (of Turn, or of Session: then joined to the turn's session). Made once per
    statement and columns, so pass *columns* as a constant tuple."""
    found = statement.subquery("found")
    query = select(found.c.hash, found.c.choice_index, *_COLUMNS, *columns).join(Turn, Turn.id == found.c.turn_id)
    if any(getattr(c, "class_", None) is Session for c in columns):
        query = query.join(Session, Session.id == Turn.session_id)
    return query


def first_in_sessions(hashes: list[str], named: list[str] | None) -> Select[Any]:
    """For each hash, the first PARENTS_KEPT turns of each kind within each of the *named*
    sessions (None: within every session, which reads every turn of the hash)."""
    kind = (TurnContinuation.hash, TurnContinuation.system_free, TurnContinuation.answered, Turn.session_id)
    query = select(TurnContinuation.hash, TurnContinuation.choice_index, *_COLUMNS,
                   func.row_number().over(partition_by=kind, order_by=(Turn.created_at, Turn.id)).label("rank"))
    query = query.join(Turn, Turn.id == TurnContinuation.turn_id).where(TurnContinuation.hash.in_(hashes))
    if named is not None:  # the named sessions' turns first: a few, however many share the hash
        member = aliased(Turn)
        query = query.where(TurnContinuation.turn_id.in_(select(member.id).where(member.session_id.in_(named))))
    ranked = query.subquery()
    return select(*[c for c in ranked.c if c.name != "rank"]).where(ranked.c.rank <= PARENTS_KEPT)


class KnownTurns:
    """The turns of the pool and of the batch known so far, indexed the ways stitching looks
    them up, and the queries that load more of them."""

    def __init__(self, db: OrmSession, prepared: Sequence[Prepared]):
        self.db = db
        self.prepared = prepared
        self.turns: dict[str, StitchTurn] = {}
        self.members: dict[str, list[StitchTurn]] = {}  # session id -> its known turns
        self.by_hash: dict[str, Continuing] = {}  # continuation hash -> turns it continues
        self.fetched: set[str] = set()  # continuation hashes whose stored turns are in by_hash
        # (hash, turn id) of continuations with the turn's system messages left out
        self.system_left_out: set[tuple[str, str]] = set()
        self.by_link: dict[str, dict[str, StitchTurn]] = {}  # link hash -> turns that may be orphans
        self.sources: dict[str, str] = {}  # session id -> "inferred" | "header" | "path"
        self.latest: dict[str, StitchTurn | None] | None = None  # see latest_stored

    def known(self, row: Row[Any]) -> StitchTurn:
        """The turn of a row of _COLUMNS; one that is already known keeps its in-memory state."""
        turn = self.turns.get(row.id)
        if turn is None:
            turn = StitchTurn(
                id=row.id,
                session_id=row.session_id,
                created_at=clock(row.created_at),
                turn_type=row.turn_type,
                status=row.status,
                parent_id=row.parent_turn_id,
                has_next_state=not row.open,
                stored=True,
            )
            self.add(turn)
        return turn

    def add(self, turn: StitchTurn) -> None:
        self.turns[turn.id] = turn
        self.members.setdefault(turn.session_id, []).append(turn)

    def continuing(self, h: str) -> Continuing:
        """The turns known to continue hash *h* (an index to add to)."""
        found = self.by_hash.get(h)
        if found is None:
            found = self.by_hash[h] = Continuing()
        return found

    def continuing_known(self, h: str) -> Continuing:
        """The same, read-only: an empty one for a hash no known turn continues."""
        return self.by_hash.get(h, _NOTHING)

    def load_orphans(self, hashes: set[str]) -> None:
        """Stored turns whose link hash is one of this batch's continuations and whose parent is
        not the turn that hash continues (none, or an earlier ancestor because the parent was
        not written yet): the turns a record of this batch may adopt. One query before
        stitching finds all of them."""
        if not hashes:
            return
        exact = (
            select(TurnContinuation.turn_id)
            .where(TurnContinuation.turn_id == Turn.parent_turn_id, TurnContinuation.hash == Turn.link_hash)
            .correlate(Turn)
            .exists()
        )
        query = (select(*_COLUMNS, Turn.link_hash, Turn.request, Session.source)
                 .join(Session, Session.id == Turn.session_id)
                 .where(or_(Turn.parent_turn_id.is_(None), ~exact)))
        if self.db.get_bind().dialect.name == "postgresql":
            # one array: an IN list of a batch's ~1,000 hashes is rendered, and parsed by psycopg, anew per batch
            statements = [query.where(Turn.link_hash == any_(cast(bindparam("hashes", pg_array(hashes)), _VARCHARS)))]
        else:
            statements = [query.where(Turn.link_hash.in_(chunk)) for chunk in chunked(hashes)]
        for statement in statements:
            for row in self.db.execute(statement):
                turn = self.known(row)
                turn.messages = list((row.request or {}).get("messages") or [])
                turn.exact = row.parent_turn_id is None
                self.by_link.setdefault(row.link_hash, {})[turn.id] = turn
                self.sources[row.session_id] = row.source

    def load_parents(self, hashes: Iterable[str]) -> None:
        """The stored turns that requests starting with these hashes could continue.

        Not every turn of a hash: a parent is the earliest turn of the hash (datapool.sessions:
        of any session, or of the record's named session), with or without its system messages,
        answered or failed. So per hash only the first PARENTS_KEPT of each of those four kinds
        are read, over the whole pool (an index range per hash and kind, first_in_pool) and
        within each session this batch names (first_in_sessions). The same opening sent by
        thousands of agents (every environment of a rollout starts alike) is then a few rows
        per batch, not thousands, and a few index probes: the read stays bounded as the pool
        grows."""
        todo = sorted(set(hashes) - self.fetched)
        self.fetched.update(todo)
        if not todo:
            return
        named: list[str] | None = sorted({p.record.session_id for p in self.prepared if p.record.session_id})
        if len(named) > BIND_CHUNK:
            named = None  # more than one IN list holds: every session's first turns
        rows = list(first_in_pool(self.db, todo))
        if named is None or named:
            for chunk in chunked(todo):
                rows += self.db.execute(first_in_sessions(chunk, named))
        for row in rows:
            self.continuing(row.hash).add(self.known(row))
            if is_system_free_index(row.choice_index):
                self.system_left_out.add((row.hash, row.id))

    def prefetch_parents(self) -> None:
        """Loads, in two rounds of queries, the stored turns the records may continue: first each
        record's longest candidate (the one that matches unless a turn went uncaptured), then
        every candidate of the records that one cannot match. Finding a parent loads what else
        it needs on its own."""
        self.load_parents({p.candidates[0][1] for p in self.prepared if p.candidates})
        earlier: set[str] = set()  # continuations of the records before this one
        rest: set[str] = set()
        for p in self.prepared:
            if len(p.candidates) > 1:
                longest = p.candidates[0][1]
                if longest not in earlier and not self.by_hash.get(longest):
                    rest.update(h for _, h in p.candidates[1:])
            earlier.update(c.hash for c in p.continuations if not is_pair_index(c.choice_index))
        self.load_parents(rest | {h for p in self.prepared for _, h in p.retries})

    def _load_latest(self, session_ids: Iterable[str], before: datetime) -> dict[str, StitchTurn | None]:
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
        found: dict[str, StitchTurn | None] = dict.fromkeys(session_ids)
        for chunk in chunked(found):
            rows = self.db.execute(
                select(*_COLUMNS).where(Turn.id.in_(select(latest).where(Session.id.in_(chunk))))
            )
            for row in rows:
                found[row.session_id] = self.known(row)
        return found

    def latest_stored(self, session_id: str, before: datetime) -> StitchTurn | None:
        """The stored main turn of a session that a record of it at ``before`` continues when
        its history was rewritten. The first call asks for every named session of the batch at
        once, up to the batch's newest record; a record older than the answer, or a session that
        stored turns were merged into since, is asked about on its own."""
        if self.latest is None:
            named = [p.record for p in self.prepared if p.record.session_id and p.record.turn_type == TurnKind.MAIN]
            newest = max((r.created_at for r in named), key=clock)
            self.latest = self._load_latest({r.session_id for r in named if r.session_id}, newest)
        if session_id in self.latest:
            hit = self.latest[session_id]
            if hit is None or hit.created_at <= clock(before):
                return hit
        return self._load_latest([session_id], before)[session_id]
