"""Whether to trust the judge, measured on live data: its votes against people's labels, the
hint-quality gate's acceptance rate, and what both did to training (the admin UI's judge page).

**A person's verdict** on a turn is, in this order: the turn's own score override in force
(its sign), else its own thumb in force, else the latest rating posted as feedback
(``votes.kind = "feedback"``). Session-wide labels are left out: a session's thumb says how the
whole conversation went, not whether this one reply was right. A verdict of 0 (an override of
0, a neutral rating) agrees only with a 0 vote.

**Agreement** is counted per judge (the model or python path that voted, ``votes.judge``) and
prompt version: every vote on a turn with a verdict (a vote agrees when it equals the
verdict's sign; unparsable votes are counted apart, never as agreement), and every such turn's
majority of that judge's votes (:func:`majority`; a tie has none).

**The hint gate** (``scoring.judge.hint_is_valid``) sees a judgement's hint when a
vote of the majority (any vote, for a tie) gave one and no person wrote one (a corrected reply
or a feedback hint are never gated). Such a judgement kept its hint (``hint_source = "prm"``)
or had it dropped (no hint): the acceptance rate is kept / seen. With the gate off every hint
is kept.

**Effect on training**: of the turns a training step used (an acked lease), how many were
trained on the judge's reward where a person's verdict disagreed with it in sign (and how many
a person's override corrected before training: the override replaces the reward), how many
were OPD samples from a judge's hint (teacher log-probs under it), and how many had their
judge hint dropped by the gate (no OPD signal from them).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import and_, case, exists, func, or_, select
from sqlalchemy.orm import Session as OrmSession

from datapool.db import chunked
from datapool.labels import in_force
from datapool.models import Judgement, Label, TrainingLease, Turn, Vote
from base.vocab import HintSource, VoteKind

#: how many disagreeing turns the page lists per judge
EXAMPLES = 10


def sign(value: float | int | None) -> int | None:
    if value is None:
        return None
    return (value > 0) - (value < 0)


def majority(values: Sequence[int | None]) -> int | None:
    """The most frequent parsed vote; None for a tie or when none parsed (as the scorer's tally)."""
    ranked = Counter(v for v in values if v is not None).most_common()
    if not ranked or (len(ranked) > 1 and ranked[0][1] == ranked[1][1]):
        return None
    return ranked[0][0]


def verdicts(db: OrmSession) -> dict[str, int]:
    """A person's verdict (−1, 0, +1) per turn that has one (see the module docstring)."""
    out: dict[str, int] = {}
    for tid, value in db.execute(select(Vote.turn_id, Vote.value).where(
            Vote.kind == VoteKind.FEEDBACK, Vote.value.is_not(None)).order_by(Vote.id)):
        out[tid] = sign(value)  # type: ignore[assignment]
    rows: dict[str, list[Label]] = {}
    for label in db.scalars(select(Label).where(Label.turn_id.is_not(None), Label.kind.in_(("thumb", "override")))):
        rows.setdefault(label.turn_id, []).append(label)  # type: ignore[arg-type]
    for tid, labels in rows.items():
        state = in_force(labels)
        for kind in ("override", "thumb"):
            value = state.get(kind)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                out[tid] = sign(value)  # type: ignore[assignment]
                break
    return out


@dataclass
class JudgeAgreement:
    """One judge and prompt version against people's verdicts."""

    judge: str
    prompt_version: str | None
    turns: int = 0  # turns it voted on
    votes: int = 0
    labelled_turns: int = 0  # of those, turns with a person's verdict
    labelled_votes: int = 0  # its votes on them
    unparsed_votes: int = 0  # of those, unparsable (counted apart)
    agreeing_votes: int = 0
    majority_turns: int = 0  # labelled turns where its votes have a majority
    agreeing_majorities: int = 0
    #: (judge's vote, person's verdict) -> votes, for parsed votes on labelled turns
    confusion: dict[tuple[int, int], int] = field(default_factory=dict)
    #: turns where its majority and the person disagree: (turn id, session id, majority, verdict)
    disagreements: list[tuple[str, str, int, int]] = field(default_factory=list)
    disagreeing_turns: int = 0

    @property
    def vote_agreement(self) -> float | None:
        parsed = self.labelled_votes - self.unparsed_votes
        return self.agreeing_votes / parsed if parsed else None

    @property
    def majority_agreement(self) -> float | None:
        return self.agreeing_majorities / self.majority_turns if self.majority_turns else None


def agreement(db: OrmSession, examples: int = EXAMPLES) -> list[JudgeAgreement]:
    """Per judge and prompt version (most votes first): its votes and majorities against
    people's verdicts. A judge without labelled turns has ``labelled_turns == 0``."""
    out: dict[tuple[str, str | None], JudgeAgreement] = {}
    for judge, version, turns, votes in db.execute(
            select(Vote.judge, Vote.prompt_version, func.count(func.distinct(Vote.turn_id)), func.count())
            .where(Vote.kind == VoteKind.PRM).group_by(Vote.judge, Vote.prompt_version)):
        out[judge, version] = JudgeAgreement(judge, version, turns=turns, votes=votes)
    people = verdicts(db)
    by_turn: dict[tuple[str, str | None, str], list[int | None]] = {}
    sessions: dict[str, str] = {}
    for ids in chunked(list(people)):
        for tid, sid, judge, version, value in db.execute(
                select(Vote.turn_id, Turn.session_id, Vote.judge, Vote.prompt_version, Vote.value)
                .join(Turn, Turn.id == Vote.turn_id)
                .where(Vote.kind == VoteKind.PRM, Vote.turn_id.in_(ids)).order_by(Vote.id)):
            by_turn.setdefault((judge, version, tid), []).append(value)
            sessions[tid] = sid
    for (judge, version, tid), values in sorted(by_turn.items(), key=lambda kv: kv[0][2]):
        row, person = out[judge, version], people[tid]
        row.labelled_turns += 1
        row.labelled_votes += len(values)
        for v in values:
            if v is None:
                row.unparsed_votes += 1
                continue
            row.agreeing_votes += v == person
            row.confusion[v, person] = row.confusion.get((v, person), 0) + 1
        m = majority(values)
        if m is not None:
            row.majority_turns += 1
            row.agreeing_majorities += m == person
            if m != person:
                row.disagreeing_turns += 1
                if len(row.disagreements) < examples:
                    row.disagreements.append((tid, sessions[tid], m, person))
    return sorted(out.values(), key=lambda r: (-r.votes, r.judge, r.prompt_version or ""))


def _gate_saw() -> Any:
    """SQL on ``Judgement``: a vote of its judge and prompt version that the gate would have
    weighed — one with a hint, of the majority (any, for a tie) — and no person's hint."""
    return and_(
        or_(Judgement.hint_source.is_(None), Judgement.hint_source == HintSource.PRM),
        exists().where(Vote.turn_id == Judgement.turn_id, Vote.kind == VoteKind.PRM, Vote.hint.is_not(None),
                       Vote.hint != "", Vote.judge == Judgement.judge,
                       Vote.prompt_version.is_not_distinct_from(Judgement.prompt_version),
                       or_(Judgement.prm_reward.is_(None), Vote.value == Judgement.prm_reward)))


def _count(cond: Any) -> Any:
    """SQL: how many rows of the group meet *cond*."""
    return func.sum(case((cond, 1), else_=0))


@dataclass
class GateCounts:
    judge: str
    prompt_version: str | None
    seen: int = 0  # judgements whose judge hint met the gate
    kept: int = 0

    @property
    def acceptance(self) -> float | None:
        return self.kept / self.seen if self.seen else None


def hint_gate(db: OrmSession) -> list[GateCounts]:
    """Per judge and prompt version of the judgements: judge hints the gate saw and kept."""
    kept = _count(Judgement.hint_source == HintSource.PRM)
    rows = db.execute(select(Judgement.judge, Judgement.prompt_version, func.count(), kept)
                      .where(Judgement.judge.is_not(None), _gate_saw())
                      .group_by(Judgement.judge, Judgement.prompt_version))
    return sorted((GateCounts(j, v, seen=n, kept=int(k or 0)) for j, v, n, k in rows),
                  key=lambda g: (-g.seen, g.judge, g.prompt_version or ""))


@dataclass
class TrainingEffect:
    judge: str
    prompt_version: str | None
    trained: int = 0  # turns a training step used, scored by this judge
    labelled: int = 0  # of those, with a person's verdict
    against_person: int = 0  # trained on a reward whose sign the person's verdict contradicts
    corrected: int = 0  # the judge contradicted the person, and the person's override was trained instead
    opd_judge_hint: int = 0  # OPD samples (teacher log-probs) under a judge's hint
    opd_person_hint: int = 0  # ... under a person's corrected reply or feedback hint
    gate_dropped: int = 0  # judge hints the gate dropped: trained without an OPD signal


def _trained() -> Any:
    return select(TrainingLease.turn_id).where(TrainingLease.acked_at.is_not(None)).distinct()


def training_effect(db: OrmSession, people: dict[str, int] | None = None) -> list[TrainingEffect]:
    """Per judge and prompt version: what its rewards and hints did to the turns trained on."""
    people = verdicts(db) if people is None else people
    trained = Judgement.turn_id.in_(_trained())
    has_teacher = Judgement.teacher_logprobs.is_not(None)

    out: dict[tuple[str, str | None], TrainingEffect] = {}
    for judge, version, n, judge_hint, person_hint in db.execute(
            select(Judgement.judge, Judgement.prompt_version, func.count(),
                   _count(and_(has_teacher, Judgement.hint_source == HintSource.PRM)),
                   _count(and_(has_teacher, Judgement.hint_source.in_((HintSource.LABEL, HintSource.FEEDBACK)))))
            .where(Judgement.judge.is_not(None), trained).group_by(Judgement.judge, Judgement.prompt_version)):
        out[judge, version] = TrainingEffect(judge, version, trained=n, opd_judge_hint=int(judge_hint or 0),
                                             opd_person_hint=int(person_hint or 0))
    for judge, version, n in db.execute(
            select(Judgement.judge, Judgement.prompt_version, func.count())
            .where(Judgement.judge.is_not(None), trained, _gate_saw(), Judgement.hint.is_(None))
            .group_by(Judgement.judge, Judgement.prompt_version)):
        out[judge, version].gate_dropped = n
    for ids in chunked(list(people)):
        for judge, version, tid, prm, used in db.execute(
                select(Judgement.judge, Judgement.prompt_version, Judgement.turn_id, Judgement.prm_reward,
                       Turn.effective_reward).join(Turn, Turn.id == Judgement.turn_id)
                .where(Judgement.judge.is_not(None), trained, Judgement.turn_id.in_(ids))):
            row, person = out[judge, version], people[tid]
            row.labelled += 1
            if used is not None and sign(used) != person:
                row.against_person += 1
            elif prm is not None and sign(prm) != person:
                row.corrected += 1
    return sorted(out.values(), key=lambda r: (-r.trained, r.judge, r.prompt_version or ""))


def summary(db: OrmSession) -> dict[str, Any]:
    """Everything the judge page shows."""
    people = verdicts(db)
    return {"agreement": agreement(db), "gate": hint_gate(db), "training": training_effect(db, people),
            "verdicts": len(people)}
