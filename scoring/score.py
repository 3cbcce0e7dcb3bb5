"""Turning a turn and its next state into signal: votes, reward, hint, teacher logprobs.

Everything here is idempotent. Each vote has a dedupe key, so a scoring task delivered twice,
or killed half-way and run again, asks the judge only for the votes still missing and never
stores one twice. Which turns must be scored is the pool's business (``datapool.judgements``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from sqlalchemy import Engine, select, update
from sqlalchemy.orm import Session as OrmSession

from base.errors import JudgeError, JudgeRefused, TeacherError
from datapool.db import dialect_insert, utcnow
from datapool.judgements import effective_next_state
from datapool.labels import correction_for
from datapool.models import Judgement, Session, Turn
from datapool.models import Vote as VoteRow
from datapool.queries import turn_view
from scoring.judge import CONTEXT_WORDS, Judge, Vote, choose_hint, hint_is_valid, tally
from scoring.teacher import teacher_logprobs, teacher_messages
from base.vocab import (
    CaptureKind,
    DeadReason,
    Endpoint,
    HintSource,
    JudgementStatus,
    TurnKind,
    TurnStatus,
    VoteKind,
)

log = logging.getLogger("nextstate.scoring")


@dataclass(frozen=True)
class TeacherConfig:
    api_base: str  # vLLM …/v1 serving the policy's versions
    api_key: str | None = None
    #: also keep the teacher's top-k tokens per response position (top-k OPD); 0: the sampled token only
    top_k: int = 0


def _store_vote(engine: Engine, turn_id: str, judge: Judge, index: int, vote: Vote) -> None:
    with OrmSession(engine) as db, db.begin():
        stmt = dialect_insert(db)(VoteRow).values(
            turn_id=turn_id, kind=VoteKind.PRM, dedupe_key=f"prm:{judge.name}:{judge.prompt_version}:{index}",
            judge=judge.name, prompt_version=judge.prompt_version, vote_index=index, value=vote.value,
            rationale=vote.rationale or None, hint=vote.hint, raw=vote.raw, created_at=utcnow())
        db.execute(stmt.on_conflict_do_nothing())


async def _collect_votes(engine: Engine, judge: Judge, turn_id: str, view: dict[str, Any],
                         state: dict[str, Any], missing: Sequence[int]) -> None:
    async def one(i: int) -> None:
        vote = await judge.vote(view, state, i)
        await asyncio.to_thread(_store_vote, engine, turn_id, judge, i, vote)  # kept even if a sibling fails

    results = await asyncio.gather(*(one(i) for i in missing), return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    refused = [e for e in errors if isinstance(e, JudgeRefused)]
    if refused:
        raise refused[0]
    if errors:
        raise JudgeError(f"{len(errors)} of {len(missing)} votes failed: {errors[0]!r}") from errors[0]


def score_turn(engine: Engine, turn_id: str, judge: Judge, m: int,
               teacher: TeacherConfig | None = None, *, hint_gate: bool = True) -> str:
    """Score one turn; returns the judgement's status. Raises JudgeError to be retried,
    JudgeRefused to be dead-lettered at once. *hint_gate*: see :func:`aggregate`."""
    with OrmSession(engine) as db, db.begin():
        turn = db.get(Turn, turn_id)
        if turn is None:
            return "missing"
        judgement = db.get(Judgement, turn_id) or Judgement(turn_id=turn_id, status=JudgementStatus.PENDING, attempts=0)
        db.add(judgement)
        judgement.attempts = (judgement.attempts or 0) + 1
        judgement.updated_at = utcnow()
        # a sibling is scored like its original, against the same next state (datapool.siblings)
        if turn.turn_type not in (TurnKind.MAIN, TurnKind.SIBLING) or turn.status != TurnStatus.OK:
            judgement.status = JudgementStatus.SKIPPED
            return JudgementStatus.SKIPPED
        session = db.get(Session, turn.session_id)
        assert session is not None
        state = effective_next_state(db, turn, session)
        if state is None:
            judgement.status = JudgementStatus.WAITING
            return JudgementStatus.WAITING
        have = set(db.scalars(select(VoteRow.vote_index).where(
            VoteRow.turn_id == turn_id, VoteRow.kind == VoteKind.PRM, VoteRow.judge == judge.name,
            VoteRow.prompt_version.is_(None) if judge.prompt_version is None
            else VoteRow.prompt_version == judge.prompt_version)))
        missing = [i for i in range(m) if i not in have]
        view = turn_view(turn)

    if missing:
        asyncio.run(_collect_votes(engine, judge, turn_id, view, state, missing))
    return aggregate(engine, turn_id, judge, teacher, hint_gate=hint_gate)


def aggregate(engine: Engine, turn_id: str, judge: Judge, teacher: TeacherConfig | None, *,
              hint_gate: bool = True) -> str:
    """Fold a turn's stored votes into its judgement (reward, hint); fetch teacher logprobs for
    a hinted white-box chat turn. Returns the judgement's status. *hint_gate*: a judge's hint is
    kept only when :func:`scoring.judge.hint_is_valid` (grounded in the next state or
    agreed by the votes); people's hints are always kept."""
    with OrmSession(engine) as db, db.begin():
        turn = db.get(Turn, turn_id)
        session = db.get(Session, turn.session_id) if turn else None
        judgement = db.get(Judgement, turn_id)
        assert turn is not None and session is not None and judgement is not None
        votes = db.scalars(select(VoteRow).where(VoteRow.turn_id == turn_id).order_by(VoteRow.id)).all()
        prm = [v for v in votes if v.kind == VoteKind.PRM and v.judge == judge.name
               and v.prompt_version == judge.prompt_version]
        feedback = [v for v in votes if v.kind == VoteKind.FEEDBACK]
        t = tally([v.value for v in prm])
        judgement.judge, judgement.prompt_version = judge.name, judge.prompt_version
        judgement.prm_reward = float(t.majority) if t.majority is not None else None
        judgement.vote_mean = t.mean
        rated = [v.value for v in feedback if v.value is not None]
        # a person's rating outranks the judges; the latest rating counts
        judgement.reward = float(rated[-1]) if rated else judgement.prm_reward
        judgement.status = JudgementStatus.SCORED if rated else t.status
        feedback_hints = [v.hint for v in feedback if v.hint]
        correction = correction_for(db, turn_id)
        if correction:  # a person's corrected reply is the OPD target before any other hint
            hint, source = correction, HintSource.LABEL
        elif feedback_hints:
            hint, source = feedback_hints[-1], HintSource.FEEDBACK
        else:
            agreeing = [v.hint for v in prm if v.hint and (t.majority is None or v.value == t.majority)]
            hint, source = choose_hint(agreeing), HintSource.PRM
            if hint is not None and hint_gate and not hint_is_valid(
                    hint, effective_next_state(db, turn, session), agreeing):
                log.info("turn %s: judge hint dropped by the hint-quality gate: %.80r", turn_id, hint)
                hint = None
        if hint != judgement.hint:
            judgement.teacher_logprobs = judgement.teacher_prompt_ids = None
            judgement.teacher_topk_ids = judgement.teacher_topk_logprobs = None
        judgement.hint, judgement.hint_source = hint, (source if hint else None)
        judgement.integrated_reward = (session.outcome + t.mean
                                       if session.outcome is not None and t.mean is not None else None)
        need_teacher = (hint and teacher is not None
                        and (judgement.teacher_logprobs is None or (teacher.top_k and judgement.teacher_topk_ids is None))
                        and turn.capture == CaptureKind.WHITE_BOX and turn.endpoint == Endpoint.CHAT and turn.token_ids)
        request = dict(turn.request or {})
        token_ids, model = list(turn.token_ids or []), turn.upstream_model
        judgement.last_error = None
        judgement.updated_at = utcnow()
        status = judgement.status

    if need_teacher:
        assert teacher is not None and hint is not None and model is not None
        try:
            result = asyncio.run(_teacher(teacher, model, request, hint, token_ids))
        except TeacherError as exc:
            if exc.final:  # the teacher refused the request itself: dead now, not after every retry
                reason = (DeadReason.CONTEXT_WINDOW_EXCEEDED if CONTEXT_WORDS.search(str(exc))
                          else DeadReason.CLIENT_ERROR)
                raise JudgeRefused(reason, f"teacher logprobs: {exc}") from exc
            raise JudgeError(f"teacher logprobs: {exc}") from exc
        except httpx.HTTPError as exc:
            raise JudgeError(f"teacher logprobs: {exc}") from exc
        with OrmSession(engine) as db, db.begin():
            db.execute(update(Judgement).where(Judgement.turn_id == turn_id, Judgement.hint == hint).values(
                teacher_prompt_ids=result.prompt_token_ids, teacher_logprobs=result.logprobs,
                teacher_topk_ids=result.topk_ids, teacher_topk_logprobs=result.topk_logprobs))
    return status


async def _teacher(cfg: TeacherConfig, model: str, request: dict[str, Any], hint: str,
                   token_ids: list[int]) -> Any:
    async with httpx.AsyncClient(timeout=120) as http:
        return await teacher_logprobs(http, cfg.api_base, model,
                                      teacher_messages(request.get("messages") or [], hint), token_ids,
                                      tools=request.get("tools"), api_key=cfg.api_key, top_k=cfg.top_k)

