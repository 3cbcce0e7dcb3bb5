"""Stitching captured calls into sessions and pairing each turn with its next state.

A request continues an earlier turn when its messages begin with that turn's request messages
followed by that turn's reply. Both sides are reduced to hashes of a canonical form of the
messages (datapool.canonical), so the match is a pool lookup and works across gateway replicas
and out of order: whichever of the two turns is written second makes the link.

A batch is stitched in memory, record by record in the order given, by the same rules as if
each record were written alone after the ones before it. What the pool already holds is read up
front in a few set-based queries and the outcome is written in bulk, so a batch costs a roughly
constant number of statements instead of several per turn (the gateway captures faster than a
per-turn writer can stitch). What needs the pool itself mid-batch (merging a stored inferred
session into another, a named session whose history was rewritten, a session's end) is done
where it occurs; those are rare. What the batch knows of the pool is datapool.stitch_reads; the
writing is datapool.stitch_writes; this module decides the links.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, String, bindparam, delete, insert, inspect, literal, or_, select, text, update
from sqlalchemy.orm import Session as OrmSession

from datapool.canonical import (
    Message,
    Prefixes,
    Prepared,
    after_last_assistant,
    link_candidates,
    longest_end,
    prepare,
    system_free_candidates,
    tenant_hash,
    tenant_scoped,
)
from datapool.db import chunked, pg_array
from datapool.edits import (
    COMPACTION_REPLACE,
    FORK,
    RECOVERY,
    RETRY,
    SUMMARY,
    is_pair_index,
    is_summary_message,
    is_system_free_index,
    stored_continuations,
    summary_shape,
    with_pairs,
)
from datapool.models import Session, Turn, TurnContinuation
from datapool.records import TurnRecord
from datapool.judgements import end_session, mark_pending
from datapool.stitch_edits import Edited, EditedTurns
from datapool.stitch_reads import KnownTurns, StitchTurn, clock
from datapool.stitch_writes import PendingWrites, fill_continuation_keys, session_row, store_sent_arguments
from base.vocab import Endpoint, TurnKind, TurnStatus


def lock_key(value: str) -> int:
    """A signed 64-bit key for pg_advisory_xact_lock."""
    return int.from_bytes(hashlib.sha256(value.encode()).digest()[:8], "big", signed=True)


def rehash(conn: Connection, *, chunk: int = 500) -> tuple[int, int]:
    """Recompute every stored turn's link hash and continuation hashes with the canonical form
    of this version, so that requests arriving from now on find the turns stored before the
    form changed (migration 0007 runs it; so does ``nextstate db rehash``). Links already made
    stay as they are. Reads the turns in chunks ordered by id; returns (turns read,
    turns whose hashes changed). Continuation rows without their turn's time and kind (written
    by a gateway older than migration 0020) get them."""
    turns = Turn.__table__
    continuations = TurnContinuation.__table__
    # a tenant's turns hash with their tenant (tenant_hash); migration 0007 runs this before the
    # pool has tenants (0014)
    sessions = Session.__table__
    tenant = (sessions.c.tenant if "tenant" in {c["name"] for c in inspect(conn).get_columns("sessions")}
              else literal(None, String).label("tenant"))
    columns = (turns.c.id, turns.c.endpoint, turns.c.status, turns.c.turn_type, turns.c.request,
               turns.c.response, turns.c.link_hash, tenant)
    keyed = "created_at" in {c["name"] for c in inspect(conn).get_columns("turn_continuations")}
    seen = changed = 0
    last = ""
    while True:
        rows = conn.execute(select(*columns).select_from(turns.join(sessions, sessions.c.id == turns.c.session_id))
                            .where(turns.c.id > last).order_by(turns.c.id).limit(chunk)).all()
        if not rows:
            if keyed:  # migration 0020 on: the rows rewritten here, and any an older gateway wrote
                fill_continuation_keys(conn, missing=True)
            return seen, changed
        last = rows[-1].id
        seen += len(rows)
        ids = [row.id for row in rows]
        stored: dict[str, set[tuple[str, int]]] = {}
        keys = (continuations.c.turn_id, continuations.c.hash, continuations.c.choice_index)
        for c in conn.execute(select(*keys).where(continuations.c.turn_id.in_(ids))):
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
            fresh = {(tenant_hash(row.tenant, c.hash), c.choice_index) for c in stored_continuations(r)}
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


class _Batch:
    """One batch stitched in memory, record by record, over what the pool holds (KnownTurns);
    what it decides is written in bulk by flush() (PendingWrites)."""

    def __init__(self, db: OrmSession, prepared: Sequence[Prepared]):
        self.db = db
        self.prepared = prepared
        self.ready: list[str] = []  # turns whose next state became known, in the order it did
        self.known = KnownTurns(db, prepared)  # what is known of the pool and of the batch so far
        self.pending = PendingWrites(db)  # decided, not yet written
        self.edited = EditedTurns(self.known, {})  # the fallback for edited histories

    def run(self) -> None:
        """Stitch the records in order, then write what is still unwritten."""
        self.known.load_orphans({c.hash for p in self.prepared for c in p.continuations
                                 if not is_pair_index(c.choice_index)})
        self.known.prefetch_parents()
        for p in self.prepared:
            self._stitch(p)
        self.flush()

    def flush(self) -> None:
        """Write what was decided since the last flush."""
        self.pending.flush()

    def _source(self, session_id: str) -> str:
        if session_id not in self.known.sources:
            # a named session of this batch may exist already; then its stored source holds
            stored = self.db.scalar(select(Session.source).where(Session.id == session_id))
            self.known.sources[session_id] = stored or self.pending.named_sessions[session_id]["source"]
        return self.known.sources[session_id]

    # -- stitching, one record at a time ----------------------------------------------------

    def _stitch(self, p: Prepared) -> None:
        r = p.record
        parent: StitchTurn | None = None
        prefix_end = 0  # index in r.messages where what r appended after the parent begins
        if r.session_id:
            session_id = r.session_id
            row = session_row(session_id, r, r.session_source or "header")
            self.pending.named_sessions.setdefault(session_id, row)
            self.edited.clients.setdefault(session_id, r.client)
            parent, prefix_end, how = self._find_linked(p, session_id)
            # linked by its whole history, or past a parent that may still come
            exact = parent is None or prefix_end >= longest_end(p)
            if parent is None and r.turn_type == TurnKind.MAIN:
                parent = self._latest_main_turn(session_id, r.created_at)
                prefix_end = after_last_assistant(r.messages)
                exact = parent is None
                if parent is not None and any(is_summary_message(m) for m in r.messages):
                    how = COMPACTION_REPLACE
        else:
            parent, prefix_end, how = self._find_linked(p, None)
            exact = parent is None or prefix_end >= longest_end(p)
            if parent is not None:
                session_id = parent.session_id
            else:
                session_id = uuid.uuid4().hex
                self.pending.new_sessions[session_id] = session_row(session_id, r, "inferred")
                self.known.sources[session_id] = "inferred"
                self.edited.clients[session_id] = r.client
        takes_state = parent is not None and r.turn_type == TurnKind.MAIN and parent.status == TurnStatus.OK and (
            not parent.has_next_state or (exact and self._skipped_to(parent)))
        if how is None and parent is not None and r.turn_type == TurnKind.MAIN and parent.has_next_state \
                and not takes_state:
            how = FORK

        turn = StitchTurn(
            id=r.id,
            session_id=session_id,
            created_at=clock(r.created_at),
            turn_type=r.turn_type,
            status=r.status,
            parent_id=parent.id if parent else None,
            has_next_state=False,
            stored=False,
            messages=r.messages,
            exact=exact,
            edit=how,
            replies=r.replies,
        )
        self.known.add(turn)
        self.edited.remember(turn, p)
        self.pending.unstored.append((p, turn))
        for c in p.continuations:
            if is_pair_index(c.choice_index):
                continue
            self.known.continuing(c.hash).add(turn)
            if is_system_free_index(c.choice_index):
                self.known.system_left_out.add((c.hash, turn.id))
        if p.candidates:
            self.known.by_link.setdefault(p.candidates[0][1], {})[turn.id] = turn

        if takes_state:
            self._give_next_state(parent, r.id, r.messages[prefix_end:])
        if p.continuations:
            self._adopt_orphans(turn, p)
        # the session's updated_at follows the turns written into it, not those merged in later
        newest = self.pending.touched.get(session_id)
        if newest is None or clock(newest) < turn.created_at:
            self.pending.touched[session_id] = r.created_at
        if r.session_done:
            self.flush()  # end_session reads the session's turns from the pool
            self.ready += end_session(self.db, session_id)
            self.db.flush()

    def _find_linked(self, p: Prepared, session_id: str | None) -> tuple[StitchTurn | None, int, str | None]:
        """The turn the record continues, where what it appended begins, and how it continues it
        when not as sent (datapool.edits.EDIT_KINDS): by prefix (_find_parent); when no turn
        continues the record's whole history, by an edited history (datapool.stitch_edits); a
        summarisation call that embeds its transcript, by the transcript."""
        r = p.record
        parent, prefix_end, dropped = self._find_parent(p, session_id)
        how: str | None = None
        if parent is not None and parent.status != TurnStatus.OK and prefix_end == len(r.messages):
            how = RETRY
        elif dropped and not _declares_tools(r):
            how = RECOVERY
        shape = summary_shape(r.messages, _declares_tools(r)) if r.turn_type == TurnKind.SIDE else None
        if r.endpoint == Endpoint.CHAT and (parent is None or prefix_end < longest_end(p)):
            found: Edited | None = self.edited.find(p, session_id, prefix_end)
            if found is not None:
                parent, prefix_end, how = found.parent, found.prefix_end, found.alignment.edit
                if how is None and found.alignment.dropped_system and not _declares_tools(r):
                    how = RECOVERY
        if shape == "embedded" and parent is None:
            batch = [t for q, t in self.pending.unstored if q.record.tenant == r.tenant]
            parent = self.edited.summarised(p, session_id, batch)
            prefix_end = len(r.messages)
        if shape is not None and parent is not None:
            how = SUMMARY
        return parent, prefix_end, how

    def _find_parent(self, p: Prepared, session_id: str | None) -> tuple[StitchTurn | None, int, bool]:
        """The earliest turn whose continuation is the longest candidate any turn has (within
        the named session, if there is one), and where what the record appended begins.

        A turn whose request the record extends further without its reply (retry_candidates)
        wins over one whose reply it continues: the record retries a failed or cancelled call
        (the same messages: only a turn that failed), or goes on after a reply it dropped.
        The last value: whether the record left out the system prompt the parent had."""
        parent: StitchTurn | None = None
        prefix_end = 0
        dropped = False
        for n, (index, h) in enumerate(p.candidates):
            if h not in self.known.fetched:
                self.known.load_parents(c for _, c in p.candidates[n:])
            first = self.known.continuing_known(h).first(
                None if session_id is None else lambda t: t.session_id == session_id)
            if first is not None:
                parent, prefix_end = first, index + 1
                dropped = (h, parent.id) in self.known.system_left_out
                break
        # the turn before may have been sent without the system prompt: it continues that turn's
        # history once its own system messages are left out (never a turn that had others)
        for n, (index, h) in enumerate(p.system_free):
            if index + 1 <= prefix_end:
                break
            if h not in self.known.fetched:
                self.known.load_parents(c for _, c in p.system_free[n:])
            left_out = self.known.system_left_out
            first = self.known.continuing_known(h).first(
                lambda t: (session_id is None or t.session_id == session_id) and (h, t.id) not in left_out)
            if first is not None:
                parent, prefix_end = first, index + 1
                dropped = False
                break
        whole = len(p.record.messages)
        for n, (k, h) in enumerate(p.retries):
            if k <= prefix_end:
                break
            if h not in self.known.fetched:
                self.known.load_parents(c for _, c in p.retries[n:])
            def keep(t: StitchTurn) -> bool:
                return (session_id is None or t.session_id == session_id) and t.id != p.record.id

            turns = self.known.continuing_known(h)
            # a turn that answered (its reply dropped) before one that failed on the same messages;
            # the same messages again (k == whole) only retry a turn that failed
            found = turns.first(lambda t: t.status == TurnStatus.OK and keep(t)) if k < whole else None
            found = found or turns.first_failed(keep)
            if found is not None:
                return found, k, False
        return parent, prefix_end, dropped

    def _latest_main_turn(self, session_id: str, before: datetime) -> StitchTurn | None:
        # An explicit session whose agent rewrote its history (compaction, a dropped system
        # prompt) still continues its latest turn; the next state is what follows the last
        # assistant message.
        at = clock(before)
        found = [
            t
            for t in self.known.members.get(session_id, ())
            if t.turn_type == TurnKind.MAIN and t.status == TurnStatus.OK and t.created_at <= at
        ]
        stored = self.known.latest_stored(session_id, before)
        if stored is not None:
            found.append(stored)
        return max(found, key=lambda t: t.order, default=None)

    def _adopt_orphans(self, turn: StitchTurn, p: Prepared) -> None:
        """Link turns written before their parent (this turn) to it: those with no parent, and
        those linked to an earlier ancestor while this turn was missing."""
        orphans = {
            o.id: (o, c.prefix)  # where what the orphan appended begins
            for c in p.continuations
            for o in self.known.by_link.get(c.hash, {}).values()
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
                self.pending.changed_parent[orphan.id] = orphan
            if orphan.turn_type == TurnKind.MAIN and not turn.has_next_state:
                self._give_next_state(turn, orphan.id, (orphan.messages or [])[start:])

    def _skipped_to(self, parent: StitchTurn) -> bool:
        """Whether the parent's next state came from a turn that is not its exact child: one
        that linked to it past its own missing parent (see StitchTurn.exact), or has moved under
        that parent since. A turn continuing the parent exactly then gives the next state."""
        state = parent.next_state
        if state is None and parent.stored:
            state = self.db.scalar(select(Turn.next_state).where(Turn.id == parent.id))
        child_id = (state or {}).get("turn_id")
        if not child_id:
            return False
        child = self.known.turns.get(child_id)
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

    def _give_next_state(self, parent: StitchTurn, child_id: str, appended: list[Message]) -> None:
        parent.next_state = {"turn_id": child_id, "messages": appended}
        parent.has_next_state = True
        if parent.stored:
            self.pending.changed_next_state[parent.id] = parent
        self.ready.append(parent.id)

    def _merge(self, old: str, new: str) -> None:
        """Move every turn of inferred session ``old`` into ``new`` and delete ``old``."""
        if self.pending.move_session(old, new) and self.known.latest is not None:
            self.known.latest.pop(new, None)  # stored turns came in: ask again
        moved = self.known.members.pop(old, [])
        for t in moved:
            t.session_id = new
        self.known.members.setdefault(new, []).extend(moved)


def _declares_tools(r: TurnRecord) -> bool:
    params = r.request.get("params") or {}
    return bool(params.get("tools") or params.get("functions") or r.request.get("tools"))


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
        if self.dialect == "postgresql":  # one array: an IN list's parameters are rendered and parsed anew per batch
            stored = set(self.db.scalars(text("SELECT id FROM turns WHERE id = ANY(CAST(:ids AS varchar[]))"),
                                         {"ids": pg_array(unique)}))
        else:
            stored = {i for chunk in chunked(unique) for i in self.db.scalars(select(Turn.id).where(Turn.id.in_(chunk)))}
        fresh = [r for r in unique.values() if r.id not in stored]
        prepared = []
        for r in fresh:  # one pass over a record's messages for every hash, its reply pairs' loose forms too
            whole = Prefixes(r.messages)
            prepared.append(tenant_scoped(with_pairs(prepare(r, whole), whole)))
        self._lock(prepared)
        batch = _Batch(self.db, prepared)
        batch.run()
        self.sessions.update((r.id, batch.known.turns[r.id].session_id) for r in fresh)
        store_sent_arguments(self.db, fresh)
        self.ready += batch.ready
        self.ready = mark_pending(self.db, self.ready)
        return len(fresh)

    def _lock(self, prepared: list[Prepared]) -> None:
        # Two replicas writing a parent and its child at the same moment would each miss the
        # other; serialising on the hash that links them makes one of them see the other.
        if self.dialect != "postgresql":
            return  # SQLite allows one writer at a time anyway
        keys: set[int] = set()
        for r, candidates, continuations, retries, _ in prepared:
            keys.update(lock_key(h) for _, h in candidates[:1])
            keys.update(lock_key(c.hash) for c in continuations if not is_pair_index(c.choice_index))
            keys.update(lock_key(h) for _, h in retries[:1])
            if r.session_id:
                keys.add(lock_key("session:" + r.session_id))
        if keys:
            # one statement, taking the locks in key order so that two writers cannot deadlock
            self.db.execute(
                text("SELECT pg_advisory_xact_lock(k) FROM unnest(CAST(:keys AS bigint[])) AS k ORDER BY k"),
                {"keys": pg_array(sorted(keys))},
            )
