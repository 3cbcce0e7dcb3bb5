"""From pool rows to token samples.

White-box turns are used exactly as vLLM produced them: the stored ``prompt_token_ids``,
sampled ``token_ids`` and behaviour logprobs. Black-box turns (text only) are re-rendered with
the policy's chat template and only the assistant reply is trained. For white-box turns both
paths agree: rendering the stored messages gives vLLM's own prompt ids (tested).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session as OrmSession

from datapool.labels import reward_overrides
from datapool.siblings import siblings_of as sibling_rows
from datapool.models import Judgement, Session, Turn
from datapool.token_mask import placeholder_positions
from base.vocab import CaptureKind, TurnKind


@dataclass
class Sample:
    turn_id: str
    session_id: str
    group_id: str | None
    step_index: int  # the turn's position among its session's main turns
    prompt_ids: list[int]
    response_ids: list[int]
    behaviour_logprobs: list[float] | None  # None: black-box; the trainer uses its own (ratio 1)
    teacher_logprobs: list[float] | None
    reward: float | None  # r_t: the majority (or a person's rating)
    integrated_reward: float | None  # O + mean votes, when the session has an outcome
    capture: str
    # response positions of redacted text (datapool.token_mask): no loss weight there
    masked: tuple[int, ...] = ()
    # top-k OPD: per response position the teacher's k most likely tokens and their log-probs
    teacher_topk_ids: list[list[int]] | None = None
    teacher_topk_logprobs: list[list[float]] | None = None
    # a shadow sibling's original turn (datapool.siblings): trained in its original's group
    sibling_of: str | None = None

    def loss_weights(self) -> list[float]:
        """1 for each response token trained on, 0 where redacted text was masked."""
        weights = [1.0] * len(self.response_ids)
        for p in self.masked:
            if 0 <= p < len(weights):
                weights[p] = 0.0
        return weights


def render_prompt_ids(tokenizer: Any, messages: Sequence[dict[str, Any]], tools: Any = None) -> list[int]:
    """The policy's chat template applied to ``messages``, ready for the assistant's reply."""
    ids = tokenizer.apply_chat_template(list(messages), tools=tools, add_generation_prompt=True,
                                        tokenize=True, return_dict=False)
    return list(ids)


def render_reply_ids(tokenizer: Any, messages: Sequence[dict[str, Any]], reply: dict[str, Any],
                     tools: Any = None, *, finished: bool = True) -> tuple[list[int], list[int]]:
    """(prompt ids, reply ids) of a black-box turn: the reply's tokens as the template writes
    them after the prompt, up to and including the end-of-turn token — which a reply cut off
    by max_tokens (``finished=False``) never produced, so it is left out."""
    prompt = render_prompt_ids(tokenizer, messages, tools)
    message = {"role": "assistant", "content": reply.get("content") or ""}
    if reply.get("tool_calls"):
        message["tool_calls"] = reply["tool_calls"]
    full = list(tokenizer.apply_chat_template([*messages, message], tools=tools, tokenize=True,
                                              return_dict=False))
    if full[: len(prompt)] != prompt:
        raise ValueError("the chat template does not render the reply after the prompt it renders alone")
    response = full[len(prompt):]
    eos = tokenizer.eos_token_id
    if eos in response:
        # what follows end-of-turn is template glue
        response = response[: response.index(eos) + (1 if finished else 0)]
    return prompt, response


def load_samples(db: OrmSession, turn_ids: Sequence[str], tokenizer: Any = None, *,
                 siblings: bool = True) -> list[Sample]:
    """Samples for these turns, in the order given. Black-box turns need ``tokenizer``.

    With *siblings*, each turn's scored shadow siblings (``datapool.siblings``) follow the
    turns, and a turn that has any forms a group with them (``group_id`` ``siblings:<turn
    id>``): binary RL then standardizes their rewards against each other (GRPO) rather than
    against the batch. Siblings are never leased themselves; they are trained with their
    original, once per pass."""
    turn_ids = list(turn_ids)
    shadow = sibling_rows(db, turn_ids, scored=True) if siblings else {}
    extra = [sid for tid in turn_ids for sid in shadow.get(tid, [])]
    out = _load(db, turn_ids + extra, tokenizer)
    steps = {s.turn_id: s.step_index for s in out}
    for s in out:
        if s.sibling_of is not None or s.turn_id in shadow:
            s.group_id = f"siblings:{s.sibling_of or s.turn_id}"
        if s.sibling_of is not None:
            s.step_index = steps.get(s.sibling_of, s.step_index)
    return out


def _load(db: OrmSession, turn_ids: Sequence[str], tokenizer: Any) -> list[Sample]:
    turns = {t.id: t for t in db.scalars(select(Turn).where(Turn.id.in_(turn_ids)))}
    judgements = {j.turn_id: j for j in db.scalars(select(Judgement).where(Judgement.turn_id.in_(turn_ids)))}
    sessions = {s.id: s for s in db.scalars(select(Session).where(
        Session.id.in_({t.session_id for t in turns.values()})))}
    positions: dict[str, int] = {}
    for sid in sessions:
        ids = db.scalars(select(Turn.id).where(Turn.session_id == sid, Turn.turn_type == TurnKind.MAIN)
                         .order_by(Turn.created_at, Turn.id)).all()
        positions.update({tid: i for i, tid in enumerate(ids)})
    overrides = reward_overrides(db, list(turn_ids))  # a person's score replaces the judge's
    out = []
    for tid in turn_ids:
        t, j = turns[tid], judgements.get(tid)
        if t.capture == CaptureKind.WHITE_BOX and t.prompt_token_ids and t.token_ids:
            prompt, response, behaviour = list(t.prompt_token_ids), list(t.token_ids), list(t.logprobs or [])
            masked = tuple((t.redaction or {}).get("reply") or ())
        else:
            if tokenizer is None:
                raise ValueError(f"turn {tid} is black-box: re-rendering it needs the policy's tokenizer")
            choice = ((t.response or {}).get("choices") or [{}])[0]
            prompt, response = render_reply_ids(tokenizer, t.request.get("messages") or [],
                                                choice.get("message") or {}, t.request.get("tools"),
                                                finished=choice.get("finish_reason") != "length")
            behaviour = None
            # the reply as stored says [REDACTED:...] where text was taken out: never learnt to say
            masked = tuple(placeholder_positions([tokenizer.decode([i]) for i in response])) if t.redaction else ()
        teacher = list(j.teacher_logprobs) if j is not None and j.teacher_logprobs else None
        top_ids = j.teacher_topk_ids if j is not None and j.teacher_topk_ids else None
        top_lps = j.teacher_topk_logprobs if j is not None and j.teacher_topk_logprobs else None
        if not (top_ids and top_lps and len(top_ids) == len(top_lps) == len(response)):
            top_ids = top_lps = None
        out.append(Sample(
            turn_id=tid, session_id=t.session_id, group_id=sessions[t.session_id].group_id,
            step_index=positions.get(tid, 0), prompt_ids=prompt, response_ids=response,
            behaviour_logprobs=behaviour if behaviour and len(behaviour) == len(response) else None,
            teacher_logprobs=teacher if teacher and len(teacher) == len(response) else None,
            reward=overrides.get(tid, j.reward if j else None), integrated_reward=j.integrated_reward if j else None,
            capture=t.capture, masked=masked,
            teacher_topk_ids=[list(x) for x in top_ids] if top_ids else None,
            teacher_topk_logprobs=[list(x) for x in top_lps] if top_lps else None,
            sibling_of=t.sibling_of,
        ))
    return out
