"""Finding sessions and turns for people: the admin UI's filters, full-text search, counts,
export selection and the annotation queue.

A filter has session conditions (mode, task, time range) and turn conditions (search words,
capture, model, policy version, reward, label state, turn type, wire format). A session matches when one of
its turns meets every turn condition; the turns a filter *selects* (what an export writes) are
exactly those turns of matching sessions.

Search is PostgreSQL full-text search over every string in a turn's request (so tool results
and earlier messages), its reply and its next state (``jsonb_to_tsvector``, the ``english``
configuration, ``websearch_to_tsquery`` syntax: words, "phrases", -not, or). On SQLite each
word must occur (case-insensitively) in that JSON text.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, fields
from datetime import datetime
from typing import Any

from sqlalchemy import Text, and_, cast, func, literal_column, or_, select
from sqlalchemy.orm import Session as OrmSession
from sqlalchemy.sql.elements import ColumnElement

from base.errors import FilterError, LabelError
from datapool import labels
from datapool.db import as_utc
from datapool.models import Judgement, Label, Session, Turn, Vote
from datapool.queries import decode_cursor, encode_cursor
from base.vocab import JudgementStatus, TurnKind, WireFormat, values

MODES = ("online", "offline", "eval")
CAPTURES = ("white-box", "black-box")
REWARDS = ("positive", "negative", "tie", "unscored")
TURN_TYPES = ("main", "side", "sibling")
WIRE_FORMATS = values(WireFormat)


@dataclass(frozen=True)
class Browse:
    """One view of the pool, as the UI's filter form and the export URLs spell it."""

    q: str | None = None
    mode: str | None = None
    capture: str | None = None
    model: str | None = None
    policy_version: str | None = None
    reward: str | None = None
    label: str | None = None
    turn_type: str | None = None
    since: datetime | None = None
    until: datetime | None = None
    task_id: str | None = None
    wire_format: str | None = None  # the API the client spoke (chat, completions, responses, messages)
    client: str | None = None  # the agent the session came from (a client profile's name)
    tenant: str | None = None  # only this tenant's sessions (gateway.tenants)

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> "Browse":
        """From query parameters; empty values are no filter. Raises :class:`FilterError`."""
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw = params.get(f.name)
            if raw is None or str(raw).strip() == "":
                continue
            text = str(raw).strip()
            if f.name in ("since", "until"):
                try:
                    values[f.name] = as_utc(datetime.fromisoformat(text))
                except ValueError:
                    raise FilterError(f"{f.name}: not a date/time: {text!r}") from None
                continue
            choices = {"mode": MODES, "capture": CAPTURES, "reward": REWARDS, "turn_type": TURN_TYPES,
                       "wire_format": WIRE_FORMATS}.get(f.name)
            if choices and text not in choices:
                raise FilterError(f"{f.name}: {text!r} is not one of {', '.join(choices)}")
            if f.name == "label":
                try:
                    labels.check_filter(text)
                except LabelError as exc:
                    raise FilterError(f"label: {exc}") from None
            values[f.name] = text[:1000]
        return cls(**values)

    def params(self) -> dict[str, str]:
        """The non-empty filters as query parameters (the inverse of :meth:`from_params`)."""
        out = {}
        for k, v in asdict(self).items():
            if v is None:
                continue
            out[k] = v.isoformat() if isinstance(v, datetime) else str(v)
        return out

    @property
    def empty(self) -> bool:
        return not self.params()


def search_document() -> Any:
    """SQL (PostgreSQL): the words of every string in a turn's request, reply and next state, the
    expression the GIN index ``ix_turns_search`` holds (migration 0010)."""
    def words(doc: Any) -> Any:
        return func.jsonb_to_tsvector(literal_column("'english'::regconfig"), doc,
                                      literal_column("'[\"string\"]'::jsonb"))

    null = literal_column("'null'::jsonb")
    return words(Turn.request).op("||")(words(func.coalesce(Turn.response, null))).op("||")(
        words(func.coalesce(Turn.next_state, null)))


