"""People's labels on turns and sessions, and what they mean to the trainer.

A label is a row in ``labels`` (see :class:`datapool.models.Label`): a kind, a JSON value, its
author and time. Rows are never updated or deleted, so the history of who decided what stays.
For every kind but ``tag`` the newest label of a (target, kind) is the one in force, and a
label whose value is null withdraws that kind. A turn's own label wins over its session's.

What the trainer does with them:

* ``exclude`` true — the turn is never leased (``datapool.leases``);
* ``override`` r — r replaces the judge's reward (``trainer.samples``);
* ``correction`` text — the corrected reply becomes the turn's OPD hint: the scorer uses it
  before any feedback or judge hint and computes teacher logprobs under it
  (``scoring``); the turn is re-queued for scoring when one is added;
* ``thumb`` ±1, ``tag``, ``note`` — for people and for the ``labels`` batch filter; ``untag``
  NAME removes the tag NAME from the same target (a later ``tag`` NAME adds it again).

The SQL helpers read a label's value through its JSON text (``CAST(value AS TEXT)``), which is
the same on PostgreSQL (jsonb) and SQLite for the values :func:`validate` lets in.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy import Float, Text, and_, cast, exists, func, or_, select
from sqlalchemy.orm import Session as OrmSession, aliased
from sqlalchemy.sql.elements import ColumnElement

from base.errors import LabelError, NotFound
from datapool.db import iso, utcnow
from datapool.models import Label, Session, Turn

KINDS = ("thumb", "override", "exclude", "correction", "tag", "untag", "note")
TAG_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}$")
MAX_TEXT = 64 * 1024
#: the values of the trainer's and the UI's ``labels`` filter (``tag:NAME`` too)
FILTERS = ("labeled", "unlabeled", "excluded", "thumb-up", "thumb-down", "override", "correction")


def validate(kind: str, value: Any) -> Any:
    """The value as stored; raises :class:`LabelError` for a value the kind does not take."""
    if kind not in KINDS:
        raise LabelError(f"unknown label kind {_shown(kind)}; use one of {', '.join(KINDS)}")
    if value is None or (kind in ("tag", "untag") and isinstance(value, str) and not value.strip()):
        if kind in ("tag", "untag"):
            raise LabelError("Type a tag first: 1-64 letters, digits, '_', '.', ':' or '-', e.g. wrong-tool")
        return None
    if kind == "thumb":
        if value in (1, -1, "1", "-1", "+1", "up", "down") and not isinstance(value, bool):
            return {"up": 1, "down": -1}.get(value, None) or int(value)
        raise LabelError(f"A thumb is 1 (up) or -1 (down), not {_shown(value)}")
    if kind == "override":
        try:
            r = float(value)
        except (TypeError, ValueError):
            raise LabelError(f"The score override must be a number from -1 to 1 (e.g. -0.5), not {_shown(value)}; "
                             "leave it empty to withdraw the override") from None
        if isinstance(value, bool) or not math.isfinite(r) or not -1.0 <= r <= 1.0:
            raise LabelError(f"The score override must be a number from -1 to 1 (e.g. -0.5), not {_shown(value)}")
        return r
    if kind == "exclude":
        if isinstance(value, bool):
            return value
        if value in ("true", "1", 1, "on"):
            return True
        if value in ("false", "0", 0, "off"):
            return False
        raise LabelError(f"exclude is true or false, not {_shown(value)}")
    if not isinstance(value, str):
        raise LabelError(f"{kind} is text, not {type(value).__name__}")
    if kind in ("tag", "untag"):
        tag = value.strip()
        if not TAG_RE.match(tag):
            why = (f"it is {len(tag)} characters long" if len(tag) > 64
                   else "it has a space" if any(c.isspace() for c in tag)
                   else "it must start with a letter or digit" if not tag[0].isalnum() or not tag[0].isascii()
                   else "it has a character other than letters, digits, '_', '.', ':' or '-'")
            raise LabelError(f"Tag {_shown(tag)} is not allowed: {why}. A tag is 1-64 letters, digits, "
                             "'_', '.', ':' or '-', starting with a letter or digit (e.g. wrong-tool)")
        return tag
    text = value.strip()
    if not text:
        return None  # an emptied note or correction withdraws it
    if len(text) > MAX_TEXT:
        raise LabelError(f"The {kind} is {len(text)} characters long; at most {MAX_TEXT} are kept")
    return text


def _shown(value: Any) -> str:
    """A rejected value as an error message quotes it: short, so a pasted essay stays out."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "…"


