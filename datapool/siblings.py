"""Shadow siblings: alternative replies to a captured turn, so one online turn gets a group.

A live turn is a single sample: binary RL has nothing to compare its reward with. When the
policy server has room (``scoring.siblings`` decides and asks it), a finished main
turn is resampled k times from its exact prompt token ids, and each reply is stored here as a
**sibling**: a turn of its own (``turn_type = "sibling"``, ``sibling_of`` = the original) in the
same session, with the original's request, parent and time, and the original's next state —
so the judge scores it against the same next state. Siblings are never sent to anyone: no
client asked for them, they have no response id, link hash or continuation, so no request can
continue them; sessions' history (``datapool.queries.get_session``) lists them apart, the
admin UI marks them, leases never hand them out, and the stitcher, the live monitor and the
eval gate only look at main turns. They live and die with their session (forget, retention:
they carry the original's time).

The trainer (``trainer.samples.load_samples``) adds a leased turn's scored siblings to its
batch, the original and its siblings as one group, whose rewards binary RL standardizes
against each other (GRPO) instead of against the batch.

Which turns are resampled (:func:`candidates`): white-box chat main turns that succeeded,
have a next state, carry prompt and reply token ids, had nothing redacted (a sibling's text
does not pass the gateway's redaction; its prompt ids are the redacted ones, but nothing is
left to chance), made no tool calls (raw completions are not parsed into tool calls), are not
in an eval session or a task group (offline rollouts have real groups), and have no sibling yet.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import exists, select
from sqlalchemy.orm import Session as OrmSession, aliased

from datapool.db import chunked
from datapool.judgements import mark_pending
from datapool.models import Judgement, Session, Turn
from base.vocab import CaptureKind, Endpoint, SessionMode, TurnKind, TurnStatus

#: a sibling's reply is cut at this many tokens when the original request set no limit
DEFAULT_MAX_TOKENS = 512


def candidates(db: OrmSession, *, limit: int, turn_ids: Sequence[str] | None = None,
               since: datetime | None = None) -> list[str]:
    """Turns that may be resampled (see the module docstring), newest first; only among
    *turn_ids* when given, only those created at or after *since* when given."""
    sibling = aliased(Turn)
    # tool calls are in the JSON: read with the row, filtered here
    q = (select(Turn.id, Turn.response[("choices", 0, "message", "tool_calls")]).join(Session, Session.id == Turn.session_id)
         .where(Turn.turn_type == TurnKind.MAIN, Turn.status == TurnStatus.OK, Turn.capture == CaptureKind.WHITE_BOX,
                Turn.endpoint == Endpoint.CHAT, Turn.next_state.is_not(None), Turn.prompt_token_ids.is_not(None),
                Turn.token_ids.is_not(None), Turn.redaction.is_(None), Session.mode != SessionMode.EVAL,
                Session.group_id.is_(None), ~exists().where(sibling.sibling_of == Turn.id)))
    if since is not None:
        q = q.where(Turn.created_at >= since)
    if turn_ids is not None:
        q = q.where(Turn.id.in_(list(turn_ids)))
    rows = db.execute(q.order_by(Turn.created_at.desc(), Turn.id.desc()).limit(limit * 2)).all()
    return [tid for tid, calls in rows if not calls][:limit]


def sampling_of(turn: Turn) -> dict[str, Any]:
    """The original request's sampling settings that a resample repeats: temperature (1.0 when
    it set none), top_p, and its output limit (``max_tokens``/``max_completion_tokens``, else
    :data:`DEFAULT_MAX_TOKENS`)."""
    req = turn.request or {}
    limit = req.get("max_completion_tokens") or req.get("max_tokens") or DEFAULT_MAX_TOKENS
    out: dict[str, Any] = {"temperature": float(req["temperature"]) if req.get("temperature") is not None else 1.0,
                           "max_tokens": int(limit)}
    if req.get("top_p") is not None:
        out["top_p"] = float(req["top_p"])
    return out


def add_siblings(db: OrmSession, original: Turn, replies: Sequence[Any], *, model: str,
                 policy_version: str | None) -> list[str]:
    """Store each of *replies* (``text``, ``token_ids``, ``logprobs``, ``finish_reason``) as a
    sibling of *original*, sampled by *model* (a served name; *policy_version* the version it
    is), and mark them for scoring. Returns their ids; call in the transaction that stores them
    and send the scoring tasks after it commits."""
    ids = []
    for reply in replies:
        tid = str(uuid.uuid4())
        db.add(Turn(
            id=tid, session_id=original.session_id, parent_turn_id=original.parent_turn_id, sibling_of=original.id,
            turn_type=TurnKind.SIBLING, endpoint=original.endpoint, wire_format=original.wire_format,
            status=TurnStatus.OK, created_at=original.created_at, model=original.model, upstream_model=model,
            policy_version=policy_version, capture=CaptureKind.WHITE_BOX, request=original.request,
            response={"id": None, "model": model, "choices": [{
                "index": 0, "finish_reason": reply.finish_reason,
                "message": {"role": "assistant", "content": reply.text}}]},
            next_state=original.next_state, prompt_token_ids=list(original.prompt_token_ids or []),
            token_ids=list(reply.token_ids), logprobs=list(reply.logprobs),
            usage={"prompt_tokens": len(original.prompt_token_ids or []), "completion_tokens": len(reply.token_ids),
                   "total_tokens": len(original.prompt_token_ids or []) + len(reply.token_ids)}))
        ids.append(tid)
    db.flush()
    return mark_pending(db, ids)


def awaiting(db: OrmSession, turn_ids: Sequence[str]) -> list[str]:
    """Those of *turn_ids* whose siblings may still come: turns a worker would resample
    (:func:`candidates`: none yet) and turns with a sibling not scored yet (no reward and no teacher
    log-probs: what :func:`siblings_of` with *scored* leaves out). A turn that cannot have siblings
    (black-box, a tool call, redacted ...) is not awaited."""
    turn_ids = list(turn_ids)
    pending = set(candidates(db, limit=len(turn_ids), turn_ids=turn_ids)) if turn_ids else set()
    every, scored = siblings_of(db, turn_ids), siblings_of(db, turn_ids, scored=True)
    pending |= {tid for tid, sibs in every.items() if len(scored.get(tid, ())) < len(sibs)}
    return [tid for tid in turn_ids if tid in pending]


def siblings_of(db: OrmSession, turn_ids: Sequence[str], *, scored: bool = False) -> dict[str, list[str]]:
    """The siblings of each of *turn_ids* that has any (oldest id order); with *scored*, only
    those whose judgement has a reward or teacher log-probs (what the trainer can use)."""
    out: dict[str, list[str]] = {}
    for ids in chunked(list(turn_ids)):
        q = select(Turn.sibling_of, Turn.id).where(Turn.sibling_of.in_(ids))  # only add_siblings sets it
        if scored:
            q = q.join(Judgement, Judgement.turn_id == Turn.id).where(
                Judgement.reward.is_not(None) | Judgement.teacher_logprobs.is_not(None))
        for original, tid in db.execute(q.order_by(Turn.id)):
            out.setdefault(original, []).append(tid)
    return out