def _search(db: OrmSession, q: str) -> ColumnElement[bool]:
    if db.get_bind().dialect.name == "postgresql":
        return search_document().op("@@")(func.websearch_to_tsquery(literal_column("'english'::regconfig"), q))
    text = func.lower(func.coalesce(cast(Turn.request, Text), "") + " " + func.coalesce(cast(Turn.response, Text), "")
                      + " " + func.coalesce(cast(Turn.next_state, Text), ""))
    words = [w for w in q.lower().split() if w]
    return and_(True, *(text.contains(w, autoescape=True) for w in words))


def effective_reward() -> Any:
    """SQL: the reward the trainer uses for a turn: a person's override, else the judge's.
    Stored on the turn (``turns.effective_reward``, kept current by triggers: migration 0010);
    :func:`computed_reward` is the same value computed from the labels and the judgement."""
    return Turn.effective_reward


def computed_reward() -> Any:
    """SQL (``Turn`` outer-joined to ``Judgement``): the override in force, else the judge's reward."""
    return func.coalesce(labels.override_reward(Turn.id, Turn.session_id), Judgement.reward)


def judged(status: str | None) -> ColumnElement[bool]:
    """SQL: the turn has a judgement in *status* (None: in any status). A subquery rather than a
    join, so that a page of turns is found by the turns' own indexes and only its rows are joined."""
    where = [Judgement.turn_id == Turn.id] + ([Judgement.status == status] if status is not None else [])
    return select(Judgement.turn_id).where(*where).correlate_except(Judgement).exists()


def turn_conditions(db: OrmSession, f: Browse) -> list[ColumnElement[bool]]:
    """Conditions on ``Turn`` (with or without ``Judgement`` joined)."""
    conds: list[ColumnElement[bool]] = []
    if f.q:
        conds.append(_search(db, f.q))
    if f.capture:
        conds.append(Turn.capture == f.capture)
    if f.model:
        conds.append(or_(Turn.model == f.model, Turn.upstream_model == f.model))
    if f.policy_version:
        conds.append(Turn.policy_version == f.policy_version)
    if f.turn_type:
        conds.append(Turn.turn_type == f.turn_type)
    if f.wire_format:
        conds.append(Turn.wire_format == f.wire_format)
    if f.reward:
        r = effective_reward()
        tied = judged(JudgementStatus.TIE)
        conds.append({"positive": r > 0, "negative": r < 0, "tie": and_(r.is_(None), tied),
                      # side turns are never scored: "unscored" means a main turn still without a reward
                      "unscored": and_(r.is_(None), Turn.turn_type == TurnKind.MAIN, ~tied)}[f.reward])
    if f.label:
        conds.append(labels.matches(f.label, Turn.id, Turn.session_id))
    if f.tenant is not None:
        conds.append(Turn.session_id.in_(select(Session.id).where(Session.tenant == f.tenant)))
    return conds


def session_conditions(f: Browse) -> list[ColumnElement[bool]]:
    conds: list[ColumnElement[bool]] = []
    if f.mode:
        conds.append(Session.mode == f.mode)
    if f.task_id:
        conds.append(Session.task_id == f.task_id)
    if f.client:
        conds.append(Session.client == f.client)
    if f.tenant is not None:
        conds.append(Session.tenant == f.tenant)
    if f.since:
        conds.append(Session.created_at >= f.since)
    if f.until:
        conds.append(Session.created_at < f.until)
    return conds


def _session_where(db: OrmSession, f: Browse) -> list[ColumnElement[bool]]:
    conds = session_conditions(f)
    tconds = turn_conditions(db, f)
    if tconds:
        conds.append(select(Turn.id).where(Turn.session_id == Session.id, *tconds).exists())
    return conds


# (client, messages) -> the first words a person said, without what the agent added (gateway.clients)
Words = Callable[[str | None, list[dict[str, Any]]], str]