def add_label(db: OrmSession, *, kind: str, value: Any, author: str, turn_id: str | None = None,
              session_id: str | None = None) -> Label:
    """Store one label on a turn or a session (exactly one). Raises :class:`LabelError`, or
    :class:`NotFound` when the target does not exist."""
    if (turn_id is None) == (session_id is None):
        raise LabelError("a label names a turn or a session")
    if kind == "correction" and session_id is not None:
        raise LabelError("a corrected reply belongs to one turn, not a session")
    value = validate(kind, value)
    if turn_id is not None and db.get(Turn, turn_id) is None:
        raise NotFound(f"no turn {turn_id!r}")
    if session_id is not None and db.get(Session, session_id) is None:
        raise NotFound(f"no session {session_id!r}")
    row = Label(turn_id=turn_id, session_id=session_id, kind=kind, value=value, author=author[:256],
                created_at=utcnow())
    db.add(row)
    db.flush()
    return row


def label_dict(row: Label) -> dict[str, Any]:
    return {"id": row.id, "turn_id": row.turn_id, "session_id": row.session_id, "kind": row.kind,
            "value": row.value, "author": row.author, "created_at": iso(row.created_at)}


def in_force(rows: Iterable[Label]) -> dict[str, Any]:
    """What a target's labels (any order) say now: one value per kind, tags as a sorted list."""
    state: dict[str, Any] = {"tags": []}
    tags: set[str] = set()
    for row in sorted(rows, key=lambda r: r.id):
        if row.kind == "tag":
            tags.add(row.value)
        elif row.kind == "untag":
            tags.discard(row.value)
        else:
            state[row.kind] = row.value
            state[f"{row.kind}_by"] = row.author
    state["tags"] = sorted(tags)
    return {k: v for k, v in state.items() if v is not None}


def effective(turn: dict[str, Any], session: dict[str, Any]) -> dict[str, Any]:
    """A turn's labels with its session's filled in where the turn has none of that kind."""
    out = {k: v for k, v in session.items() if k not in ("correction", "correction_by", "note", "note_by")}
    out.update({k: v for k, v in turn.items() if k != "tags"})
    out["tags"] = sorted(set(turn.get("tags", [])) | set(session.get("tags", [])))
    return out


def for_turns(db: OrmSession, turn_ids: Sequence[str]) -> dict[str, dict[str, Any]]:
    """``{turn_id: {"turn": in force, "session": in force, "effective": merged, "history": [...]}}``."""
    if not turn_ids:
        return {}
    sessions = dict(db.execute(select(Turn.id, Turn.session_id).where(Turn.id.in_(turn_ids))).all())
    rows = list(db.scalars(select(Label).where(or_(Label.turn_id.in_(turn_ids),
                                                   Label.session_id.in_(set(sessions.values()))))))
    by_turn: dict[str, list[Label]] = {}
    by_session: dict[str, list[Label]] = {}
    for r in rows:
        if r.turn_id is not None:
            by_turn.setdefault(r.turn_id, []).append(r)
        else:
            by_session.setdefault(r.session_id or "", []).append(r)
    out = {}
    for tid, sid in sessions.items():
        own, inherited = in_force(by_turn.get(tid, [])), in_force(by_session.get(sid, []))
        history = sorted(by_turn.get(tid, []), key=lambda r: r.id)
        out[tid] = {"turn": own, "session": inherited, "effective": effective(own, inherited),
                    "history": [label_dict(r) for r in history]}
    return out


def for_session(db: OrmSession, session_id: str) -> dict[str, Any]:
    rows = list(db.scalars(select(Label).where(Label.session_id == session_id).order_by(Label.id)))
    return {"state": in_force(rows), "history": [label_dict(r) for r in rows]}


def reward_overrides(db: OrmSession, turn_ids: Sequence[str]) -> dict[str, float]:
    """The rewards people set for these turns (turn label, else the session's)."""
    return {tid: float(v["effective"]["override"]) for tid, v in for_turns(db, turn_ids).items()
            if v["effective"].get("override") is not None}


