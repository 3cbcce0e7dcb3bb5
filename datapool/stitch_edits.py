"""Finding the turn a request continues when its history was edited (datapool.edits): by the
request's reply pairs, then message by message; and the session a summarisation call that embeds
its transcript summarises. Only asked when prefix matching found no turn that the request's whole
history continues, so a conversation sent as it was costs nothing here.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any, NamedTuple

from sqlalchemy import select

from datapool.canonical import Message, Prepared, tenant_hash
from datapool.edits import (
    COMPACTION_REPLACE,
    RETRY,
    TAIL_INDEX,
    Alignment,
    align,
    choice_of,
    loose_forms,
    request_pairs,
    request_tails,
    text_of,
    transcript_overlap,
)
from datapool.models import Session, Turn
from datapool.stitch_reads import _COLUMNS, KnownTurns, StitchTurn, clock, per_hash, with_turns
from base.vocab import TurnKind, TurnStatus

# at most this many stored turns are read (newest first) for one request's reply pairs, and for a
# summarisation call's transcript
CANDIDATES = 64


class Edited(NamedTuple):
    parent: StitchTurn
    prefix_end: int  # where what the request appended after the parent's reply begins
    alignment: Alignment


def replies_of(response: dict[str, Any] | None) -> list[Message]:
    return [c.get("message") or {} for c in (response or {}).get("choices") or []]


# what EditedTurns reads of a stored turn beside _COLUMNS: its request, reply and client
_EDITED = (Turn.request, Turn.response, Session.client)


class EditedTurns:
    """The lookups of edited histories over a batch's KnownTurns."""

    def __init__(self, known: KnownTurns, clients: dict[str, str | None]):
        self.known = known
        self.clients = clients  # session id -> its client, as far as known
        self.by_pair: dict[str, dict[str, tuple[StitchTurn, int]]] = {}  # pair key -> turn id -> (turn, choice)
        self.fetched: set[str] = set()

    def remember(self, turn: StitchTurn, p: Prepared) -> None:
        """A turn of this batch, findable by its reply pairs."""
        for c in p.continuations:
            if c.choice_index <= TAIL_INDEX:
                self.by_pair.setdefault(c.hash, {})[turn.id] = (turn, choice_of(c.choice_index))

    def _loaded(self, row: Any) -> StitchTurn:
        turn = self.known.known(row)
        if turn.replies is None:
            turn.messages = list((row.request or {}).get("messages") or [])
            turn.replies = replies_of(row.response)
        self.clients.setdefault(row.session_id, row.client)
        return turn

    def _load(self, keys: set[str]) -> None:
        todo = keys - self.fetched
        self.fetched |= todo
        if not todo:
            return
        # the latest CANDIDATES pair and tail rows of these keys: the latest of each key, then of all
        rows: list[Any] = []
        for statement, params in per_hash(self.known.db, sorted(todo), ((False, False), (False, True)),
                                          limit=CANDIDATES, latest=True, where=f"c.choice_index <= {TAIL_INDEX}"):
            rows += self.known.db.execute(with_turns(statement, _EDITED), params)
        rows.sort(key=lambda row: (clock(row.created_at), row.id), reverse=True)
        for row in rows[:CANDIDATES]:
            turn = self._loaded(row)
            self.by_pair.setdefault(row.hash, {})[turn.id] = (turn, choice_of(row.choice_index))

    def find(self, p: Prepared, session_id: str | None, after: int) -> Edited | None:
        """The turn whose history (and reply) the record's messages hold, ending later than *after*
        (where prefix matching's parent ended): the latest end, then the whole history before a
        tail of it, then the longest tail, the record's client, the latest turn. A turn found by its
        request tail is one the record goes on from without its reply (only user and tool messages
        after it), or retries if it failed."""
        r = p.record
        messages = r.messages
        forms = loose_forms(messages)
        keys = [(i + 1, tenant_hash(r.tenant, h), False) for i, h in request_pairs(messages, forms)]
        keys += [(j + 1, tenant_hash(r.tenant, h), True) for j, h in request_tails(messages, forms)]
        keys = sorted((k for k in keys if k[0] > after), key=lambda k: -k[0])
        if not keys:
            return None
        self._load({h for _, h, _ in keys})
        for end, h, tail in keys:
            best: tuple[tuple[Any, ...], Edited] | None = None
            for turn, choice in self.by_pair.get(h, {}).values():
                if not self._eligible(turn, r.id, session_id, tail):
                    continue
                if tail and end == len(messages) and turn.status == TurnStatus.OK:
                    continue  # the same messages again: a second sample, not a retry
                found = align(messages, forms, end if tail else end - 1, turn.messages or [],
                              loose_forms(turn.messages or []))
                if found is None or (tail and not found.whole):
                    continue
                if tail and turn.status != TurnStatus.OK and end == len(messages):
                    found = found._replace(edit=RETRY)
                client = self.clients.get(turn.session_id)
                if found.edit == COMPACTION_REPLACE and r.client and client and client != r.client:
                    continue
                score = (found.whole, found.tail, bool(r.client) and client == r.client, turn.order)
                if best is None or score > best[0]:
                    best = (score, Edited(turn, end, found))
            if best is not None:
                return best[1]
        return None

    @staticmethod
    def _eligible(turn: StitchTurn, record_id: str, session_id: str | None, tail: bool) -> bool:
        if turn.id == record_id or (session_id is not None and turn.session_id != session_id):
            return False
        return turn.turn_type == TurnKind.MAIN and turn.messages is not None and (
            tail or turn.status == TurnStatus.OK)

    def summarised(self, p: Prepared, session_id: str | None, batch: Sequence[StitchTurn]) -> StitchTurn | None:
        """The turn whose history a summarisation call's embedded transcript holds the most of
        (at least two messages and its last one), among the newest turns; the latest on a tie."""
        r = p.record
        transcript = "\n".join(text_of(m) for m in r.messages if m.get("role") == "user")
        query = (
            select(*_COLUMNS, Turn.request, Turn.response, Session.client)
            .join(Session, Session.id == Turn.session_id)
            .where(Turn.turn_type == TurnKind.MAIN, Turn.status == TurnStatus.OK,
                   Turn.created_at <= r.created_at,
                   Session.tenant.is_(None) if r.tenant is None else Session.tenant == r.tenant)
            .order_by(Turn.created_at.desc(), Turn.id.desc())
            .limit(CANDIDATES)
        )
        if session_id is not None:
            query = query.where(Turn.session_id == session_id)
        candidates = [self._loaded(row) for row in self.known.db.execute(query)]
        at = clock(r.created_at)
        candidates += [t for t in batch if t.turn_type == TurnKind.MAIN and t.status == TurnStatus.OK
                       and t.created_at <= at and t.replies is not None
                       and (session_id is None or t.session_id == session_id)]
        best: tuple[tuple[int, tuple[datetime, str]], StitchTurn] | None = None
        for t in candidates:
            if t.messages is None:
                continue
            overlap = transcript_overlap(transcript, t.messages, (t.replies or [None])[0])
            if overlap >= 2 and (best is None or (overlap, t.order) > best[0]):
                best = ((overlap, t.order), t)
        return best[1] if best else None