def sessions_page(db: OrmSession, f: Browse, *, limit: int, cursor: str | None, words: Words | None = None
                  ) -> tuple[list[dict[str, Any]], str | None]:
    """Matching sessions, newest first, with a summary each; and the next page's cursor."""
    page, next_cursor, _ = sessions_window(db, f, limit=limit, cursor=cursor, words=words)
    return page, next_cursor


def sessions_window(db: OrmSession, f: Browse, *, limit: int, cursor: str | None = None, before: str | None = None,
                    words: Words | None = None) -> tuple[list[dict[str, Any]], str | None, str | None]:
    """A page of matching sessions, newest first: those older than ``cursor``, or (``before``)
    the ``limit`` sessions just newer than that key. Returns the page, the cursor of the older
    page and the ``before`` key of the newer page (None where there is none). *words* gives each
    session's preview (default: its first user message as sent)."""
    q = select(Session).where(*_session_where(db, f))
    if before:
        at, sid = decode_cursor(before)
        q = q.where(or_(Session.created_at > at, and_(Session.created_at == at, Session.id > sid)))
        rows = list(db.scalars(q.order_by(Session.created_at.asc(), Session.id.asc()).limit(limit + 1)))
        page = list(reversed(rows[:limit]))
        newer = encode_cursor(page[0].created_at, page[0].id) if len(rows) > limit else None
        older = encode_cursor(page[-1].created_at, page[-1].id) if page else None
        return _summaries(db, page, words), older, newer
    if cursor:
        at, sid = decode_cursor(cursor)
        q = q.where(or_(Session.created_at < at, and_(Session.created_at == at, Session.id < sid)))
    rows = list(db.scalars(q.order_by(Session.created_at.desc(), Session.id.desc()).limit(limit + 1)))
    page = rows[:limit]
    older = encode_cursor(page[-1].created_at, page[-1].id) if len(rows) > limit else None
    newer = encode_cursor(page[0].created_at, page[0].id) if cursor and page else (cursor if cursor else None)
    return _summaries(db, page, words), older, newer


def _preview(messages: list[dict[str, Any]]) -> str:
    for m in messages:
        if m.get("role") == "user":
            return content_text(m.get("content"))[:200]
    return content_text(messages[0].get("content"))[:200] if messages else ""


def _show(client: str | None, messages: list[dict[str, Any]], words: Words | None) -> str:
    said = words(client, messages)[:200] if words is not None else ""
    return said or _preview(messages)