def correction_for(db: OrmSession, turn_id: str) -> str | None:
    """The corrected reply in force for a turn, if a person wrote one."""
    row = db.scalars(select(Label).where(Label.turn_id == turn_id, Label.kind == "correction")
                     .order_by(Label.id.desc()).limit(1)).first()
    return row.value if row is not None and isinstance(row.value, str) else None


# --------------------------------------------------------------------------------------------
# SQL: conditions on a turn (its id and session id columns), for the trainer and the UI


def _latest(kind: str, target: ColumnElement[bool]) -> Any:
    return (select(cast(Label.value, Text)).where(Label.kind == kind, target)
            .order_by(Label.id.desc()).limit(1).correlate_except(Label).scalar_subquery())


def in_force_text(kind: str, turn_id: Any, session_id: Any) -> Any:
    """SQL: the JSON text of the label of *kind* in force for a turn (its own, else its session's)."""
    return func.coalesce(_latest(kind, Label.turn_id == turn_id), _latest(kind, Label.session_id == session_id))


def excluded(turn_id: Any, session_id: Any) -> ColumnElement[bool]:
    """SQL: a person excluded the turn (or its session) from training."""
    return func.coalesce(in_force_text("exclude", turn_id, session_id), "false") == "true"


def override_reward(turn_id: Any, session_id: Any) -> Any:
    """SQL: the reward a person set for the turn, or NULL."""
    return cast(in_force_text("override", turn_id, session_id), Float)


def _carries(kinds: Sequence[str], turn_id: Any, session_id: Any, *, sessions: bool = True) -> ColumnElement[bool]:
    """SQL: the turn (or, with *sessions*, its session) has a label of one of *kinds* at all. One
    uncorrelated ``IN`` over the few labelled turns (the database builds that set once), the
    cheap test that the exact, per-row conditions below are put behind. *session_id* is implied
    by *turn_id* here (the session's labels reach the turn through its row)."""
    ids = select(Label.turn_id).where(Label.kind.in_(kinds), Label.turn_id.is_not(None))
    if sessions:
        member = aliased(Turn)
        ids = ids.union_all(select(member.id).join(Label, Label.session_id == member.session_id)
                            .where(Label.kind.in_(kinds)))
    return turn_id.in_(ids)


def matches(spec: str, turn_id: Any, session_id: Any) -> ColumnElement[bool]:
    """SQL for one ``labels`` filter value (see :data:`FILTERS`, or ``tag:NAME``)."""
    on_target = or_(Label.turn_id == turn_id, Label.session_id == session_id)
    if spec == "labeled":
        return _carries(KINDS, turn_id, session_id)
    if spec == "unlabeled":
        return ~_carries(KINDS, turn_id, session_id)
    if spec == "excluded":
        return and_(_carries(["exclude"], turn_id, session_id), excluded(turn_id, session_id))
    if spec in ("thumb-up", "thumb-down"):
        return and_(_carries(["thumb"], turn_id, session_id),
                    in_force_text("thumb", turn_id, session_id) == ("1" if spec == "thumb-up" else "-1"))
    if spec == "override":
        return and_(_carries(["override"], turn_id, session_id),
                    in_force_text("override", turn_id, session_id).is_not(None))
    if spec == "correction":
        return and_(_carries(["correction"], turn_id, session_id, sessions=False),
                    _latest("correction", Label.turn_id == turn_id).is_not(None))
    if spec.startswith("tag:") and TAG_RE.match(spec[4:]):
        value = f'"{spec[4:]}"'
        removed = aliased(Label)
        # a tag row on the target with no later untag of the same tag on the same target
        return and_(_carries(["tag"], turn_id, session_id), exists().where(
            on_target, Label.kind == "tag", cast(Label.value, Text) == value, ~exists().where(
                removed.kind == "untag", cast(removed.value, Text) == value, removed.id > Label.id,
                or_(removed.turn_id == Label.turn_id, removed.session_id == Label.session_id))))
    raise LabelError(f"unknown labels filter {spec!r}; one of {', '.join(FILTERS)} or tag:NAME")


def check_filter(spec: str) -> str:
    """*spec* if it is a valid ``labels`` filter; raises :class:`LabelError` otherwise."""
    matches(spec, Turn.id, Turn.session_id)
    return spec


def all_of(specs: Iterable[str], turn_id: Any, session_id: Any) -> ColumnElement[bool]:
    return and_(True, *(matches(s, turn_id, session_id) for s in specs))