def content_text(content: Any) -> str:
    """A message's content as plain text (content parts joined, None as empty)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(str(p.get("text", "")) if isinstance(p, dict) else str(p) for p in content)
    return str(content)


def _summaries(db: OrmSession, sessions: list[Session], words: Words | None = None) -> list[dict[str, Any]]:
    ids = [s.id for s in sessions]
    if not ids:
        return []
    r = effective_reward()
    turns = db.execute(
        select(Turn.session_id, Turn.id, Turn.turn_type, Turn.model, Turn.policy_version, Turn.capture,
               Judgement.status, r.label("reward"))
        .outerjoin(Judgement, Judgement.turn_id == Turn.id)
        .where(Turn.session_id.in_(ids)).order_by(Turn.created_at, Turn.id)).all()
    first: dict[str, str] = {}
    info: dict[str, dict[str, Any]] = {sid: {"turns": 0, "main": 0, "siblings": 0, "positive": 0, "negative": 0,
                                              "tie": 0, "neutral": 0, "unscored": 0, "models": set(), "versions": set(),
                                              "captures": set()}
                                       for sid in ids}
    for sid, tid, ttype, model, version, capture, status, reward in turns:
        i = info[sid]
        if ttype == TurnKind.SIBLING:  # no part of the session's history (datapool.siblings): counted apart
            i["siblings"] += 1
            continue
        first.setdefault(sid, tid)
        i["turns"] += 1
        i["models"].add(model)
        i["captures"].add(capture)
        if version:
            i["versions"].add(version)
        if ttype != TurnKind.MAIN:
            continue
        i["main"] += 1
        if reward is not None:
            i["positive" if reward > 0 else "negative" if reward < 0 else "neutral"] += 1
        elif status == JudgementStatus.TIE:
            i["tie"] += 1
        else:
            i["unscored"] += 1
    previews = dict(db.execute(select(Turn.session_id, Turn.request).where(Turn.id.in_(first.values()))).all())
    labeled = set(db.scalars(select(Turn.session_id).join(Label, Label.turn_id == Turn.id)
                             .where(Turn.session_id.in_(ids))))
    labeled |= set(db.scalars(select(Label.session_id).where(Label.session_id.in_(ids))))
    out = []
    for s in sessions:
        i = info[s.id]
        out.append({
            "id": s.id, "mode": s.mode, "task_id": s.task_id, "group_id": s.group_id, "source": s.source,
            "created_at": s.created_at, "ended_at": s.ended_at, "end_reason": s.end_reason,
            "outcome": s.outcome, "labeled": s.id in labeled,
            "client": s.client, "tenant": s.tenant,
            "preview": _show(s.client, ((previews.get(s.id) or {}).get("messages")) or [], words),
            **{k: (sorted(v) if isinstance(v, set) else v) for k, v in i.items()},
        })
    return out


_CHOICES: dict[tuple[str, str | None], tuple[float, dict[str, list[str]]]] = {}


def filter_choices(db: OrmSession, *, max_age_s: float = 10.0, tenant: str | None = None) -> dict[str, list[str]]:
    """The models, policy versions, clients and tenants the filter forms list (200 of each at
    most): of *tenant*'s sessions only when given (and then no tenants). Each is a DISTINCT over
    every turn, so a page load reuses the answer for *max_age_s* seconds."""
    key = (db.get_bind().url.render_as_string(hide_password=True), tenant)
    now = time.monotonic()
    hit = _CHOICES.get(key)
    if hit is not None and now - hit[0] < max_age_s:
        return hit[1]
    mine = [] if tenant is None else [Session.tenant == tenant]
    turns = [] if tenant is None else [Turn.session_id.in_(select(Session.id).where(*mine))]
    models = [m for m in db.scalars(select(Turn.model).where(*turns).distinct().limit(200)) if m]
    versions = [v for v in db.scalars(select(Turn.policy_version).where(*turns).distinct().limit(200)) if v]
    clients = [c for c in db.scalars(select(Session.client).where(*mine).distinct().limit(200)) if c]
    tenants = [] if tenant is not None else [
        t for t in db.scalars(select(Session.tenant).distinct().limit(200)) if t]
    found = {"models": sorted(models), "versions": sorted(versions), "clients": sorted(clients),
             "tenants": sorted(tenants)}
    _CHOICES[key] = (now, found)
    return found


def counts(db: OrmSession, f: Browse) -> dict[str, int]:
    """How many sessions match and how many turns are selected, by reward bucket; shadow
    siblings the filter selects (``datapool.siblings``, which an export writes too, with turn
    type ``sibling``) are no session's own turns: counted apart, as ``siblings``."""
    sessions = db.scalar(select(func.count()).select_from(Session).where(*_session_where(db, f))) or 0
    r = effective_reward()
    sconds, tconds = session_conditions(f), turn_conditions(db, f)

    def selected(q: Any) -> Any:
        q = q.where(*sconds, *tconds)
        return q.join(Session, Session.id == Turn.session_id) if sconds else q

    # the buckets read the turns' own column; ties (no reward, judges split) are counted from
    # the judgements in that state, which are few
    own = Turn.turn_type != TurnKind.SIBLING
    rows = db.execute(selected(select(
        func.count().filter(own), func.count().filter(own, r > 0), func.count().filter(own, r < 0),
        func.count().filter(own, r == 0), func.count().filter(~own),
    ).select_from(Turn))).one()
    tie = db.scalar(selected(select(func.count()).select_from(Turn).join(Judgement, Judgement.turn_id == Turn.id)
                             .where(own, Judgement.status == JudgementStatus.TIE, r.is_(None))))
    total, pos, neg, neutral, siblings = (int(x or 0) for x in rows)
    tie = int(tie or 0)
    return {"sessions": int(sessions), "turns": total, "positive": pos, "negative": neg, "neutral": neutral,
            "tie": tie, "unscored": total - pos - neg - tie - neutral, "siblings": siblings}


def selected_turns(db: OrmSession, f: Browse, *, after: tuple[datetime, str] | None, limit: int) -> list[Turn]:
    """The turns the filter selects, oldest first, ``limit`` at a time after the key ``after``
    (created_at, id) of the previous batch."""
    q = (select(Turn).join(Session, Session.id == Turn.session_id)
         .outerjoin(Judgement, Judgement.turn_id == Turn.id)
         .where(*session_conditions(f), *turn_conditions(db, f)))
    if after is not None:
        q = q.where(or_(Turn.created_at > after[0], and_(Turn.created_at == after[0], Turn.id > after[1])))
    return list(db.scalars(q.order_by(Turn.created_at, Turn.id).limit(limit)))


def iter_selected(engine: Any, f: Browse, batch: int = 500) -> Iterator[list[tuple[Turn, Session, Judgement | None]]]:
    """Batches of selected turns with their session and judgement; one short transaction each,
    so a long export never holds the pool."""
    after: tuple[datetime, str] | None = None
    while True:
        with OrmSession(engine) as db:
            turns = selected_turns(db, f, after=after, limit=batch)
            if not turns:
                return
            sids = {t.session_id for t in turns}
            sessions = {s.id: s for s in db.scalars(select(Session).where(Session.id.in_(sids)))}
            judgements = {j.turn_id: j for j in db.scalars(
                select(Judgement).where(Judgement.turn_id.in_([t.id for t in turns])))}
            out = [(t, sessions[t.session_id], judgements.get(t.id)) for t in turns]
            db.expunge_all()
        after = (turns[-1].created_at, turns[-1].id)
        yield out
        if len(turns) < batch:
            return


# --------------------------------------------------------------------------------------------
# the annotation queue


def _gap(teacher: list[float] | None, student: list[float] | None) -> float | None:
    if not teacher or not student or len(teacher) != len(student):
        return None
    return sum(abs(a - b) for a, b in zip(teacher, student)) / len(teacher)


def queue(db: OrmSession, *, limit: int = 50, scan: int = 2000, gap_threshold: float = 1.0,
          tenant: str | None = None) -> list[dict[str, Any]]:
    """Unlabeled scored-or-tied main turns, contested ones first: split judge votes, a person's
    feedback disagreeing with the judges, a large mean |teacher − student| logprob gap. Looks at
    the ``scan`` newest candidates."""
    rows = db.execute(
        select(Turn.id, Turn.session_id, Turn.created_at, Turn.logprobs, Judgement.status, Judgement.reward,
               Judgement.prm_reward, Judgement.teacher_logprobs)
        .join(Judgement, Judgement.turn_id == Turn.id)
        .where(*_queue_where(), *([] if tenant is None else [
            Turn.session_id.in_(select(Session.id).where(Session.tenant == tenant))]))
        .order_by(Turn.created_at.desc(), Turn.id.desc()).limit(scan)).all()
    ids = [r.id for r in rows]
    votes: dict[str, list[Vote]] = {}
    for v in db.scalars(select(Vote).where(Vote.turn_id.in_(ids))):
        votes.setdefault(v.turn_id, []).append(v)
    scored = []
    for r in rows:
        prm = [v.value for v in votes.get(r.id, []) if v.kind == "prm"]
        fb = [v.value for v in votes.get(r.id, []) if v.kind == "feedback" and v.value is not None]
        reasons, score = [], 0.0
        parsed = [v for v in prm if v is not None]
        if len(set(parsed)) > 1 or r.status == JudgementStatus.TIE:
            minority = 1 - max(parsed.count(x) for x in set(parsed)) / len(parsed) if parsed else 0.5
            score += 1 + minority
            reasons.append(f"split votes {'/'.join(f'{v:+d}' for v in sorted(parsed, reverse=True))}")
        if fb and r.prm_reward is not None and math.copysign(1, fb[-1]) != math.copysign(1, r.prm_reward or 0.0) \
                and fb[-1] != r.prm_reward:
            score += 2
            reasons.append(f"feedback {fb[-1]:+d} vs judges {r.prm_reward:+.0f}")
        gap = _gap(r.teacher_logprobs, r.logprobs)
        if gap is not None and gap >= gap_threshold:
            score += gap
            reasons.append(f"|teacher − student| {gap:.2f}")
        scored.append({"turn_id": r.id, "session_id": r.session_id, "created_at": r.created_at,
                       "status": r.status, "reward": r.reward, "score": score, "reasons": reasons,
                       "gap": gap})
    scored.sort(key=lambda x: (-x["score"], -x["created_at"].timestamp()))
    return scored[:limit]


def _queue_where() -> tuple[Any, ...]:
    """Which turns the annotation queue holds: unlabeled judged main turns."""
    return (Turn.turn_type == TurnKind.MAIN,
            Judgement.status.in_((JudgementStatus.SCORED, JudgementStatus.TIE, JudgementStatus.UNPARSABLE)),
            ~labels.matches("labeled", Turn.id, Turn.session_id))


def queue_size(db: OrmSession, *, tenant: str | None = None) -> int:
    """How many turns the annotation queue holds in all (not only the ones :func:`queue` ranks),
    of *tenant*'s sessions only when given."""
    mine = [] if tenant is None else [Turn.session_id.in_(select(Session.id).where(Session.tenant == tenant))]
    return db.scalar(select(func.count()).select_from(Turn).join(Judgement, Judgement.turn_id == Turn.id)
                     .where(*_queue_where(), *mine)) or 0



# --------------------------------------------------------------------------------------------
# the turns view: one row per turn across sessions

TURN_SORTS = ("time", "reward", "latency", "tokens")
JUDGE_STATUSES = tuple(s.value for s in JudgementStatus) + ("none",)


@dataclass(frozen=True)
class TurnPage:
    """How the turns view orders and pages: ``sort`` one of :data:`TURN_SORTS`, ``order``
    ``desc``/``asc``, ``offset`` rows skipped; ``status`` a judge status (or ``none``)."""

    sort: str = "time"
    order: str = "desc"
    offset: int = 0
    status: str | None = None

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> "TurnPage":
        sort = str(params.get("sort") or "time")
        order = str(params.get("order") or "desc")
        status = str(params.get("status") or "").strip() or None
        if sort not in TURN_SORTS:
            raise FilterError(f"sort: {sort!r} is not one of {', '.join(TURN_SORTS)}")
        if order not in ("asc", "desc"):
            raise FilterError(f"order: {order!r} is not one of asc, desc")
        if status is not None and status not in JUDGE_STATUSES:
            raise FilterError(f"status: {status!r} is not one of {', '.join(JUDGE_STATUSES)}")
        raw = str(params.get("offset") or "0").strip()
        if not raw.isdigit() or int(raw) > 10_000_000:
            raise FilterError(f"offset: not a whole number >= 0: {raw[:40]!r}")
        return cls(sort=sort, order=order, offset=int(raw), status=status)

    def params(self) -> dict[str, str]:
        out = {}
        if self.sort != "time":
            out["sort"] = self.sort
        if self.order != "desc":
            out["order"] = self.order
        if self.status:
            out["status"] = self.status
        return out


def turns_page(db: OrmSession, f: Browse, p: TurnPage, *, limit: int) -> tuple[list[dict[str, Any]], bool]:
    """One SQL query (LIMIT ``limit`` + 1, OFFSET): the turns the filter selects, each with its
    session, reward, judge status, latency, tokens, finish reason and tool-call count; and
    whether more follow. The date range (``since``/``until``) applies to the turn's time here.
    Labels are fetched for the page's turns only."""
    r = effective_reward()
    completion = Turn.usage["completion_tokens"].as_float()
    sconds = session_conditions(Browse(mode=f.mode, task_id=f.task_id))
    conds = [*sconds, *turn_conditions(db, f)]
    if f.since:
        conds.append(Turn.created_at >= f.since)
    if f.until:
        conds.append(Turn.created_at < f.until)
    if p.status == "none":
        conds.append(~judged(None))
    elif p.status:
        conds.append(judged(p.status))
    key = {"time": Turn.created_at, "reward": r, "latency": Turn.latency_ms, "tokens": completion}[p.sort]
    if p.sort == "time":  # never NULL: plain order, which the created_at index serves either way
        primary = key.desc() if p.order == "desc" else key.asc()
    else:
        primary = key.desc().nulls_last() if p.order == "desc" else key.asc().nulls_last()
    tie = Turn.id.desc() if p.order == "desc" else Turn.id.asc()
    # first the page's turn ids, by the turns' own indexes (sorts and filters read columns of
    # ``turns``; judge states are EXISTS subqueries), then its columns and judge status for
    # those rows only
    ids = select(Turn.id).where(*conds).order_by(primary, tie).offset(p.offset).limit(limit + 1)
    if sconds:
        ids = ids.join(Session, Session.id == Turn.session_id)
    page = ids.subquery()
    q = (select(Turn.id, Turn.session_id, Turn.created_at, Turn.model, Turn.upstream_model, Turn.policy_version,
                Turn.capture, Turn.wire_format, Turn.turn_type, Turn.status, Turn.latency_ms,
                Turn.usage["prompt_tokens"].as_float().label("prompt_tokens"), completion.label("completion_tokens"),
                Turn.response[("choices", 0, "finish_reason")].as_string().label("finish_reason"),
                Turn.response[("choices", 0, "message", "tool_calls")].label("tool_calls"),
                Judgement.status.label("judge_status"), r.label("reward"), Session.tenant.label("tenant"))
         .select_from(Turn).join(page, page.c.id == Turn.id).outerjoin(Judgement, Judgement.turn_id == Turn.id)
         .join(Session, Session.id == Turn.session_id)
         .order_by(primary, tie))
    rows = db.execute(q).all()
    more = len(rows) > limit
    rows = rows[:limit]
    labs = labels.for_turns(db, [row.id for row in rows]) if rows else {}
    out = []
    for row in rows:
        calls = row.tool_calls
        out.append({
            "id": row.id, "session_id": row.session_id, "created_at": row.created_at, "model": row.model,
            "upstream_model": row.upstream_model, "policy_version": row.policy_version, "capture": row.capture,
            "wire_format": row.wire_format, "turn_type": row.turn_type, "status": row.status, "latency_ms": row.latency_ms,
            "prompt_tokens": _int(row.prompt_tokens), "completion_tokens": _int(row.completion_tokens),
            "finish_reason": row.finish_reason if isinstance(row.finish_reason, str) else None,
            "tool_calls": len(calls) if isinstance(calls, list) else 0,
            "judge_status": row.judge_status, "reward": row.reward, "tenant": row.tenant,
            "labels": _label_words((labs.get(row.id) or {}).get("effective") or {}),
        })
    return out, more


def _int(v: Any) -> int | None:
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def _label_words(state: dict[str, Any]) -> list[str]:
    """A turn's labels in force as short words for a table cell (``thumb:1``, ``exclude``, tags)."""
    out = []
    for k, v in state.items():
        if k.endswith("_by") or k in ("tags", "correction", "note"):
            continue
        out.append(k if v is True else f"{k}:{v}")
    out += [f"#{t}" for t in state.get("tags", [])]
    out += [k for k in ("correction", "note") if k in state]
    return out
